"""voicepipe: does a voice pipeline answer inside the human turn budget, and what would change it?"""

__version__ = "0.1.0"

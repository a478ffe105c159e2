"""``python -m voicepipe``: the same command line as ``voicepipe``."""

from voicepipe.cli import main

main()

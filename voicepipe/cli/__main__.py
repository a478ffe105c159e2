"""``python -m voicepipe.cli``: the same command line as ``voicepipe``."""

from voicepipe.cli import main

main()

"""``python -m passes run [MODEL]``: the main job (:mod:`passes.flow.cli`); the installed
console command ``mutable-buffer-passes`` runs the same ``main``."""

import sys

from .flow.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m passes"))

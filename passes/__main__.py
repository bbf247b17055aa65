"""``python -m passes run [MODEL]``: the main job (:mod:`passes.flow.cli`); the installed
console command ``mutable-buffer-passes`` runs the same ``main``."""

import sys

from ._startup import interrupted_while_starting

try:
    from .flow.cli import main
except KeyboardInterrupt:  # Ctrl-C while the job's modules load: one line, as later on
    interrupted_while_starting()

if __name__ == "__main__":
    sys.exit(main(prog="python -m passes"))

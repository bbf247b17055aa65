"""``python -m passes run [MODEL]``: the main job (:mod:`passes.flow.cli`); the installed
console command ``mutable-buffer-passes`` runs the same ``main``."""

import sys

try:
    from .flow.cli import main
except KeyboardInterrupt:  # Ctrl-C while the job's modules load: one line, as later on
    print("interrupted (Ctrl-C) while starting", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main(prog="python -m passes"))

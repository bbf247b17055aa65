"""``python -m passes run [MODEL]``: the main job (:mod:`passes.flow.cli`)."""

import sys

from .flow.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m pass_manager replay FOLDER [--trust] [--pdb]``: see :func:`.replay.main`."""

import sys

from .replay import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

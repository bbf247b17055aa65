"""Ctrl-C while ``python -m passes`` starts.

Python imports this package before its ``__main__``, and torch takes seconds to load:
Ctrl-C meanwhile gets the main job's one line and status 130, not a traceback. Python sets
``sys.argv[0]`` to ``"-m"`` while it locates the module, which tells that run from an import
of the library (left as it is), as does the installed command's name. The job's ``main``
restores the default handler, and its stages name where Ctrl-C stopped them from then on.
"""

import os
import signal
import sys
from typing import Any

COMMAND = "mutable-buffer-passes"  # setup.cfg's console script


def interrupted_while_starting(signum: Any = None, frame: Any = None) -> None:
    """Say so in one line and exit with the main job's interrupted status."""
    print("interrupted (Ctrl-C) while starting", file=sys.stderr)
    raise SystemExit(130)


def quiet_start() -> None:
    """Handle SIGINT with :func:`interrupted_while_starting` (unless ignored, as in a
    background job of a script)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted_while_starting)


def started() -> None:
    """Give SIGINT back to Python (``KeyboardInterrupt``), if :func:`quiet_start` took it."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The installed command's script imports the package the same way, under its own name.
if sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == COMMAND:
    quiet_start()

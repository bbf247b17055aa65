"""Ctrl-C while ``python -m passes`` starts.

Python imports this package before its ``__main__``, and torch takes seconds to load:
Ctrl-C meanwhile gets the main job's one line and status 130, not a traceback. Python sets
``sys.argv[0]`` to ``"-m"`` while it locates the module, which tells that run from an import
of the library (left as it is); ``__main__`` restores the default handler once the job's
modules are loaded, and its stages name where Ctrl-C stopped them from then on.
"""

import signal
import sys
from typing import Any


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


if sys.argv[:1] == ["-m"]:
    quiet_start()

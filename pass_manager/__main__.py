"""Command line of the pass manager: ``python -m pass_manager replay FOLDER [--trust] [--pdb]``.

``replay`` loads a reproducer folder (written by a ``Reproducer`` instrument) and
runs its failing pass again on the saved program, with the same checks. Exit status: 1
when the pass fails (the output says whether with the recorded error), 0 when it no
longer fails, 2 when the folder cannot be replayed. A folder whose program or validation
file is pickled, or whose passes are defined outside this library (in your project or
tests), is replayed only with ``--trust``: reading it runs code from the folder.
"""

from __future__ import annotations

import argparse
import sys

from .instruments import PrintIR
from .replay import replay

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pass_manager", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    replay_parser = commands.add_parser("replay", help="rerun the failing pass of a reproducer")
    replay_parser.add_argument("folder", help="a folder written by a Reproducer")
    replay_parser.add_argument(
        "--trust", action="store_true",
        help="read pickled files and import the modules the folder names (runs code from the "
             "folder: only for a folder you made or whose author you trust)",
    )
    replay_parser.add_argument(
        "--pdb", action="store_true", help="start the debugger at the exception the pass raised"
    )
    replay_parser.add_argument(
        "--print-before", action="store_true", help="print the program the pass is given"
    )
    replay_parser.add_argument(
        "--print-after-failure", action="store_true",
        help="print what the pass changed before it failed",
    )
    args = parser.parse_args(argv)
    instruments = []
    if args.print_before or args.print_after_failure:
        instruments.append(
            PrintIR(before=args.print_before, after_failure=args.print_after_failure)
        )
    return replay(args.folder, trusted=args.trust, pdb=args.pdb, instruments=instruments)


if __name__ == "__main__":
    sys.exit(main())

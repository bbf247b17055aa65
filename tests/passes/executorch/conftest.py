"""The ExecuTorch tests need the ``executorch`` extra, which ``make test`` installs (so CI
runs them). A checkout without it does not collect this directory and says so in the
report header; ``tests/passes/test_executorch_extra.py`` checks the error users get then.
"""

from __future__ import annotations

import importlib.util

MISSING = importlib.util.find_spec("executorch") is None
if MISSING:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config) -> str | None:
    if MISSING:
        return "executorch extra not installed: tests/passes/executorch not collected"
    return None

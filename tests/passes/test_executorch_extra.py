"""The ExecuTorch extra is optional: nothing imports it until it is used, and without it
users get a typed error that says how to install it (checked in a clean interpreter
where ``executorch`` cannot be imported)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


def test_package_never_imports_executorch_and_missing_extra_is_a_typed_error():
    done = _run("""
        import sys
        import passes, passes.flow, passes.executorch, passes.delegation
        assert not [m for m in sys.modules if m.split(".")[0] == "executorch"], "imported"
        sys.modules["executorch"] = None  # as if the extra were not installed
        from pass_manager import PassManagerError
        from passes.executorch import ExecuTorchMissingError, available
        assert not available()
        try:
            from passes.executorch import BufferOwningPartitioner
        except ExecuTorchMissingError as e:
            assert isinstance(e, PassManagerError) and isinstance(e, ImportError)
            print(e)
        else:
            raise SystemExit("no error")
    """)
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith("BufferOwningPartitioner needs ExecuTorch 1.5.1")
    assert "--no-deps executorch==1.5.1" in message and "[executorch]" in message
    # From a checkout, named absolutely: "-c constraints.txt -e '.[executorch]'" worked only
    # from its root.
    assert f"-c {ROOT / 'constraints.txt'} " in message and f"-e '{ROOT}[executorch]'" in message

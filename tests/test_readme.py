"""The README's Python examples run, in order, in one namespace, so they cannot rot."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_examples_run(capsys):
    namespace: dict = {"__name__": "readme_example"}
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "ReluToClamp" in out  # the custom-pass example printed its plan and report
    assert "ReluToClamp(floor=0.5) ReluToClamp{floor=0.5}" in out  # a pass as a value, as text
    assert "'layers.1.attn.v_cache'" in out  # the quick start's delegate owns the caches
    assert len(namespace["decoded"]) == 4
    # "When a pass goes wrong": the failed pass's statistics, its dump, a reproducer.
    assert "refused: writes-constant" in out and "IR Dump After Failure of" in out
    assert "reproduced: the recorded error" in out
    assert len(namespace["decoded_on_et"]) == 4  # the ExecuTorch example decoded too

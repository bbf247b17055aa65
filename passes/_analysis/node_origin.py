"""Where a node of a lowered program came from: the node of the program the user exported
and the line of their model that made it, read from the node's ``from_node`` chain and
``stack_trace``. Lowering renames every node (``view`` becomes ``aten_view_copy_dtype``);
an error naming the lowered name alone points at nothing the user has seen.
"""

from __future__ import annotations

from pathlib import Path

from torch.fx import Node

__all__ = ["exported_name", "source_line"]


def exported_name(node: Node) -> str:
    """The name of the node ``node`` was made from in the first program of its history (the
    exported program), or its own name when it has no ``from_node`` chain."""
    name = node.name
    chain = node.meta.get("from_node") or []
    while chain:
        name = chain[-1].name
        chain = chain[-1].from_node
    return name


def source_line(node: Node) -> str | None:
    """``"model.py, line 11: bits = y.view(torch.int32)"``: the last frame of the node's
    ``stack_trace`` (the line of ``forward`` that made it), or None when there is none."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
             if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return None
    frame = lines[frames[-1]]
    code = lines[frames[-1] + 1] if frames[-1] + 1 < len(lines) else ""
    try:
        path, line_number = frame.split('"')[1], frame.split(", line ")[1].split(",")[0]
    except IndexError:
        return None
    return f"{Path(path).name}, line {line_number}" + (f": {code}" if code else "")

"""MarkMutableBuffers: find every buffer (and user input) a program mutates and mark it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pass_manager import ALL_CONDITIONS, Effects, Pass, PassResult
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import MutableBuffersMarked
from ._analysis.buffers import (
    BUFFER,
    INITIAL_META,
    LIFTED_GRAPH_HINT,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    PARAMETER,
    USER_INPUT,
    buffer_tensor,
    find_mutations,
    lifted_state_kind,
)
from ._analysis.marked_state import initial_copy

__all__ = ["MarkMutableBuffers"]

_STATISTIC = {BUFFER: "mutable buffers marked", PARAMETER: "written parameters marked",
              USER_INPUT: "mutated user inputs marked"}


@dataclass(frozen=True, repr=False)
class MarkMutableBuffers(Pass):
    """Mark each mutated buffer's node with ``meta["mutable_buffer"] = fqn``.

    A write is read from operator schemas (an argument annotated ``Tensor(a!)``), followed
    through any chain of views back to the buffer: in-place ops, ``out=`` variants,
    trailing ``copy_`` write-backs, and ``BUFFER_MUTATION`` outputs of functional programs.
    A parameter the program writes (one not requiring grad, or any under ``no_grad``) is
    state too and gets the same mark (``mutable_buffers`` reports its kind as
    ``"parameter"``). Mutated user inputs get ``meta["mutable_user_input"] = name``
    instead. The first time a buffer is marked, its value is kept in
    ``meta["mutable_buffer_initial"]`` for :func:`passes.reset_mutable_buffers`: a buffer
    filled with one value (a KV cache's zeros) keeps only that value, expanded to its
    shape; any other buffer is cloned. Written constants are reported, not marked.

    Example (GraphModule form)::

        before:  %k_cache = get_attr[k_cache]
                 %index_copy_ = aten.index_copy_(%k_cache, 2, %pos, %k)
        after:   %k_cache = get_attr[k_cache]  meta["mutable_buffer"] = "k_cache"
                 %index_copy_ = aten.index_copy_(%k_cache, 2, %pos, %k)

    Raises:
        ProgramFormError: the program is neither a GraphModule nor an ExportedProgram (an
            eager module: export it first).
    """

    provides = frozenset({MutableBuffersMarked})
    preserves = ALL_CONDITIONS  # only node meta changes
    effects = Effects.only_meta(MUTABLE_BUFFER_META, MUTABLE_INPUT_META, INITIAL_META)

    def call(self, program: Any) -> PassResult:
        with collector_paused():  # the scan's records are not garbage before it returns
            return self._mark(program)

    def _mark(self, program: Any) -> PassResult:
        scan = find_mutations(program)
        notes = [f"cannot see through {o.node.name}: {o.reason}" for o in scan.opaque]
        changed = False
        statistics: Counter[str] = Counter()
        if scan.opaque:
            statistics["opaque nodes not seen through"] = len(scan.opaque)
        for state, writers in scan.writers.items():
            if state.kind not in _STATISTIC:
                statistics[f"written {state.kind}s (not marked)"] += 1
                notes.append(f"{state.kind} {state.name!r} is written by "
                             f"{', '.join(n.name for n in writers if n is not None)}")
                continue
            nodes = scan.nodes_of(state)
            # A written parameter is state like a buffer: the same mark, the same kept value.
            stored = state.kind in (BUFFER, PARAMETER)
            kept = next((n.meta[INITIAL_META] for n in nodes
                         if n.meta.get(INITIAL_META) is not None), None)
            if stored and kept is None:
                kept = initial_copy(buffer_tensor(program, state.name))
            key = MUTABLE_BUFFER_META if stored else MUTABLE_INPUT_META
            statistics[_STATISTIC[state.kind]] += 1
            lifted = [lifted_state_kind(program, n) for n in nodes] if not stored else []
            if any(lifted):
                notes.append(f"input {state.name!r} is marked as a mutated input, but it is "
                             f"named like a {next(k for k in lifted if k)} torch.export lifted "
                             f"to an input: {LIFTED_GRAPH_HINT}")
            for node in nodes:
                if node.meta.get(key) != state.name:
                    node.meta[key] = state.name
                    changed = True
                if stored and node.meta.get(INITIAL_META) is not kept:
                    node.meta[INITIAL_META] = kept
                    changed = True
        return PassResult(program, changed, notes, statistics)

"""The main job's delegation stages: lower, hand the caches over, decode.

The job lowers its final program twice. ``AllNodePartitioner`` puts every computing node
into one delegate. A *cache-update-only* partitioner delegates nothing but the cache
updates (``index_put`` / ``index_copy``, with the quantize/dequantize of their results in a
quantized program), as a backend that keeps only the KV cache in its own memory would:
whether its delegates can own the caches shows whether each cache's update is visible to a
partitioner. A re-exported converted program hid them (export writes each cache back with
a whole-buffer ``aten.copy(cache, new)`` computed outside any delegate, issue 10, pattern
8); the job quantizes with ``quantize_program``, whose lifted program's mutation outputs
are the updates themselves, so no rewrite stands between them and the partitioner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from pass_manager import PassManager, Report
from pass_manager.validation import Trace

from .._analysis.quantize_ops import is_dequantize, is_quantize
from ..consume_buffer_mutations_in_delegate import ConsumeBufferMutationsInDelegate
from ..delegation import AllNodePartitioner, delegates, to_delegate
from ..delegation.ownership import program_state
from ..delegation.partitioners import DELEGATION_TAG, Partitioner, tagged_partitions
from .result import FlowResult, check_same, restricted

__all__ = ["CACHE_UPDATE_OPS", "CacheUpdatePartitioner", "Delegated", "delegate_stage",
           "delegation_stages"]

aten = torch.ops.aten
# The functional cache updates a decoder's index_put_ / index_copy_ (or cache[..., pos] = v)
# become after functionalization.
CACHE_UPDATE_OPS = (aten.index_put.default, aten.index_copy.default)
def _quantized_result(node: Node) -> list[Node]:
    """The quantize nodes reading ``node``'s result and the dequantize nodes reading those."""
    found: list[Node] = []
    for quantize in (u for u in node.users if is_quantize(u) and u.args[0] is node):
        found += [quantize, *(u for u in quantize.users
                              if is_dequantize(u) and u.args[0] is quantize)]
    return found


class CacheUpdatePartitioner:
    """Tags each cache update (``index_put`` / ``index_copy``) with the quantize/dequantize
    of its result, one partition per update: what a backend running only the cache updates
    (in a quantized program, the quantized updates) delegates. Outside inputs only feed the
    update itself (the others read the update or constants), so a group forms no cycle."""

    def __call__(self, ep: ExportedProgram) -> dict[str, list[Node]]:
        for node in ep.graph.nodes:
            node.meta.pop(DELEGATION_TAG, None)
        updates = [n for n in ep.graph.nodes
                   if n.op == "call_function" and n.target in CACHE_UPDATE_OPS]
        for index, update in enumerate(updates):
            for node in (update, *_quantized_result(update)):
                node.meta[DELEGATION_TAG] = f"cache_update_{index}"
        return tagged_partitions(ep)


def _mutated_buffers(ep: ExportedProgram) -> int:
    return sum(s.kind == OutputKind.BUFFER_MUTATION for s in ep.graph_signature.output_specs)


@dataclass
class Delegated:
    """A lowered program with its buffers handed over, and what the delegates own."""

    program: ExportedProgram
    report: Report
    mutated: int  # mutated buffers of the program before lowering
    owned: dict[str, list[str]] = field(default_factory=dict)  # delegate tag -> buffers

    @property
    def owned_count(self) -> int:
        return sum(len(b) for b in self.owned.values())


def delegate_stage(
    stage: Callable[[str, Callable[[], Any]], Any],
    program: ExportedProgram,
    partitioner: Partitioner,
    title: str,
    options: Mapping[str, Any],
) -> Delegated:
    """``to_delegate`` + ``ConsumeBufferMutationsInDelegate`` as two logged stages of the job
    (``title`` tells them apart); ``program`` itself is left as it is."""
    lowered = stage(f"to_delegate{title}", lambda: to_delegate(program, partitioner))
    consumed = stage(
        f"consume buffer mutations{title}",
        lambda: PassManager([ConsumeBufferMutationsInDelegate()], **options).run(lowered),
    )
    owned = {info.tag: sorted(info.owned_buffers) for info in delegates(consumed.program)}
    return Delegated(consumed.program, consumed.report, _mutated_buffers(program), owned)


def delegation_stages(
    stage: Any,
    result: FlowResult,
    program: ExportedProgram,
    steps: list,
    traces: tuple[Trace, Trace],
    options: Mapping[str, Any],
    state: Callable[[torch.nn.Module], dict[str, torch.Tensor]] = program_state,
) -> Trace:
    """Lower ``program`` with both partitioners, decode both, check them against
    ``traces`` = (eager, the input program's decode, read with ``state``); returns the
    all-node decode. ``state`` reads every buffer, the delegates' included (integer state
    dequantized: :func:`passes.flow.integer_state.dequantized_state`)."""
    eager, reference = traces
    everything = delegate_stage(stage, program, AllNodePartitioner(), "", options)
    result.reports.append(("delegation", everything.report))
    for tag, owned in everything.owned.items():
        result.delegate_summary.append(f"{tag}: owns {', '.join(owned) or 'none'}")
    caches = delegate_stage(
        stage, program, CacheUpdatePartitioner(), " (cache updates only)", options
    )
    # Its report stays out of the pass table (one note per moved cache, twice over): the
    # summary line and the JSON report say what it did.
    _cache_update_summary(result, caches)
    final = stage(
        "decode the lowered program",
        lambda: stage.run(everything.program, steps, state=state),
    )
    cache_trace = stage(
        "decode the cache-update delegates",
        lambda: stage.run(caches.program, steps, state=state),
    )
    # Constants torchao or export lifted into buffers of the quantized module (a
    # cross-attention's lifted tensors) are no state of the model: compare the model's.
    model_state = set(eager.buffers[0]) if eager.buffers else set()
    for name, trace in (("delegated program", final),
                        ("program with cache-update delegates", cache_trace)):
        check_same(
            result,
            f"{name} matches its input program",
            restricted(reference, model_state),
            restricted(trace, model_state),
        )
    return final


def _cache_update_summary(result: FlowResult, caches: Delegated) -> None:
    result.delegate_summary.append(
        f"cache-update-only partitioner (index_put/index_copy): {len(caches.owned)} "
        f"delegate(s) own {caches.owned_count} of {caches.mutated} mutated buffers"
    )
    result.cache_update_delegation = {
        "owned": caches.owned_count,
        "mutated": caches.mutated,
        "delegates": caches.owned,
    }

"""pt2e quantization of programs with mutable buffers: :class:`PassQuantizer`.

The flow, with torchao's ``prepare_pt2e`` / ``convert_pt2e``::

    gm = torch.export.export(model, example_inputs).module()
    quantizer = PassQuantizer(
        XNNPACKQuantizer().set_global(config),
        transform=[MarkMutableBuffers()],              # in transform_for_annotation
        after_annotate=[SkipAnnotateDataMovementOps()],  # after the quantizer's annotate
    )
    prepared = prepare_pt2e(gm, quantizer)
    for args in calibration_data:
        prepared(*args)
    reset_mutable_buffers(prepared)          # calibration leaves its state in the buffers
    converted = convert_pt2e(prepared, fold_quantize=True)
    converted = PassManager([UnfreezeMutableBuffer()]).run(converted).program

``reset_mutable_buffers`` is the step after calibration: without it the converted program
starts from whatever the last calibration batch left in a KV cache or an accumulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule
from torchao.quantization.pt2e.quantizer import Quantizer

from pass_manager import PassManager, Report

from ._analysis.buffer_reads import OBSERVED_READS_META, BufferRead, view_chain
from ._analysis.buffers import MUTABLE_BUFFER_META
from .errors import QuantizationFlowError

__all__ = ["PassQuantizer", "QuantizationFlowError"]


class PassQuantizer(Quantizer):
    """A torchao ``Quantizer`` that runs pass pipelines around another quantizer.

    ``transform_for_annotation`` runs the wrapped quantizer's own transform, then the
    ``transform`` passes; ``annotate`` runs the wrapped ``annotate``, then the
    ``after_annotate`` passes (each list is one :class:`pass_manager.PassManager`, so its
    conditions are checked and a failing pass is rolled back). ``validate`` and the
    observer callback delegate to the wrapped quantizer. The callback also records, on
    each mutable buffer's node, the observers that watch a read of it, so that
    ``UnfreezeMutableBuffer`` knows exactly which frozen constant stands for which buffer.

    Args:
        quantizer: any torchao pt2e ``Quantizer``.
        transform: passes run before annotation (e.g. ``MarkMutableBuffers()``).
        after_annotate: passes run after annotation (e.g. ``SkipAnnotateDataMovementOps()``);
            they must edit the graph module in place, since ``prepare_pt2e`` ignores what
            ``annotate`` returns.

    The run reports of both pipelines are kept in :attr:`reports`.
    """

    def __init__(
        self,
        quantizer: Quantizer,
        transform: Sequence[Any] = (),
        after_annotate: Sequence[Any] = (),
        **options: Any,
    ):
        super().__init__()
        if not isinstance(quantizer, Quantizer):
            raise TypeError(
                f"PassQuantizer wraps a torchao Quantizer, got {type(quantizer).__name__}"
            )
        self.quantizer = quantizer
        # ``options`` are PassManager options for both pipelines (e.g. print_after,
        # reproducer_dir).
        self.transform = (
            PassManager(list(transform), name="transform", **options) if transform else None
        )
        self.after_annotate = (
            PassManager(list(after_annotate), name="after_annotate", **options)
            if after_annotate else None
        )
        self.reports: list[Report] = []

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        model = self.quantizer.transform_for_annotation(model)
        if self.transform is None:
            return model
        result = self.transform.run(model)
        self.reports.append(result.report)
        return result.program

    def annotate(self, model: GraphModule) -> GraphModule:
        annotated = self.quantizer.annotate(model)
        if annotated is not None and annotated is not model:
            raise QuantizationFlowError(
                f"{type(self.quantizer).__name__}.annotate returned a new graph module; "
                "prepare_pt2e only keeps annotations made in place",
                pass_name=type(self).__name__,
            )
        if self.after_annotate is not None:
            result = self.after_annotate.run(model)
            self.reports.append(result.report)
            if result.program is not model:
                raise QuantizationFlowError(
                    "an after_annotate pass returned a new graph module; prepare_pt2e only "
                    "keeps annotations made in place",
                    pass_name=type(self).__name__,
                )
        return model

    def validate(self, model: GraphModule) -> None:
        self.quantizer.validate(model)

    def prepare_obs_or_fq_callback(
        self, model: GraphModule, edge_or_node_to_obs_or_fq: dict
    ) -> None:
        self.quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)
        _record_observed_reads(model, edge_or_node_to_obs_or_fq)

    def __repr__(self) -> str:
        return f"PassQuantizer({type(self.quantizer).__name__})"


def _record_observed_reads(model: GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
    """Note on each marked buffer's nodes which observers see it (directly or via views),
    and which nodes consume the observed value."""
    consumers: dict[tuple, set[str]] = {}
    for key, observer in edge_or_node_to_obs_or_fq.items():
        if observer is None:
            continue
        source = key[0] if isinstance(key, tuple) else key
        found = view_chain(source)
        if found is None:
            continue
        root, chain = found
        users = {key[1].name} if isinstance(key, tuple) else {u.name for u in key.users}
        read = (root.meta[MUTABLE_BUFFER_META], chain, observer)
        consumers.setdefault(read, set()).update(users)
    reads: dict[str, list[BufferRead]] = {}
    for (fqn, chain, observer), names in consumers.items():
        reads.setdefault(fqn, []).append(BufferRead(fqn, chain, observer, frozenset(names)))
    for node in model.graph.nodes:
        fqn = node.meta.get(MUTABLE_BUFFER_META)
        if fqn in reads:
            node.meta[OBSERVED_READS_META] = list(reads[fqn])

"""BufferOwningPartitioner: ExecuTorch partitioning that gives each delegate the buffers it owns.

ExecuTorch decides buffer ownership with ``tag_mutated_buffer``: a mutated buffer goes to
the smallest tag among its readers. That fails where our ``ConsumeBufferMutationsInDelegate``
succeeds: a buffer also returned as a user output (an assertion in ``to_backend``), an
update whose new value is read outside the delegate (a crash erasing a used getitem), a
buffer mutated in two partitions (a spec violation), and a buffer read in two
partitions but mutated in one (a silently wrong program). The wrapper runs any ExecuTorch
partitioner, then re-decides ownership with the same analysis as
``ConsumeBufferMutationsInDelegate`` (:func:`passes.delegation.ownership.tagged_buffer_ownership`):
a buffer exactly one partition mutates and reads is tagged into it; any other stays at the
top level and a note says why (``strict=True``: :class:`BufferConsumptionError`).

Several methods of one ``.pte`` (``to_edge_transform_and_lower({"prefill": ep1, "decode":
ep2}, ...)``) share their mutable buffers through memory planning
(``MemoryPlanningPass(share_mutable_buffers=True)``), but a delegate's state is its own: a
cache handed to the prefill's delegate is not the one the decode's reads. ExecuTorch calls a
partitioner once per method without saying which, so ``methods=`` gives the wrapper the
mapping it lowers: each buffer that another method reads or writes too stays at the top
level in every method, with a note (``strict=True``: :class:`SharedBufferDelegationError`);
:mod:`passes.executorch.method_state` recognizes which method each call is for.

ExecuTorch lets a partitioner change tags only, so the rewrite an owned buffer needs when
its new value is used outside the owner (returned, or read by ops the partition leaves out)
happens in ``transform_for_pre_decomposition``, the hook ``to_edge_transform_and_lower``
runs first: those uses read a copy of the new value, a distinct node that ``partition``
tags into the owning delegate, so the delegate returns it as an ordinary output. The
partition is not known yet there, so a trial partition of the program's buffers decides
which new values need that copy (:mod:`passes.executorch.new_value_copies`): none where
every use stays inside the owner, which would otherwise copy a KV cache per token.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import executorch.kernels.quantized  # noqa: F401  (registers the out variants; see below)
import torch
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from .._analysis.buffers import buffer_tensor
from .._methods.shared_buffers import check_shared_buffers
from ..delegation.errors import BufferConsumptionError
from ..delegation.ownership import BufferOwnership, tagged_buffer_ownership
from ..delegation.partitioners import DELEGATION_TAG, getitems_follow_their_source
from . import (
    DelegateStateDtypeError,
    DelegateStateWarning,
    ExecuTorchInputError,
    PortableKernelAbortWarning,
    SharedBufferDelegationError,
    UnfoldedQuantizeError,
    portable_kernel_abort,
)
from .buffer_layout import with_converted_copy_sources
from .coreml_fp16_state import coreml_fp16_state_reads
from .coreml_state_order import coreml_state_order
from .method_state import MethodState, SharedBuffer, checked_methods, method_state
from .new_value_copies import (
    CopyPlan,
    functional,
    plan_new_value_copies,
    separate_new_buffer_values,
)
from .portable_kernels import aborting_kernels
from .state_writes import refuse_mismatched_state_writes

__all__ = ["BufferOwningPartitioner", "executorch_state", "separate_new_buffer_values"]

PASS_NAME = "BufferOwningPartitioner"

# The wrapper keeps some quantize / dequantize nodes at the top level (a 0-d value, a
# quantize XNNPACK would drop, partitions on grids XNNPACK misreads), and state stored as
# integers is written by one there too: ExecuTorch's portable kernels run them, whose out
# variants only `executorch.kernels.quantized` (imported above) registers. Without it, a
# user's `to_executorch()` fails with `RuntimeError: Missing out variants:
# {'quantized_decomposed::quantize_per_tensor'}` (our runtime helpers import it themselves).

# Backends whose state on the device is not the buffer as the program holds it: the dtype
# kept, and whether state starts zero-filled. Core ML (coremltools 9) casts fp32 state to
# fp16 with a warning, and an integer or bool buffer to fp16 state silently (an int64
# counter is then exact only up to 2048), fails on int8 state deep in its converter, and
# zero-fills state when the model is prewarmed.
COREML_BACKEND = "CoreMLBackend"
XNNPACK_BACKEND = "XnnpackBackend"
_STATE_DTYPE = {COREML_BACKEND: torch.float16}
_ZERO_FILLED = {COREML_BACKEND}
# Dtypes the backend cannot take as a delegate's input either (coremltools 9: ``KeyError:
# torch.int8``; its torch frontend has no number for bfloat16: ``KeyError: torch.bfloat16``
# on the cast computing the new value), so state stored so can neither be owned nor stay at
# the top level beside the delegate.
_NO_INPUT_DTYPES = {COREML_BACKEND: frozenset({torch.int8, torch.uint8, torch.bfloat16})}


def _is_value_copy(node: Node) -> bool:
    """A clone of one value, in any dialect (the copies ``separate_new_buffer_values`` adds
    become ``_clone_dim_order`` in Edge; any other clone is as pure, so it may move too)."""
    name = str(getattr(node.target, "__name__", node.target))
    return node.op == "call_function" and "clone" in name and len(node.all_input_nodes) == 1


class BufferOwningPartitioner(Partitioner):
    """An ExecuTorch partitioner wrapping ``partitioner`` that decides buffer ownership.

    Args:
        partitioner: any ExecuTorch ``Partitioner`` (``AllNodePartitioner``,
            ``XnnpackPartitioner``, a backend's own); it tags the nodes, this decides which
            mutable buffers each partition owns.
        methods: the mapping ``{method name: ExportedProgram}`` given to
            ``to_edge_transform_and_lower``, when it lowers several methods of one model
            into one ``.pte``: a buffer that some method writes and more than one method
            reads or writes stays at the top level in every method (memory planning shares
            it; a delegate's copy would not be shared). Buffers one method alone uses are
            decided as without it.
        strict: raise :class:`BufferConsumptionError` (naming the buffer and the partitions)
            instead of keeping a buffer that a partition mutates at the top level, and
            :class:`SharedBufferDelegationError` (naming the buffer and the methods) instead
            of keeping a buffer shared by methods out of the partition that takes it.
        own_buffers: whether the backends can own mutable buffers. ``None`` (default): a
            backend can if the wrapped partitioner gave any of its partitions a mutable
            buffer (as stateful backends' partitioners do, e.g. with ExecuTorch's
            ``tag_mutated_buffer``); XNNPACK's gives none, and an XNNPACK delegate handed a
            buffer to update crashes the runtime, so its buffers stay at the top level.
        keep_precision: float buffers a backend would hold in a narrower dtype on the
            device (Core ML keeps fp32 state as fp16) that stay at the top level in their
            own dtype instead: ``True`` for all of them, or their FQNs (``["acc"]``). The
            delegate receives such a buffer and returns its new value, as it does for the
            integer state it cannot hold; buffers the backend holds as they are are
            unaffected. Core ML then computes the new value in its compute precision:
            ``DelegateStateWarning`` (issue ``"fp16 compute"``) says so when that is fp16
            (the default; ``CoreMLBackend.generate_compile_specs(compute_precision=
            coremltools.precision.FLOAT32)`` keeps every bit).

    Raises:
        ExecuTorchInputError: ``partitioner`` is not a ``Partitioner`` instance (the class
            itself, ``XnnpackPartitioner`` for ``XnnpackPartitioner()``, names the fix).
        SharedBufferError: ``methods`` disagree about a buffer some method writes and
            several hold (shape, dtype, initial value or quantization grid): memory planning
            would give it one place and one initial value for all, silently wrong in the
            others.
        ExecuTorchInputError: ``keep_precision`` is not a bool or a collection of FQNs, or
            (from ``partition``) names a buffer the program does not have.
        DelegateStateDtypeError: from ``partition``, a Core ML delegate would own a buffer
            stored as int8 or uint8 (``QuantizeMutableBuffers``): Core ML keeps fp16 state
            only (its converter fails with ``slice_update ... dtype int8`` otherwise). Raised,
            not kept at the top level with a note: kept there, the Core ML partition fails
            too (``KeyError: torch.int8``, coremltools 9). Any other integer or bool buffer
            (a position counter) is kept at the top level with a note: Core ML would hold
            it as fp16 state, silently (an int64 counter is exact only up to 2048).
        UnfoldedQuantizeError: from ``partition``, an XNNPACK partition quantizes a constant
            (a weight) in the graph (``convert_pt2e(fold_quantize=False)``), which XNNPACK's
            runtime computes wrong values with. (A quantize of a 0-d value an XNNPACK
            partition receives, which XNNPACK crashes on, is kept at the top level with a
            note instead; so is a quantize of a received value that XNNPACK's GEMM config
            marked fused into a GEMM it then left out, which XNNPACK would drop and compute
            with an uninitialized tensor in its place; and so is a copy an XNNPACK
            partition holds of a value it also returns or receives, which XNNPACK would
            drop and then refuse to return twice or pass through; and so is a whole XNNPACK
            partition computing on a uint8 grid, which XNNPACK serializes as int8, or on
            a 16-bit one (QnnQuantizer's 16a8w / 16a16w), which it refuses to serialize.)

    Warns:
        DelegateStateWarning: from ``partition``, a Core ML delegate will own an fp32 buffer
            (fp16 on the device; ``keep_precision`` keeps it out), or a buffer whose initial
            value is not all zeros (Core ML zero-fills state when the model is prewarmed),
            or a float buffer kept at the top level (by ``keep_precision``, because
            several ``methods`` share it, or for an ownership reason) is updated by a Core
            ML partition computing in fp16, which rounds its new value every call.

    After ``transform_for_pre_decomposition``, ``copy_plan`` says which new buffer values
    got a copy for their uses outside the owner (:class:`CopyPlan`). After each
    ``partition`` call, ``notes`` says what happened to every mutable buffer and
    ``ownership`` holds the verdicts (:class:`BufferOwnership`). With ``methods``,
    ``method_notes`` holds each method's notes and ``notes`` all of them, each prefixed
    with its method (``[decode] kept 'k_cache' at the top level: ...``).

    Example:
        >>> wrapped = BufferOwningPartitioner(XnnpackPartitioner())
        >>> to_edge_transform_and_lower(ep, partitioner=[wrapped])
    """

    def __init__(
        self,
        partitioner: Partitioner,
        methods: Mapping[str, ExportedProgram] | None = None,
        strict: bool = False,
        own_buffers: bool | None = None,
        keep_precision: bool | Collection[str] = False,
    ):
        super().__init__(getattr(_checked_partitioner(partitioner), "spec", {}))
        self.partitioner = partitioner
        self.methods = _checked_methods(methods)
        self.strict = strict
        self.own_buffers = own_buffers
        self.keep_precision = _checked_keep_precision(keep_precision)
        self.notes: list[str] = []
        self.method_notes: dict[str, list[str]] = {}
        self.ownership: list[BufferOwnership] = []
        self.copy_plan: CopyPlan | None = None
        self._state: MethodState | None = (
            method_state(self.methods) if self.methods is not None else None)
        self._copy_plans: dict[str, CopyPlan] = {}
        self._nonzero: dict[str, int] = {}
        # Buffer FQN -> the partition that would own it, for those the last verdicts kept
        # at the top level because keep_precision asked.
        self._precision_kept: dict[str, str] = {}

    def __repr__(self) -> str:
        methods = f", methods={list(self.methods)}" if self.methods is not None else ""
        kept = (f", keep_precision={self.keep_precision!r}" if self.keep_precision else "")
        return (f"{PASS_NAME}({self.partitioner!r}{methods}, strict={self.strict}, "
                f"own_buffers={self.own_buffers}{kept})")

    def _shared(self, program: ExportedProgram) -> tuple[str | None, dict[str, SharedBuffer]]:
        """Which method ``program`` is (a label, None without ``methods``) and its buffers
        other methods use too."""
        if self._state is None:
            return None, {}
        written = set(program.graph_signature.buffers_to_mutate.values())
        this = self._state.methods_of(program)
        label = this[0] if len(this) == 1 else (
            "/".join(this) if this else "a method not in methods")
        return label, self._state.shared(program, written)

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[Node], bool] | None]:
        ops, keep = self.partitioner.ops_to_not_decompose(ep)
        if _backend_id(self.partitioner) != XNNPACK_BACKEND:
            return ops, keep
        # An op on a grid XNNPACK misreads will not be delegated (_keep_misread_grids_out): kept
        # whole, it would be neither decomposed nor delegated, which lowering refuses.
        def kept_whole(node: Node) -> bool:
            return (keep is None or keep(node)) and not _on_misread_grid(node)
        return ops, kept_whole

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        # ExecuTorch hands ``partition`` a copy whose state holds fake tensors: the values
        # of the buffers (is an initial value zeros?) are read here, where they are real.
        self._nonzero.update(_nonzero_elements(exported_program))
        self._check_keep_precision(exported_program)
        # A decomposed program whose state write lost its conversion cannot be repaired here;
        # a copy_ still converting is made explicit, or to_edge's decomposition drops it.
        refuse_mismatched_state_writes(exported_program, PASS_NAME)
        program = with_converted_copy_sources(exported_program)
        program = self.partitioner.transform_for_pre_decomposition(program)
        # The copies only serve a delegate that owns the buffer and leave it by a use outside
        # (any other copy is one whole-buffer copy per call for nothing), so the trial
        # partition decides which new values need one.
        if self.own_buffers is False:
            self.copy_plan = CopyPlan(frozenset())
            return program
        program = functional(program)
        if _backend_id(self.partitioner) == COREML_BACKEND:
            # coremltools 9.0 reads fp16 state as fp32 and then refuses an fp16 value written
            # into it by index / scatter ops: read it as fp16 explicitly, same bits.
            program = coreml_fp16_state_reads(program)
        label, shared = self._shared(program)
        # Shared buffers stay at the top level, so their new values need no copy either.
        verdicts = functools.partial(self._verdicts, shared=shared)
        self.copy_plan = plan_new_value_copies(program, self.partitioner, verdicts)
        if label is not None:
            self._copy_plans[label] = self.copy_plan
        program = separate_new_buffer_values(program, self.copy_plan.copied)
        if _backend_id(self.partitioner) == COREML_BACKEND:
            # coremltools 9.0 fails (KeyError) on two owned buffers when the last op
            # computes a new state value, or one value feeds two states: reorder, same values.
            program = coreml_state_order(program)
        return program

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        graph = exported_program.graph
        before = {node: node.meta.get(DELEGATION_TAG) for node in graph.nodes}
        self._check_keep_precision(exported_program)
        label, shared = self._shared(exported_program)
        copy_plan = self._copy_plans.get(label, self.copy_plan) if label else self.copy_plan
        result = self.partitioner.partition(exported_program)
        program = result.tagged_exported_program
        # Shared buffers the wrapped partitioner gave a partition (mutated inside, or the
        # placeholder tagged, as for a buffer this method only reads).
        taken = self._taken_shared(program, result.partition_tags, shared)
        if self.strict and taken:
            self._restore(graph, before)
            fqn, partitions = next(iter(taken.items()))
            raise SharedBufferDelegationError(
                fqn, list(shared[fqn].methods), partitions,
                f"{shared[fqn].describe()}; ExecuTorch shares a top-level buffer between "
                "methods, never a delegate's copy")
        unfolded = _unfolded_quantize(program, result.partition_tags, set(shared))
        if unfolded is not None:
            self._restore(graph, before)
            raise unfolded
        scalar_notes = self._keep_scalar_quantize_out(program, result.partition_tags)
        scalar_notes += _keep_dropped_quantize_out(program, result.partition_tags)
        scalar_notes += _keep_pass_through_clones_out(program, result.partition_tags)
        scalar_notes += _keep_misread_grids_out(program, result.partition_tags, set(shared))
        scalar_notes += _getitems_with_their_source(program, result.partition_tags)
        verdicts = self._verdicts(program, result.partition_tags, shared)
        owned = []
        for verdict in verdicts:
            if verdict.consumable:
                copies = self._value_copies(verdict)
                if copies is None:
                    verdict.reason = self._unreturnable(verdict)
                    verdict.owner_tag = None
                else:
                    owned.append((verdict, copies))
        # A buffer kept out because keep_precision asked is not refused: the user chose it.
        refused = [v for v in verdicts if not v.consumable and v.mutated_by
                   and v.fqn not in self._precision_kept]
        if self.strict and refused:
            self._restore(graph, before)
            v = refused[0]
            raise BufferConsumptionError(v.fqn, v.partitions, v.reason, PASS_NAME)
        for verdict, _ in owned:
            backend = self._backend(result.partition_tags, verdict.owner_tag)
            error = _state_on_device(program, verdict, backend, self._nonzero)
            if error is not None:
                self._restore(graph, before)
                raise error
        for verdict in verdicts:
            if not verdict.consumable:
                self._warn_of_compute_precision(program, verdict, result.partition_tags,
                                                label, shared)
        _warn_of_aborting_kernels(program, result.partition_tags)
        notes = list(scalar_notes)
        if copy_plan is not None and copy_plan.failure is not None:
            notes.append(
                f"the trial partition deciding the copies of new buffer values failed "
                f"({copy_plan.failure}): every such value used besides its write-back "
                "was copied"
            )
        mutated = {v.fqn for v in verdicts}
        for fqn, partitions in taken.items():
            if fqn not in mutated:  # read here, written by another method: not a constant
                self._untag_buffer(program, fqn)
                notes.append(
                    f"kept {fqn!r} at the top level: {shared[fqn].describe()} and another "
                    f"method writes it, so partition(s) {', '.join(map(repr, partitions))} "
                    "may not keep it as a constant")
        for verdict in verdicts:
            if not verdict.consumable:
                # ExecuTorch reads ownership from the placeholder's tag; untagged stays on top.
                verdict.placeholder.meta.pop(DELEGATION_TAG, None)
                notes.append(f"kept {verdict.fqn!r} at the top level: {verdict.reason}")
        for verdict, copies in owned:
            verdict.placeholder.meta[DELEGATION_TAG] = verdict.owner_tag
            for node in copies:
                node.meta[DELEGATION_TAG] = verdict.owner_tag
            copied = copies or [u for u in verdict.value.users if _is_value_copy(u)]
            returns = " (and returns its new value as an ordinary output)" if copied else ""
            notes.append(f"{verdict.fqn!r} owned by partition {verdict.owner_tag!r}{returns}")
        self.ownership = verdicts
        if label is None:
            self.notes = notes
        else:
            self.method_notes[label] = notes
            self.notes = [f"[{method}] {note}"
                          for method, kept in self.method_notes.items() for note in kept]
        return PartitionResult(program, result.partition_tags)

    def _keep_scalar_quantize_out(
        self, program: ExportedProgram, partition_tags: dict[str, Any]
    ) -> list[str]:
        """Keep at the top level each quantize an XNNPACK partition would apply to a 0-d
        value it receives; a note per node kept out.

        XNNPACK's ``ChannelsLastTaggedReshapePass`` asks, of every dequantize in a delegate
        whose input is computed there, whether the value quantized is channels-last by
        indexing it when it is a delegate input (``meta["val"][0]``): a 0-d one (a 0-d user
        input, state, constant, or a value computed outside the partition such as
        ``x.sum()``) fails with ``IndexError: invalid index of a 0-dim tensor``, untyped.
        Quantized outside, the value enters the delegate already as 8-bit integers, the
        dequantize's input is then a delegate input, and XNNPACK lowers and computes it as
        the program does (runtime equal to Python bit for bit on the models of the
        tests). Only quantized values trip it: a float 0-d input is never indexed.
        """
        from executorch.backends.xnnpack.utils.quant_utils import is_dequant

        xnnpack = _xnnpack_tags(partition_tags)
        if not xnnpack:
            return []
        notes = []
        for node in program.graph.nodes:
            tag = node.meta.get(DELEGATION_TAG)
            if tag not in xnnpack or not is_dequant(node):
                continue
            quantize = node.args[0]
            if not (isinstance(quantize, Node) and quantize.meta.get(DELEGATION_TAG) == tag
                    and quantize.all_input_nodes and isinstance(quantize.args[0], Node)):
                continue
            value = quantize.args[0]
            received = value.op == "placeholder" or value.meta.get(DELEGATION_TAG) != tag
            if received and _is_scalar(value):
                _untag_quantize(quantize, tag)
                notes.append(
                    f"kept {quantize.name} (quantizing the 0-d {value.name}) out of partition "
                    f"{tag!r}: XNNPACK fails on a 0-d value it quantizes itself (IndexError "
                    "in ChannelsLastTaggedReshapePass); the partition receives it quantized")
        return notes

    @staticmethod
    def _taken_shared(
        program: ExportedProgram, partition_tags: dict[str, Any],
        shared: dict[str, SharedBuffer],
    ) -> dict[str, list[str]]:
        """Shared buffer -> the partitions the wrapped partitioner gave it (tagged
        placeholder, or its update inside a partition)."""
        if not shared:
            return {}
        sig = program.graph_signature
        taken: dict[str, set[str]] = {}
        placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
        for name, fqn in sig.inputs_to_buffers.items():
            tag = placeholders[name].meta.get(DELEGATION_TAG) if name in placeholders else None
            if fqn in shared and tag in partition_tags:
                taken.setdefault(fqn, set()).add(tag)
        for verdict in tagged_buffer_ownership(program):
            if verdict.fqn in shared and verdict.mutated_by:
                taken.setdefault(verdict.fqn, set()).update(verdict.mutated_by)
        return {fqn: sorted(tags) for fqn, tags in taken.items()}

    @staticmethod
    def _untag_buffer(program: ExportedProgram, fqn: str) -> None:
        for name, target in program.graph_signature.inputs_to_buffers.items():
            if target == fqn:
                for node in program.graph.find_nodes(op="placeholder"):
                    if node.name == name:
                        node.meta.pop(DELEGATION_TAG, None)

    def _verdicts(
        self, program: ExportedProgram, partition_tags: dict[str, Any],
        shared: dict[str, SharedBuffer] | None = None,
    ) -> list[BufferOwnership]:
        """Who may own each mutated buffer of tagged ``program``, copies aside; a buffer
        other methods use too (``shared``) stays at the top level."""
        verdicts = tagged_buffer_ownership(program)
        stateful = self._stateful_backends(verdicts, partition_tags)
        self._precision_kept = {}
        for verdict in verdicts:
            if shared and verdict.fqn in shared:
                verdict.reason = (
                    f"{shared[verdict.fqn].describe()}; ExecuTorch's memory planning shares "
                    "a top-level buffer between methods, a delegate's copy would be its own")
                verdict.owner_tag = None
                continue
            backend = self._backend(partition_tags, verdict.owner_tag)
            if verdict.consumable and backend not in stateful:
                verdict.reason = (
                    f"partition {verdict.owner_tag!r} runs on {backend}, whose partitioner gives "
                    "its delegates no mutable buffers (own_buffers=True overrides)"
                )
            elif verdict.consumable:
                keep = self.keep_precision is True or verdict.fqn in (self.keep_precision or ())
                verdict.reason = _state_kept_off_device(program, verdict.fqn, backend, keep)
                if verdict.reason is not None and buffer_tensor(
                        program, verdict.fqn).is_floating_point():
                    self._precision_kept[verdict.fqn] = verdict.owner_tag
            if not verdict.consumable:
                verdict.owner_tag = None
        return verdicts

    def _warn_of_compute_precision(
        self, program: ExportedProgram, verdict: BufferOwnership,
        partition_tags: dict[str, Any], label: str | None, shared: dict[str, SharedBuffer],
    ) -> None:
        """Warn that a Core ML partition computing in fp16 rounds the new value of a float
        buffer kept at the top level in a wider dtype (by ``keep_precision``, because
        several methods share it, or for an ownership reason): the partition casts the
        buffer it receives to fp16, updates it and returns the value cast back, so the
        top level stores an fp16-rounded value every call (an accumulator at 1000, fp16
        spacing 0.5, never moves by ``x / 1000``)."""
        value = buffer_tensor(program, verdict.fqn)
        if not value.is_floating_point() or value.dtype == torch.float16:
            return
        rounding = [tag for tag in verdict.mutated_by
                    if _computes_in_fp16(partition_tags.get(tag))]
        if not rounding:
            return
        if verdict.fqn in self._precision_kept:
            why = "keep_precision"
        elif verdict.fqn in shared:
            why = shared[verdict.fqn].describe()
        else:
            why = verdict.reason
        where = f" in method {label!r}" if label is not None else ""
        dtype = str(value.dtype).split(".")[-1]
        partitions = ", ".join(map(repr, rounding))
        warnings.warn(DelegateStateWarning(
            verdict.fqn, COREML_BACKEND, "fp16 compute",
            f"{PASS_NAME}: {verdict.fqn!r} stays {dtype} at the top level{where} ({why}), "
            f"but the {COREML_BACKEND} partition {partitions} updating it computes in fp16, "
            "which rounds its new value on every call (an increment below half the fp16 "
            "spacing is lost): generate its compile specs with "
            "compute_precision=coremltools.precision.FLOAT32"), stacklevel=3)

    def _check_keep_precision(self, program: ExportedProgram) -> None:
        """Refuse FQNs in ``keep_precision`` that name no buffer of ``program`` (nor, with
        ``methods``, of any method): a misspelt name would keep nothing, silently."""
        if self.keep_precision in (True, False):
            return
        known = set(program.graph_signature.inputs_to_buffers.values())
        for other in (self.methods or {}).values():
            known.update(other.graph_signature.inputs_to_buffers.values())
        unknown = sorted(set(self.keep_precision) - known)
        if unknown:
            raise ExecuTorchInputError(
                PASS_NAME, "keep_precision",
                f"names {', '.join(map(repr, unknown))}, which the program has no buffer "
                f"called; its buffers: {', '.join(map(repr, sorted(known))) or 'none'}")

    @staticmethod
    def _backend(partition_tags: dict[str, Any], tag: str | None) -> str | None:
        spec = partition_tags.get(tag) if tag is not None else None
        return getattr(spec, "backend_id", None)

    def _stateful_backends(
        self, verdicts: list[BufferOwnership], partition_tags: dict[str, Any]
    ) -> set[str | None]:
        """Backends whose delegates may own buffers: all, none, or those given one."""
        backends = {self._backend(partition_tags, tag) for tag in partition_tags}
        if self.own_buffers is not None:
            return backends if self.own_buffers else set()
        return {
            self._backend(partition_tags, v.placeholder.meta.get(DELEGATION_TAG))
            for v in verdicts if v.placeholder.meta.get(DELEGATION_TAG) in partition_tags
        }

    @staticmethod
    def _value_copies(verdict: BufferOwnership) -> list[Node] | None:
        """The copies carrying the new value out of the owner, or None if another use does."""
        tag = verdict.owner_tag
        output = verdict.value.graph.output_node()
        returned = output.args[0]
        if sum(1 for arg in returned if arg is verdict.value) > 1:
            return None
        outside = [
            u for u in verdict.value.users
            if u is not output and u.meta.get(DELEGATION_TAG) != tag
        ]
        if not all(_is_value_copy(u) for u in outside):
            return None
        return outside

    def _unreturnable(self, verdict: BufferOwnership) -> str:
        users = ", ".join(sorted(u.name for u in verdict.value.users if u.op != "output"))
        used = (
            f"its new value {verdict.value.name} is also used outside partition "
            f"{verdict.owner_tag!r} ({users or 'returned'}), which ExecuTorch cannot lower for "
            "an owned buffer"
        )
        if self.copy_plan is not None and verdict.fqn in self.copy_plan.inside:
            return (f"{used}; the trial partition run before decomposition kept every use "
                    "inside its owner, so no copy carries the value out")
        return (f"{used}; lower with to_edge_transform_and_lower, whose "
                "transform_for_pre_decomposition hook gives those uses a copy")

    @staticmethod
    def _restore(graph: torch.fx.Graph, before: dict[Node, Any]) -> None:
        for node in graph.nodes:
            tag = before.get(node)
            if tag is None:
                node.meta.pop(DELEGATION_TAG, None)
            else:
                node.meta[DELEGATION_TAG] = tag


def _xnnpack_tags(partition_tags: dict[str, Any]) -> set[str]:
    return {tag for tag, spec in partition_tags.items()
            if getattr(spec, "backend_id", None) == XNNPACK_BACKEND}


def _keep_dropped_quantize_out(
    program: ExportedProgram, partition_tags: dict[str, Any]
) -> list[str]:
    """Keep at the top level each quantize an XNNPACK partition would drop; a note per node.

    XNNPACK's GEMM configs mark the quantize after a ``mm``/``linear`` as implicit (fused
    into the GEMM's output) while they examine the GEMM, and leave the mark when they then
    reject that GEMM (e.g. ``softmax(s) @ dequantize(v)``: its activation is not a
    dequantize). The rejected GEMM stays at the top level and the quantize of its result
    goes into the next partition still marked: XNNPACK emits no conversion for it and never
    connects the partition's input, so the quantized value it computes with is an
    uninitialized internal tensor (a silently wrong program: outputs off by 1.5-3 on values
    of size ~1, varying run to run). Quantized outside, the value enters the partition as
    8-bit integers, which XNNPACK lowers as an ordinary quantized input (runtime equal to
    Python within one quantization step on the models of the tests). A quantize XNNPACK
    fuses into a GEMM of its own partition (the value computed there), or a dynamic one
    (its input is the partition's input by design), is left alone.
    """
    from executorch.backends.xnnpack.utils.quant_utils import (
        is_dynamic_qdq,
        is_quant,
        is_tagged_as_implicit_q_dq,
    )

    xnnpack = _xnnpack_tags(partition_tags)
    notes: list[str] = []
    if not xnnpack:
        return notes
    for node in program.graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if (tag not in xnnpack or not is_quant(node) or not is_tagged_as_implicit_q_dq(node)
                or is_dynamic_qdq(node) or not isinstance(node.args[0], Node)):
            continue
        value = node.args[0]
        if value.op != "placeholder" and value.meta.get(DELEGATION_TAG) == tag:
            continue
        _untag_quantize(node, tag)
        notes.append(
            f"kept {node.name} (quantizing {value.name}, computed outside) out of partition "
            f"{tag!r}: XNNPACK's GEMM config marked it fused into a GEMM it then left out, "
            "and XNNPACK would compute with an uninitialized value in its place; the "
            "partition receives it quantized")
    return notes


def _keep_pass_through_clones_out(
    program: ExportedProgram, partition_tags: dict[str, Any]
) -> list[str]:
    """Keep at the top level each clone an XNNPACK partition would turn into a value it
    returns twice or passes through; a note per node.

    XNNPACK removes clones (``RemoveCloneOpsTransform``), so the partition then returns the
    clone's input in its place. When that input leaves the partition anyway (a buffer's new
    value, written back and returned as ``state.clone()``) or comes from outside it
    (``x.clone()`` of an input), the delegate would return one value twice or return an
    input, which XNNPACK's preprocess refuses ("Output node ... is already in the
    inputs"): the program would not lower at all. At the top level the clone is
    ExecuTorch's own copy kernel, one copy of the value per call.
    """
    xnnpack = _xnnpack_tags(partition_tags)
    notes: list[str] = []
    if not xnnpack:
        return notes

    def leaves(node: Node, tag: str) -> bool:  # the output node carries no tag
        return any(user.meta.get(DELEGATION_TAG) != tag for user in node.users)

    for node in program.graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if tag not in xnnpack or not _is_value_copy(node) or not leaves(node, tag):
            continue
        value = node.all_input_nodes[0]
        computed_inside = value.op != "placeholder" and value.meta.get(DELEGATION_TAG) == tag
        if computed_inside and not leaves(value, tag):
            continue  # the partition returns the value once, in the clone's place
        del node.meta[DELEGATION_TAG]
        why = (f"the partition also returns {value.name}" if computed_inside
               else f"{value.name} enters the partition")
        notes.append(
            f"kept {node.name} (a copy of {value.name}) out of partition {tag!r}: XNNPACK "
            f"drops copies and {why}, so the delegate would return one value twice or "
            "pass an input through, which XNNPACK refuses")
    return notes


_INT32_RANGE = (torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max)


def _misread_grid(node: Node) -> torch.dtype | None:
    """The dtype of the grid ``node`` quantizes to or dequantizes from (torch's
    ``quantized_decomposed`` ops) when ExecuTorch's XNNPACK cannot compute on it, else None.

    XNNPACK computes on int8 grids and takes int32 ones as a GEMM's bias (the full int32
    range, zero point 0). Anything else it misreads: a uint8 grid is serialized as int8;
    a 16-bit grid (QnnQuantizer's 16a8w / 16a16w: int32 storage over [0, 65535], int16
    weights) as int32, which its serializer refuses for a zero point other than 0
    (``ValueError: Invalid quantization scale or zero point``)."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant

    if not (is_quant(node) or is_dequant(node)):
        return None
    args = [*node.args, *node.kwargs.values()]
    at = next((i for i, arg in enumerate(args) if isinstance(arg, torch.dtype)), None)
    if at is None:
        return None
    dtype = args[at]
    if dtype == torch.int8:
        return None
    if dtype == torch.int32 and tuple(args[at - 2:at]) == _INT32_RANGE:
        return None
    return dtype


def _on_misread_grid(node: Node) -> bool:
    """Whether ``node`` reads a value dequantized from, or is quantized to, a grid XNNPACK
    misreads (:func:`_misread_grid`)."""
    return any(_misread_grid(value) is not None for value in (*node.all_input_nodes, *node.users))


def _getitems_with_their_source(program: ExportedProgram, partition_tags: dict[str, Any]
                                ) -> list[str]:
    """Put each ``getitem`` in the partition of the multi-output node it reads (or at the
    top level with it), a note saying which moved, and drop the partitions left empty.

    ExecuTorch lowers a partition holding a ``getitem`` but not its ``split`` with the
    list as the delegate's input (which fails when it runs), and one holding the ``split``
    but not all its ``getitem`` nodes fails to lower (``RuntimeError: Tried to erase
    Node getitem_2 but it still had 3 users``)."""
    moved = getitems_follow_their_source(program.graph)
    if not moved:
        return []
    tagged = {node.meta.get(DELEGATION_TAG) for node in program.graph.nodes
              if node.op == "call_function"}
    for tag in [tag for tag in partition_tags if tag not in tagged]:
        del partition_tags[tag]
    names = ", ".join(node.name for node in moved)
    return [f"moved {names} to the partition of the multi-output node each reads (or the "
            "top level, with it): a delegate can neither take nor hand out a tuple"]


def _constant_inputs(program: ExportedProgram, state: set[str]) -> dict[str, str]:
    """The placeholders of ``program`` holding constants (parameters, buffers, lifted
    tensor constants), each with its FQN. A written parameter or buffer is state, not a
    constant, and so is a buffer in ``state`` (one another method writes)."""
    sig = program.graph_signature
    mutated = {*sig.buffers_to_mutate.values(), *sig.parameters_to_mutate.values(), *state}
    constants = {name: fqn for name, fqn in (*sig.inputs_to_parameters.items(),
                                             *sig.inputs_to_buffers.items())
                 if fqn not in mutated}
    constants.update(sig.inputs_to_lifted_tensor_constants)
    return constants


def _keep_misread_grids_out(
    program: ExportedProgram, partition_tags: dict[str, Any], state: set[str]
) -> list[str]:
    """Keep at the top level each XNNPACK partition computing on a grid it misreads (uint8,
    16-bit: :func:`_misread_grid`), and each value an XNNPACK partition computes from
    dequantized constants alone but hands out; a note each.

    ExecuTorch 1.5.1's XNNPACK serializer writes every per-tensor quantized value that is
    not int32 as ``qint8``, uint8 included (QnnQuantizer's activations): with a zero point
    above 127 the runtime fails to load the method (XNNPACK ``invalid_parameter``, error
    0x1), with one below it reads uint8 bytes as int8 and computes wrong values silently
    (``x + 1`` off by 1.0 on values of 1-5). Its partitioner takes such values all the same.
    XNNPACK's GEMM configs refuse a GEMM on uint8 activations, and leave the transpose of
    its dequantized weight in a partition, whose output XNNPACK then fails to load ("Failed
    to create static transpose"). Kept out, those ops run on ExecuTorch's portable kernels,
    which compute what the quantized program does. A 16-bit grid (QnnQuantizer's 16a8w /
    16a16w activations, int32 storage over [0, 65535]) it serializes as int32 and refuses
    while lowering (``ValueError: ... Found invalid zeropoint``); kept out alike.
    """
    xnnpack = _xnnpack_tags(partition_tags)
    notes: list[str] = []
    constants = _constant_inputs(program, state) if xnnpack else {}
    for tag in sorted(xnnpack):
        nodes = [node for node in program.graph.nodes if node.meta.get(DELEGATION_TAG) == tag]
        misread = next((node for node in nodes if _misread_grid(node) is not None), None)
        if misread is not None:
            if _misread_grid(misread) == torch.uint8:
                why = (f"it computes on a uint8 grid ({misread.name}), which ExecuTorch's "
                       "XNNPACK serializes as int8 (wrong values, or a method that fails to "
                       "load)")
            else:
                why = (f"it computes on a {_misread_grid(misread)} (not int8) grid "
                       f"({misread.name}), which ExecuTorch's XNNPACK refuses to serialize")
            kept = nodes
        else:
            kept = _constant_values_handed_out(nodes, tag, constants)
            why = ("they compute from dequantized constants alone and leave the partition "
                   "(XNNPACK left out the op using them), which XNNPACK fails to load")
        if not kept:
            continue
        for node in kept:
            del node.meta[DELEGATION_TAG]
        if all(node in kept for node in nodes):
            del partition_tags[tag]
        names = ", ".join(node.name for node in kept if node.op != "placeholder")
        notes.append(f"kept {names} out of XNNPACK partition {tag!r}: {why}; they run on "
                     "ExecuTorch's portable kernels")
    return notes


def _constant_values_handed_out(nodes: list[Node], tag: str, constants: Mapping[str, str]
                                ) -> list[Node]:
    """The nodes of partition ``tag`` (``nodes``, in graph order) computing from dequantized
    constants alone whose values no node of the partition uses but another one of them (a
    weight's ``dequantize`` -> ``permute`` whose GEMM stayed out), with the constants only
    they read."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant

    derived: set[Node] = set()
    for node in nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(
                value in derived or (value.op == "placeholder" and value.name in constants)
                for value in inputs) and (is_dequant(node) or any(v in derived for v in inputs)):
            derived.add(node)
    kept: list[Node] = []
    for node in reversed(nodes):
        if node in derived and not any(
                user.meta.get(DELEGATION_TAG) == tag and user not in kept for user in node.users):
            kept.append(node)
    for node in nodes:  # constants no node left in the partition reads
        if node.op == "placeholder" and node.name in constants and kept and not any(
                user.meta.get(DELEGATION_TAG) == tag and user not in kept for user in node.users):
            kept.append(node)
    return kept


def _untag_quantize(quantize: Node, tag: str) -> None:
    """Take ``quantize`` out of partition ``tag`` (it then runs at the top level), and its
    input too when that is a placeholder no other node of the partition reads."""
    del quantize.meta[DELEGATION_TAG]
    value = quantize.args[0]
    if value.op == "placeholder" and not any(
            user.meta.get(DELEGATION_TAG) == tag for user in value.users):
        value.meta.pop(DELEGATION_TAG, None)


def _unfolded_quantize(
    program: ExportedProgram, partition_tags: dict[str, Any], state: set[str]
) -> UnfoldedQuantizeError | None:
    """The error for the first quantize of a constant (not 0-d) an XNNPACK partition holds:
    ``convert_pt2e(fold_quantize=False)`` leaves weights so, and XNNPACK computes wrong
    values with them. (A 0-d constant's quantize is kept out instead, with the 0-d rule.)"""
    from executorch.backends.xnnpack.utils.quant_utils import is_quant

    xnnpack = _xnnpack_tags(partition_tags)
    if not xnnpack:
        return None
    # A written parameter is state, read as state is (quantized in the graph), not a weight
    # left unfolded; lowering refuses it as written (ParameterMutationOnExecuTorchError).
    constants = _constant_inputs(program, state)
    for node in program.graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if tag in xnnpack and is_quant(node) and isinstance(node.args[0], Node):
            value = node.args[0]
            if value.op == "placeholder" and value.name in constants and not _is_scalar(value):
                return UnfoldedQuantizeError(node.name, constants[value.name], tag)
    return None


def _warn_of_aborting_kernels(program: ExportedProgram, partition_tags: dict[str, Any]) -> None:
    """Warn of each node left at the top level whose portable kernel aborts the process
    on its dtype (see :mod:`passes.executorch.portable_kernels`)."""
    for node, op, side, dtype in aborting_kernels(program):
        if node.meta.get(DELEGATION_TAG) in partition_tags:
            continue
        warnings.warn(PortableKernelAbortWarning(
            node.name, dtype,
            f"{PASS_NAME}: {node.name} ({op}) stays at the top level, where ExecuTorch "
            f"1.5.1's portable quantized kernel runs it; {portable_kernel_abort(side, dtype)}"),
            stacklevel=3)


def _is_scalar(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _nonzero_elements(program: ExportedProgram) -> dict[str, int]:
    """Buffer FQN -> how many of its elements are not zero, for the real tensors of
    ``program`` (a fake one has no values)."""
    found = {}
    for fqn in program.graph_signature.inputs_to_buffers.values():
        value = buffer_tensor(program, fqn)
        if not isinstance(value, FakeTensor):
            found[fqn] = int(value.count_nonzero())
    return found


def _state_kept_off_device(program: ExportedProgram, fqn: str, backend: str | None,
                           keep_precision: bool = False) -> str | None:
    """Why buffer ``fqn`` stays at the top level rather than in ``backend``'s state: a
    dtype its state would not hold as it is, but the delegate can receive and return (None
    when the state holds it, or when nothing can: :func:`_state_on_device` raises). A
    float buffer the state would round stays only when ``keep_precision`` asks (else
    :func:`_state_on_device` warns)."""
    kept = _STATE_DTYPE.get(backend)
    value = buffer_tensor(program, fqn)
    if (kept is None or value.dtype == kept
            or value.dtype in _NO_INPUT_DTYPES.get(backend, ())):
        return None
    held, dtype = str(kept).split(".")[-1], str(value.dtype).split(".")[-1]
    if value.is_floating_point():
        if not keep_precision:
            return None
        return (f"keep_precision asks for it: {backend} keeps {held} state only, which "
                f"would round this {dtype} buffer; the delegate receives it and returns its "
                "new value instead")
    # What the (float) state would make of the values: it rounds an integer past its
    # mantissa, and turns a bool into 1.0 / 0.0 (no longer a mask).
    if value.dtype == torch.bool:
        lost = f"its True / False would be {held} 1.0 / 0.0"
    else:
        lost = f"an integer above {int(2 / torch.finfo(kept).eps)} is rounded"
    return (f"{backend} keeps {held} state only, which would not hold "
            f"this {dtype} buffer as it is ({lost}): the delegate receives it and "
            "returns its new value instead")


def _computes_in_fp16(spec: Any) -> bool:
    """Whether ``spec`` (a partition's delegation spec) is a Core ML one computing in fp16
    (its default)."""
    if getattr(spec, "backend_id", None) != COREML_BACKEND:
        return False
    import coremltools
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    precision = CoreMLBackend.model_compute_precision_from_compile_specs(spec.compile_specs)
    return precision == coremltools.precision.FLOAT16


def _state_on_device(
    program: ExportedProgram, verdict: BufferOwnership, backend: str | None,
    nonzero: Mapping[str, int],
) -> DelegateStateDtypeError | None:
    """Warn where ``backend``'s state will not hold the buffer as the program does; the
    error to raise where it cannot hold it at all. ``nonzero``: the non-zero element
    counts read before ExecuTorch made the state fake (used when ``program``'s is)."""
    kept = _STATE_DTYPE.get(backend)
    if kept is None and backend not in _ZERO_FILLED:
        return None
    value = buffer_tensor(program, verdict.fqn)
    if kept is not None and value.dtype != kept:
        if not value.is_floating_point() or value.dtype in _NO_INPUT_DTYPES.get(backend, ()):
            return DelegateStateDtypeError(
                verdict.fqn, verdict.owner_tag, backend, value.dtype, str(kept).split(".")[-1])
        warnings.warn(DelegateStateWarning(
            verdict.fqn, backend, "fp16",
            f"{PASS_NAME}: {backend} keeps {verdict.fqn!r} ({value.dtype}) as "
            f"{str(kept).split('.')[-1]} state on the device: its values are rounded there "
            f"(keep_precision=[{verdict.fqn!r}] keeps it {str(value.dtype).split('.')[-1]} "
            "at the top level)"), stacklevel=3)
    count = (nonzero.get(verdict.fqn, 0) if isinstance(value, FakeTensor)
             else int(value.count_nonzero()))
    if backend in _ZERO_FILLED and count:
        warnings.warn(DelegateStateWarning(
            verdict.fqn, backend, "initial value",
            f"{PASS_NAME}: {backend} zero-fills its state when the model is prewarmed, and "
            f"the initial value of {verdict.fqn!r} is not all zeros "
            f"({count} of {value.numel()} elements): it is lost on the "
            "device (require passes.conditions.ZeroInitialState to refuse such programs)"),
            stacklevel=3)
    return None


def _backend_id(partitioner: Partitioner) -> str | None:
    """The backend a partitioner delegates to, when it says (Core ML's does)."""
    return getattr(getattr(partitioner, "delegation_spec", None), "backend_id", None)


def _checked_partitioner(partitioner: Any) -> Partitioner:
    """``partitioner`` if it is a Partitioner instance; the class itself (an easy slip:
    ``BufferOwningPartitioner(XnnpackPartitioner)``) would fail deep inside ExecuTorch."""
    if isinstance(partitioner, type) and issubclass(partitioner, Partitioner):
        raise ExecuTorchInputError(
            PASS_NAME, "partitioner",
            f"got the class {partitioner.__name__}, not a partitioner; pass an instance: "
            f"{partitioner.__name__}()")
    if not isinstance(partitioner, Partitioner):
        raise ExecuTorchInputError(
            PASS_NAME, "partitioner",
            f"got {type(partitioner).__name__} {partitioner!r:.80}; pass an ExecuTorch "
            "Partitioner instance, e.g. XnnpackPartitioner()")
    return partitioner


def _checked_keep_precision(keep: Any) -> bool | frozenset[str]:
    """``keep`` as True, False or a frozenset of FQNs; a lone string (an easy slip for
    ``["acc"]``) or anything else is refused."""
    if isinstance(keep, bool):
        return keep
    if isinstance(keep, Collection) and not isinstance(keep, (str, bytes)) and all(
            isinstance(name, str) for name in keep):
        return frozenset(keep)
    hint = f"; for one buffer: keep_precision=[{keep!r}]" if isinstance(keep, str) else ""
    raise ExecuTorchInputError(
        PASS_NAME, "keep_precision",
        f"got {type(keep).__name__} {keep!r:.80}; pass True (every float buffer the backend "
        f"would round) or a collection of buffer FQNs{hint}")


def _checked_methods(methods: Any) -> dict[str, ExportedProgram] | None:
    if methods is None:
        return None
    methods = checked_methods(PASS_NAME, "methods", methods)
    # Memory planning (share_mutable_buffers=True) gives a buffer of one name one place for
    # every method, sized and initialized from one of them: methods disagreeing about it
    # would read each other's bytes as their own dtype or shape, or start from another's
    # initial value, and the .pte would be silently wrong.
    check_shared_buffers(methods, f"{PASS_NAME}(methods=...)")
    return methods


def executorch_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of a program lowered by ExecuTorch, by FQN: its own and its delegates'.

    A state reader for :func:`pass_manager.assert_same_behaviour` on
    ``lowered.exported_program()``: a buffer a delegate owns lives in that delegate's
    original program (which ExecuTorch's Python execution of the delegate updates).
    """
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    state = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    for sub in module.modules():
        if isinstance(sub, LoweredBackendModule):
            owned = sub.original_module
            for spec in owned.graph_signature.input_specs:
                if spec.kind == InputKind.BUFFER and spec.target in owned.state_dict:
                    state[spec.target] = owned.state_dict[spec.target].detach().clone()
                elif spec.kind == InputKind.BUFFER and spec.target in owned.constants:
                    state[spec.target] = owned.constants[spec.target].detach().clone()
    return state

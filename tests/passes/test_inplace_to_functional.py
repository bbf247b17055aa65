"""InplaceToFunctional: functional programs that behave like eager, call after call, on both
program forms; the ExportedProgram signature matches run_decompositions({}); unsupported
mutations are typed errors that leave the program unchanged."""

import copy
import operator

import pytest
import torch

from pass_manager import PassFailedError, PassManager, assert_same_behaviour, graph_of
from pass_manager import _rollback as rollback
from pass_manager.program import program_text
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    UnsupportedMutationError,
    conditions,
    mutable_buffers,
    register_functional_variant,
)
from passes.functional_variants import unregister_functional_variant

PIPELINE = [MarkMutableBuffers(), InplaceToFunctional()]


def functionalize(program):
    return PassManager(PIPELINE).run(program)


@pytest.mark.parametrize("form", ["exported", "module"])
def test_behaves_like_eager_for_four_calls(mutation_model, form):
    name, eager, calls, ep = mutation_model
    program = ep if form == "exported" else ep.module()
    result = functionalize(program)
    assert type(result.program) is type(program)
    assert_same_behaviour(eager, result.program, calls, calls=4)
    assert not conditions.Functional.check(result.program)
    assert not conditions.MutableBuffersMarked.check(result.program)
    assert result.report.records[1].modified == (name != "no_mutation")
    # Downstream passes (torchao) need meta["val"] on every node the pass created.
    missing = [n.name for n in graph_of(result.program).nodes
               if n.op == "call_function" and "val" not in n.meta]
    assert missing == []


def test_signature_matches_run_decompositions(mutation_model):
    _, _, _, ep = mutation_model
    reference = copy.deepcopy(ep).run_decompositions({}).graph_signature
    result = functionalize(ep).program
    result.validate()  # torch's own verifier accepts the rewritten program
    signature = result.graph_signature
    assert list(signature.buffers_to_mutate.values()) == list(reference.buffers_to_mutate.values())
    assert list(signature.user_inputs_to_mutate.values()) == list(
        reference.user_inputs_to_mutate.values())
    assert [s.kind for s in signature.output_specs] == [s.kind for s in reference.output_specs]


def test_kv_cache_graph_before_and_after(zoo):
    _, _, ep = zoo("kv_index_copy")
    gm = functionalize(ep.module()).program
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.index_copy_.default not in targets
    assert targets.count(torch.ops.aten.index_copy.default) == 2
    write_backs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert [n.args[0].target for n in write_backs] == [
        "layers.0.attn.k_cache", "layers.0.attn.v_cache"]
    assert all(n.next.op == "output" or n.next in write_backs for n in write_backs)
    # The new node keeps the provenance of the node it replaced.
    index_copy = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index_copy.default)
    assert "layers.0.attn" in str(index_copy.meta["nn_module_stack"])
    assert "index_copy_" in index_copy.meta["stack_trace"]


def test_reads_through_views_taken_before_the_write(zoo):
    eager, calls, ep = zoo("transpose_select")
    gm = functionalize(ep.module()).program
    scatter = [n for n in gm.graph.nodes if n.target is torch.ops.aten.select_scatter.default]
    assert len(scatter) == 1
    assert_same_behaviour(eager, gm, calls, calls=4)


def test_second_run_is_a_no_op(zoo):
    _, _, ep = zoo("many_writes")
    for program in (ep, ep.module()):
        once = functionalize(program).program
        again = PassManager([InplaceToFunctional()]).run(once)
        assert not again.modified


def test_runs_without_any_re_trace(zoo, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("InplaceToFunctional must not re-trace")

    # Exported before export is forbidden: the zoo exports on first use, and under xdist
    # this test may be the first on its worker to use the model.
    _, _, ep = zoo("view_zoo")
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", forbidden)
    monkeypatch.setattr(torch.export, "export", forbidden)
    monkeypatch.setattr(torch.fx.experimental.proxy_tensor, "make_fx", forbidden)
    monkeypatch.setattr(torch.fx.Interpreter, "run", forbidden)
    assert functionalize(ep).modified


def _assert_rejected(program, kind, node):
    before = program_text(program)
    with pytest.raises(UnsupportedMutationError) as info:
        InplaceToFunctional().call(program)
    assert info.value.kind == kind and info.value.node == node
    assert node in str(info.value) and "InplaceToFunctional" in str(info.value)
    assert program_text(program) == before  # the pass left the program exactly as it was
    return info.value


@pytest.mark.parametrize("form", ["exported", "module"])
def test_constant_write_is_a_typed_error_and_program_unchanged(form, constant_writer):
    ep = constant_writer
    program = ep if form == "exported" else ep.module()
    _assert_rejected(program, "writes-constant", "add_")
    with pytest.raises(PassFailedError) as info:  # through the manager: same error, chained
        PassManager([InplaceToFunctional()]).run(program)
    assert isinstance(info.value.__cause__, UnsupportedMutationError)


def test_possible_partial_overlap_is_rejected():
    # A hand-built graph without fake values: overlap of buf[1:] and buf[:-1] cannot be
    # ruled out (it is real here), so the pass must refuse rather than guess.
    root = torch.nn.Module()
    root.register_buffer("buf", torch.arange(6.0))
    graph = torch.fx.Graph()
    buf = graph.get_attr("buf")
    tail = graph.call_function(torch.ops.aten.slice.Tensor, (buf, 0, 1, 6))
    head = graph.call_function(torch.ops.aten.slice.Tensor, (buf, 0, 0, 5))
    graph.call_function(torch.ops.aten.add_.Tensor, (tail, head))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (buf, 2)),))
    gm = torch.fx.GraphModule(root, graph)
    error = _assert_rejected(gm, "overlap", "add__tensor")
    assert "slice" in error.reason


class WritesStateThenAConstant(torch.nn.Module):
    """Two buffer writes the pass rewrites, then a write it refuses (a lifted constant)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))
        self.c = torch.ones(3)

    def forward(self, x):
        self.b.add_(x)
        self.b.mul_(2)
        self.c.add_(self.b)
        return self.b + self.c


def _counting_records(monkeypatch):
    """Count the rollback records taken outside the core loop (by ``transaction``)."""
    taken = []

    def record(*args, **kwargs):
        taken.append(args[0])
        return real(*args, **kwargs)

    real = rollback.RollbackRecord
    monkeypatch.setattr(rollback, "RollbackRecord", record)
    return taken


@pytest.mark.parametrize("form", ["exported", "module"])
def test_a_refusal_after_rewritten_writes_leaves_the_program_as_it_was(form, monkeypatch):
    """The walk has rewritten add_ and mul_ when it meets the constant write: called
    directly, the pass restores the program with the manager's rollback record, so the
    program prints and runs as before (state included, several calls)."""
    calls = [(torch.full((3,), float(i)),) for i in range(3)]
    ep = torch.export.export(WritesStateThenAConstant(), copy.deepcopy(calls[0]))
    program = ep if form == "exported" else ep.module()
    marked = PassManager([MarkMutableBuffers()]).run(program).program
    reference, before = copy.deepcopy(marked), program_text(marked)
    taken = _counting_records(monkeypatch)
    with pytest.raises(UnsupportedMutationError) as info:
        InplaceToFunctional().call(marked)
    assert info.value.kind == "writes-constant" and len(taken) == 1
    assert program_text(marked) == before
    assert_same_behaviour(reference, marked, calls, calls=3)
    # Through the manager: its record is the only one, and it restores the program too.
    with pytest.raises(PassFailedError) as managed:
        PassManager([InplaceToFunctional()]).run(marked)
    assert isinstance(managed.value.__cause__, UnsupportedMutationError)
    assert len(taken) == 1 and program_text(marked) == before
    with pytest.raises(PassFailedError):
        InplaceToFunctional()(marked)  # torch-style call: the manager's transaction
    assert len(taken) == 1 and program_text(marked) == before
    assert_same_behaviour(reference, marked, calls, calls=3)


@torch.library.custom_op("mbp_test::scale_", mutates_args=("buf",))
def _scale_(buf: torch.Tensor, factor: float) -> None:
    buf.mul_(factor)


@_scale_.register_fake
def _(buf, factor):
    return None


@torch.library.custom_op("mbp_test::scaled", mutates_args=())
def _scaled(buf: torch.Tensor, factor: float) -> torch.Tensor:
    return buf * factor


@_scaled.register_fake
def _(buf, factor):
    return torch.empty_like(buf)


class CustomWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        torch.ops.mbp_test.scale_(self.b, 1.5)
        return self.b + x


def test_custom_op_falls_back_to_auto_functionalized_and_prefers_a_registered_variant():
    calls = [(torch.full((3,), float(i)),) for i in range(4)]
    ep = torch.export.export(CustomWrite(), calls[0])
    auto = torch.ops.higher_order.auto_functionalized
    for program in (ep, ep.module()):  # no variant registered: torch's own fallback
        result = functionalize(copy.deepcopy(program)).program
        assert_same_behaviour(CustomWrite(), result, calls, calls=4)
        assert auto in [n.target for n in graph_of(result).nodes]
    register_functional_variant(torch.ops.mbp_test.scale_.default,
                                torch.ops.mbp_test.scaled.default)
    try:
        for program in (ep, ep.module()):
            result = functionalize(copy.deepcopy(program)).program
            assert_same_behaviour(CustomWrite(), result, calls, calls=4)
            targets = [n.target for n in graph_of(result).nodes]
            assert torch.ops.mbp_test.scaled.default in targets and auto not in targets
    finally:
        unregister_functional_variant(torch.ops.mbp_test.scale_.default)


class SplitAndOut(torch.nn.Module):
    """An out= op with two outputs (written via getitem), a dtype-changing in-place update."""

    def __init__(self):
        super().__init__()
        self.register_buffer("low_", torch.zeros(3))
        self.register_buffer("high", torch.zeros(3))
        self.register_buffer("low", torch.zeros(3, dtype=torch.float16))

    def forward(self, x):
        torch.aminmax(x, dim=0, out=(self.low_, self.high))
        self.low.add_(x.sum(0))  # fp16 buffer += fp32 tensor: the result is cast back
        return self.low_ + self.high, self.low * 1


def test_multi_output_out_variant_and_dtype_cast():
    calls = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    ep = torch.export.export(SplitAndOut(), calls[0])
    for program in (ep, ep.module()):
        result = functionalize(copy.deepcopy(program)).program
        assert_same_behaviour(SplitAndOut(), result, calls, calls=4)
        targets = {n.target for n in graph_of(result).nodes}
        assert torch.ops.aten._to_copy.default in targets
        assert operator.getitem in targets


class NoGradWrite(torch.nn.Module):
    """A cache written under torch.no_grad(): export wraps it in a higher-order op."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            self.b.add_(x)
        return self.b * 2


def test_write_inside_no_grad_region_is_found_and_functionalized():
    calls = [(torch.full((3,), float(i)),) for i in range(4)]
    ep = torch.export.export(NoGradWrite(), calls[0])
    for program in (ep, ep.module()):
        marked = PassManager([MarkMutableBuffers()]).run(copy.deepcopy(program)).program
        assert list(mutable_buffers(marked)) == ["b"]
        result = PassManager([InplaceToFunctional()]).run(marked).program
        assert_same_behaviour(NoGradWrite(), result, calls, calls=4)
        assert torch.ops.higher_order.wrap_with_set_grad_enabled not in [
            n.target for n in graph_of(result).nodes]


class DynamicSlices(torch.nn.Module):
    """Writes through slices whose bounds are a dynamic dimension of the input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(16))
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x.sum(0))
        self.buf[: x.shape[0]].copy_(x[:, 0])
        self.buf.narrow(0, 1, x.shape[0]).mul_(2)
        return self.buf * self.acc.sum()


def test_dynamic_shapes():
    calls = [(torch.randn(n, 4, generator=torch.Generator().manual_seed(n)),) for n in (3, 5, 2, 7)]
    dims = ({0: torch.export.Dim("n", min=2, max=8)},)
    ep = torch.export.export(DynamicSlices(), calls[0], dynamic_shapes=dims)
    for program in (ep, ep.module()):
        result = functionalize(copy.deepcopy(program)).program
        assert_same_behaviour(DynamicSlices(), result, calls, calls=4)
    result.graph.lint()
    functionalize(ep).program.validate()


def test_registry_rejects_what_is_not_a_mutating_op():
    with pytest.raises(TypeError, match="OpOverload"):
        register_functional_variant(torch.add, torch.add)
    with pytest.raises(ValueError, match="writes none of its arguments"):
        register_functional_variant(torch.ops.aten.add.Tensor, torch.ops.aten.add.Tensor)


class _Holder:
    """A plain Python object holding a tensor, as transformers' ``StaticCache`` layers do."""

    def __init__(self, tensor):
        self.tensor = tensor


class _BufferWrittenThroughAnObject(torch.nn.Module):
    """Registers the held tensors as buffers (as transformers' old ExecuTorch recipe
    registers each cache layer's tensors) and reads and writes them through the plain
    object, through the buffer, or both: non-strict export lifts the object's tensors as
    constants beside the buffers. The counter is updated as ``StaticCache`` updates its
    ``cumulative_length``: ``copy_`` of the position, then ``to`` (itself, the same dtype)
    and ``add_`` on that."""

    def __init__(self):
        super().__init__()
        self.holder = _Holder(torch.zeros(4))
        self.counter = _Holder(torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", self.holder.tensor, persistent=False)
        self.register_buffer("steps", self.counter.tensor)
        self.register_buffer("seen", torch.zeros(4))
        self.seen_through = _Holder(self.seen)

    def forward(self, x, position):
        self.holder.tensor.add_(x)  # written through the object, read through the buffer
        self.seen.mul_(0.5).add_(x)  # written through the buffer, read through the object
        step = self.counter.tensor.copy_(position[0]).to(dtype=torch.int64, device=x.device)
        step.add_(1)
        return self.total * 2 + self.seen_through.tensor + self.counter.tensor


@pytest.mark.parametrize("form", ["exported", "module"])
def test_a_constant_that_is_a_buffers_tensor_is_read_and_written_as_that_buffer(form):
    """Non-strict export lifts a tensor reached through a plain object as a constant beside
    the buffer holding the very same tensor (transformers' old recipe exported with
    ``strict=False``: its cache layers' tensors), and writes the constant. It was refused
    (``writes-constant`` / ``shared-storage``); each such constant is now read and written
    as its buffer, exactly eager's state, and a counter updated through ``to`` of the
    constant's ``copy_`` is written (non-strict export's fake values share no storage
    there, so ``to`` read as a copy and its ``add_`` was lost: 2 where eager holds 3)."""
    model = _BufferWrittenThroughAnObject()
    example = (torch.ones(4), torch.tensor([0]))
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), example, strict=False)
    kinds = [spec.kind.name for spec in ep.graph_signature.input_specs]
    assert kinds.count("CONSTANT_TENSOR") == 3  # total, steps and seen, lifted beside them
    result = functionalize(ep if form == "exported" else ep.module())
    functional = result.program
    assert sorted(mutable_buffers(functional)) == ["seen", "steps", "total"]
    if form == "exported":
        specs = functional.graph_signature.input_specs
        assert "CONSTANT_TENSOR" not in {spec.kind.name for spec in specs}
        assert not functional.constants.keys() - {"total"}  # the non-persistent buffer
    assert "is the tensor of buffer 'total'" in "\n".join(result.report.records[1].notes)
    calls = [(torch.full((4,), float(i)), torch.tensor([i])) for i in range(1, 4)]
    assert_same_behaviour(model, functional, calls)


class _PartOfABufferWrittenThroughAnObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("whole", torch.zeros(4))
        self.holder = _Holder(self.whole[:2])  # a view of part of the buffer, not the buffer

    def forward(self, x):
        self.holder.tensor.add_(x)
        return self.whole * 2


def test_a_written_constant_sharing_part_of_a_buffers_storage_is_still_refused():
    """Only a constant that is exactly the buffer's tensor is the buffer: one viewing part
    of it stays a second input whose write the buffer's readers would not see."""
    with torch.no_grad():
        ep = torch.export.export(_PartOfABufferWrittenThroughAnObject(), (torch.ones(2),),
                                 strict=False)
    error = _assert_rejected(ep, "shared-storage", "c_lifted_tensor_0")
    assert "shares its storage with buffer 'whole'" in str(error)

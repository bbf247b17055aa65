"""exported_program_from: a graph module back into the ExportedProgram export gives, no trace.

Every program is run call after call against eager (or the program it came from) with
outputs, buffers and mutated inputs compared exactly; the signature and graph are checked
against the program ``ep.module()`` came from (the lift is its inverse) or against a
re-export of the same graph module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.validation import copy_program, first_difference, run_program
from passes import (
    InplaceToFunctional,
    LiftError,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    conditions,
    exported_program_from,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes.flow.examples import AnnotateEveryOpQuantizer, decoder_job
from passes.quantization import PassQuantizer
from tests.models.lifting import PrefillDecoder, StateKinds, prefill_calls, state_kinds_calls

aten = torch.ops.aten


def functional(program):
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def input_specs(program):
    return [(s.kind, s.arg.name, s.target, s.persistent)
            for s in program.graph_signature.input_specs]


def output_specs(program):
    return [(s.kind, s.target) for s in program.graph_signature.output_specs]


@pytest.mark.parametrize("with_like", [True, False], ids=["like", "no-like"])
def test_lifting_ep_module_gives_back_the_program(mutation_model, with_like):
    """The inverse of ``ep.module()`` on every model of the zoo, functionalized: the same
    signature, the same graph code, the same state objects, the same behaviour."""
    _, eager, calls, ep = mutation_model
    program = functional(ep)
    lifted = exported_program_from(program.module(), like=program if with_like else None)
    assert isinstance(lifted, torch.export.ExportedProgram)
    assert str(lifted.graph_signature) == str(program.graph_signature)
    assert lifted.graph_module.code == program.graph_module.code
    assert lifted.state_dict.keys() == program.state_dict.keys()
    assert all(lifted.state_dict[k] is v for k, v in program.state_dict.items())
    assert all(lifted.constants[k] is v for k, v in program.constants.items())
    assert lifted.call_spec == program.call_spec
    assert (lifted.example_inputs is not None) == with_like
    assert_same_behaviour(eager, lifted, calls, calls=4)
    assert_same_behaviour(program, lifted, calls, calls=4)


def test_the_graph_module_form_of_inplace_to_functional_lifts_to_its_program_form(zoo):
    """InplaceToFunctional on ``ep.module()`` leaves trailing write-backs; lifted, they are
    the mutation outputs InplaceToFunctional gives the ExportedProgram itself."""
    eager, calls, ep = zoo("many_writes")
    gm = functional(copy.deepcopy(ep).module())
    assert any(n.target is aten.copy_.default for n in gm.graph.nodes)
    lifted = exported_program_from(gm, like=ep)
    reference = functional(ep)
    assert output_specs(lifted) == output_specs(reference)
    assert input_specs(lifted) == input_specs(reference)
    assert OutputKind.USER_INPUT_MUTATION in {k for k, _ in output_specs(lifted)}
    assert not conditions.Functional.check(lifted)
    assert_same_behaviour(eager, lifted, calls, calls=4)


def test_a_non_functional_export_lifts_as_export_gave_it(zoo):
    """In-place writes other than trailing write-backs stay in place, unlisted, as export
    leaves them; the program still behaves like eager."""
    eager, calls, ep = zoo("view_zoo")
    lifted = exported_program_from(ep.module(), like=ep)
    assert str(lifted.graph_signature) == str(ep.graph_signature)
    assert lifted.graph_module.code == ep.graph_module.code
    assert conditions.Functional.check(lifted)  # the writes are still in place
    assert_same_behaviour(eager, lifted, calls, calls=4)


def test_state_kinds_order_names_and_mutations_match_a_re_export():
    """Parameters, then buffers, then constants, then user inputs, whatever the graph reads
    first; export's names; mutation outputs in input order; the same as torch.export on
    the same graph module, functionalized."""
    model, calls = StateKinds(), state_kinds_calls()
    ep = torch.export.export(copy.deepcopy(model), copy.deepcopy(calls[0]))
    gm = functional(ep).module()
    reads = gm.graph.find_nodes(op="get_attr")
    reads[0].prepend(next(n for n in reads if n.target == "acc"))  # the buffer read first ...
    gm.recompile()
    lifted = exported_program_from(gm)  # not a deep copy: that makes `scale` a buffer
    assert [(k, name) for k, name, _, _ in input_specs(lifted)] == [
        (InputKind.PARAMETER, "p_lin_weight"), (InputKind.PARAMETER, "p_lin_bias"),
        (InputKind.BUFFER, "b_acc"), (InputKind.BUFFER, "b_decay"),
        (InputKind.CONSTANT_TENSOR, "c_scale"),
        (InputKind.USER_INPUT, "x"), (InputKind.USER_INPUT, "y")]  # ... but lifted third
    assert "decay" in lifted.constants and "decay" not in lifted.state_dict  # non-persistent
    assert "scale" in lifted.constants
    reexported = functional(torch.export.export(gm, copy.deepcopy(calls[0])))
    assert input_specs(lifted) == input_specs(reexported)
    assert output_specs(lifted) == output_specs(reexported) == [
        (OutputKind.BUFFER_MUTATION, "acc"), (OutputKind.BUFFER_MUTATION, "decay"),
        (OutputKind.USER_INPUT_MUTATION, "y"), (OutputKind.USER_OUTPUT, None),
        (OutputKind.USER_OUTPUT, None)]
    assert_same_behaviour(model, lifted, calls, calls=4)
    assert_same_behaviour(reexported, lifted, calls, calls=4)


class BuiltinNamedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, input):  # a name fx renames in a graph (a Python builtin)
        self.acc.add_(input)
        return self.acc * 2


def test_an_input_named_like_a_builtin():
    """fx renames a placeholder called like a Python builtin (``input`` -> ``input_1``):
    the signature names the node as the graph calls it, state and inputs stay apart."""
    calls = [(torch.full((3,), float(i)),) for i in range(4)]
    program = functional(torch.export.export(BuiltinNamedInput(), calls[0]))
    lifted = exported_program_from(program.module(), like=program)
    assert [(k, name) for k, name, _, _ in input_specs(lifted)] == [
        (InputKind.BUFFER, "b_acc"), (InputKind.USER_INPUT, "input_1")]
    assert_same_behaviour(BuiltinNamedInput(), lifted, calls, calls=4)


def test_a_graph_called_with_flat_arguments(zoo):
    """Without ep.module()'s pytree codegen, the graph's placeholders are the arguments
    and its output the result: the program is called the same way."""
    eager, calls, ep = zoo("counters")
    gm = functional(ep).module()
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    lifted = exported_program_from(gm)
    assert lifted.call_spec.in_spec == torch.utils._pytree.tree_structure(((0,), {}))
    assert_same_behaviour(eager, lifted, calls, calls=4)


def test_the_graph_module_is_not_changed(zoo):
    _, calls, ep = zoo("counters")
    gm = functional(ep).module()
    code, nodes = gm.code, [(n.name, n.op, n.target, dict(n.meta)) for n in gm.graph.nodes]
    before = run_program(gm, calls)
    exported_program_from(gm)
    assert gm.code == code
    assert [(n.name, n.op, n.target, dict(n.meta)) for n in gm.graph.nodes] == nodes
    assert first_difference(before, run_program(gm, calls)) is None


@pytest.fixture(scope="module")
def quantized_decoder():
    """A one-layer decoder through the passes' quantization flow, converted with folding:
    the GraphModule the main job re-exports."""
    model, example, steps = decoder_job(n_layers=1, steps=5)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), example, strict=True)
    program = functional(ep)
    quantizer = PassQuantizer(AnnotateEveryOpQuantizer(), transform=[MarkMutableBuffers()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(copy_program(program).module(), quantizer)
    with torch.no_grad():
        for args in steps:
            prepared(*args)
    reset_mutable_buffers(prepared)
    converted = PassManager([UnfreezeMutableBuffer()]).run(convert_pt2e(prepared)).program
    return model, example, steps, program, converted


def test_a_quantized_graph_module_lifts_like_its_re_export(quantized_decoder):
    """torchao's converted graph: frozen weights and (de)quantize nodes without fake values.
    The lift has the re-export's inputs exactly, the outputs the re-export has once
    functionalized, and computes what both compute, call after call."""
    _, example, steps, program, converted = quantized_decoder
    assert any("val" not in n.meta for n in converted.graph.nodes if n.op == "call_function")
    lifted = exported_program_from(copy_program(converted), like=program)
    with torch.no_grad():
        reexported = torch.export.export(copy_program(converted), example, strict=True)
    assert input_specs(lifted) == input_specs(reexported)
    refunctional = functional(copy_program(reexported))
    assert output_specs(lifted) == output_specs(refunctional)
    assert list(lifted.graph_signature.buffers_to_mutate.values()) == [
        "layers.0.attn.k_cache", "layers.0.attn.v_cache"]
    assert all("val" in n.meta for n in lifted.graph.nodes if n.op != "output")
    assert first_difference(run_program(reexported, steps), run_program(lifted, steps)) is None
    assert first_difference(run_program(converted, steps), run_program(lifted, steps)) is None
    # Already functional: the pipeline the main job runs after its re-export changes nothing.
    assert not PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        copy_program(lifted)).modified


def test_the_missing_fake_values_are_those_torch_propagates(quantized_decoder):
    """The values given to the nodes torchao left without one (most by their ops' Meta
    kernels) have the shape, strides, dtype and device torch's FakeTensorProp gives them."""
    _, _, _, program, converted = quantized_decoder
    missing = {n.name for n in converted.graph.nodes if n.op == "call_function"
               and "val" not in n.meta and n.target is not aten.copy_.default}
    lifted = exported_program_from(copy_program(converted), like=program)
    ours = {n.name: n.meta["val"] for n in lifted.graph.nodes if n.name in missing}
    assert len(ours) == len(missing) > 50
    placeholders = lifted.graph.find_nodes(op="placeholder")
    mode = detect_fake_mode([p.meta["val"] for p in placeholders])
    propagated = copy_program(lifted).graph_module
    FakeTensorProp(propagated, mode).propagate_dont_convert_inputs(
        *[p.meta["val"] for p in placeholders])
    torchs = {n.name: n.meta["val"] for n in propagated.graph.nodes if n.name in missing}

    def layout(v):
        return tuple(v.shape), v.stride(), v.dtype, v.device, type(v).__name__

    assert {k: layout(v) for k, v in ours.items()} == {k: layout(v) for k, v in torchs.items()}


def test_frozen_constants_get_the_fake_values_from_tensor_gives(quantized_decoder):
    """convert's frozen constants come without fake values: each lifted one has the
    layout, device and type the fake mode's ``from_tensor`` gives the tensor."""
    _, _, _, program, converted = quantized_decoder
    frozen = {n.target for n in converted.graph.find_nodes(op="get_attr")
              if "val" not in n.meta}
    lifted = exported_program_from(copy_program(converted), like=program)
    values = dict(zip([s.target for s in lifted.graph_signature.input_specs],
                      [p.meta["val"] for p in lifted.graph.find_nodes(op="placeholder")],
                      strict=True))
    assert len(frozen) > 3 and frozen <= values.keys()
    mode = detect_fake_mode(list(values.values()))

    def layout(v):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device,
                v.requires_grad, type(v).__name__)

    assert {t: layout(values[t]) for t in frozen} == {
        t: layout(mode.from_tensor(lifted.constants.get(t, lifted.state_dict.get(t)),
                                   static_shapes=True)) for t in frozen}


class SharedStorageConstants(nn.Module):
    """Two constants on one storage, neither a view (``set_``), and one on its own."""

    def __init__(self):
        super().__init__()
        self.w = torch.arange(8.0)
        self.v = torch.empty(0).set_(self.w.untyped_storage(), 0, (2, 4), (4, 1))
        self.u = torch.linspace(0, 1, 8)

    def forward(self, x):
        return x * self.w + self.v.sum(0).repeat(2) + self.u


def test_constants_sharing_a_storage_keep_sharing_it_in_their_fake_values():
    """A constant without a fake value gets one sharing its storage with those of the other
    state on its storage, as ``from_tensor`` (and export) make them."""
    calls = [(torch.full((8,), float(i)),) for i in range(3)]
    ep = torch.export.export(SharedStorageConstants(), calls[0])
    gm = ep.module()
    for node in gm.graph.find_nodes(op="get_attr"):
        del node.meta["val"]  # as convert leaves a frozen constant
    lifted = exported_program_from(gm, like=ep)
    values = {s.target: p.meta["val"] for s, p in zip(
        lifted.graph_signature.input_specs, lifted.graph.find_nodes(op="placeholder"),
        strict=True)}
    storage = {t: StorageWeakRef(values[t].untyped_storage()) for t in ("w", "v", "u")}
    assert storage["w"] == storage["v"] != storage["u"]
    assert_same_behaviour(SharedStorageConstants(), lifted, calls, calls=3)


def test_a_lifted_program_keeps_its_marks_and_shares_its_state(quantized_decoder):
    _, _, steps, program, converted = quantized_decoder
    converted = copy_program(converted)
    lifted = exported_program_from(converted, like=program)
    cache = "layers.0.attn.k_cache"
    assert lifted.state_dict[cache] is converted.get_buffer(cache)
    assert sorted(mutable_buffers(lifted)) == [cache, "layers.0.attn.v_cache"]
    module = lifted.module()
    with torch.no_grad():
        for args in steps:
            module(*args)
    assert lifted.state_dict[cache].abs().sum() > 0  # the runs wrote the shared cache
    assert sorted(reset_mutable_buffers(lifted)) == [cache, "layers.0.attn.v_cache"]
    assert lifted.state_dict[cache].abs().sum() == 0


def test_dynamic_shapes_keep_their_ranges():
    """A prefill of four positions, then one position per call: ``like`` gives the user's
    ranges; without it each size is ranged as its shape environment bounds it."""
    model, calls = PrefillDecoder(), prefill_calls()
    positions = torch.export.Dim("positions", min=1, max=16)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), calls[0], strict=True,
                                 dynamic_shapes=({1: positions}, {0: positions}))
    program = functional(ep)
    lifted = exported_program_from(copy_program(program).module(), like=program)
    assert lifted.range_constraints == program.range_constraints
    assert_same_behaviour(model, lifted, calls, calls=4)
    alone = exported_program_from(copy_program(program).module())
    assert alone.range_constraints.keys() == program.range_constraints.keys()
    (symbol,) = alone.range_constraints
    assert alone.range_constraints[symbol].upper == 16
    assert_same_behaviour(model, alone, calls, calls=4)


# ----- what only a trace could lift: typed errors, the graph module left as it was


class TwoBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(2, 4))
        self.register_buffer("b", torch.zeros(2, 4))

    def forward(self, x):
        self.a.add_(x)
        self.b.add_(x * 2)
        return self.a + self.b


def _write_backs_module():
    ep = torch.export.export(TwoBuffers(), (torch.ones(4),))
    return functional(ep).module()


def _write_backs(gm):
    return [n for n in gm.graph.nodes if n.target is aten.copy_.default]


def _state_read(gm, target):
    return next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target)


def _refused(gm, match, node):
    code = gm.code
    with pytest.raises(LiftError, match=match) as info:
        exported_program_from(gm)
    assert info.value.node == node
    assert gm.code == code
    return info.value


def test_refuses_a_state_written_back_twice():
    gm = _write_backs_module()
    first = _write_backs(gm)[0]
    with gm.graph.inserting_before(gm.graph.output_node()):
        again = gm.graph.call_function(aten.copy_.default, first.args)
    gm.recompile()
    _refused(gm, "written back twice", again.name)


def test_refuses_a_write_back_of_a_view_of_written_state():
    gm = _write_backs_module()
    write_a, _ = _write_backs(gm)
    with gm.graph.inserting_before(write_a):
        view = gm.graph.call_function(aten.view.default, (_state_read(gm, "b"), [2, 4]))
    write_a.args = (write_a.args[0], view)
    gm.recompile()
    _refused(gm, "a view of b, which is itself written back", write_a.name)


def test_refuses_a_broadcasting_write_back():
    gm = _write_backs_module()
    write_a, _ = _write_backs(gm)
    write_a.args = (write_a.args[0], gm.graph.find_nodes(op="placeholder")[0])  # x: (4,)
    gm.recompile()
    _refused(gm, r"copies a torch.float32 \(4,\) value .* into a torch.float32 \(2, 4\)",
             write_a.name)


def test_refuses_a_write_to_a_constant():
    gm = _write_backs_module()
    value = gm.a
    delattr(gm, "a")
    gm.a = value  # the written tensor is now a plain attribute: a constant to export
    write_a, _ = _write_backs(gm)
    _refused(gm, "writes the constant 'a'", write_a.name)


def test_refuses_a_call_into_a_submodule():
    gm = _write_backs_module()
    gm.add_submodule("act", nn.ReLU())
    node = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.users)
    with gm.graph.inserting_after(node):
        call = gm.graph.call_module("act", (node,))
    call.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
    gm.recompile()
    _refused(gm, "call_module 'act': export would trace into it", call.name)


def test_refuses_an_op_export_would_have_decomposed():
    gm = _write_backs_module()
    node = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.users)
    with gm.graph.inserting_after(node):
        relu = gm.graph.call_function(torch.relu, (node,))
    relu.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(relu, delete_user_cb=lambda user: user is not relu)
    gm.recompile()
    _refused(gm, "not an allowed operator type", relu.name)


def test_refuses_inputs_without_fake_values():
    gm = torch.fx.symbolic_trace(StateKinds())
    _refused(gm, "has no fake value", "x")


def test_refuses_a_like_called_differently(zoo):
    _, _, ep = zoo("counters")
    _, _, other = zoo("many_writes")
    gm = functional(ep).module()
    with pytest.raises(LiftError, match="not called like `like`"):
        exported_program_from(gm, like=other)

"""Rollback of meta: objects held in node meta are copied unless a pass's effects exclude
``edits_meta_in_place``; either way a failing pass is undone exactly, and under
``strict=True`` a broken declaration is an EffectsError."""

import copy

import pytest
import torch
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    SharedQuantizationSpec,
)

from pass_manager import (
    Effects,
    EffectsError,
    PassFailedError,
    PassManager,
    function_pass,
    graph_of,
)
from pass_manager.program import program_text

from ..conftest import targets

QSPEC = QuantizationSpec(dtype=torch.int8, observer_or_fake_quant_ctr=torch.nn.Identity)


def annotate(program):
    """A quantizer's annotations on every call_function node, plus a nested list entry."""
    for node in graph_of(program).nodes:
        if node.op == "call_function":
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={a: QSPEC for a in node.all_input_nodes},
                output_qspec=QSPEC,
                _annotated=True,
            )
            node.meta["custom"] = {"tags": ["a"]}


def meta_state(program):
    """Every node's meta as plain values: annotations by their fields (nodes by name)."""
    state = []
    for node in graph_of(program).nodes:
        entries = {}
        for key, value in node.meta.items():
            if isinstance(value, QuantizationAnnotation):
                value = (
                    sorted((a.name, repr(q)) for a, q in value.input_qspec_map.items()),
                    repr(value.output_qspec),
                    value.allow_implicit_sharing,
                    value._annotated,
                )
            elif key == "custom":
                value = copy.deepcopy(value)
            entries[key] = value if key in ("quantization_annotation", "custom") else id(value)
        state.append((node.name, node.op, str(node.target), str(node.args), entries))
    return state


def edit_everything(program):
    """Edits annotations and nested meta in place, args and graph structure."""
    graph = graph_of(program)
    relu = targets(program, "relu")[0]
    for node in graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if annotation is not None:
            for arg in list(annotation.input_qspec_map):
                annotation.input_qspec_map[arg] = SharedQuantizationSpec(arg)
            annotation.output_qspec = None
            annotation._annotated = False
            node.meta["custom"]["tags"].append("b")
    relu.meta["quantization_annotation"].input_qspec_map.clear()
    with graph.inserting_after(relu):
        neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    mul = targets(program, "mul")[0]
    mul.args = (mul.args[0], 3.0)


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_a_failing_pass_that_edits_annotations_in_place_is_undone_exactly(form, request):
    program = request.getfixturevalue(form)
    annotate(program)
    before, text = meta_state(program), program_text(program)

    def edits_then_fails(program):
        edit_everything(program)
        raise RuntimeError("boom")

    with pytest.raises(PassFailedError):
        PassManager([edits_then_fails]).run(program)  # undeclared: meta objects copied
    assert program_text(program) == text
    assert meta_state(program) == before


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_a_failing_pass_declaring_no_in_place_edits_is_undone_exactly(form, request):
    program = request.getfixturevalue(form)
    annotate(program)
    before, text = meta_state(program), program_text(program)

    def replaces_then_fails(program):
        for node in graph_of(program).nodes:
            annotation = node.meta.get("quantization_annotation")
            if annotation is not None:
                new = copy.copy(annotation)
                new.input_qspec_map = {a: SharedQuantizationSpec(a) for a in new.input_qspec_map}
                new.output_qspec = None
                node.meta["quantization_annotation"] = new
                node.meta["custom"] = {"tags": ["replaced"]}
        node = targets(program, "relu")[0]
        node.args = (node.args[0],)
        graph_of(program).erase_node(next(n for n in graph_of(program).nodes
                                          if n.op == "output"))
        raise RuntimeError("boom")

    declared = function_pass(replaces_then_fails, effects=Effects.rewrite(in_place=None))
    with pytest.raises(PassFailedError):
        PassManager([declared]).run(program)
    assert program_text(program) == text
    assert meta_state(program) == before


def test_strict_turns_an_undeclared_in_place_edit_into_a_typed_error(traced):
    annotate(traced)
    before, text = meta_state(traced), program_text(traced)

    def edits(program):
        targets(program, "relu")[0].meta["quantization_annotation"].output_qspec = None

    declared = function_pass(edits, effects=Effects.rewrite(in_place=None), name="edits")
    with pytest.raises(EffectsError) as info:
        PassManager([declared], strict=True).run(traced)
    error = info.value
    assert error.pass_name == "edits" and error.rolled_back
    assert any("quantization_annotation" in e and "relu" in e for e in error.edits)
    assert error.kind == "edits_meta_in_place"
    assert program_text(traced) == text and meta_state(traced) == before


def test_replacing_meta_objects_is_what_the_declaration_allows(traced):
    annotate(traced)

    def replaces(program):
        node = targets(program, "relu")[0]
        new = copy.copy(node.meta["quantization_annotation"])
        new.output_qspec = None
        node.meta["quantization_annotation"] = new

    declared = function_pass(replaces, effects=Effects.rewrite(in_place=None), name="replaces")
    result = PassManager([declared], strict=True).run(traced)
    assert result.modified
    assert targets(traced, "relu")[0].meta["quantization_annotation"].output_qspec is None


def test_strict_undoes_and_names_an_in_place_edit_of_a_module_stack(exported):
    """Provenance entries are kept by reference (a pass replaces them); under strict=True a
    pass editing one in place is undone and named like any other meta object (it was left
    edited: every node's nn_module_stack emptied after the rollback)."""
    stacks = {n.name: dict(n.meta["nn_module_stack"]) for n in graph_of(exported).nodes
              if "nn_module_stack" in n.meta}
    assert stacks

    def clears_stacks_then_fails(program):
        for node in graph_of(program).nodes:
            node.meta.get("nn_module_stack", {}).clear()
        raise RuntimeError("boom")

    with pytest.raises(PassFailedError):
        PassManager([clears_stacks_then_fails], strict=True).run(exported)
    assert {n.name: n.meta["nn_module_stack"] for n in graph_of(exported).nodes
            if "nn_module_stack" in n.meta} == stacks

    def clears_stacks(program):
        targets(program, "relu")[0].meta["nn_module_stack"].clear()

    declared = function_pass(clears_stacks, effects=Effects.rewrite(in_place=None),
                             name="clears_stacks")
    with pytest.raises(EffectsError) as info:
        PassManager([declared], strict=True).run(exported)
    assert info.value.kind == "edits_meta_in_place"
    assert any("nn_module_stack" in e and "relu" in e for e in info.value.edits)
    assert targets(exported, "relu")[0].meta["nn_module_stack"] == stacks["relu"]

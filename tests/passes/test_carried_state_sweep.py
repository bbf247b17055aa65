"""Carried state of other shapes and write forms (a sliding window shifted in place, an int64
counter, an SSM-style state returned with its input, a write through a transpose and a
narrow, two states in one dict input, a 0-d state, bool and int32 masks, state returned
unchanged, fp16 state written in place and also returned, one value into two states, two
states swapped, a state written with another's old value): functionalized,
made resident by InputsToBuffers, the programs behave like eager over several calls (outputs
and state, bit for bit), and BuffersToInputs gives back the program it started from; on
ExecuTorch's runtime the carried form (the runtime threading written inputs) and the resident
form both follow eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

from pass_manager import PassManager
from passes import BuffersToInputs, InplaceToFunctional, InputsToBuffers, MarkMutableBuffers
from passes.inputs_to_buffers import carried_buffers
from tests.models import state_shapes as shapes

FORMS = ["exported", "module"]
CALLS = 5


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def functional(case: shapes.Case, form: str):
    args, kwargs = case.inputs()
    ep = torch.export.export(case.model(), args, kwargs)
    program = ep if form == "exported" else ep.module()
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def runnable(program):
    return program.module() if isinstance(program, torch.export.ExportedProgram) else program


def eager_calls(case: shapes.Case, inputs=None):
    """Per call: the inputs eager was given, its outputs, and its state afterwards."""
    model, inputs = case.model(), case.inputs() if inputs is None else inputs
    calls = []
    for _ in range(CALLS):
        given = copy.deepcopy(inputs)
        # A clone: an output may be the state itself, which later calls write.
        out = pytree.tree_map(torch.clone, model(*inputs[0], **inputs[1]))
        inputs = case.thread(inputs, out)
        calls.append((given, out, [t.clone() for t in shapes.state_of(case, inputs)]))
    return calls


def leaves_equal(got, expected):
    torch.testing.assert_close(pytree.tree_leaves(got), pytree.tree_leaves(expected),
                               rtol=0, atol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(shapes.CASES))
def test_resident_state_behaves_like_eager_and_round_trips(name, form):
    case = shapes.CASES[name]
    program = functional(case, form)
    options = dict(case.options)
    if form == "module":  # a GraphModule keeps no example inputs: state would start as zeros
        options["initial_values"] = dict(zip(case.state, shapes.state_of(case, case.inputs()),
                                             strict=True))
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    assert sorted(carried_buffers(resident).values()) == sorted(case.state)
    module = runnable(resident)
    for given, out, state in eager_calls(case):
        got = module(*shapes.stateless(case, given)[0])
        returned = {int(o) for o in case.options.get("next_values", {}).values()}
        expected = [o for i, o in enumerate(pytree.tree_leaves(out)) if i not in returned]
        leaves_equal(got, expected)
        buffers = dict(module.named_buffers())
        leaves_equal([buffers[b] for b in case.state], state)

    # BuffersToInputs gives back the carried program: same calls, same outputs and state.
    back = PassManager([BuffersToInputs()]).run(resident).program
    if form == "exported":
        assert back.call_spec == program.call_spec
    first, second = runnable(program), runnable(back)
    inputs_first = case.inputs()
    inputs_second = copy.deepcopy(inputs_first)
    for _ in range(CALLS):
        out_first = first(*inputs_first[0], **inputs_first[1])
        out_second = second(*inputs_second[0], **inputs_second[1])
        leaves_equal(out_second, out_first)
        leaves_equal(inputs_second, inputs_first)
        inputs_first = case.thread(inputs_first, out_first)
        inputs_second = case.thread(inputs_second, out_second)


def runtime_steps(case: shapes.Case):
    """Eager's calls as the runtime gets them: state written in place passed as the same
    (initial) tensors every call, for the runtime to thread; returned state passed back."""
    first = case.inputs()
    steps, expected = [], []
    for given, out, state in eager_calls(case, copy.deepcopy(first)):
        if case.options.get("next_values"):
            steps.append(given)
        else:
            args = tuple(a if i in case.keep else first[0][i] for i, a in enumerate(given[0]))
            steps.append((args, first[1]))
        expected.append((out, state))
    return steps, expected


def close(got, expected):
    torch.testing.assert_close(pytree.tree_leaves(got), pytree.tree_leaves(expected),
                               rtol=1e-5, atol=1e-5)  # XNNPACK's fp32 kernels


@pytest.mark.parametrize("name", list(shapes.CASES))
def test_carried_and_resident_state_on_the_runtime_follow_eager(name):
    """The carried program on ExecuTorch's runtime (decode_on_runtime threading each input
    the program writes), and the resident one (state in the loaded program), over several
    calls: outputs and the threaded state follow eager."""
    pytest.importorskip("executorch")
    from passes.executorch import decode_on_runtime

    case = shapes.CASES[name]
    program = functional(case, "exported")
    resident = PassManager([InputsToBuffers(**case.options)]).run(program).program
    steps, expected = runtime_steps(case)
    returned = {int(o) for o in case.options.get("next_values", {}).values()}

    carried = decode_on_runtime(program, None, steps)
    for outputs, written, (out, state) in zip(carried.outputs, carried.carried, expected,
                                              strict=True):
        close(outputs, out)
        if not returned:
            close(list(written.values()), state)

    on_runtime = decode_on_runtime(resident, None, [shapes.stateless(case, s) for s in steps])
    for outputs, (out, _) in zip(on_runtime.outputs, expected, strict=True):
        close(outputs, [o for i, o in enumerate(pytree.tree_leaves(out)) if i not in returned])

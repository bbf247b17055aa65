"""BuffersToInputs: resident buffers become explicit inputs (written in place, or returned),
behaving like eager with the state threaded by hand; InputsToBuffers -> BuffersToInputs
gives back the program it started from, outputs and state bit for bit over several calls,
on both program forms."""

from __future__ import annotations

import collections
import copy
import io

import pytest
import torch
import torch.utils._pytree as pytree

from pass_manager import PassFailedError, PassManager
from passes import (
    BuffersToInputs,
    CarriedStateError,
    InplaceToFunctional,
    InputsToBuffers,
    MarkMutableBuffers,
    StateNameError,
)
from passes.inputs_to_buffers import carried_buffers
from tests.models import carried_state as models
from tests.models.accumulators import Accumulate
from tests.models.shared_values import TiedBuffers

FORMS = ["exported", "module"]
CALLS = 5


def functional(program):
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def exported(module, args, kwargs=None, form="exported"):
    ep = torch.export.export(module, args, kwargs or {})
    return functional(ep if form == "exported" else ep.module())


def runnable(program):
    return program.module() if isinstance(program, torch.export.ExportedProgram) else program


def round_trip(program, **options):
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    return PassManager([BuffersToInputs()]).run(resident)


def assert_same_calls(before, after, calls):
    """``before`` and ``after`` called with the same inputs (each its own copy of the state
    tensors, threaded the same way) give the same outputs and leave the same state."""
    first, second = runnable(before), runnable(after)
    for args, kwargs, thread in calls:
        state_first, state_second = copy.deepcopy((args, kwargs)), copy.deepcopy((args, kwargs))
        for _ in range(CALLS):
            out_first = first(*state_first[0], **state_first[1])
            out_second = second(*state_second[0], **state_second[1])
            # Leaves: HF's StaticCache and model outputs are pytrees, not known to assert_close.
            for a, b in ((out_second, out_first), (state_second, state_first)):
                torch.testing.assert_close(pytree.tree_leaves(a), pytree.tree_leaves(b),
                                           rtol=0, atol=0)
            state_first = thread(state_first, out_first)
            state_second = thread(state_second, out_second)


def _in_place(state, _):
    (x, *rest), kwargs = state
    return (x * 1.5 + 0.25, *rest), kwargs


def _returned_at(position, output):
    def thread(state, out):
        (x, *rest), kwargs = state
        rest[position - 1] = out[output]
        return (x * 1.5 + 0.25, *rest), kwargs
    return thread


@pytest.mark.parametrize("form", FORMS)
def test_in_place_inputs_round_trip_exactly(form):
    program = exported(models.InPlaceCache(), models.cache_inputs(), form=form)
    result = round_trip(program)
    assert "restored" in " ".join(result.report.records[0].notes)
    if form == "exported":
        assert result.program.graph_signature == program.graph_signature
        assert result.program.call_spec.in_spec == program.call_spec.in_spec
        torch.testing.assert_close(result.program.example_inputs, program.example_inputs)
    else:
        assert [p.name for p in result.program.graph.find_nodes(op="placeholder")] == [
            "x", "cache", "position"]
    assert_same_calls(program, result.program, [(models.cache_inputs(), {}, _in_place)])


class Cell(torch.nn.Module):
    """An RNN cell whose one output, a tensor (no tuple), is its state's next value."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + h * 0.5)


def _cell_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, generator=torch.Generator().manual_seed(8)), torch.zeros(4)


def _returned_alone(state, out):
    (x, _), kwargs = state
    return (x * 1.5 + 0.25, out), kwargs


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["scan", "window", "cell"])
def test_pairs_round_trip_exactly(form, case):
    """The cell's resident GraphModule lost its output spec, so BuffersToInputs took its
    signature for one changed since and made ``h`` a keyword written in place."""
    model, inputs, name, output, thread = {
        "scan": (models.SelectiveScan, models.scan_inputs, "h", "1", _returned_at(1, 1)),
        "window": (models.SlidingWindow, models.window_inputs, "window", "1",
                   _returned_at(1, 1)),
        "cell": (Cell, _cell_inputs, "h", "", _returned_alone)}[case]
    program = exported(model(), inputs(), form=form)
    result = round_trip(program, next_values={name: output})
    assert "restored" in " ".join(result.report.records[0].notes)
    assert_same_calls(program, result.program, [(inputs(), {}, thread)])


@pytest.mark.parametrize("form", FORMS)
def test_keyword_name_pairs_round_trip_exactly(form):
    args, kwargs = models.named_state_inputs()
    program = exported(models.NamedState(), args, kwargs, form=form)
    result = round_trip(program, pair_by_name=("past_key_values.", "present."))

    def thread(state, out):
        (x,), _ = state
        return (x * 1.5,), {"past_key_values": {"0.key": out["present.0.key"],
                                                "0.value": out["present.0.value"]}}
    assert_same_calls(program, result.program, [(args, kwargs, thread)])


@pytest.mark.parametrize("form", FORMS)
def test_created_state_round_trips_exactly(form):
    prompt = torch.randn(1, 3, models.DIM, generator=torch.Generator().manual_seed(5))
    program = exported(models.Prefill(), (prompt,), form=form)
    result = round_trip(program, created={"1": "cache", "2": "position"})
    assert "cache" not in dict(runnable(result.program).named_buffers())
    assert_same_calls(program, result.program, [((prompt,), {}, lambda s, _: s)])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("returned", [False, True])
def test_registered_buffers_become_inputs_and_behave_like_eager(form, returned):
    x = torch.randn(4, generator=torch.Generator().manual_seed(6))
    program = exported(Accumulate(), (x,), form=form)
    result = PassManager([BuffersToInputs(returned=returned)]).run(program)
    module = runnable(result.program)
    assert "acc" not in dict(module.named_buffers())
    eager = Accumulate()
    acc = torch.zeros(4)
    for step in range(CALLS):
        x = torch.full((4,), 0.5 * step - 1)
        expected = eager(x)
        if returned:
            out, acc = module(x, acc=acc)
        else:
            out = module(x, acc=acc)  # written in place
        assert torch.equal(out, expected)
        assert torch.equal(acc, eager.acc)


class PersistentAndNot(torch.nn.Module):
    """A persistent buffer (in the state dict) and a non-persistent one (a constant)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.total.mul_(0.5).add_(x)
        self.count.add_(1)
        return self.total * self.count


@pytest.mark.parametrize("form", FORMS)
def test_buffers_made_inputs_leave_the_state_and_come_back_resident(form):
    """BuffersToInputs then InputsToBuffers: the state dict and constants keep no stale copy
    of state that became an input (saved and lowered for nothing, and a buffer made again
    under its name collided with it), and the resident program runs as eager does."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(7))
    program = exported(PersistentAndNot(), (x,), form=form)
    as_inputs = PassManager([BuffersToInputs()]).run(program).program
    if form == "exported":
        assert not {"total", "count"} & (set(as_inputs.state_dict) | set(as_inputs.constants))
    resident = PassManager([InputsToBuffers()]).run(as_inputs).program
    module, eager = runnable(resident), PersistentAndNot()
    for step in range(CALLS):
        x = torch.full((4,), 0.5 * step - 1)
        assert torch.equal(module(x), eager(x))
        buffers = dict(module.named_buffers())
        assert torch.equal(buffers["total"], eager.total)
        assert torch.equal(buffers["count"], eager.count)


class Layers(torch.nn.Module):
    """Buffers of submodules, as every Hugging Face model has them: ``layers.0.acc``."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Accumulate(), Accumulate()])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("returned", [False, True])
def test_buffers_of_submodules_become_keywords_python_can_name(form, returned):
    """``layers.0.acc`` cannot be a parameter of forward: the generated code was a
    SyntaxError. The keyword is the FQN as an identifier."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(9))
    program = exported(Layers(), (x,), form=form)
    result = PassManager([BuffersToInputs(returned=returned)]).run(program)
    module = runnable(result.program)
    assert list(module._in_spec.children()[1].context) == ["layers_0_acc", "layers_1_acc"]
    assert "buffer 'layers.0.acc' -> input 'layers_0_acc'" in result.report.records[0].notes
    eager = Layers()
    state = {"layers_0_acc": torch.zeros(4), "layers_1_acc": torch.zeros(4)}
    for step in range(CALLS):
        x = torch.full((4,), 0.5 * step - 1)
        out = module(x, **state)
        if returned:
            out, *values = out
            state = dict(zip(state, values, strict=True))
        assert torch.equal(out, eager(x))
        assert torch.equal(state["layers_0_acc"], eager.layers[0].acc)
        assert torch.equal(state["layers_1_acc"], eager.layers[1].acc)


class NamedLikeItsInput(torch.nn.Module):
    """A buffer named as the forward's argument: buffer ``x``, input ``x``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("x", torch.zeros(4))

    def forward(self, x):
        self.x.add_(x)
        return self.x * 2


class NamedLikeAKeyword(torch.nn.Module):
    """A buffer named as a keyword input whose leaves are placeholders of other names:
    buffer ``state``, keyword ``state={"a": ...}`` (placeholder ``state_a``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x, *, state):
        self.state.add_(x)
        return self.state * 2 + state["a"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["positional", "keyword"])
def test_a_buffer_named_like_an_input_becomes_its_own_input(form, case):
    """The mutation output of buffer ``x`` was taken for one of input ``x`` (ExportedProgram:
    the buffer stayed resident and the signature said the caller's ``x`` is written);
    the keyword ``x`` (GraphModule) was a duplicate argument, a SyntaxError. Buffer
    ``state`` beside keyword ``state`` was too (on both forms: the ExportedProgram's
    ``module()`` raised it)."""
    model, kwargs, expected = {
        "positional": (NamedLikeItsInput, {}, ["x_1"]),
        "keyword": (NamedLikeAKeyword, {"state": {"a": torch.ones(4)}}, ["state", "state_1"]),
    }[case]
    program = exported(model(), (torch.ones(4),), kwargs, form=form)
    result = PassManager([BuffersToInputs()]).run(program).program
    module = runnable(result)
    assert list(module._in_spec.children()[1].context) == expected
    assert not dict(module.named_buffers())
    if form == "exported":
        assert [(s.kind.name, s.target) for s in result.graph_signature.output_specs] == [
            ("USER_INPUT_MUTATION", expected[-1]), ("USER_OUTPUT", None)]
    eager, state = model(), torch.zeros(4)
    for step in range(CALLS):
        x = torch.full((4,), 0.5 * step - 1)
        assert torch.equal(module(x.clone(), **kwargs, **{expected[-1]: state}),
                           eager(x, **kwargs))
        assert torch.equal(state, eager.get_buffer("x" if case == "positional" else "state"))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("named", [None, "a", "b"])
def test_tied_buffers_become_one_input(form, named):
    """One tensor registered as ``a`` and ``b``: both names become the one input (whichever
    was named, or the one export reads); neither stays resident with a stale value."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(8))
    program = exported(TiedBuffers(), (x,), form=form)
    options = {} if named is None else {"buffers": [named]}
    module = runnable(PassManager([BuffersToInputs(**options)]).run(program).program)
    assert not {"a", "b"} & set(dict(module.named_buffers(remove_duplicate=False)))
    (name,) = module._in_spec.children()[1].context  # the one keyword input
    assert named in (None, name)
    eager, state = TiedBuffers(), torch.zeros(4)
    for step in range(CALLS):
        x = torch.full((4,), 0.5 * step - 1)
        assert torch.equal(module(x, **{name: state}), eager(x))
        assert torch.equal(state, eager.a) and torch.equal(state, eager.b)


class NestedCache(torch.nn.Module):
    """A cache registered in a submodule (FQN ``attn.cache``), written at a position."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.register_buffer("cache", torch.zeros(4, 2))

    def forward(self, x, position):
        self.attn.cache.index_copy_(0, position, x)
        return self.attn.cache.sum(0)


@pytest.mark.parametrize("returned", [False, True])
def test_a_nested_buffer_becomes_a_keyword_torch_can_call_and_lower(returned):
    """``attn.cache`` became the keyword input ``attn.cache``: torch writes keyword inputs
    as parameters of the ``forward`` it generates, so ``ep.module()`` and
    ``run_decompositions`` (ExecuTorch's lowering) failed with ``SyntaxError: def
    forward(self, x, position, attn.cache)``. Now the keyword is ``attn_cache``, and the
    program, decomposed too, computes what eager does, call after call, with the state
    threaded by hand (written in place, or returned)."""
    model = NestedCache()
    calls = [(torch.full((1, 2), step + 1.0), torch.tensor([step])) for step in range(4)]
    with torch.no_grad():
        program = exported(copy.deepcopy(model), calls[0])
    result = PassManager([BuffersToInputs(returned=returned)]).run(program)
    eager = copy.deepcopy(model)
    for candidate in (result.program, result.program.run_decompositions({})):
        module, cache = candidate.module(), torch.zeros(4, 2)
        for x, position in calls:
            out = module(x, position, attn_cache=cache)
            if returned:
                out, cache = out
            assert torch.equal(out, eager(x, position)) and torch.equal(cache, eager.attn.cache)
        eager = copy.deepcopy(model)
    assert "buffer 'attn.cache' -> input 'attn_cache'" in result.report.records[0].notes


@pytest.mark.parametrize(("buffers", "name", "reason"), [
    (["cache"], "cache", "no buffer"),
    # A string was read letter by letter ('a', 'c', 'c'): one named "hh" moved buffer "h".
    ("acc", "acc", "one string"),
    # A mapping's values were dropped unread.
    ({"acc": "total"}, "buffers", "is a mapping"),
], ids=["no buffer", "a string", "a mapping"])
def test_a_name_that_is_no_buffer_is_refused(buffers, name, reason):
    program = exported(Accumulate(), (torch.ones(4),))
    before = copy.deepcopy(program)
    with pytest.raises(PassFailedError) as caught:
        PassManager([BuffersToInputs(buffers=buffers)]).run(program)
    error = caught.value.__cause__
    assert isinstance(error, StateNameError) and error.name == name and reason in error.reason
    assert "BuffersToInputs" in str(error)
    assert str(program.graph) == str(before.graph)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf(request):
    pytest.importorskip("transformers.exporters")
    from tests.models import hf_exporter

    return hf_exporter.export(request.param)


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_hf_exporters_programs_round_trip_exactly(hf, method):
    from tests.models import hf_exporter

    options = hf_exporter.resident_cache_options(hf)[method]
    program = functional(copy.deepcopy(getattr(hf, method)))
    result = round_trip(program, **options).program
    assert result.call_spec.in_spec == program.call_spec.in_spec
    assert result.call_spec.out_spec == program.call_spec.out_spec
    kwargs = getattr(hf, f"{method}_kwargs")
    # The decode advances its cache call after call; each prefill starts a fresh one.
    thread = (lambda s, _: s) if method == "decode" else (
        lambda s, _: ((), copy.deepcopy(kwargs)))
    assert_same_calls(program, result, [((), kwargs, thread)])


class _CarriedBesideResident(torch.nn.Module):
    """Two inputs written in place (``a``, ``b``) beside a resident counter ``r``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("r", torch.ones(4))

    def forward(self, x, a, b):
        a.add_(x)
        b.mul_(1.5)
        self.r.add_(1)
        return a + b * self.r


def _carried_inputs():
    return torch.linspace(-1, 1, 4), torch.zeros(4), torch.full((4,), 2.0)


@pytest.mark.parametrize("steps", [
    # Another buffer made an input after the run: its keyword joins the signature.
    [dict(), ["r"], ["a", "b"]],
], ids=["another buffer made an input since"])
@pytest.mark.parametrize("form", FORMS)
def test_a_record_is_not_restored_into_a_signature_changed_since(form, steps):
    """An InputsToBuffers record restores the signature before that run only while the
    program still has the one it left: restored into another (an input added or taken
    since), inputs went missing and the program could not be called. Then the buffers
    become keyword inputs, as any buffer does, and the program behaves like eager."""
    x, a, b = _carried_inputs()
    program = exported(_CarriedBesideResident(), (x, a, b), form=form)
    for step in steps:
        if isinstance(step, dict):
            if form == "module":  # no example inputs: start the buffers as eager's inputs
                step = {**step, "initial_values": {n: t for n, t in (("a", a), ("b", b)) if
                                                    n in step.get("buffers", ("a", "b"))}}
            program = PassManager([InputsToBuffers(**step)]).run(program).program
        else:
            result = PassManager([BuffersToInputs(buffers=step)]).run(program)
            program = result.program
    notes = " ".join(result.report.records[0].notes)
    assert "not restored" in notes and "before InputsToBuffers is restored" not in notes
    module, eager = runnable(program), _CarriedBesideResident()
    state = {"a": a.clone(), "b": b.clone()}
    if "r" in steps[1]:
        state["r"] = eager.r.clone()
    expected_a, expected_b = a.clone(), b.clone()
    for call in range(CALLS):
        x = torch.linspace(-1, 1, 4) * (call + 1)
        got = module(x, **state)
        expected = eager(x, expected_a, expected_b)
        torch.testing.assert_close(got if isinstance(got, torch.Tensor) else got[0],
                                   expected, rtol=0, atol=0)
        r = state["r"] if "r" in state else dict(module.named_buffers())["r"]
        for got_state, want in zip((state["a"], state["b"], r),
                                   (expected_a, expected_b, eager.r), strict=True):
            torch.testing.assert_close(got_state, want, rtol=0, atol=0)
    assert carried_buffers(program) == {}  # the record said ``a`` and ``b`` were buffers


@pytest.mark.parametrize("runs, undo", [
    ([["a"], ["b"]], [["a"], ["b"]]),
    ([["a", "b"]], [["b"], ["a"]]),
    ([["a"], ["b"]], [["b"], ["a"]]),
], ids=["runs undone out of order", "one run undone in parts", "runs undone in order"])
@pytest.mark.parametrize("form, saved", [("exported", False), ("exported", True),
                                         ("module", False)],
                         ids=["exported", "exported-saved and loaded", "module"])
def test_runs_undone_in_any_order_and_part_restore_the_signature(form, saved, runs, undo):
    """Buffers InputsToBuffers made resident come back to their place whatever the order
    and whichever part is made inputs, the others staying resident; each step's record
    names exactly the buffers still resident, and the program behaves like eager. Undone
    out of order, ``a`` became a keyword input and the records still said ``a`` (and, once
    ``b`` was undone, ``b``) were buffers; one run undone in parts, likewise."""
    x, a, b = _carried_inputs()
    program = exported(_CarriedBesideResident(), (x, a, b), form=form)
    spec = program.call_spec.in_spec if form == "exported" else program._in_spec
    step = copy.deepcopy(program)  # its own counter ``r``: the calls below advance it
    for run in runs:
        step = PassManager([InputsToBuffers(buffers=run, initial_values={
            n: {"a": a, "b": b}[n] for n in run})]).run(step).program
    resident = [n for run in runs for n in run]
    for names in undo:
        if saved:
            buffer = io.BytesIO()
            torch.export.save(step, buffer)
            buffer.seek(0)
            step = functional(torch.export.load(buffer))
        step = PassManager([BuffersToInputs(buffers=names)]).run(step).program
        resident = [n for n in resident if n not in names]
        assert sorted(carried_buffers(step).values()) == sorted(resident)
        if resident:  # ``x`` and the inputs back, in their places
            args = (step.call_spec.in_spec if form == "exported" else step._in_spec).child(0)
            assert args.num_leaves == 3 - len(resident)
    assert (step.call_spec.in_spec if form == "exported" else step._in_spec) == spec
    assert_same_calls(program, step, [((x, a, b), {}, _in_place)])


@pytest.mark.parametrize("case", ["one leaf of a namedtuple", "one output of two buffers"])
def test_a_part_that_cannot_come_back_alone_is_refused(case):
    """A buffer whose input was one leaf of a container that cannot lose leaves (a
    namedtuple), or whose next value one output returned for another buffer too, cannot be
    made an input while the other stays resident: a typed error names it."""
    if case == "one leaf of a namedtuple":
        program = exported(_NamedState(), (torch.ones(3), _Pair(torch.zeros(3),
                                                                torch.ones(3))))
        options, buffers, named = {}, ["s_a"], "s_b"
    else:
        program = exported(_OneValueTwice(), (torch.ones(3), torch.zeros(3), torch.zeros(3)))
        options, buffers, named = {"next_values": {"a": "1", "b": "1"}}, ["a"], "b"
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    with pytest.raises(CarriedStateError, match=f"BuffersToInputs: '{named}'"):
        BuffersToInputs(buffers).call(resident)
    assert sorted(carried_buffers(resident)) == sorted(["s_a", "s_b"] if named == "s_b" else
                                                       ["a", "b"])


_Pair = collections.namedtuple("_Pair", ["a", "b"])


class _NamedState(torch.nn.Module):
    def forward(self, x, s):
        s.a.add_(x)
        s.b.mul_(2.0)
        return s.a + s.b


class _OneValueTwice(torch.nn.Module):
    def forward(self, x, a, b):
        return x * 2, a + b + x


@pytest.mark.parametrize("form", FORMS)
def test_two_runs_are_undone_in_turn_by_one_run(form):
    """``a`` made resident by one InputsToBuffers run, ``b`` by the next: one BuffersToInputs
    of both gives back the signature before either, bit for bit in behaviour. It restored
    only the last run: ``a`` became a keyword input ``a`` after the others, and the first
    run's record stayed (``carried_buffers`` still said input ``a`` was a buffer)."""
    x, a, b = _carried_inputs()
    program = exported(_CarriedBesideResident(), (x, a, b), form=form)
    resident = copy.deepcopy(program)  # its own counter ``r``: the calls below advance it
    for name, value in (("a", a), ("b", b)):
        resident = PassManager([InputsToBuffers(
            buffers=[name], initial_values={name: value})]).run(resident).program
    result = PassManager([BuffersToInputs(buffers=["a", "b"])]).run(resident)
    back = result.program
    assert (back.call_spec.in_spec if form == "exported" else back._in_spec) == (
        program.call_spec.in_spec if form == "exported" else program._in_spec)
    assert carried_buffers(back) == {}
    assert result.report.records[0].statistics["written in place"] == 2
    assert_same_calls(program, back, [((x, a, b), {}, _in_place)])


@pytest.mark.parametrize("form", FORMS)
def test_the_programs_own_state_joins_the_restored_signature(form):
    """A program writing state of its own beside the carried state InputsToBuffers made
    resident (Phi3's longrope rewrites its rotary frequencies beside HF's cache): by default
    BuffersToInputs makes every written buffer an input, and the carried ones come back as
    they were, the program's own appended as a keyword. The record was dropped instead:
    ``a`` and ``b`` came back as keywords ``a``/``b`` after ``x``, no note said why, and
    the call ``program(x, a, b)`` that worked before InputsToBuffers failed."""
    x, a, b = _carried_inputs()
    program = exported(_CarriedBesideResident(), (x, a, b), form=form)
    options = {} if form == "exported" else {"initial_values": {"a": a, "b": b}}
    resident = PassManager([InputsToBuffers(**options)]).run(copy.deepcopy(program)).program
    result = PassManager([BuffersToInputs()]).run(resident)
    assert "the call signature before InputsToBuffers is restored" in result.report.records[
        0].notes
    back = result.program
    if form == "exported":
        args, kwargs = back.call_spec.in_spec.children()
        assert (args, kwargs.context) == (program.call_spec.in_spec.child(0), ["r"])
        assert [t.shape for t in pytree.tree_leaves(back.example_inputs)] == [(4,)] * 4
    eager = _CarriedBesideResident()
    got, expected = runnable(back), (a.clone(), b.clone())
    state, r = (a.clone(), b.clone()), eager.r.clone()
    for call in range(CALLS):
        x = torch.linspace(-1, 1, 4) * (call + 1)
        torch.testing.assert_close(got(x, *state, r=r), eager(x, *expected), rtol=0, atol=0)
        torch.testing.assert_close((*state, r), (*expected, eager.r), rtol=0, atol=0)


@pytest.mark.parametrize("form", FORMS)
def test_a_buffer_made_an_input_and_resident_again_starts_from_its_value(form):
    """BuffersToInputs then InputsToBuffers gives the buffer back its value on both forms:
    the ExportedProgram keeps it as the input's example, and a GraphModule, which keeps no
    example inputs, kept nothing: the counter ``r`` (ones) came back as zeros (a note said
    so) and every call's output and state differed."""
    x, a, b = _carried_inputs()
    program = exported(_CarriedBesideResident(), (x, a, b), form=form)
    as_input = PassManager([BuffersToInputs(buffers=["r"])]).run(copy.deepcopy(program))
    again = PassManager([InputsToBuffers(buffers=["r"])]).run(as_input.program)
    assert not any("zeros" in note for note in again.report.records[0].notes)
    first, second = runnable(program), runnable(again.program)
    first_state, second_state = (a.clone(), b.clone()), (a.clone(), b.clone())
    for call in range(CALLS):
        x = torch.linspace(-1, 1, 4) * (call + 1)
        torch.testing.assert_close(second(x, *second_state), first(x, *first_state),
                                   rtol=0, atol=0)
        torch.testing.assert_close(second_state, first_state, rtol=0, atol=0)
        torch.testing.assert_close(dict(second.named_buffers())["r"],
                                   dict(first.named_buffers())["r"], rtol=0, atol=0)


def saved_and_loaded(program):
    """``program`` through ``torch.export.save`` / ``load``, which keep no node meta: the
    loaded program needs MarkMutableBuffers again."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return functional(torch.export.load(buffer))


def _saved_cases():
    prompt = torch.randn(1, 3, models.DIM, generator=torch.Generator().manual_seed(5))
    return {
        "in place": (models.InPlaceCache(), models.cache_inputs(), {}, {}, _in_place),
        "pair": (models.SlidingWindow(), models.window_inputs(), {},
                 {"next_values": {"window": "1"}}, _returned_at(1, 1)),
        "keyword pairs": (models.NamedState(), *models.named_state_inputs(),
                          {"pair_by_name": ("past_key_values.", "present.")}, None),
        "created": (models.Prefill(), (prompt,), {}, {"created": {"1": "cache", "2": "position"}},
                    lambda s, _: s),
    }


@pytest.mark.parametrize("case", ["in place", "pair", "keyword pairs", "created"])
def test_the_record_survives_a_save_and_load(case):
    """The record InputsToBuffers leaves was kept in the graph module's meta only, which
    ``torch.export.save`` drops: after a load, BuffersToInputs made every buffer a keyword
    input (``window`` appended, its pair's output appended too). It is also kept as JSON where
    a save keeps it; the example inputs, which it does not keep, come back as the program's
    own with each restored input given its buffer's value."""
    model, args, kwargs, options, thread = _saved_cases()[case]
    program = exported(model, args, kwargs)
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    result = PassManager([BuffersToInputs()]).run(saved_and_loaded(resident))
    back = result.program
    assert "the call signature before InputsToBuffers is restored" in result.report.records[
        0].notes
    assert back.call_spec.in_spec == program.call_spec.in_spec
    assert back.call_spec.out_spec == program.call_spec.out_spec
    assert back.graph_signature.user_inputs == program.graph_signature.user_inputs
    assert back.graph_signature.user_outputs == program.graph_signature.user_outputs
    back.module()(*back.example_inputs[0], **back.example_inputs[1])  # a call it takes
    if thread is None:
        def thread(state, out):
            (x,), _ = state
            return (x * 1.5,), {"past_key_values": {"0.key": out["present.0.key"],
                                                    "0.value": out["present.0.value"]}}
    assert_same_calls(program, back, [(args, kwargs, thread)])


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_hf_exporters_programs_restore_after_a_save_and_load(method):
    """HF's ``StaticCache`` in the call spec is written and read back with the record."""
    pytest.importorskip("transformers.exporters")
    from tests.models import hf_exporter

    hf = hf_exporter.export("llama")
    options = hf_exporter.resident_cache_options(hf)[method]
    program = functional(copy.deepcopy(getattr(hf, method)))
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    back = PassManager([BuffersToInputs()]).run(saved_and_loaded(resident)).program
    assert back.call_spec.in_spec == program.call_spec.in_spec
    assert back.call_spec.out_spec == program.call_spec.out_spec
    kwargs = getattr(hf, f"{method}_kwargs")
    thread = (lambda s, _: s) if method == "decode" else (
        lambda s, _: ((), copy.deepcopy(kwargs)))
    assert_same_calls(program, back, [((), kwargs, thread)])


class _Unsaved:
    """A pytree container registered without ``serialized_type_name``: no call spec holding
    it can be written."""

    def __init__(self, state):
        self.state = state


pytree.register_pytree_node(
    _Unsaved, lambda c: ([c.state], None), lambda leaves, _: _Unsaved(leaves[0]),
    flatten_with_keys_fn=lambda c: ([(pytree.GetAttrKey("state"), c.state)], None))


class _InPlaceInContainer(torch.nn.Module):
    def forward(self, x, carried):
        carried.state.add_(x)
        return carried.state * 2


def test_a_record_a_save_cannot_keep_is_noted_after_the_load():
    program = exported(_InPlaceInContainer(), (torch.ones(3), _Unsaved(torch.zeros(3))))
    resident = PassManager([InputsToBuffers()]).run(program).program
    result = PassManager([BuffersToInputs()]).run(saved_and_loaded(resident))
    notes = " ".join(result.report.records[0].notes)
    assert "saved without InputsToBuffers' record" in notes and "_Unsaved" in notes
    assert result.program.graph_signature.user_inputs == ("x", "carried_state")

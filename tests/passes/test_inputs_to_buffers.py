"""InputsToBuffers: carried state (inputs written in place, input/output pairs, state a
prefill creates) becomes resident buffers; the programs then behave like eager with the state
threaded by hand, call after call, bit for bit, on both program forms; refusals are typed and
leave the program unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

from pass_manager import PassFailedError, PassManager, PreconditionError
from passes import (
    BuffersToInputs,
    CarriedStateError,
    InplaceToFunctional,
    InputsToBuffers,
    MarkMutableBuffers,
    StateNameError,
    StatePairingError,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes.inputs_to_buffers import carried_buffers
from tests.models import carried_state as models

FORMS = ["exported", "module"]
CALLS = 5


def functional(module, args, kwargs=None, form="exported"):
    """``module`` exported, marked and functionalized, in ``form``."""
    ep = torch.export.export(module, args, kwargs or {})
    program = ep if form == "exported" else ep.module()
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def resident(program, **options):
    return PassManager([InputsToBuffers(**options)]).run(program)


def runnable(program):
    return program.module() if isinstance(program, torch.export.ExportedProgram) else program


def buffers(module, names):
    found = dict(module.named_buffers())
    return {n: found[n].clone() for n in names}


def test_in_place_inputs_become_buffers_and_behave_like_eager(form="exported"):
    for form in FORMS:
        x, cache, position = models.cache_inputs()
        program = functional(models.InPlaceCache(), (x, cache.clone(), position.clone()),
                             form=form)
        result = resident(program)
        assert carried_buffers(result.program) == {"cache": "cache", "position": "position"}
        assert result.report.records[0].statistics["in place"] == 2
        module = runnable(result.program)
        eager = models.InPlaceCache()
        generator = torch.Generator().manual_seed(0)
        for _ in range(CALLS):
            x = torch.randn(1, 1, models.DIM, generator=generator)
            expected = eager(x, cache, position)  # eager threads its state in place
            assert torch.equal(module(x), expected)
            state = buffers(module, ["cache", "position"])
            assert torch.equal(state["cache"], cache)
            assert torch.equal(state["position"], position)  # the integer counter, exact
        assert set(mutable_buffers(result.program)) >= {"cache", "position"}


class ReservedNameState(torch.nn.Module):
    """State carried in an input named as a Python builtin (``list``), as torch.export keeps
    it and an fx graph copy would rename it (``list_1``)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, input, list):
        list.mul_(0.5).add_(self.linear(input))
        return list.sum(0)


def test_an_input_named_as_a_python_builtin_is_named_as_the_program_names_it():
    torch.manual_seed(0)
    model = ReservedNameState()
    eager, state = copy.deepcopy(model), torch.zeros(2, 3)
    program = functional(model, (torch.randn(2, 3), torch.zeros(2, 3)))
    with pytest.raises(PassFailedError):  # a refusal first: its rollback keeps the names
        resident(program, buffers={"no_such_input": "state"})
    result = resident(program, buffers={"list": "state"})
    assert carried_buffers(result.program) == {"list": "state"}
    module = runnable(result.program)
    generator = torch.Generator().manual_seed(1)
    for _ in range(CALLS):
        x = torch.randn(2, 3, generator=generator)
        assert torch.equal(module(x), eager(x, state))
        assert torch.equal(buffers(module, ["state"])["state"], state)


class _KeywordKeyedState(torch.nn.Module):
    """State in a dict keyed by Python keywords (``state["def"]``): a buffer ``state.def``
    is read as ``self.state.def``, which torch.fx's code does not compile."""

    def forward(self, x, state):
        state["def"].add_(x)
        state["class"].add_(state["def"] * 0.5)
        return state["def"] * state["class"]


@pytest.mark.parametrize("form", FORMS)
def test_state_keyed_by_a_python_keyword_gets_a_name_fx_can_write(form):
    """On base: the ExportedProgram's ``module()`` and the GraphModule's recompile raised
    ``SyntaxError`` (``state_def_1 = self.state.def``)."""
    state = {"def": torch.zeros(3), "class": torch.zeros(3)}  # a GraphModule's start too
    program = functional(_KeywordKeyedState(), (torch.ones(3),),
                         {"state": copy.deepcopy(state)}, form=form)
    result = resident(program)
    module = runnable(result.program)
    assert carried_buffers(result.program) == {"state_def": "state.def_",
                                               "state_class": "state.class_"}
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(3, generator=generator)
        assert torch.equal(module(x), _KeywordKeyedState()(x, state))
        assert torch.equal(buffers(module, ["state.def_"])["state.def_"], state["def"])
        assert torch.equal(buffers(module, ["state.class_"])["state.class_"], state["class"])
    error = _refused(program, CarriedStateError, buffers={"state.def": "state.def",
                                                          "state.class": "class_state"})
    assert error.name == "state.def" and "keyword" in error.reason


@pytest.mark.parametrize("form", FORMS)
def test_the_exported_program_keeps_no_trace_of_the_inputs(form):
    program = functional(models.InPlaceCache(), models.cache_inputs(), form=form)
    out = resident(program).program
    if form == "exported":
        kinds = {s.arg.name: s.kind.name for s in out.graph_signature.input_specs}
        assert [n for n, k in kinds.items() if k == "USER_INPUT"] == ["x"]
        assert out.call_spec.in_spec.num_leaves == 1
        assert len(pytree.tree_leaves(out.example_inputs)) == 1
        assert all(s.kind.name != "USER_INPUT_MUTATION" for s in out.graph_signature.output_specs)
        assert not out.graph_signature.buffers_to_mutate.keys() - {
            s.arg.name for s in out.graph_signature.output_specs}
    else:
        assert [p.name for p in out.graph.find_nodes(op="placeholder")] == ["x"]
    assert "cache" in dict(runnable(out).named_buffers())
    # Non-persistent, like HF's and ExecuTorch's caches: not in the state dict.
    assert "cache" not in runnable(out).state_dict()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["scan", "window"])
def test_pairs_by_mapping_behave_like_eager(form, case):
    model, inputs, state_name = {
        "scan": (models.SelectiveScan, models.scan_inputs, "h"),
        "window": (models.SlidingWindow, models.window_inputs, "window"),
    }[case]
    x, state = inputs()
    program = functional(model(), (x, state), form=form)
    result = resident(program, next_values={state_name: "1"})
    assert carried_buffers(result.program) == {state_name: state_name}
    module = runnable(result.program)
    eager = model()
    generator = torch.Generator().manual_seed(1)
    for _ in range(CALLS):
        x = torch.randn(*x.shape, generator=generator)
        expected, state = eager(x, state)  # eager threads the returned state
        got = module(x)
        got = got[0] if isinstance(got, tuple) else got
        assert torch.equal(got, expected)
        assert torch.equal(buffers(module, [state_name])[state_name], state)


class _StateWrittenThroughAnAlias(torch.nn.Module):
    """Writes its state through an alias and returns that alias's ``copy_``, as Qwen3-Next's
    gated delta net updates its recurrent state (``state.to(float32)``, the same dtype: the
    state itself; the new value ``copy_``-ed into it; the ``copy_`` returned as the cache)."""

    def forward(self, x, state):
        alias = state.to(torch.float32)
        new = alias * 0.5 + x
        returned = alias.copy_(new)
        return new.sum(-1), returned


@pytest.mark.parametrize("form", FORMS)
def test_state_written_through_an_alias_and_returned_by_its_copy_pairs(form):
    """Functionalized, the state's write is ``new`` and the returned value
    ``aten.copy(alias, new)``: the same elements (a whole copy of ``new``'s shape and dtype).
    The pair was refused ("writes it in place with add, but output '1' returns copy"), as
    was HF's Qwen3-Next decode."""
    state = torch.zeros(2, 4)
    program = functional(_StateWrittenThroughAnAlias(), (torch.ones(2, 4), state.clone()),
                         form=form)
    result = resident(program, next_values={"state": "1"})
    assert carried_buffers(result.program) == {"state": "state"}
    module, eager = runnable(result.program), _StateWrittenThroughAnAlias()
    generator = torch.Generator().manual_seed(3)
    for _ in range(CALLS):
        x = torch.randn(2, 4, generator=generator)
        expected, state = eager(x, state)
        state = state.clone()
        got = module(x)
        assert torch.equal(got[0] if isinstance(got, tuple) else got, expected)
        assert torch.equal(buffers(module, ["state"])["state"], state)


class _CacheReadBackThroughACast(torch.nn.Module):
    """Writes its cache in place, then reads it back through an op that keeps every element
    and returns what it read as the cache, as GPT-Neo's attention does (``key =
    key.to(torch.float32)`` after ``layer_past.update``: in fp32 eager returns the cache
    itself, and export records the cast as the returned cache)."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x, position, cache):
        cache.index_copy_(0, position, x)
        keys = self.read(cache)
        return (keys * 2).sum(0), keys


READS_KEEPING_EVERY_ELEMENT = {
    "same-dtype cast": lambda cache: cache.to(torch.float32),
    "contiguous": lambda cache: cache.contiguous(),
    "view of its own shape": lambda cache: cache.view(cache.shape),
    "clone": lambda cache: cache.clone(),
    # through other shapes and permutations back to its own: the same elements at the
    # same indices (refused as "output '1' returns slice" ... until followed)
    "full slice": lambda cache: cache[:],
    "flatten and view back": lambda cache: cache.flatten().view(6, 4),
    "unsqueeze and squeeze": lambda cache: cache.unsqueeze(0).squeeze(0),
    "transposed twice": lambda cache: cache.t().t(),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("read", list(READS_KEEPING_EVERY_ELEMENT))
def test_a_cache_written_in_place_and_returned_through_a_cast_pairs(read, form):
    """The in-place write is ``index_copy``, the returned cache ``to(index_copy)`` (or a
    ``contiguous``, a same-shape ``view``, a ``clone`` of it): the same elements. The pair
    was refused ("writes it in place with index_copy_default, but output '1' returns to"),
    as was HF's GPT-Neo decode."""
    eager = _CacheReadBackThroughACast(READS_KEEPING_EVERY_ELEMENT[read])
    cache = torch.zeros(6, 4)
    program = functional(eager, (torch.ones(1, 4), torch.tensor([0]), cache.clone()),
                         form=form)
    result = resident(program, next_values={"cache": "1"},
                      initial_values={"cache": cache.clone()})
    assert carried_buffers(result.program) == {"cache": "cache"}
    module = runnable(result.program)
    generator = torch.Generator().manual_seed(5)
    for step in range(CALLS):
        x, position = torch.randn(1, 4, generator=generator), torch.tensor([step])
        expected, cache = eager(x, position, cache)
        cache = cache.clone()
        got = module(x, position)
        assert torch.equal(got[0] if isinstance(got, tuple) else got, expected)
        assert torch.equal(buffers(module, ["cache"])["cache"], cache)


# Reads of the written cache that move its elements (a square cache, so shapes agree):
# still another value than the one written in place.
READS_MOVING_ELEMENTS = {
    "transposed": lambda cache: cache.t(),
    "transposed then reshaped": lambda cache: cache.t().reshape(4, 4),
    "reshaped, transposed, reshaped back": lambda cache: cache.view(2, 8).t().reshape(4, 4),
}


@pytest.mark.parametrize("read", list(READS_MOVING_ELEMENTS))
def test_a_cache_returned_with_its_elements_moved_is_refused(read):
    eager = _CacheReadBackThroughACast(READS_MOVING_ELEMENTS[read])
    program = functional(eager, (torch.ones(1, 4), torch.tensor([0]), torch.zeros(4, 4)),
                         form="module")
    error = _refused(program, StatePairingError, next_values={"cache": "1"})
    assert error.name == "cache" and "writes it in place" in error.reason


@pytest.mark.parametrize("form", FORMS)
def test_keyword_inputs_pair_with_outputs_by_name(form):
    args, kwargs = models.named_state_inputs()
    program = functional(models.NamedState(), args, kwargs, form=form)
    result = resident(program, pair_by_name=("past_key_values.", "present."),
                      buffers={"past_key_values.0.key": "kv.0.key",
                               "past_key_values.0.value": "kv.0.value"})
    assert carried_buffers(result.program) == {"past_key_values_0_key": "kv.0.key",
                                               "past_key_values_0_value": "kv.0.value"}
    module = runnable(result.program)
    eager = models.NamedState()
    past = kwargs["past_key_values"]
    generator = torch.Generator().manual_seed(2)
    for _ in range(CALLS):
        x = torch.randn(1, 1, models.DIM, generator=generator)
        expected = eager(x, past_key_values=past)
        past = {"0.key": expected["present.0.key"], "0.value": expected["present.0.value"]}
        got = module(x)
        assert list(got) == ["logits"]
        assert torch.equal(got["logits"], expected["logits"])
        state = buffers(module, ["kv.0.key", "kv.0.value"])
        assert torch.equal(state["kv.0.key"], past["0.key"])


@pytest.mark.parametrize("form", FORMS)
def test_prefill_created_state_is_shared_with_the_decode(form):
    prompt = torch.randn(1, 3, models.DIM, generator=torch.Generator().manual_seed(3))
    prefill = functional(models.Prefill(), (prompt,), form=form)
    x, cache, position = models.cache_inputs()
    decode = functional(models.Decode(), (x, cache, position), form=form)
    prefill = resident(prefill, created={"1": "cache", "2": "position"}).program
    decode = resident(decode).program
    assert carried_buffers(prefill) == {"output:1": "cache", "output:2": "position"}
    prefill_module, decode_module = runnable(prefill), runnable(decode)
    # One resident state: the decode's buffers are the prefill's.
    for name in ("cache", "position"):
        decode_module._buffers[name] = prefill_module.get_buffer(name)
    expected, cache, position = models.Prefill()(prompt)
    assert torch.equal(prefill_module(prompt)[0], expected)  # a returned tuple stays one
    eager = models.Decode()
    generator = torch.Generator().manual_seed(4)
    for _ in range(CALLS - 1):
        x = torch.randn(1, 1, models.DIM, generator=generator)
        assert torch.equal(decode_module(x), eager(x, cache, position))
        assert torch.equal(decode_module.get_buffer("cache"), cache)
        assert torch.equal(decode_module.get_buffer("position"), position)
    # A prefill starts the state afresh, whatever the decodes left.
    assert torch.equal(prefill_module(prompt)[0], expected)  # a returned tuple stays one
    assert int(prefill_module.get_buffer("position")) == 3


def test_reset_restores_the_initial_value_given():
    x, cache, position = models.cache_inputs()
    program = functional(models.InPlaceCache(), (x, cache, position))
    start = torch.full_like(cache, 0.25)
    out = resident(program, initial_values={"cache": start}).program
    module = out.module()
    module(x)
    assert not torch.equal(module.get_buffer("cache"), start)
    reset_mutable_buffers(out)
    assert torch.equal(out.module().get_buffer("cache"), start)


def test_a_non_functional_program_is_refused_by_the_precondition():
    ep = torch.export.export(models.InPlaceCache(), models.cache_inputs())
    with pytest.raises(PreconditionError):
        PassManager([InputsToBuffers()]).run(ep)


def _refused(program, error, **options):
    before = copy.deepcopy(program)
    with pytest.raises(PassFailedError) as caught:
        resident(program, **options)
    assert isinstance(caught.value.__cause__, error)
    assert "InputsToBuffers" in str(caught.value.__cause__)
    assert str(program.graph) == str(before.graph)
    return caught.value.__cause__


@pytest.mark.parametrize("form", FORMS)
def test_a_pair_of_another_shape_is_refused(form):
    program = functional(models.NamedState(), *models.named_state_inputs(), form=form)
    error = _refused(program, StatePairingError,
                     next_values={"past_key_values.0.key": "logits"})
    assert "past_key_values_0_key" in str(error) and "logits" in str(error)


@pytest.mark.parametrize("form", FORMS)
def test_a_name_that_is_no_input_is_refused(form):
    program = functional(models.SelectiveScan(), models.scan_inputs(), form=form)
    error = _refused(program, StateNameError, next_values={"state": "1"})
    assert error.name == "state" and "no input" in error.reason


class _ReturnsOnlyTheNextState(torch.nn.Module):
    def forward(self, x, h):
        return h * 0.5 + x


@pytest.mark.parametrize("form", FORMS)
def test_a_single_returned_tensor_is_the_output_named_empty(form):
    """A program returning one tensor (no tuple) names it ``""``: pairing ``"0"`` is refused
    with the outputs quoted (``''``; the list read ``(outputs: )`` before), and ``""`` makes
    the state resident, following eager call after call."""
    x, h = torch.tensor([1.0, -2.0, 0.25]), torch.tensor([3.0, 0.5, -1.0])
    program = functional(_ReturnsOnlyTheNextState(), (x, h), form=form)
    error = _refused(program, StateNameError, next_values={"h": "0"})
    assert error.name == "0" and "(outputs: '')" in error.reason
    result = resident(program, next_values={"h": ""}, initial_values={"h": h})
    module, state = runnable(result.program), h.clone()
    for _ in range(CALLS):
        state = _ReturnsOnlyTheNextState()(x, state)
        assert module(x) == ()
        assert torch.equal(dict(module.named_buffers())["h"], state)


@pytest.mark.parametrize("form", FORMS)
def test_a_mapping_naming_an_input_that_is_not_state_is_refused(form):
    program = functional(models.SelectiveScan(), models.scan_inputs(), form=form)
    error = _refused(program, StateNameError, buffers={"x": "x_state"})
    assert error.name == "x" and "not state" in error.reason


@pytest.mark.parametrize("form", FORMS)
def test_an_input_written_in_place_paired_with_another_value_is_refused(form):
    program = functional(models.InPlaceCache(), models.cache_inputs(), form=form)
    error = _refused(program, StatePairingError, next_values={"cache": ""})
    assert error.name == "cache"


_BY_NAME = ("past_key_values.", "present.")


@pytest.fixture(scope="module", params=FORMS)
def named_state(request):
    return functional(models.NamedState(), *models.named_state_inputs(), form=request.param)


@pytest.mark.parametrize(("error", "name", "reason", "options"), [
    # One input named twice (its keyword path and its placeholder): one of the two buffers
    # or next values was taken silently.
    (StateNameError, "past_key_values_0_key", "twice", dict(
        pair_by_name=_BY_NAME, buffers={"past_key_values.0.key": "k1",
                                        "past_key_values_0_key": "k2"})),
    (StateNameError, "past_key_values_0_key", "twice", dict(next_values={
        "past_key_values.0.key": "present.0.key", "past_key_values_0_key": "present.0.value"})),
    # A buffer name with an empty part: a raw KeyError (GraphModule), or a program whose
    # module() failed later (ExportedProgram, ".k").
    (CarriedStateError, ".k", "empty", dict(pair_by_name=_BY_NAME,
                                            buffers={"past_key_values.0.key": ".k"})),
    (CarriedStateError, "cache..key", "empty", dict(
        pair_by_name=_BY_NAME, buffers={"past_key_values.0.key": "cache..key"})),
    # Options of another shape: read letter by letter, or a raw error deep in the rewrite.
    (StateNameError, "past_key_values.0.key", "one string", dict(
        pair_by_name=_BY_NAME, buffers="past_key_values.0.key")),
    (StateNameError, "pair_by_name", "pair of strings", dict(pair_by_name="past_key_values.")),
    (StateNameError, "next_values", "not a mapping", dict(next_values=["past_key_values.0.key"])),
    (StateNameError, "past_key_values.0.key", "strings", dict(
        pair_by_name=_BY_NAME, buffers={"past_key_values.0.key": 0})),
    (CarriedStateError, "past_key_values.0.key", "not a tensor", dict(
        pair_by_name=_BY_NAME, initial_values={"past_key_values.0.key": [0.0]})),
], ids=["buffers twice", "next_values twice", "leading dot", "double dot", "a string",
        "pair_by_name a string", "next_values a list", "a buffer name no string",
        "an initial value no tensor"])
def test_malformed_options_are_refused_by_name(named_state, error, name, reason, options):
    refused = _refused(named_state, error, **options)
    assert refused.name == name and reason in refused.reason, refused


def test_state_carried_as_a_pair_but_not_paired_is_named_in_the_notes(named_state):
    """Without a pairing the pass moves nothing of OpenVINO-named state; it said nothing."""
    result = resident(named_state)
    assert not result.modified
    notes = "\n".join(result.report.records[0].notes)
    for leaf in ("key", "value"):
        assert (f"input 'past_key_values.0.{leaf}' stays an input though output "
                f"'present.0.{leaf}' looks like its next value") in notes, notes
    # A pair_by_name pairing nothing (a prefix mistyped) said nothing either.
    result = resident(named_state, pair_by_name=("past_key_value.", "present."))
    assert not result.modified
    assert "pair_by_name ('past_key_value.', 'present.') pairs no input" in "\n".join(
        result.report.records[0].notes)


class DynamicCache(torch.nn.Module):
    """A cache of a dynamic length written in place and returned (as HF's decode under
    ``ExecutorchConfig(dynamic=True)``, which marks every axis ``Dim.AUTO``)."""

    def forward(self, x, position, cache):
        cache.index_copy_(1, position, x)
        return x.sum() + cache.sum(), cache


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("options", [{}, {"next_values": {"cache": "1"}}], ids=["", "paired"])
def test_a_state_of_a_dynamic_shape_is_refused_as_such(form, options):
    """Paired, it was refused for another reason: \"writes it in place with copy_default,
    but output '1' returns index_copy_default\" (a whole copy of symbolic size was not seen
    through)."""
    length = torch.export.Dim("length", min=2, max=16)
    ep = torch.export.export(DynamicCache(), (torch.randn(1, 1, 4), torch.tensor([0]),
                                              torch.zeros(1, 8, 4)),
                             dynamic_shapes=(None, None, {1: length}))
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        ep if form == "exported" else ep.module()).program
    error = _refused(program, CarriedStateError, **options)
    assert error.name == "cache" and "dynamic" in error.reason


def test_a_taken_buffer_name_is_refused():
    program = functional(models.SelectiveScan(), models.scan_inputs())
    error = _refused(program, CarriedStateError, next_values={"h": "1"}, buffers={"h": "a"})
    assert error.name == "a"


class _InputNamedLikeAModule(torch.nn.Module):
    """An input ``proj`` written in place beside the module ``proj`` (``proj.weight``)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, proj):
        proj.add_(self.proj(x))
        return proj * 2


@pytest.mark.parametrize("form", FORMS)
def test_a_buffer_named_like_a_module_holding_state_is_refused(form):
    """Buffer ``proj`` beside parameter ``proj.weight`` would replace the module
    ``ep.module()`` builds: the ExportedProgram's result could not be run (torch: "references
    nonexistent attribute weight of proj"). Refused, as a name under a tensor is; another
    name works."""
    args = (torch.ones(4), torch.zeros(4))
    program = functional(_InputNamedLikeAModule(), args, form=form)
    assert _refused(program, CarriedStateError).name == "proj"
    error = _refused(program, CarriedStateError, buffers={"proj": "proj.weight.state"})
    assert error.name == "proj.weight.state" and "module" in error.reason
    result = resident(program, buffers={"proj": "proj_state"},
                      initial_values={"proj_state": torch.zeros(4)})
    module, eager, state = runnable(result.program), _InputNamedLikeAModule(), torch.zeros(4)
    eager.load_state_dict({k: v for k, v in module.state_dict().items() if "weight" in k
                           or "bias" in k})
    generator = torch.Generator().manual_seed(0)
    for _ in range(CALLS):
        x = torch.randn(4, generator=generator)
        assert torch.equal(module(x), eager(x, state))
        assert torch.equal(dict(module.named_buffers())["proj_state"], state)


def test_an_example_input_that_no_longer_fits_the_program_is_refused():
    """An ExportedProgram's example inputs are what a state starts as; one of another dtype
    than the program takes (changed since export) is refused naming the input, never made a
    buffer the program cannot write; initial_values then give the start."""
    x, cache, position = models.cache_inputs()
    program = functional(models.InPlaceCache(), (x, cache, position))
    program.example_inputs = ((x, cache.double(), position), {})
    error = _refused(program, CarriedStateError)
    assert error.name == "cache" and "float64" in error.reason and "initial_values" in error.reason
    result = resident(program, initial_values={"cache": cache})
    assert torch.equal(result.program.constants["cache"], cache)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf(request):
    pytest.importorskip("transformers.exporters")
    from tests.models import hf_exporter

    return hf_exporter.export(request.param)


@pytest.mark.parametrize("form", FORMS)
def test_hf_exporters_prefill_and_decode_share_one_resident_cache(hf, form):
    """HF's exporter's programs, made resident, generate what HF's programs generate with
    the cache threaded as HF threads it: logits and cache bit for bit, call after call."""
    from tests.models import hf_exporter

    options = hf_exporter.resident_cache_options(hf)
    methods = {}
    for name in ("prefill", "decode"):
        program = copy.deepcopy(getattr(hf, name))
        program = program if form == "exported" else program.module()
        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
        methods[name] = runnable(resident(program, **options[name]).program)
    state = {n: t for n, t in methods["decode"].named_buffers() if n.startswith("cache.")}
    for name, tensor in state.items():  # one resident state for both methods
        owner, leaf = name.rsplit(".", 1)
        methods["prefill"].get_submodule(owner)._buffers[leaf] = tensor

    def without_cache(module):
        def call(**kwargs):
            kwargs.pop("cache")
            return module(**kwargs)[0], None
        return call

    # In lockstep: HF's decode writes its cache in place, so each step is compared at once.
    expected = hf_exporter.thread_calls(hf, hf.prefill.module(), hf.decode.module(), 7)
    got = hf_exporter.thread_calls(hf, without_cache(methods["prefill"]),
                                   without_cache(methods["decode"]), 7)
    for (logits, cache), (resident_logits, _) in zip(expected, got, strict=True):
        assert torch.equal(resident_logits, logits)
        for layer_index, layer in enumerate(cache.layers):
            for leaf in ("keys", "values", "cumulative_length"):
                assert torch.equal(state[f"cache.layers.{layer_index}.{leaf}"],
                                   getattr(layer, leaf))


def test_part_of_hf_cache_cannot_leave_the_call_alone(hf):
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        copy.deepcopy(hf.decode)).program
    error = _refused(program, CarriedStateError, buffers=["cache.0"])
    assert error.name == "cache_0" and "StaticCache" in error.reason


@pytest.mark.parametrize("form", FORMS)
def test_state_in_a_mapping_keyed_by_tuples_leaves_its_sibling_in_the_call(form):
    """A dict keyed by tuples (any hashable keys) keeps its other keys once one leaf is
    resident. Its keys were matched as strings against the children's positions: none kept,
    a spec of no key for one child (an untyped ValueError; the GraphModule form was built,
    and failed when called)."""
    x, state = models.keyed_state_inputs()
    program = functional(models.KeyedState(), (x, state), form=form)
    result = resident(program).program
    module = runnable(copy.deepcopy(result))
    eager, eager_state = models.KeyedState(), copy.deepcopy(state)
    for call in range(CALLS):
        x = torch.randn(models.DIM, generator=torch.Generator().manual_seed(call))
        assert torch.equal(module(x, {("w", 0): state[("w", 0)]}), eager(x, eager_state))
        (buffer,) = carried_buffers(result).values()
        assert torch.equal(dict(module.named_buffers())[buffer], eager_state[("h", 0)])
    back = PassManager([BuffersToInputs()]).run(result).program
    spec = back.call_spec.in_spec if form == "exported" else back._in_spec
    assert spec == (program.call_spec.in_spec if form == "exported" else program._in_spec)


@pytest.mark.parametrize("form", FORMS)
def test_part_of_a_dataclass_cannot_leave_the_call_alone(form):
    """A registered dataclass's context is ``[field names, None field names]``: two lists,
    which were read as the keys of its two fields (an untyped ValueError; the GraphModule
    form was built with a spec that cannot call it). The refusal names the field that would
    stay, ``w``, and, it being only read, that it cannot leave: the reason said "make all of
    its leaves state", which a read-only leaf cannot be (naming it is refused as no state)."""
    program = functional(models.FieldState(), models.field_state_inputs(), form=form)
    error = _refused(program, CarriedStateError)
    assert error.name == "fields_h" and "StateFields" in error.reason
    assert "('fields_w')" in error.reason and "only read" in error.reason
    _refused(program, StateNameError, buffers=["fields_h", "fields_w"])


def test_semantic_validation_says_the_pass_changed_the_programs_inputs():
    """SemanticValidation calls every program with the same inputs; after InputsToBuffers
    the program no longer takes the state it made a buffer. It said so as an untyped
    ``PassFailedError ... ValueError: Ran into a kwarg keyword mismatch`` blaming the pass
    (HF's decode under SemanticValidation); now a ValidationInputError naming the pass and
    the input, the program left as it was."""
    from pass_manager import SemanticValidation, ValidationInputError

    x, cache, position = models.cache_inputs()
    for form in FORMS:
        program = functional(models.InPlaceCache(), (x, cache.clone(), position.clone()),
                             form=form)
        before = program.graph_module.code if form == "exported" else program.code
        validation = SemanticValidation((x, cache.clone(), position.clone()))
        with pytest.raises(ValidationInputError) as caught:
            PassManager([InputsToBuffers()], instruments=[validation]).run(program)
        error = caught.value
        assert "pass #0 InputsToBuffers changed the program's inputs" in error.reason
        assert error.call == "inputs" and "x" in error.expected, error.expected
        after = program.graph_module.code if form == "exported" else program.code
        assert after == before

"""Conditions and passes as values: preserves "everything", condition identity, immutable passes
with options, pipeline text, the in_place contract and the failure hook."""

import copy
import dataclasses
import enum
import gc
import re
import typing

import pytest
import torch

from pass_manager import (
    ALL_CONDITIONS,
    Condition,
    Effects,
    EffectsError,
    Instrumentation,
    Pass,
    PassFailedError,
    PassManager,
    PassResult,
    PipelineError,
    PostconditionError,
    PreconditionError,
    function_pass,
    graph_of,
    parse_pipeline,
)
from pass_manager.program import program_text

from .conftest import NoRelu, targets

X = Condition("X", lambda p: [])
Y = Condition("Y", lambda p: [])


# -- preserves = "everything" is a flag --------------------------------------------------
def test_preserves_everything_is_a_flag_not_a_set():
    assert ALL_CONDITIONS == "everything"
    with pytest.raises(TypeError, match="only preserves takes 'everything'"):
        function_pass(lambda p: None, requires="everything")
    group = PassManager([function_pass(lambda p: None, preserves="everything", name="a"),
                         function_pass(lambda p: None, preserves={X}, name="b")])
    assert group.preserves == frozenset({X})
    assert PassManager([function_pass(lambda p: None, preserves="everything")]).preserves == (
        "everything")


def test_a_pass_preserving_everything_keeps_every_cached_result(traced):
    calls = []
    watched = Condition("Watched", lambda p: calls.append(1) or [])

    provide = function_pass(lambda p: None, provides={watched}, name="provide")

    @function_pass(preserves="everything")
    def annotate(program):
        for node in graph_of(program).nodes:
            node.meta["seen"] = True

    consume = function_pass(lambda p: None, requires={watched}, name="consume")
    result = PassManager([provide, annotate, consume]).run(traced)
    assert result.report.records[1].modified
    assert len(calls) == 1  # cached across the (measured) change


# -- conditions are equal only to themselves ------------------------------------------------
def test_conditions_with_one_name_are_different_conditions():
    first = Condition("Same", lambda p: [])
    second = Condition("Same", lambda p: ["violated"])
    assert first != second and first == first
    assert len({first, second}) == 2


def test_two_conditions_with_one_name_in_one_plan_are_a_pipeline_error():
    mine = Condition("NoRelu", lambda p: [])
    provide = function_pass(lambda p: None, provides={NoRelu}, name="provide")
    consume = function_pass(lambda p: None, requires={mine}, name="consume")
    with pytest.raises(PipelineError) as info:
        PassManager([provide, consume])
    assert info.value.condition == "NoRelu" and "consume" in str(info.value)


# -- passes are small immutable values with options ----------------------------------------
@dataclasses.dataclass(frozen=True, repr=False)
class ScaleConstants(Pass):
    """Multiplies every float constant argument by ``factor`` (options: factor, ops)."""

    factor: float = 2.0
    ops: tuple = ()

    def call(self, program):
        changed = False
        for node in graph_of(program).nodes:
            if node.op != "call_function" or (self.ops and node.target not in self.ops):
                continue
            args = tuple(a * self.factor if isinstance(a, (int, float)) else a for a in node.args)
            if args != node.args:
                node.args, changed = args, True
        return PassResult(program, changed)


def test_a_pass_is_an_immutable_value_whose_repr_shows_its_options():
    p = ScaleConstants(factor=3.0, ops=(torch.ops.aten.mul.Tensor,))
    assert repr(p) == "ScaleConstants(factor=3.0, ops=(aten.mul.Tensor,))"
    assert p == ScaleConstants(factor=3.0, ops=(torch.ops.aten.mul.Tensor,))
    assert hash(p) == hash(copy.copy(p))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.factor = 1.0


def test_pipeline_text_prints_names_and_non_default_options():
    pm = PassManager([ScaleConstants(), ScaleConstants(factor=0.5, ops=(torch.ops.aten.add,))])
    assert pm.pipeline_text() == "ScaleConstants,ScaleConstants{factor=0.5,ops=(aten.add,)}"


def test_parse_pipeline_round_trips_and_runs(traced):
    text = "ScaleConstants{factor=3.0,ops=(aten.mul.Tensor, torch.ops.aten.add.Tensor)}"
    pm = parse_pipeline(text, strict=True)
    (p,) = pm.plan()
    assert p == ScaleConstants(3.0, (torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor))
    assert pm.strict
    assert parse_pipeline(pm.pipeline_text()).plan() == pm.plan()
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    expected = torch.relu(traced.linear(x)) * 2 + 1
    result = parse_pipeline("ScaleConstants{factor=2}").run(traced)  # mul 2 -> 4, add 1 -> 2
    assert result.modified
    torch.testing.assert_close(result.graph_module(x), (expected - 1) * 2 + 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("NoSuchPass", "no registered pass is named 'NoSuchPass'"),
        ("ScaleConstants{factor}", "not key=value"),
        ("ScaleConstants{speed=2}", "ScaleConstants: no option 'speed'; its options: factor, ops"),
        ("ScaleConstants{ops=(aten.no_such_op,)}", "names no operator"),
        ("ScaleConstants{factor=2", "unbalanced"),
        ("ScaleConstants{factor=open('x')}", "expected a Python literal"),
    ],
)
def test_bad_pipeline_text_is_a_pipeline_error(text, message):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ScaleConstant", "no registered pass is named 'ScaleConstant' (did you mean "
                          "'ScaleConstants'?)"),
        ("ScaleConstants{factr=2}", "ScaleConstants: no option 'factr' (did you mean 'factor'?); "
                                    "its options: factor, ops"),
    ],
)
def test_a_misspelt_pass_or_option_name_suggests_the_close_one(text, message):
    """A typo in an option was torch's TypeError about __init__, listing no option; a typo
    in a pass name listed every pass, the intended one among them unmarked."""
    with pytest.raises(PipelineError) as info:
        parse_pipeline(text)
    assert str(info.value).startswith(message)


@dataclasses.dataclass(frozen=True)
class Floored(Pass):
    """Options annotated as strings, as ``from __future__ import annotations`` leaves them."""

    floor: "int" = 0
    scale: "float" = 1.0
    exact: "bool" = False
    label: "str" = ""
    limit: "int | None" = None
    cap: typing.Optional[float] = None  # noqa: UP045 - the spelling users write too

    def call(self, program):
        return PassResult(program, False)


@pytest.mark.parametrize(("option", "said"), [
    ("floor='x'", "option floor='x': expected int, got str"),
    ("floor=true", "option floor=True: expected int, got bool"),
    ("scale='1'", "option scale='1': expected float, got str"),
    ("exact=1", "option exact=1: expected bool, got int"),
    ("label=1", "option label=1: expected str, got int"),  # was taken: label=1 in the pass
    ("factor='2'", "option factor='2': expected float, got str"),  # annotated as the type
    # The pass was built with them, to fail deep inside it or compute with a string.
    ("limit='x'", "option limit='x': expected int or None, got str"),
    ("limit=1.5", "option limit=1.5: expected int or None, got float"),
    ("cap='1'", "option cap='1': expected float or None, got str"),
])
def test_an_option_of_the_wrong_basic_type_is_a_pipeline_error(option, said):
    name = "ScaleConstants" if option.startswith("factor") else "Floored"
    with pytest.raises(PipelineError, match=f"^{name}: {said}$"):
        parse_pipeline(f"{name}{{{option}}}")


def test_an_option_of_the_right_basic_type_is_taken():
    (p,) = parse_pipeline("Floored{floor=2,scale=3,exact=true,limit=4,cap=None}").plan()
    assert p == Floored(2, 3, True, limit=4)
    assert parse_pipeline("Floored{limit=None,cap=2}").plan()[0] == Floored(cap=2)
    assert parse_pipeline("ScaleConstants{factor=2}").plan()[0].factor == 2


@pytest.mark.parametrize("label", ["a\\", "\\", "a\\,b", "it's \"q\"\\", "x},{y", "a=b"])
def test_a_string_option_round_trips_through_pipeline_text(label):
    """A string ending in a backslash printed as 'a\\\\': the closing quote was taken as
    escaped, so the text the pipeline printed (and a Reproducer saved) did not parse."""
    text = PassManager([Floored(label=label)]).pipeline_text()
    assert parse_pipeline(f"{text},{text}").plan() == [Floored(label=label)] * 2


def test_a_class_redefined_under_one_name_is_parsed_as_the_live_one(traced):
    """A notebook cell run twice defines a second class of one name; the first is dead
    but, being in a reference cycle, stays until the garbage collector runs."""
    def define(factor):
        class Redefined(Pass):
            def call(self, program):
                for node in graph_of(program).nodes:
                    if node.op == "call_function" and node.target is torch.ops.aten.mul.Tensor:
                        node.args = (node.args[0], factor)
                return PassResult(program, True)
        return Redefined

    gc.disable()  # keep the first class alive until the parser looks
    try:
        define(5.0)
        live = define(3.0)
        (p,) = parse_pipeline("Redefined").plan()
    finally:
        gc.enable()
    assert type(p) is live
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    result = parse_pipeline("Redefined").run(traced)
    torch.testing.assert_close(result.graph_module(x), torch.relu(traced.linear(x)) * 3 + 1)


def test_functions_have_no_pipeline_text():
    with pytest.raises(PipelineError, match="no pipeline text"):
        PassManager([lambda gm: None]).pipeline_text()


# -- in_place: declared and checked --------------------------------------------------------
def _copy_of(program):
    return PassResult(copy.deepcopy(program), True)


def test_an_in_place_pass_returning_another_program_is_a_typed_error(traced):
    before = traced.code
    returns_copy = function_pass(_copy_of, effects=Effects(in_place=True), name="returns_copy")
    with pytest.raises(EffectsError, match="in_place = True") as info:
        PassManager([returns_copy]).run(traced)
    assert isinstance(info.value, PassFailedError) and info.value.rolled_back
    assert traced.code == before
    # A Pass subclass declaring nothing is in place (Effects()): told what to declare.
    assert "declares effects = Effects.rewrite(in_place=False)" in str(info.value)


def test_a_pass_declaring_a_new_program_must_not_change_its_input(traced):
    def edits_input(program):
        targets(program, "relu")[0].target = torch.abs
        return PassResult(program, True)

    with pytest.raises(EffectsError, match="in_place = False"):
        PassManager([function_pass(edits_input, effects=Effects(in_place=False))]).run(traced)
    assert "relu" in traced.code

    copies = function_pass(_copy_of, effects=Effects(in_place=False), name="copies")
    result = PassManager([copies]).run(traced)
    assert result.program is not traced


# -- the failure hook --------------------------------------------------------------------
class FailureRecorder(Instrumentation):
    def __init__(self):
        self.seen = []

    def after_pass_failed(self, pass_, program, record, error):
        self.seen.append((pass_.name, record.index, program_text(program), error))


def test_after_pass_failed_sees_the_restored_program_and_the_error(traced):
    before = program_text(traced)
    fine = function_pass(lambda p: None, name="fine")

    def breaks(program):
        targets(program, "relu")[0].target = torch.abs
        raise RuntimeError("boom")

    recorder = FailureRecorder()
    with pytest.raises(PassFailedError) as info:
        PassManager([fine, breaks], instruments=[recorder]).run(traced)
    ((name, index, text, error),) = recorder.seen
    assert (name, index) == ("breaks", 1)
    assert text == before  # restored before the hook ran
    assert error is info.value and error.rolled_back and "abs" in error.diff


def test_after_pass_failed_sees_precondition_and_postcondition_failures(traced):
    recorder = FailureRecorder()
    needs = function_pass(lambda p: None, requires={NoRelu}, name="needs")
    with pytest.raises(PreconditionError):
        PassManager([needs], instruments=[recorder]).run(traced)
    claims = function_pass(lambda p: PassResult(p, False), provides={NoRelu}, name="claims")
    with pytest.raises(PostconditionError):
        PassManager([claims], instruments=[recorder]).run(traced)
    assert [(name, type(error).__name__) for name, _, _, error in recorder.seen] == [
        ("needs", "PreconditionError"),
        ("claims", "PostconditionError"),
    ]


@dataclasses.dataclass(frozen=True)
class Signed(Pass):
    """Options whose defaults equal other values: a replay must get the very value."""

    offset: float = 0.0
    tolerance: float = float("nan")
    scale: typing.Any = 1
    bounds: tuple = (0.0, 1.0)

    def call(self, program):
        return PassResult(program, False)


@pytest.mark.parametrize(("options", "text"), [
    ({}, "Signed"),  # a nan default: before, no pipeline text at all ("nan does not read back")
    ({"offset": -0.0}, "Signed{offset=-0.0}"),  # before, dropped: replayed with 0.0
    ({"scale": True}, "Signed{scale=true}"),  # before, dropped: True == 1
    ({"scale": 1.0}, "Signed{scale=1.0}"),  # an int and a float compute different dtypes
    ({"bounds": (-0.0, 1.0)}, "Signed{bounds=(-0.0, 1.0)}"),
    ({"offset": 1e-3, "tolerance": 0.5}, "Signed{offset=0.001,tolerance=0.5}"),
])
def test_pipeline_text_rebuilds_the_very_option_values(options, text):
    p = Signed(**options)
    assert PassManager([p]).pipeline_text() == text
    (back,) = parse_pipeline(text).plan()
    assert repr(back) == repr(p)
    for got, want in zip(dataclasses.astuple(back), dataclasses.astuple(p), strict=True):
        assert type(got) is type(want) and str(got) == str(want)


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


@dataclasses.dataclass(frozen=True)
class Window:
    size: int = 1


@dataclasses.dataclass(frozen=True)
class Chooses(Pass):
    """Options of an Enum, a frozenset and a dataclass."""

    mode: Mode = Mode.FAST
    fallback: Mode | None = None
    ops: frozenset = frozenset()
    window: Window = Window()

    def call(self, program):
        return PassResult(program, False)


@pytest.mark.parametrize(("options", "text"), [
    ({"mode": Mode.SLOW}, "Chooses{mode=Mode.SLOW}"),
    ({"fallback": Mode.FAST, "ops": frozenset({"b", "a"})},
     "Chooses{fallback=Mode.FAST,ops=frozenset({'a', 'b'})}"),
    ({"ops": frozenset({torch.ops.aten.add.Tensor})}, "Chooses{ops=frozenset({aten.add.Tensor})}"),
])
def test_enum_and_frozenset_options_round_trip_through_pipeline_text(options, text):
    """Before, such a pass had no pipeline text ("does not read back"), so its reproducer
    could not be replayed."""
    p = Chooses(**options)
    assert PassManager([p]).pipeline_text() == text
    assert parse_pipeline(text).plan() == [p]


@pytest.mark.parametrize(("text", "message"), [
    ("Chooses{mode=Mode.MEDIUM}", "Mode has no member 'MEDIUM'; its members: FAST, SLOW"),
    ("Chooses{ops=frozenset(open('x'))}", "expected a Python literal"),
    ("Chooses{ops=frozenset({[1]})}", "expected a Python literal"),
])
def test_an_enum_member_or_frozenset_text_that_names_nothing_is_a_pipeline_error(text, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        parse_pipeline(text)


def test_a_dataclass_option_has_no_pipeline_text_and_the_error_says_which():
    with pytest.raises(PipelineError, match=r"its option window=Window\(size=2\) does not read "
                       "back"):
        PassManager([Chooses(window=Window(2))]).pipeline_text()

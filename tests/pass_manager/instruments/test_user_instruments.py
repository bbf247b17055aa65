"""An instrument of the user's own whose hook raises: an InstrumentError naming the
instrument, the hook and the pass it was around (it was the pass's PassFailedError, or the
bare exception from before_run, after_pass_failed and after_run), and around a pass the
program is rolled back: it computes what eager does, call after call."""

import copy

import pytest
import torch

from pass_manager import (
    Effects,
    Instrumentation,
    InstrumentError,
    Pass,
    PassFailedError,
    PassManager,
    Reproducer,
    graph_of,
)
from tests.models.accumulators import Accumulate

from ..conftest import ReluToAbs


class Refuses(ReluToAbs):
    def call(self, program):
        super().call(program)
        raise ValueError("the pass's own failure")


def _raising_in(hook):
    def raises(self, *args):
        raise RuntimeError(f"bug in {hook}")
    return type("Broken", (Instrumentation,), {hook: raises})()


@pytest.mark.parametrize("hook", ["before_run", "before_pass", "after_pass",
                                  "after_pass_failed", "after_run"])
def test_an_instrument_raising_is_named_and_the_pass_rolled_back(hook):
    model = Accumulate()
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    program = torch.export.export(Accumulate(), (x,))
    program.state_dict["acc"].copy_(model.acc)
    failing = hook == "after_pass_failed"
    with pytest.raises(InstrumentError) as info:
        PassManager([Refuses() if failing else ReluToAbs()],
                    instruments=[_raising_in(hook)]).run(program)
    error = info.value
    assert (error.instrument, error.hook) == ("Broken", hook)
    passed = "Refuses" if failing else "ReluToAbs"
    around = "" if hook.endswith("_run") else f" around pass #0 {passed}"
    assert str(error).startswith(f"instrument Broken.{hook}{around} raised RuntimeError: "
                                 f"bug in {hook} (the instrument failed, not the pass)")
    assert isinstance(error.__cause__, PassFailedError if failing else RuntimeError)
    if hook == "after_run":  # every pass succeeded: the program is what they made it
        return
    assert error.rolled_back == (hook != "before_run" and hook != "before_pass")
    module = program.module()
    for _ in range(3):  # the program as exported: relu (not abs) and the running sum
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(module.acc, model.acc, rtol=0, atol=0)


class Tags(Pass):
    """Marks every node (declares only that meta key)."""

    effects = Effects.only_meta("tagged")

    def call(self, program):
        for node in graph_of(program).nodes:
            node.meta["tagged"] = True


def _rewriting_in(hook, edit="args"):
    """An instrument that, in ``hook``, turns ``* 2`` into ``* 3`` (a change of what is
    computed), or (``edit="signature"``) drops the buffer mutation from the signature."""
    def rewrites(self, *args):
        program = args[0] if hook.endswith("_run") else args[1]
        if edit == "signature":
            program.graph_signature.output_specs.pop(0)
            return
        for node in graph_of(program).nodes:
            if node.target == torch.ops.aten.mul.Tensor:
                node.args = (node.args[0], 3)
    return type("Rewrites", (Instrumentation,), {hook: rewrites})()


@pytest.mark.parametrize(("hook", "passes", "edit"), [
    (hook, passes, edit) for hook in ("before_run", "before_pass", "after_pass", "after_run")
    for passes in ([Tags()], [ReluToAbs()]) for edit in ("args", "signature")]
    + [("after_pass_failed", [Refuses()], edit) for edit in ("args", "signature")],
    ids=lambda v: v if isinstance(v, str) else v[0].name)
def test_an_instrument_changing_the_program_is_named_and_undone(hook, passes, edit):
    """An instrument rewrote ``* 2`` into ``* 3`` or dropped a buffer mutation from the
    signature: the run succeeded (the report said a pass changed what it did, or nothing),
    or the error said the program was rolled back while the change stayed (outputs off
    eager from the first call; before the first pass, after the last, or around a
    meta-only pass, whose record keeps no signature, the change was named but kept, the
    graph's code stale). Every hook's change is undone: the program computes what the
    passes alone make it compute."""
    model = Accumulate()
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    program = torch.export.export(Accumulate(), (x,))
    program.state_dict["acc"].copy_(model.acc)
    reference = copy.deepcopy(program)
    if hook == "after_run":  # every pass succeeded: what they made it stays
        PassManager(passes).run(reference)
    with pytest.raises(InstrumentError) as info:
        PassManager(passes, instruments=[_rewriting_in(hook, edit)]).run(program)
    error = info.value
    assert (error.instrument, error.hook) == ("Rewrites", hook)
    assert "changed the program's nodes or signature" in str(error) and error.rolled_back
    assert str(program.graph_signature) == str(reference.graph_signature)
    module, expected = program.module(), reference.module()
    for _ in range(3):
        torch.testing.assert_close(module(x), expected(x), rtol=0, atol=0)
        torch.testing.assert_close(module.acc, expected.acc, rtol=0, atol=0)


def test_a_broken_failure_hook_leaves_the_others_theirs(tmp_path):
    """The failure hooks run in reverse order: the broken one, registered last, ran first,
    and before, its error stopped the others: no reproducer folder, no notice."""
    seen = []

    class Sees(Instrumentation):
        def after_pass_failed(self, pass_, program, record, error):
            seen.append(type(error).__name__)

    program = torch.export.export(Accumulate(), (torch.ones(4),))
    with pytest.raises(InstrumentError) as info:
        PassManager([Refuses()], instruments=[Sees(), Reproducer(tmp_path),
                                              _raising_in("after_pass_failed")]).run(program)
    assert info.value.instrument == "Broken" and isinstance(info.value.__cause__, PassFailedError)
    assert seen == ["PassFailedError"] and len(list(tmp_path.iterdir())) == 1


class _NotesInMeta(Instrumentation):
    """Writes a meta entry of its own on every node before each pass (node meta is not
    what an instrument is checked for: only nodes and the signature)."""

    def before_pass(self, pass_, program, record):
        for node in graph_of(program).nodes:
            node.meta["seen_by_instrument"] = pass_.name


class _Tags(Pass):
    effects = Effects.only_meta("tag")

    def call(self, program):
        return None  # changes nothing


class _DoesNothing(Pass):
    def call(self, program):
        return None


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("unchanging", [_Tags, _DoesNothing], ids=["meta-only", "default effects"])
def test_an_instruments_meta_entry_is_not_blamed_on_the_pass(strict, unchanging):
    """The pass's record was taken before the before_pass hooks: the instrument's entry was
    the pass's change (modified, a report warning if it said "unmodified"; under strict an
    EffectsError naming the pass's undeclared meta keys, or its claim a PassFailedError)."""
    program = torch.export.export(Accumulate(), (torch.ones(4),))
    result = PassManager([unchanging()], instruments=[_NotesInMeta()], strict=strict).run(program)
    assert result.modified is False and result.report.warnings == []

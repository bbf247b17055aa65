"""An instrument of the user's own whose hook raises: an InstrumentError naming the
instrument, the hook and the pass it was around (it was the pass's PassFailedError, or the
bare exception from before_run, after_pass_failed and after_run), and around a pass the
program is rolled back: it computes what eager does, call after call."""

import pytest
import torch

from pass_manager import Instrumentation, InstrumentError, PassFailedError, PassManager
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

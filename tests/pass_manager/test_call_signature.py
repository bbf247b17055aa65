"""What inputs a program takes (``pass_manager.call_signature``): read from the input tree
an ExportedProgram (or its ``ep.module()``) was exported with, or from ``forward``'s
signature; each mismatch named in words, each fitting call accepted."""

import pytest
import torch

from pass_manager.call_signature import describe_inputs, signature_of


class Scaled(torch.nn.Module):
    def forward(self, x, pos, *, scale):
        return x * scale + pos


X = torch.ones(2, 3)
ARGS, KWARGS = (X, torch.zeros(3)), {"scale": 2.0}


@pytest.fixture(scope="module")
def signatures():
    ep = torch.export.export(Scaled(), ARGS, KWARGS)
    return {"exported": signature_of(ep), "ep.module()": signature_of(ep.module()),
            "eager": signature_of(Scaled())}


@pytest.mark.parametrize("form", ["exported", "ep.module()", "eager"])
def test_each_form_names_its_inputs_and_accepts_a_fitting_call(signatures, form):
    signature = signatures[form]
    assert str(signature) == "(x, pos, *, scale)"
    assert signature.mismatch(ARGS, KWARGS) is None
    assert signature.mismatch(ARGS[:1], KWARGS) is not None
    assert signature.mismatch(ARGS, {**KWARGS, "bias": 1.0}) is not None


def test_an_exported_program_names_what_differs(signatures):
    exported = signatures["exported"]
    assert exported.mismatch(ARGS[:1], KWARGS) == (
        "it gives 1 positional argument, the program takes 2")
    assert exported.mismatch(ARGS, {}) == "the keyword argument(s) 'scale' are missing"
    assert exported.mismatch(ARGS, {**KWARGS, "bias": 1.0}) == (
        "the program takes no keyword argument(s) 'bias'")
    assert exported.mismatch(((X,), ARGS[1]), KWARGS) == (
        "input 'x' is a tuple of 1 entry, the program was exported with a single value")


def test_a_program_of_no_known_kind_accepts_every_call():
    assert signature_of(object()).mismatch((1, 2, 3), {"a": 4}) is None


def test_inputs_are_described_in_a_line():
    assert describe_inputs(ARGS, KWARGS) == (
        "2 positional arguments (Tensor[2, 3] float32, Tensor[3] float32) and keyword "
        "arguments scale=2.0")
    assert describe_inputs((), {}) == "no arguments"

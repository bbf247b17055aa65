"""Checks shared by the InplaceToFunctional pattern tests: export, functionalize both forms,
compare 4 calls with eager; or a refusal that leaves the program unchanged."""

import copy

import pytest
import torch

from pass_manager import PassManager, assert_same_behaviour, graph_of
from pass_manager.program import program_text
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError, conditions

__all__ = ["_calls", "functionalize_both_forms", "refused_in_both_forms",
           "refused_in_both_forms_of", "targets"]


def _calls(*shapes, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(s, generator=gen) for s in shapes) for _ in range(n)]


def functionalize_both_forms(factory, calls, state=None, **export_kwargs):
    """Export ``factory()``, functionalize both forms, compare 4 calls with eager (and the
    state ``state`` reads, buffers by default); returns the two functional programs."""
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]), **export_kwargs)
    results = []
    for program in (ep, ep.module()):
        result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            copy.deepcopy(program)).program
        assert not conditions.Functional.check(result)
        if state is None:
            assert_same_behaviour(factory(), result, calls, calls=4)
        else:
            assert_same_behaviour(factory(), result, calls, calls=4, state=state)
        results.append(result)
    results[0].validate()
    return results


def refused_in_both_forms(factory, calls, kind):
    """Export ``factory()`` and check :func:`refused_in_both_forms_of` on it."""
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    return refused_in_both_forms_of(ep, kind)


def refused_in_both_forms_of(ep, kind):
    """Marked, both forms of ``ep`` are refused with ``kind`` and left unchanged; returns
    the last error."""
    for program in (ep, ep.module()):
        marked = PassManager([MarkMutableBuffers()]).run(copy.deepcopy(program)).program
        before = program_text(marked)
        with pytest.raises(UnsupportedMutationError) as info:
            InplaceToFunctional().call(marked)
        assert info.value.kind == kind
        assert info.value.node in str(info.value) and "InplaceToFunctional" in str(info.value)
        assert program_text(marked) == before
    return info.value


def targets(program):
    return [n.target for n in graph_of(program).nodes if n.op == "call_function"]

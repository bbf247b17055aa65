"""Grad-mode regions and higher-order ops together (issue 10, pattern 4), exported with grad
enabled, strict and non-strict.

What torch 2.13's export produces for these shapes: a ``no_grad`` block holding a ``cond`` /
``map`` / ``while_loop`` is never wrapped in ``wrap_with_set_grad_enabled``. Export splits the
graph at each ``_set_grad_enabled`` call and keeps a region only when that call is its first
node; ``split_module`` puts the ``get_attr`` of the nested op's subgraph first, so the region
is inlined (its grad mode dropped) and its writes are ordinary top-level writes. A region inside
a higher-order op's subgraph is kept (there it writes tensors the subgraph owns, or nothing).
Each program is functionalized in both forms and compared with eager over 4 calls, and
``run_decompositions({})`` is checked on the same program: both agree with eager. A ``cond``
branch writing captured state stays refused where torch fails too.
"""

import copy

import pytest
import torch
from torch import nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.while_loop import while_loop

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.program import program_text
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError

from .functionalize_checks import (
    _calls,
    functionalize_both_forms,
    refused_in_both_forms_of,
    targets,
)

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_HOPS = {torch.ops.higher_order.cond, torch.ops.higher_order.map_impl,
         torch.ops.higher_order.while_loop}


class _Stateful(nn.Module):
    second_buffer = False  # strict export drops buffers the program never reads

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("b", torch.zeros(3))
        if self.second_buffer:
            self.register_buffer("c", torch.ones(3))


class CondInNoGrad(_Stateful):
    """The issue's shape: ``self.b.add_(torch.cond(...))`` under no_grad."""

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.b.add_(torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,)).sum(0))
        return y * self.b


class CondWritingLocalsInNoGrad(_Stateful):
    """A branch writing a tensor it allocates, next to an EMA-like state write."""

    def forward(self, x):
        y = self.lin(x)

        def doubled_plus_one(t):
            u = t * 2
            u.add_(1)
            return u

        with torch.no_grad():
            r = torch.cond(y.sum() > 0, doubled_plus_one, lambda t: t - 1, (y,))
            self.b.mul_(0.5).add_(r.sum(0))
        return y + self.b


class MapInNoGrad(_Stateful):
    second_buffer = True

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.c.mul_(0.9)
            self.b.add_(hop_map(lambda row: row.sin() + 1, y).sum(0))
        return y * self.b + self.c


class WhileLoopInNoGrad(_Stateful):
    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            _, acc = while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 0.5 + 1),
                                (torch.tensor(0), y.sum(0)))
            self.b.add_(acc)
        return y * self.b


class CondReadingStateWrittenInNoGrad(_Stateful):
    """The predicate reads the state the region just wrote."""

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.b.add_(1)
            r = torch.cond(self.b.sum() > 4, lambda t: t.cos(), lambda t: t.sin(), (y,))
        return y + r + self.b


class NestedGradModes(_Stateful):
    """no_grad / enable_grad / no_grad nested, each writing state: export makes a
    sequence of regions, not nested ones."""

    second_buffer = True

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.b.add_(y.sum(0))
            with torch.enable_grad():
                z = y * 2
                self.c.mul_(1.1)
            with torch.no_grad():
                self.c.add_(1)
        return z + self.b + self.c


class NoGradInsideCondBranch(_Stateful):
    """Regions inside a branch writing the branch's own tensors; the state write is outside."""

    def forward(self, x):
        y = self.lin(x)

        def branch(t):
            u = t * 3
            with torch.no_grad():
                u.add_(1)
                w = t.clone()
                w.mul_(2)
            return u + w

        r = torch.cond(y.sum() > 0, branch, lambda t: t - 1, (y,))
        with torch.no_grad():
            self.b.add_(r.sum(0))
        return y + r + self.b


class NoGradInsideMapBody(_Stateful):
    def forward(self, x):
        y = self.lin(x)

        def body(row):
            with torch.no_grad():
                s = row.clone()
                s.add_(1)
            return s * row

        m = hop_map(body, y)
        with torch.no_grad():
            self.b.mul_(0.5)
            with torch.enable_grad():
                self.b.add_(m.sum(0))
        return y * self.b


_NESTED_IN_NO_GRAD = [CondInNoGrad, CondWritingLocalsInNoGrad, MapInNoGrad, WhileLoopInNoGrad,
                      CondReadingStateWrittenInNoGrad]
_OTHERS = [NestedGradModes, NoGradInsideCondBranch, NoGradInsideMapBody]


def _export(factory, calls, strict):
    return torch.export.export(factory(), copy.deepcopy(calls[0]), strict=strict)


def _torch_agrees(factory, ep, calls):
    reference = copy.deepcopy(ep).run_decompositions({})
    assert_same_behaviour(factory(), reference, calls, calls=4)
    return reference


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("factory", _NESTED_IN_NO_GRAD + _OTHERS)
def test_grad_regions_next_to_higher_order_ops_match_eager_like_torch(factory, strict):
    calls = _calls((4, 3))
    ep = _export(factory, calls, strict)
    if factory in _NESTED_IN_NO_GRAD:
        # export inlined the no_grad block holding the higher-order op: no region remains
        assert _SET_GRAD not in targets(ep)
        assert _HOPS & set(targets(ep))
    reference = _torch_agrees(factory, ep, calls)
    functional_ep, _ = functionalize_both_forms(factory, calls, strict=strict)
    assert sorted(functional_ep.graph_signature.buffers_to_mutate.values()) == sorted(
        reference.graph_signature.buffers_to_mutate.values())


def test_no_region_export_produces_holds_a_nested_higher_order_op():
    """Every wrap_with_set_grad_enabled region export left in these programs has a body
    without get_attr (no nested higher-order op): the only kind the pass has to inline."""
    calls = _calls((4, 3))
    seen = 0
    for factory in _NESTED_IN_NO_GRAD + _OTHERS:
        for strict in (False, True):
            gm = _export(factory, calls, strict).graph_module
            for module in gm.modules():
                for node in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
                    if node.op == "call_function" and node.target is _SET_GRAD:
                        body = getattr(module, node.args[1].target)
                        assert not [n for n in body.graph.nodes if n.op == "get_attr"]
                        seen += 1
    assert seen >= 6  # regions do occur: in HOP subgraphs and around plain writes


class CondWritingCapturedStateInNoGrad(_Stateful):
    def forward(self, x):
        y = self.lin(x)

        def writes(t):
            self.b.add_(t.sum(0))
            return t * 2

        with torch.no_grad():
            r = torch.cond(y.sum() > 0, writes, lambda t: t - 1, (y,))
        return y + r


@pytest.mark.parametrize("strict", [False, True])
def test_cond_writing_captured_state_in_a_no_grad_block_is_refused_like_torch(strict):
    """Exported with grad enabled, the block is inlined and the cond branch writes the
    buffer: run_decompositions({}) fails on it, and the pass refuses, program unchanged."""
    calls = _calls((4, 3))
    ep = _export(CondWritingCapturedStateInNoGrad, calls, strict)
    with pytest.raises(Exception, match="is not functional"):
        copy.deepcopy(ep).run_decompositions({})
    error = refused_in_both_forms_of(ep, "opaque")
    assert "inside its subgraph" in str(error)
    # What to do instead, in the refusal itself (issue 33, item 8).
    assert "torch.where(condition, new, old)" in str(error) and "copy_" in str(error)


# -- autocast regions: export keeps them (autocast changes values), with their writes ------
class AutocastWritesState(nn.Module):
    """A bf16-autocast region writing a buffer (also through a view, and read after the
    write inside the region) and a user input; run_decompositions inlines it with its casts
    explicit, the pass functionalizes the body and writes its new values back after it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("acc", torch.zeros(4, 3))

    def forward(self, x, seen):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)  # bf16 under autocast
            self.acc.add_(y.float())
            self.acc[0].mul_(0.5)
            total = self.acc.sum()
            seen.add_(y.float().mean(0))
        return y.float() + self.acc, total


def test_autocast_region_writing_state_is_functionalized_inside():
    calls = _calls((4, 3), (3,))
    ep = torch.export.export(AutocastWritesState(), copy.deepcopy(calls[0]))
    assert torch.ops.higher_order.wrap_with_autocast in targets(ep)
    reference = _torch_agrees(AutocastWritesState, ep, calls)
    functional_ep, gm = functionalize_both_forms(AutocastWritesState, calls)
    assert sorted(functional_ep.graph_signature.buffers_to_mutate.values()) == sorted(
        reference.graph_signature.buffers_to_mutate.values()) == ["acc"]
    assert list(functional_ep.graph_signature.user_inputs_to_mutate.values()) == ["seen"]
    for program in (functional_ep, gm):
        # the region stays (its casts matter), with a body that writes nothing
        assert torch.ops.higher_order.wrap_with_autocast in targets(program)
        module = program.graph_module if hasattr(program, "graph_module") else program
        for sub in module.modules():
            if sub is not module and isinstance(sub, torch.fx.GraphModule):
                assert not [n for n in sub.graph.nodes if str(n.target).endswith("_.Tensor")]


class AutocastShapeChangeOfState(nn.Module):
    """A metadata mutation of a buffer inside an autocast region: refused in the body, the
    region is then refused as a whole, and the program is left as it was."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.b.unsqueeze_(0)
            self.b.add_(x)
        return x * 2


def test_autocast_region_whose_body_cannot_be_functionalized_is_refused_unchanged():
    calls = _calls((3,))
    ep = torch.export.export(AutocastShapeChangeOfState(), copy.deepcopy(calls[0]))
    error = refused_in_both_forms_of(ep, "opaque")
    assert "inside its subgraph" in str(error)
    # The body's own refusal says why (before, only that the region writes b).
    assert "its body cannot be functionalized: node unsqueeze_ (relayout)" in str(error)


class AutocastThenFailingWrite(nn.Module):
    """The autocast region is functionalizable, a later write is not: on the refusal the
    region's body and fake values are restored with the rest of the program."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.b.add_(x)
        self.b.as_strided((3, 2), (1, 1)).add_(1)  # addresses elements twice: refused
        return self.b * 1


def test_refusal_after_a_functionalized_autocast_region_restores_its_body():
    calls = _calls((6,))
    ep = torch.export.export(AutocastThenFailingWrite(), copy.deepcopy(calls[0]))
    for program in (ep, ep.module()):
        marked = PassManager([MarkMutableBuffers()]).run(copy.deepcopy(program)).program
        before = program_text(marked)
        module = marked.graph_module if hasattr(marked, "graph_module") else marked
        bodies = {name: sub.code for name, sub in module.named_children()
                  if isinstance(sub, torch.fx.GraphModule)}
        with pytest.raises(UnsupportedMutationError):
            InplaceToFunctional().call(marked)
        assert program_text(marked) == before
        assert {name: sub.code for name, sub in module.named_children()
                if isinstance(sub, torch.fx.GraphModule)} == bodies


class AutocastInsideNoGrad(nn.Module):
    """The one no_grad region holding a higher-order op that torch 2.13's export makes: an
    autocast block inside it (the autocast region is made after the grad regions). The
    autocast region returns the buffer it wrote (copy_'s result), which the no_grad region
    then writes again: that result must stay the buffer once the body is functional."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("buf", torch.zeros(4, 3))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.lin(y)
                self.buf.copy_(z.float())
            self.buf.mul_(2)
        return y + self.buf


def test_no_grad_region_holding_an_autocast_region():
    """Non-strict: strict export's program of this module fails when called (a dtype
    assertion it leaves in the body), before any pass."""
    calls = _calls((4, 3))
    ep = _export(AutocastInsideNoGrad, calls, strict=False)
    regions = [n for n in ep.graph.nodes if n.target is _SET_GRAD]
    body = getattr(ep.graph_module, regions[0].args[1].target)
    assert torch.ops.higher_order.wrap_with_autocast in targets(body)
    _torch_agrees(AutocastInsideNoGrad, ep, calls)
    functionalize_both_forms(AutocastInsideNoGrad, calls)


class EmaInNoGrad(nn.Module):
    """A linear whose output's running mean is kept under ``no_grad`` (a QAT or training
    model's statistics), read by the output: autograd must see neither the update nor its
    read of ``y``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(y.mean(0))
        return y * self.ema


def _train(module, inputs):
    """Steps of SGD on ``module``; each step's parameter gradients and the state after it."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for x in inputs:
        optimizer.zero_grad()
        module(x).pow(2).sum().backward()
        seen.append(([p.grad.clone() for p in module.parameters()],
                     [b.clone() for b in module.buffers()]))
        optimizer.step()
    return seen


def test_no_grad_state_update_trains_like_eager_once_functional():
    """Inlined, a no_grad region used to record its update in autograd: the state then held
    a grad history, so the second backward failed (``Trying to backward through the graph a
    second time``) and the first one's gradients went through the update (off eager by 0.40,
    against eager's largest gradient of 0.36). Its reads now go through ``detach``: 4
    training steps equal eager bit for bit, gradients and state."""
    inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ep = torch.export.export(EmaInNoGrad(), (inputs[0],))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        ep.module()).program
    assert not any(n.target is _SET_GRAD for n in functional.graph.nodes)
    expected, got = _train(EmaInNoGrad(), inputs), _train(functional, inputs)
    for (grads, state), (want_grads, want_state) in zip(got, expected, strict=True):
        for value, want in zip([*grads, *state], [*want_grads, *want_state], strict=True):
            assert torch.equal(value, want)
        assert not any(b.requires_grad for b in state)

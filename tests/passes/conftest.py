"""Small real modules that mutate state in the ways export produces, shared by the
MarkMutableBuffers / InplaceToFunctional tests.

Each factory returns ``(module, calls)``: a fresh eager module and one input tuple per
call (at least 4 calls, with changing positions where the model has a cache).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.flow.examples import decode_inputs, kv_decoder


def _kv(cache_update):
    def build():
        model, _ = kv_decoder(1, cache_update=cache_update, seed=3)
        return model, decode_inputs(model.cfg, 5, seed=3)

    return build


def _seeded(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class SliceCopy(nn.Module):
    """``cache[:, s:e].copy_(x)`` then ``cache.narrow(...).mul_(...)``, then attention-like read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 8, 4))

    def forward(self, x):
        self.cache[:, 1:3].copy_(x)
        self.cache.narrow(1, 2, 3).mul_(0.5)
        return (self.cache * x.sum()).sum(1)


class TransposeSelect(nn.Module):
    """Mutation through transpose + select of a buffer, then a read of the whole buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.arange(12.0).reshape(3, 4))

    def forward(self, x):
        before = self.state.sum()
        self.state.transpose(0, 1).select(0, 2).add_(x)
        return self.state * 2 + before


class Counters(nn.Module):
    """An accumulator read before and after add_, a decaying state (mul_, a non-persistent
    buffer), a step counter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("decay", torch.ones(4), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        before = self.lin(self.acc)
        self.acc.add_(x)
        self.decay.mul_(0.9)
        self.step.add_(1)
        return before + self.lin(self.acc) * self.decay, self.step * 1


class ManyWrites(nn.Module):
    """One buffer written several times in one forward (whole, view, reads between), and a
    mutated user input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(3, 5))

    def forward(self, x, y):
        self.buf.add_(x)
        mid = self.buf.sum(0)
        self.buf[1].mul_(2)
        row = self.buf[0]
        self.buf[:, 2:].sub_(1)
        y.add_(row[:3].sum())
        self.buf.clamp_(-50, 50)
        return mid, row * 1, self.buf * y.sum()


class ViewZoo(nn.Module):
    """Writes through out=, reshape-as-view + slice, diagonal, unsqueeze + permute + select
    and split; reads the whole buffer afterwards."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("w", torch.ones(2, 4))

    def forward(self, x):
        torch.add(x, self.total, out=self.total)
        self.w.reshape(-1)[2:5].mul_(x[0])
        self.w.diagonal().add_(1)
        self.w.unsqueeze(0).permute(2, 0, 1)[1].mul_(x[1:3].view(1, 2))
        _, right = self.w.split(2, dim=1)
        right.add_(x[:2])
        return self.total * 2 + self.w.sum()


class BatchNormTrain(nn.Module):
    """batch_norm in training mode: its schema does not say it updates the running stats."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.bn(x))


class NoMutation(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale


class WritesParameter(nn.Module):
    """Writes a parameter in place: marked like a buffer, functionalized like torch does."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        self.w.add_(x)
        return self.w * 2


def _calls(*shapes, n=5, seed=0):
    return [
        tuple(_seeded(*s, seed=seed + 10 * i + j) for j, s in enumerate(shapes)) for i in range(n)
    ]


MUTATION_MODELS = {
    "kv_index_copy": _kv("index_copy"),
    "kv_index_put": _kv("index_put"),
    "slice_copy": lambda: (SliceCopy(), _calls((2, 2, 4))),
    "transpose_select": lambda: (TransposeSelect(), _calls((3,))),
    "counters": lambda: (Counters(), _calls((4,))),
    "many_writes": lambda: (ManyWrites(), _calls((3, 5), (3,))),
    "view_zoo": lambda: (ViewZoo(), _calls((4,))),
    "batchnorm_train": lambda: (BatchNormTrain().train(), _calls((4, 3))),
    "no_mutation": lambda: (NoMutation(), _calls((4,))),
}

_EXPORTS: dict = {}


def exported_model(name):
    """(eager module, calls, ExportedProgram): the export is cached and deep-copied per use."""
    if name not in _EXPORTS:
        model, calls = MUTATION_MODELS[name]()
        eager = copy.deepcopy(model)
        ep = torch.export.export(model, copy.deepcopy(calls[0]))
        _EXPORTS[name] = (eager, calls, ep)
    eager, calls, ep = _EXPORTS[name]
    return copy.deepcopy(eager), calls, copy.deepcopy(ep)


@pytest.fixture
def zoo():
    """``zoo(name) -> (eager module, calls, ExportedProgram)`` for one model of the zoo."""
    return exported_model


@pytest.fixture(params=sorted(MUTATION_MODELS))
def mutation_model(request):
    """(name, eager module, calls, ExportedProgram) for every model of the zoo."""
    return (request.param, *exported_model(request.param))


@pytest.fixture
def parameter_writer():
    """The ExportedProgram of a module that writes one of its parameters in place."""
    return torch.export.export(WritesParameter(), (torch.ones(3),))


class WritesConstant(nn.Module):
    """Writes a plain tensor attribute, lifted by export as a constant: torch's
    functionalization and ours both refuse it."""

    def __init__(self):
        super().__init__()
        self.c = torch.ones(3)

    def forward(self, x):
        self.c.add_(x)
        return self.c * 2


@pytest.fixture
def constant_writer():
    """The ExportedProgram of a module that writes a lifted constant in place."""
    return torch.export.export(WritesConstant(), (torch.ones(3),))

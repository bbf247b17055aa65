"""Factories for the main-job tests: the smallest decoder, and models the job must reject."""

import torch

from passes.flow.examples import decoder_job


def one_layer_decoder():
    return decoder_job(n_layers=1, steps=8)


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return x + 1
        return x - 1


def not_exportable():
    return DataDependent(), (torch.randn(3),)


def wrong_return():
    return torch.nn.ReLU()


class KeywordOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, *, x):
        self.total.add_(x)
        return self.total * 2


def keyword_only_given_positionally():
    """Contract v1 takes positional inputs only: this forward's one input is keyword-only."""
    return KeywordOnly(), (torch.ones(3),)


def a_step_that_does_not_fit():
    """The second decode call gives forward two inputs where it takes one."""
    model, example, steps = decoder_job(n_layers=1, steps=3)
    return model, example, [steps[0], (*steps[1], torch.ones(1)), steps[2]]


def the_class_not_a_module():
    return KeywordOnly, (torch.ones(3),)


class CacheAndRunningSum(torch.nn.Module):
    """A KV-style cache written with a projection's (quantized) values, and a running sum
    of the scores read from it that starts from a prior off any 8-bit grid: with
    --quantize-state the cache is stored as integers and the sum must stay float."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(8, 8, generator=generator) / 3)
            self.proj.bias.zero_()
        self.register_buffer("cache", torch.zeros(1, 16, 8))
        self.register_buffer("running_sum", torch.full((1, 16), 0.3))

    def forward(self, x, pos):
        self.cache.index_copy_(1, pos, self.proj(x))
        scores = torch.matmul(x, self.cache.transpose(1, 2)).squeeze(1)
        self.running_sum.add_(scores)
        return scores.softmax(-1), self.running_sum * 0.5


def cache_and_running_sum():
    generator = torch.Generator().manual_seed(1)
    steps = [(torch.randn(1, 1, 8, generator=generator), torch.tensor([i])) for i in range(4)]
    return CacheAndRunningSum(), steps[0], steps


class RunningSum(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("total", torch.zeros(4, dtype=dtype))
        self.linear = torch.nn.Linear(4, 4).to(dtype)

    def forward(self, x):
        self.total.add_(self.linear(x).sum(0))
        return self.total * 2


def bfloat16_running_sum():
    """A model as many checkpoints ship it: bfloat16 weights and state."""
    torch.manual_seed(0)
    return RunningSum(torch.bfloat16), (torch.randn(2, 4, dtype=torch.bfloat16),)


class ScaledSum(torch.nn.Module):
    """An optional keyword input: export fixes it at the example's value."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x, scale=1.0):
        self.total.add_(x)
        return self.total * scale


def a_step_with_a_keyword_the_example_did_not_give():
    x = torch.ones(3)
    return {"module": ScaledSum(), "example_args": (x,), "steps": [(x,), ((x,), {"scale": 2.0})]}


def a_method_call_with_a_keyword_its_example_did_not_give():
    x = torch.ones(3)
    return {"module": ScaledSum(), "methods": {"prefill": {"example_args": (x,)},
                                               "decode": {"example_args": (x,)}},
            "steps": [("prefill", (x,)), ("decode", (x,), {"scale": 2.0})]}


class RebindsItsSum(torch.nn.Module):
    """Keeps a running sum by rebinding its buffer (``self.total = self.total + ...``), not
    writing it in place: strict export drops the rebinding (TorchDynamo's side effect)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        self.total = self.total + x
        self.scale = self.scale.float()  # rebinds to the same value: nothing is lost
        return self.total * self.scale * 2


def rebinds_its_sum():
    return RebindsItsSum(), (torch.ones(3),)


class OneCache(torch.nn.Module):
    """One cache written with a projection's values: prefill and decode share it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(1, 8, 4))

    def forward(self, x, pos):
        self.cache.index_copy_(1, pos, self.proj(x))
        return torch.matmul(x, self.cache.transpose(1, 2))


def one_shared_cache():
    """Two methods over one cache (contract v3): the smallest several-method job."""
    torch.manual_seed(0)
    prompt = (torch.randn(1, 2, 4), torch.arange(2))
    decodes = [(torch.randn(1, 1, 4), torch.tensor([i])) for i in range(2, 4)]
    return {"module": OneCache(),
            "methods": {"prefill": {"example_args": prompt},
                        "decode": {"example_args": decodes[0]}},
            "steps": [("prefill", prompt), *(("decode", call) for call in decodes)]}


class Float64Cache(torch.nn.Module):
    """A float32 model keeping its cache in float64, written with a quantized projection's
    values: its reads are state the quantizer does not observe."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4, 4, dtype=torch.float64))

    def forward(self, x, pos):
        y = self.proj(x)
        self.cache.index_copy_(0, pos, y.double())
        return y + self.cache.sum().float()


def float64_cache():
    torch.manual_seed(0)
    steps = [(torch.randn(1, 4), torch.tensor([i])) for i in range(3)]
    return Float64Cache(), steps[0], steps


def float64_running_sum():
    """A whole model in float64: the quantizer would observe its weights."""
    torch.manual_seed(0)
    return RunningSum(torch.float64), (torch.randn(2, 4, dtype=torch.float64),)


class LowBits(torch.nn.Module):
    """Reads a float's bits through a dtype view, which ExecuTorch's portable kernels lack
    (``aten::view_copy.dtype_out``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        self.acc.add_(y.sum(0))
        return y + (y.view(torch.int32) & 1).float()


class MaskedCacheAttention(torch.nn.Module):
    """Attention over a KV cache whose unwritten positions a -inf mask, kept as state,
    hides: quantized, the mask reads a finite value and hides nothing. ``fill``: the mask's
    value (``torch.finfo(torch.float32).min`` as Hugging Face's masks)."""

    def __init__(self, dim: int = 8, length: int = 6, fill: float = float("-inf")):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.register_buffer("k_cache", torch.zeros(length, dim))
        self.register_buffer("v_cache", torch.zeros(length, dim))
        self.register_buffer("mask", torch.full((length,), fill))

    def forward(self, x, pos):
        self.k_cache.index_copy_(0, pos, self.k(x))
        self.v_cache.index_copy_(0, pos, self.v(x))
        self.mask.index_fill_(0, pos, 0.0)
        scores = self.q(x) @ self.k_cache.T + self.mask
        return torch.softmax(scores, -1) @ self.v_cache


def masked_cache_steps(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 8, generator=generator), torch.tensor([i])) for i in range(count)]

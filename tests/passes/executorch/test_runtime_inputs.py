"""flat_inputs: a step's inputs as the flat list ExecuTorch's runtime takes, in the order the
program binds them. HF's exporter gives a sliding-window model one mask per attention kind,
``{"full_attention": None, "sliding_attention": mask}``; a caller may write the mapping in
its own key order, and torch binds it by key."""

from __future__ import annotations

import copy

import torch

from passes.executorch import decode_on_runtime
from passes.executorch.runtime_inputs import flat_inputs, user_input_names


class MasksByKind(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x, attention_mask, scale):
        self.total.add_(x.masked_fill(~attention_mask["sliding_attention"], 0.0) * scale)
        return self.total * 2


def _program_and_steps():
    mask = torch.tensor([True, False, True])
    exported_with = {"x": torch.ones(3), "scale": torch.ones(3),
                     "attention_mask": {"full_attention": None, "sliding_attention": mask}}
    program = torch.export.export(MasksByKind(), (), copy.deepcopy(exported_with))
    steps = [((), {"scale": torch.full((3,), float(i)), "x": torch.arange(3.0) + i,
                   "attention_mask": {"sliding_attention": mask, "full_attention": None}})
             for i in range(1, 4)]  # the caller's own key order, outside and inside
    return program, steps


def test_a_mapping_in_the_callers_key_order_is_flattened_in_the_exported_order():
    program, steps = _program_and_steps()
    flat = flat_inputs("decode_on_runtime", "steps[0]", program, steps[0])
    kwargs = steps[0][1]
    by_name = dict(zip(user_input_names(program), flat, strict=True))
    assert by_name["x"] is kwargs["x"] and by_name["scale"] is kwargs["scale"]
    assert by_name["attention_mask_sliding_attention"] is kwargs["attention_mask"][
        "sliding_attention"]


def test_the_runtime_runs_such_steps_like_eager():
    program, steps = _program_and_steps()
    eager = MasksByKind()
    expected = [eager(**copy.deepcopy(kwargs)) for _, kwargs in steps]
    run = decode_on_runtime(program, None, steps)
    for outputs, want in zip(run.outputs, expected, strict=True):
        torch.testing.assert_close(outputs[0], want, rtol=0, atol=0)

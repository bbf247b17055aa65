"""A model factory the main job cannot functionalize: it writes a constant in place."""

import torch


class ScaleConstant(torch.nn.Module):
    """Writes a plain tensor attribute, which export lifts as a constant, not a buffer:
    neither torch's functionalization nor ours can make that write an output."""

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(4)

    def forward(self, x):
        self.scale.mul_(x)
        return self.scale + 1


def writes_constant():
    return ScaleConstant(), (torch.full((4,), 2.0),)

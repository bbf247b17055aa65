"""A model factory the main job cannot functionalize: it writes a parameter in place."""

import torch


class ScaleWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        self.weight.mul_(x)
        return self.weight + 1


def writes_parameter():
    return ScaleWeights(), (torch.full((4,), 2.0),)

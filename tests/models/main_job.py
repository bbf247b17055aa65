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

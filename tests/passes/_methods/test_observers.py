"""share_observers: one observer per shared buffer across prepared methods, or a clear
error when the methods' quantizer observes the buffer on grids of different kinds."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.pt2e.observer import MinMaxObserver

from passes import QuantizationFlowError
from passes._methods.observers import BufferObservers, share_observers


def test_observers_of_another_kind_for_one_buffer_are_refused():
    unsigned = MinMaxObserver(dtype=torch.uint8, quant_min=0, quant_max=255)
    signed = MinMaxObserver(dtype=torch.int8, quant_min=-128, quant_max=127)
    found = {"prefill": BufferObservers(grid={"k_cache": [unsigned]}),
             "decode": BufferObservers(grid={"k_cache": [signed]})}
    with pytest.raises(QuantizationFlowError) as caught:
        share_observers({}, found)
    message = str(caught.value)
    assert "buffer 'k_cache'" in message and "'prefill'" in message and "'decode'" in message
    assert "torch.uint8" in message and "torch.int8" in message


def test_a_read_observed_on_another_kind_of_grid_keeps_its_own():
    grid = [MinMaxObserver(dtype=torch.uint8), MinMaxObserver(dtype=torch.uint8)]
    read = MinMaxObserver(dtype=torch.int8, quant_min=-128, quant_max=127)
    found = {"prefill": BufferObservers(grid={"k_cache": grid[:1]}),
             "decode": BufferObservers(grid={"k_cache": grid[1:]}, reads={"k_cache": [read]})}
    assert share_observers({}, found) == {"k_cache": 2}

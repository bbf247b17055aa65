"""The main job's memo of torchao's HistogramObserver search: one search per set of
statistics, answers bit for bit torchao's own, torchao's search back outside the block."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.pt2e.observer import HistogramObserver

from passes.flow.histogram_searches import histogram_searches_found_once


def observed(*values: torch.Tensor, dtype: torch.dtype = torch.quint8) -> HistogramObserver:
    observer = HistogramObserver(dtype=dtype)
    for value in values:
        observer(value)
    return observer


@pytest.fixture
def searches(monkeypatch) -> list[HistogramObserver]:
    done = []
    search = HistogramObserver._non_linear_param_search

    def counted(observer):
        done.append(observer)
        return search(observer)

    monkeypatch.setattr(HistogramObserver, "_non_linear_param_search", counted)
    return done


def test_the_same_statistics_are_searched_once_and_answered_as_torchao_would(searches):
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(64, generator=generator) * 3 for _ in range(3)]
    expected = [observed(*data).calculate_qparams() for _ in range(2)]
    other = observed(data[0] * 10)
    expected_other = other.calculate_qparams()
    int8 = observed(*data, dtype=torch.qint8)  # 256 levels too: the same search
    expected_int8 = int8.calculate_qparams()
    int16 = observed(*data, dtype=torch.int16)  # other levels: another search
    expected_int16 = int16.calculate_qparams()
    searches.clear()

    with histogram_searches_found_once():
        first, second = observed(*data), observed(*data)
        answers = [first.calculate_qparams(), second.calculate_qparams(),
                   first.calculate_qparams()]
        assert searches == [first]
        assert all(torch.equal(a, e)
                   for answer in answers for a, e in zip(answer, expected[0], strict=True))
        with histogram_searches_found_once():  # a nested block shares the answers
            assert all(map(torch.equal, observed(*data).calculate_qparams(), expected[0]))
            assert all(map(torch.equal, other.calculate_qparams(), expected_other))
            assert all(map(torch.equal, int8.calculate_qparams(), expected_int8))
            assert all(map(torch.equal, int16.calculate_qparams(), expected_int16))
        assert searches == [first, other, int16]
        # answered with tensors of their own: changing one changes no later answer
        answers[0][0].add_(1)
        assert torch.equal(second.calculate_qparams()[0], expected[0][0])
    assert all(map(torch.equal, first.calculate_qparams(), expected[0]))
    assert searches == [first, other, int16, first]  # outside: torchao's search each time


def test_torchaos_search_is_back_after_the_block_even_when_it_fails(searches):
    search = HistogramObserver._non_linear_param_search
    with pytest.raises(RuntimeError, match="stop"), histogram_searches_found_once():
        assert HistogramObserver._non_linear_param_search is not search
        raise RuntimeError("stop")
    assert HistogramObserver._non_linear_param_search is search

"""Factory contracts v1 and v2: what a malformed result is told (v3: test_methods_factory)."""

from __future__ import annotations

import pytest
import torch

from passes.flow.factory import ModelError, model_spec
from tests.models.main_job import KeywordOnly


@pytest.mark.parametrize(
    ("made", "message"),
    [
        # A tensor has no truth value: read for one, it raised a RuntimeError traceback.
        ({"module": KeywordOnly(), "example_kwargs": {"x": torch.ones(3)},
          "steps": torch.ones(4, 3)}, "steps must be a list of calls, got Tensor"),
        ({"module": KeywordOnly(), "example_kwargs": torch.ones(3)},
         "'example_args' must be a tuple and 'example_kwargs' a mapping"),
    ],
)
def test_a_tensor_where_calls_belong_is_a_model_error(made, message):
    with pytest.raises(ModelError, match=message):
        model_spec(made, "job", 2)


def test_absent_or_none_steps_repeat_the_example():
    made = {"module": KeywordOnly(), "example_kwargs": {"x": torch.ones(3)}, "steps": None}
    steps = model_spec(made, "job", 2).steps
    assert len(steps) == 2 and all(torch.equal(kwargs["x"], torch.ones(3)) for _, kwargs in steps)

"""Factory contracts v1 and v2: what a malformed result is told (v3: test_methods_factory)."""

from __future__ import annotations

import pytest
import torch

from passes.flow.factory import ModelError, model_spec
from tests.models.main_job import KeywordOnly, ScaledSum


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


@pytest.mark.parametrize("made", [
    (ScaledSum(), (torch.ones(3),), []),
    {"module": KeywordOnly(), "example_kwargs": {"x": torch.ones(3)}, "steps": []},
    {"module": KeywordOnly(), "methods": {"forward": {"example_kwargs": {"x": torch.ones(3)}}},
     "steps": []},
], ids=["v1", "v2", "v3"])
def test_empty_steps_are_a_model_error_not_the_example_repeated(made):
    """steps=[] (a list of calls built from nothing) decoded the example --steps times."""
    from passes.flow.factory import is_methods_factory, methods_spec

    read = methods_spec if is_methods_factory(made) else model_spec
    with pytest.raises(ModelError, match=r"job\(\): steps is empty"):
        read(made, "job", 2)


def test_absent_or_none_steps_repeat_the_example():
    made = {"module": KeywordOnly(), "example_kwargs": {"x": torch.ones(3)}, "steps": None}
    steps = model_spec(made, "job", 2).steps
    assert len(steps) == 2 and all(torch.equal(kwargs["x"], torch.ones(3)) for _, kwargs in steps)


def test_a_step_of_another_shape_or_dtype_is_a_model_error_before_any_decode():
    """Both fit forward's signature and failed at that step's decode, after export and the
    steps before it (status 3): a 1-token step on a program exported for 2 tokens without
    dynamic_shapes (torch's guard), an int32 position on an int64 one (index_copy_)."""
    from passes.flow.factory import check_calls_fit, export_program
    from tests.models.static_cache import DIM, PositionedWrites

    program = export_program(PositionedWrites(), (torch.zeros(1, 2, DIM), torch.arange(2))).program
    check_calls_fit(program, [("steps[0]", ((torch.ones(1, 2, DIM), torch.tensor([2, 3])), {}))],
                    "job")
    with pytest.raises(ModelError, match=r"job\(\): steps\[1\] does not fit .*: input 'x' has "
                       r"shape \[1, 1, 2\], the program was exported for \[1, 2, 2\]; input "
                       r"'pos' has shape \[1\], the program was exported for \[2\] \(a factory "
                       r"gives other shapes per call with 'dynamic_shapes'\)"):
        check_calls_fit(program, [("steps[1]", ((torch.ones(1, 1, DIM), torch.tensor([2])),
                                                {}))], "job")
    with pytest.raises(ModelError, match=r"input 'pos' is int32, the program was exported for "
                       r"int64"):
        check_calls_fit(program, [("steps[1]", ((torch.ones(1, 2, DIM),
                                                 torch.tensor([2, 3], dtype=torch.int32)), {}))],
                        "job")
    # A Python value is part of the program: another one at a step is not taken.
    from tests.models.static_cache import ResettableCounter

    program = export_program(ResettableCounter(), (torch.zeros(1, 1, DIM), False)).program
    with pytest.raises(ModelError, match=r"to be equal to False, but got True \(a value that "
                       r"is no tensor is fixed at export"):
        check_calls_fit(program, [("steps[1]", ((torch.ones(1, 1, DIM), True), {}))], "job")


def test_a_buffer_forward_rebinds_is_exported_non_strict_and_kept():
    """Strict export dropped ``self.total = self.total + x``: the program kept total at 0
    while eager summed (the job's first check failed, its note said the model writes no
    buffer). Non-strict writes it back, and the note says why strict was not used."""
    import copy

    from pass_manager import PassManager
    from passes import InplaceToFunctional, MarkMutableBuffers
    from passes.flow.factory import ExportError, export_program
    from tests.models.main_job import RebindsItsSum

    model = RebindsItsSum()
    eager = copy.deepcopy(model)
    exported = export_program(model, (torch.ones(3),))
    assert exported.mode == "non-strict"
    assert "reassigns the buffer(s) total (self.x = ...)" in exported.note
    assert "scale" not in exported.note
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        exported.program).program.module()
    for x in (torch.ones(3), torch.arange(3.0), torch.full((3,), -2.0)):
        assert torch.equal(functional(x), eager(x))
        assert torch.equal(functional.total, eager.total)
    with pytest.raises(ExportError, match=r"strict: forward reassigns the buffer\(s\) total"):
        export_program(RebindsItsSum(), (torch.ones(3),), mode="strict")


def test_an_exported_program_returned_alone_runs_on_the_example_it_was_exported_with():
    """``return torch.export.export(model, example)`` was refused ("must return (module,
    example_inputs) ... got ExportedProgram") although the program holds its example."""
    import copy

    from pass_manager import PassManager
    from passes import InplaceToFunctional, MarkMutableBuffers
    from passes.flow.factory import export_program

    example = torch.tensor([1.0, -2.0, 0.5])
    model = ScaledSum()
    eager = copy.deepcopy(model)
    spec = model_spec(torch.export.export(model, (example,)), "job", 3)
    assert len(spec.steps) == 3 and all(torch.equal(args[0], example) for args, _ in spec.steps)
    program = export_program(spec.module, spec.example_args, spec.example_kwargs).program
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        program).program.module()
    for args, kwargs in spec.steps:
        assert torch.equal(functional(*args, **kwargs), eager(*args, **kwargs))
        assert torch.equal(functional.total, eager.total)


@pytest.mark.parametrize("made", [
    lambda module: (module, (torch.ones(3, device="meta"),)),
    lambda module: {"module": module, "methods": {"forward": {
        "example_args": (torch.ones(3, device="meta"),)}}},
], ids=["v1", "v3"])
def test_a_model_on_the_meta_device_is_a_model_error_naming_a_tensor(made):
    """Built under torch.device('meta') (weights never loaded), eager and every program ran
    on shapes alone and the job failed in its checks with status 3 ("Tensor.item() cannot
    be called on meta tensors")."""
    from passes.flow.factory import is_methods_factory, methods_spec

    with torch.device("meta"):
        module = ScaledSum()
    result = made(module)
    read = methods_spec if is_methods_factory(result) else model_spec
    with pytest.raises(ModelError, match=r"meta device.*first: 'total'.*load its weights"):
        read(result, "job", 2)


class _CacheAtAScalarPosition(torch.nn.Module):
    """A KV cache written at a 0-d position tensor, as eager takes it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, 4))

    def forward(self, k, pos):
        self.cache[:, pos] = k
        return self.cache.sum(1)


class _ReturnsADynamicCache(torch.nn.Module):
    def forward(self, x):
        from transformers import DynamicCache

        return x + 1, DynamicCache()


@pytest.mark.parametrize(("module", "example", "said"), [
    (_CacheAtAScalarPosition(), (torch.ones(1, 4), torch.tensor(2)),
     r"a 0-d tensor as an index, as in cache\[:, pos\] = k; index with a 1-element tensor"),
    (_ReturnsADynamicCache(), (torch.ones(2),),
     r"returns Hugging Face's DynamicCache.*TorchExportableModuleWithStaticCache"),
], ids=["scalar position", "DynamicCache"])
def test_an_export_failure_says_what_in_the_model_to_change(module, example, said):
    """The scalar position was told "forward branches on a tensor's value" (it has no
    branch); Hugging Face's DynamicCache output was torch's pytree message alone."""
    from passes.flow.factory import ExportError, export_program

    with pytest.raises(ExportError, match=said):
        export_program(module, example)


def test_a_numpy_array_as_an_input_is_a_model_error_saying_pass_a_tensor():
    """It read "forward raises on its example in eager: linear(): argument 'input' must be
    Tensor, not numpy.ndarray", or at a step "Expected input at *args[0] to be a tensor ...
    (a value that is no tensor is fixed at export)", nothing saying what to pass."""
    x = torch.ones(3)
    for made, where in (((ScaledSum(), (x.numpy(),)), "the example"),
                        ({"module": KeywordOnly(), "example_kwargs": {"x": x.numpy()}},
                         "the example"),
                        ({"module": ScaledSum(), "example_args": (x,),
                          "steps": [(x,), ((x.numpy(),), {})]}, r"steps\[1\]")):
        with pytest.raises(ModelError, match=rf"job\(\): {where}: input 'x' is a numpy.ndarray: "
                           r"pass a torch.Tensor \(torch.from_numpy\(array\)\)"):
            model_spec(made, "job", 2)


def test_a_value_where_the_program_takes_a_tensor_says_pass_a_tensor():
    from passes.flow.factory import check_calls_fit, export_program

    program = export_program(ScaledSum(), (torch.ones(3),)).program
    with pytest.raises(ModelError, match=r"input 'x' is a numpy.ndarray: pass a torch.Tensor"):
        check_calls_fit(program, [("steps[1]", ((torch.ones(3).numpy(),), {}))], "job")

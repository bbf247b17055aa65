"""The main job's decoder on ExecuTorch's runtime, fp32 and quantized.

Our passes run first (MarkMutableBuffers + InplaceToFunctional; the main job's quantization
flow with the passes: PassQuantizer with SkipAnnotateDataMovementOps, reset_mutable_buffers,
UnfreezeMutableBuffer), then
XnnpackPartitioner wrapped in BufferOwningPartitioner, ``to_executorch()``, and the pybind
runtime in the wheel decodes the steps from one loaded program, so its KV caches persist
across calls. Each step's output must match the Python program's: fp32 within 1e-5,
quantized within one step of the output's quantization grid.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

from pass_manager import PassManager, run_program
from pass_manager.validation import copy_program
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import (
    BufferOwningPartitioner,
    ExecuTorchInputError,
    ParameterMutationOnExecuTorchError,
    decode_on_runtime,
)
from passes.executorch.runtime import PROGRAM_FORMS, lower_to_pte, output_grid
from passes.flow.examples import decoder_job, xnnpack_quantizer
from passes.quantization import quantize_program
from tests.models.shared_values import TiedBuffers, vector_calls

STEPS = 5
CALLS = 4


@pytest.fixture(scope="module")
def job():
    model, example, steps = decoder_job(n_layers=1, steps=STEPS)
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        torch.export.export(copy.deepcopy(model), example)
    ).program
    return model, example, steps, functional


def _worst_per_step(expected, actual) -> list[float]:
    assert len(expected.outputs) == len(actual.outputs) == STEPS
    return [
        max(float((e - a).abs().max()) for e, a in zip(exp, act, strict=True))
        for exp, act in zip(expected.outputs, actual.outputs, strict=True)
    ]


def test_fp32_decode_on_the_runtime(job):
    _, example, steps, functional = job
    expected = run_program(functional, steps)
    decoded = decode_on_runtime(functional, example, steps)
    assert max(_worst_per_step(expected, decoded.trace)) <= 1e-5
    # XNNPACK cannot run the cache update (index_put): the caches stay in the program's
    # top level, where the runtime keeps them between calls; the wrapper says why.
    assert decoded.delegates >= 1 and len(decoded.notes) == 2
    assert all("computed outside any partition" in note for note in decoded.notes)
    # The caches are state: later steps attend to earlier ones (step outputs would match a
    # stateless program only if every step saw empty caches).
    fresh = [run_program(functional, [args]).outputs[0] for args in steps]
    later = zip(fresh[1:], decoded.trace.outputs[1:], strict=True)
    assert any(float((f[0] - d[0]).abs().max()) > 1e-3 for f, d in later)


def test_quantized_decode_on_the_runtime(job):
    _, example, steps, functional = job
    quantized = quantize_program(copy_program(functional), xnnpack_quantizer(), steps)
    grid = output_grid(quantized)
    assert grid is not None and grid > 0
    expected = run_program(quantized, steps)
    decoded = decode_on_runtime(quantized, example, steps)
    assert max(_worst_per_step(expected, decoded.trace)) <= grid


def test_main_job_on_the_executorch_runtime(capsys):
    from passes.flow.cli import main

    status = main(["run", "tests.models.main_job:one_layer_decoder", "--steps", "3",
                   "--runtime", "executorch", "--skip-quantization", "--skip-delegation"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "runtime executorch" in out
    header = next(line for line in out.splitlines() if line.startswith("step "))
    assert "fp32 on executorch" in header
    assert "PASS  ExecuTorch runtime decodes the fp32 program like Python (within 1e-5)" in out
    assert "executorch fp32: " in out and "XNNPACK delegate(s)" in out


def test_main_job_without_the_extra_says_how_to_install(monkeypatch, capsys):
    import passes.executorch
    from passes.flow.cli import main

    monkeypatch.setattr(passes.executorch, "available", lambda: False)
    status = main(["run", "--runtime", "executorch"])
    err = capsys.readouterr().err
    assert status == 3
    assert "needs the executorch extra" in err and "--no-deps executorch==1.5.1" in err


class Counter(torch.nn.Module):
    """State with a non-zero initial value, updated by an op XNNPACK runs (add)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.arange(4.0) + 1)

    def forward(self, x):
        self.acc.add_(x)
        return self.acc * 2


def test_xnnpack_delegates_never_get_a_buffer_and_initial_state_is_kept():
    """XNNPACK's partitioner gives its delegates no mutable buffer (an XNNPACK delegate
    handed one crashes the runtime): the wrapper keeps it at the top level, says why, and
    the runtime starts from the buffer's real initial value."""
    model = Counter()
    steps = [(torch.full((4,), float(i)),) for i in range(CALLS)]
    python = run_program(model, steps)
    decoded = decode_on_runtime(model, steps[0], steps)
    assert decoded.delegates == 1
    (note,) = decoded.notes
    assert note.startswith("kept 'acc' at the top level: partition ") and "XnnpackBackend" in note
    for expected, actual in zip(python.outputs, decoded.trace.outputs, strict=True):
        torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)


class _ScaledCounter(torch.nn.Module):
    """Keyword-only inputs, as Hugging Face models are called."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, x, *, scale):
        self.acc.add_(x * scale)
        return self.acc + 0


def test_a_module_taking_keyword_only_inputs_is_exported_from_an_args_kwargs_pair():
    """On 91ee2ec ``example_inputs`` had to be an argument tuple: a module with a
    keyword-only input could not be passed at all (ExecuTorchInputError: missing a required
    argument: 'scale'). It is now written as a step is: ``(args, kwargs)``."""
    steps = [((torch.arange(3.0) + i,), {"scale": torch.tensor(i + 0.5)}) for i in range(3)]
    python = run_program(_ScaledCounter(), steps)
    decoded = decode_on_runtime(_ScaledCounter(), steps[0], steps)
    for expected, actual in zip(python.outputs, decoded.outputs, strict=True):
        assert torch.equal(actual[0], expected[0])
    _refused("missing a required argument: 'scale'.*keyword inputs go in an",
             _ScaledCounter(), steps[0][0], steps)


class _DecaysItsWeight(torch.nn.Module):
    def __init__(self, as_buffer: bool):
        super().__init__()
        weight = torch.linspace(0, 1, 4)
        if as_buffer:
            self.register_buffer("weight", weight)
        else:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        self.weight.mul_(0.5).add_(x)
        return self.weight * 2


def test_a_written_parameter_is_refused_before_the_runtime_gets_it_wrong():
    steps = [(torch.randn(4),) for _ in range(STEPS)]
    functional = {}
    for as_buffer in (False, True):
        functional[as_buffer] = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            torch.export.export(_DecaysItsWeight(as_buffer), steps[0])).program
    with pytest.raises(ParameterMutationOnExecuTorchError) as info:
        decode_on_runtime(functional[False], steps[0], steps)
    assert info.value.parameters == ["weight"] and "register_buffer" in str(info.value)
    assert info.value.pass_name == "decode_on_runtime"  # the helper called, not lower_to_pte
    # The advice works: as a buffer, the runtime keeps the state from call to call.
    decoded = decode_on_runtime(functional[True], steps[0], steps)
    expected = run_program(_DecaysItsWeight(True), steps)
    assert max(_worst_per_step(expected, decoded.trace)) <= 1e-6


def test_a_written_parameter_quantized_is_refused_for_what_it_is():
    """Quantized (weights folded, the default), the written parameter's read is quantized in
    the graph as a state read is: the refusal says the parameter is written, not that it
    was left unfolded (whose advice, fold_quantize=True, was already taken)."""
    steps = [(torch.randn(4),) for _ in range(STEPS)]
    with torch.no_grad():
        program = quantize_program(torch.export.export(_DecaysItsWeight(False), steps[0]),
                                   xnnpack_quantizer(), steps)
    assert program.graph_signature.parameters_to_mutate
    with pytest.raises(ParameterMutationOnExecuTorchError) as info:
        decode_on_runtime(program, None, steps)
    assert info.value.parameters == ["weight"]
    with pytest.raises(ParameterMutationOnExecuTorchError):  # with any partitioner
        lower_to_pte(program, None, BufferOwningPartitioner(XnnpackPartitioner()))


def test_a_buffer_registered_under_two_names_and_written_runs_on_the_runtime():
    """One tensor registered as ``a`` and ``b``, written through ``a``, read through ``b``:
    torch.export keeps a placeholder for each name and reads and writes through one, and
    ExecuTorch's lowering then failed in torch (an untyped AssertionError, "expected
    compiled_fn to be GraphModule"). The lowering drops the name nothing reads, with a note."""
    steps = vector_calls(STEPS)
    with torch.no_grad():
        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            torch.export.export(TiedBuffers(), steps[0])).program
    decoded = decode_on_runtime(program, None, steps)
    expected = run_program(TiedBuffers(), steps)
    assert max(_worst_per_step(expected, decoded.trace)) == 0
    assert any("a second name of" in note for note in decoded.notes), decoded.notes
    assert len(program.graph_signature.inputs_to_buffers) == 2  # the caller's is untouched


def _initialized(edge) -> ExecutorchBackendConfig:
    """The config that serializes the mutable buffers' values (ExecuTorch keeps only their
    shapes otherwise)."""
    sig = edge.exported_program().graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    names = [name for name, fqn in sig.inputs_to_buffers.items() if fqn in mutated]
    return ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)])


@pytest.fixture(scope="module")
def counter_forms():
    """The Counter in every form a user holds on the way to a device, lowered once."""
    model = Counter()
    steps = [(torch.full((4,), float(i)),) for i in range(CALLS)]
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), steps[0])
        edge = to_edge_transform_and_lower(
            copy.deepcopy(ep), partitioner=[BufferOwningPartitioner(XnnpackPartitioner())])
        initialized = copy.deepcopy(edge).to_executorch(_initialized(edge))
        plain = copy.deepcopy(edge).to_executorch()
    return {"model": model, "steps": steps, "edge": edge, "initialized": initialized,
            "plain": plain, "pte": initialized.buffer}


@pytest.mark.parametrize("form", ["edge", "initialized", "pte"])
def test_every_lowered_form_a_user_holds_decodes_like_python(counter_forms, form):
    steps = counter_forms["steps"]
    decoded = decode_on_runtime(counter_forms[form], None, steps)
    python = run_program(counter_forms["model"], steps)
    assert decoded.delegates == 1 and decoded.pte_bytes > 0 and not decoded.notes
    for expected, actual in zip(python.outputs, decoded.trace.outputs, strict=True):
        torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    if form == "edge":  # serialized from a copy: the caller's manager serializes again
        assert lower_to_pte(counter_forms["edge"], None)[1:] == (None, 1)


def test_a_program_serialized_without_its_state_is_run_as_is_and_noted(counter_forms):
    """ExecuTorch's plain to_executorch() keeps the counter's shape, not its value: the
    runtime starts elsewhere than Python, and the note says so and what to pass."""
    steps = counter_forms["steps"]
    decoded = decode_on_runtime(counter_forms["plain"], None, steps)
    (note,) = decoded.notes
    assert note.startswith("'acc' holds a non-zero value the .pte does not keep")
    assert "EdgeProgramManager" in note
    python = run_program(counter_forms["model"], steps)
    assert not torch.equal(decoded.trace.outputs[0][0], python.outputs[0][0])


def _refused(match: str, *args, **kwargs) -> ExecuTorchInputError:
    with pytest.raises(ExecuTorchInputError, match=match) as info:
        decode_on_runtime(*args, **kwargs)
    assert isinstance(info.value, TypeError) and info.value.helper == "decode_on_runtime"
    return info.value


def test_what_is_not_a_program_is_refused_naming_what_to_pass(counter_forms, tmp_path):
    steps = counter_forms["steps"]
    error = _refused("got a dict", {"forward": counter_forms["edge"]}, None, steps)
    assert error.argument == "program" and PROGRAM_FORMS in error.reason
    assert "ExecutorchProgramManager (from .to_executorch())" in PROGRAM_FORMS
    path = tmp_path / "counter.pte"
    path.write_bytes(counter_forms["pte"])
    _refused(r"read_bytes\(\)", str(path), None, steps)
    _refused("not a .pte program", b"not a program at all", None, steps)
    error = _refused("already lowered", counter_forms["edge"], None, steps,
                     partitioner=XnnpackPartitioner())
    assert error.argument == "partitioner"


def test_inputs_that_do_not_fit_are_refused_before_any_lowering(counter_forms, monkeypatch):
    def no_lowering(*args, **kwargs):
        raise AssertionError("inputs are checked before the program is lowered")

    monkeypatch.setattr("passes.executorch.edge_ops.to_edge_transform_and_lower", no_lowering)
    model, steps = Counter(), counter_forms["steps"]
    assert _refused("argument tuple", model, None, steps).argument == "example_inputs"
    assert _refused("got a Tensor", model, steps[0][0], steps).argument == "example_inputs"
    error = _refused("the program takes", model, steps[0], [steps[0], (*steps[1], 1.0)])
    assert error.argument == "steps[1]" and "(x)" in error.reason
    # The program was exported with x positional: a keyword x does not fit its call spec.
    error = _refused("the program takes 1", model, steps[0], [((), {"x": steps[0][0]})])
    assert "x=Tensor[4] float32" in error.reason


def test_steps_the_lowered_program_cannot_take_are_refused(counter_forms):
    pte, (x,) = counter_forms["pte"], counter_forms["steps"][0]
    # Without the check, the runtime would silently reuse the previous call's input.
    error = _refused(r"gives 0 input\(s\); the lowered method takes 1 \(Tensor\[4\]\)",
                     pte, None, [(x,), ()])
    assert error.argument == "steps[1]"
    error = _refused("the runtime refused the call", pte, None, [(torch.ones(5),)])
    assert isinstance(error.__cause__, RuntimeError) and "Tensor[5] float32" in error.reason


def test_output_grid_refuses_what_holds_no_graph_of_its_outputs(counter_forms):
    for program in (counter_forms["edge"], counter_forms["pte"], torch.ones(1)):
        with pytest.raises(ExecuTorchInputError) as info:
            output_grid(program)
        assert info.value.argument == "program" and "ExportedProgram or GraphModule" in str(
            info.value)


def test_a_delegate_this_runtime_lacks_is_refused_before_loading():
    """On cc54dca a program delegated to a backend not built into the pybind runtime (Core
    ML's on Linux; ExecuTorch's demo backend here) lowered, loaded, then failed in its
    first call with an untyped ``RuntimeError: Failed to execute method forward, error:
    0x20``. Now each runtime helper names the method and the backend before loading; for
    a ``.pte`` given as bytes too. Lowering alone (``lower_to_pte``) is not refused."""
    from passes.executorch import run_methods_on_runtime
    from tests.models.executorch_cases import ReturnsBuffer, everything

    x = torch.randn(4)
    with torch.no_grad():
        program = torch.export.export(ReturnsBuffer(), (x,))
    pte, _, delegates = lower_to_pte(copy.deepcopy(program), None, everything())
    assert delegates == 1
    for run in (lambda: decode_on_runtime(copy.deepcopy(program), None, [(x,)], everything()),
                lambda: decode_on_runtime(pte, None, [(x,)]),
                lambda: run_methods_on_runtime({"forward": copy.deepcopy(program)},
                                               [("forward", (x,), {})],
                                               partitioner=everything())):
        with pytest.raises(ExecuTorchInputError, match="method 'forward' delegates to "
                                                       "DemoBackend, which this ExecuTorch"):
            run()


class _BitCastRead(torch.nn.Module):
    """Reads its state through a dtype view: ``aten::view_copy.dtype_out`` once lowered,
    which the portable kernels do not have."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(4))

    def forward(self, x):
        self.k.add_(x)
        return (self.k.view(torch.int32) & 0xFF).float()


def test_an_operator_this_runtime_has_no_kernel_for_is_refused_before_loading():
    """On 409aa90 a program calling an operator with no kernel in this runtime lowered, then
    failed to load with an untyped ``RuntimeError: Failed to execute method forward, error:
    0x14`` ("Missing operator" only in the log). Now both runtime helpers name the method
    and the operator before loading; ``lower_to_pte`` still lowers it for a runtime that
    has the kernel."""
    from passes.executorch import run_methods_on_runtime

    x = torch.ones(4)
    with torch.no_grad():
        program = torch.export.export(_BitCastRead(), (x,))
    pte, _, _ = lower_to_pte(copy.deepcopy(program), None, None)
    for run, named in ((lambda: decode_on_runtime(copy.deepcopy(program), None, [(x,)]), True),
                       (lambda: decode_on_runtime(pte, None, [(x,)]), False),  # names nothing
                       (lambda: run_methods_on_runtime({"forward": copy.deepcopy(program)},
                                                       [("forward", (x,), {})]), True)):
        with pytest.raises(ExecuTorchInputError, match=r"method 'forward' calls "
                                                       r"aten::view_copy\.dtype_out.*, for which"
                           ) as info:
            run()
        # The node calling it, and the line of forward that made it (it named neither).
        assert (info.value.node is not None) is named
        assert ("self.k.view(torch.int32)" in info.value.reason) is named

"""Built-in passes as pipeline text: every one round-trips with non-default options, and the
main job runs a pipeline given as text."""

import pytest
import torch

from pass_manager import PassManager, PipelineError, assert_same_behaviour, parse_pipeline
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)

from .flow.main_job_cli import run_main

aten = torch.ops.aten

BUILT_INS = [
    MarkMutableBuffers(),
    InplaceToFunctional(),
    SkipAnnotateDataMovementOps(extra_ops=(aten.roll.default, (aten.scatter.src, 3))),
    UnfreezeMutableBuffer(),
    ConsumeBufferMutationsInDelegate(strict=True),
]


def test_every_built_in_pass_round_trips_through_pipeline_text():
    manager = PassManager(BUILT_INS)
    text = manager.pipeline_text()
    assert text == (
        "MarkMutableBuffers,InplaceToFunctional,"
        "SkipAnnotateDataMovementOps{extra_ops=(aten.roll.default, (aten.scatter.src, 3))},"
        "UnfreezeMutableBuffer,ConsumeBufferMutationsInDelegate{strict=true}"
    )
    parsed = parse_pipeline(text)
    assert parsed.plan() == manager.plan()
    assert [type(p) for p in parsed.plan()] == [type(p) for p in manager.plan()]
    assert parsed.pipeline_text() == text


@pytest.mark.parametrize("p", BUILT_INS, ids=lambda p: p.name)
def test_each_built_in_pass_alone_round_trips(p):
    (parsed,) = parse_pipeline(PassManager([p]).pipeline_text()).plan()
    assert parsed == p and repr(parsed) == repr(p)


def test_repr_shows_options_as_python():
    assert repr(SkipAnnotateDataMovementOps(extra_ops=(aten.clone.default,))) == (
        "SkipAnnotateDataMovementOps(extra_ops=(aten.clone.default,))"
    )
    assert repr(ConsumeBufferMutationsInDelegate(strict=True)) == (
        "ConsumeBufferMutationsInDelegate(strict=True)"
    )
    # The old mapping spelling of extra_ops is stored as the same value.
    assert SkipAnnotateDataMovementOps(extra_ops={aten.roll: None, aten.scatter: 3}) == (
        SkipAnnotateDataMovementOps(extra_ops=(aten.roll, (aten.scatter, 3)))
    )


def test_a_bad_option_value_is_a_pipeline_error():
    with pytest.raises(PipelineError, match="not an operator"):
        parse_pipeline("SkipAnnotateDataMovementOps{extra_ops=(3,)}")


class Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, pos, x):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0) * 2


def test_parsed_pipeline_runs_like_the_built_one():
    model = Cache()
    inputs = [(torch.tensor([i]), torch.full((1, 3), float(i + 1))) for i in range(3)]
    program = torch.export.export(Cache(), inputs[0])
    result = parse_pipeline("InplaceToFunctional,MarkMutableBuffers").run(program)
    assert [r.name for r in result.report.records] == ["MarkMutableBuffers", "InplaceToFunctional"]
    assert "index_copy_(" not in result.graph_module.code
    assert_same_behaviour(model, result.program, inputs)




def test_main_job_runs_a_pipeline_given_as_text():
    done = run_main(
        "tests.models.main_job:one_layer_decoder", "--steps", "2",
        "--skip-quantization", "--skip-delegation",
        "--pipeline", "MarkMutableBuffers,InplaceToFunctional",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passes = done.stdout.split("== passes")[1].split("==")[0]
    assert "functionalize: MarkMutableBuffers" in passes
    assert "functionalize: InplaceToFunctional" in passes


def test_main_job_runs_a_one_pass_pipeline_instead_of_functionalization():
    # Marking alone leaves the in-place ops; the program still runs and matches eager.
    done = run_main(
        "tests.models.main_job:one_layer_decoder", "--steps", "2",
        "--skip-quantization", "--skip-delegation", "--pipeline", "MarkMutableBuffers",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passes = done.stdout.split("== passes")[1].split("==")[0]
    assert "functionalize: MarkMutableBuffers" in passes and "InplaceToFunctional" not in passes


def test_main_job_rejects_bad_pipeline_text_in_one_line():
    done = run_main("--pipeline", "MarkMutableBuffers,NoSuchPass")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --pipeline:") and "NoSuchPass" in line

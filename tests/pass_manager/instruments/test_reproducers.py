"""A failing pass leaves a reproducer folder; ``python -m pass_manager replay`` reruns it."""

import contextlib
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pass_manager import (
    ArchiveError,
    PassFailedError,
    PassManager,
    PassManagerError,
    Reproducer,
    SemanticsError,
    SemanticValidation,
    UntrustedFileError,
    load_program,
    load_reproducer,
    run_program,
)
from pass_manager.program import program_text
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.delegation import program_state
from tests.models.accumulators import Accumulate
from tests.models.failing import writes_constant

from .failing_passes import (
    AddToSub,
    FailAfterRewrite,
    FailsWithAnyOption,
    FailsWithItsConstructorOption,
    Nothing,
)

ROOT = Path(__file__).resolve().parents[3]


def _replay(folder, *extra, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pass_manager", "replay", str(folder), *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )


def _program(form):
    ep = torch.export.export(Accumulate(), (torch.ones(4),))
    return ep if form == "ExportedProgram" else ep.module()


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
def test_failing_pass_writes_a_folder_that_replays_the_error(form, tmp_path):
    program = _program(form)
    before = program_text(program)
    manager = PassManager([FailAfterRewrite(message="boom")], instruments=[Reproducer(tmp_path)])
    with pytest.raises(PassFailedError) as info:
        manager.run(program)
    folder = info.value.reproducer
    assert folder is not None and folder.parent == tmp_path
    assert f"Reproducer: {folder}" in str(info.value)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["pipeline"] == "FailAfterRewrite{message='boom'}"
    assert manifest["form"] == form and manifest["replayable"]
    assert manifest["error_type"] == "pass_manager.errors.PassFailedError"
    assert "RuntimeError: boom" in manifest["error_message"]
    assert manifest["versions"]["torch"] == torch.__version__
    assert "RuntimeError: boom" in (folder / "error.txt").read_text()
    # The saved program is the one the pass was given (rolled back), and still runs. An
    # ExportedProgram is saved in the safe format; a GraphModule is pickled (needs trust).
    assert manifest["program_format"] == ("exported" if form == "ExportedProgram" else "pickled")
    assert sorted(f.name for f in folder.iterdir() if f.name.startswith("program.")) == (
        ["program.pt2", "program.state.pt", "program.txt"] if form == "ExportedProgram"
        else ["program.pt", "program.txt"])
    program_file = folder / manifest["program_file"]
    assert program_file.suffix == (".pt2" if form == "ExportedProgram" else ".pt")
    saved = load_program(program_file, trusted=form == "GraphModule")
    assert isinstance(saved, torch.export.ExportedProgram) == (form == "ExportedProgram")
    assert program_text(saved) == before
    x = [(torch.ones(4),), (torch.full((4,), 2.0),)]
    expected, actual = run_program(program, x), run_program(saved, x)
    assert all(torch.equal(a, b) for a, b in zip(expected.outputs[-1], actual.outputs[-1],
                                                 strict=True))

    # The failing pass is defined in the tests, not the library: importing it needs trust.
    replayed = _replay(folder, "--trust")
    assert replayed.returncode == 1, replayed.stderr
    assert "PassFailedError: pass #0 FailAfterRewrite failed: RuntimeError: boom" in replayed.stdout
    assert "reproduced: the recorded error" in replayed.stdout


def test_replay_keeps_the_pass_place_and_the_validation_reference(tmp_path):
    """A pass that silently computes something else fails validation; the replay compares
    with the reference from before the pipeline, which the folder holds."""
    checked = SemanticValidation((torch.ones(4),))
    manager = PassManager([Nothing(), AddToSub()],
                          instruments=[checked, Reproducer(tmp_path, checked)])
    with pytest.raises(SemanticsError) as info:
        manager.run(_program("GraphModule"))
    folder = info.value.reproducer
    assert (folder / "validation.pt").exists()
    reproduction = load_reproducer(folder, trusted=True)
    with pytest.raises(SemanticsError) as again:
        reproduction.run()
    assert str(again.value) == json.loads((folder / "manifest.json").read_text())["error_message"]
    assert "pass #1 AddToSub" in str(again.value)
    replayed = _replay(folder, "--trust")
    assert replayed.returncode == 1 and "reproduced: the recorded error" in replayed.stdout


def test_replay_of_a_fixed_pass_exits_zero_and_an_unreadable_folder_two(tmp_path):
    with pytest.raises(PassManagerError) as info:
        PassManager([FailAfterRewrite()], instruments=[Reproducer(tmp_path)]).run(
            _program("ExportedProgram"))
    folder = info.value.reproducer
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["pipeline"] = "AddToSub"  # "the fix": a pass that does not raise
    (folder / "manifest.json").write_text(json.dumps(manifest))
    fixed = _replay(folder, "--trust")
    assert fixed.returncode == 0 and "no longer fails" in fixed.stdout
    assert _replay(tmp_path / "missing").returncode == 2


def test_replay_pdb_stops_at_the_pass_exception(tmp_path):
    with pytest.raises(PassManagerError) as info:
        PassManager([FailAfterRewrite()], instruments=[Reproducer(tmp_path)]).run(
            _program("GraphModule"))
    debugged = subprocess.run(
        [sys.executable, "-m", "pass_manager", "replay", str(info.value.reproducer), "--trust",
         "--pdb"],
        input="p self.message\nq\n", capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert debugged.returncode == 1
    assert "'deliberate failure'" in debugged.stdout  # pdb evaluated inside FailAfterRewrite.call


def _library_reproducer(directory):
    """A reproducer a stranger could send: a library pass (InplaceToFunctional refuses to
    functionalize a write to a constant) on an ExportedProgram, with validation."""
    model, example = writes_constant()
    checked = SemanticValidation(example, state=program_state)
    manager = PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                          instruments=[checked, Reproducer(directory, checked)])
    with pytest.raises(PassFailedError) as info:
        manager.run(torch.export.export(model, example))
    return info.value.reproducer


def test_an_exported_program_reproducer_of_a_library_pass_replays_without_trust(tmp_path):
    folder = _library_reproducer(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["program_format"] == "exported" and manifest["validation_format"] == "plain"
    assert manifest["needs_trust"] == [] and not manifest["replay"].endswith("--trust")
    reproduction = load_reproducer(folder)
    assert reproduction.instruments[-1].state is program_state  # by name, from the library
    replayed = _replay(folder)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "InplaceToFunctional cannot rewrite node mul_" in replayed.stdout
    assert "reproduced: the recorded error" in replayed.stdout


class _RunsCode:
    """Unpickling it writes ``marker``: a trojan in place of a reproducer's file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.parametrize("file", ["program.pt2", "validation.pt"])
def test_a_crafted_pickle_in_a_reproducer_is_refused_without_trust(file, tmp_path):
    folder = _library_reproducer(tmp_path / "out")
    marker = tmp_path / "marker"
    torch.save(_RunsCode(marker), folder / file)

    replayed = _replay(folder)
    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert not marker.exists()
    assert f"{folder / file} (pickled) was not read" in replayed.stderr
    assert "--trust" in replayed.stderr and "would call exec" in replayed.stderr

    with contextlib.suppress(TypeError):  # the trojan gives no validation record
        load_reproducer(folder, trusted=True)
    assert marker.exists()  # the crafted file is a real trojan: trust runs it


_MODULE_RUNNING_CODE = """
open({marker!r}, "w").write("ran")

def read(module):
    return {{}}
"""


@pytest.mark.parametrize("where", ["manifest", "validation"])
def test_a_reproducer_naming_a_module_outside_the_library_is_refused_without_trust(
    where, tmp_path, monkeypatch
):
    folder = _library_reproducer(tmp_path / "out")
    marker = tmp_path / "marker"
    module = f"runs_code_on_import_{where}"  # one per test: an imported module is cached
    (tmp_path / f"{module}.py").write_text(_MODULE_RUNNING_CODE.format(marker=str(marker)))
    if where == "manifest":
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["modules"].append(module)
        (folder / "manifest.json").write_text(json.dumps(manifest))
        named_in, kind = folder / "manifest.json", "module list"
    else:
        validation = torch.load(folder / "validation.pt", weights_only=True)
        validation["state"] = f"{module}:read"
        torch.save(validation, folder / "validation.pt")
        named_in, kind = folder / "validation.pt", "state reader name"

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    replayed = _replay(folder, env=env)
    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert not marker.exists()
    assert f"{named_in} ({kind}) was not read" in replayed.stderr
    assert f"'{module}'" in replayed.stderr and "--trust" in replayed.stderr
    with pytest.raises(UntrustedFileError) as info:
        load_reproducer(folder)
    assert info.value.path == named_in and not marker.exists()

    monkeypatch.syspath_prepend(str(tmp_path))
    load_reproducer(folder, trusted=True)
    assert marker.exists()


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    from pass_manager import PassManager, PassManagerError, Reproducer
    from tests.pass_manager.instruments.failing_passes import FailAfterRewrite, Nothing

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.ones(25 * 2**20))  # 100 MiB

        def forward(self, x):
            return self.cache[:4] + x

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def rss():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    model = Big()
    if sys.argv[2] == "ExportedProgram":
        program = torch.export.export(model, (torch.ones(4),))
    else:
        program = torch.fx.symbolic_trace(model)
    PassManager([Nothing()]).run(program)  # warm up the manager
    before = peak()
    try:
        PassManager([FailAfterRewrite()], instruments=[Reproducer(sys.argv[1])]).run(program)
    except PassManagerError as e:
        folder = e.reproducer
    grown = peak() - before
    resident = rss()
    copy = bytes(memoryview(model.cache.numpy()))  # the measure sees one copy of the state
    print(grown, rss() - resident, sum(f.stat().st_size for f in folder.iterdir()))
    """
)


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
def test_reproducer_of_a_large_program_keeps_no_second_copy_of_its_state(form, tmp_path):
    script = tmp_path / "big.py"
    script.write_text(_MEMORY_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), form],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    grown, copy_grown, written = (int(v) for v in done.stdout.split()[-3:])
    mib = 2**20
    measured = f"peak grew {grown / mib:.1f} MiB; one copy takes {copy_grown / mib:.1f} MiB"
    assert written > 100 * mib, measured  # the state is in the folder
    assert copy_grown > 90 * mib, measured  # a copy of the state would be seen
    assert grown < 25 * mib, measured  # and writing the folder made none


def test_a_pass_whose_options_are_not_dataclass_fields_is_not_replayed_without_them(tmp_path):
    """Its pipeline text used to be the bare name, recorded as replayable: the replay then
    built it with the default threshold and reported another error (or none)."""
    failing = FailsWithItsConstructorOption(threshold=0.5)
    assert repr(failing) == "FailsWithItsConstructorOption(threshold=0.5)"
    with pytest.raises(PassFailedError, match=r"threshold 0\.5") as info:
        PassManager([failing], instruments=[Reproducer(tmp_path)]).run(
            _program("ExportedProgram"))
    manifest = json.loads((info.value.reproducer / "manifest.json").read_text())
    assert manifest["replayable"] is False and manifest["pipeline"] is None
    assert "constructor takes threshold" in manifest["not_replayable_because"]
    with pytest.raises(ArchiveError, match="cannot be replayed"):
        load_reproducer(info.value.reproducer, trusted=True)


@pytest.mark.parametrize("option", [torch.ones(2), abs], ids=["tensor", "function"])
def test_a_pass_whose_option_has_no_text_is_recorded_as_not_replayable(option, tmp_path):
    """Its repr went into the pipeline text and the manifest said replayable; the replay then
    failed to parse it (exit 2, 'cannot load the reproducer')."""
    with pytest.raises(PassFailedError) as info:
        PassManager([FailsWithAnyOption(option)], instruments=[Reproducer(tmp_path)]).run(
            _program("ExportedProgram"))
    manifest = json.loads((info.value.reproducer / "manifest.json").read_text())
    assert manifest["replayable"] is False and manifest["pipeline"] is None
    assert manifest["not_replayable_because"].startswith(
        "FailsWithAnyOption has no pipeline text: its option option=")
    with pytest.raises(ArchiveError, match="cannot be replayed"):
        load_reproducer(info.value.reproducer, trusted=True)


def test_a_pass_whose_options_are_literals_is_replayed_with_them(tmp_path):
    """A dtype and an infinite float had no pipeline text (the reproducer not replayable)."""
    option = {"floor": -0.5, "names": ("a", 'b,{"c"}'), "op": torch.ops.aten.add.Tensor,
              "dtype": torch.bfloat16, "bounds": (-math.inf, math.inf)}
    with pytest.raises(PassFailedError) as info:
        PassManager([FailsWithAnyOption(option)], instruments=[Reproducer(tmp_path)]).run(
            _program("ExportedProgram"))
    assert load_reproducer(info.value.reproducer, trusted=True).passes == [
        FailsWithAnyOption(option)]


def test_a_pass_that_cannot_be_rebuilt_is_recorded_and_load_refuses_it_by_name(tmp_path):
    def fails(program):
        raise RuntimeError("boom")

    with pytest.raises(PassManagerError) as info:
        PassManager([fails], instruments=[Reproducer(tmp_path)]).run(_program("ExportedProgram"))
    folder = info.value.reproducer
    manifest = json.loads((folder / "manifest.json").read_text())
    assert not manifest["replayable"] and manifest["not_replayable_because"]
    with pytest.raises(ArchiveError, match="cannot be replayed") as refused:
        load_reproducer(folder, trusted=True)
    assert refused.value.reason == manifest["not_replayable_because"]


_USER_PASS = """
import torch
from pass_manager import Pass, PassResult, graph_module_of


class {name}(Pass):
    '''A pass of the user's own project, outside this library and the tests.'''

    def call(self, program):
        for node in graph_module_of(program).graph.nodes:
            if node.target == torch.ops.aten.add.Tensor:
                node.target = torch.ops.aten.sub.Tensor
        raise RuntimeError("the user's pass failed")
"""


def test_a_reproducer_of_a_users_own_pass_replays_without_setting_pythonpath(
    tmp_path, monkeypatch
):
    project = tmp_path / "project"
    (project / "user_passes").mkdir(parents=True)
    (project / "user_passes" / "__init__.py").write_text("")
    (project / "user_passes" / "rewrite.py").write_text(_USER_PASS.format(name="UserRewrite"))
    monkeypatch.syspath_prepend(str(project))
    from user_passes.rewrite import UserRewrite

    with pytest.raises(PassFailedError) as info:
        PassManager([UserRewrite()], instruments=[Reproducer(tmp_path / "out")]).run(
            _program("ExportedProgram"))
    folder = info.value.reproducer
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["modules"] == ["user_passes.rewrite"]
    assert manifest["import_paths"] == [str(project.resolve())]
    assert manifest["replay"].endswith(f"replay {folder} --trust")

    # Only the library is on the path: the replay finds the user's pass where it came from.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    replayed = _replay(folder, "--trust", env=env)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "RuntimeError: the user's pass failed" in replayed.stdout
    assert "reproduced: the recorded error" in replayed.stdout
    # Without trust the module is not imported at all, and the folder is not put on the path.
    refused = _replay(folder, env=env)
    assert refused.returncode == 2 and "'user_passes.rewrite'" in refused.stderr


def test_a_validation_that_is_not_a_semantic_validation_is_refused_where_it_is_given(tmp_path):
    with pytest.raises(TypeError, match=r"Reproducer\(validation='not a validation'\): give "
                                        "the run's SemanticValidation instrument, or nothing"):
        Reproducer(tmp_path, "not a validation")


_USER_OPERATOR = """
import torch


@torch.library.custom_op("reproducer_test_ops::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@triple.register_fake
def _(x):
    return torch.empty_like(x)


class TriplesAndWritesAConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.ones(4)  # a constant: InplaceToFunctional refuses its write

    def forward(self, x):
        self.weight.mul_(x)
        return triple(self.weight) + 1
"""


def test_a_reproducer_of_a_program_calling_a_users_operator_replays_with_trust(
    tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "user_ops.py").write_text(_USER_OPERATOR)
    monkeypatch.syspath_prepend(str(project))
    from user_ops import TriplesAndWritesAConstant

    program = torch.export.export(TriplesAndWritesAConstant(), (torch.full((4,), 2.0),))
    with pytest.raises(PassFailedError) as info:
        PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                    instruments=[Reproducer(tmp_path / "out")]).run(program)
    folder = info.value.reproducer
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["modules"] == ["passes.inplace_to_functional", "user_ops"]
    assert manifest["import_paths"] == [str(project.resolve())]

    # The replay imports the module defining the operator before it loads the program.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    replayed = _replay(folder, "--trust", env=env)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "reproduced: the recorded error" in replayed.stdout
    refused = _replay(folder, env=env)
    assert refused.returncode == 2 and "'user_ops'" in refused.stderr

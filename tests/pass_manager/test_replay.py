"""``python -m pass_manager replay FOLDER`` on folders a user hands it by mistake: none there,
an empty one, a file, a manifest of a newer reproducer format or one missing what a replay
reads. Each is exit status 2 and one line on stderr saying what the folder is not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pass_manager import ArchiveError, PassManager, PassManagerError, Reproducer, load_reproducer
from pass_manager.instruments.reproducer import REPRODUCER_FORMAT
from passes import InplaceToFunctional, MarkMutableBuffers
from tests.models.failing import writes_constant

ROOT = Path(__file__).resolve().parents[2]


def _replay(folder):
    return subprocess.run([sys.executable, "-m", "pass_manager", "replay", str(folder)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A real reproducer: InplaceToFunctional refusing a write to a constant."""
    model, example = writes_constant()
    program = torch.export.export(model, example, strict=False)
    with pytest.raises(PassManagerError) as info:
        PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                    instruments=[Reproducer(tmp_path_factory.mktemp("repro"))]).run(program)
    return info.value.reproducer


def test_a_reproducer_says_its_format_and_replays(written):
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["format"] == REPRODUCER_FORMAT
    done = _replay(written)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "reproduced: the recorded error" in done.stdout and done.stderr == ""


def _file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("")
    return tmp / "a_file"


def _not_json(tmp: Path) -> Path:
    (tmp / "manifest.json").write_text("{not json")
    return tmp


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda tmp: tmp / "missing", "no such folder"),
        (lambda tmp: tmp, "it has no manifest.json: not a folder a Reproducer wrote"),
        (_file, "a file, not a folder a Reproducer wrote"),
        (_not_json, "manifest.json is not JSON"),
    ],
)
def test_a_folder_that_is_not_a_reproducer_is_one_line_and_status_2(tmp_path, make, reason):
    folder = make(tmp_path)
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.reason.startswith(reason)
    done = _replay(folder)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: cannot replay: {info.value}"
    assert len(done.stderr.strip().splitlines()) == 1


def test_replay_help_lists_the_statuses_it_gives(written, tmp_path):
    """--help said nothing of 0 / 1 / 2, which a script calling replay branches on."""
    done = subprocess.run([sys.executable, "-m", "pass_manager", "replay", "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0
    rows = done.stdout.split("exit status:")[1].strip().splitlines()
    listed = {int(row.split()[0]): row for row in rows}
    assert sorted(listed) == [0, 1, 2]
    assert "failed again" in listed[1] and "cannot be replayed" in listed[2]
    assert _replay(written).returncode == 1 and _replay(tmp_path / "none").returncode == 2


def test_the_folder_reproducers_are_written_in_names_them(written):
    """Given the Reproducer's (or --reproducer-dir's) folder, the replay said only that it is
    no reproducer; the main job's help says 'write a reproducer folder under DIR'."""
    with pytest.raises(ArchiveError) as info:
        load_reproducer(written.parent)
    assert info.value.reason == ("it has no manifest.json: not a folder a Reproducer wrote; it "
                                 f"holds reproducers: {written}")


def _edited(written: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / written.name
    folder.mkdir()
    for file in written.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_manifest_of_a_newer_format_names_both_formats(written, tmp_path):
    def newer(manifest):
        manifest["format"] = REPRODUCER_FORMAT + 1
        manifest["versions"]["mutable-buffer-passes"] = "9.0.0"
        del manifest["replayable"]  # what a newer format may well rename

    folder = _edited(written, tmp_path, newer)
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.reason == (
        f"it is reproducer format {REPRODUCER_FORMAT + 1}, written by mutable-buffer-passes "
        f"9.0.0; this version reads formats up to {REPRODUCER_FORMAT}: replay it with the "
        "version that wrote it, or a newer one")
    done = _replay(folder)
    assert done.returncode == 2 and "KeyError" not in done.stderr
    assert f"reproducer format {REPRODUCER_FORMAT + 1}" in done.stderr


def test_a_manifest_missing_what_a_replay_reads_names_the_keys(written, tmp_path):
    folder = _edited(written, tmp_path, lambda manifest: manifest.pop("pipeline"))
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.reason == ("it lacks 'pipeline': not a whole reproducer manifest "
                                 "(damaged, or not written by a Reproducer)")
    assert _replay(folder).returncode == 2


def test_a_manifest_without_a_format_is_the_first_format(written, tmp_path):
    """Reproducers written before the manifest named its format still replay."""
    folder = _edited(written, tmp_path, lambda manifest: manifest.pop("format", None))
    assert load_reproducer(folder).manifest["pipeline"] == "InplaceToFunctional"


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("index", "1", "its 'index' is '1', not an int"),
        ("index", -1, "its 'index' is -1, not a place in a pipeline (0 or more)"),
        ("modules", "passes", "its 'modules' is 'passes', not a list"),
        ("import_paths", "/tmp", "its 'import_paths' is '/tmp', not a list of folders"),
        ("strict", "yes", "its 'strict' is 'yes', not true or false"),
        ("pipeline", "", "its 'pipeline' is empty, not the failing pass as pipeline text"),
    ],
)
def test_a_manifest_with_a_value_of_another_kind_is_named_before_the_replay(
        written, tmp_path, key, value, reason):
    """A hand-edited or damaged manifest replayed: an index given as text ended in a
    TypeError traceback from inside the runner; a module list given as one string was read
    letter by letter; an empty pipeline 'no longer failed'."""
    folder = _edited(written, tmp_path, lambda manifest: manifest.update({key: value}))
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.reason == (f"{reason}: not a manifest a Reproducer wrote (damaged, or "
                                 "edited)")
    if key == "index":
        done = _replay(folder)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip() == f"error: cannot replay: {info.value}"


@pytest.mark.parametrize("pipeline", ["Nope", "InplaceToFunctional{nope=1}",
                                      "InplaceToFunctional{"])
def test_a_manifest_naming_a_pass_no_one_can_build_is_an_archive_error(
        written, tmp_path, pipeline):
    """An edited pipeline (a pass renamed, an option added, a brace lost) was a
    PipelineError out of load_reproducer, not the ArchiveError a damaged folder is."""
    folder = _edited(written, tmp_path, lambda manifest: manifest.update(pipeline=pipeline))
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.path == folder / "manifest.json"
    assert info.value.reason.startswith("its pass cannot be rebuilt: PipelineError: ")


def test_a_manifest_naming_several_passes_where_one_failed_is_an_archive_error(
        written, tmp_path):
    """Edited to "A,A" with 'group' false, the replay ran the pass twice, under the
    failed pass's number and name."""
    folder = _edited(written, tmp_path, lambda manifest: manifest.update(
        pipeline=f"{manifest['pipeline']},{manifest['pipeline']}"))
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.reason == ("its 'pipeline' holds 2 passes but 'group' is false: a "
                                 "Reproducer writes the one pass that failed (damaged, or edited)")


def test_a_missing_program_file_is_named_as_the_folder_holds_it(written, tmp_path):
    """The replay looked for the pickled program.pt next and said *that* was missing."""
    folder = _edited(written, tmp_path, lambda manifest: None)
    (folder / "program.pt2").unlink()
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.path == folder / "program.pt2"
    assert info.value.reason.startswith("it is missing")


def test_a_state_file_of_other_shapes_is_refused_not_loaded_into_the_program(written, tmp_path):
    """program.state.pt whose tensors the graph cannot hold (another shape, another dtype)
    was loaded into the program as it was, and the replay ran on it."""
    folder = _edited(written, tmp_path, lambda manifest: None)
    state = torch.load(folder / "program.state.pt", weights_only=True)
    kind = "state_dict" if state["state_dict"] else "constants"
    name = next(iter(state[kind]))
    state[kind][name] = torch.zeros(7, 7, 7, dtype=torch.int64)
    torch.save(state, folder / "program.state.pt")
    with pytest.raises(ArchiveError) as info:
        load_reproducer(folder)
    assert info.value.path == folder / "program.state.pt"
    assert f"{name} is int64[7, 7, 7], the program's float32[" in info.value.reason

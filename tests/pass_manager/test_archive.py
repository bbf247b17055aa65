"""save_program / load_program: an ExportedProgram is saved in a format read without
running code from the file; anything else is pickled and read only with trusted=True.
A file crafted to run code on load (each way torch.export.load would run it) is refused
before it reaches torch, with a typed error that says how to read it anyway."""

from __future__ import annotations

import io
import json
import shutil
import zipfile

import pytest
import torch
from torch.export import Dim

from pass_manager import (
    ArchiveError,
    UntrustedFileError,
    first_difference,
    load_program,
    run_program,
    save_program,
)
from pass_manager._untrusted import graph_refusals
from pass_manager.archive import load_data, save_data, state_file
from pass_manager.program import program_text
from tests.models.accumulators import Accumulate

CALLS = [(torch.ones(4),), (torch.full((4,), 2.0),), (torch.arange(4.0),)]


class _Window(torch.nn.Module):
    """Reads a slice of a buffer as long as its input: a dynamic dimension."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(4.0))

    def forward(self, x):
        return x + self.b[: x.shape[0]]


class _Scaled(torch.nn.Module):
    """Takes a keyword argument: its name is in the program's input spec."""

    def forward(self, x, *, scale):
        return x * scale


class _RunsCode:
    """Unpickling it writes ``marker``: what a trojan file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _doubled(x):
    return x * 2


torch.fx.wrap("_doubled")  # a function of the user's, kept as one call by symbolic_trace


class _CallsOwnFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        y = _doubled(x)
        self.total.add_(y)
        return y + self.total


def _pickle_of(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_an_exported_program_loads_without_trust_with_its_meta_and_state(tmp_path):
    ep = torch.export.export(Accumulate(), CALLS[0])
    acc = next(n for n in ep.graph.nodes if n.name == "b_acc")
    acc.meta["mutable_buffer"] = "acc"  # what a pass writes: carried beside the archive
    acc.meta["mutable_buffer_initial"] = torch.zeros(4)
    saved = save_program(ep, tmp_path / "program.pt2")
    assert (saved.format, saved.pickled_because, saved.needs_trust) == ("exported", "", False)
    # The archive is torch.export.save's own (its tensors stand-ins, the data beside it).
    archived = torch.export.load(tmp_path / "program.pt2")
    assert program_text(archived) == program_text(ep)
    assert all(t.is_meta for t in archived.state_dict.values())

    loaded = load_program(tmp_path / "program.pt2")
    assert isinstance(loaded, torch.export.ExportedProgram)
    assert program_text(loaded) == program_text(ep)
    mark = next(n for n in loaded.graph.nodes if n.name == "b_acc").meta
    assert mark["mutable_buffer"] == "acc" and torch.equal(mark["mutable_buffer_initial"],
                                                           torch.zeros(4))
    assert all(not t.is_meta for t in [*loaded.state_dict.values(), *loaded.constants.values()])
    assert first_difference(run_program(ep, CALLS), run_program(loaded, CALLS)) is None


def test_a_dynamic_shape_program_loads_without_trust(tmp_path):
    ep = torch.export.export(_Window(), (torch.ones(3),),
                             dynamic_shapes=({0: Dim("n", max=4)},))
    assert save_program(ep, tmp_path / "program.pt2").format == "exported"
    loaded = load_program(tmp_path / "program.pt2")
    calls = [(torch.ones(2),), (torch.ones(4),)]
    assert first_difference(run_program(ep, calls), run_program(loaded, calls)) is None


def test_a_pickle_in_place_of_the_state_file_is_refused_without_trust(tmp_path):
    marker = tmp_path / "marker"
    save_program(torch.export.export(Accumulate(), CALLS[0]), tmp_path / "program.pt2")
    state_file(tmp_path / "program.pt2").write_bytes(_pickle_of(_RunsCode(marker)))
    with pytest.raises(UntrustedFileError) as info:
        load_program(tmp_path / "program.pt2")
    assert info.value.path == tmp_path / "program.state.pt" and not marker.exists()


def test_an_exported_program_without_its_state_file_is_an_archive_error(tmp_path):
    save_program(torch.export.export(Accumulate(), CALLS[0]), tmp_path / "program.pt2")
    state_file(tmp_path / "program.pt2").unlink()
    with pytest.raises(ArchiveError, match="missing") as info:
        load_program(tmp_path / "program.pt2")
    assert info.value.path == tmp_path / "program.state.pt"


def test_a_graph_module_is_pickled_and_read_only_with_trust(tmp_path):
    gm = torch.export.export(Accumulate(), CALLS[0]).module()
    saved = save_program(gm, tmp_path / "program.pt")
    assert saved.format == "pickled" and "GraphModule" in saved.pickled_because
    with pytest.raises(UntrustedFileError) as info:
        load_program(tmp_path / "program.pt")
    error = info.value
    assert error.path == tmp_path / "program.pt" and error.format == "pickled"
    assert "trusted=True" in str(error) and "--trust" in str(error)
    loaded = load_program(tmp_path / "program.pt", trusted=True)
    assert first_difference(run_program(gm, CALLS), run_program(loaded, CALLS)) is None


def test_a_pickled_program_keeps_its_fake_values_symbolic_ones_included(tmp_path):
    gm = torch.export.export(_Window(), (torch.ones(3),),
                             dynamic_shapes=({0: Dim("n", max=4)},)).module()
    save_program(gm, tmp_path / "program.pt")
    loaded = load_program(tmp_path / "program.pt", trusted=True)
    shapes = [(n.name, str(n.meta.get("val"))) for n in gm.graph.nodes]
    assert [(n.name, str(n.meta.get("val"))) for n in loaded.graph.nodes] == shapes
    assert any("s" in shape for name, shape in shapes if name == "x")  # a symbolic size
    calls = [(torch.ones(2),), (torch.ones(4),)]
    assert first_difference(run_program(gm, calls), run_program(loaded, calls)) is None


def test_a_pickled_graph_module_calling_a_function_of_the_user_keeps_it(tmp_path):
    gm = torch.fx.symbolic_trace(_CallsOwnFunction())
    for node in gm.graph.nodes:
        node.meta["mark"] = f"seen {node.name}"
    code = gm.code
    save_program(gm, tmp_path / "program.pt")
    assert gm.code == code and any(n.target is _doubled for n in gm.graph.nodes)
    loaded = load_program(tmp_path / "program.pt", trusted=True)
    assert [n.target for n in loaded.graph.nodes] == [n.target for n in gm.graph.nodes]
    assert [n.meta["mark"] for n in loaded.graph.nodes] == [f"seen {n.name}"
                                                            for n in gm.graph.nodes]
    assert first_difference(run_program(gm, CALLS), run_program(loaded, CALLS)) is None


def test_a_crafted_pickle_is_refused_without_trust_and_runs_with_it(tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / "program.pt").write_bytes(_pickle_of(_RunsCode(marker)))
    with pytest.raises(UntrustedFileError) as info:
        load_program(tmp_path / "program.pt")
    assert not marker.exists()
    assert "would call exec" in str(info.value)  # what the pickle would have called
    load_program(tmp_path / "program.pt", trusted=True)  # trusted: what the caller asked for
    assert marker.exists()


def _rewrite_archive(path, edit, target):
    """Copy the program at ``path`` (its archive and state file) to ``target``, the
    archive's entries edited."""
    source = zipfile.ZipFile(path)
    with zipfile.ZipFile(target, "w") as crafted:
        for entry in source.infolist():
            root, name = entry.filename.split("/", 1)
            for new_name, content in edit(name, source.read(entry.filename)).items():
                crafted.writestr(f"{root}/{new_name}", content)
    shutil.copy(state_file(path), state_file(target))


def _input_name(code):
    def edit(name, content):
        if name == "models/model.json":  # `def forward(self, x=<code>)` runs at load
            content = content.replace(b'"x"', json.dumps(f"x={code}").encode())
        return {name: content}
    return edit


def _shape_expression(code):
    def edit(name, content):
        if name == "models/model.json":  # torch.export.load sympify-s (evals) it
            symbol = "Symbol('s77', positive=True, integer=True)"
            text = json.dumps(json.loads(content))
            assert json.dumps(symbol) in text
            text = text.replace(json.dumps(symbol), json.dumps(f"(exec({code!r}) or {symbol})"))
            content = text.encode()
        return {name: content}
    return edit


def _example_inputs(code):
    def edit(name, content):
        if name == "data/sample_inputs/model.pt":  # retried with weights_only=False
            content = _pickle_of(_Exec(code))
        return {name: content}
    return edit


def _pickled_weight(code):
    def edit(name, content):
        if name == "data/weights/model_weights_config.json":
            config = json.loads(content)
            for entry in config["config"].values():
                entry["use_pickle"] = True  # read with torch.load(weights_only=False)
            content = json.dumps(config).encode()
        elif name.startswith("data/weights/weight_"):
            content = _pickle_of(_Exec(code))
        return {name: content}
    return edit


def _keyword_name(code):
    def edit(name, content):
        if name == "models/model.json":  # ep.module() writes `{'<name>': ...}` into forward
            program = json.loads(content)
            signature = program["graph_module"]["module_call_graph"][0]["signature"]
            spec = json.loads(signature["in_spec"])
            keywords = spec[1]["children_spec"][1]
            assert keywords["context"] == '["scale"]'
            keywords["context"] = json.dumps([f"scale': exec({code!r}), 'scale"])
            signature["in_spec"] = json.dumps(spec)
            content = json.dumps(program).encode()
        return {name: content}
    return edit


class _Exec:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


ATTACKS = {
    "input name": _input_name,
    "keyword name": _keyword_name,
    "shape expression": _shape_expression,
    "example inputs": _example_inputs,
    "pickled weight": _pickled_weight,
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_archive_crafted_to_run_code_is_refused_before_torch_reads_it(attack, tmp_path):
    edit = ATTACKS[attack]
    marker = tmp_path / "marker"
    code = f"open({str(marker)!r}, 'w').write('ran')"
    if attack == "keyword name":
        ep = torch.export.export(_Scaled(), (torch.ones(2),), {"scale": torch.ones(2)})
        call = ((torch.ones(2),), {"scale": torch.ones(2)})
    else:
        ep = torch.export.export(_Window(), (torch.ones(3),),
                                 dynamic_shapes=({0: Dim("n", max=4)},))
        call = ((torch.ones(3),), {})
    save_program(ep, tmp_path / "program.pt2")
    _rewrite_archive(tmp_path / "program.pt2", edit(code), tmp_path / "crafted.pt2")

    with pytest.raises(UntrustedFileError) as info:
        load_program(tmp_path / "crafted.pt2")
    assert not marker.exists()
    assert info.value.path == tmp_path / "crafted.pt2" and "--trust" in str(info.value)

    # The attack is real: torch.export.load, or the forward it generates, runs the code.
    try:
        torch.export.load(tmp_path / "crafted.pt2").module().forward(*call[0], **call[1])
    except Exception:  # noqa: BLE001 - the code ran before the archive failed
        pass
    assert marker.exists()


def test_an_archive_with_an_entry_save_program_does_not_write_is_refused(tmp_path):
    save_program(torch.export.export(Accumulate(), CALLS[0]), tmp_path / "program.pt2")

    def add_compiled_code(name, content):
        entries = {name: content}
        if name == "archive_format":  # torch.export.load would load it as a shared library
            entries["data/aotinductor/model/model.so"] = b"\x7fELF"
        return entries

    _rewrite_archive(tmp_path / "program.pt2", add_compiled_code, tmp_path / "crafted.pt2")
    with pytest.raises(UntrustedFileError) as info:
        load_program(tmp_path / "crafted.pt2")
    assert "data/aotinductor/model/model.so" in str(info.value)


def test_a_loaded_graph_calling_a_python_function_is_refused():
    """torch's verifier admits what the file's ``verifiers`` entry names: the graphs are
    checked again, bodies of higher-order ops included."""
    ep = torch.export.export(_Window(), (torch.ones(3),))
    assert graph_refusals(ep) == []
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    node.target = print
    assert graph_refusals(ep) == [f"node {node.name} calls {print!r}, not an operator"]


def test_a_file_that_is_no_program_is_an_archive_error(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "weights.pt")
    with pytest.raises(ArchiveError) as info:
        load_program(tmp_path / "weights.pt")
    assert not isinstance(info.value, UntrustedFileError)
    assert "not a program" in str(info.value)


def _damaged_files(tmp_path):
    """Files a user may pass by mistake: not torch's, or a program cut short in transit."""
    (tmp_path / "notes.pt").write_text("hello")
    (tmp_path / "empty.pt").write_bytes(b"")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "not torch")
    with zipfile.ZipFile(tmp_path / "other_format.pt2", "w") as archive:
        archive.writestr("model/archive_format", "onnx")
    save_program(torch.fx.symbolic_trace(Accumulate()), tmp_path / "program.pt")
    save_program(torch.export.export(Accumulate(), CALLS[0]), tmp_path / "program.pt2")
    for name in ("program.pt", "program.pt2"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut_{name}").write_bytes(data[: len(data) // 2])
    return ["notes.pt", "empty.pt", "other.zip", "other_format.pt2", "cut_program.pt",
            "cut_program.pt2"]


@pytest.mark.parametrize("trusted", [False, True])
def test_a_damaged_or_foreign_file_is_an_archive_error_naming_it(tmp_path, trusted):
    for name in _damaged_files(tmp_path):
        with pytest.raises(ArchiveError) as info:
            load_program(tmp_path / name, trusted=trusted)
        assert info.value.path == tmp_path / name, name
        assert str(tmp_path / name) in str(info.value), name


def test_plain_data_reads_without_trust_and_anything_else_needs_it(tmp_path):
    plain = {"inputs": [((torch.ones(2),), {"scale": 2.0})], "state": "passes.x:reader",
             "reference": {"outputs": [[torch.zeros(3)]], "buffers": [{}], "inputs": [[]]}}
    assert save_data(plain, tmp_path / "plain.pt") == "plain"
    loaded = load_data(tmp_path / "plain.pt")
    assert torch.equal(loaded["inputs"][0][0][0], torch.ones(2))
    assert loaded["reference"]["outputs"][0][0].shape == (3,)

    code = {"state": len}  # a function: only a pickle stores it
    assert save_data(code, tmp_path / "code.pt") == "pickled"
    with pytest.raises(UntrustedFileError):
        load_data(tmp_path / "code.pt")
    assert load_data(tmp_path / "code.pt", trusted=True) == code

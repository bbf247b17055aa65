"""Cached analyses are reused only while what they read is unchanged, and the manager's
change measure (against its snapshot) sees every kind of change."""

import pytest
import torch

from pass_manager import Effects, PassFailedError, PassManager, PassResult, function_pass, graph_of
from pass_manager.analysis import Same, cached

from .conftest import targets


class Counted:
    """An analysis (the op of every node) that counts how often it is computed."""

    def __init__(self):
        self.runs = 0

    def __call__(self, program):
        self.runs += 1
        return [str(n.target) for n in graph_of(program).nodes]


def relu_node(program):
    return targets(program, "relu")[0]


def test_a_cached_analysis_is_reused_while_the_program_is_unchanged(traced):
    analysis = Counted()
    first = cached(traced, "ops", analysis)
    relu_node(traced).meta["note"] = "meta other than val is not read"
    assert cached(traced, "ops", analysis) is first and analysis.runs == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda p: setattr(relu_node(p), "target", torch.abs),
        lambda p: setattr(relu_node(p), "args", (next(iter(graph_of(p).nodes)),)),
        lambda p: relu_node(p).meta.__setitem__("val", object()),
        lambda p: graph_of(p).create_node("call_function", torch.neg, (relu_node(p),)),
        lambda p: p.register_buffer("extra", torch.zeros(1)),
    ],
    ids=["target", "args", "val", "new-node", "new-buffer"],
)
def test_any_change_of_what_the_stamp_covers_recomputes(traced, change):
    analysis = Counted()
    cached(traced, "ops", analysis)
    change(traced)
    cached(traced, "ops", analysis)
    assert analysis.runs == 2


def test_equal_args_assigned_anew_keep_the_analysis(traced):
    analysis = Counted()
    cached(traced, "ops", analysis)
    relu_node(traced).args = tuple(relu_node(traced).args)
    cached(traced, "ops", analysis)
    assert analysis.runs == 1


def test_a_signature_change_recomputes_for_an_exported_program(exported):
    analysis = Counted()
    cached(exported, "ops", analysis)
    exported.graph_signature.output_specs[-1].arg.name = "renamed"
    cached(exported, "ops", analysis)
    assert analysis.runs == 2


def test_what_an_analysis_declares_it_reads_is_part_of_its_stamp(traced):
    analysis = Counted()

    def depends(program):
        return relu_node(program).meta.get("mark"), Same(program.acc), program.acc._version

    cached(traced, "ops", analysis, depends)
    cached(traced, "ops", analysis, depends)
    assert analysis.runs == 1
    relu_node(traced).meta["mark"] = "x"
    cached(traced, "ops", analysis, depends)
    traced.acc.add_(1)
    cached(traced, "ops", analysis, depends)
    assert analysis.runs == 3


def test_a_nested_meta_edit_is_a_measured_change_and_is_rolled_back(traced):
    relu_node(traced).meta["custom"] = {"tags": ["a"]}

    def edits_nested(program):
        relu_node(program).meta["custom"]["tags"].append("b")
        return PassResult(program, False)

    result = PassManager([function_pass(edits_nested, effects=Effects(in_place=True))]).run(traced)
    assert result.modified and result.report.warnings  # measured, though it claimed not

    def edits_then_fails(program):
        edits_nested(program)
        raise RuntimeError("boom")

    with pytest.raises(PassFailedError):
        PassManager([edits_then_fails]).run(traced)
    assert relu_node(traced).meta["custom"] == {"tags": ["a", "b"]}  # as before that pass


def test_reassigning_equal_args_is_no_change(traced):
    def same_args(program):
        for node in graph_of(program).nodes:
            node.args = tuple(node.args)

    result = PassManager([function_pass(same_args)]).run(traced)
    assert not result.modified


def test_stamps_inside_an_unchanged_block_share_one_measure_and_still_see_later_changes(traced):
    from pass_manager.analysis import unchanged

    analysis = Counted()
    measured = []
    graph = graph_of(traced)
    with unchanged(graph):
        import pass_manager.analysis as module

        original = module.node_fields
        module.node_fields = lambda nodes: measured.append(1) or original(nodes)
        try:
            cached(traced, "ops", analysis)
            cached(traced, "ops", analysis)
            cached(traced, "other", Counted())
        finally:
            module.node_fields = original
    assert analysis.runs == 1 and measured == [1]  # measured once, when first needed
    relu_node(traced).target = torch.abs  # outside the block: measured again
    cached(traced, "ops", analysis)
    assert analysis.runs == 2


def test_the_manager_checks_a_guarantee_with_the_scan_its_pass_made(exported):
    """MarkMutableBuffers' scan serves its guarantee MutableBuffersMarked: one scan a run."""
    import passes._analysis.buffers as buffers
    from passes import MarkMutableBuffers

    scans = []
    original = buffers._scan_mutations

    def counted(program):
        scans.append(1)
        return original(program)

    buffers._scan_mutations = counted
    try:
        result = PassManager([MarkMutableBuffers()]).run(exported)
    finally:
        buffers._scan_mutations = original
    assert result.modified and result.report.records[0].checked == ["MutableBuffersMarked"]
    assert len(scans) == 1

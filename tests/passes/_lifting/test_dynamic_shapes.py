"""exported_program_from on a quantized program exported with a dynamic token dimension (as
transformers' exporter exports): the lift keeps the symbolic sizes and their ranges, and runs
prefills of several lengths and single-token decodes as the converted graph module does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.validation import copy_program
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    exported_program_from,
    reset_mutable_buffers,
)
from passes.flow.examples import AnnotateEveryOpQuantizer, kv_decoder
from passes.quantization import PassQuantizer
from tests.models.llama_shaped import llama_shaped


def token_calls(dim: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(x [1, n, dim], positions [n])`` call per length, positions following on."""
    generator, start, calls = torch.Generator().manual_seed(3), 0, []
    for n in lengths:
        calls.append((torch.randn(1, n, dim, generator=generator), torch.arange(start, start + n)))
        start += n
    return calls


@pytest.fixture(scope="module")
def dynamic_quantized_decoder():
    """The one-layer decoder exported with a dynamic token dimension (1 .. max_seq), through
    the passes' quantization flow: (its functional program, the converted graph module, calls
    of 4, 7, 1 and 1 tokens)."""
    model, _ = kv_decoder(1)
    calls = token_calls(model.cfg.dim, [4, 7, 1, 1])
    tokens = torch.export.Dim("tokens", min=1, max=model.cfg.max_seq)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), calls[0], strict=True,
                                 dynamic_shapes=({1: tokens}, {0: tokens}))
    return (*_quantized(ep, calls), calls)


def test_a_dynamic_quantized_program_lifts_with_its_ranges_and_runs_every_length(
        dynamic_quantized_decoder):
    """Prefills of 4 and 7 tokens, then single-token decodes: outputs and caches equal the
    converted graph module's, call after call; the token size stays symbolic, ranged as the
    user's Dim, and the program refuses a length beyond it."""
    program, converted, calls = dynamic_quantized_decoder
    lifted = exported_program_from(copy_program(converted), like=program)
    assert lifted.range_constraints == program.range_constraints
    (symbol,) = lifted.range_constraints
    x = lifted.graph.find_nodes(op="placeholder")[-2].meta["val"]
    assert isinstance(x.shape[1], torch.SymInt) and x.shape[1].node.expr == symbol
    assert_same_behaviour(converted, lifted, calls)
    upper = int(lifted.range_constraints[symbol].upper)
    too_long = token_calls(x.shape[2], [upper + 1])
    with pytest.raises(AssertionError, match=rf"x.size\(\)\[1\] <= {upper}"):
        lifted.module()(*too_long[0])


def test_the_new_fake_values_are_torchs_on_storages_of_their_own(dynamic_quantized_decoder):
    """Each value the lift gives a node convert left without one has the symbolic shape,
    strides, storage size, dtype and device torch's FakeTensorProp gives it in the graph's
    fake mode, and a storage no other value of the graph uses."""
    program, converted, _ = dynamic_quantized_decoder
    _assert_new_values_are_torchs(program, converted)


def test_a_llama_shaped_decoders_new_values_are_torchs(dynamic_quantized_llama):
    """The same on a Llama-shaped layer, whose (de)quantize nodes read more layouts: grouped
    heads transposed, rotary halves sliced at an offset (not dense), a causal mask, size-one
    dimensions; and its lifted program runs every length as the converted module does
    (outputs and KV caches; the rotary ``inv_freq`` buffer convert folded into a constant
    is read by neither graph, so the lift, as export, leaves it out)."""
    program, converted, calls = dynamic_quantized_llama
    _assert_new_values_are_torchs(program, converted)

    def caches(module):
        return {k: v.clone() for k, v in module.named_buffers() if k.endswith("_cache")}

    assert_same_behaviour(converted, exported_program_from(copy_program(converted),
                                                           like=program), calls, state=caches)


@pytest.fixture(scope="module")
def dynamic_quantized_llama():
    """A one-layer Llama-shaped decoder exported with a dynamic token dimension, quantized
    as the decoder above: (its functional program, the converted graph module, calls of 4,
    7, 1 and 1 tokens)."""
    model = llama_shaped(1, vocab=100)
    generator, start, calls = torch.Generator().manual_seed(3), 0, []
    for n in (4, 7, 1, 1):
        calls.append((torch.randint(100, (1, n), generator=generator),
                      torch.arange(start, start + n)))
        start += n
    tokens = torch.export.Dim("tokens", min=1, max=model.cfg.max_seq)
    with torch.no_grad():
        ep = torch.export.export(model, calls[0], strict=True,
                                 dynamic_shapes=({1: tokens}, {0: tokens}))
    return (*_quantized(ep, calls), calls)


def _quantized(ep, calls):
    """(the functional program, its converted graph module) through the passes' flow,
    calibrated on ``calls``."""
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    quantizer = PassQuantizer(AnnotateEveryOpQuantizer(), transform=[MarkMutableBuffers()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(copy_program(program).module(), quantizer)
    with torch.no_grad():
        for args in calls:
            prepared(*args)
    reset_mutable_buffers(prepared)
    return program, PassManager([UnfreezeMutableBuffer()]).run(convert_pt2e(prepared)).program


def _assert_new_values_are_torchs(program, converted):
    missing = {n.name for n in converted.graph.nodes if n.op == "call_function"
               and "val" not in n.meta and n.target is not torch.ops.aten.copy_.default}
    lifted = exported_program_from(copy_program(converted), like=program)
    ours = {n.name: n.meta["val"] for n in lifted.graph.nodes if n.name in missing}
    symbolic = [v for v in ours.values() if v._has_symbolic_sizes_strides]
    assert len(ours) == len(missing) and len(symbolic) > 30
    placeholders = lifted.graph.find_nodes(op="placeholder")
    mode = detect_fake_mode([p.meta["val"] for p in placeholders])
    propagated = copy_program(lifted).graph_module
    FakeTensorProp(propagated, mode).propagate_dont_convert_inputs(
        *[p.meta["val"] for p in placeholders])
    torchs = {n.name: n.meta["val"] for n in propagated.graph.nodes if n.name in missing}

    def layout(v):
        return (str(tuple(v.shape)), str(v.stride()), v.storage_offset(),
                str(v.untyped_storage().nbytes()), v.dtype, v.device, type(v).__name__,
                v.fake_mode is mode)

    assert {k: layout(v) for k, v in ours.items()} == {k: layout(v) for k, v in torchs.items()}
    storages = [StorageWeakRef(v.untyped_storage()) for n in lifted.graph.nodes
                if isinstance(v := n.meta.get("val"), torch.Tensor)]
    for value in ours.values():
        assert storages.count(StorageWeakRef(value.untyped_storage())) == 1


def test_the_dynamic_graph_module_is_not_changed(dynamic_quantized_decoder):
    program, converted, calls = dynamic_quantized_decoder
    gm = copy_program(converted)
    code = gm.code
    nodes = [(n.name, n.op, n.target, sorted(n.meta)) for n in gm.graph.nodes]
    exported_program_from(gm, like=program)
    assert gm.code == code
    assert [(n.name, n.op, n.target, sorted(n.meta)) for n in gm.graph.nodes] == nodes
    assert_same_behaviour(converted, gm, calls)

"""The Llama-shaped benchmark decoder (RoPE, grouped-query attention, a static cache written
with ``index_copy_``, exported strict under no_grad) is functionalized like the eager model."""

import copy

import pytest
import torch

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers, mutable_buffers
from passes.conditions import Functional
from tests.models.llama_shaped import export_llama, llama_job


@pytest.mark.parametrize("form", ["exported", "module"])
def test_functionalized_llama_shaped_decoder_decodes_like_eager(form):
    model, example, calls = llama_job(n_layers=2, steps=5)
    ep = export_llama(copy.deepcopy(model), example)
    reference = copy.deepcopy(ep).run_decompositions({}).graph_signature.buffers_to_mutate
    program = ep if form == "exported" else ep.module()
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
    caches = {f"layers.{i}.self_attn.{kv}_cache" for i in range(2) for kv in "kv"}
    assert set(mutable_buffers(result.program)) == caches == set(reference.values())
    assert not Functional.check(result.program)
    if form == "exported":
        assert set(result.program.graph_signature.buffers_to_mutate.values()) == caches
    with torch.no_grad():
        assert_same_behaviour(model, result.program, calls, calls=5)

"""Pass-manager overhead against torch's PassManager on the same cheap passes.

Graphs of about 100, 1,000 and 10,000 nodes (a chain of elementwise ops, built with the
fx Graph API). Three cheap passes: a read-only analysis, a meta-only tagger and a
rewrite that changes one node. Our passes declare conditions (checked once, then
cached); torch's run as plain callables. Prints min/median/max and the ratio of
medians from one run, plus the per-node cost of fingerprint and snapshot.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult
from torch.fx.passes.infra.pass_manager import PassManager as TorchPassManager

from pass_manager import Condition, Effects, PassManager, function_pass
from pass_manager._rollback import RollbackRecord
from pass_manager.benchmarking import time_call
from pass_manager.program import graph_module_of

# The digest the manager once measured change with (it compares against its rollback
# record now): kept here as the reference cost the snapshot column is read against.
# Meta entries that describe values or provenance rather than program structure; they
# are costly to hash and no pass's correctness claim depends on their identity.
_UNHASHED_META = frozenset(
    {
        "val",
        "tensor_meta",
        "example_value",
        "stack_trace",
        "nn_module_stack",
        "source_fn_stack",
        "from_node",
        "seq_nr",
        "original_aten",
        "torch_fn",
        "unbacked_bindings",
        "custom",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
    }
)


def _meta_token(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor@{id(value)}"
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        return "(" + ",".join(_meta_token(v) for v in value) + ")"
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a meta value whose repr fails still counts as "some object"
        return f"{type(value).__name__}@{id(value)}"


def _tensor_token(t: torch.Tensor) -> str:
    return f"{id(t)}:{t._version}:{tuple(t.shape)}:{t.dtype}"


class Fingerprint(NamedTuple):
    """Digests of a program: ``code`` covers what recompile() depends on, ``state`` the rest."""

    code: str
    state: str


def fingerprint(program: Any) -> Fingerprint:
    """A structural digest: graph (ops, targets, args, meta), module state, signature.

    Two programs with equal fingerprints run the same code on the same state objects.
    Tensor *contents* enter through identity and the in-place version counter, so an
    in-place update of a buffer by a pass is seen without hashing its data.
    """
    gm = graph_module_of(program)
    code = hashlib.blake2b(digest_size=16)
    h = hashlib.blake2b(digest_size=16)
    for node in gm.graph.nodes:
        code.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}\n".encode())
        meta = ";".join(
            f"{k}={_meta_token(v)}" for k, v in node.meta.items() if k not in _UNHASHED_META
        )
        h.update(f"{node.name}|{meta}\n".encode())
    for name, module in gm.named_modules():
        for key, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                h.update(f"{name}.{key}={_tensor_token(value)}\n".encode())
        for kind in ("_buffers", "_parameters"):
            for key, value in getattr(module, kind, {}).items():
                token = _tensor_token(value) if value is not None else "None"
                h.update(f"{name}.{kind}.{key}={token}\n".encode())
        h.update(f"{name}:{type(module).__name__}\n".encode())
    if isinstance(program, ExportedProgram):
        h.update(repr(program.graph_signature).encode())
        for key, value in program.state_dict.items():
            h.update(f"state.{key}={_tensor_token(value)}\n".encode())
        for key, value in program.constants.items():
            token = _tensor_token(value) if isinstance(value, torch.Tensor) else id(value)
            h.update(f"const.{key}={token}\n".encode())
    return Fingerprint(code.hexdigest(), h.hexdigest())


OPS = (torch.ops.aten.relu.default, torch.ops.aten.neg.default, torch.ops.aten.sin.default)


def chain_graph(nodes: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for i in range(nodes - 2):
        value = graph.call_function(OPS[i % len(OPS)], (value,))
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def has_output(program) -> list[str]:
    return [] if any(n.op == "output" for n in program.graph.nodes) else ["no output node"]


HasOutput = Condition("HasOutput", has_output, doc="the graph returns something")


def count_ops(gm):
    sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return TorchPassResult(gm, False)


def tag_first(gm):
    next(iter(gm.graph.nodes)).meta["tagged"] = True
    return TorchPassResult(gm, True)


def flip_last_op(gm):
    node = next(n for n in reversed(gm.graph.nodes) if n.op == "call_function")
    node.target = OPS[(OPS.index(node.target) + 1) % len(OPS)]
    return TorchPassResult(gm, True)


RAW_PASSES = [count_ops, tag_first, flip_last_op]
OUR_PASSES = [
    function_pass(count_ops, provides={HasOutput}, name="count_ops"),
    function_pass(tag_first, requires={HasOutput}, preserves={HasOutput}, name="tag_first"),
    function_pass(flip_last_op, requires={HasOutput}, preserves={HasOutput}, name="flip_last_op"),
]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    lines = [
        "## Pass-manager overhead vs torch.fx PassManager (same 3 cheap passes)",
        "",
        "| nodes | torch median ms | ours median ms (min/max) | ratio ours/torch "
        "| fingerprint µs/node | snapshot µs/node |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size in args.sizes:
        gm = chain_graph(size)
        fresh = lambda gm=gm: copy.deepcopy(gm)  # noqa: E731 - a per-size factory
        torch_t = time_call("torch", lambda m: TorchPassManager(RAW_PASSES)(m), fresh, args.repeat)
        ours_t = time_call("ours", lambda m: PassManager(OUR_PASSES).run(m), fresh, args.repeat)
        fp_t = time_call("fingerprint", fingerprint, fresh, args.repeat)
        snap_t = time_call("snapshot", lambda m: RollbackRecord(m, Effects.anything()), fresh,
                           args.repeat)
        lines.append(
            f"| {size} | {torch_t.median * 1e3:.2f} | {ours_t.median * 1e3:.2f} "
            f"({ours_t.min * 1e3:.2f}/{ours_t.max * 1e3:.2f}) | "
            f"{ours_t.median / torch_t.median:.2f}x | {fp_t.median / size * 1e6:.2f} | "
            f"{snap_t.median / size * 1e6:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()

"""Cost of ``exported_program_from`` on converted (quantized) programs, against its floor and
against the re-export it replaces.

Programs: the built-in KV decoder at several depths (default 1, 4, 16, 32 layers) and a
decoder with Llama 3.2 1B's shapes (``tests.models.llama_shaped``: 16 layers, dim 2,048, 32
heads, 8 K/V heads, MLP 8,192, vocabulary 128,256; 1.5 B fp32 parameters, random weights,
``--no-1b`` leaves it out), exported for one-token decodes (static shapes); and, in the same
run, the KV decoder at ``--dynamic-layers`` depths (default 2, 16) and the 1B-shaped decoder
exported with a dynamic token dimension (``Dim`` 1 .. max_seq on the tokens of every input,
as transformers' exporter exports), called with a prefill of 4 tokens, one of 7, then a
one-token decode. A small Llama-shaped decoder (``--llama-layers`` depths, default 1: dim 64,
4 heads, 2 K/V heads, MLP 128, vocabulary 100) gives a row of each kind too: its layers have
more distinct layouts than the KV decoder's (rotary halves, grouped heads) on a small
floor, the hardest case for the dynamic lift. ``--scale-1b N`` divides the 1B-shaped
model's dim and MLP width by N, its 16 layers, heads and so its graph kept, where the full
width does not build in time (the lift's work is per node and per layout, not per weight
element). Each is exported strict under ``no_grad``, functionalized,
quantized through the passes' flow (PassQuantizer with MarkMutableBuffers and
SkipAnnotateDataMovementOps, the every-op quantizer: the most (de)quantize nodes torchao
inserts without a fake value), calibrated on one call, reset, converted with folding and
unfrozen: the GraphModule the main job re-exports.

Per program, CPU time of this process (``time.process_time``, after a garbage collection;
min and median of ``--repeat`` runs, half as many for the re-exports, all four interleaved
round by round; the input is never modified, so every run gets the same one):

* floor: one ``ExportedProgram(...)`` construction from the finished parts of a lift (its
  graph copied beforehand, untimed): what any way of building the program pays;
* lift: ``exported_program_from(converted, like=program)``;
* re-export: ``torch.export.export(converted, example, strict=True)`` under ``no_grad``, and
  re-export + ``PassManager([MarkMutableBuffers(), InplaceToFunctional()])``, which gives
  the same signature as the lift (the main job's re-export stage).

What the lift pays beyond the floor is split, in the same rounds, against two costs any lift
that leaves the graph module unchanged pays with torch's APIs (second table):

* graph copy: ``Graph.graph_copy`` of the converted graph (torch.fx's ``node_copy`` of every
  node, which the lift's copy also is);
* fake tensors: one ``FakeTensor`` per value the lift makes (each node convert left without
  one, each frozen constant), built from its finished layout as the lift builds one (a meta
  tensor of that layout and storage size, wrapped) - the least giving those values can cost
  in the graph's fake mode (``empty_strided`` on meta costs as much on static shapes and
  ~10x more on symbolic ones, which it computes a storage size for in Python arithmetic);
* layouts: the result layout of each distinct layout key (op, input layouts, other
  arguments) among those nodes, as the lift computes it (a fresh ``_ResultLayouts``): a
  run of the op's Meta kernel on the finished input values, or for a (de)quantize on
  symbolic sizes the ``empty_like`` layout built from the sizes' hints (a kernel run there
  is torch's symbolic arithmetic, 0.3-0.5 ms a key, which the lift no longer pays).

Before timing, the lift and the re-export are each called ``--calls`` times from the same
state (outputs and buffers compared exactly; the shared buffers are reset in between, not
deep-copied, which the 1B model's 6 GB would not afford): the ratios compare programs that
compute the same thing.

    python -m benchmarks.bench_lifting [--layers 1 4 16 32] [--dynamic-layers 2 16]
        [--llama-layers 1] [--repeat 5] [--no-1b] [--scale-1b 1]
"""

from __future__ import annotations

import argparse
import copy
import gc
import operator
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager
from pass_manager.benchmarking import Timings
from pass_manager.validation import Trace, first_difference
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    exported_program_from,
    reset_mutable_buffers,
)
from passes._analysis.fake_values import (  # the lift's own steps, timed apart
    _fresh_fake_tensor,
    _Layout,
    _ResultLayouts,
)
from passes.flow.examples import AnnotateEveryOpQuantizer, decode_inputs, kv_decoder
from passes.quantization import PassQuantizer
from tests.models.llama_shaped import llama_inputs, llama_shaped

__all__ = ["main"]

LLAMA_1B = {"n_layers": 16, "dim": 2048, "n_heads": 32, "n_kv_heads": 8, "hidden": 8192,
            "vocab": 128256, "max_seq": 128, "rope_theta": 500000.0}


def _timed_rounds(measured: dict[str, tuple[Callable[[Any], Any], Callable[[], Any], int]]
                  ) -> dict[str, Timings]:
    """Time each ``name: (fn, make_input, runs)`` in interleaved rounds, so that a change in
    the machine's load during the run falls on all of them alike."""
    timings = {name: Timings(name) for name in measured}
    for round_ in range(max(runs for _, _, runs in measured.values())):
        for name, (fn, make_input, runs) in measured.items():
            if round_ >= runs:
                continue
            argument = make_input()
            gc.collect()
            start = time.process_time()
            fn(argument)
            timings[name].samples.append(time.process_time() - start)
    return timings


TOKEN_LENGTHS = (4, 7, 1)  # the dynamic rows' calls: a prefill of 4, one of 7, a decode


def _token_calls(make: Callable[[int, torch.Generator], torch.Tensor]) -> list[tuple]:
    """One ``(tokens [1, n, ...], positions [n])`` call per length of TOKEN_LENGTHS, the
    positions following on; ``make(n, generator)`` gives the tokens."""
    generator, start, calls = torch.Generator().manual_seed(3), 0, []
    for n in TOKEN_LENGTHS:
        calls.append((make(n, generator), torch.arange(start, start + n)))
        start += n
    return calls


def _dynamic_tokens(max_seq: int) -> tuple[dict[int, Any], dict[int, Any]]:
    tokens = torch.export.Dim("tokens", min=1, max=max_seq)
    return {1: tokens}, {0: tokens}


def _converted(model: torch.nn.Module, example: tuple, calls: list[tuple],
               dynamic_shapes: Any = None) -> tuple[Any, Any]:
    """(the functional program, its converted GraphModule) through the passes' flow."""
    with torch.no_grad():
        ep = torch.export.export(model, example, strict=True, dynamic_shapes=dynamic_shapes)
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    quantizer = PassQuantizer(AnnotateEveryOpQuantizer(), transform=[MarkMutableBuffers()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(program.module(), quantizer)
    with torch.no_grad():
        prepared(*calls[0])
    reset_mutable_buffers(prepared)
    converted = convert_pt2e(prepared)
    return program, PassManager([UnfreezeMutableBuffer()]).run(converted).program


def _floor_parts(lifted: ExportedProgram) -> Callable[[], torch.fx.Graph]:
    def fresh_graph() -> torch.fx.Graph:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(lifted.graph, {}))
        return graph
    return fresh_graph


def _construct(lifted: ExportedProgram) -> Callable[[torch.fx.Graph], ExportedProgram]:
    def construct(graph: torch.fx.Graph) -> ExportedProgram:
        return ExportedProgram(
            root=lifted.graph_module, graph=graph, graph_signature=lifted.graph_signature,
            state_dict=lifted.state_dict, range_constraints=lifted.range_constraints,
            module_call_graph=lifted.module_call_graph, example_inputs=lifted.example_inputs,
            constants=lifted.constants, verifiers=lifted.verifiers)
    return construct


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    graph.graph_copy(gm.graph, {})
    return graph


def _missing(converted: Any, lifted: ExportedProgram) -> list[torch.fx.Node]:
    """The lifted graph's copies of the nodes convert left without a fake value (by name:
    the lift keeps names)."""
    names = {n.name for n in converted.graph.nodes
             if n.op == "call_function" and "val" not in n.meta}
    return [n for n in lifted.graph.nodes if n.name in names]


def _made_values(converted: Any, lifted: ExportedProgram) -> list[tuple[_Layout, Any]]:
    """(layout, device) of each fake value the lift makes: the nodes convert left without
    one and the frozen constants."""
    values = [n.meta["val"] for n in _missing(converted, lifted)]
    constants = {id(t): t for t in (operator.attrgetter(str(n.target))(converted)
                                    for n in converted.graph.find_nodes(op="get_attr")
                                    if "val" not in n.meta)}
    values += constants.values()
    return [(_Layout(v.shape, v.stride(), v.dtype, v.untyped_storage().nbytes()), v.device)
            for v in values]


def _fake_tensors(mode: Any) -> Callable[[list[tuple[_Layout, Any]]], None]:
    def make(layouts: list[tuple[_Layout, Any]]) -> None:
        for layout, device in layouts:
            _fresh_fake_tensor(mode, layout, device)
    return make


def _keyed_nodes(converted: Any, lifted: ExportedProgram, mode: Any
                 ) -> list[tuple[torch.fx.Node, tuple]]:
    """One (node, layout key) per distinct layout key among the values the lift makes:
    those whose result layout the lift computes."""
    layouts, first = _ResultLayouts(mode), {}
    for node in _missing(converted, lifted):
        keyed = layouts.key_of(node)
        if keyed is not None:
            first.setdefault(keyed[0], (node, keyed[0]))
    return list(first.values())


def _result_layouts(mode: Any) -> Callable[[list[tuple[torch.fx.Node, tuple]]], None]:
    def run(keyed: list[tuple[torch.fx.Node, tuple]]) -> None:
        layouts = _ResultLayouts(mode)  # new, as each lift's
        for node, key in keyed:
            layouts._layout(node, key)
    return run


def _reexport(converted: Any, example: tuple, dynamic_shapes: Any = None) -> ExportedProgram:
    with torch.no_grad():
        return torch.export.export(converted, example, strict=True,
                                   dynamic_shapes=dynamic_shapes)


def _reexport_functional(converted: Any, example: tuple, dynamic_shapes: Any = None
                         ) -> ExportedProgram:
    functionalize = PassManager([MarkMutableBuffers(), InplaceToFunctional()])
    return functionalize.run(_reexport(converted, example, dynamic_shapes)).program


def _decode(program: ExportedProgram, marked: ExportedProgram, calls: list[tuple]) -> Trace:
    """``program``'s outputs and buffers over ``calls``, run on the state it shares with the
    others; ``marked``'s marks then put that state back."""
    module, trace = program.module(), Trace()
    with torch.no_grad():
        for args in calls:
            trace.outputs.append([module(*args).clone()])
            trace.buffers.append({k: v.clone() for k, v in module.named_buffers()})
            trace.inputs.append([])
    reset_mutable_buffers(marked)
    return trace


def measure(label: str, model: torch.nn.Module, example: tuple, calls: list[tuple],
            repeat: int, export_repeat: int, dynamic_shapes: Any = None) -> tuple[str, str]:
    program, converted = _converted(model, example, calls, dynamic_shapes)
    missing = sum(1 for n in converted.graph.nodes
                  if n.op == "call_function" and "val" not in n.meta)
    lifted = exported_program_from(converted, like=program)
    if lifted.range_constraints != program.range_constraints:
        raise AssertionError(f"{label}: the lift lost the program's range constraints")
    reexported = _reexport(converted, example, dynamic_shapes)
    difference = first_difference(_decode(reexported, lifted, calls),
                                  _decode(lifted, lifted, calls))
    if difference is not None:
        raise AssertionError(f"{label}: the lift and the re-export differ: {difference}")

    layouts = _made_values(converted, lifted)
    mode = detect_fake_mode([p.meta["val"] for p in lifted.graph.find_nodes(op="placeholder")])
    keyed_nodes = _keyed_nodes(converted, lifted, mode)
    t = _timed_rounds({
        "floor": (_construct(lifted), _floor_parts(lifted), repeat),
        "lift": (lambda gm: exported_program_from(gm, like=program), lambda: converted, repeat),
        "graph copy": (_graph_copy, lambda: converted, repeat),
        "fake tensors": (_fake_tensors(mode), lambda: layouts, repeat),
        "layouts": (_result_layouts(mode), lambda: keyed_nodes, repeat),
        "re-export": (lambda gm: _reexport(gm, example, dynamic_shapes), lambda: converted,
                      export_repeat),
        "re-export + functionalize": (
            lambda gm: _reexport_functional(gm, example, dynamic_shapes), lambda: converted,
            export_repeat),
    })
    floor, lift = t["floor"], t["lift"]
    reexport, refunctional = t["re-export"], t["re-export + functionalize"]

    def cell(t: Timings) -> str:
        return f"{t.min * 1e3:.0f} ({t.median * 1e3:.0f})"

    copy_, fakes, kernels = t["graph copy"], t["fake tensors"], t["layouts"]
    above = lift.min - floor.min
    other = above - copy_.min - fakes.min - kernels.min

    def share(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ({seconds / floor.min:.2f})"

    return (f"| {label} | {len(converted.graph.nodes)} | {missing} | {cell(floor)} "
            f"| {cell(lift)} | {cell(reexport)} | {cell(refunctional)} "
            f"| {lift.min / floor.min:.2f} ({lift.median / floor.median:.2f}) "
            f"| {reexport.min / lift.min:.1f} | {refunctional.min / lift.min:.1f} |",
            f"| {label} | {share(above)} | {share(copy_.min)} | {len(layouts)}: "
            f"{share(fakes.min)} | {len(keyed_nodes)}: {share(kernels.min)} "
            f"| {share(other)} |")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[1, 4, 16, 32],
                        help="the KV decoder's depths, static shapes")
    parser.add_argument("--dynamic-layers", type=int, nargs="*", default=[2, 16],
                        help="the KV decoder's depths, dynamic token dimension")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="decode calls compared")
    parser.add_argument("--llama-layers", type=int, nargs="*", default=[1],
                        help="depths of a small Llama-shaped decoder (dim 64, vocabulary "
                             "100), static and dynamic token dimension")
    parser.add_argument("--no-1b", action="store_true",
                        help="leave out the 1B-shaped model (both rows)")
    parser.add_argument("--scale-1b", type=int, default=1,
                        help="divide the 1B-shaped model's dim and MLP width by this (its "
                             "16 layers, heads and graph kept) where the full width does "
                             "not build in time")
    args = parser.parse_args(argv)
    export_repeat = max(1, args.repeat // 2)
    lines = [
        "## Lifting: exported_program_from on converted programs, against its floor and "
        "re-export",
        "",
        "CPU ms, min (median) over repeated runs; ratios of minima from the same run. "
        "Nodes: the converted GraphModule's; missing: its call_function nodes without a "
        "fake value (torchao's (de)quantize nodes), which the lift propagates. Dynamic "
        "tokens: exported with a dynamic token dimension, called with 4, 7 then 1 tokens "
        "(the static rows: one-token decodes).",
        "",
        "| program | nodes | missing | floor: ExportedProgram(...) | lift "
        "| re-export | re-export + functionalize | lift / floor (of medians) "
        "| re-export / lift | (re-export + functionalize) / lift |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    breakdown = [
        "",
        "What lift - floor is made of (CPU ms of the minima, in parentheses as a fraction of "
        "the floor): torch.fx's copy of the converted graph, one FakeTensor per value the "
        "lift makes (their number first), the result layout of each distinct layout key "
        "among them (their number first: a Meta kernel run, or on symbolic sizes a "
        "(de)quantize's empty_like layout built from the hints), and the rest (the layout "
        "keys, the state and signature, the collections of the lift's new objects).",
        "",
        "| program | lift - floor | graph copy | fake tensors | layouts | rest |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    programs: list[tuple[str, dict[str, Any] | None, bool]] = [
        (f"KV decoder, {layers} layers", {"layers": layers}, False) for layers in args.layers]
    programs += [(f"KV decoder, {layers} layers, dynamic tokens", {"layers": layers}, True)
                 for layers in args.dynamic_layers]
    programs += [(f"Llama-shaped, {layers} layer{'s' * (layers > 1)} (dim 64){tail}",
                  {"n_layers": layers, "vocab": 100}, dynamic)
                 for layers in args.llama_layers
                 for tail, dynamic in (("", False), (", dynamic tokens", True))]
    if not args.no_1b:
        config = dict(LLAMA_1B, dim=LLAMA_1B["dim"] // args.scale_1b,
                      hidden=LLAMA_1B["hidden"] // args.scale_1b)
        shape = ("16 layers, dim 2,048" if args.scale_1b == 1 else
                 f"16 layers, dim {config['dim']:,}, MLP {config['hidden']:,}: 1/{args.scale_1b}"
                 " of its width")
        programs += [(f"Llama 3.2 1B-shaped ({shape})", config, False),
                     (f"Llama 3.2 1B-shaped ({shape}), dynamic tokens", config, True)]
    for label, config, dynamic in programs:
        if "layers" not in config:
            model = llama_shaped(seed=0, **config)
            vocab = model.cfg.vocab
            calls = (_token_calls(lambda n, g, v=vocab: torch.randint(v, (1, n), generator=g))
                     if dynamic else llama_inputs(model.cfg, args.calls))
            shapes = _dynamic_tokens(model.cfg.max_seq) if dynamic else None
            big = config.get("dim", 0) >= 1024  # fewer runs: each re-export takes minutes
            row, split = measure(label, model, calls[0], calls,
                                 max(1, args.repeat // 2) if big else args.repeat,
                                 1 if big else export_repeat, shapes)
        else:
            model, _ = kv_decoder(config["layers"])
            dim = model.cfg.dim
            calls = (_token_calls(lambda n, g, dim=dim: torch.randn(1, n, dim, generator=g))
                     if dynamic else decode_inputs(model.cfg, args.calls))
            shapes = _dynamic_tokens(model.cfg.max_seq) if dynamic else None
            row, split = measure(label, copy.deepcopy(model), calls[0], calls, args.repeat,
                                 export_repeat, shapes)
        lines.append(row)
        breakdown.append(split)
        print(row, split, sep="\n", flush=True)
    text = "\n".join(lines + breakdown)
    print(text)
    return text


if __name__ == "__main__":
    main()

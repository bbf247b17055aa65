"""One tensor registered under several buffer names, written: dropped to one name before
ExecuTorch's lowering, which fails on it.

``torch.export`` (non-strict) keeps a placeholder for each name a module registers one
tensor under (tied buffers) and routes every read and write through one of them; the
others have no users. ExecuTorch 1.5.1's ``to_edge`` fails on such a program when the
tensor is written, inside torch's AOT export ("expected compiled_fn to be GraphModule", an
``AssertionError`` naming nothing). :func:`drop_unused_aliases` removes, from the lowering's
private copy, each buffer placeholder nothing reads whose tensor a written buffer the graph
uses also holds: the device keeps the tensor once, under the name the program uses.
"""

from __future__ import annotations

from torch.export import ExportedProgram

from .._analysis.buffers import BUFFER, find_mutations, tied_names

__all__ = ["drop_unused_aliases"]


def drop_unused_aliases(ep: ExportedProgram) -> list[str]:
    """Drop from ``ep`` (in place: a private copy) the unused second names of written
    buffers; returns a note for each."""
    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    names = dict(sig.inputs_to_buffers)
    # Written in place (as exported) or by a BUFFER_MUTATION output (functional).
    written = {state.name for state in find_mutations(ep).writers if state.kind == BUFFER}
    used_written = {fqn for name, fqn in names.items()
                    if fqn in written and placeholders[name].users}
    tied = tied_names(ep, names.values())
    notes = []
    for name, fqn in names.items():
        node = placeholders[name]
        kept = next((other for other in tied.get(fqn, ()) if other in used_written), None)
        if node.users or kept is None or fqn in written:
            continue
        ep.graph.erase_node(node)
        sig.input_specs[:] = [s for s in sig.input_specs if s.arg.name != name]
        held = ep.state_dict if fqn in ep.state_dict else ep.constants
        del held[fqn]
        notes.append(f"dropped buffer {fqn!r}, a second name of {kept!r} that nothing reads "
                     "(ExecuTorch's lowering fails on a written tensor registered twice)")
    if notes:
        ep.graph_module.recompile()
    return notes

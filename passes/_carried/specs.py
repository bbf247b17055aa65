"""The names of a program's flat inputs and outputs, and its call specs with leaves removed or
added: what moving state between the call signature and resident buffers does to ``in_spec``
/ ``out_spec``.

A flat input is named by its placeholder (``cache_0``) and, for a keyword input, by its dotted
path too (``cache.0``: keyword ``cache``, leaf 0 of its container); a flat output by its dotted
path in the output structure (``logits``, ``cache.0``; a returned tuple's elements ``0``,
``1``, ...). Those are the names OpenVINO-style pairing (``past_key_values.*`` inputs,
``present.*`` outputs) matches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch.utils._pytree as pytree
from torch.utils._pytree import TreeSpec

__all__ = ["input_names", "kept_arg_names", "listed_outputs", "output_names", "with_leaves",
           "without_leaves"]


def _context_keys(spec: TreeSpec) -> list | None:
    """The key of each child when ``spec``'s context lists them, one per child: a mapping's
    (``dict``, ``OrderedDict``: any hashable keys) or a ModelOutput's (names); None for any
    other context, even one of as many entries as there are children (a dataclass registered
    with ``torch.export.register_dataclass`` holds ``[field names, None field names]``: two
    lists, not two keys)."""
    children, context = spec.children(), spec.context
    if not isinstance(context, (list, tuple)) or len(context) != len(children):
        return None
    if spec.type in (dict, OrderedDict) or all(isinstance(k, (str, int)) for k in context):
        return list(context)
    return None


def _keys(spec: TreeSpec) -> list[str]:
    """Each child's name in a dotted path: its key (:func:`_context_keys`), else its
    position."""
    keys = _context_keys(spec)
    if keys is not None and all(isinstance(k, (str, int)) for k in keys):
        return [str(k) for k in keys]
    return [str(i) for i in range(len(spec.children()))]


def _paths(spec: TreeSpec, prefix: str, found: list[str]) -> None:
    if spec.is_leaf():
        found.append(prefix)
        return
    for key, child in zip(_keys(spec), spec.children(), strict=True):
        _paths(child, f"{prefix}.{key}" if prefix else key, found)


def output_names(out_spec: TreeSpec) -> list[str]:
    """The dotted path of each flat output (``"0"`` ... for a returned tuple; ``""`` for a
    single returned tensor)."""
    found: list[str] = []
    _paths(out_spec, "", found)
    return found


def listed_outputs(names: Sequence[str]) -> str:
    """Output names as a message lists them: each quoted, since a single returned tensor's
    name is ``""``, which unquoted reads as no output at all."""
    return ", ".join(repr(n) for n in names) or "none"


def input_names(in_spec: TreeSpec, placeholders: Sequence[str]) -> list[tuple[str, ...]]:
    """Per flat input, the names it answers to: its placeholder's, and a keyword input's
    dotted path (``in_spec`` is the ``(args, kwargs)`` spec)."""
    args, kwargs = in_spec.children()
    paths = [""] * args.num_leaves
    _paths(kwargs, "", paths)
    return [tuple(dict.fromkeys(n for n in (name, path) if n))
            for name, path in zip(placeholders, paths, strict=True)]


def without_leaves(spec: TreeSpec, drop: set[int], refuse: Callable[[int, str], Exception],
                   keep: int = 1) -> TreeSpec:
    """``spec`` without the flat leaves ``drop``.

    A container whose leaves all go goes with them; a list, tuple or mapping (any container
    whose context lists its keys) keeps its other children. Dropping only some leaves of any
    other container (a ``StaticCache``, a namedtuple) cannot be said: ``refuse(leaf, type,
    staying)`` gives the error raised for its first dropped leaf (``staying``: the flat
    positions of the container's leaves that would stay).
    The top ``keep`` levels stay even when empty: 2 for an ``(args, kwargs)`` spec, 1 for
    the outputs (a returned tuple stays a tuple; a single returned tensor that goes leaves
    an empty tuple).
    """
    new, _ = _drop(spec, drop, 0, refuse, keep)
    if new is None:  # the one output went: the program returns ``()``, as a spec says it
        # (None would leave a GraphModule's codegen without one, its specs no longer those
        # recorded, and BuffersToInputs unable to restore the signature)
        return pytree.tree_structure(())
    return new


def _drop(spec: TreeSpec, drop: set[int], first: int, refuse, keep: int = 0
          ) -> tuple[TreeSpec | None, int]:
    """``keep``: how many levels from here stay even when all their leaves go."""
    if spec.is_leaf():
        return (None if first in drop else spec), first + 1
    kept, positions, index = [], [], first
    children = spec.children()
    for position, child in enumerate(children):
        new, index = _drop(child, drop, index, refuse, max(keep - 1, 0))
        if new is not None:
            kept.append(new)
            positions.append(position)
    if len(kept) == len(children) and all(a is b for a, b in zip(kept, children, strict=True)):
        return spec, index
    if len(kept) == len(children):
        return TreeSpec(spec.type, spec.context, kept), index
    if not kept and spec.num_leaves > 0 and not keep:
        return None, index
    if spec.type in (list, tuple):
        return TreeSpec(spec.type, spec.context, kept), index
    keys = _context_keys(spec)
    if keys is not None:
        context = [keys[p] for p in positions]
        return TreeSpec(spec.type, type(spec.context)(context), kept), index
    leaves = range(first, index)
    raise refuse(min(i for i in leaves if i in drop), spec.type.__name__,
                 [i for i in leaves if i not in drop])


def with_leaves(spec: TreeSpec, keyword: dict[str, int]) -> TreeSpec:
    """``spec`` (an ``(args, kwargs)`` spec) with one more keyword tensor input per name."""
    args, kwargs = spec.children()
    leaf = pytree.tree_structure(0)
    keys = list(kwargs.context) + list(keyword)
    children = list(kwargs.children()) + [leaf] * len(keyword)
    return TreeSpec(tuple, None, [args, TreeSpec(dict, keys, children)])


def kept_arg_names(names: Sequence[str] | None, in_spec: TreeSpec, new_in_spec: TreeSpec,
                   drop: set[int]) -> list[str] | None:
    """The forward's argument names (a module call signature's ``forward_arg_names``: the
    positional ones, then the keywords) left once the flat inputs ``drop`` have gone."""
    if names is None:
        return None
    args, _ = in_spec.children()
    kept, first = [], 0
    for name, child in zip(names, args.children(), strict=False):
        leaves = set(range(first, first + child.num_leaves))
        first += child.num_leaves
        if not leaves or leaves - drop:
            kept.append(name)
    keywords = set(new_in_spec.child(1).context)
    return kept + [n for n in names[len(args.children()):] if n in keywords]

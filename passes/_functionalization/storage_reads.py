"""Functionalizing ops that read a written tensor's storage or layout, not only its values.

A written view's new value is a fresh tensor with its own storage. ``as_strided`` (and
``_reshape_alias``, ``as_strided_copy``) of it would address that storage, whereas eager
addresses the base's: such ops are re-addressed in the storage root's new value, at their
absolute offset. Stride / storage-offset queries read an original node's layout, which a
write never changes. An ``out=`` resize of an intermediate is a rename to its new value
(metadata mutations such as ``unsqueeze_`` are views by then: ``metadata_mutations``).
Part of :class:`passes._functionalization.rewrite.Rewrite`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node, map_arg

from .._analysis.op_schema import STORAGE_VIEWS, argument_value, target_of, view_base_index
from ..errors import UnsupportedMutationError

__all__ = ["StorageReads", "whole_storage"]


class StorageReads:
    """Rewrite methods for storage readers, layout queries and layout changes (mixed into
    Rewrite)."""

    def _check_relayout(self, node: Node, written: Node, what: str) -> None:
        """A tensor whose shape or strides change: fine for an intermediate no earlier view
        reads (later readers read the new value); refused for state and viewed tensors."""
        alias = self.aliases[written]
        earlier = [n for n, a in self.aliases.items() if a.root is alias.root and a.chain
                   and self.order[n] < self.order[node] and n.op == "call_function"
                   and view_base_index(n) is not None]
        if alias.chain or alias.root in self.states or earlier:
            why = (f"{written.name} is program state" if alias.root in self.states else
                   f"{alias.root.name} is read through views taken before" if not alias.chain
                   else f"{written.name} is a view of {alias.root.name}")
            raise UnsupportedMutationError(
                node, f"{what} changes the shape/strides of {written.name}, and {why}",
                "relayout")
        self.relaid.add(alias.root)

    def _storage_offset(self, node: Node, view: Node, val: Any) -> int:
        """``val``'s offset in the storage of ``view``'s root, whose current value then
        stands for that storage: refused when the root is not exactly its own storage."""
        root = self.aliases[view].root
        cur = self.cur.get(root, root)
        if root in self.relaid:
            raise UnsupportedMutationError(
                node, f"it reads the storage of {root.name}, whose shape/strides a write "
                      "changed", "storage")
        for tensor in (root.meta.get("val"), cur.meta.get("val")):
            if not whole_storage(tensor):
                raise UnsupportedMutationError(
                    node, f"it reads the storage of {root.name} (sizes, strides, offset) after "
                          f"a write, and {root.name} is not a contiguous tensor owning all of "
                          "its storage with static sizes", "storage")
        offset = val.storage_offset() if isinstance(val, torch.Tensor) else None
        if not isinstance(offset, int):
            raise UnsupportedMutationError(
                node, f"it reads the storage of {root.name} at an offset that is not static",
                "storage")
        return offset

    def _storage_reader(self, node: Node) -> bool:
        """Re-address an op reading a written tensor's storage in the root's new value.

        A written view's new value is a fresh tensor with its own storage: ``as_strided``
        of it would read the wrong elements (eager reads the base's storage).
        """
        source = node.args[0]
        alias = self.aliases.get(source)
        if alias is not None and alias.root in self.state_views:
            # Its storage is laid out as eager's only until the first call has ended.
            raise UnsupportedMutationError(
                node, f"it reads the storage of {alias.root.name}, whose strides a metadata "
                      "mutation changes, so its storage order is not eager's", "storage")
        if alias is None or self.cur.get(alias.root, alias.root) is alias.root:
            return False
        if target_of(node) in STORAGE_VIEWS:
            ver = self.version[alias.root]
            self.value[node] = (self._view_values(alias.root, (node,))[-1], ver)
            self.stale.append(node)
            return True
        # as_strided_copy(input, size, stride, offset=input's offset)
        schema = target_of(node)._schema
        offset = argument_value(node, schema, 3)
        if offset is None:
            offset = self._storage_offset(node, source, source.meta.get("val"))
        else:
            self._storage_offset(node, source, source.meta.get("val"))
        size, stride = argument_value(node, schema, 1), argument_value(node, schema, 2)
        self._set_args(node, (self.cur[alias.root], size, stride, offset), {})
        return True

    def _layout_query(self, node: Node) -> None:
        """A stride / storage-offset query reads the layout of an original node (a write
        never changes it), never the layout of a fresh functional value."""
        def twin(arg: Node) -> Node:
            alias = self.aliases.get(arg)
            if alias is None or arg not in self.value:
                return arg
            return alias.chain[-1] if alias.chain else alias.root

        self._set_args(node, *map_arg((node.args, node.kwargs), twin))


def whole_storage(val: Any) -> bool:
    """A contiguous tensor with static sizes at offset 0 that owns all of its storage."""
    if not isinstance(val, torch.Tensor):
        return False
    sizes = (*val.shape, *val.stride(), val.storage_offset())
    if not all(isinstance(s, int) for s in sizes) or val.storage_offset() != 0:
        return False
    try:
        nbytes = val.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return val.is_contiguous() and nbytes == val.numel() * val.element_size()

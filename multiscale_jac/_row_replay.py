"""Which sample each row of a batched run belongs to, without following it again (private).

Following the owners (:class:`~multiscale_jac.rows.RowTracker`, a dispatch mode over every aten
op of the forward pass) costs a Python call per op: on a small model most of a layer-wise call.
Its outcome is a function of what the forward pass does, so a run that does the same again may
take it over, on one premise, checked on every run that uses it:

* the run that was followed was *pure*: no rule read a tensor's values (indices, masks, boxes:
  the same call could permute rows otherwise) and every owner was known;
* the run that takes it over made the same sequence of torch calls, each with the same
  function, the same tensor shapes, dtypes and devices and the same non-tensor arguments
  (:func:`describe`, recorded by the layer-wise run's torch-function mode), and its layers were
  called in the same order with outputs of the same shapes.

Python control flow on data (``.item()``, ``bool(t)``) or on anything else shows in the calls
(another op, another argument); an argument that cannot be compared (an unhashable object)
gives no signature (so does any argument but tensors, numbers, strings, dtypes, devices,
slices and containers of them), and the run is followed again. What is kept (:data:`ROW_PLANS`): per model
(held weakly), at most 128 plans in all, each plain data (shapes, functions, sample indices);
:func:`multiscale_jac.clear_plan_cache` empties it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._plan_cache import PlanCache
from .rows import RowGroups

__all__ = ["ROW_PLANS", "RowPlan", "describe"]


class _Unhashable(Exception):
    pass


def _part(v: Any) -> Any:
    if isinstance(v, Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, *(_part(x) for x in v))
    if isinstance(v, dict):
        return ("d", *((k, _part(x)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("s", _part(v.start), _part(v.stop), _part(v.step))
    if v is None or v is Ellipsis or isinstance(v, _PLAIN):
        return v
    raise _Unhashable  # another object: not compared (nor kept alive by a plan)


_PLAIN = (int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)
_PLAIN += (torch.memory_format,)


def describe(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """One torch call as comparable data (``None``: an argument that cannot be compared)."""
    try:
        return (func, _part(args), _part(kwargs))
    except _Unhashable:
        return None


@dataclass(frozen=True)
class RowPlan:
    """A pure followed run: its torch calls, its layer calls (module id, output shape) in
    order, and the sample groups of each layer call."""

    signature: tuple
    calls: tuple[tuple[int, tuple[int, ...]], ...]
    groups: tuple[RowGroups | None, ...]
    output: tuple[int, ...]

    def matches(
        self, signature: Sequence | None, calls: Sequence[tuple[int, tuple[int, ...]]], out: Any
    ) -> bool:
        return (
            signature is not None
            and isinstance(out, Tensor)
            and tuple(out.shape) == self.output
            and tuple(calls) == self.calls
            and tuple(signature) == self.signature
        )


#: the pure followed runs, per model (held weakly) and key (the inputs' shapes, the hooked
#: layers, whether the graph is kept), least recently used first out; ``None`` marks a key
#: whose run differed from its plan (followed from then on). Emptied by
#: :func:`multiscale_jac.clear_plan_cache`, as every :class:`~multiscale_jac._plan_cache.PlanCache`.
ROW_PLANS = PlanCache(maxsize=128)

"""The cost model's two halves (private): what a model does on one sample (:class:`Work`: the
ops it dispatches by kind, the flops and elements they compute, counted once per model and
shapes by :func:`count_work`) and what that costs on a machine (:class:`Machine`, measured by
:mod:`~multiscale_jac._calibration`)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["KINDS", "NO_WORK", "Machine", "Work", "count_work"]

#: op kinds priced apart: convolutions and matrix products, normalisations, views, the rest
KINDS = ("dense", "norm", "view", "other")

_VIEWS = {
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "select", "slice", "alias", "as_strided", "detach", "split", "split_with_sizes",
    "unbind", "narrow", "clone", "contiguous", "flatten", "unflatten", "lift_fresh",
}  # fmt: skip


def _kind(func: Any) -> str:
    name = func._schema.name.split("::")[-1]
    if any(k in name for k in ("conv", "mm", "linear", "matmul", "attention")):
        return "dense"
    if "norm" in name:
        return "norm"
    return "view" if name in _VIEWS else "other"


@dataclass(frozen=True)
class Work:
    """What one pass of one sample does: ops dispatched per kind (:data:`KINDS`), flops
    (convolutions and matrix products, :mod:`torch.utils.flop_counter`'s count) and elements
    written (the outputs of every op but views)."""

    ops: tuple[int, ...] = (0, 0, 0, 0)
    flops: int = 0
    elems: int = 0

    @property
    def count(self) -> int:
        return sum(self.ops)


#: no work counted (a footprint not measured)
NO_WORK = Work()


class _Counter(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's ``disable`` otherwise, whose
        # first call imports torch._dynamo (1-2 s, tens of MiB): a first call's cost the
        # plain forward pass it counts never needs
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.flops = self.elems = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _kind(func)
        self.ops[kind] += 1
        if kind != "view":
            self.elems += sum(t.numel() for t in _tensors(out))
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            with contextlib.suppress(Exception):  # a count it cannot make is not work we miss
                self.flops += int(count(*args, **kwargs, out_val=out))
        return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def count_work(run: Callable[[], Any]) -> tuple[Any, Work]:
    """``run()``'s result and the :class:`Work` it dispatched."""
    counter = _Counter()
    with counter:
        out = run()
    return out, Work(tuple(counter.ops[k] for k in KINDS), counter.flops, counter.elems)


@dataclass(frozen=True)
class Machine:
    """Seconds per op of each kind (``op_s[pass]``, per :data:`KINDS`)
    in each pass of a vectorised call, per flop, the fixed seconds of one vectorised call
    (``call_s[pass]``: the transforms' set-up) and per element written (``elem_s``), on one
    device, dtype and thread count."""

    op_s: dict[str, tuple[float, ...]]
    flop_s: float
    call_s: dict[str, float]
    elem_s: float = 0.0

    def overhead(self, work: Work, kind: str) -> float:
        """Seconds of one vectorised call of a ``kind`` pass over ``work``'s ops: its set-up
        and its ops' dispatch, whatever the samples it vectorises over."""
        ops = zip(work.ops, self.op_s[kind], strict=True)
        return self.call_s[kind] + sum(n * s for n, s in ops)

    def work_seconds(self, flops: float, elems: float) -> float:
        """Seconds of ``flops`` and of writing ``elems`` elements."""
        return flops * self.flop_s + elems * self.elem_s

    def pass_seconds(self, work: Work, times: float = 1.0) -> float:
        """Seconds of ``times`` times ``work``'s flops and elements."""
        return times * self.work_seconds(work.flops, work.elems)

"""Structured derivatives w.r.t. selected entries of conv/linear weights (reverse mode).

The generic path reparametrises a weight as ``W = W0.index_put(idx, v)`` and differentiates
w.r.t. the selected values ``v``: in reverse mode every output row pays for the full weight
gradient. Here, for ``conv1d/conv2d/linear`` whose weight carries selected entries, the layer
runs through :class:`_SelectedConv` / :class:`_SelectedLinear`, custom autograd functions
(composable with ``vmap``, ``jvp`` and ``jacrev``) whose derivative w.r.t. ``v`` only touches the
selected entries: for ``W[o, i, u, v]``, ``grad_v[j] = <gy[:, o_j], unfold(x)[:, row_j]>``, the
input channel ``i`` shifted by ``(u, v)``, ``O(k L)`` per row (linear: ``x[..., i]``).
:class:`StructuredFunction` gives the model a fresh alias of each such weight (those of
:func:`rev_candidates`) and :class:`StructuredMode` recognises it at ``F.conv1d/conv2d/linear``;
any other op that reads the alias gets the dense reparametrised weight (so weights used
elsewhere, or twice, stay exact).

The engine uses it in reverse mode (``entries="structured"``, or ``"auto"`` for weights of at
least 4,096 entries). Forward mode uses :mod:`~multiscale_jac.entries` instead: under ``vmap``
the tangent's one-hotness is invisible here, so this jvp costs a ``(C_out, k) @ (k, L)`` GEMM
per tangent, not ``O(L)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._ops import bind_op, ntuple, numeric_padding, tensors
from .adapter import PerSampleFunction, dense_weight

__all__ = [
    "StructuredFunction",
    "StructuredMode",
    "layer_roles",
    "rev_candidates",
    "selected_columns",
    "structured_kind",
]


def structured_kind(module_types: set[type]) -> str | None:
    """``"conv1d"``, ``"conv2d"`` or ``"linear"`` if every module owning the weight is one of
    those (one kind), else ``None``."""
    kinds = {torch.nn.Conv1d: "conv1d", torch.nn.Conv2d: "conv2d", torch.nn.Linear: "linear"}
    found = {kinds.get(t) for t in module_types}
    return found.pop() if len(found) == 1 and None not in found else None


def layer_roles(fn: PerSampleFunction) -> dict[str, tuple[str | None, str | None]]:
    """For every selected tensor of ``fn``: the :func:`structured_kind` of the modules that own
    it as their ``weight`` or ``bias``, and that role (``None`` if it has both or neither)."""
    owners: dict[int, set[tuple[type, str]]] = {}
    for m in fn.model.modules():
        for role in ("weight", "bias"):
            t = getattr(m, role, None)
            if isinstance(t, Tensor):
                owners.setdefault(id(t), set()).add((type(m), role))
    params = fn.subset.check_model(fn.model)
    out = {}
    for name in fn.subset.names:
        found = owners.get(id(params[name]), set())
        roles = {r for _, r in found}
        kind = structured_kind({t for t, _ in found})
        out[name] = (kind, roles.pop() if len(roles) == 1 else None)
    return out


def rev_candidates(fn: PerSampleFunction) -> tuple[str, ...]:
    """The selected tensors of ``fn`` that can take the structured reverse path: entries of
    conv1d/conv2d/linear weights, at most half of a tensor (a larger share is cheaper through
    the dense weight)."""
    roles, params = layer_roles(fn), fn.params
    return tuple(
        n
        for n in fn.subset.names
        if fn.flat_indices[n] is not None
        and 2 * fn.flat_indices[n].numel() <= params[n].numel()
        and roles[n][0] is not None
        and roles[n][1] == "weight"
    )


class StructuredFunction:
    """``fn`` (called the same way, ``f(values, *levels) -> (O,)``) with the selected entries
    of ``names`` differentiated through the structured functions (:class:`StructuredMode`).

    Args:
        fn: The per-sample function.
        names: The tensors to run structured; those not in :func:`rev_candidates` are dropped.

    Attributes:
        names: The tensors that run structured, in ``names`` order.
    """

    def __init__(self, fn: PerSampleFunction, names: Sequence[str]) -> None:
        candidates = rev_candidates(fn)
        self.fn = fn
        self.names = tuple(n for n in names if n in candidates)

    def __call__(self, values: tuple[Tensor, ...], *levels: Tensor) -> Tensor:
        fn = self.fn
        if not self.names:
            return fn(values, *levels)
        params = fn.params
        entries = {}
        for n, v in zip(fn.subset.names, values):
            if n in self.names:
                alias = params[n].view_as(params[n])  # a fresh object the mode knows
                entries[id(alias)] = (alias, params[n], fn.flat_indices[n], v)
                params[n] = alias
            else:
                params[n] = fn.place(n, v)
        mode = StructuredMode(entries)
        return fn.call(params, levels, around=lambda stack, _: stack.enter_context(mode))


def _conv_geometry(w0: Tensor, idx: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Output channel and ``unfold`` row of every selected entry of a conv weight."""
    cout = w0.shape[0]
    per_out = w0[0].numel()  # cin_g * kh * kw
    o = idx // per_out
    group = o // (cout // groups)
    return o, group * per_out + idx % per_out


def selected_columns(
    x: Tensor, w0: Tensor, idx: Tensor, stride: Any, padding: Any, dilation: Any, groups: int
) -> Tensor:
    """``(B, k, L)``: the ``unfold`` row of ``x`` that every selected entry ``idx`` of the conv
    weight ``w0`` multiplies (input channel shifted by the entry's kernel offset); ``x`` is
    ``(B, C, H, W)`` (conv2d) or ``(B, C, L)`` (conv1d, unfolded as ``(B, C, 1, L)``), numeric
    ``padding``."""
    _, rows = _conv_geometry(w0, idx, groups)
    kernel = tuple(w0.shape[2:])
    if x.dim() == 3:
        x, kernel = x.unsqueeze(2), (1, *kernel)
        stride = (1, *ntuple(stride, 1))
        padding = (0, *ntuple(padding, 1))
        dilation = (1, *ntuple(dilation, 1))
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, C*K, L)
    return cols.index_select(1, rows)


class _SelectedConv(torch.autograd.Function):
    """``conv2d(x, W0.index_put(idx, v), None, stride, padding, dilation, groups)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w0, v, idx, stride, padding, dilation, groups):  # type: ignore[override]
        return F.conv2d(x, dense_weight(w0, idx, v), None, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        x, w0, v, idx, stride, padding, dilation, groups = inputs
        ctx.save_for_forward(x, w0, v, idx)
        ctx.save_for_backward(x, w0, v, idx)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.out_hw = tuple(output.shape[-2:])

    @staticmethod
    def _columns(ctx, x: Tensor, w0: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        stride, padding, dilation, groups = ctx.conv
        o, _ = _conv_geometry(w0, idx, groups)
        return o, selected_columns(x, w0, idx, stride, padding, dilation, groups)  # (B, k, L)

    @staticmethod
    def jvp(ctx, x_t, w0_t, v_t, *_):  # type: ignore[override]
        x, w0, v, idx = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        out = None
        if x_t is not None:
            out = F.conv2d(x_t, dense_weight(w0, idx, v), None, stride, padding, dilation, groups)
        if v_t is not None:
            o, cols = _SelectedConv._columns(ctx, x, w0, idx)
            # (C_out, k) weights of the selected entries' tangents, then one GEMM with the columns
            place = (o[None, :] == torch.arange(w0.shape[0], device=o.device)[:, None]).to(
                v_t.dtype
            )
            y = torch.matmul(place * v_t[None, :], cols)  # (B, C_out, L)
            y = y.view(x.shape[0], w0.shape[0], *ctx.out_hw)
            out = y if out is None else out + y
        return out

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, w0, v, idx = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = torch.nn.grad.conv2d_input(
                x.shape, dense_weight(w0, idx, v), gy, stride, padding, dilation, groups
            )
        if ctx.needs_input_grad[2]:
            o, cols = _SelectedConv._columns(ctx, x, w0, idx)
            g = gy.flatten(2).index_select(1, o)  # (B, k, L)
            gv = (g * cols).sum(dim=(0, 2))
        return gx, None, gv, None, None, None, None, None


class _SelectedLinear(torch.autograd.Function):
    """``linear(x, W0.index_put(idx, v))`` (no bias)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w0, v, idx):  # type: ignore[override]
        return F.linear(x, dense_weight(w0, idx, v))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        x, w0, v, idx = inputs
        ctx.save_for_forward(x, w0, v, idx)
        ctx.save_for_backward(x, w0, v, idx)

    @staticmethod
    def jvp(ctx, x_t, w0_t, v_t, idx_t):  # type: ignore[override]
        x, w0, v, idx = ctx.saved_tensors
        out = None if x_t is None else F.linear(x_t, dense_weight(w0, idx, v))
        if v_t is not None:
            cin = w0.shape[1]
            contrib = x.index_select(-1, idx % cin) * v_t  # (..., k)
            y = contrib.new_zeros(*x.shape[:-1], w0.shape[0]).index_add(-1, idx // cin, contrib)
            out = y if out is None else out + y
        return out

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, w0, v, idx = ctx.saved_tensors
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = gy @ dense_weight(w0, idx, v)
        if ctx.needs_input_grad[2]:
            cin = w0.shape[1]
            g = gy.index_select(-1, idx // cin) * x.index_select(-1, idx % cin)
            gv = g.reshape(-1, idx.numel()).sum(0)
        return gx, None, gv, None


class StructuredMode(TorchFunctionMode):
    """Route conv/linear calls on registered weight aliases through the structured functions.

    Args:
        entries: ``id(alias) -> (alias, w0, idx, v)``: the alias the model sees as its weight,
            the detached base weight, the flat indices of the selected entries and their values.
    """

    def __init__(self, entries: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]]) -> None:
        super().__init__()
        self.entries = entries

    def _entry(self, t: Any) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        e = self.entries.get(id(t)) if isinstance(t, Tensor) else None
        return e if e is not None and e[0] is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            b = bind_op(handler[1], args, kwargs)
            e = self._entry(b["weight"])
            if e is not None:
                return handler[0](b, e)
        if not any(self._entry(a) is not None for a in tensors(args, kwargs)):
            return func(*args, **kwargs)

        # any other use of a registered weight: the dense reparametrised weight
        def swap(a: Any) -> Any:
            e = self._entry(a)
            return dense_weight(e[1], e[2], e[3]) if e is not None else a

        args = tuple(
            swap(a) if not isinstance(a, (list, tuple)) else type(a)(map(swap, a)) for a in args
        )
        kwargs = {k: swap(a) for k, a in kwargs.items()}
        return func(*args, **kwargs)


def _conv_nd(b: dict, e: tuple, nd: int) -> Tensor:
    _, w0, idx, v = e
    x = b["input"]
    stride, dilation = ntuple(b["stride"], nd), ntuple(b["dilation"], nd)
    padding = numeric_padding(b["padding"], dilation, tuple(w0.shape[2:]))
    if padding is None:  # asymmetric 'same': dense path
        conv = F.conv2d if nd == 2 else F.conv1d
        dense = dense_weight(w0, idx, v)
        return conv(x, dense, b["bias"], b["stride"], b["padding"], b["dilation"], b["groups"])
    unbatched = x.dim() == nd + 1
    if unbatched:
        x = x.unsqueeze(0)
    if nd == 1:  # as a conv2d over (1, L)
        x, w0 = x.unsqueeze(2), w0.unsqueeze(2)
        stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
    y = _SelectedConv.apply(x, w0, v, idx, stride, padding, dilation, b["groups"])
    if nd == 1:
        y = y.squeeze(2)
    if b["bias"] is not None:
        y = y + b["bias"].reshape(1, -1, *([1] * nd))
    return y.squeeze(0) if unbatched else y


def _linear(b: dict, e: tuple) -> Tensor:
    _, w0, idx, v = e
    y = _SelectedLinear.apply(b["input"], w0, v, idx)
    return y if b["bias"] is None else y + b["bias"]


_HANDLERS: dict[Any, tuple[Callable, str]] = {
    torch.conv2d: (lambda b, e: _conv_nd(b, e, 2), "conv"),
    torch.conv1d: (lambda b, e: _conv_nd(b, e, 1), "conv"),
    F.linear: (_linear, "linear"),
}

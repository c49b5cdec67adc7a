"""Forward mode w.r.t. single entries of conv/linear weights and biases, at their own cost.

For an entry ``W[o, i, u, v]`` of a conv (``W[o, i]`` of a linear layer, ``b[o]`` of a bias) the
layer's output tangent is known in closed form: input channel ``i`` shifted by ``(u, v)`` (the
``unfold`` row of the entry; ``x[..., i]``; ones), placed in output channel ``o``, zero elsewhere.
:class:`EntryMode` (a ``TorchFunctionMode``) runs one forward pass per selected tensor and keeps
that tangent *pending* (``m * e_o (x) row_j``, ``m`` a multiplier) instead of forming it:
elementwise ops multiply ``m`` by their derivative, a conv/linear layer reading the pending
tensor gets only channel ``o`` (valid stride-1 convs compose into one kernel), and any other use
materialises it (``docs/entries.md`` walks through the steps). So every path is exact; the
structure only makes the common ones cheap. The entry index ``j`` travels as the tangent of a
dummy scalar ``c0`` (the tangent on ``v`` is ``e_j``): both are set by the engine, one entry per
tangent, which is the contract the closed forms rely on.

Safety: a layer whose input carries a tangent takes the dense route. An in-place op on a pending
tensor other than a whitelisted elementwise one, or on a tensor with a tangent after a pending
tensor was copied, raises :class:`NotStructuredError`; the engine then runs the generic path for
that tensor and records why.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import jvp
from torch.overrides import TorchFunctionMode

from ._ops import ACTIVATIONS, bind_call, bind_op, ntuple, numeric_padding, tensors
from .adapter import PerSampleFunction
from .structured import layer_roles, selected_columns

__all__ = [
    "EntryGeometry",
    "EntryMode",
    "NotStructuredError",
    "entry_call",
    "entry_geometry",
    "entry_names",
]


class NotStructuredError(RuntimeError):
    """The model did something the structured forward pass does not handle exactly."""


@dataclass(frozen=True)
class EntryGeometry:
    """The selected entries of one tensor: their flat indices and their output channel."""

    flat: Tensor  # (k,) long
    ochan: Tensor  # (k,) long
    is_bias: bool


def entry_geometry(
    shape: tuple[int, ...], idx: Tensor | None, device: torch.device
) -> EntryGeometry:
    """The :class:`EntryGeometry` of entries ``idx`` (flat; ``None``: all) of a weight or bias
    of shape ``shape`` (a 1-d tensor is taken for a bias)."""
    numel = math.prod(shape)
    flat = torch.arange(numel, device=device) if idx is None else idx.to(device)
    return EntryGeometry(flat=flat, ochan=flat // (numel // shape[0]), is_bias=len(shape) == 1)


# ---------------------------------------------------------------------- autograd functions
def _row(
    ctx: Any, c_t: Tensor, u: Tensor | None, m: Tensor | None, ochan: Tensor, dim: int
) -> tuple[Tensor, Tensor]:
    """``(m_o * row_j, o)`` for the entry ``j`` (the tangent ``c_t``): the pending tangent's one
    non-zero channel (size 1 at ``dim``); ``ctx.like`` is the pending tensor's (shape, dtype, device)."""
    j = c_t.long().reshape(1)
    o = ochan.index_select(0, j)
    if u is None:  # a bias entry: ones
        shape, dtype, device = ctx.like
        shape = list(shape)
        shape[dim] = 1
        row = torch.ones(shape, dtype=dtype, device=device)
    else:
        row = u.index_select(dim, j)
    if m is not None:
        row = row * m.index_select(dim, o)
    return row, o


def _hot(o: Tensor, channels: int, ndim: int, dim: int, dtype: torch.dtype) -> Tensor:
    shape = [1] * ndim
    shape[dim] = channels
    return (torch.arange(channels, device=o.device) == o).to(dtype).view(shape)


def _save(ctx: Any, *tensors: Tensor | None) -> None:
    """``save_for_forward`` for optional tensors (``None`` kept as a flag)."""
    ctx.present = tuple(t is not None for t in tensors)
    ctx.save_for_forward(*(t for t in tensors if t is not None))


def _saved(ctx: Any) -> list[Tensor | None]:
    it = iter(ctx.saved_tensors)
    return [next(it) if p else None for p in ctx.present]


def _one_channel_conv(t: Tensor, k: Tensor, spec: tuple) -> Tensor:
    """``conv(t, k)`` for a one-channel ``t`` ``(B, 1, *spatial)`` and ``k`` ``(C, 1, *kernel)``
    (per entry under ``vmap``: unfold + matmul, as a grouped conv per entry is slow on CPU)."""
    stride, padding, dilation, out_sp = spec
    if t.dim() != 4 or isinstance(padding, str):
        op = F.conv2d if t.dim() == 4 else F.conv1d
        return op(t, k, None, stride, padding, dilation)
    cols = F.unfold(t, tuple(k.shape[2:]), dilation=dilation, padding=padding, stride=stride)
    out = torch.matmul(k.flatten(1), cols)  # (B, C, L)
    return out.view(*out.shape[:2], *out_sp)


class _Materialize(torch.autograd.Function):
    """``y`` (a copy) whose tangent gains the pending contribution of entry ``j``: the source
    row placed in channel ``o`` or, with ``kernels``, convolved with ``kernels[o]``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y, c0, u, ochan, m, kernels, dim, has_tangent, src):  # type: ignore[override]
        return y.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        y, _c0, u, ochan, m, kernels, dim, has_tangent, src = inputs
        _save(ctx, u, ochan, m, kernels)
        ctx.spec = (dim, has_tangent, y.shape[dim], y.dim(), tuple(y.shape[2:]))
        ctx.like = (src, y.dtype, y.device)

    @staticmethod
    def jvp(ctx, y_t, c_t, *_):  # type: ignore[override]
        dim, has_tangent, channels, ndim, out_sp = ctx.spec
        u, ochan, m, kernels = _saved(ctx)
        row, o = _row(ctx, c_t, u, m, ochan, dim)
        if kernels is None:
            out = _hot(o, channels, ndim, dim, row.dtype) * row
        else:
            k = kernels.index_select(0, o).transpose(0, 1)  # (C, 1, *kernel)
            out = _one_channel_conv(row, k, (1, 0, 1, out_sp))
        return out + y_t if has_tangent else out


class _Consume(torch.autograd.Function):
    """A conv/linear reading a pending tensor: primal as usual, tangent from channel ``o``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, b, c0, u, ochan, m, spec):  # type: ignore[override]
        kind, _dim, conv = spec
        if kind == "linear":
            return F.linear(x, w, b)
        return (F.conv2d if kind == "conv2d" else F.conv1d)(x, w, b, *conv)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        x, w, _b, _c0, u, ochan, m, spec = inputs
        _save(ctx, w, u, ochan, m)
        ctx.out_sp = tuple(output.shape[2:])
        ctx.spec = spec
        ctx.like = (tuple(x.shape), x.dtype, x.device)

    @staticmethod
    def jvp(ctx, x_t, w_t, b_t, c_t, *_):  # type: ignore[override]
        kind, dim, conv = ctx.spec
        w, u, ochan, m = _saved(ctx)
        t, o = _row(ctx, c_t, u, m, ochan, dim)  # (..., 1) or (B, 1, *spatial)
        if kind == "linear":
            return t * w.index_select(1, o).squeeze(1)
        stride, padding, dilation, _ = conv
        spec = (stride, padding, dilation, ctx.out_sp)
        return _one_channel_conv(t, w.index_select(1, o), spec)


def _numel(out: Any) -> int:
    if isinstance(out, Tensor):
        return out.numel()
    if isinstance(out, (list, tuple)):
        return sum(_numel(o) for o in out)
    return 0


def _fan_in(kind: str, w: Tensor) -> int:
    """The inputs every output of a conv/linear layer with weight ``w`` sums over."""
    return int(w.shape[-1] if kind == "linear" else w[0].numel())


def _macs(kind: str, out: Any, args: tuple, kwargs: dict) -> int:
    """Multiply-adds of a conv/linear call (its output times the weight's fan-in)."""
    b = bind_op("linear" if kind == "linear" else "conv", args, kwargs)
    return _numel(out) * _fan_in(kind, b["weight"])


# ---------------------------------------------------------------------- the mode
@dataclass
class _Pending:
    ref: weakref.ref
    u: Tensor | None
    m: Tensor | None
    dim: int
    #: ``(C_entry_out, C, *kernel)``: the tangent is ``conv(source_o, kernels[o])`` (a chain of
    #: valid stride-1 convs composed into one kernel), or ``None``: the source in channel ``o``
    kernels: Tensor | None = None
    #: shape of the layer output the entries' tangent starts in (the source's layout)
    src: tuple[int, ...] = ()
    copy: Tensor | None = field(default=None)


#: elementwise ops that keep a tangent pending (derivative: ``jvp`` with a ones tangent)
_ELEMENTWISE = {*ACTIVATIONS, F.batch_norm}
_INPLACE_TO_OUT = {torch.relu_: torch.relu, torch.Tensor.relu_: torch.relu, F.relu_: torch.relu}
_IDENTITY_IF_OFF = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout}


def _is_inplace(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    if name in _INPLACE_DUNDERS or "out" in kwargs:
        return True
    if func in _ELEMENTWISE or func in _IDENTITY_IF_OFF:
        b = bind_call(func, args, kwargs)
        return bool(b and b.get("inplace"))
    return False


_INPLACE_OPS = "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift"
_INPLACE_DUNDERS = {"__setitem__", *(f"__i{op}__" for op in _INPLACE_OPS.split())}
#: ops whose output is (usually) a view: they create no new tangent memory
_VIEWS = {
    *("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze"),
    *("permute", "transpose", "t", "movedim", "expand", "expand_as", "select", "narrow", "split"),
    *("chunk", "unbind", "__getitem__"),
}


def _valid_unit(b: dict, nd: int) -> bool:
    """A conv call with stride 1, dilation 1, no padding and one group."""
    pad = b["padding"]
    no_pad = pad == "valid" or (not isinstance(pad, str) and set(ntuple(pad, nd)) == {0})
    return (
        no_pad
        and set(ntuple(b["stride"], nd)) == {1}
        and set(ntuple(b["dilation"], nd)) == {1}
        and b["groups"] == 1
    )


_CONVS = {torch.conv2d: "conv2d", F.conv2d: "conv2d", torch.conv1d: "conv1d", F.conv1d: "conv1d"}


class EntryMode(TorchFunctionMode):
    """One forward pass with tangents on the selected entries of one weight or bias.

    Args:
        alias: The object the model sees as the selected tensor (a fresh view of it).
        dense: The selected tensor with the current values placed, without a tangent.
        generic: ``() -> Tensor``: the reparametrised tensor whose tangent is the one-hot
            tangent (used by any op other than conv/linear).
        c0: The dummy scalar whose tangent is the entry index ``j``.
        geometry: The entries' :class:`EntryGeometry`.
    """

    def __init__(
        self,
        alias: Tensor,
        dense: Tensor,
        generic: Callable[[], Tensor],
        c0: Tensor,
        geometry: EntryGeometry,
    ) -> None:
        super().__init__()
        self.alias = alias
        self.dense = dense
        self.generic = generic
        self.c0 = c0
        self.geo = geometry
        self._generic: Tensor | None = None
        self._pending: dict[int, _Pending] = {}
        self._tainted: dict[int, weakref.ref] = {}
        self._taint_all = False
        #: counts of what ran: entry layers, one-channel consumers, chained convs, copies,
        #: generic uses, entry layers that took the dense route
        kinds = ("entry", "consume", "chain", "materialize", "generic", "dense_entry")
        self.stats = dict.fromkeys(kinds, 0)
        #: per-tangent work (multiply-adds or elements written) of this pass (``work``) and of
        #: the generic one-hot pass over the same ops (``dense_work``), and the elements of the
        #: tangents they create (``elems``, ``dense_elems``; a sum over ops, so an upper bound of
        #: what is alive at once): the cost model's and the memory planner's inputs
        self.work = 0
        self.dense_work = 0
        self.elems = 0
        self.dense_elems = 0
        #: elements the pass holds whatever the tangents: each entry layer's unfolded input and
        #: the rows of it the selected entries multiply (a conv; a linear layer's selected
        #: input columns), summed over entry layers (one forward per sample, not per tangent)
        self.held = 0

    def _count(self, work: int, dense_work: int, elems: int, dense_elems: int) -> None:
        self.work += work
        self.dense_work += dense_work
        self.elems += elems
        self.dense_elems += dense_elems

    # ------------------------------------------------------------ bookkeeping
    def _pend(self, t: Any) -> _Pending | None:
        if not isinstance(t, Tensor):
            return None
        p = self._pending.get(id(t))
        return p if p is not None and p.ref() is t else None

    def _taint(self, t: Any) -> bool:
        if not isinstance(t, Tensor):
            return False
        r = self._tainted.get(id(t))
        return r is not None and r() is t

    def _involved(self, t: Any) -> bool:
        """``t`` is the selected tensor or carries a tangent (pending or not)."""
        return t is self.alias or self._taint(t) or self._pend(t) is not None

    def _mark(self, out: Any) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, Tensor):
                self._tainted[id(t)] = weakref.ref(t)

    def _materialize(self, t: Tensor, p: _Pending) -> Tensor:
        if p.copy is None:
            self.stats["materialize"] += 1
            k = 1 if p.kernels is None else p.kernels[0].numel()
            self._count(t.numel() * k, 0, t.numel(), 0)
            p.copy = _Materialize.apply(
                t, self.c0, p.u, self.geo.ochan, p.m, p.kernels, p.dim, False, p.src
            )
            self._mark(p.copy)
        return p.copy

    def _swap(self, a: Any) -> Any:
        """An argument as a general op must see it: pending -> copy, alias -> generic."""
        if isinstance(a, (list, tuple)):
            return type(a)(self._swap(b) for b in a)
        if a is self.alias:
            if self._generic is None:
                self.stats["generic"] += 1
                self._generic = self.generic()
                self._mark(self._generic)
            return self._generic
        p = self._pend(a)
        return self._materialize(a, p) if p is not None else a

    # ------------------------------------------------------------ dispatch
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        kind = _CONVS.get(func) or ("linear" if func is F.linear else None)
        if kind is not None:
            out = self._layer(func, kind, args, kwargs)
            if out is not None:
                return out
        elif args and self._pend(args[0]) is not None:
            out = self._elementwise(func, args, kwargs)
            if out is not None:
                return out
        inplace = _is_inplace(func, args, kwargs)
        if inplace and args:
            self._check_inplace(args[0])
        operands = list(tensors(args, kwargs))
        if not any(self._involved(t) for t in operands):
            return func(*args, **kwargs)
        if inplace and args and isinstance(args[0], Tensor) and not self._taint(args[0]):
            self._taint_all = True  # views of its base gain a tangent unseen
        out = func(*self._swap(args), **{k: self._swap(v) for k, v in kwargs.items()})
        self._mark(out)
        cost = _macs(kind, out, args, kwargs) if kind is not None else _numel(out)
        new = 0 if getattr(func, "__name__", "") in _VIEWS else _numel(out)
        self._count(cost, cost, new, new)
        return out

    def _check_inplace(self, target: Any) -> None:
        if self._pend(target) is not None:
            raise NotStructuredError(
                "an in-place op writes into a layer output with a pending structured tangent"
            )
        if self._taint(target):
            # a copy made for a pending tangent and its original could diverge, and vmap
            # cannot write a per-entry tangent into an output of the structured functions
            raise NotStructuredError("an in-place op writes into a tensor with a tangent")

    def _layer(self, func: Any, kind: str, args: tuple, kwargs: dict) -> Tensor | None:
        b = bind_op("linear" if kind == "linear" else "conv", args, kwargs)
        x, w, bias = b["input"], b["weight"], b["bias"]
        if not isinstance(x, Tensor):
            return None
        if w is self.alias or bias is self.alias:
            if (w is self.alias) == self.geo.is_bias:  # weight entries used as a bias or v.v.
                return None
            return self._entry(func, kind, b)
        p = self._pend(x)
        if p is None or any(self._involved(t) for t in (w, bias)):
            return None
        if kind == "linear":
            if p.dim != x.dim() - 1 or p.kernels is not None:
                return None
            spec: tuple = ("linear", p.dim, None)
        else:
            if p.dim != 1 or b["groups"] != 1 or x.dim() != (4 if kind == "conv2d" else 3):
                return None
            if _valid_unit(b, x.dim() - 2):
                return self._chain(func, kind, b, p)
            if p.kernels is not None:
                return None
            spec = (kind, 1, (b["stride"], b["padding"], b["dilation"], 1))
        self.stats["consume"] += 1
        out = _Consume.apply(x, w, bias, self.c0, p.u, self.geo.ochan, p.m, spec)
        self._mark(out)
        fan_in, c_in, o = _fan_in(kind, w), max(x.shape[p.dim], 1), out.numel()
        cols = o // max(out.shape[p.dim], 1) * fan_in // c_in
        macs = o * fan_in
        self._count(macs // c_in + o, macs, o + cols, o)
        return out

    def _chain(self, func: Any, kind: str, b: dict, p: _Pending) -> Tensor:
        """A valid stride-1 conv of a pending tensor: compose its kernel into the pending
        kernels (``conv(conv(s, K), W) = conv(s, K * W)``, a full convolution of kernels);
        the output stays pending and nothing runs per entry."""
        x, w = b["input"], b["weight"]
        y = func(x, w, b["bias"], 1, 0, 1, 1)
        if p.kernels is None:
            kernels = w.transpose(0, 1)  # kernels[o] = W[:, o]
        else:
            tconv = F.conv_transpose2d if kind == "conv2d" else F.conv_transpose1d
            kernels = tconv(p.kernels, w.transpose(0, 1))
        self.stats["chain"] += 1
        self._count(0, y.numel() * w[0].numel(), 0, y.numel())
        self._pending[id(y)] = _Pending(weakref.ref(y), p.u, p.m, 1, kernels, p.src)
        return y

    def _entry(self, func: Any, kind: str, b: dict) -> Tensor | None:
        x = b["input"]
        w = self.dense if b["weight"] is self.alias else b["weight"]
        bias = self.dense if b["bias"] is self.alias else b["bias"]
        if self._taint(w if self.geo.is_bias else bias) or self._pend(x) is not None:
            return None
        if kind == "linear":
            y = F.linear(x, w, bias)
            dim = y.dim() - 1
            u = None if self.geo.is_bias else x.index_select(-1, self.geo.flat % x.shape[-1])
            self.held += 0 if u is None else u.numel()
        else:
            nd = 2 if kind == "conv2d" else 1
            if x.dim() != nd + 2:
                return None
            dilation = ntuple(b["dilation"], nd)
            padding = numeric_padding(b["padding"], dilation, tuple(w.shape[2:]))
            if padding is None:
                return None  # asymmetric 'same'
            stride, groups = ntuple(b["stride"], nd), b["groups"]
            y = func(x, w, bias, stride, padding, dilation, groups)
            dim = 1
            u = None
            if not self.geo.is_bias:
                cols = selected_columns(x, w, self.geo.flat, stride, padding, dilation, groups)
                u = cols.view(x.shape[0], -1, *y.shape[2:])
                unfolded = w.shape[1] * groups * math.prod(w.shape[2:])  # rows of the unfold
                self.held += x.shape[0] * unfolded * cols.shape[-1] + cols.numel()
        macs = y.numel() * _fan_in(kind, w)
        self._count(0, macs, 0, y.numel())
        if self._taint_all or self._taint(x):
            # the input carries a tangent too: dense route
            self.stats["dense_entry"] += 1
            self._count(macs + y.numel(), 0, y.numel(), 0)
            out = _Materialize.apply(
                y, self.c0, u, self.geo.ochan, None, None, dim, True, tuple(y.shape)
            )
            self._mark(out)
            return out
        self.stats["entry"] += 1
        self._pending[id(y)] = _Pending(weakref.ref(y), u, None, dim, None, tuple(y.shape))
        return y

    def _elementwise(self, func: Any, args: tuple, kwargs: dict) -> Tensor | None:
        """A whitelisted elementwise op on a pending tensor: stays pending, ``m *= f'(y)``."""
        y = args[0]
        p = self._pend(y)
        if p is None or p.kernels is not None:
            return None
        if any(self._involved(t) for t in tensors(args[1:], kwargs)):
            return None
        b = bind_call(func, args, kwargs) if func in _ELEMENTWISE | _IDENTITY_IF_OFF else None
        if func in _IDENTITY_IF_OFF:  # dropout: the identity when not training
            if b is None or b.get("training", True):
                return None
            out = y if b.get("inplace") else y.clone()
            self._count(0, y.numel(), 0, y.numel())
            self._pending[id(out)] = _Pending(weakref.ref(out), p.u, p.m, p.dim, None, p.src)
            return out
        if func is F.batch_norm and (b is None or b.get("training")):
            return None
        inplace = func in _INPLACE_TO_OUT or bool(b and b.get("inplace"))
        if func not in _ELEMENTWISE and func not in _INPLACE_TO_OUT:
            return None
        if inplace and p.copy is not None:
            raise NotStructuredError(
                "an in-place op writes into a layer output whose pending tangent was copied"
            )
        if b is not None:
            first = next(iter(b))

            def f(t: Tensor) -> Tensor:
                return func(**{**b, first: t, **({"inplace": False} if "inplace" in b else {})})
        else:
            out_func = _INPLACE_TO_OUT.get(func, func)

            def f(t: Tensor) -> Tensor:
                return out_func(t, *args[1:], **kwargs)

        self._count(0, y.numel(), 0, y.numel())
        primal, deriv = jvp(f, (y,), (torch.ones_like(y),))
        m = deriv if p.m is None else p.m * deriv
        if inplace:
            out = func(*args, **kwargs)  # the model's own in-place op on the primal
            p.m = m
            return out
        self._pending[id(primal)] = _Pending(weakref.ref(primal), p.u, m, p.dim, None, p.src)
        return primal


# ---------------------------------------------------------------------- running a function
def entry_names(fn: PerSampleFunction) -> tuple[str, ...]:
    """The selected tensors of ``fn`` the structured forward pass can run: weights and biases
    of conv1d/conv2d/linear modules."""
    roles = layer_roles(fn)
    return tuple(n for n in fn.subset.names if None not in roles[n])


def entry_call(
    fn: PerSampleFunction,
    name: str,
    values: tuple[Tensor, ...],
    levels: tuple[Tensor, ...],
    v: Tensor,
    c0: Tensor,
    *,
    stats: dict[str, int] | None = None,
) -> Tensor:
    """The flat output ``(O,)`` of one sample of ``fn`` with the structured forward pass for
    the entries of ``name`` (:class:`EntryMode`).

    Args:
        fn: The per-sample function.
        name: The selected tensor whose entries carry tangents.
        values: All selected values (primal); ``name``'s are replaced by ``v``.
        levels: The sample's levels.
        v: ``name``'s selected values, carrying the one-hot tangent ``e_j``.
        c0: A scalar zero carrying the tangent ``j``.
        stats: If given, updated with the counts of what the pass ran, its per-tangent
            ``work``, ``dense_work``, ``elems``, ``dense_elems`` and the elements it ``held``
            whatever the tangents (see :class:`EntryMode`).
    """
    params = fn.full_params(values)
    base = fn.params[name]
    alias = base.view_as(base)  # a fresh object the mode recognises
    geometry = entry_geometry(tuple(base.shape), fn.flat_indices[name], base.device)
    mode = EntryMode(alias, params[name].detach(), lambda: fn.place(name, v), c0, geometry)
    params[name] = alias
    try:
        return fn.call(params, levels, around=lambda stack, _: stack.enter_context(mode))
    finally:  # also what was counted before a NotStructuredError
        if stats is not None:
            kinds = ("work", "dense_work", "elems", "dense_elems", "held")
            counts = {k: getattr(mode, k) for k in kinds}
            for k, n in (*mode.stats.items(), *counts.items()):
                stats[k] = stats.get(k, 0) + n

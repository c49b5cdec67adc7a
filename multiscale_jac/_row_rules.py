"""The row rules of :mod:`~multiscale_jac.rows` (private): for every aten op, the owner of each
element of its outputs from the owners of its inputs' elements.

An *owner* is an ``int32`` CPU tensor with the ndim of the tensor it describes, each dim either
of size 1 (the owner does not vary along it) or of the tensor's size: ``owner[e]`` is the sample
whose data element ``e`` was computed from, ``-1`` for none (a constant: a parameter, zeros, a
learned token). ``None`` stands for an owner that is ``-1`` everywhere (a *shared* tensor).
Owners combine by agreement: ``-1`` agrees with anything, two different samples do not
(:class:`Mixed`, an :class:`Unknown` whose reason names the op and the two samples).

Rules by kind (each a function ``rule(ctx, b, out)`` of the op's bound arguments ``b`` and its
output, returning the owners of its outputs in the output's structure):

* elementwise (torch's ``pointwise`` tag, and a few untagged ones): the inputs' owners combined,
  broadcasting as the op broadcasts;
* data movement (views, reshapes, ``cat``, indexing, ``gather``, ``scatter``, ``index_put``,
  padding, ``repeat``, ``flip``, ...): the same op applied to the owners (expanded only along the
  dims it reads or writes), so a fold ``(B, 2, d) -> (2B, d)``, a transpose taken sample-minor,
  levels stacked along the batch, or rows permuted by ``x[perm]`` give each row its sample;
* reductions, softmax, sorting, ``cumsum`` and the like: the owner must agree along the reduced
  dims (a mean over the batch dim mixes samples);
* contractions (``mm``, ``bmm``, convolutions, attention kernels, embeddings): agreement over the
  contracted dims (a convolution over a row's channels and positions);
* normalisation with batch statistics: agreement over every dim but the channels; pooling,
  resampling and padding other than constant: agreement over the spatial dims;
* creation ops (``zeros``, ``*_like``, ``new_*``, random fills): shared.

An op without a rule gives :class:`Unknown`, except where every input is shared or owned by one
sample throughout (then every output is that sample's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BIG",
    "OWNER_DTYPE",
    "VALUE_FREE",
    "Mixed",
    "Unknown",
    "agree",
    "combine",
    "compress",
    "fit",
    "reshape_owner",
    "rule_for",
    "tensor_outputs",
]

OWNER_DTYPE = torch.int32
#: stands in for ``-1`` where the smallest sample index is taken
BIG = torch.iinfo(OWNER_DTYPE).max

Owner = Tensor | None
Rule = Callable[[Any, dict[str, Any], Any], Any]


class Unknown(Exception):
    """No owner can be given (the reason says why): a tensor tagged with it, and everything
    computed from it, belongs to no known sample."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Mixed(Unknown):
    """An op combines elements of two different samples."""

    def __init__(self, op: str, first: int, second: int) -> None:
        super().__init__(f"{op} mixes samples {first} and {second} (rows of both in one value)")


# ---------------------------------------------------------------------- owner algebra
def compress(o: Owner) -> Owner:
    """``o`` with every dim along which it agrees (``-1`` agreeing with anything) reduced to
    size 1; ``None`` if it is ``-1`` everywhere. (NumPy: owners are small CPU tensors, and
    NumPy's calls on them cost a fraction of torch's.)"""
    if o is None:
        return None
    a = o.numpy()
    for d in range(a.ndim):  # broadcast dims first: free
        if a.shape[d] > 1 and a.strides[d] == 0:
            a = a[(slice(None),) * d + (slice(0, 1),)]
    for d in range(a.ndim):
        if a.shape[d] > 1:
            hi = a.max(axis=d, keepdims=True)
            lo = np.where(a < 0, BIG, a).min(axis=d, keepdims=True)
            if ((lo == hi) | (lo == BIG)).all():
                a = hi
    if (a < 0).all():
        return None
    return torch.from_numpy(np.ascontiguousarray(a))


def _check(hi: np.ndarray, lo: np.ndarray, op: str) -> Tensor:
    bad = (lo != BIG) & (lo != hi)
    if bad.any():
        at = tuple(np.argwhere(bad)[0])
        raise Mixed(op, int(lo[at]), int(hi[at]))
    return torch.from_numpy(np.ascontiguousarray(hi))


def combine(owners: Sequence[Owner], op: str) -> Owner:
    """Elementwise agreement of broadcastable owners (right-aligned, as torch broadcasts)."""
    hi = lo = None
    for o in owners:
        if o is None:
            continue
        a = o.numpy()
        low = np.where(a < 0, BIG, a)
        hi = a if hi is None else np.maximum(hi, a)
        lo = low if lo is None else np.minimum(lo, low)
    if hi is None or lo is None:
        return None
    return _check(hi, lo, op)


def agree(o: Owner, dims: Sequence[int] | None, op: str, *, keepdim: bool = True) -> Owner:
    """``o`` reduced over ``dims`` (``None``: all) by agreement."""
    if o is None:
        return None
    nd = o.dim()
    dims = list(range(nd)) if dims is None else sorted({d % nd for d in dims} if nd else set())
    if not dims:
        return o
    a = o.numpy()
    axes = tuple(dims)
    hi = a.max(axis=axes, keepdims=True)
    lo = np.where(a < 0, BIG, a).min(axis=axes, keepdims=True)
    out = _check(hi, lo, op)
    return out if keepdim else out.squeeze(dims)


def fit(o: Owner, t: Tensor) -> Owner:
    """``o`` as an owner of ``t``: leading singleton dims added or dropped to ``t``'s ndim.

    Raises:
        Unknown: ``o`` does not broadcast to ``t`` (a rule's mistake, never a wrong owner).
    """
    if o is None or t.numel() == 0:
        return None
    while o.dim() > t.dim():
        if o.size(0) != 1:
            raise Unknown(f"an owner of shape {tuple(o.shape)} for a tensor of {tuple(t.shape)}")
        o = o.squeeze(0)
    if o.dim() < t.dim():
        o = o.reshape((1,) * (t.dim() - o.dim()) + tuple(o.shape))
    if any(s not in (1, n) for s, n in zip(o.shape, t.shape)):
        raise Unknown(f"an owner of shape {tuple(o.shape)} for a tensor of {tuple(t.shape)}")
    return o


def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The contiguous groups of dims a reshape ``src -> dst`` maps onto each other."""
    i = j = 0
    groups = []
    while i < len(src) or j < len(dst):
        si, dj, pa, pb = [], [], 1, 1
        if i < len(src):
            pa, i = src[i], i + 1
            si.append(i - 1)
        if j < len(dst):
            pb, j = dst[j], j + 1
            dj.append(j - 1)
        while pa != pb:
            if pa < pb and i < len(src):
                pa, i = pa * src[i], i + 1
                si.append(i - 1)
            elif j < len(dst):
                pb, j = pb * dst[j], j + 1
                dj.append(j - 1)
            else:
                raise Unknown(f"no reshape from {tuple(src)} to {tuple(dst)}")
        groups.append((si, dj))
    return groups


def reshape_owner(o: Owner, src: Sequence[int], dst: Sequence[int]) -> Owner:
    """The owner of ``t.reshape(dst)`` for ``t`` of shape ``src`` owned by ``o``: only the
    groups of dims that carry owners are expanded."""
    if o is None or 0 in src:
        return None
    sizes, out = list(o.shape), [1] * len(dst)
    for si, dj in _groups(list(src), list(dst)):
        if any(o.size(d) > 1 for d in si):
            for d in si:
                sizes[d] = src[d]
            for d in dj:
                out[d] = dst[d]
    return o.expand(sizes).reshape(out)


# ---------------------------------------------------------------------- rule helpers
def _name(func: Any) -> str:
    return str(func)


def tensor_outputs(out: Any) -> list[Tensor | None]:
    """An op's outputs as a list (``None`` for an output that is not a tensor)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t if isinstance(t, Tensor) else None for t in out]
    return []


def _same(o: Owner, out: Any) -> Any:
    """``o`` for every tensor output (fitted to each; other outputs shared)."""
    if isinstance(out, Tensor):
        return fit(o, out)
    return type(out)(fit(o, t) if isinstance(t, Tensor) else None for t in out)


def _tensors(values: Any) -> list[Tensor]:
    found = []
    for v in values:
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, Tensor))
    return found


def pointwise(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    """Elementwise: the inputs' owners combined as the op broadcasts."""
    return _same(combine([ctx.own(t) for t in _tensors(b.values())], ctx.op), out)


def _all_agree(ctx: Any, t: Any) -> Owner:
    """One owner for the whole of ``t`` (a weight read everywhere), as a 0-d owner."""
    if not isinstance(t, Tensor):
        return None
    o = agree(ctx.own(t), None, ctx.op, keepdim=False)
    return None if o is None else o.reshape(())


def _shared(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    return _same(None, out)


def _expand(o: Tensor, t: Tensor, dims: Sequence[int]) -> Tensor:
    """``o`` expanded to ``t``'s sizes along ``dims`` only."""
    sizes = list(o.shape)
    for d in dims:
        sizes[d % t.dim()] = t.size(d)
    return o.expand(sizes)


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu")


# ---------------------------------------------------------------------- views and movement
def _view(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self = b["self"]
    return reshape_owner(ctx.own(self), self.shape, out.shape)


def _expand_rule(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    return fit(ctx.own(b["self"]), out)


def _permute(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    return None if o is None else o.permute(b["dims"])


def _transpose(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    return None if o is None else o.transpose(b["dim0"], b["dim1"])


def _t(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    return None if o is None or o.dim() < 2 else o.t()


def _unsqueeze(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    return None if o is None else o.unsqueeze(b["dim"])


def _squeeze(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, o = b["self"], ctx.own(b["self"])
    if o is None:
        return None
    dim = b.get("dim")
    dims = range(self.dim()) if dim is None else [dim] if isinstance(dim, int) else dim
    dims = [d % self.dim() for d in dims] if self.dim() else []
    return o.squeeze(tuple(d for d in dims if self.size(d) == 1)) if dims else o


def _slice(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o, dim = ctx.own(b["self"]), b["dim"]
    if o is None or o.size(dim) == 1:
        return o
    return torch.ops.aten.slice.Tensor(o, dim, b["start"], b["end"], b["step"])


def _select(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o, dim = ctx.own(b["self"]), b["dim"]
    if o is None:
        return None
    return o.squeeze(dim) if o.size(dim) == 1 else o.select(dim, b["index"])


def _split(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    o, dim = ctx.own(b["self"]), b.get("dim", 0)
    if o is None:
        return _same(None, out)
    if o.size(dim) == 1:
        return _same(o, out)
    sizes = [t.size(dim) for t in out]
    return list(o.split(sizes, dim))


def _unbind(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    o, dim = ctx.own(b["self"]), b.get("dim", 0)
    if o is None:
        return _same(None, out)
    if o.size(dim) == 1:
        return [o.squeeze(dim) for _ in out]
    return list(o.unbind(dim))


def _unfold(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o, dim = ctx.own(b["self"]), b["dimension"]
    if o is None:
        return None
    if o.size(dim) == 1:
        return o.unsqueeze(-1)
    return o.unfold(dim, b["size"], b["step"])


def _diagonal(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, o = b["self"], ctx.own(b["self"])
    if o is None:
        return None
    d1, d2 = b["dim1"], b["dim2"]
    return torch.diagonal(_expand(o, self, [d1, d2]), b["offset"], d1, d2)


def _cat(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    tensors = [t for t in b["tensors"] if not (t.dim() == 1 and t.numel() == 0)]
    dim = b.get("dim", 0)
    owners = [ctx.own(t) for t in tensors]
    if all(o is None for o in owners):
        return None
    d = dim % out.dim()
    full = [
        fit(torch.full((1,) * t.dim(), -1, dtype=OWNER_DTYPE) if o is None else o, t)
        for o, t in zip(owners, tensors)
    ]
    sizes = [1] * out.dim()
    for o in full:
        sizes = [max(s, n) for s, n in zip(sizes, o.shape)]
    parts = []
    for o, t in zip(full, tensors):
        want = list(sizes)
        want[d] = t.size(d)
        parts.append(o.expand(want))
    return torch.cat(parts, d)


def _stack(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    dim = b.get("dim", 0) % out.dim()
    tensors = b["tensors"]
    owners = [ctx.own(t) for t in tensors]
    if all(o is None for o in owners):
        return None
    full = [
        torch.full((1,) * (t.dim() + 1), -1, dtype=OWNER_DTYPE) if o is None else o.unsqueeze(dim)
        for o, t in zip(owners, tensors)
    ]
    sizes = [1] * out.dim()
    for o in full:
        sizes = [max(s, n) for s, n in zip(sizes, o.shape)]
    sizes[dim] = 1
    return torch.cat([o.expand(sizes) for o in full], dim)


def _long_indices(indices: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Advanced indices as CPU long tensors, one per dim (a bool mask of ``k`` dims as ``k``)."""
    longs: list[Tensor | None] = []
    for ix in indices:
        if ix is None:
            longs.append(None)
        elif ix.dtype in (torch.bool, torch.uint8):
            longs.extend(_cpu(ix).bool().nonzero().unbind(1))
        else:
            longs.append(_cpu(ix).long())
    return longs


def _index_owners(ctx: Any, indices: Sequence[Tensor | None]) -> Owner:
    """The owner of the index values, over the broadcast shape of the indices (a bool mask's
    over its true entries)."""
    parts = []
    for ix in indices:
        if ix is None:
            continue
        o = ctx.own(ix)
        if o is None:
            continue
        if ix.dtype in (torch.bool, torch.uint8):
            parts.append(o.expand(ix.shape)[_cpu(ix).bool()])
        else:
            parts.append(o)
    return combine(parts, ctx.op) if parts else None


def _place_index_owner(io: Owner, longs: Sequence[Tensor | None], out: Tensor) -> Owner:
    """The index owner over ``out``'s dims (where advanced indexing puts the indexed dims)."""
    if io is None:
        return None
    adv = [d for d, ix in enumerate(longs) if ix is not None]
    adjacent = adv == list(range(adv[0], adv[-1] + 1))
    pos = adv[0] if adjacent else 0
    shape = torch.broadcast_shapes(*(ix.shape for ix in longs if ix is not None))
    io = io.expand(shape) if io.dim() <= len(shape) else io
    return io.reshape((1,) * pos + tuple(shape) + (1,) * (out.dim() - pos - len(shape)))


def _index(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, indices = b["self"], b["indices"]
    o = ctx.own(self)
    longs = _long_indices(indices)
    io = _index_owners(ctx, indices)
    if o is None and io is None:
        return None
    if o is None:
        o = torch.full((1,) * self.dim(), -1, dtype=OWNER_DTYPE)
    picked = torch.ops.aten.index.Tensor(
        _expand(o, self, [d for d, ix in enumerate(longs) if ix is not None]), longs
    )
    return combine([picked, _place_index_owner(io, longs, out)], ctx.op)


def _index_select(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, dim, index = b["self"], b["dim"], b["index"]
    o, io = ctx.own(self), ctx.own(index)
    picked = None if o is None else _expand(o, self, [dim]).index_select(dim, _cpu(index).long())
    if io is not None:
        d = dim % out.dim()
        io = io.reshape((1,) * d + (-1,) + (1,) * (out.dim() - d - 1))
    return combine([picked, io], ctx.op)


def _gather(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, dim, index = b["self"], b["dim"], b["index"]
    o = ctx.own(self)
    picked = None if o is None else o.expand(self.shape).gather(dim, _cpu(index).long())
    return combine([picked, ctx.own(index)], ctx.op)


def _positions(self: Tensor) -> Tensor:
    return torch.arange(self.numel()).view(self.shape)


def _write(ctx: Any, self: Tensor, pos: Tensor, vals: Owner, keep: bool) -> Owner:
    """``self``'s owner after writing ``vals`` (owners of the written values, ``pos``'s shape)
    at flat positions ``pos``; ``keep``: the written values combine with what was there
    (accumulating writes) instead of replacing it."""
    o = ctx.own(self)
    base = (
        torch.full((self.numel(),), -1, dtype=OWNER_DTYPE)
        if o is None
        else o.expand(self.shape).reshape(-1).clone()
    )
    v = torch.full(pos.shape, -1, dtype=OWNER_DTYPE) if vals is None else vals.expand(pos.shape)
    pos, v = pos.reshape(-1), v.reshape(-1)
    hi = base.scatter_reduce(0, pos, v, "amax", include_self=keep)
    lo = torch.where(base < 0, BIG, base).scatter_reduce(
        0, pos, torch.where(v < 0, BIG, v), "amin", include_self=keep
    )
    return _check(hi, lo, ctx.op).view(self.shape)


def _index_put(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, indices = b["self"], b["indices"]
    longs = _long_indices(indices)
    pos = torch.ops.aten.index.Tensor(_positions(self), longs)
    vals = combine(
        [
            fit(ctx.own(b["values"]), pos),
            _place_index_owner(_index_owners(ctx, indices), longs, pos),
        ],
        ctx.op,
    )
    return _write(ctx, self, pos, vals, bool(b.get("accumulate", False)))


def _scatter(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, dim, index = b["self"], b["dim"], b["index"]
    pos = _positions(self).gather(dim, _cpu(index).long())
    src = b.get("src")
    vals = None
    if isinstance(src, Tensor):
        so = ctx.own(src)
        if so is not None:
            vals = so.expand(src.shape)[tuple(slice(0, s) for s in index.shape)]
    vals = combine([vals, ctx.own(index)], ctx.op)
    if "scatter_reduce" in ctx.op:
        keep = bool(b.get("include_self", True))
    else:  # scatter_add and scatter(..., reduce=) accumulate; scatter replaces
        keep = "scatter_add" in ctx.op or b.get("reduce") is not None
    return _write(ctx, self, pos, vals, keep)


def _index_write(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, dim, index = b["self"], b["dim"], b["index"]
    pos = _positions(self).index_select(dim, _cpu(index).long())
    source, value = b.get("source"), b.get("value")
    if isinstance(source, Tensor):  # index_add, index_copy: source is shaped like pos
        vals = fit(ctx.own(source), pos)
    else:  # index_fill: one value
        vals = _all_agree(ctx, value)
        vals = None if vals is None else vals.reshape((1,) * pos.dim())
    io = ctx.own(index)
    if io is not None:
        d = dim % self.dim()
        io = io.reshape((1,) * d + (-1,) + (1,) * (self.dim() - d - 1))
    return _write(ctx, self, pos, combine([vals, io], ctx.op), "index_add" in ctx.op)


def _masked_scatter(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, mask, source = b["self"], b["mask"], b["source"]
    m = _cpu(mask).bool().expand(self.shape)
    pos = _positions(self)[m]
    so = ctx.own(source)
    vals = None if so is None else so.expand(source.shape).reshape(-1)[: pos.numel()]
    mo = ctx.own(mask)
    mv = None if mo is None else mo.expand(self.shape)[m]
    return _write(ctx, self, pos, combine([vals, mv], ctx.op), False)


def _masked_select(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, mask = b["self"], b["mask"]
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    m = _cpu(mask).bool().expand(shape)
    parts = []
    for t in (self, mask):
        o = ctx.own(t)
        if o is not None:
            parts.append(fit(o, torch.empty(shape, device="meta")).expand(shape)[m])
    return combine(parts, ctx.op)


def _nonzero(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self = b["self"]
    o = ctx.own(self)
    if o is None:
        return None
    return o.expand(self.shape)[_cpu(self) != 0].unsqueeze(1)


def _take(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, index = b["self"], b["index"]
    o = ctx.own(self)
    picked = None if o is None else o.expand(self.shape).reshape(-1)[_cpu(index).long()]
    return combine([picked, ctx.own(index)], ctx.op)


def _repeat(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o, reps = ctx.own(b["self"]), list(b["repeats"])
    if o is None:
        return None
    o = o.reshape((1,) * (len(reps) - o.dim()) + tuple(o.shape))
    return o.repeat([r if s > 1 else 1 for r, s in zip(reps, o.shape)])


def _repeat_interleave(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, dim, repeats = b["self"], b.get("dim"), b["repeats"]
    o = ctx.own(self)
    if o is None:
        return None
    if dim is None:
        if o.numel() == 1:
            return o.reshape(-1)
        raise Unknown(f"{ctx.op} over the flattened tensor")
    if o.size(dim) == 1:
        return o
    reps = _cpu(repeats) if isinstance(repeats, Tensor) else repeats
    return o.repeat_interleave(reps, dim)


def _flip(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    return None if o is None else o.flip(b["dims"])


def _roll(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    self, o = b["self"], ctx.own(b["self"])
    if o is None:
        return None
    dims = list(b.get("dims") or [])
    if not dims:
        return o.expand(self.shape).reshape(-1).roll(b["shifts"]).view(self.shape)
    return o.roll(b["shifts"], dims)


def _constant_pad(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o, pad = ctx.own(b["self"]), list(b["pad"])
    if o is None:
        return None
    widths = []
    for k in range(len(pad) // 2):
        d = o.dim() - 1 - k
        widths += pad[2 * k : 2 * k + 2] if o.size(d) > 1 else [0, 0]
    if not any(widths):
        return o
    return torch.nn.functional.pad(o, widths, value=-1)


def _as_strided(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    o = ctx.own(b["self"])
    if o is None or o.numel() == 1:
        return _same(o, out)
    raise Unknown(f"{ctx.op} of a tensor whose rows belong to several samples")


def _copy(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    """``self.copy_(src)``: ``self`` takes ``src``'s owner (broadcast)."""
    return fit(ctx.own(b["src"]), b["self"])


def _fill(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    value = b.get("value")
    return fit(_all_agree(ctx, value), out) if isinstance(value, Tensor) else None


# ---------------------------------------------------------------------- reductions
def _dims(value: Any, nd: int) -> list[int] | None:
    """A reduction's ``dim`` argument as a list (``None``, ``[]``: all dims)."""
    if value is None:
        return None
    dims = [value] if isinstance(value, int) else list(value)
    return [d % nd for d in dims] if dims and nd else None


def _reduce(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    """Reductions over ``dim`` (all dims where absent); outputs keep or drop the dims."""
    self = b["self"]
    dims = _dims(b.get("dim"), self.dim())
    keep = bool(b.get("keepdim", False))
    o = agree(ctx.own(self), dims, ctx.op, keepdim=True)
    if o is not None and not keep:
        o = o.squeeze(tuple(range(o.dim())) if dims is None else tuple(dims))
    return _same(o, out)


def _along(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    """Ops that read a whole dim per output element (softmax, cumsum, sort, topk, glu):
    agreement along ``dim``, the shape kept."""
    self = b["self"]
    dim = b.get("dim", -1)
    return _same(agree(ctx.own(self), [dim if dim is not None else -1], ctx.op), out)


def _loss(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    """Losses with a ``reduction`` (0: none, elementwise; 1, 2: a scalar)."""
    owners = [ctx.own(t) for t in _tensors(b.values())]
    if b.get("reduction", 1) == 0:
        return _same(combine(owners, ctx.op), out)
    return _same(agree(combine(owners, ctx.op), None, ctx.op, keepdim=False), out)


def _nll_loss(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    self, target = b["self"], b["target"]
    if b.get("reduction", 1) != 0:
        both = [_all_agree(ctx, self), _all_agree(ctx, target), _all_agree(ctx, b.get("weight"))]
        return _same(combine(both, ctx.op), out)
    o = ctx.own(self)
    if o is not None:
        o = agree(o, [1] if self.dim() > 1 else None, ctx.op, keepdim=True)
        o = o.squeeze(1) if self.dim() > 1 else o.reshape(())
    first = combine([o, ctx.own(target)], ctx.op)
    return (fit(first, out[0]), None)


# ---------------------------------------------------------------------- contractions
def _mm(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    names = [
        k for k in ("self", "mat1", "mat2", "batch1", "batch2") if isinstance(b.get(k), Tensor)
    ]
    if "mat1" in names:  # addmm(self=bias, mat1, mat2)
        left, right, bias = b["mat1"], b["mat2"], b["self"]
    elif "batch1" in names:  # baddbmm / addbmm
        left, right, bias = b["batch1"], b["batch2"], b["self"]
    else:  # mm, bmm
        left, right, bias = b["self"], b["mat2"], None
    lo = agree(ctx.own(left), [-1], ctx.op)
    ro = agree(ctx.own(right), [-2], ctx.op)
    parts = [lo, ro, None if bias is None else ctx.own(bias)]
    if "addbmm" in ctx.op:  # sums over the batch of products
        parts = [agree(lo, [0], ctx.op, keepdim=False), agree(ro, [0], ctx.op, keepdim=False)]
        parts.append(ctx.own(bias))
    return fit(combine(parts, ctx.op), out)


def _mv(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    mat = b.get("mat", b.get("self")) if "vec" in b else b["self"]
    vec = b["vec"]
    mo = agree(ctx.own(mat), [-1], ctx.op)
    parts = [None if mo is None else mo.squeeze(-1), _all_agree(ctx, vec)]
    if "mat" in b:
        parts.append(ctx.own(b["self"]))
    return fit(combine(parts, ctx.op), out)


def _dot(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    return _same(combine([_all_agree(ctx, t) for t in _tensors(b.values())], ctx.op), out)


def _convolution(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    x, w = b["input"], b["weight"]
    batched = x.dim() == w.dim()
    o = agree(ctx.own(x), list(range(1, x.dim())) if batched else None, ctx.op)
    parts = [o, _all_agree(ctx, w), _all_agree(ctx, b.get("bias"))]
    return fit(combine(parts, ctx.op), out)


def _embedding(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    io = ctx.own(b["indices"])
    return fit(
        combine([None if io is None else io.unsqueeze(-1), _all_agree(ctx, b["weight"])], ctx.op),
        out,
    )


def _attention(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    q, k, v = b["query"], b["key"], b["value"]
    mask = b.get("attn_mask", b.get("attn_bias"))
    parts = [
        agree(ctx.own(q), [-1], ctx.op),
        agree(ctx.own(k), [-2, -1], ctx.op),
        agree(ctx.own(v), [-2, -1], ctx.op),
    ]
    if isinstance(mask, Tensor):
        parts.append(agree(ctx.own(mask), [-1], ctx.op))
    o = combine(parts, ctx.op)
    found = []
    for t in tensor_outputs(out):
        if t is None or t.dim() < q.dim() - 1 or o is None:
            found.append(None)
        elif t.dim() == q.dim():
            found.append(fit(o, t))
        else:  # the log-sum-exp (..., L)
            found.append(fit(o.squeeze(-1), t))
    return found[0] if isinstance(out, Tensor) else type(out)(found)


# ---------------------------------------------------------------------- normalisation and windows
def _batch_norm(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    x = b["input"]
    training = bool(b.get("training", False)) or "no_stats" in ctx.op
    if "no_training" in ctx.op:
        training = False
    params = [_all_agree(ctx, b.get(k)) for k in ("weight", "bias", "running_mean", "running_var")]
    xo = ctx.own(x)
    if training:
        stats = agree(xo, [0, *range(2, x.dim())], ctx.op)
        xo = combine([xo, stats], ctx.op)
    o = combine([xo, *params], ctx.op)
    found = [fit(o, out[0]) if isinstance(out, (tuple, list)) else fit(o, out)]
    if isinstance(out, Tensor):
        return found[0]
    for t in out[1:]:
        found.append(None if not training or not isinstance(t, Tensor) else _channel_owner(o, t))
    return type(out)(found)


def _channel_owner(o: Owner, t: Tensor) -> Owner:
    """Per-channel statistics ``(C,)`` of an owner ``(1, C or 1, 1...)``."""
    if o is None or t.dim() != 1:
        return None
    flat = agree(o, [0, *range(2, o.dim())], "batch statistics", keepdim=False)
    return fit(flat, t)


def _layer_norm(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    x, k = b["input"], len(b["normalized_shape"])
    o = agree(ctx.own(x), list(range(x.dim() - k, x.dim())), ctx.op)
    o = combine([o, _all_agree(ctx, b.get("weight")), _all_agree(ctx, b.get("bias"))], ctx.op)
    return _same(o, out)


def _group_norm(ctx: Any, b: dict[str, Any], out: Any) -> Any:
    x = b["input"]
    o = agree(ctx.own(x), list(range(1, x.dim())), ctx.op)
    o = combine([o, _all_agree(ctx, b.get("weight")), _all_agree(ctx, b.get("bias"))], ctx.op)
    first = fit(o, out[0])
    rest = [None if o is None else fit(o.reshape(-1, *([1] * (t.dim() - 1))), t) for t in out[1:]]
    return type(out)([first, *rest])


def _window(spatial: int, channels: bool = False) -> Rule:
    """Ops over the last ``spatial`` dims (pooling, resampling, reflection padding), also over
    the channels (pixel shuffle) with ``channels``."""

    def rule(ctx: Any, b: dict[str, Any], out: Any) -> Any:
        x = b.get("self", b.get("input"))
        k = spatial + (1 if channels else 0)
        o = agree(ctx.own(x), list(range(max(0, x.dim() - k), x.dim())), ctx.op)
        return _same(o, out)

    return rule


def _grid_sample(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    x, grid = b["input"], b["grid"]
    xo = agree(ctx.own(x), list(range(2, x.dim())), ctx.op)
    go = agree(ctx.own(grid), [-1], ctx.op)
    if go is not None:
        go = go.squeeze(-1).unsqueeze(1)
    return fit(combine([xo, go], ctx.op), out)


def _roi_align(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    """torchvision's RoI ops: box ``k`` reads the image ``rois[k, 0]`` of the batch."""
    x, rois = b["input"], b["rois"]
    xo = agree(ctx.own(x), list(range(1, x.dim())), ctx.op, keepdim=False)
    picked = None if xo is None else xo[_cpu(rois[:, 0]).long()]
    ro = agree(ctx.own(rois), [1], ctx.op, keepdim=False)
    o = combine([picked, ro], ctx.op)
    first = out if isinstance(out, Tensor) else out[0]
    return _same(_per_row(o, first), out)


def _per_row(o: Owner, t: Tensor) -> Owner:
    """A per-row owner ``(R,)`` (or 0-d) as an owner of ``t`` ``(R, ...)``."""
    if o is None:
        return None
    return o.reshape(-1, *([1] * (t.dim() - 1))) if o.dim() else o.reshape((1,) * t.dim())


def _rows_whole(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    """Ops that read a whole row (dim 0 entry) per output row and change the ndim (``im2col``,
    ``col2im``); an unbatched input is read whole."""
    x = b["self"]
    batched = x.dim() == (4 if "im2col" in ctx.op else 3)
    dims = list(range(1, x.dim())) if batched else None
    return _per_row(agree(ctx.own(x), dims, ctx.op, keepdim=False), out)


def _prelu(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    """The weight broadcasts along dim 1, not from the right: read whole."""
    return fit(combine([ctx.own(b["self"]), _all_agree(ctx, b["weight"])], ctx.op), out)


def _affine_grid(ctx: Any, b: dict[str, Any], out: Tensor) -> Owner:
    theta = b["theta"]
    o = agree(ctx.own(theta), list(range(1, theta.dim())), ctx.op, keepdim=False)
    return _per_row(o, out)


# ---------------------------------------------------------------------- the table
_WINDOWS = {
    1: "max_pool1d adaptive_max_pool1d upsample_linear1d",
    2: "upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_bicubic2d _upsample_bicubic2d_aa _pad_circular",
    3: "upsample_trilinear3d",
}

#: the rules by op name (aten's without overload or in-place underscore; other namespaces with
#: theirs): ``(rule, space-separated names)``
_RULES: list[tuple[Rule, str]] = [
    (
        pointwise,
        "hardswish where masked_fill _to_copy clone native_dropout bernoulli detach alias "
        "lift_fresh lift_fresh_copy log_sigmoid_forward rrelu_with_noise floor_divide tril "
        "triu _conj resolve_conj resolve_neg positive real imag threshold hardtanh relu6 "
        "logical_not bitwise_not normal",
    ),
    (
        _shared,
        "arange zeros ones full empty empty_strided empty_like zeros_like ones_like full_like "
        "rand randn randint randperm rand_like randn_like randint_like new_zeros new_ones "
        "new_empty new_full new_empty_strided scalar_tensor eye linspace logspace tril_indices "
        "triu_indices zero uniform exponential random log_normal geometric cauchy "
        "_local_scalar_dense",
    ),
    (_view, "view _unsafe_view _reshape_alias reshape view_copy _reshape_copy"),
    (_expand_rule, "expand expand_copy"),
    (_permute, "permute permute_copy"),
    (_transpose, "transpose transpose_copy"),
    (_t, "t t_copy"),
    (_unsqueeze, "unsqueeze unsqueeze_copy"),
    (_squeeze, "squeeze squeeze_copy"),
    (_slice, "slice slice_copy"),
    (_select, "select select_copy"),
    (_split, "split split_with_sizes unsafe_split unsafe_split_with_sizes split_copy"),
    (_unbind, "unbind unbind_copy"),
    (_unfold, "unfold unfold_copy"),
    (_diagonal, "diagonal diagonal_copy"),
    (_cat, "cat _cat concat concatenate"),
    (_stack, "stack"),
    (_index, "index _unsafe_index"),
    (_index_select, "index_select"),
    (_gather, "gather"),
    (_index_put, "index_put _index_put_impl _unsafe_index_put"),
    (_scatter, "scatter scatter_add scatter_reduce"),
    (_index_write, "index_add index_copy index_fill"),
    (_masked_scatter, "masked_scatter"),
    (_masked_select, "masked_select"),
    (_nonzero, "nonzero"),
    (_take, "take"),
    (_repeat, "repeat"),
    (_repeat_interleave, "repeat_interleave"),
    (_flip, "flip"),
    (_roll, "roll"),
    (_constant_pad, "constant_pad_nd"),
    (_as_strided, "as_strided as_strided_copy"),
    (_copy, "copy"),
    (_fill, "fill"),
    (
        _reduce,
        "sum mean nansum amax amin max min aminmax prod argmax argmin any all count_nonzero "
        "var std var_mean std_mean logsumexp linalg_vector_norm norm median nanmedian "
        "kthvalue mode",
    ),
    (
        _along,
        "_softmax _log_softmax softmax log_softmax _safe_softmax cumsum cumprod logcumsumexp "
        "cummax cummin sort topk glu",
    ),
    (
        _loss,
        "mse_loss l1_loss smooth_l1_loss huber_loss soft_margin_loss binary_cross_entropy "
        "binary_cross_entropy_with_logits kl_div",
    ),
    (_nll_loss, "nll_loss_forward nll_loss2d_forward"),
    (_mm, "mm addmm bmm baddbmm addbmm _addmm_activation"),
    (_mv, "mv addmv"),
    (_dot, "dot vdot"),
    (_convolution, "convolution _convolution"),
    (_embedding, "embedding"),
    (
        _attention,
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention "
        "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
        "_scaled_dot_product_fused_attention_overrideable scaled_dot_product_attention",
    ),
    (
        _batch_norm,
        "native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training "
        "_native_batch_norm_legit_functional",
    ),
    (_layer_norm, "native_layer_norm _fused_rms_norm"),
    (_group_norm, "native_group_norm"),
    *(
        (
            _window(k),
            f"max_pool{k}d_with_indices avg_pool{k}d adaptive_avg_pool{k}d "
            f"_adaptive_avg_pool{k}d adaptive_max_pool{k}d fractional_max_pool{k}d "
            f"max_unpool{k}d upsample_nearest{k}d _upsample_nearest_exact{k}d "
            f"reflection_pad{k}d replication_pad{k}d max_pool{k}d {_WINDOWS[k]}",
        )
        for k in (1, 2, 3)
    ),
    (_window(2, channels=True), "pixel_shuffle pixel_unshuffle channel_shuffle"),
    (_window(2, channels=True), "native_channel_shuffle"),
    (_rows_whole, "im2col col2im"),
    (_prelu, "_prelu_kernel"),
    (_affine_grid, "affine_grid_generator"),
    (_grid_sample, "grid_sampler_2d grid_sampler_3d grid_sampler"),
    (
        _roi_align,
        "torchvision::roi_align torchvision::roi_pool torchvision::ps_roi_align "
        "torchvision::ps_roi_pool",
    ),
]
_TABLE = {name: rule for rule, names in _RULES for name in names.split()}
#: rules that read a tensor argument's values (indices, masks, boxes), not only its owner
_READS_VALUES = (
    _index, _index_put, _index_select, _gather, _scatter, _index_write, _masked_scatter,
    _masked_select, _nonzero, _take, _repeat_interleave, _roi_align,
)  # fmt: skip
#: the rules whose result is a function of the op, its arguments' shapes, strides and non-tensor
#: values and its inputs' owners alone: :mod:`~multiscale_jac.rows` keeps their results
VALUE_FREE = frozenset(rule for rule, _ in _RULES if rule not in _READS_VALUES)


def _packet(func: Any) -> str:
    """``aten::sum.dim_IntList`` -> ``sum``; ``aten::add_.Tensor`` -> ``add``;
    ``torchvision::roi_align.default`` -> ``torchvision::roi_align``."""
    name = func._schema.name  # "aten::add_"
    ns, _, base = name.partition("::")
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return base if ns == "aten" else f"{ns}::{base}"


@functools.cache
def rule_for(func: Any) -> Rule | None:
    """The rule of the aten op overload ``func``, or ``None`` (torch's ``pointwise`` tag first:
    ``max.other`` is elementwise, ``max.dim`` a reduction)."""
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return pointwise
    name = func._schema.name.partition("::")[2]
    if name.endswith("_") and not name.endswith("__"):  # an in-place variant: the functional's tag
        packet = getattr(torch.ops.aten, name[:-1], None)
        overload = getattr(packet, func._overloadname, None) if packet is not None else None
        if overload is not None and torch.Tag.pointwise in overload.tags:
            return pointwise
    return _TABLE.get(_packet(func))

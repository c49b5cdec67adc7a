"""Masked execution: run an unmodified model on padded levels so that it computes exactly what
it computes on every sample's unpadded levels.

Every tensor that derives from an input level carries a :class:`Region`: for each sample of the
batch, which of its elements are real (the rest is padding). After every op the output is
re-zeroed outside its region, and every op with spatial extent has a rule saying how the region
maps from input to output (a 3x3 conv shrinks it, a stride-2 pool halves it, a flatten turns it
into a ragged vector, ...). Ops whose padded result can differ from the unpadded one get a
special rule (max pooling fills padding with ``-inf``; norms use masked statistics); ops with no
exact rule raise :class:`UnsupportedOpError` naming the op and the module that called it.

Mechanism (``docs/padded.md`` says why not ``torch.fx``): a ``TorchFunctionMode``
(``_ops.RuleMode``, shared with level packing) that sees every torch function the model calls,
inside ``vmap``/``jacrev``/``jvp``. Regions are *concrete* tables over the whole batch,
``(N, *extent)`` booleans; inside ``vmap`` each sample picks its row through a batched sample
index, so every rule's checks (equal regions for binary ops, a kernel that fits every sample)
stay plain Python.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._ops import (
    BINARY,
    SAVES_OUTPUT_INPLACE,
    SIGNATURES,
    SINGULAR,
    UNARY,
    RuleMode,
    avg_divisor,
    bind_call,
    bind_op,
    data_operands,
    named,
    ntuple,
    op_name,
    pairs,
    pool_args,
    require_more_than_one,
    tensors,
    with_input,
)
from ._sizes import PaddedNumber, PaddedSize, has_padded, make_number, plain
from .enums import UnsupportedOpError

__all__ = ["MaskedMode", "PaddedFunction", "Region", "SUPPORTED_OPS", "UnsupportedOpError"]


# ---------------------------------------------------------------------- regions
@dataclass(frozen=True)
class Region:
    """Which elements of a tracked tensor are real, for every sample of the batch.

    Attributes:
        dims: The tensor dims the region constrains (others are real everywhere).
        table: ``(N, *[size of d for d in dims])`` bool, concrete (never batched).
        sizes: ``(N, len(dims))`` int64 when the region is a top-left box over ``dims``
            (the valid size of every sample), else ``None``.
        group: For an ordered region, the dims whose coordinates were merged with padded dims
            (a superset of what ``dims`` needs: the table may be constant along some of them).

    Two kinds of region: a **box** (``sizes`` known) is *positional*: a real element sits at
    the same coordinates as in the unpadded tensor, so spatial ops (conv, pool, upsample) have
    rules. After a flatten or reshape that merges padded dims with others, or a concatenation
    along a padded dim, the region is *ordered* (``group`` is set): only the row-major order of
    the real elements matches the unpadded tensor, not their coordinates along the ``group``
    dims. Ordered regions allow ops that do not look at those coordinates (elementwise ops with
    operands constant along ``group``, reductions over all of ``group``, concatenation along a
    dim not after the first of ``group``, reshapes) and refuse the rest.
    """

    dims: tuple[int, ...]
    table: Tensor
    sizes: Tensor | None = None
    group: tuple[int, ...] | None = None

    @staticmethod
    def box(sizes: Tensor, extent: Sequence[int], dims: Sequence[int]) -> Region:
        """The top-left box ``[:sizes[i, 0], :sizes[i, 1], ...]`` in a tensor of ``extent``."""
        n = sizes.shape[0]
        table = torch.ones((n, *extent), dtype=torch.bool, device=sizes.device)
        for k, m in enumerate(extent):
            inside = torch.arange(m, device=sizes.device).unsqueeze(0) < sizes[:, k : k + 1]
            table = table & inside.reshape(n, *(m if j == k else 1 for j in range(len(extent))))
        return Region(tuple(dims), table, sizes)

    @property
    def ordered(self) -> bool:
        return self.group is not None

    @property
    def touched(self) -> tuple[int, ...]:
        """Dims whose coordinates depend on padding: ``dims``, and ``group`` if ordered."""
        return tuple(sorted(set(self.dims) | set(self.group or ())))

    @property
    def extent(self) -> tuple[int, ...]:
        return tuple(self.table.shape[1:])

    def moved(self, where: Callable[[int], int]) -> Region:
        """The same region with every dim ``d`` moved to ``where(d)`` (a shift or permute)."""
        dims = [where(d) for d in self.dims]
        order = sorted(range(len(dims)), key=lambda k: dims[k])
        table = self.table.permute(0, *(1 + k for k in order))
        sizes = None if self.sizes is None else self.sizes[:, order]
        group = None if self.group is None else tuple(sorted(where(d) for d in self.group))
        return Region(tuple(dims[k] for k in order), table, sizes, group)

    def full_table(self, shape: Sequence[int]) -> Tensor:
        """The table expanded over every dim of a tensor of ``shape``: ``(N, *shape)``."""
        n = self.table.shape[0]
        view = [n] + [1] * len(shape)
        for k, d in enumerate(self.dims):
            view[1 + d] = self.table.shape[1 + k]
        return self.table.reshape(view).expand(n, *shape)

    def same_as(self, other: Region) -> bool:
        return (
            self.dims == other.dims
            and self.group == other.group
            and self.extent == other.extent
            and bool(torch.equal(self.table, other.table))
        )


def compact(region: Region | None) -> Region | None:
    """Drop dims along which the table is constant; ``None`` if everything is real."""
    if region is None:
        return None
    table, dims, sizes = region.table, list(region.dims), region.sizes
    k = 0
    while k < len(dims):
        t = table.movedim(1 + k, -1)
        if torch.equal(t.all(-1), t.any(-1)):
            table = t.any(-1)
            del dims[k]
            if sizes is not None:
                sizes = torch.cat([sizes[:, :k], sizes[:, k + 1 :]], dim=1)
        else:
            k += 1
    if bool(table.all()):
        return None
    return Region(tuple(dims), table, sizes, region.group)


# ---------------------------------------------------------------------- the mode
class MaskedMode(RuleMode):
    """Track regions and re-zero after every op (see the module docstring).

    Args:
        sample_index: The sample's row in every region table: a 0-d int64 tensor, batched
            under ``vmap``.
        model: Used to name the module of an unsupported op in errors.
    """

    context = "padded execution"
    no_rule = "no exact rule for this op on padded inputs"
    untracked = frozenset({F.interpolate})
    root = "<model>"

    def __init__(self, sample_index: Tensor, model: nn.Module | None = None) -> None:
        super().__init__(model)
        self._index = sample_index.reshape(1)
        self._regions: dict[int, tuple[weakref.ref, Region]] = {}

    # -------------------------------------------------------------- bookkeeping
    def region(self, t: Any) -> Region | None:
        if not isinstance(t, Tensor):
            return None
        entry = self._regions.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def track(self, t: Tensor, region: Region | None) -> Tensor:
        """Record ``region`` for ``t`` (compacted; nothing if fully real)."""
        region, key = compact(region), id(t)
        if region is None:
            self._regions.pop(key, None)
        else:
            forget = weakref.ref(t, lambda _, k=key: self._regions.pop(k, None))
            self._regions[key] = (forget, region)
        return t

    def row(self, table: Tensor) -> Tensor:
        """This sample's row of a concrete ``(N, ...)`` table."""
        return table.index_select(0, self._index.to(table.device))[0]

    def mask(self, region: Region, like: Tensor) -> Tensor:
        """This sample's bool mask, shaped to broadcast against ``like``."""
        m = self.row(region.table)
        shape = [1] * like.dim()
        for k, d in enumerate(region.dims):
            shape[d] = m.shape[k]
        return m.reshape(shape)

    def rezero(self, out: Tensor, region: Region | None) -> Tensor:
        """``out`` with zeros outside ``region`` (a new tensor), tracked."""
        region = compact(region)
        if region is None:
            return out
        zero = False if out.dtype == torch.bool else 0  # ``where(m, bool, 0)`` is int64
        return self.track(torch.where(self.mask(region, out), out, zero), region)

    def rezero_box(self, out: Tensor, sizes: Tensor, nsp: int) -> Tensor:
        """``out`` re-zeroed outside the top-left box of ``sizes`` over its last ``nsp`` dims."""
        return self.rezero(
            out, Region.box(sizes, out.shape[-nsp:], range(out.dim() - nsp, out.dim()))
        )

    # -------------------------------------------------------------- sizes
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = _SIZE_READS.get(func)
        if kind is not None:
            return _read_size(self, kind, func, args, kwargs)
        if has_padded(args, kwargs):
            return _sized_call(self, func, types, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def number(self, value: int | float, per_sample: Tensor | None) -> Any:
        """``value`` as a :class:`~multiscale_jac._sizes.PaddedSize` with every sample's own
        ``per_sample`` ``(N,)`` (a plain number where they all agree)."""
        return value if per_sample is None else make_number(value, per_sample, self)

    def scalar(self, number: Any, like: Tensor | None) -> Any:
        """A padded number as this sample's value: a 0-d tensor (batched under ``vmap``) of
        the dtype a Python number of its kind gets against ``like``; other values as they are."""
        if not isinstance(number, PaddedNumber):
            return number
        floating = isinstance(number, float)
        if like is not None and (not floating or like.is_floating_point() or like.is_complex()):
            dtype = like.dtype
        else:
            dtype = torch.get_default_dtype() if floating else torch.int64
        device = like.device if like is not None else number.per_sample.device
        return self.row(number.per_sample.to(device=device, dtype=dtype))

    def diverged(self, what: str, reason: str) -> UnsupportedOpError:
        """The error for a size read from a padded tensor that decides something per sample
        (:mod:`~multiscale_jac._sizes`)."""
        return UnsupportedOpError(what, self.where(None)[1], reason, context=self.context)


# ---------------------------------------------------------------------- elementwise
def _common_region(
    mode: MaskedMode, func: Any, operands: Sequence[Tensor], out_ndim: int
) -> Region | None:
    """The region of an elementwise result: the one region every tracked operand has (dims
    aligned for broadcasting), or boxes over different dims joined where the operands
    broadcast (a ``(W,)`` coordinate row against a ``(C, H, W)`` map); else raise."""
    found: list[tuple[Tensor, Region]] = []
    for t in operands:
        r = mode.region(t)
        if r is None:
            continue
        shift = out_ndim - t.dim()
        found.append((t, r.moved(lambda d, s=shift: d + s) if shift else r))
    if not found:
        return None
    first = found[0][1]
    if all(first.same_as(r) for _, r in found[1:]):
        return first
    joined = _joined_boxes(found, out_ndim)
    if joined is None:
        raise mode.unsupported(
            func,
            "its tensor inputs have different valid regions per sample (the unpadded "
            "model would combine tensors of different shapes)",
        )
    return joined


def _joined_boxes(found: list[tuple[Tensor, Region]], out_ndim: int) -> Region | None:
    """One box from boxes that agree where they share a dim, each other dim constrained by
    one operand only while the other tracked operands broadcast along it (extent 1)."""
    if any(r.ordered or r.sizes is None for _, r in found):
        return None
    sizes: dict[int, Tensor] = {}
    extent: dict[int, int] = {}
    for _, r in found:
        for k, d in enumerate(r.dims):
            if d in sizes and not torch.equal(sizes[d], r.sizes[:, k]):
                return None
            sizes[d], extent[d] = r.sizes[:, k], r.extent[k]
    for t, r in found:
        shift = out_ndim - t.dim()
        for d in sizes:
            if d not in r.dims and d >= shift and t.shape[d - shift] != 1:
                return None  # real all along a dim another operand pads: shapes differ
    dims = sorted(sizes)
    return Region.box(torch.stack([sizes[d] for d in dims], 1), [extent[d] for d in dims], dims)


@MaskedMode.rule(*UNARY, *BINARY, *SINGULAR)
def _elementwise(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Any:
    operands = data_operands(func, args, kwargs)
    if func in SAVES_OUTPUT_INPLACE:
        raise mode.unsupported(
            func,
            "an in-place op that does not keep 0 at 0 and whose backward reads its output "
            "(re-zeroing the padding would modify a saved tensor); use the out-of-place form",
        )
    args = mode.singular_safe(func, args)
    out = func(*args, **kwargs)
    if not isinstance(out, Tensor):
        return out
    region = _common_region(mode, func, operands, out.dim())
    if region is not None and region.ordered:
        for t in operands:
            if mode.region(t) is None and t.numel() > 1:
                shift = out.dim() - t.dim()
                if any(0 <= d - shift < t.dim() and t.shape[d - shift] > 1 for d in region.group):
                    raise mode.unsupported(
                        func,
                        "an unpadded tensor combined position by position with a flattened "
                        "padded one (positions differ from the unpadded model's)",
                    )
    return mode.settle(func, args, kwargs, operands, out, region)


# ---------------------------------------------------------------------- spatial helpers
def _spatial_region(mode: MaskedMode, func: Any, x: Tensor, nsp: int) -> Region:
    """The box region over the last ``nsp`` dims of ``x``, else raise."""
    r = mode.region(x)
    dims = tuple(range(x.dim() - nsp, x.dim()))
    if r is None:
        raise mode.unsupported(func, "internal: untracked input")  # pragma: no cover
    if r.ordered or r.sizes is None or not set(r.dims) <= set(dims):
        raise mode.unsupported(
            func,
            "its input's padding is not a top-left box over the spatial dims (for example "
            "after a flatten or a reshape)",
        )
    sizes = r.sizes
    if r.dims != dims:
        columns = [
            r.sizes[:, r.dims.index(d)]
            if d in r.dims
            else torch.full_like(r.sizes[:, 0], x.shape[d])
            for d in dims
        ]
        sizes = torch.stack(columns, dim=1)
    return Region.box(sizes, [x.shape[d] for d in dims], dims)


def _out_sizes(
    func: Any,
    sizes: Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool = False,
) -> Tensor:
    """Per-sample output sizes of a sliding window (PyTorch's conv/pool formula)."""
    out = []
    for k in range(sizes.shape[1]):
        s_in = sizes[:, k]
        span = s_in + 2 * padding[k] - dilation[k] * (kernel[k] - 1) - 1
        if ceil_mode:
            o = torch.div(span + stride[k] - 1, stride[k], rounding_mode="floor") + 1
            # the last window must start inside the input or the left padding
            o = torch.where((o - 1) * stride[k] >= s_in + padding[k], o - 1, o)
        else:
            o = torch.div(span, stride[k], rounding_mode="floor") + 1
        if bool((o < 1).any()):
            i = int((o < 1).nonzero()[0, 0])
            raise ValueError(
                f"padded execution: {op_name(func)}: sample {i} has valid size {tuple(sizes[i].tolist())} "
                f"along the spatial dims, too small for kernel {tuple(kernel)} (the unpadded model fails too)"
            )
        out.append(o)
    return torch.stack(out, dim=1)


# ---------------------------------------------------------------------- convolution
@MaskedMode.rule(torch.conv1d, torch.conv2d, torch.conv3d)
def _conv(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("conv", args, kwargs)
    x, w = b["input"], b["weight"]
    if mode.region(w) is not None or (b["bias"] is not None and mode.region(b["bias"]) is not None):
        raise mode.unsupported(func, "a padded tensor as conv weight")
    nsp = w.dim() - 2
    sizes = _spatial_region(mode, func, x, nsp).sizes
    if b["padding"] != "same":  # 'same' keeps every sample's sizes (the padding reads zeros)
        padding = (0,) * nsp if b["padding"] == "valid" else ntuple(b["padding"], nsp)
        stride, dilation = ntuple(b["stride"], nsp), ntuple(b["dilation"], nsp)
        sizes = _out_sizes(func, sizes, tuple(w.shape[2:]), stride, padding, dilation)
    return mode.rezero_box(func(*args, **kwargs), sizes, nsp)


# ---------------------------------------------------------------------- pooling
_MAX_POOLS = [
    *named(F, "max_pool1d max_pool2d max_pool3d"),
    *named(torch, "max_pool1d max_pool2d max_pool3d"),
]
_AVG_POOLS = named(F, "avg_pool1d avg_pool2d avg_pool3d")
_ADAPTIVE_AVG = named(F, "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d")
_ADAPTIVE_MAX = named(F, "adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d")
#: spatial dims of every pooling op (each list above goes 1d, 2d, 3d)
_NSP = {
    f: 1 + k % 3
    for funcs in (_MAX_POOLS, _AVG_POOLS, _ADAPTIVE_AVG, _ADAPTIVE_MAX)
    for k, f in enumerate(funcs)
}


@MaskedMode.rule(*_MAX_POOLS)
def _max_pool(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    nsp = _NSP[func]
    b = bind_op("max_pool", args, kwargs)
    if b["return_indices"]:
        raise mode.unsupported(func, "return_indices=True (indices refer to padded positions)")
    x = b["input"]
    region = _spatial_region(mode, func, x, nsp)
    kernel, stride, padding = pool_args(b, nsp)
    dilation = ntuple(b["dilation"], nsp)
    sizes = _out_sizes(func, region.sizes, kernel, stride, padding, dilation, b["ceil_mode"])
    new_args, new_kwargs = with_input(args, kwargs, mode.fill(x, region, -math.inf))
    return mode.rezero_box(func(*new_args, **new_kwargs), sizes, nsp)


@MaskedMode.rule(*_AVG_POOLS)
def _avg_pool(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    nsp = _NSP[func]
    b = bind_op("avg_pool", args, kwargs)
    x = b["input"]
    region = _spatial_region(mode, func, x, nsp)
    kernel, stride, padding = pool_args(b, nsp)
    sizes = _out_sizes(func, region.sizes, kernel, stride, padding, (1,) * nsp, b["ceil_mode"])
    # window sums (padding and the padded region hold zeros), divided per sample like PyTorch
    x2 = x.unsqueeze(-1) if nsp == 1 else x
    k2, s2, p2 = (
        ((*kernel, 1), (*stride, 1), (*padding, 0)) if nsp == 1 else (kernel, stride, padding)
    )
    pool = F.avg_pool2d if nsp <= 2 else F.avg_pool3d
    sums = pool(x2, k2, s2, p2, b["ceil_mode"], True, 1)
    if nsp == 1:
        sums = sums.squeeze(-1)
    out_extent = tuple(sums.shape[-nsp:])
    if b["divisor_override"]:
        divisor = torch.full(
            (1,) * sums.dim(), float(b["divisor_override"]), dtype=sums.dtype, device=sums.device
        )
    else:
        table = avg_divisor(region.sizes, out_extent, b, x.dtype)
        divisor = mode.row(table).reshape((1,) * (sums.dim() - nsp) + out_extent)
    return mode.rezero_box(sums / divisor, sizes, nsp)


@MaskedMode.rule(*_ADAPTIVE_AVG, *_ADAPTIVE_MAX)
def _adaptive_pool(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    nsp = _NSP[func]
    b = bind_op("adaptive_pool", args, kwargs)
    size = ntuple(b["output_size"], nsp)
    if any(s != 1 for s in size) or b["return_indices"]:
        raise mode.unsupported(
            func,
            "only output size 1 (global pooling) has an exact rule; other sizes bin the input by its size",
        )
    x = b["input"]
    dims = tuple(range(x.dim() - nsp, x.dim()))
    return _reduce_impl(mode, func, x, dims, True, "mean" if func in _ADAPTIVE_AVG else "amax")


# ---------------------------------------------------------------------- reductions
_REDUCE = {f: kind for kind in ("sum", "mean", "amax", "amin") for f in pairs(kind)}


@MaskedMode.rule(*_REDUCE)
def _reduce(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("reduce", args, kwargs)
    if "dtype" in kwargs:
        raise mode.unsupported(func, "dtype= in a reduction")
    x = b["input"]
    if b["dim"] in (None, (), []):
        dims = tuple(range(x.dim()))
    else:
        dims = tuple(d % x.dim() for d in ntuple(b["dim"], 1))
    return _reduce_impl(mode, func, x, dims, b["keepdim"], _REDUCE[func])


def _reduce_impl(
    mode: MaskedMode, func: Any, x: Tensor, dims: tuple[int, ...], keepdim: bool, kind: str
) -> Tensor:
    region = mode.region(x)
    reduced = [d for d in region.touched if d in dims]
    if region.ordered and reduced and not set(region.group) <= set(dims):
        raise mode.unsupported(
            func,
            "a reduction over part of a flattened padded group (which elements it combines "
            "depends on positions that differ from the unpadded model's)",
        )
    after = _after_reduce(region, dims, keepdim, x.dim())
    if not reduced:  # reducing over dims where everything is real: elementwise for the region
        return mode.rezero(getattr(x, kind)(dim=dims, keepdim=keepdim), after)
    if kind in ("amax", "amin"):
        filled = mode.fill(x, region, -math.inf if kind == "amax" else math.inf)
        return mode.rezero(getattr(filled, kind)(dim=dims, keepdim=keepdim), after)
    out = x.sum(dim=dims, keepdim=keepdim)  # padding holds zeros
    if kind == "mean":
        full = region.full_table(x.shape).to(x.dtype)  # (N, *shape)
        count = full.sum(dim=tuple(1 + d for d in dims), keepdim=keepdim)
        out = out / mode.row(count.clamp(min=1))
    return mode.rezero(out, after)


def _after_reduce(region: Region, dims: tuple[int, ...], keepdim: bool, ndim: int) -> Region | None:
    """An output element is real if any element it reduces is real. Reducing all of an ordered
    group leaves no mixed coordinates behind."""

    def where(d: int) -> int:
        return d if keepdim else d - sum(1 for r in dims if r < d)

    keep = [k for k, d in enumerate(region.dims) if d not in dims]
    red = tuple(1 + k for k, d in enumerate(region.dims) if d in dims)
    table = region.table.any(dim=red) if red else region.table
    sizes = None if region.sizes is None else region.sizes[:, keep]
    group = region.group
    if group is not None:
        group = None if set(group) <= set(dims) else tuple(where(d) for d in group)
    new_dims = tuple(where(region.dims[k]) for k in keep)
    if not new_dims and bool(table.all()):
        return None
    return Region(new_dims, table, sizes if new_dims else None, group)


# ---------------------------------------------------------------------- softmax
@MaskedMode.rule(*pairs("softmax log_softmax"), F.softmax, F.log_softmax)
def _softmax(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("softmax", args, kwargs)
    x = b["input"]
    if b["dim"] is None:
        raise mode.unsupported(func, "softmax without dim")
    dim = b["dim"] % x.dim()
    region = mode.region(x)
    if dim in region.touched:
        if region.ordered and region.group != (dim,):
            raise mode.unsupported(func, "softmax over one dim of a flattened padded group")
        new_args, new_kwargs = with_input(args, kwargs, mode.fill(x, region, -math.inf))
        return mode.rezero(func(*new_args, **new_kwargs), region)
    return mode.rezero(func(*args, **kwargs), region)


# ---------------------------------------------------------------------- upsampling
@MaskedMode.rule(F.interpolate)
def _interpolate(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("interpolate", args, kwargs)
    x = b["input"]
    nsp = x.dim() - 2
    if b["size"] is not None or b["scale_factor"] is None:
        # also on an unpadded input: the size may be a padded map's shape (an FPN's top-down
        # pathway resizes to the finer map's shape), the canvas and not each sample's own
        raise mode.unsupported(
            func,
            "size= would give every sample the same (padded) target size, not its own; use "
            "an integer scale_factor",
        )
    if mode.region(x) is None:  # a scale factor on an unpadded input: as it is
        return func(*args, **kwargs)
    if b["mode"] not in ("nearest", "nearest-exact"):
        raise mode.unsupported(
            func,
            f"mode={b['mode']!r} reads across the border of the valid region; only nearest with an integer scale_factor is exact",
        )
    scale = ntuple(b["scale_factor"], nsp)
    if any(float(s) != int(s) or int(s) < 1 for s in scale):
        raise mode.unsupported(
            func, f"scale_factor={b['scale_factor']!r} is not a positive integer"
        )
    region = _spatial_region(mode, func, x, nsp)
    sizes = region.sizes * torch.tensor([int(s) for s in scale], device=region.sizes.device)
    return mode.rezero_box(func(*args, **kwargs), sizes, nsp)


# ---------------------------------------------------------------------- concatenation
@MaskedMode.rule(torch.cat, torch.concat, torch.concatenate)
def _cat(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("cat", args, kwargs)
    parts = list(b["tensors"])
    out = func(*args, **kwargs)
    dim = b["dim"] % out.dim()
    regions = [mode.region(t) for t in parts]
    if all(r is None or dim not in r.dims for r in regions):
        return mode.rezero(out, _common_region(mode, func, parts, out.dim()))
    # along a padded dim: the real elements of the result in row-major order are those of the
    # inputs in order, if no padded dim comes before ``dim`` (ordered inputs) and, for boxes,
    # the other dims agree (as the unpadded model's shapes must)
    n = next(r for r in regions if r is not None).table.shape[0]
    tables, rest, group = [], None, {dim}
    for t, r in zip(parts, regions):
        full = (
            torch.ones((n, *t.shape), dtype=torch.bool, device=out.device)
            if r is None
            else r.full_table(t.shape)
        )
        if r is not None and r.ordered:
            if min(r.group) < dim:
                raise mode.unsupported(
                    func,
                    "concatenation along a dim after the first of a flattened padded group "
                    "(it would interleave real elements in another order than unpadded)",
                )
        else:
            other = full.any(dim=1 + dim)
            if rest is not None and not torch.equal(rest, other):
                raise mode.unsupported(
                    func,
                    "its inputs have different valid sizes along the other dims (the "
                    "unpadded model would concatenate tensors of mismatched shapes)",
                )
            rest = other
        if r is not None:
            group.update(r.touched)
        tables.append(full)
    table = torch.cat(tables, dim=1 + dim)
    return mode.rezero(out, Region(tuple(range(out.dim())), table, None, tuple(sorted(group))))


@MaskedMode.rule(torch.stack)
def _stack(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("cat", args, kwargs)
    parts = list(b["tensors"])
    out = func(*args, **kwargs)
    dim = b["dim"] % out.dim()
    region = _common_region(mode, func, parts, parts[0].dim())
    if region is None:
        return out
    return mode.rezero(out, region.moved(lambda d: d + (1 if d >= dim else 0)))


# ---------------------------------------------------------------------- layout
@MaskedMode.rule(
    *pairs("reshape flatten unflatten"), *named(torch.Tensor, "view view_as reshape_as")
)
def _reshape(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs["input"]
    if (
        func in (torch.Tensor.view, torch.Tensor.reshape)
        and len(args) == 2
        and isinstance(args[1], torch.dtype)
    ):
        raise mode.unsupported(func, "a dtype view")
    out = func(*args, **kwargs)
    region = mode.region(x)
    if out.dim() == x.dim() and out.shape == x.shape:
        return mode.track(out, region)
    return mode.track(out, reshaped_region(region, x.shape, out.shape))


def reshaped_region(region: Region, old: Sequence[int], new: Sequence[int]) -> Region | None:
    """The region of ``x.reshape(new)`` for ``x`` of shape ``old``.

    Dims that the reshape leaves alone keep their meaning (a box stays a box); dims merged or
    split together with a padded dim become an ordered group.
    """
    table = region.full_table(old).reshape(region.table.shape[0], *new)
    touched = set(region.touched)
    where: dict[int, int] = {}
    group: set[int] = set()
    for old_dims, new_dims in _reshape_blocks(old, new):
        if len(old_dims) == 1 and len(new_dims) == 1:
            where[old_dims[0]] = new_dims[0]
        elif touched & set(old_dims):
            group.update(new_dims)
    for d in region.group or ():
        if d in where:
            group.add(where[d])
    if not group:
        moved = region.moved(where.__getitem__)
        return compact(Region(moved.dims, moved.table, moved.sizes))
    return compact(Region(tuple(range(len(new))), table, None, tuple(sorted(group))))


def _reshape_blocks(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up dims of ``old`` and ``new`` into blocks with equal products (size-1 dims alone)."""
    blocks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        if j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            blocks.append(([], [j]))
            j += 1
            continue
        if i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            blocks.append(([i], []))
            i += 1
            continue
        oi, nj = [i], [j]
        po, pn = old[i], new[j]
        i += 1
        j += 1
        while po != pn:
            if po < pn:
                oi.append(i)
                po *= old[i]
                i += 1
            else:
                nj.append(j)
                pn *= new[j]
                j += 1
        blocks.append((oi, nj))
    return blocks


@MaskedMode.rule(*pairs("permute transpose movedim t"))
def _permute(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs["input"]
    out = func(*args, **kwargs)
    region = mode.region(x)
    # order[j]: the input dim that becomes output dim j, read off a probe with distinct sizes
    probe = torch.empty(tuple(range(2, x.dim() + 2)), device="meta")
    probe_args, probe_kwargs = with_input(args, kwargs, probe)
    order = [s - 2 for s in func(*probe_args, **probe_kwargs).shape]
    if region.ordered and [order.index(d) for d in region.group] != sorted(
        order.index(d) for d in region.group
    ):
        raise mode.unsupported(func, "a permutation that reorders a flattened padded group")
    return mode.track(out, region.moved(order.index))


@MaskedMode.rule(*pairs("squeeze unsqueeze"))
def _squeeze(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs["input"]
    out = func(*args, **kwargs)
    return mode.track(out, reshaped_region(mode.region(x), x.shape, out.shape))


@MaskedMode.rule(torch.Tensor.expand, torch.Tensor.expand_as)
def _expand(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x = args[0]
    out = func(*args, **kwargs)
    region = mode.region(x)
    shift = out.dim() - x.dim()
    return mode.track(out, region.moved(lambda d: d + shift))


@MaskedMode.rule(torch.Tensor.__getitem__)
def _getitem(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x, index = args[0], args[1]
    region = mode.region(x)
    idx = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (Tensor, list, bool)) for i in idx):
        raise mode.unsupported(func, "tensor/advanced indexing of a padded tensor")
    # expand Ellipsis
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - n_real))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None)))
    in_dim = out_dim = 0
    mapping: dict[int, int] = {}
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if isinstance(i, int):
            if in_dim in region.touched:
                raise mode.unsupported(func, "integer indexing along a padded dim")
            in_dim += 1
            continue
        if in_dim in region.touched and i != slice(None):
            raise mode.unsupported(func, "slicing along a padded dim")
        mapping[in_dim] = out_dim
        in_dim += 1
        out_dim += 1
    out = func(*args, **kwargs)
    return mode.track(out, region.moved(mapping.__getitem__))


_SPLITS = {f: kind for kind in ("chunk", "split", "unbind") for f in pairs(kind)}


@MaskedMode.rule(*_SPLITS)
def _split(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, ...]:
    x = args[0] if args else kwargs["input"]
    dim = bind_op(_SPLITS[func], args, kwargs)["dim"] % x.dim()
    region = mode.region(x)
    if dim in region.touched:
        raise mode.unsupported(func, "splitting along a padded dim")
    outs = func(*args, **kwargs)
    drop = _SPLITS[func] == "unbind"
    moved = region.moved(lambda d: d - 1 if drop and d > dim else d)
    for o in outs:
        mode.track(o, moved)
    return outs


# ---------------------------------------------------------------------- linear maps
@MaskedMode.rule(F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
def _linear(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
    region = mode.region(x)
    if mode.region(w) is not None or region is None:
        raise mode.unsupported(
            func, "a padded tensor as the right operand (it would sum over padded positions)"
        )
    if (x.dim() - 1) in region.touched:
        raise mode.unsupported(
            func, "a linear map over a padded dim (mixes real and padded positions)"
        )
    out = func(*args, **kwargs)
    if out.dim() != x.dim():
        raise mode.unsupported(func, "a matmul that changes the rank")
    return mode.rezero(out, region)


@MaskedMode.rule(F.embedding)
def _embedding(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """A lookup per position: the ids' region, with the embedding dim appended (real)."""
    ids = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    if mode.region(weight) is not None:
        raise mode.unsupported(func, "a padded tensor as the embedding table")
    return mode.rezero(func(*args, **kwargs), mode.region(ids))


@MaskedMode.rule(torch.einsum)
def _einsum(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """Sums of products: padded zeros add nothing to a contraction, so an einsum is exact when
    every padded dim of every operand is either kept in the output or summed over as a whole,
    and unpadded operands do not weight padded dims position by position."""
    equation = args[0]
    operands = (
        list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    )
    if not isinstance(equation, str) or "->" not in equation:
        raise mode.unsupported(func, "an einsum without an explicit '->' output")
    lhs, rhs = equation.replace(" ", "").split("->")
    raw = lhs.split(",")
    ells = [op.dim() - len(sp.replace("...", "")) for sp, op in zip(raw, operands)]
    max_ell = max((e for sp, e in zip(raw, ells) if "..." in sp), default=0)
    specs = [_expand_ellipsis(sp, e, max_ell) for sp, e in zip(raw, ells)]
    out_spec = _expand_ellipsis(rhs, max_ell, max_ell)
    kept: dict[str, Region] = {}
    tables = []
    for spec, op in zip(specs, operands):
        r = mode.region(op)
        if r is None:
            continue
        letters = "".join(spec[d] for d in r.touched)
        inside = [c in out_spec for c in letters]
        if any(inside) and not all(inside):
            raise mode.unsupported(
                func, "an einsum that sums over part of the padded dims of an operand"
            )
        for c in letters:
            if c in kept and not kept[c].same_as(r):
                raise mode.unsupported(func, "operands with different padding along a shared index")
            kept[c] = r
        if all(inside):
            tables.append((r, spec))
    for spec, op in zip(specs, operands):
        if mode.region(op) is None and any(
            c in kept and op.shape[k] > 1 for k, c in enumerate(spec)
        ):
            raise mode.unsupported(
                func, "an unpadded operand weighting padded positions one by one"
            )
    out = func(*args, **kwargs)
    if not tables:
        return out
    n = tables[0][0].table.shape[0]
    full = torch.ones((n, *out.shape), dtype=torch.bool, device=out.device)
    group, seen = None, set()
    for r, spec in tables:
        if id(r) not in seen:  # a region's table enters once, placed by its first operand
            seen.add(id(r))
            full = full & r.moved(lambda d, s=spec: out_spec.index(s[d])).full_table(out.shape)
        if r.ordered:
            group = tuple(sorted({out_spec.index(spec[d]) for d in r.group} | set(group or ())))
    return mode.rezero(out, Region(tuple(range(out.dim())), full, None, group))


def _expand_ellipsis(spec: str, n_ell: int, max_ell: int) -> str:
    """Replace ``...`` by ``n_ell`` upper-case letters, right-aligned among ``max_ell``."""
    return spec.replace("...", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[max_ell - n_ell : max_ell])


# ---------------------------------------------------------------------- normalisation
@MaskedMode.rule(F.batch_norm)
def _batch_norm(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("batch_norm", args, kwargs)
    if b["training"]:
        raise mode.unsupported(func, "BatchNorm with batch statistics")
    region = mode.region(b["input"])
    if 1 in region.touched:
        raise mode.unsupported(func, "padding along the channel dim")
    return mode.rezero(func(*args, **kwargs), region)


@MaskedMode.rule(F.group_norm, F.instance_norm)
def _group_norm(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """GroupNorm, and InstanceNorm (one group per channel), with statistics over the real
    elements of every group."""
    instance = func is F.instance_norm
    b = bind_op("instance_norm" if instance else "group_norm", args, kwargs)
    x = b["input"]
    region = mode.region(x)
    if 1 in region.touched or 0 in region.touched:
        raise mode.unsupported(func, "padding along the batch or channel dim")
    if instance and not b["use_input_stats"]:
        return mode.rezero(func(*args, **kwargs), region)
    if instance and b["running_mean"] is not None:
        raise mode.unsupported(func, "InstanceNorm updating running statistics in train mode")
    n1, c = x.shape[0], x.shape[1]
    g = c if instance else b["num_groups"]
    counts = region.full_table(x.shape)[:, 0, 0].flatten(1).sum(1)
    require_more_than_one(counts * (c // g), func, mode.context, "sample")
    if instance:
        out = _masked_normalise(mode, x, region, tuple(range(2, x.dim())), b["eps"])
    else:
        xg = x.reshape(n1, g, c // g, *x.shape[2:])
        greg = region.moved(lambda d: d + 1)
        out = _masked_normalise(mode, xg, greg, tuple(range(2, xg.dim())), b["eps"])
    return mode.rezero(_affine(out.reshape(x.shape), b, [1, c] + [1] * (x.dim() - 2)), region)


@MaskedMode.rule(F.layer_norm)
def _layer_norm(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("layer_norm", args, kwargs)
    x = b["input"]
    region = mode.region(x)
    k = len(ntuple(b["normalized_shape"], 1))
    dims = tuple(range(x.dim() - k, x.dim()))
    if not set(dims) & set(region.dims):  # per position: elementwise for the region
        return mode.rezero(func(*args, **kwargs), region)
    _check_norm_dims(mode, func, region, dims, b["weight"], b["bias"])
    out = _masked_normalise(mode, x, region, dims, b["eps"])
    return mode.rezero(_affine(out, b, x.shape[x.dim() - k :]), region)


@MaskedMode.rule(F.rms_norm, torch.rms_norm)
def _rms_norm(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims: per position when they are not
    padded (the channels of tokens), else the mean square over the real elements of every
    slice, computed like PyTorch's (in at least float32, ``eps=None``: that type's epsilon)."""
    b = bind_op("rms_norm", args, kwargs)
    x = b["input"]
    region = mode.region(x)
    k = len(ntuple(b["normalized_shape"], 1))
    dims = tuple(range(x.dim() - k, x.dim()))
    if not set(dims) & set(region.dims):  # per position: elementwise for the region
        return mode.rezero(func(*args, **kwargs), region)
    _check_norm_dims(mode, func, region, dims, b["weight"])
    acc = torch.promote_types(x.dtype, torch.float32)
    eps = torch.finfo(acc).eps if b["eps"] is None else b["eps"]
    xa = x.to(acc) * mode.mask(region, x)
    mean_square = (xa * xa).sum(dim=dims, keepdim=True) / _masked_count(mode, xa, region, dims)
    out = (xa * torch.rsqrt(mean_square + eps)).to(x.dtype)
    return mode.rezero(_affine(out, {**b, "bias": None}, x.shape[x.dim() - k :]), region)


def _check_norm_dims(
    mode: MaskedMode, func: Any, region: Region, dims: tuple[int, ...], *params: Tensor | None
) -> None:
    """Masked statistics over ``dims`` are exact when every slice along them holds the real
    elements of the unpadded slice: refuse normalised dims that cut a flattened group, and an
    elementwise weight or bias that varies along a flattened group (positions differ)."""
    if not region.ordered or not set(region.group) & set(dims):
        return
    if not set(region.group) <= set(dims):
        raise mode.unsupported(
            func,
            "a normalisation over part of a flattened padded group (which elements it "
            "combines depends on positions that differ from the unpadded model's)",
        )
    first = min(dims)
    if any(
        p is not None and p.dim() == len(dims) and p.shape[d - first] > 1
        for p in params
        for d in region.group
    ):
        raise mode.unsupported(
            func,
            "an elementwise weight or bias over a flattened padded group (positions differ "
            "from the unpadded model's)",
        )


def _affine(out: Tensor, b: dict, shape: Sequence[int]) -> Tensor:
    """``out * weight + bias`` of a bound norm call, the parameters viewed as ``shape``."""
    if b["weight"] is not None:
        out = out * b["weight"].reshape(shape)
    if b["bias"] is not None:
        out = out + b["bias"].reshape(shape)
    return out


def _masked_normalise(
    mode: MaskedMode, x: Tensor, region: Region, dims: tuple[int, ...], eps: float
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (biased) variance over the real elements
    along ``dims``."""
    count = _masked_count(mode, x, region, dims)
    m = mode.mask(region, x).to(x.dtype)
    xm = x * m
    mean = xm.sum(dim=dims, keepdim=True) / count
    centred = (x - mean) * m
    var = (centred * centred).sum(dim=dims, keepdim=True) / count
    return centred * torch.rsqrt(var + eps)


def _masked_count(mode: MaskedMode, x: Tensor, region: Region, dims: tuple[int, ...]) -> Tensor:
    """This sample's number of real elements of every slice along ``dims`` (at least 1), shaped
    like a ``keepdim`` reduction of ``x``."""
    full = region.full_table(x.shape).to(x.dtype)
    return mode.row(full.sum(dim=tuple(1 + d for d in dims), keepdim=True).clamp(min=1))


# ---------------------------------------------------------------------- attention
def _attention_regions(
    mode: MaskedMode, func: Any, q: Tensor, k: Tensor, v: Tensor, tokens_first: bool = False
) -> tuple[Region | None, Region | None]:
    """The query's and the key's regions, checked: padding along the token dim only (``-2``,
    or ``0`` with ``tokens_first``), the same for key and value."""

    def token(t: Tensor) -> int:
        return 0 if tokens_first else t.dim() - 2

    rq, rk, rv = mode.region(q), mode.region(k), mode.region(v)
    if rk is not None:
        if rv is None or not rk.same_as(rv):
            raise mode.unsupported(func, "key and value with different padding")
        if set(rk.touched) != {token(k)}:
            raise mode.unsupported(func, "padding of key/value outside the token dim")
    elif rv is not None:
        raise mode.unsupported(func, "padded value with unpadded key")
    if rq is not None and set(rq.touched) != {token(q)}:
        raise mode.unsupported(func, "padding of the query outside the token dim")
    return rq, rk


def _pair_table(rq: Region | None, rk: Region | None, size_q: int, size_k: int) -> Tensor:
    """``(N, L, S)``: true where both the query and the key are real."""
    r = rq if rq is not None else rk
    n, dev = r.table.shape[0], r.table.device
    qt = rq.table if rq is not None else torch.ones(n, size_q, dtype=torch.bool, device=dev)
    kt = rk.table if rk is not None else torch.ones(n, size_k, dtype=torch.bool, device=dev)
    return qt.unsqueeze(2) & kt.unsqueeze(1)


def _user_attn_mask(
    mode: MaskedMode,
    func: Any,
    am: Tensor | None,
    rq: Region | None,
    rk: Region | None,
    sizes: tuple[int, int],
    blocked: bool,
) -> Tensor | None:
    """A user's attention mask ``(..., L, S)``, checked against the padding: an unpadded mask
    reads the same entries as unpadded when the tokens are padded at the end (a box), not when
    they are interleaved (flattened); a padded mask must be real exactly where query and key
    are. The rows of padded queries are opened (those outputs are re-zeroed; a row blocked
    everywhere would put nan into the backward pass). ``blocked``: a bool mask is True where
    attention is blocked (``multi_head_attention_forward``), else where it is allowed (SDPA)."""
    if am is None:
        return am
    ra = mode.region(am)
    if ra is not None:
        n = ra.table.shape[0]
        fits = not (rq is None and rk is None)
        fits = fits and am.dim() >= 2 and tuple(am.shape[-2:]) == sizes
        if fits:
            want = _pair_table(rq, rk, *sizes).reshape(n, *[1] * (am.dim() - 2), *sizes)
            fits = torch.equal(ra.full_table(am.shape), want.expand(n, *am.shape))
        if not fits:
            raise mode.unsupported(
                func, "an attn_mask whose padding differs from the query's and the key's"
            )
    elif (rq is not None and rq.ordered and am.dim() >= 2 and am.shape[-2] > 1) or (
        rk is not None and rk.ordered and am.shape[-1] > 1
    ):
        raise mode.unsupported(
            func,
            "an unpadded attn_mask over flattened padded tokens (its positions differ from "
            "the unpadded model's)",
        )
    if rq is None:
        return am
    pad = (~mode.row(rq.table)).unsqueeze(-1)  # (L, 1): padded query rows
    if am.dtype == torch.bool:
        return am & ~pad if blocked else am | pad
    return am.masked_fill(pad, 0.0)


@MaskedMode.rule(F.scaled_dot_product_attention)
def _sdpa(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """Keys padded along the token dim get a key-padding mask from their region (ANDed into a
    bool ``attn_mask``, ``-inf`` in a float one), padded query rows are re-zeroed. ``is_causal``
    with padded keys becomes its top-left causal mask, exact for tokens padded at the end."""
    names = SIGNATURES["sdpa"][0]
    b = bind_op("sdpa", args, kwargs)
    q, k, v = b["query"], b["key"], b["value"]
    rq, rk = _attention_regions(mode, func, q, k, v)
    sizes = (q.shape[-2], k.shape[-2])
    am = _user_attn_mask(mode, func, b["attn_mask"], rq, rk, sizes, blocked=False)
    if b["is_causal"] and (rq is not None or rk is not None):
        if any(r is not None and r.ordered for r in (rq, rk)):
            raise mode.unsupported(
                func,
                "is_causal over flattened padded tokens (positions differ from the unpadded "
                "model's)",
            )
        if rk is not None and am is None:
            am = torch.ones(sizes, dtype=torch.bool, device=q.device).tril()
            b["is_causal"] = False
    if rk is not None:
        key_mask = mode.mask(rk, k).transpose(-1, -2)  # (..., 1, S)
        if am is None:
            am = key_mask
        elif am.dtype == torch.bool:
            am = am & key_mask
        else:
            am = am.masked_fill(~key_mask, -math.inf)
    b["attn_mask"] = am
    out = func(**{n: b[n] for n in names if n in b and not (n == "enable_gqa" and not b[n])})
    return mode.rezero(out, rq)


_MHA_TENSORS = [
    "in_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "out_proj_weight",
    "out_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "static_k",
    "static_v",
]


@MaskedMode.rule(F.multi_head_attention_forward)
def _mha(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> tuple:
    """``nn.MultiheadAttention``: its ``forward`` calls this with tokens first, ``(L, N, E)``
    or unbatched ``(L, E)`` (``batch_first`` is a transpose around it; the fast path
    ``torch._native_multi_head_attention`` is never taken under a torch-function mode).
    Padded keys join the key-padding mask, so they get weight 0; the rows of padded queries
    are re-zeroed in the output and in the attention weights."""
    b = bind_call(func, args, kwargs)
    if b is None:
        raise mode.unsupported(func, "a call that does not match its signature")
    q, k, v = b["query"], b["key"], b["value"]
    if any(mode.region(b[n]) is not None for n in _MHA_TENSORS):
        raise mode.unsupported(func, "a padded tensor as projection weight or static key/value")
    rq, rk = _attention_regions(mode, func, q, k, v, tokens_first=True)
    if rk is not None and (b["static_k"] is not None or b["static_v"] is not None):
        raise mode.unsupported(
            func, "static_k/static_v with padded keys (they replace the keys that are padded)"
        )
    sizes = (q.shape[0], k.shape[0])
    b["attn_mask"] = _user_attn_mask(mode, func, b["attn_mask"], rq, rk, sizes, blocked=True)
    if rk is not None:
        b["key_padding_mask"] = _key_padding_mask(mode, func, b, rk)
    out, weights = func(**b)
    out = mode.rezero(out, rq)
    if weights is None or (rq is None and rk is None):
        return out, weights
    return out, mode.rezero(weights, _weights_region(rq, rk, weights, k.shape[0]))


def _key_padding_mask(mode: MaskedMode, func: Any, b: dict, rk: Region) -> Tensor:
    """``multi_head_attention_forward``'s ``key_padding_mask`` (True or ``-inf``: ignored),
    ``(N, S)`` or ``(S,)``, with the padded keys added to the user's mask (a float one if the
    ``attn_mask`` is float, as PyTorch wants both of one type)."""
    k, user, am = b["key"], b["key_padding_mask"], b["attn_mask"]
    ignore = ~mode.row(rk.table)  # (S,)
    if k.dim() == 3:
        ignore = ignore.expand(k.shape[1], -1).contiguous()  # (N, S)
    if user is None:
        if am is not None and am.is_floating_point():
            zeros = torch.zeros(ignore.shape, dtype=b["query"].dtype, device=ignore.device)
            return zeros.masked_fill(ignore, -math.inf)
        return ignore
    ru = mode.region(user)
    if ru is not None:
        if set(ru.touched) != {user.dim() - 1} or not torch.equal(ru.table, rk.table):
            raise mode.unsupported(func, "a key_padding_mask whose padding differs from the key's")
    elif rk.ordered and user.shape[-1] > 1:
        raise mode.unsupported(
            func,
            "an unpadded key_padding_mask over flattened padded keys (its positions differ "
            "from the unpadded model's)",
        )
    if user.dtype == torch.bool:
        return user | ignore
    return user.masked_fill(ignore, -math.inf)


def _weights_region(rq: Region | None, rk: Region | None, w: Tensor, size_k: int) -> Region:
    """The attention weights' ``(..., L, S')`` region: real where query and key are real. The
    ``S' - S`` extra keys (``bias_k``, ``add_zero_attn``) are real and sit after the padded
    keys, so only the order of the real keys then matches the unpadded weights'."""
    size_q, size_w = w.shape[-2:]
    extra = size_w - size_k
    table = _pair_table(rq, rk, size_q, size_k)
    n = table.shape[0]
    table = torch.cat([table, table.new_ones(n, size_q, extra)], dim=2)
    dims = (w.dim() - 2, w.dim() - 1)
    q_box = rq is None or rq.sizes is not None
    k_box = rk is None or (rk.sizes is not None and extra == 0)
    if not (q_box and k_box):
        group = tuple(d for d, box in zip(dims, (q_box, k_box)) if not box)
        return Region(dims, table, None, group)
    full = torch.tensor([[size_q, size_k]], device=table.device).expand(n, 2)
    qs = full[:, :1] if rq is None else rq.sizes
    ks = full[:, 1:] if rk is None else rk.sizes
    return Region(dims, table, torch.cat([qs, ks], dim=1))


@MaskedMode.rule(torch.Tensor.masked_fill_)
def _masked_fill_(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """In place, as ``masked_fill``; ``nn.MultiheadAttention`` turns a bool ``key_padding_mask``
    into a float one with it."""
    return _elementwise(mode, func, args, kwargs)


# ---------------------------------------------------------------------- sizes read from padding
_SIZE_READS: dict[Any, str] = {
    Tensor.shape.__get__: "shape",
    Tensor.size: "shape",
    Tensor.numel: "numel",
    torch.numel: "numel",
    Tensor.__len__: "len",
}


def _read_size(mode: MaskedMode, kind: str, func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.shape``, ``x.size()``, ``x.numel()``, ``len(x)``: padded dims of a tracked ``x``
    answer with a :class:`~multiscale_jac._sizes.PaddedSize` (see :mod:`._sizes`)."""
    out = func(*args, **kwargs)
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    region = mode.region(x)
    if region is None:
        return out
    if kind == "numel":
        rest = math.prod(n for d, n in enumerate(x.shape) if d not in region.dims)
        count = region.table.flatten(1).sum(1) * rest
        return mode.number(out, count)
    if kind == "len":  # Python makes len() a plain int: refuse where samples differ
        own = _own_extent(region, 0)
        if own is not None and bool((own != out).any()):
            raise mode.unsupported(func, "len() of a padded dim (every sample has its own)")
        return out
    if isinstance(out, int):  # x.size(dim)
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        return mode.number(out, _own_extent(region, dim % x.dim()))
    return torch.Size([mode.number(n, _own_extent(region, d)) for d, n in enumerate(out)])


def _own_extent(region: Region, d: int) -> Tensor | None:
    """Every sample's own extent along dim ``d`` ``(N,)`` (its real elements along a line;
    ``None``: not padded)."""
    if d not in region.dims:
        return None
    k = region.dims.index(d)
    if region.sizes is not None:
        return region.sizes[:, k]
    count = region.table.sum(dim=1 + k)
    return count.flatten(1).amax(1) if count.dim() > 1 else count


#: ops whose size arguments describe their input's own shape or a layout of it: they see the
#: padded extents and their rules work from the regions (``expand`` also gets a box along
#: the dims it creates)
_SHAPE_ARGS = {
    *pairs("reshape flatten unflatten"),
    *named(torch.Tensor, "view expand"),
    F.layer_norm,
    F.rms_norm,
    torch.layer_norm,
    torch.rms_norm,
    F.interpolate,  # its rule refuses size= with its own reason
}
_FILLS = {f: 0 for f in named(torch, "zeros ones empty rand randn")}
_FILLS.update({f: 1 for f in named(torch.Tensor, "new_zeros new_ones new_empty")})
_FILLS.update({torch.full: 0, torch.Tensor.new_full: 1})  # the size follows ``self``


def _sized_call(mode: MaskedMode, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """An op given a size read from a padded tensor (:mod:`._sizes`): as a shape, as every
    sample's own number, as the extent of a new tensor, or refused."""
    if func in _SHAPE_ARGS:
        out = RuleMode.__torch_function__(mode, func, types, plain(args), plain(kwargs))
        return _expanded(mode, args, out) if func is torch.Tensor.expand else out
    if func in _FILLS:
        return _filled(mode, func, args, kwargs)
    if func is torch.arange:
        return _arange(mode, func, args, kwargs)
    if func is torch.linspace:
        return _linspace(mode, args, kwargs)
    if func in _GLOBAL_POOLS and _is_global_pool(mode, func, args, kwargs):
        x = bind_op("max_pool" if func in _MAX_POOLS else "avg_pool", args, kwargs)["input"]
        nsp = _NSP[func]
        kind = "amax" if func in _MAX_POOLS else "mean"
        return _reduce_impl(mode, func, x, tuple(range(x.dim() - nsp, x.dim())), True, kind)
    if mode.rules.get(func) is _elementwise:
        like = next(iter(tensors(args, kwargs)), None)
        args = tuple(mode.scalar(a, like) for a in args)
        kwargs = {k: mode.scalar(v, like) for k, v in kwargs.items()}
        if not has_padded(args, kwargs):
            return RuleMode.__torch_function__(mode, func, types, args, kwargs)
    raise mode.unsupported(
        func,
        "a size read from a padded tensor's shape reaches it as a number (every sample has "
        "its own size; only shapes, elementwise arithmetic and new tensors of that size "
        "have exact rules)",
    )


def _box_over(mode: MaskedMode, func: Any, sizes: dict[int, Any]) -> Region | None:
    """The box whose extent along dim ``d`` is ``sizes[d]`` (padded numbers: each sample's
    own; plain ints: all of it)."""
    padded = {d: s for d, s in sizes.items() if isinstance(s, PaddedSize)}
    if not padded:
        return None
    dims = sorted(padded)
    table = torch.stack([padded[d].per_sample for d in dims], dim=1)
    extent = [int(padded[d].plain()) for d in dims]
    if bool((table < 0).any()) or bool((table > torch.tensor(extent, device=table.device)).any()):
        raise mode.unsupported(
            func,
            "a size computed from a padded tensor's shape is negative or larger than its "
            "padded value for some sample",
        )
    return Region.box(table, extent, dims)


def _size_arg(args: tuple, kwargs: dict, start: int) -> tuple:
    """The size of ``torch.zeros(2, 3)``, ``torch.zeros((2, 3))``, ``x.new_zeros(size=...)``
    (``start``: the position of the size, after ``self`` for ``Tensor.new_*``)."""
    if "size" in kwargs:
        return tuple(kwargs["size"])
    rest = args[start:]
    return tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest


def _filled(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """``torch.zeros(h, w)`` and the like: each sample's own extent along the padded sizes."""
    start = _FILLS[func]
    if func in (torch.full, torch.Tensor.new_full):
        fill = args[start + 1] if len(args) > start + 1 else kwargs.get("fill_value")
        if isinstance(fill, PaddedNumber):
            raise mode.unsupported(func, "a fill value computed from a padded tensor's shape")
        size = tuple(kwargs["size"] if "size" in kwargs else args[start])
    else:
        size = _size_arg(args, kwargs, start)
    out = func(*plain(args), **plain(kwargs))
    return mode.rezero(out, _box_over(mode, func, dict(enumerate(size))))


def _arange(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """``torch.arange(w)``: the values are each sample's own in its first entries."""
    b = {"end": args[0]} if len(args) == 1 else dict(zip(("start", "end", "step"), args))
    b.update((k, kwargs[k]) for k in ("start", "end", "step") if k in kwargs)
    start, step, end = b.get("start", 0), b.get("step", 1), b.get("end")
    if not isinstance(end, PaddedNumber) or any(isinstance(v, PaddedNumber) for v in (start, step)):
        raise mode.unsupported(func, "a start or step computed from a padded tensor's shape")
    out = func(*plain(args), **plain(kwargs))
    per = torch.ceil((end.per_sample.double() - start) / step).clamp(min=0)
    return mode.rezero(out, _box_over(mode, func, {0: mode.number(out.shape[0], per)}))


def _linspace(mode: MaskedMode, args: tuple, kwargs: dict) -> Tensor:
    """Every sample's own ``torch.linspace(start, end, steps)`` in its first ``steps``
    entries, by torch's formula (from ``start`` up to the half, from ``end`` down after)."""
    b = {**dict(zip(("start", "end", "steps"), args)), **kwargs}
    if "out" in b or isinstance(b["start"], Tensor) or isinstance(b["end"], Tensor):
        raise mode.unsupported(torch.linspace, "out= or a tensor start or end")
    steps = b["steps"]
    dtype = b.get("dtype") or torch.get_default_dtype()
    k = torch.arange(plain(steps), dtype=dtype, device=b.get("device"))
    n, a, e = (mode.scalar(v, k) for v in (steps, b["start"], b["end"]))
    step = (e - a) / (n - 1)
    values = torch.where(k < n // 2, a + step * k, e - step * (n - 1 - k))
    values = torch.where(torch.as_tensor(n == 1), a + 0 * k, values)  # torch: [start]
    return mode.rezero(values, _box_over(mode, torch.linspace, {0: steps}))


def _is_global_pool(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> bool:
    """``F.avg_pool2d(x, x.shape[2:])``: a window of each sample's own size, once (no stride,
    padding or dilation): a global pooling."""
    nsp = _NSP[func]
    b = bind_op("max_pool" if func in _MAX_POOLS else "avg_pool", args, kwargs)
    x, kernel = b["input"], ntuple(b["kernel_size"], nsp)
    region = mode.region(x)
    if region is None or region.ordered or b.get("divisor_override"):
        return False
    if b["stride"] not in (None, [], ()) and tuple(ntuple(b["stride"], nsp)) != tuple(kernel):
        return False
    if any(p != 0 for p in ntuple(b["padding"], nsp)) or any(
        d != 1 for d in ntuple(b.get("dilation", 1), nsp)
    ):
        return False
    for j, size in enumerate(kernel):
        d = x.dim() - nsp + j
        own = _own_extent(region, d)
        if plain(size) != x.shape[d]:
            return False
        if own is not None and not (
            isinstance(size, PaddedSize) and torch.equal(size.per_sample, own)
        ):
            return False
    return True


_GLOBAL_POOLS = {*_MAX_POOLS, *_AVG_POOLS}


def _expanded(mode: MaskedMode, args: tuple, out: Tensor) -> Tensor:
    """``x.expand(...)`` with padded sizes along dims it creates or stretches from 1: the
    unpadded result has each sample's own extent there."""
    x, sizes = args[0], args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    shift = out.dim() - x.dim()
    new = {
        d: s
        for d, s in enumerate(sizes)
        if isinstance(s, PaddedSize) and (d < shift or x.shape[d - shift] == 1)
    }
    box = _box_over(mode, torch.Tensor.expand, new)
    region = mode.region(out)
    if box is None or region is None:
        return mode.rezero(out, box or region)
    if region.sizes is not None and not region.ordered:  # a box with more dims
        dims = sorted({*region.dims, *box.dims})
        parts = {**dict(zip(region.dims, region.sizes.T)), **dict(zip(box.dims, box.sizes.T))}
        sizes = torch.stack([parts[d] for d in dims], dim=1)
        return mode.rezero(out, Region.box(sizes, [out.shape[d] for d in dims], dims))
    table = region.full_table(out.shape) & box.full_table(out.shape)
    return mode.rezero(out, Region(tuple(range(out.dim())), table, None, region.group))


@MaskedMode.rule(*pairs("triu tril"))
def _triangle(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    """``triu``/``tril`` zero entries by their row and column: exact where those are the
    unpadded model's (a box over the last two dims), e.g. a causal mask of a padded size."""
    x = args[0] if args else kwargs["input"]
    region = mode.region(x)
    if region.ordered and {x.dim() - 2, x.dim() - 1} & set(region.touched):
        raise mode.unsupported(func, "rows or columns of flattened padded positions")
    return mode.track(func(*args, **kwargs), region)


@MaskedMode.rule(torch.meshgrid)
def _meshgrid(mode: MaskedMode, func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, ...]:
    """Grids of 1-d coordinates (``torch.arange(w)`` of a padded size): every grid is real in
    the box of each sample's own lengths."""
    parts = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    outs = func(*args, **kwargs)
    regions = [mode.region(t) for t in parts]
    if any(r is not None and (t.dim() != 1 or r.sizes is None) for t, r in zip(parts, regions)):
        raise mode.unsupported(func, "a padded input that is not a 1-d box")
    n = next(r for r in regions if r is not None).sizes.shape[0]
    lengths = [
        r.sizes[:, 0] if r is not None else torch.full((n,), t.numel(), dtype=torch.int64)
        for t, r in zip(parts, regions)
    ]
    if kwargs.get("indexing") == "xy" and len(lengths) > 1:
        lengths[0], lengths[1] = lengths[1], lengths[0]
    device = lengths[0].device
    sizes = torch.stack([v.to(device) for v in lengths], dim=1)
    box = Region.box(sizes, list(outs[0].shape), range(len(lengths)))
    return tuple(mode.rezero(o, box) for o in outs)


# ---------------------------------------------------------------------- catalogue
#: Names of the ops with an exact rule (for the docs and error messages).
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted({op_name(f) for f in MaskedMode.rules}))


# ---------------------------------------------------------------------- running a model padded
class PaddedFunction:
    """A per-sample function on the *padded* levels of a :class:`PackedBatch`.

    ``f(values, *padded_levels, sample_index) -> (O_pad,)``: the model runs on sample
    ``sample_index``'s padded levels ``(C_l, *max_spatial_l)`` under :class:`MaskedMode`, so the
    real entries of the output equal the unpadded run's, in the same order, and the rest are
    zero. After a call, :attr:`output_table` ``(N, O_pad)`` says which entries are real for every
    sample of the batch (it is concrete, also when the call ran under ``vmap``).
    """

    def __init__(self, fn: Any, packed: Any) -> None:
        self.fn = fn
        self.packed = packed
        self.level_regions = [
            None if t.dim() == 2 else Region.box(sizes, t.shape[2:], range(2, t.dim()))
            for sizes, t in zip(packed.sizes, packed.levels)
        ]
        self.output_table: Tensor | None = None

    def __call__(self, values: tuple[Tensor, ...], *args: Tensor) -> Tensor:
        *levels, index = args
        mode = MaskedMode(index, self.fn.model)

        def enter(stack: Any, batched: list[Tensor]) -> None:
            stack.enter_context(mode)
            for t, region in zip(batched, self.level_regions):
                mode.track(t, region)

        out = self.fn.call(self.fn.full_params(values), tuple(levels), around=enter)
        region = mode.region(out)
        n = self.packed.num_samples
        if region is None:
            self.output_table = torch.ones((n, out.numel()), dtype=torch.bool, device=out.device)
        else:
            self.output_table = region.full_table(out.shape)
        return out

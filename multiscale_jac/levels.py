"""Level packing for heads shared across pyramid levels: :func:`map_levels`.

Detection heads apply one conv tower to every FPN level (``[head(x) for x in levels]``).
:func:`map_levels` instead lays the levels side by side on one **canvas** with zero gutters
between them, runs the module once, and cuts the per-level outputs back out. A
``TorchFunctionMode`` (:class:`CanvasMode`) keeps this exact: after every op it re-zeroes
everything outside the level boxes, maps the boxes through the op (a stride-2 conv halves them;
the canvas offsets are multiples of the total stride so they stay aligned), checks that no window
reaches from one level into another, fills gutters with ``-inf`` for max pooling, divides average
pools per level, and normalises (GroupNorm/InstanceNorm) with statistics per level. An op it has
no rule for, or a gutter that turns out too narrow, makes it fall back to the per-level loop,
recorded on the returned :class:`LevelOutputs`. ``docs/padded.md`` measures it against padding
every level to the largest and stacking them.
"""

from __future__ import annotations

import contextvars
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack

from ._checks import check_bool
from ._ops import (
    BINARY,
    SAVES_OUTPUT_INPLACE,
    SINGULAR,
    UNARY,
    RuleMode,
    avg_divisor,
    bind_op,
    data_operands,
    ntuple,
    numeric_padding,
    op_name,
    pool_args,
    require_more_than_one,
    with_input,
)
from .enums import FallbackWarning, UnsupportedOpError
from .masked import MaskedMode

__all__ = ["AUTO_PACKING", "CanvasMode", "LevelOutputs", "canvas_layout", "map_levels"]

Box = tuple[int, int, int, int]  # (y, x, h, w) on the canvas

#: set to a reason by a caller whose result depends on every level's own call (K-FAC counts
#: each call's positions, and a canvas adds the gutters' and the call counts differ): while
#: set, :func:`map_levels` runs the per-level loop (recorded as the reason, never warned)
_LOOP_ONLY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "multiscale_jac_map_levels_loop_only", default=None
)


class LevelOutputs(list):
    """The per-level outputs of :func:`map_levels` (a ``list`` of tensors) and how they were made.

    Attributes:
        packing: ``"canvas"`` (one call on a canvas of all levels) or ``"loop"`` (one call per
            level).
        requested: The ``packing`` argument (``"auto"``, ``"canvas"`` or ``"loop"``).
        reason: Why the loop ran when the canvas was requested or chosen (``None`` otherwise).
    """

    def __init__(
        self, outputs: Sequence[Any], packing: str, requested: str, reason: str | None = None
    ) -> None:
        super().__init__(outputs)
        self.packing = packing
        self.requested = requested
        self.reason = reason


#: What ``packing="auto"`` runs, per device type (the canvas elsewhere: see docs/padded.md,
#: "Which packing is the default"; not measured by the current benchmarks).
AUTO_PACKING: dict[str, str] = {"cpu": "loop"}
_AUTO_PACKING_OTHER = "canvas"


def map_levels(
    module: nn.Module | Callable[[Tensor], Tensor],
    levels: Sequence[Tensor],
    *,
    packing: str = "auto",
    gutter: int | None = None,
    strict: bool = False,
) -> LevelOutputs:
    """``[module(x) for x in levels]``, computed in one call on a canvas of all levels.

    Args:
        module: Applied to every level. On the canvas its spatial ops must be 2-d convs,
            max/avg pools or nearest upsampling by an integer factor (any stride, padding,
            dilation, groups), elementwise ops, BatchNorm in eval mode, GroupNorm, InstanceNorm,
            concatenation along channels; anything else makes the canvas fall back to the loop.
        levels: ``L`` tensors ``(B, C, H_l, W_l)`` (same ``B`` and ``C``).
        packing: ``"canvas"`` (one call on all levels), ``"loop"`` (the list comprehension) or
            ``"auto"``: :data:`AUTO_PACKING` by the levels' device type (the loop on CPU, where
            it measured faster; the canvas elsewhere).
        gutter: Zero rows/columns between levels on the canvas; default: the module's largest
            window reach (in input pixels) plus its total stride, enough for every conv/pool
            layer registered in ``module``; too narrow a gutter is detected and falls back.
        strict: Raise :class:`~multiscale_jac.masked.UnsupportedOpError` instead of falling
            back to the loop when the canvas cannot run the module exactly.

    Returns:
        The per-level outputs, equal to ``[module(x) for x in levels]``, as a list that also
        records the packing that ran (:class:`LevelOutputs`). A fallback from an explicitly
        requested canvas to the loop also warns (:class:`~multiscale_jac.FallbackWarning`);
        under ``"auto"`` it is recorded only. Inside padded (masked) execution the loop runs
        (every level already carries its own per-sample mask there).

    Raises:
        ValueError: Unknown ``packing``, an empty list, levels that are not 4-d or that differ
            in batch size or channels, a ``gutter`` that is not a non-negative int.
        TypeError: A ``module`` that is not callable, a ``strict`` that is not a bool.
    """
    levels, strict = _check_arguments(module, levels, packing, gutter, strict)
    chosen = packing
    if packing == "auto":
        chosen = AUTO_PACKING.get(levels[0].device.type, _AUTO_PACKING_OTHER)

    def loop(reason: str | None) -> LevelOutputs:
        return LevelOutputs([module(x) for x in levels], "loop", packing, reason)

    if chosen == "loop":
        return loop(None if packing == "loop" else f"auto on {levels[0].device.type}")
    forced = _LOOP_ONLY.get()
    if forced is not None:
        return loop(forced)
    if len(levels) == 1:
        return loop("one level")
    if any(isinstance(m, MaskedMode) for m in _get_current_function_mode_stack()):
        return loop("inside padded (masked) execution")
    boxes, height, width = canvas_layout(module, [tuple(x.shape[2:]) for x in levels], gutter)
    canvas = _paint(levels, boxes, height, width)
    mode = CanvasMode(module)
    try:
        with mode:
            mode.track(canvas, boxes)
            out = module(canvas)
            out_boxes = mode.boxes(out)
        if out_boxes is None or len(out_boxes) != len(levels):
            raise UnsupportedOpError(
                "output",
                None,
                "the module's output is not a spatial map with one box per level",
                context=mode.context,
            )
    except UnsupportedOpError as err:
        if strict:
            raise
        if packing == "canvas":
            warnings.warn(
                f"map_levels fell back from the canvas to the per-level loop: {err}",
                FallbackWarning,
                stacklevel=2,
            )
        return loop(str(err))
    return LevelOutputs(_cut(out, out_boxes), "canvas", packing)


def _check_arguments(
    module: Any, levels: Sequence[Tensor], packing: str, gutter: int | None, strict: bool
) -> tuple[list[Tensor], bool]:
    """:func:`map_levels`'s arguments checked: the levels as a list and ``strict``."""
    if not callable(module):
        raise TypeError(f"module must be callable; got {type(module).__name__}")
    strict = check_bool(strict, "strict")
    if packing not in ("auto", "canvas", "loop"):
        raise ValueError(f"unknown packing {packing!r}; expected 'auto', 'canvas' or 'loop'")
    if gutter is not None and (
        not isinstance(gutter, int) or isinstance(gutter, bool) or gutter < 0
    ):
        raise ValueError(f"gutter must be a non-negative int; got {gutter!r}")
    levels = list(levels)
    if not levels:
        raise ValueError("map_levels got an empty list of levels")
    for k, x in enumerate(levels):
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"level {k} must be a (B, C, H, W) tensor; got {shape}")
        if x.shape[:2] != levels[0].shape[:2]:
            raise ValueError(
                f"level {k} has batch/channels {tuple(x.shape[:2])} but level 0 has "
                f"{tuple(levels[0].shape[:2])}; all levels must share B and C"
            )
    return levels, strict


def canvas_layout(
    module: Any, sizes: Sequence[tuple[int, int]], gutter: int | None = None
) -> tuple[list[Box], int, int]:
    """Where :func:`map_levels` puts levels of ``sizes`` on its canvas for ``module``:
    ``(boxes (y, x, h, w) per level, canvas height, canvas width)``."""
    stride, reach = _geometry(module)
    g = gutter if gutter is not None else reach + stride  # reach is in input pixels already
    return _shelf(list(sizes), g, stride)


def _geometry(module: Any) -> tuple[int, int]:
    """Total stride and the largest window reach (in input pixels) of the module's convs and
    pools, in registration order: what the canvas offsets and gutters must accommodate."""
    stride, reach = 1, 0
    mods = module.modules() if isinstance(module, nn.Module) else []
    for m in mods:
        if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            k = ntuple(m.kernel_size, 2)
            d = ntuple(getattr(m, "dilation", 1), 2)
            p = m.padding if isinstance(m.padding, str) else ntuple(m.padding, 2)
            s = ntuple(m.stride if m.stride is not None else k, 2)
            if isinstance(p, str):
                p = tuple(dd * (kk - 1) // 2 for dd, kk in zip(d, k))
            r = max(max(pp, dd * (kk - 1) - pp + ss - 1) for pp, dd, kk, ss in zip(p, d, k, s))
            reach = max(reach, r * stride)
            stride *= max(s)
    return stride, reach


def _shelf(sizes: list[tuple[int, int]], gutter: int, stride: int) -> tuple[list[Box], int, int]:
    """Shelf layout: the largest level at the top left, the others stacked in columns to its
    right; offsets rounded up to multiples of ``stride``."""

    def up(v: int) -> int:
        return -(-v // stride) * stride

    order = sorted(range(len(sizes)), key=lambda k: -sizes[k][0] * sizes[k][1])
    boxes: list[Box] = [(0, 0, 0, 0)] * len(sizes)
    h0, w0 = sizes[order[0]]
    boxes[order[0]] = (0, 0, h0, w0)
    col_x = up(w0 + gutter)
    y, col_w, height = 0, 0, h0
    for k in order[1:]:
        h, w = sizes[k]
        if y > 0 and y + h > max(height, h0):
            col_x = up(col_x + col_w + gutter)
            y, col_w = 0, 0
        boxes[k] = (y, col_x, h, w)
        height = max(height, y + h)
        col_w = max(col_w, w)
        y = up(y + h + gutter)
    width = col_x + col_w
    return boxes, up(height), up(width)


def _flat_index(boxes: Sequence[Box], width: int, device: torch.device) -> Tensor:
    """Canvas positions (row-major, ``y * width + x``) of every box's pixels, box after box."""
    parts = [
        (
            torch.arange(y, y + h, device=device)[:, None] * width
            + torch.arange(x, x + w, device=device)
        ).reshape(-1)
        for y, x, h, w in boxes
    ]
    return torch.cat(parts)


def _paint(levels: list[Tensor], boxes: list[Box], height: int, width: int) -> Tensor:
    """The canvas ``(B, C, height, width)``: zeros with every level pasted at its box."""
    # one out-of-place index_copy: differentiable, vmap-friendly, and its backward is one gather
    flat = torch.cat([x.flatten(2) for x in levels], dim=-1)
    canvas = flat.new_zeros(*flat.shape[:-1], height * width)
    canvas = canvas.index_copy(-1, _flat_index(boxes, width, flat.device), flat)
    return canvas.unflatten(-1, (height, width))


def _cut(out: Tensor, boxes: Sequence[Box]) -> list[Tensor]:
    """The per-level maps ``(B, C', h, w)`` cut out of a canvas ``(B, C', H, W)`` (one gather)."""
    flat = out.flatten(-2).index_select(-1, _flat_index(boxes, out.shape[-1], out.device))
    pieces = flat.split([h * w for _, _, h, w in boxes], dim=-1)
    return [p.unflatten(-1, (h, w)) for p, (_, _, h, w) in zip(pieces, boxes)]


# ---------------------------------------------------------------------- the canvas mode
class CanvasMode(RuleMode):
    """Track level boxes on canvas tensors and re-zero outside them after every op."""

    context = "map_levels canvas"
    no_rule = "no canvas rule for this op"
    root = "<module>"

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self._boxes: dict[int, tuple[Any, list[Box]]] = {}
        self._masks: dict[Any, Tensor] = {}

    def region(self, t: Any) -> list[Box] | None:
        """The level boxes of ``t`` (``None`` if it is not a tracked canvas)."""
        entry = self._boxes.get(id(t)) if isinstance(t, Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    boxes = region

    def track(self, t: Tensor, boxes: list[Box]) -> Tensor:
        self._boxes[id(t)] = (t, boxes)
        return t

    def mask(self, boxes: list[Box], like: Tensor) -> Tensor:
        """``(H, W)`` bool for a canvas ``like``, true inside the boxes (cached per layout)."""
        key = (tuple(boxes), tuple(like.shape[-2:]), str(like.device))
        m = self._masks.get(key)
        if m is None:
            m = torch.zeros(like.shape[-2:], dtype=torch.bool, device=like.device)
            for y, x, h, w in boxes:
                m[y : y + h, x : x + w] = True
            self._masks[key] = m
        return m

    def rezero(self, out: Tensor, boxes: list[Box]) -> Tensor:
        return self.track(torch.where(self.mask(boxes, out), out, 0), boxes)


def _common_boxes(mode: CanvasMode, func: Any, operands: Sequence[Tensor]) -> list[Box]:
    found = None
    for t in operands:
        b = mode.boxes(t)
        if b is None:
            if t.dim() >= 2 and t.numel() > 1 and t.shape[-1] > 1 and t.shape[-2] > 1:
                raise mode.unsupported(func, "an unpacked spatial tensor combined with the canvas")
            continue
        if found is None:
            found = b
        elif found != b:
            raise mode.unsupported(func, "inputs with different level boxes")
    return found  # type: ignore[return-value]


@CanvasMode.rule(*UNARY, *BINARY, *SINGULAR, F.batch_norm)
def _elementwise(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Any:
    operands = data_operands(func, args, kwargs)
    boxes = _common_boxes(mode, func, operands)
    if func is F.batch_norm and bind_op("batch_norm", args, kwargs)["training"]:
        raise mode.unsupported(
            func, "BatchNorm with batch statistics (they would mix levels and gutters)"
        )
    if func in SAVES_OUTPUT_INPLACE:
        raise mode.unsupported(func, "an in-place op whose backward reads its output")
    args = mode.singular_safe(func, args)  # keep gutters away from 0 where the op is singular
    out = func(*args, **kwargs)
    if not isinstance(out, Tensor):
        return out
    return mode.settle(func, args, kwargs, operands, out, boxes)


def _window(
    mode: CanvasMode,
    func: Any,
    boxes: list[Box],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> list[Box]:
    """Output boxes of a sliding window, after checking alignment and gutters."""
    out = []
    for y, x, h, w in boxes:
        if y % stride[0] or x % stride[1]:
            raise mode.unsupported(
                func, f"a level box at ({y}, {x}) not aligned to stride {tuple(stride)}"
            )
        sizes = []
        for size, k, s, p, d in zip((h, w), kernel, stride, padding, dilation):
            span = size + 2 * p - d * (k - 1) - 1
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= size + p:
                o -= 1
            if o < 1:
                raise ValueError(
                    f"{op_name(func)}: a level of size {(h, w)} is too small for kernel {tuple(kernel)}"
                )
            sizes.append(o)
        out.append((y // stride[0], x // stride[1], sizes[0], sizes[1]))
    # every window of a level must stay inside the level or the zero gutter
    for i, ((y, x, _, _), (_, _, oh, ow)) in enumerate(zip(boxes, out)):
        r0 = y - padding[0]
        r1 = y + (oh - 1) * stride[0] - padding[0] + dilation[0] * (kernel[0] - 1)
        c0 = x - padding[1]
        c1 = x + (ow - 1) * stride[1] - padding[1] + dilation[1] * (kernel[1] - 1)
        for j, (yy, xx, hh, ww) in enumerate(boxes):
            if i != j and r0 < yy + hh and yy <= r1 and c0 < xx + ww and xx <= c1:
                raise mode.unsupported(
                    func,
                    f"the gutter between levels {i} and {j} is narrower than the window's reach",
                )
    return out


@CanvasMode.rule(torch.conv2d)
def _conv(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("conv", args, kwargs)
    x, w = b["input"], b["weight"]
    if mode.boxes(w) is not None:
        raise mode.unsupported(func, "a canvas as conv weight")
    kernel = tuple(w.shape[2:])
    stride, dilation = ntuple(b["stride"], 2), ntuple(b["dilation"], 2)
    padding = numeric_padding(b["padding"], dilation, kernel)
    if padding is None:
        raise mode.unsupported(func, "padding='same' with an even kernel")
    boxes = _window(mode, func, mode.boxes(x), kernel, stride, padding, dilation, False)
    return mode.rezero(func(*args, **kwargs), boxes)


@CanvasMode.rule(F.max_pool2d, torch.max_pool2d)
def _max_pool(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("max_pool", args, kwargs)
    if b["return_indices"]:
        raise mode.unsupported(func, "return_indices=True")
    x = b["input"]
    kernel, stride, padding = pool_args(b, 2)
    dilation = ntuple(b["dilation"], 2)
    boxes = _window(mode, func, mode.boxes(x), kernel, stride, padding, dilation, b["ceil_mode"])
    new_args, new_kwargs = with_input(args, kwargs, mode.fill(x, mode.boxes(x), -math.inf))
    return mode.rezero(func(*new_args, **new_kwargs), boxes)


@CanvasMode.rule(F.avg_pool2d)
def _avg_pool(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("avg_pool", args, kwargs)
    x = b["input"]
    kernel, stride, padding = pool_args(b, 2)
    in_boxes = mode.boxes(x)
    boxes = _window(mode, func, in_boxes, kernel, stride, padding, (1, 1), b["ceil_mode"])
    sums = F.avg_pool2d(x, kernel, stride, padding, b["ceil_mode"], True, 1)
    if b["divisor_override"]:
        return mode.rezero(sums / b["divisor_override"], boxes)
    # PyTorch's divisor for every level's own size, pasted at the level's output box
    sizes = torch.tensor([[h, w] for _, _, h, w in in_boxes], device=x.device)
    extent = (max(oh for _, _, oh, _ in boxes), max(ow for _, _, _, ow in boxes))
    table = avg_divisor(sizes, extent, b, x.dtype)
    divisor = torch.ones(sums.shape[-2:], dtype=x.dtype, device=x.device)
    for level, (oy, ox, oh, ow) in enumerate(boxes):
        divisor[oy : oy + oh, ox : ox + ow] = table[level, :oh, :ow]
    return mode.rezero(sums / divisor, boxes)


@CanvasMode.rule(F.interpolate)
def _interpolate(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("interpolate", args, kwargs)
    if (
        b["mode"] not in ("nearest", "nearest-exact")
        or b["size"] is not None
        or b["scale_factor"] is None
    ):
        raise mode.unsupported(func, "only nearest upsampling by an integer scale_factor")
    sy, sx = (int(s) for s in ntuple(b["scale_factor"], 2))
    if any(float(s) != int(s) for s in ntuple(b["scale_factor"], 2)):
        raise mode.unsupported(func, "a non-integer scale_factor")
    boxes = [(y * sy, x * sx, h * sy, w * sx) for y, x, h, w in mode.boxes(b["input"])]
    return mode.rezero(func(*args, **kwargs), boxes)


@CanvasMode.rule(torch.cat)
def _cat(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("cat", args, kwargs)
    if b["dim"] % 4 != 1:
        raise mode.unsupported(func, "concatenation other than along channels")
    boxes = _common_boxes(mode, func, list(b["tensors"]))
    return mode.rezero(func(*args, **kwargs), boxes)


def _per_level_normalise(
    mode: CanvasMode, x: Tensor, groups: int, eps: float, weight: Tensor | None, bias: Tensor | None
) -> Tensor:
    """Normalise every level box separately: gather the boxes' pixels, native ``group_norm``
    (with the affine) on each level's pixels, scatter back onto a zero canvas (gutters stay 0)."""
    boxes = mode.boxes(x)
    height, width = x.shape[-2:]
    index = _flat_index(boxes, width, x.device)
    flat = x.flatten(-2).index_select(-1, index)
    pieces = flat.split([h * w for _, _, h, w in boxes], dim=-1)
    # native group_norm per level (measured faster on CPU than segment sums over all levels)
    normed = torch.cat([F.group_norm(p, groups, weight, bias, eps) for p in pieces], dim=-1)
    canvas = normed.new_zeros(*normed.shape[:-1], height * width).index_copy(-1, index, normed)
    return mode.track(canvas.unflatten(-1, (height, width)), boxes)


@CanvasMode.rule(F.group_norm)
def _group_norm(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("group_norm", args, kwargs)
    x = b["input"]
    return _per_level_normalise(mode, x, b["num_groups"], b["eps"], b["weight"], b["bias"])


@CanvasMode.rule(F.instance_norm)
def _instance_norm(mode: CanvasMode, func: Any, args: tuple, kwargs: dict) -> Tensor:
    b = bind_op("instance_norm", args, kwargs)
    x = b["input"]
    if not b["use_input_stats"]:
        return _elementwise(mode, func, args, kwargs)
    if b["running_mean"] is not None:
        raise mode.unsupported(func, "InstanceNorm updating running statistics")
    pixels = torch.tensor([h * w for _, _, h, w in mode.boxes(x)])
    require_more_than_one(pixels, func, mode.context, "level")
    return _per_level_normalise(mode, x, x.shape[1], b["eps"], b["weight"], b["bias"])

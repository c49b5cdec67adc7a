"""Packing lists of differently-shaped feature maps into one :class:`PackedBatch`.

Shape conventions (used throughout the library):

* N samples, L levels per sample. Sample ``i`` at level ``l`` is a tensor ``(C_l, *spatial)``
  with 0 to 3 spatial dims (``S_l`` of them). ``C_l`` and ``S_l`` agree across samples at a
  level; the spatial sizes may differ per sample and per level.
* A sample's *shape signature* is the tuple over levels of its spatial sizes,
  e.g. ``((24, 24), (14, 14))``. Samples with equal signatures form a *bucket*.
* Level ``l`` of a :class:`PackedBatch` is one zero-padded tensor ``(N, C_l, *max_spatial_l)``;
  sample ``i`` is valid in the top-left corner ``[:sizes[l][i, 0], :sizes[l][i, 1], ...]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .enums import InputKind, Layout, parse_enum

__all__ = ["Bucket", "PackedBatch", "Signature", "pack"]

#: Spatial sizes of one sample at every level, e.g. ``((24, 24), (14, 14))``.
Signature = tuple[tuple[int, ...], ...]

_MAX_SPATIAL_DIMS = 3


class Bucket(NamedTuple):
    """Samples with identical shape signatures: ``signature`` and their ``indices`` (ascending)."""

    signature: Signature
    indices: list[int]


class PackedBatch:
    """A batch of multi-level samples, padded per level, with exact ``unpack``.

    Build it with :func:`pack`. Attributes:

    * ``levels``: tuple of L tensors ``(N, C_l, *max_spatial_l)``, zero outside each sample's
      valid region.
    * ``sizes``: tuple of L int64 tensors ``(N, S_l)``, valid spatial sizes (top-left anchored),
      on the same device as ``levels``.
    * ``signatures``: tuple of N shape signatures (see module docstring).
    * ``kind``: the :class:`~multiscale_jac.enums.InputKind` the user passed; ``unpack`` and the
      model adapter restore that structure.
    * ``layout``: ``"padded"`` or ``"nested"`` (the latter also builds :attr:`nested` eagerly).
    """

    def __init__(
        self,
        levels: Sequence[Tensor],
        signatures: Sequence[Signature],
        kind: InputKind,
        layout: Layout = Layout.PADDED,
    ) -> None:
        self.levels: tuple[Tensor, ...] = tuple(levels)
        self.signatures: tuple[Signature, ...] = tuple(signatures)
        self.kind = InputKind(kind)
        self.layout = Layout(layout)
        device = self.levels[0].device
        self.sizes: tuple[Tensor, ...] = tuple(
            torch.tensor(
                [sig[lvl] for sig in self.signatures], dtype=torch.int64, device=device
            ).reshape(len(self.signatures), t.dim() - 2)
            for lvl, t in enumerate(self.levels)
        )
        self._masks: tuple[Tensor, ...] | None = None
        self._nested: tuple[Tensor, ...] | None = None
        if self.layout is Layout.NESTED:
            self._nested = self._build_nested()

    # ------------------------------------------------------------------ basic facts
    @property
    def num_samples(self) -> int:
        """N, the number of samples."""
        return len(self.signatures)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_levels(self) -> int:
        """L, the number of levels per sample."""
        return len(self.levels)

    @property
    def channels(self) -> tuple[int, ...]:
        """``C_l`` for every level."""
        return tuple(int(t.shape[1]) for t in self.levels)

    @property
    def spatial_dims(self) -> tuple[int, ...]:
        """``S_l``, the number of spatial dims of every level."""
        return tuple(t.dim() - 2 for t in self.levels)

    @property
    def dtype(self) -> torch.dtype:
        return self.levels[0].dtype

    @property
    def device(self) -> torch.device:
        return self.levels[0].device

    @property
    def is_uniform(self) -> bool:
        """True when all samples share one shape signature (no padding anywhere)."""
        return len(set(self.signatures)) == 1

    @property
    def padding_waste(self) -> float:
        """Fraction of the padded positions (summed over levels) that are padding."""
        total = sum(t[:, 0].numel() for t in self.levels)
        valid = sum(math.prod(s) for sig in self.signatures for s in sig)
        return 1.0 - valid / total if total else 0.0

    @property
    def largest_sample(self) -> int:
        """The index of the sample with the most elements, summed over levels (its working set
        bounds the others')."""
        sizes = [
            sum(c * math.prod(s) for c, s in zip(self.channels, sig)) for sig in self.signatures
        ]
        return max(range(len(sizes)), key=sizes.__getitem__)

    @property
    def masks(self) -> tuple[Tensor, ...]:
        """Boolean valid-region masks, one ``(N, *max_spatial_l)`` tensor per level."""
        if self._masks is None:
            self._masks = tuple(
                _mask_from_sizes(sizes, t.shape[2:]) for sizes, t in zip(self.sizes, self.levels)
            )
        return self._masks

    def buckets(self) -> list[Bucket]:
        """Groups of sample indices with identical shape signatures, in order of first occurrence."""
        groups: dict[Signature, list[int]] = {}
        for i, sig in enumerate(self.signatures):
            groups.setdefault(sig, []).append(i)
        return [Bucket(sig, idx) for sig, idx in groups.items()]

    # ------------------------------------------------------------------ access
    def sample(self, i: int) -> list[Tensor]:
        """The levels of sample ``i``, each ``(C_l, *spatial)`` (views, no padding)."""
        if not isinstance(i, int) or not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample index {i!r} out of range for {self.num_samples} samples")
        i %= self.num_samples
        return [_crop(t[i], s) for t, s in zip(self.levels, self.signatures[i])]

    def stack(self, indices: Sequence[int]) -> list[Tensor]:
        """Stack samples that share one signature: L tensors ``(len(indices), C_l, *spatial_l)``.

        Raises:
            ValueError: the samples do not share one shape signature.
        """
        indices = list(indices)
        sigs = {self.signatures[i] for i in indices}
        if len(sigs) != 1:
            raise ValueError(
                f"stack needs samples with one shape signature; samples {indices} have {sorted(sigs)}"
            )
        (sig,) = sigs
        if indices == list(range(self.num_samples)):
            return [_crop_batched(t, s) for t, s in zip(self.levels, sig)]
        idx = torch.tensor(indices, device=self.device)
        return [_crop_batched(t.index_select(0, idx), s) for t, s in zip(self.levels, sig)]

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """The samples ``indices`` (in that order) as a batch of the same kind and layout,
        padded only to the selection's own largest sizes.

        Raises:
            ValueError: an empty selection or an index out of range.
        """
        indices = [int(i) for i in indices]
        if not indices:
            raise ValueError("select needs at least one sample index")
        bad = [i for i in indices if not 0 <= i < self.num_samples]
        if bad:
            raise ValueError(f"sample index {bad[0]} out of range for {self.num_samples} samples")
        sigs = [self.signatures[i] for i in indices]
        idx = torch.tensor(indices, device=self.device)
        levels = [
            _crop_batched(
                t.index_select(0, idx), [max(s[lvl][d] for s in sigs) for d in range(t.dim() - 2)]
            )
            for lvl, t in enumerate(self.levels)
        ]
        return PackedBatch(levels, sigs, self.kind, self.layout)

    def unpack(self) -> Any:
        """Return the input exactly as it was passed to :func:`pack`.

        A single tensor for ``kind="tensor"``, a list of L batched tensors for ``"levels"``, and
        a list of N lists of L tensors ``(C_l, *spatial)`` (views into the padded storage) for
        ``"samples"``.
        """
        if self.kind is InputKind.TENSOR:
            return self.levels[0]
        if self.kind is InputKind.LEVELS:
            return list(self.levels)
        return [self.sample(i) for i in range(self.num_samples)]

    @property
    def nested(self) -> tuple[Tensor, ...]:
        """Each level as a ``torch.nested`` jagged tensor of tokens ``(N, j, C_l)``.

        The spatial positions of a sample are flattened (row-major) into ``j`` tokens, so a
        sample ``(C, H, W)`` becomes ``(H * W, C)``. ``torch.nested`` holds one ragged dim only,
        which is why the spatial dims are flattened; convolutions and ``torch.func`` transforms
        do not run on nested tensors in torch 2.13 (see ``docs/packing.md``).
        """
        if self._nested is None:
            self._nested = self._build_nested()
        return self._nested

    def _build_nested(self) -> tuple[Tensor, ...]:
        out = []
        for lvl in range(self.num_levels):
            tokens = [
                self.sample(i)[lvl].reshape(self.channels[lvl], -1).transpose(0, 1)
                for i in range(self.num_samples)
            ]
            out.append(torch.nested.nested_tensor(tokens, layout=torch.jagged))
        return tuple(out)

    def to(self, *args: Any, **kwargs: Any) -> PackedBatch:
        """Move/cast every level like ``Tensor.to``; returns a new :class:`PackedBatch`.

        Raises:
            TypeError: the target dtype is not floating point.
        """
        levels = [t.to(*args, **kwargs) for t in self.levels]
        if not levels[0].is_floating_point():
            raise TypeError(
                f"PackedBatch.to: feature maps must stay floating point, got {levels[0].dtype}"
            )
        if all(a is b for a, b in zip(levels, self.levels)):
            return self
        return PackedBatch(levels, self.signatures, self.kind, self.layout)

    def __repr__(self) -> str:
        lv = ", ".join(
            f"(C={c}, max={tuple(t.shape[2:])})" for c, t in zip(self.channels, self.levels)
        )
        return (
            f"PackedBatch(N={self.num_samples}, kind={self.kind.value!r}, levels=[{lv}], "
            f"buckets={len(self.buckets())}, dtype={self.dtype}, device={self.device}, "
            f"layout={self.layout.value!r})"
        )


# ---------------------------------------------------------------------- pack
def pack(samples: Any, *, layout: str | Layout = "padded") -> PackedBatch:
    """Pack a batch of multi-level samples.

    Args:
        samples: One of

            * a list of N samples, each a list (or tuple) of L tensors ``(C_l, *spatial)`` with
              0 to 3 spatial dims; spatial sizes may differ per sample and per level, ``C_l`` and
              the rank must agree across samples at a level;
            * a list of L batched tensors ``(N, C_l, *spatial_l)`` (uniform per level);
            * a single tensor ``(N, C, *spatial)`` (one level);
            * a :class:`PackedBatch` (returned as is, re-laid-out if ``layout`` differs).
        layout: ``"padded"`` or ``"nested"`` (also builds :attr:`PackedBatch.nested`).

    Returns:
        The :class:`PackedBatch`; ``unpack()`` gives back ``samples`` exactly.

    Raises:
        TypeError: a non-tensor, a non-floating dtype, or mixed dtypes.
        ValueError: empty lists, mismatched level counts, channels or ranks, or devices.
    """
    layout = parse_enum(Layout, layout, "layout")
    if isinstance(samples, PackedBatch):
        if samples.layout is layout:
            return samples
        return PackedBatch(samples.levels, samples.signatures, samples.kind, layout)
    if isinstance(samples, Tensor):
        _check_batched(samples, "the input tensor")
        levels, kind = [samples], InputKind.TENSOR
        sigs = [(tuple(samples.shape[2:]),)] * samples.shape[0]
        _check_common([samples], lambda j: "the input tensor")
        return PackedBatch(levels, sigs, kind, layout)
    if not isinstance(samples, (list, tuple)):
        raise TypeError(
            "pack expects a list of samples (each a list of tensors), a list of batched "
            f"tensors or one batched tensor; got {type(samples).__name__}"
        )
    if len(samples) == 0:
        raise ValueError("pack got an empty list of samples; it needs at least one sample")
    if all(isinstance(s, Tensor) for s in samples):
        return _pack_levels(list(samples), layout)
    bad = [i for i, s in enumerate(samples) if not isinstance(s, (list, tuple))]
    if bad:
        i = bad[0]
        first_list = next((j for j, s in enumerate(samples) if isinstance(s, (list, tuple))), None)
        also = "" if first_list is None else f" but samples[{first_list}] is a list"
        raise TypeError(
            f"samples[{i}] is a {type(samples[i]).__name__}{also}; pack expects either every "
            "element to be a batched tensor (one per level) or every element to be a list of "
            "tensors (one sample)"
        )
    return _pack_samples([list(s) for s in samples], layout)


def _pack_levels(levels: list[Tensor], layout: Layout) -> PackedBatch:
    for lvl, t in enumerate(levels):
        _check_batched(t, f"level {lvl}")
    n = levels[0].shape[0]
    for lvl, t in enumerate(levels):
        if t.shape[0] != n:
            raise ValueError(
                f"level {lvl} has batch size {t.shape[0]} but level 0 has {n}; every level of "
                "a list of batched tensors must hold the same N samples"
            )
    _check_common(levels, lambda j: f"level {j}")
    sig = tuple(tuple(t.shape[2:]) for t in levels)
    return PackedBatch(levels, [sig] * n, InputKind.LEVELS, layout)


def _pack_samples(samples: list[list[Any]], layout: Layout) -> PackedBatch:
    num_levels = len(samples[0])
    for i, s in enumerate(samples):
        if len(s) == 0:
            raise ValueError(f"sample {i} is an empty list of levels; each sample needs >= 1 level")
        if len(s) != num_levels:
            raise ValueError(
                f"sample {i} has {len(s)} levels but sample 0 has {num_levels}; all samples "
                "need the same number of levels"
            )
        for lvl, t in enumerate(s):
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"sample {i}, level {lvl} is a {type(t).__name__}, not a torch.Tensor"
                )
    flat = [t for s in samples for t in s]
    _check_common(flat, lambda j: f"sample {j // num_levels}, level {j % num_levels}")
    levels = []
    for lvl in range(num_levels):
        ref = samples[0][lvl]
        if not 1 <= ref.dim() <= _MAX_SPATIAL_DIMS + 1:
            raise ValueError(
                f"sample 0, level {lvl} has shape {tuple(ref.shape)}; a level must be "
                f"(C, *spatial) with 0 to {_MAX_SPATIAL_DIMS} spatial dims"
            )
        for i, s in enumerate(samples):
            t = s[lvl]
            if t.dim() != ref.dim():
                raise ValueError(
                    f"sample {i}, level {lvl} has rank {t.dim()} (shape {tuple(t.shape)}) but "
                    f"sample 0 has rank {ref.dim()} (shape {tuple(ref.shape)}) at that level"
                )
            if t.shape[0] != ref.shape[0]:
                raise ValueError(
                    f"sample {i}, level {lvl} has {t.shape[0]} channels (shape "
                    f"{tuple(t.shape)}) but sample 0 has {ref.shape[0]} (shape "
                    f"{tuple(ref.shape)}); channels must agree across samples at a level"
                )
            _check_nonempty(t, f"sample {i}, level {lvl}")
        max_sp = [max(int(s[lvl].shape[d]) for s in samples) for d in range(1, ref.dim())]
        shapes = {tuple(s[lvl].shape) for s in samples}
        if len(shapes) == 1:
            padded = torch.stack([s[lvl] for s in samples])
        else:
            padded = ref.new_zeros((len(samples), ref.shape[0], *max_sp))
            for i, s in enumerate(samples):
                _crop(padded[i], tuple(s[lvl].shape[1:])).copy_(s[lvl])
        levels.append(padded)
    sigs = [tuple(tuple(t.shape[1:]) for t in s) for s in samples]
    return PackedBatch(levels, sigs, InputKind.SAMPLES, layout)


# ---------------------------------------------------------------------- helpers
def _check_batched(t: Tensor, what: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if not 2 <= t.dim() <= _MAX_SPATIAL_DIMS + 2:
        raise ValueError(
            f"{what} has shape {tuple(t.shape)}; a batched level must be (N, C, *spatial) with "
            f"0 to {_MAX_SPATIAL_DIMS} spatial dims"
        )
    if t.shape[0] == 0:
        raise ValueError(f"{what} has shape {tuple(t.shape)}: zero samples")
    _check_nonempty(t[0], what)


def _check_nonempty(t: Tensor, what: str) -> None:
    if any(d == 0 for d in t.shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)} with an empty dimension")


def _check_common(tensors: Sequence[Tensor], name: Any) -> None:
    """All tensors floating point, with one dtype and one device."""
    ref = tensors[0]
    for j, t in enumerate(tensors):
        if not t.is_floating_point():
            raise TypeError(
                f"{name(j)} has dtype {t.dtype}; feature maps must be floating point "
                "(convert images with .float())"
            )
        if t.dtype != ref.dtype:
            raise TypeError(f"{name(j)} has dtype {t.dtype} but {name(0)} has {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name(j)} is on {t.device} but {name(0)} is on {ref.device}")


def _crop(t: Tensor, size: Sequence[int]) -> Tensor:
    """``t[:, :size[0], :size[1], ...]`` for a per-sample tensor ``(C, *spatial)``."""
    return t[(slice(None), *(slice(0, s) for s in size))]


def _crop_batched(t: Tensor, size: Sequence[int]) -> Tensor:
    """``t[:, :, :size[0], ...]`` for a batched tensor ``(N, C, *spatial)``."""
    return t[(slice(None), slice(None), *(slice(0, s) for s in size))]


def _mask_from_sizes(sizes: Tensor, max_spatial: Sequence[int]) -> Tensor:
    """Boolean ``(N, *max_spatial)`` mask that is True inside each sample's valid region."""
    n = sizes.shape[0]
    mask = torch.ones((n, *max_spatial), dtype=torch.bool, device=sizes.device)
    for d, m in enumerate(max_spatial):
        ar = torch.arange(m, device=sizes.device)
        inside = ar.unsqueeze(0) < sizes[:, d : d + 1]  # (N, m)
        shape = [n] + [1] * len(max_spatial)
        shape[1 + d] = m
        mask = mask & inside.reshape(shape)
    return mask

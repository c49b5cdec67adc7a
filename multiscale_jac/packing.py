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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .enums import InputKind, Layout, parse_enum

__all__ = ["Bucket", "PackedBatch", "Signature", "Structure", "ambiguous", "pack", "readings"]

#: Spatial sizes of one sample at every level, e.g. ``((24, 24), (14, 14))``.
Signature = tuple[tuple[int, ...], ...]

_MAX_SPATIAL_DIMS = 3


class Bucket(NamedTuple):
    """Samples with identical shape signatures (one entry of :meth:`PackedBatch.buckets`).

    Attributes:
        signature: The shape signature the samples share: the spatial sizes of every level,
            e.g. ``((24, 24), (14, 14))``.
        indices: The positions of those samples in the batch, ascending.
    """

    signature: Signature
    indices: list[int]


@dataclass(frozen=True)
class Structure:
    """How the model takes one sample: a tensor (``kind`` ``tensor`` or ``tensors``), or a list
    of levels (``levels``, ``samples``) or, when ``keys`` is set, a mapping of levels of type
    ``container`` with those keys (a ``dict`` or ``OrderedDict`` of feature maps)."""

    kind: InputKind
    keys: tuple[Any, ...] | None = None
    container: type | None = None

    def arrange(self, levels: Sequence[Tensor]) -> Any:
        """The model's argument from one tensor per level."""
        if self.kind in (InputKind.TENSOR, InputKind.TENSORS):
            return levels[0]
        if self.keys is None:
            return list(levels)
        return (self.container or dict)(zip(self.keys, levels))


class PackedBatch:
    """A batch of multi-level samples, padded per level, with exact ``unpack``.

    Build it with :func:`pack`. Attributes:

    * ``levels``: tuple of L tensors ``(N, C_l, *max_spatial_l)``, zero outside each sample's
      valid region.
    * ``sizes``: tuple of L int64 tensors ``(N, S_l)``, valid spatial sizes (top-left anchored),
      on the same device as ``levels``.
    * ``signatures``: tuple of N shape signatures (see module docstring).
    * ``kind``: the :class:`~multiscale_jac.enums.InputKind` the user passed and ``structure``
      (:class:`Structure`: also the keys of a mapping); ``unpack`` and the model adapter restore
      that structure.
    * ``layout``: ``"padded"`` or ``"nested"`` (the latter also builds :attr:`nested` eagerly).

    Levels may hold integer data (token ids, class maps): it is carried as is, never
    differentiated.
    """

    def __init__(
        self,
        levels: Sequence[Tensor],
        signatures: Sequence[Signature],
        kind: InputKind | Structure,
        layout: Layout = Layout.PADDED,
    ) -> None:
        self.levels: tuple[Tensor, ...] = tuple(levels)
        self.signatures: tuple[Signature, ...] = tuple(signatures)
        self.structure = kind if isinstance(kind, Structure) else Structure(InputKind(kind))
        self.kind = self.structure.kind
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
        """The dtype of the floating-point levels (of the first level if none is)."""
        return next((t.dtype for t in self.levels if t.is_floating_point()), self.levels[0].dtype)

    @property
    def device(self) -> torch.device:
        """The device of the levels (all levels and ``sizes`` are on it)."""
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
        return PackedBatch(levels, sigs, self.structure, self.layout)

    def unpack(self) -> Any:
        """Return the input exactly as it was passed to :func:`pack`.

        A single tensor for ``kind="tensor"``, a list of N tensors ``(C, *spatial)`` for
        ``"tensors"``, L batched tensors for ``"levels"`` and N samples of L tensors
        ``(C_l, *spatial)`` for ``"samples"`` (views into the padded storage), levels in a list
        or in a mapping of the type and keys that were passed.
        """
        if self.kind is InputKind.TENSOR:
            return self.levels[0]
        if self.kind is InputKind.LEVELS:
            return self.structure.arrange(self.levels)
        return [self.structure.arrange(self.sample(i)) for i in range(self.num_samples)]

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
        """Move every level like ``Tensor.to``; a dtype applies to the floating-point levels
        only (integer data stays integer). Returns a new :class:`PackedBatch`.

        Raises:
            TypeError: the target dtype is not floating point.
        """
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"PackedBatch.to: feature maps must stay floating point, got {dtype}")
        levels = [
            t.to(
                device=device,
                dtype=dtype if t.is_floating_point() else None,
                non_blocking=non_blocking,
            )
            for t in self.levels
        ]
        if all(a is b for a, b in zip(levels, self.levels)):
            return self
        return PackedBatch(levels, self.signatures, self.structure, self.layout)

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
def pack(
    samples: Any,
    *,
    layout: str | Layout = "padded",
    input_kind: str | InputKind | None = None,
) -> PackedBatch:
    """Pack a batch of multi-level samples.

    Args:
        samples: One of

            * a single tensor ``(N, C, *spatial)`` (one level);
            * a list of N tensors ``(C, *spatial)``, one per sample, spatial sizes free (a ragged
              batch of single images; the model gets each as one tensor ``(1, C, *spatial)``);
            * a list (or a ``dict``/``OrderedDict``) of L batched tensors
              ``(N, C_l, *spatial_l)``, one per level;
            * a list of N samples, each a list (or tuple, or mapping with the same keys) of L
              tensors ``(C_l, *spatial)`` with 0 to 3 spatial dims; spatial sizes may differ per
              sample and per level, ``C_l``, the rank and the dtype must agree across samples at
              a level;
            * a :class:`PackedBatch` (returned as is, re-laid-out if ``layout`` differs).

            Levels may be integer (token ids, class maps): carried as data, never
            differentiated. A model that takes mappings gets the same mapping type with the
            same keys.
        layout: ``"padded"`` or ``"nested"`` (also builds :attr:`PackedBatch.nested`).
        input_kind: How to read ``samples`` (:class:`~multiscale_jac.InputKind`); needed only
            for a list of rank-2 or rank-3 tensors with one leading size, which reads both as
            N samples (``"tensors"``) and as L levels (``"levels"``); the error shows both.
            (The entry points that get a model try both readings on one sample and take the
            one the model runs.)

    Returns:
        The :class:`PackedBatch`; ``unpack()`` gives back ``samples`` exactly.

    Raises:
        TypeError: a non-tensor, a complex dtype, or dtypes that differ across samples.
        ValueError: empty lists, mismatched level counts, keys, channels or ranks, devices, an
            ambiguous list of tensors, or an ``input_kind`` that does not fit.
    """
    layout = parse_enum(Layout, layout, "layout")
    kind = None if input_kind is None else parse_enum(InputKind, input_kind, "input_kind")
    if isinstance(samples, PackedBatch):
        _expect(kind, (samples.kind,), "this PackedBatch")
        if samples.layout is layout:
            return samples
        return PackedBatch(samples.levels, samples.signatures, samples.structure, layout)
    if isinstance(samples, Tensor):
        _expect(kind, (InputKind.TENSOR,), "one batched tensor")
        return _pack_levels([samples], Structure(InputKind.TENSOR), layout)
    if isinstance(samples, Mapping):
        _expect(kind, (InputKind.LEVELS,), "a mapping of batched levels")
        keys, values = _mapping_items(samples, "the inputs")
        return _pack_levels(values, Structure(InputKind.LEVELS, keys, type(samples)), layout)
    if not isinstance(samples, (list, tuple)):
        raise TypeError(
            "pack expects one batched tensor, a list of per-sample tensors, a list or dict of "
            "batched levels, or a list of samples (each a list or dict of levels); got "
            f"{type(samples).__name__}"
        )
    if len(samples) == 0:
        raise ValueError("pack got an empty list of samples; it needs at least one sample")
    if all(isinstance(s, Tensor) for s in samples):
        return _pack_tensor_list(list(samples), kind, layout)
    _expect(kind, (InputKind.SAMPLES,), "a list of samples (each a list or dict of levels)")
    if all(isinstance(s, Mapping) for s in samples):
        keys = _mapping_items(samples[0], "samples[0]")[0]
        rows = []
        for i, s in enumerate(samples):
            got, values = _mapping_items(s, f"samples[{i}]")
            if got != keys:
                raise ValueError(
                    f"samples[{i}] has the keys {list(got)} but samples[0] {list(keys)}"
                )
            rows.append(values)
        structure = Structure(InputKind.SAMPLES, keys, type(samples[0]))
        return _pack_samples(rows, structure, layout, explicit=kind is not None)
    bad = [i for i, s in enumerate(samples) if not isinstance(s, (list, tuple))]
    if bad:
        i = bad[0]
        first_list = next((j for j, s in enumerate(samples) if isinstance(s, (list, tuple))), None)
        also = "" if first_list is None else f" but samples[{first_list}] is a list"
        raise TypeError(
            f"samples[{i}] is a {type(samples[i]).__name__}{also}; pack expects either every "
            "element to be a tensor (one per sample or one per level) or every element to be a "
            "list or dict of tensors (one sample)"
        )
    rows = [list(s) for s in samples]
    return _pack_samples(rows, Structure(InputKind.SAMPLES), layout, explicit=kind is not None)


def _pack_tensor_list(tensors: list[Tensor], kind: InputKind | None, layout: Layout) -> PackedBatch:
    """A list of tensors: per-sample tensors or batched levels (see :func:`_read`)."""
    kind = kind or _read(tensors)
    if kind is InputKind.LEVELS:
        return _pack_levels(tensors, Structure(InputKind.LEVELS), layout)
    if kind in (InputKind.TENSORS, InputKind.SAMPLES):
        return _pack_samples([[s] for s in tensors], Structure(kind), layout, explicit=True)
    raise ValueError(
        f"input_kind={kind.value!r} does not fit a list of tensors; pass 'tensors' (one tensor "
        "per sample) or 'levels' (one batched tensor per level)"
    )


def readings(tensors: Sequence[Tensor]) -> tuple[InputKind, ...]:
    """How a list of tensors can read: ``levels`` where only that reading exists (ranks that
    differ; rank 4 or 5: batched 2-d or 3-d maps), ``tensors`` (one per sample) for rank 1,
    both for rank 2 or 3 with one leading size.

    Raises:
        ValueError: leading sizes that differ (neither reading exists).
    """
    ranks = {t.dim() for t in tensors}
    if len(ranks) > 1 or min(ranks) >= 4:
        return (InputKind.LEVELS,)
    if ranks == {1}:
        return (InputKind.TENSORS,)
    if len({t.shape[0] for t in tensors}) > 1:
        raise ValueError(
            f"pack got a list of tensors of shapes {_shapes(tensors)} whose leading sizes "
            "differ: as samples (one tensor (C, *spatial) each) their channels would differ, "
            "as levels (one batched tensor (N, C_l, *spatial) each) their batch sizes"
        )
    return (InputKind.TENSORS, InputKind.LEVELS)


def ambiguous(tensors: Sequence[Tensor], why: str = "") -> ValueError:
    """The refusal of a list of tensors that reads two ways, showing both (``why``: what a
    probe of the model found)."""
    n, first = len(tensors), tensors[0]
    return ValueError(
        f"pack got a list of {n} tensors of shapes {_shapes(tensors)}, which reads two ways: as "
        f"{n} samples of one tensor each (input_kind='tensors'; the model gets each as "
        f"{(1, *first.shape)}), or as {n} levels of one batch of {first.shape[0]} samples "
        f"(input_kind='levels'; the model gets a list of {n} tensors like "
        f"{(1, *first.shape[1:])}){why}. Pass input_kind='tensors' or 'levels' (a list of "
        "samples, each a list of levels, needs no choice)"
    )


def _read(tensors: list[Tensor]) -> InputKind:
    found = readings(tensors)
    if len(found) > 1:
        raise ambiguous(tensors)
    return found[0]


def _shapes(tensors: Sequence[Tensor]) -> str:
    more = f" (and {len(tensors) - 3} more)" if len(tensors) > 3 else ""
    return " and ".join(str(tuple(t.shape)) for t in tensors[:3]) + more


def _expect(kind: InputKind | None, fits: tuple[InputKind, ...], what: str) -> None:
    if kind is not None and kind not in fits:
        choices = " or ".join(repr(k.value) for k in fits)
        raise ValueError(f"input_kind={kind.value!r} does not fit {what} (it reads as {choices})")


def _mapping_items(mapping: Mapping, what: str) -> tuple[tuple[Any, ...], list[Any]]:
    if not mapping:
        raise ValueError(f"{what} is an empty mapping; it needs at least one level")
    return tuple(mapping.keys()), list(mapping.values())


def _pack_levels(levels: list[Tensor], structure: Structure, layout: Layout) -> PackedBatch:
    what = "the input tensor" if structure.kind is InputKind.TENSOR else None
    names = [what or _level_name(structure, lvl) for lvl in range(len(levels))]
    for name, t in zip(names, levels):
        _check_batched(t, name)
    n = levels[0].shape[0]
    for name, t in zip(names, levels):
        if t.shape[0] != n:
            raise ValueError(
                f"{name} has batch size {t.shape[0]} but {names[0]} has {n}; every level of "
                "a list of batched tensors must hold the same N samples"
            )
    _check_common(levels, names.__getitem__, one_dtype=False)
    sig = tuple(tuple(t.shape[2:]) for t in levels)
    return PackedBatch(levels, [sig] * n, structure, layout)


def _level_name(structure: Structure, lvl: int) -> str:
    return f"level {lvl}" if structure.keys is None else f"level {structure.keys[lvl]!r}"


def _pack_samples(
    samples: list[list[Any]], structure: Structure, layout: Layout, *, explicit: bool
) -> PackedBatch:
    """``samples``: N lists of L per-sample tensors ``(C_l, *spatial)``. ``explicit``: the
    reading was the user's, so a level that looks batched (a leading 1 on a 4-d map) is taken
    as given."""
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
    levels = [_pack_level(samples, lvl, explicit) for lvl in range(num_levels)]
    sigs = [tuple(tuple(t.shape[1:]) for t in s) for s in samples]
    return PackedBatch(levels, sigs, structure, layout)


def _pack_level(samples: list[list[Tensor]], lvl: int, explicit: bool) -> Tensor:
    """Level ``lvl`` of every sample, zero-padded to one ``(N, C, *max_spatial)`` tensor."""
    column = [s[lvl] for s in samples]
    _check_common(column, lambda i: f"sample {i}, level {lvl}")
    ref = column[0]
    if not 1 <= ref.dim() <= _MAX_SPATIAL_DIMS + 1:
        raise ValueError(
            f"sample 0, level {lvl} has shape {tuple(ref.shape)}; a level must be "
            f"(C, *spatial) with 0 to {_MAX_SPATIAL_DIMS} spatial dims"
        )
    if not explicit and ref.dim() == 4 and all(t.dim() == 4 and t.shape[0] == 1 for t in column):
        raise ValueError(
            f"sample 0, level {lvl} has shape {tuple(ref.shape)}, like a batch of one: a "
            "sample's level is (C, *spatial) without a batch dim. Drop it with .squeeze(0), or "
            "pass input_kind='samples' if these are one-channel 3-d volumes"
        )
    for i, t in enumerate(column):
        if t.dim() != ref.dim():
            raise ValueError(
                f"sample {i}, level {lvl} has rank {t.dim()} (shape {tuple(t.shape)}) but "
                f"sample 0 has rank {ref.dim()} (shape {tuple(ref.shape)}) at that level"
            )
        if t.shape[0] != ref.shape[0]:
            hint = (
                "; a sequence per sample (token ids, T positions) is passed as (1, T): one "
                "channel, T positions"
                if ref.dim() == 1
                else ""
            )
            raise ValueError(
                f"sample {i}, level {lvl} has {t.shape[0]} channels (shape "
                f"{tuple(t.shape)}) but sample 0 has {ref.shape[0]} (shape "
                f"{tuple(ref.shape)}); channels must agree across samples at a level{hint}"
            )
        _check_nonempty(t, f"sample {i}, level {lvl}")
    if len({tuple(t.shape) for t in column}) == 1:
        return torch.stack(column)
    max_sp = [max(int(t.shape[d]) for t in column) for d in range(1, ref.dim())]
    padded = ref.new_zeros((len(column), ref.shape[0], *max_sp))
    for i, t in enumerate(column):
        _crop(padded[i], tuple(t.shape[1:])).copy_(t)
    return padded


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


def _check_common(tensors: Sequence[Tensor], name: Any, *, one_dtype: bool = True) -> None:
    """No complex data, one device, and (``one_dtype``: the samples of one level) one dtype,
    floating point or integer data such as token ids."""
    ref = tensors[0]
    for j, t in enumerate(tensors):
        if t.is_complex():
            raise TypeError(f"{name(j)} has dtype {t.dtype}; complex inputs are not supported")
        if one_dtype and t.dtype != ref.dtype:
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

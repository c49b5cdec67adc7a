"""Property-based checks users run on their own models.

Two halves:

* **Strategies** (Hypothesis; ``pip install "multiscale_jac[testing]"``) that draw what a data
  loader produces: :func:`pyramids` (FPN-style multi-level samples), :func:`images` (single-level
  batches), :func:`token_batches` (the token layout) and :func:`param_subsets` (whole tensors,
  single entries in arbitrary order, mixtures). They are built from small integers and lists, and
  the tensor values come from a drawn seed, so a failing example shrinks to the smallest
  pyramid, not to odd floats.
* **Checkers** (no Hypothesis needed): :func:`assert_jacobian_matches` / :func:`check_model`
  run every requested route of :func:`~multiscale_jac.per_sample_jacobian` and compare it with
  the loop reference (:func:`multiscale_jac.reference.per_sample_jacobian_loop`) in float64;
  :func:`assert_fisher_matches` and :func:`assert_laplace_matches` do the same for
  :func:`~multiscale_jac.diag_fisher` and :class:`~multiscale_jac.SubnetLaplace` against dense
  computations from the loop reference's Jacobians.

The page "Testing your model" (``docs/testing.md``) has a worked example.
"""

from __future__ import annotations

import bisect
import copy
import functools
import itertools
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._folds import CONV_BODIES, CONV_FOLDS, VECTOR_BODIES, VECTOR_FOLDS, FoldingNet, folding_inputs
from .engine import per_sample_jacobian
from .enums import FallbackWarning, Likelihood, parse_enum
from .fisher import diag_fisher
from .laplace import SubnetLaplace
from .packing import PackedBatch, pack
from .reference import per_sample_jacobian_loop
from .subset import ParamSubset

__all__ = [
    # strategies (need Hypothesis)
    "pyramids",
    "images",
    "token_batches",
    "param_subsets",
    "folding_models",
    "FoldingCase",
    # checkers
    "assert_jacobian_matches",
    "check_model",
    "assert_fisher_matches",
    "assert_laplace_matches",
    "check_routes",
    "assert_routes_match",
    "CheckReport",
    "RouteReport",
]

_EXTRA = 'pip install "multiscale_jac[testing]"'
_SEED_MAX = 2**32 - 1
_SUBSET_KINDS = ("tensors", "entries", "indices", "flat", "mixed")


# ====================================================================== strategies
def _strategies() -> Any:
    """``hypothesis.strategies``, or an ImportError that names the extra."""
    try:
        from hypothesis import strategies
    except ImportError as err:
        raise ImportError(
            f"the strategies of multiscale_jac.testing need Hypothesis: {_EXTRA} "
            "(the checkers, assert_jacobian_matches and friends, work without it)"
        ) from err
    return strategies


@dataclass(frozen=True)
class _Shapes:
    """A checked description of what a strategy draws."""

    channels: tuple[int, ...]
    strides: tuple[int, ...]
    dims: tuple[int, ...]
    min_size: int
    max_size: int
    batch: tuple[int, int]
    ragged: bool
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return max(self.dims, default=0)

    def level_size(self, finest: tuple[int, ...], level: int, ceil: bool) -> tuple[int, ...]:
        """Level ``level``'s spatial size from the finest level's: ``finest * s_min / s_l``,
        rounded down or up, never below 1."""
        s_min, s = min(self.strides), self.strides[level]
        out = []
        for h in finest[: self.dims[level]]:
            num = h * s_min
            out.append(max(1, -(-num // s) if ceil else num // s))
        return tuple(out)


def _positive_int(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be at least {low}; got {value!r}")
    return value


def _int_range(value: Any, name: str) -> tuple[int, int]:
    """``n`` -> ``(n, n)``; ``(lo, hi)`` checked."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = _positive_int(value, name)
        return n, n
    if isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = (_positive_int(v, name) for v in value)
        if lo > hi:
            raise ValueError(f"{name} must be (min, max) with min <= max; got {value!r}")
        return lo, hi
    raise TypeError(f"{name} must be an int or a (min, max) pair; got {value!r}")


def _per_level(value: Any, name: str, levels: int | None, low: int) -> tuple[int, ...] | int:
    """An int (kept) or a sequence of ints (checked; its length must be ``levels`` if set)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive_int(value, name, low)
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise TypeError(f"{name} must be an int or a non-empty sequence of ints; got {value!r}")
    out = tuple(_positive_int(v, name, low) for v in value)
    if levels is not None and len(out) != levels:
        raise ValueError(f"{name} has {len(out)} entries but there are {levels} levels")
    return out


def _shapes(
    channels: Any,
    strides: Any,
    spatial_dims: Any,
    min_size: Any,
    max_size: Any,
    batch_size: Any,
    ragged: Any,
    dtype: Any,
) -> _Shapes:
    """Check a strategy's arguments (errors name the argument)."""
    lengths = {len(v) for v in (channels, strides, spatial_dims) if isinstance(v, Sequence)}
    if len(lengths) > 1:
        raise ValueError(
            f"channels, strides and spatial_dims give different level counts: {sorted(lengths)}"
        )
    levels = lengths.pop() if lengths else 1 if strides is not None else 3
    if strides is None:  # FPN strides 1, 2, 4, ... relative to the finest level
        strides = tuple(2**k for k in range(levels))
    per = [
        _per_level(channels, "channels", levels, 1),
        _per_level(strides, "strides", levels, 1),
        _per_level(spatial_dims, "spatial_dims", levels, 0),
    ]
    ch, st, dims = (p if isinstance(p, tuple) else (p,) * levels for p in per)
    if any(d > 3 for d in dims):
        raise ValueError(f"spatial_dims must be 0 to 3; got {spatial_dims!r}")
    lo, hi = _positive_int(min_size, "min_size"), _positive_int(max_size, "max_size")
    if lo > hi:
        raise ValueError(f"min_size ({lo}) must not exceed max_size ({hi})")
    if not isinstance(ragged, bool):
        raise TypeError(f"ragged must be True or False; got {ragged!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype; got {dtype!r}")
    return _Shapes(ch, st, dims, lo, hi, _int_range(batch_size, "batch_size"), ragged, dtype)


def _draw_layout(draw: Any, st: Any, spec: _Shapes) -> tuple[list[list[tuple[int, ...]]], int]:
    """Every sample's spatial sizes per level, and a seed for the values.

    Order of the draws (what shrinking minimises first): the batch size, a pool of finest-level
    sizes (one unless ragged) and which pool entry each sample takes (0: all alike), the
    rounding of every level (False: floor), the seed.
    """
    n = draw(st.integers(*spec.batch), label="batch size")
    pool_size = draw(st.integers(1, n)) if spec.ragged else 1
    finest = st.tuples(*(st.integers(spec.min_size, spec.max_size) for _ in range(spec.rank)))
    pool = draw(st.lists(finest, min_size=pool_size, max_size=pool_size), label="finest sizes")
    which = [0] * n
    if pool_size > 1:
        which = draw(st.lists(st.integers(0, pool_size - 1), min_size=n, max_size=n))
    nlev = len(spec.channels)
    ceil = draw(st.lists(st.booleans(), min_size=nlev, max_size=nlev), label="ceil per level")
    seed = draw(st.integers(0, _SEED_MAX), label="seed")
    sizes = [[spec.level_size(pool[w], lvl, ceil[lvl]) for lvl in range(nlev)] for w in which]
    return sizes, seed


def _samples(st: Any, spec: _Shapes, finish: Callable[[list[list[Tensor]]], Any]) -> Any:
    """A strategy: every sample's levels ``(C_l, *spatial)`` (standard normal values from the
    drawn seed), handed to ``finish`` for the form the caller gives them."""

    @st.composite
    def draw_samples(draw: Any) -> Any:
        sizes, seed = _draw_layout(draw, st, spec)
        g = torch.Generator().manual_seed(seed)
        return finish(
            [
                [
                    torch.randn(c, *s, generator=g, dtype=spec.dtype)
                    for c, s in zip(spec.channels, sig)
                ]
                for sig in sizes
            ]
        )

    return draw_samples()


def _stacked(samples: list[list[Tensor]]) -> list[Tensor]:
    """Samples of one shape as batched levels ``(N, C_l, *spatial)``."""
    return [torch.stack(level) for level in zip(*samples)]


def _keys(as_mapping: Any, levels: int) -> tuple[str, ...] | None:
    if as_mapping is False:
        return None
    if as_mapping is True:
        return tuple(f"p{k}" for k in range(levels))
    if isinstance(as_mapping, Sequence) and not isinstance(as_mapping, str):
        keys = tuple(as_mapping)
        if len(keys) != levels or len(set(keys)) != levels:
            raise ValueError(f"as_mapping needs {levels} distinct keys, one per level; got {keys}")
        return keys
    raise TypeError(f"as_mapping must be True, False or a sequence of keys; got {as_mapping!r}")


def pyramids(
    *,
    channels: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    min_size: int = 1,
    max_size: int = 8,
    batch_size: int | tuple[int, int] = (1, 4),
    ragged: bool = True,
    as_mapping: bool | Sequence[str] = False,
    spatial_dims: int | Sequence[int] = 2,
    dtype: torch.dtype = torch.float64,
) -> Any:
    """A Hypothesis strategy for batches of multi-level samples (FPN levels, multi-scale crops).

    The level count L is the length of ``channels``, ``strides`` or ``spatial_dims`` (whichever
    are sequences; they must agree), else 3. The finest level (the smallest stride) has its
    spatial sizes drawn in ``[min_size, max_size]``, each dim on its own; level ``l`` is that
    size times ``min(strides) / strides[l]``, rounded down or up (drawn once per level and
    batch, as a backbone's pooling or padded strided conv does), never below 1. Odd sizes and
    one-pixel maps occur; shrinking goes to one sample, size ``min_size`` and floor rounding.

    Args:
        channels: ``C_l``: one int for every level, or one per level.
        strides: Each level's stride (positive ints), or one int for every level; default
            ``1, 2, 4, ...`` (one per level).
        min_size: Smallest height/width of the finest level.
        max_size: Largest height/width of the finest level.
        batch_size: Samples per batch: an int or an inclusive ``(min, max)`` range.
        ragged: ``True``: a list of N samples, each a list of L tensors ``(C_l, H_l, W_l)``,
            sizes drawn per sample (samples may share sizes, so shape buckets hold several).
            ``False``: one size for the whole batch, given as L batched tensors
            ``(N, C_l, H_l, W_l)``, the other form a data loader produces.
        as_mapping: ``True``: every list of levels becomes an ``OrderedDict`` with keys
            ``"p0"``, ``"p1"``, ...; a sequence of L strings: those keys.
        spatial_dims: Spatial dims per level, 0 to 3 (0: a feature vector ``(C_l,)``); an int
            for every level or one per level (a level of rank r takes the finest level's first
            r sizes). One-channel 3-d levels ``(1, D, H, W)`` read as a batch of one: pass
            ``input_kind="samples"`` with them (see :func:`~multiscale_jac.pack`).
        dtype: A floating dtype for the values (standard normal, from a drawn seed).

    Returns:
        A strategy whose examples :func:`~multiscale_jac.pack` accepts.

    Raises:
        ImportError: Hypothesis is not installed (``pip install "multiscale_jac[testing]"``).
        TypeError, ValueError: bad arguments (the message names the argument).
    """
    st = _strategies()
    spec = _shapes(channels, strides, spatial_dims, min_size, max_size, batch_size, ragged, dtype)
    keys = _keys(as_mapping, len(spec.channels))

    def arrange(levels: list[Tensor]) -> Any:
        return levels if keys is None else OrderedDict(zip(keys, levels))

    if spec.ragged:
        return _samples(st, spec, lambda samples: [arrange(s) for s in samples])
    return _samples(st, spec, lambda samples: arrange(_stacked(samples)))


def images(
    *,
    channels: int,
    min_size: int = 1,
    max_size: int = 8,
    batch_size: int | tuple[int, int] = (1, 4),
    ragged: bool = True,
    spatial_dims: int = 2,
    dtype: torch.dtype = torch.float64,
) -> Any:
    """A Hypothesis strategy for single-level batches (a segmentation net's images).

    Sizes are drawn as for :func:`pyramids` with one level (each spatial dim in
    ``[min_size, max_size]``).

    Args:
        channels: ``C``.
        min_size: Smallest size of a spatial dim.
        max_size: Largest size of a spatial dim.
        batch_size: An int or an inclusive ``(min, max)`` range.
        ragged: ``True``: a list of N tensors ``(C, *spatial)`` with sizes drawn per sample (the
            model gets each as ``(1, C, *spatial)``); ``False``: one tensor ``(N, C, *spatial)``.
        spatial_dims: 0 to 3.
        dtype: A floating dtype for the values.

    Raises:
        ImportError: Hypothesis is not installed (``pip install "multiscale_jac[testing]"``).
    """
    st = _strategies()
    dims = _positive_int(spatial_dims, "spatial_dims", 0)
    spec = _shapes(
        _positive_int(channels, "channels"), 1, dims, min_size, max_size, batch_size, ragged, dtype
    )
    if spec.ragged:
        return _samples(st, spec, lambda samples: [s[0] for s in samples])
    return _samples(st, spec, lambda samples: _stacked(samples)[0])


def token_batches(
    *,
    channels: int,
    min_tokens: int = 1,
    max_tokens: int = 8,
    batch_size: int | tuple[int, int] = (1, 4),
    ragged: bool = True,
    spatial_dims: int = 1,
    as_list: bool = True,
    dtype: torch.dtype = torch.float64,
) -> Any:
    """A Hypothesis strategy for token batches: a :class:`~multiscale_jac.PackedBatch` with
    ``layout="nested"``, so the model gets every sample as tokens ``(1, T, C)``.

    Args:
        channels: ``C``, the features per token.
        min_tokens: Smallest sequence length (per side of the grid with ``spatial_dims=2``).
        max_tokens: Largest sequence length (per side).
        batch_size: An int or an inclusive ``(min, max)`` range.
        ragged: Lengths drawn per sample (``False``: one length for the batch).
        spatial_dims: 1: sequences of ``T`` tokens; 2: ``H x W`` grids flattened row-major to
            ``T = H * W`` tokens.
        as_list: ``True``: the model gets a list of one tensor ``[(1, T, C)]`` (samples of one
            level, as ``tests/cases.py``'s transformer takes them); ``False``: the tensor
            ``(1, T, C)`` itself.
        dtype: A floating dtype for the values.

    Raises:
        ImportError: Hypothesis is not installed (``pip install "multiscale_jac[testing]"``).
    """
    st = _strategies()
    if spatial_dims not in (1, 2):
        raise ValueError(f"spatial_dims must be 1 or 2 for tokens; got {spatial_dims!r}")
    if not isinstance(as_list, bool):
        raise TypeError(f"as_list must be True or False; got {as_list!r}")
    spec = _shapes(channels, 1, spatial_dims, min_tokens, max_tokens, batch_size, ragged, dtype)

    def finish(samples: list[list[Tensor]]) -> PackedBatch:
        if as_list:
            return pack(samples, layout="nested")
        return pack([s[0] for s in samples], layout="nested", input_kind="tensors")

    return _samples(st, spec, finish)


@dataclass(frozen=True)
class _Pool:
    """The tensors a subset strategy draws from."""

    layout: tuple[tuple[str, torch.Size], ...]  # every parameter of the model
    names: tuple[str, ...]  # the allowed ones
    numel: dict[str, int]
    flat_start: dict[str, int]  # offset in parameters_to_vector
    patterns: tuple[str, ...]  # exact names, then globs (only allowed tensors, not too many)
    wholes: frozenset[str]  # the allowed names small enough to be drawn whole

    def flat(self, k: int) -> int:
        """The k-th allowed flat index, as an index into ``parameters_to_vector``."""
        starts = list(itertools.accumulate((self.numel[n] for n in self.names), initial=0))
        t = bisect.bisect_right(starts, k) - 1
        return self.flat_start[self.names[t]] + k - starts[t]


def _pool(model: nn.Module, params: Any, max_whole: int) -> _Pool:
    everything = ParamSubset.all(model)
    layout = everything.layout
    names = everything.names if params is None else ParamSubset.from_names(model, params).names
    numel = {n: math.prod(s) for n, s in layout}
    starts = dict(zip(numel, itertools.accumulate(numel.values(), initial=0)))
    globs: set[str] = {"*"}
    for n in names:
        parts = n.split(".")
        globs.update(".".join(parts[:k]) + ".*" for k in range(1, len(parts)))
        globs.add("*." + parts[-1])
    allowed = set(names)
    wholes = [n for n in names if numel[n] <= max_whole]
    for g in sorted(globs, key=lambda g: (g.count("*"), len(g), g)):
        hits = ParamSubset.from_names(model, g).names
        if set(hits) <= allowed and sum(numel[n] for n in hits) <= max_whole:
            wholes.append(g)
    return _Pool(layout, names, numel, starts, tuple(wholes), frozenset(wholes) & allowed)


def _draw_entries(draw: Any, st: Any, pool: _Pool, names: list[str], budget: int) -> dict:
    """Unique flat indices (arbitrary order) for every name; at most ``budget`` in all, at
    least one each (``names`` already cut to ``budget``)."""
    chosen: dict[str, Tensor] = {}
    for j, name in enumerate(names):
        room = budget - (len(names) - j - 1) - sum(len(v) for v in chosen.values())
        k = pool.numel[name]
        idx = draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=min(k, room), unique=True))
        chosen[name] = torch.tensor(idx, dtype=torch.int64)
    return chosen


def param_subsets(
    model: nn.Module,
    *,
    params: str | Sequence[str] | None = None,
    kinds: Sequence[str] = ("tensors", "entries", "mixed"),
    max_entries: int = 8,
    max_tensors: int = 3,
    max_whole: int = 4096,
) -> Any:
    """A Hypothesis strategy for :class:`~multiscale_jac.ParamSubset` s of ``model``.

    Kinds (drawn among ``kinds``; shrinking goes to the first):

    * ``"tensors"``: whole tensors by exact name or glob (``"head.*"``, ``"*.bias"``, ``"*"``),
      in the order drawn (:meth:`~multiscale_jac.ParamSubset.from_names`);
    * ``"entries"``: single entries, as ``"indices"`` (per tensor, the tensors and their
      indices in arbitrary order: :meth:`~multiscale_jac.ParamSubset.from_indices`) or ``"flat"``
      (indices into ``parameters_to_vector`` in arbitrary order, interleaving tensors:
      :meth:`~multiscale_jac.ParamSubset.from_flat_indices`); both can be asked for alone;
    * ``"mixed"``: whole tensors and entries of others in one subset.

    The library returns Jacobian columns in the order given, so the order is part of what is
    tested.

    Args:
        model: The model whose parameters are drawn.
        params: Draw only from these tensors (a name, a glob or a list of them); globs are
            drawn only where they match nothing else. Default: every parameter.
        kinds: Among ``"tensors"``, ``"entries"``, ``"indices"``, ``"flat"``, ``"mixed"``.
        max_entries: The most single entries in one subset (whole tensors do not count).
        max_tensors: The most tensors (or patterns) named in one subset.
        max_whole: Tensors (and globs) with more entries than this are never drawn whole, so
            that a real model's large convolutions do not make the Jacobian huge; their
            entries still are. Where nothing is that small, ``"tensors"`` draws entries.

    Raises:
        ImportError: Hypothesis is not installed (``pip install "multiscale_jac[testing]"``).
    """
    st = _strategies()
    kinds = tuple(kinds)
    if not kinds or any(k not in _SUBSET_KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty selection of {_SUBSET_KINDS}; got {kinds!r}")
    max_entries = _positive_int(max_entries, "max_entries")
    max_tensors = _positive_int(max_tensors, "max_tensors")
    pool = _pool(model, params, _positive_int(max_whole, "max_whole"))
    some_names = st.lists(
        st.sampled_from(pool.names), min_size=1, max_size=max_tensors, unique=True
    )

    @st.composite
    def draw_subset(draw: Any) -> ParamSubset:
        kind = draw(st.sampled_from(kinds), label="kind")
        if kind == "tensors" and not pool.patterns:  # every tensor is too large to be whole
            kind = "indices"
        if kind == "entries":
            kind = draw(st.sampled_from(["indices", "flat"]))
        if kind == "tensors":
            pats = st.lists(
                st.sampled_from(pool.patterns), min_size=1, max_size=max_tensors, unique=True
            )
            return ParamSubset.from_names(model, draw(pats))
        if kind == "flat":
            total = sum(pool.numel[n] for n in pool.names)
            ks = draw(
                st.lists(
                    st.integers(0, total - 1),
                    min_size=1,
                    max_size=min(total, max_entries),
                    unique=True,
                )
            )
            return ParamSubset.from_flat_indices(model, [pool.flat(k) for k in ks])
        names = draw(some_names)
        whole = [kind == "mixed" and n in pool.wholes and draw(st.booleans()) for n in names]
        parts = [n for n, w in zip(names, whole) if not w][:max_entries]
        entries = _draw_entries(draw, st, pool, parts, max_entries)
        if kind == "indices":
            return ParamSubset.from_indices(model, entries)
        selection = {
            n: None if w else entries[n] for n, w in zip(names, whole) if w or n in entries
        }
        return ParamSubset(pool.layout, selection)

    return draw_subset()


@dataclass(frozen=True)
class FoldingCase:
    """A drawn model that folds a dimension into its batch, with a batch and its targets.

    Attributes:
        model: A :class:`~multiscale_jac._folds.FoldingNet` in eval mode, float64.
        inputs: The batch (a tensor, or a list of same-size levels).
        targets: Class labels ``(N,)``.
        kind: The fold (``items``, ``items_minor``, ``perm``, ``sort``, ``token``, ``mix``,
            ``plain``, ``frames``, ``frames_minor``, ``levels``, ``stack``, ``tta``).
        body: The layers run on the rows (``linear``, ``linear_ln``, ``conv``, ``conv_gn``,
            ``conv_bn``).
    """

    model: nn.Module
    inputs: Any
    targets: Tensor
    kind: str
    body: str

    def __repr__(self) -> str:
        n = self.targets.shape[0]
        return f"FoldingCase(kind={self.kind!r}, body={self.body!r}, N={n}, model={self.model})"


def folding_models(
    *,
    batch_size: int | tuple[int, int] = (1, 5),
    kinds: Sequence[str] | None = None,
) -> Any:
    """Models that fold a dimension into the batch, with a batch (a Hypothesis strategy).

    Each draw builds a :class:`FoldingCase`: a model whose forward pass turns its batch into
    rows that are not the samples in order (pairs ``(B, 2, d) -> (2B, d)`` sample-major or
    sample-minor, video frames, same-size levels stacked or concatenated along the batch, a
    map and its mirror image, rows permuted by a fixed rule or by their data, a learned token
    put in front of every sample; and, as negative cases, a batch mean subtracted), runs Linear
    (and LayerNorm) or Conv2d (and GroupNorm or an eval-mode BatchNorm) layers on the rows and
    classifies; sizes, widths, the pooling and the values come from drawn integers.

    Args:
        batch_size: ``N``, an int or a ``(min, max)`` range (odd sizes and 1 included).
        kinds: The folds to draw from (default: all).

    Returns:
        A strategy of :class:`FoldingCase`; run :func:`check_routes` on each.
    """
    st = _strategies()
    lo, hi = _int_range(batch_size, "batch_size")
    pool = tuple(kinds) if kinds is not None else VECTOR_FOLDS + CONV_FOLDS
    unknown = [k for k in pool if k not in VECTOR_FOLDS + CONV_FOLDS]
    if unknown or not pool:
        raise ValueError(f"kinds must be among {VECTOR_FOLDS + CONV_FOLDS}; got {kinds!r}")

    @st.composite
    def draw_case(draw: Any) -> FoldingCase:
        kind = draw(st.sampled_from(pool))
        body = draw(st.sampled_from(CONV_BODIES if kind in CONV_FOLDS else VECTOR_BODIES))
        conv = kind in CONV_FOLDS
        features = draw(st.integers(1, 3))
        items = draw(st.integers(1, 3))
        n = draw(st.integers(lo, hi))
        seed = draw(st.integers(0, _SEED_MAX))
        torch.manual_seed(seed)
        model = FoldingNet(
            kind,
            body,
            items=items,
            features=features,
            width=draw(st.integers(2, 4)),
            classes=draw(st.integers(2, 3)),
            pool=draw(st.sampled_from(("mean", "flat"))),
        )
        model = model.to(torch.float64).eval()
        gen = torch.Generator().manual_seed(seed)
        size = draw(st.integers(2, 4)) if conv else 0
        inputs = folding_inputs(model, n, features=features, size=size, generator=gen)
        targets = torch.randint(0, model.head.out_features, (n,), generator=gen)
        return FoldingCase(model, inputs, targets, kind, body)

    return draw_case()


# ====================================================================== reports
@dataclass(frozen=True)
class RouteReport:
    """One checked route (or quantity) and what happened.

    Attributes:
        route: What was run, e.g. ``"strategy='padded', mode='auto'"``.
        status: ``"exact"``, ``"fell back"`` (exact, but another route ran: see ``reason``),
            ``"refused"`` (:func:`check_routes`: the route raised a ``ValueError`` or
            ``TypeError`` saying why it does not run; not a failure), ``"mismatch"`` (see
            ``detail``) or ``"error"`` (the route raised; ``detail`` is the exception).
        ran: What actually ran (strategy and mode, or the method), ``""`` if nothing did.
        reason: The recorded fallback reason (``result.fallback``: it names the op and the module
            path), or ``None``.
        detail: Where the largest mismatch is (sample, output row, parameter and index, values,
            error), or the exception text.
        max_error: The largest absolute difference from the reference, ``None`` on error.
    """

    route: str
    status: str
    ran: str = ""
    reason: str | None = None
    detail: str = ""
    max_error: float | None = None

    def failed(self, strict: bool) -> bool:
        """A mismatch or an error; with ``strict``, a fallback too."""
        return self.status in ("mismatch", "error") or (strict and self.reason is not None)


@dataclass(frozen=True)
class CheckReport:
    """The outcome of a check: one :class:`RouteReport` per route.

    ``str(report)`` is a table (route, what ran, status) with the fallback reasons, mismatch
    locations and errors as numbered notes under it. ``report.ok`` is ``True`` when no route
    failed (with ``strict``, a fallback is a failure).

    Attributes:
        what: The quantity checked and its reference.
        routes: One :class:`RouteReport` per route, in the order run.
        strict: Whether a fallback counts as a failure.
        rtol: Relative tolerance (of the reference's magnitude).
        atol: Absolute tolerance.
    """

    what: str
    routes: tuple[RouteReport, ...]
    strict: bool
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        """No route failed."""
        return not self.failures

    @property
    def failures(self) -> tuple[RouteReport, ...]:
        """The routes that failed."""
        return tuple(r for r in self.routes if r.failed(self.strict))

    def __str__(self) -> str:
        header = ("route", "ran", "status")
        rows, notes = [], {}  # note text -> its number (one number for repeated reasons)
        for r in self.routes:
            status = r.status
            texts = [r.detail or r.reason]
            if r.status == "mismatch" and r.reason:  # a mismatch after a fallback
                texts.append(f"(fell back first) {r.reason}")
            for text in filter(None, texts):
                status += f" [{notes.setdefault(text, len(notes) + 1)}]"
            rows.append((r.route, r.ran, status))
        widths = [max(len(row[c]) for row in [header, *rows]) for c in range(3)]
        lines = [
            f"{self.what} (rtol={self.rtol:g}, atol={self.atol:g}"
            + (", strict" if self.strict else "")
            + f"): {'ok' if self.ok else f'{len(self.failures)} of {len(self.routes)} failed'}",
            *(
                "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
                for row in [header, *rows]
            ),
        ]
        if notes:
            lines.append("")
            lines += [f"[{k}] {t}" for t, k in notes.items()]
        return "\n".join(lines)

    def message(self) -> str:
        """The failures first, one line each, then the whole table."""
        lines = [f"{len(self.failures)} of {len(self.routes)} routes failed: {self.what}"]
        for r in self.failures:
            ran = f" (ran {r.ran})" if r.ran else ""
            if r.status in ("mismatch", "error"):
                lines.append(f"- {r.route}{ran}: {r.status}: {r.detail}")
            else:
                lines.append(f"- {r.route}{ran}: fell back (strict): {r.reason}")
        return "\n".join([*lines, "", str(self)])


# ====================================================================== comparisons
def _float64_model(model: nn.Module) -> nn.Module:
    """``model`` itself when every floating tensor is float64, else a float64 copy."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if all(t.dtype == torch.float64 for t in tensors if t.is_floating_point()):
        return model
    return copy.deepcopy(model).to(torch.float64)


def _float64(x: Any) -> Any:
    """Floating tensors in ``x`` (nested lists, tuples, mappings, a PackedBatch) as float64."""
    if isinstance(x, PackedBatch):
        return x.to(torch.float64) if any(t.is_floating_point() for t in x.levels) else x
    if isinstance(x, Tensor):
        return x.to(torch.float64) if x.is_floating_point() else x
    if isinstance(x, Mapping):
        return type(x)((k, _float64(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_float64(v) for v in x)
    return x


def _value(option: Any) -> Any:
    """An option's plain value (enum members and strings alike)."""
    return getattr(option, "value", option)


def _name(option: Any) -> str:
    return repr(_value(option))


class _Where:
    """Words for a position: a sample and its level shapes, a column's parameter and index."""

    def __init__(self, subset: ParamSubset, inputs: Any = None, input_kind: Any = None) -> None:
        self.subset = subset
        self.shapes: list[list[tuple[int, ...]]] | None = None
        if inputs is not None:
            try:
                packed = pack(inputs, input_kind=input_kind)
            except (TypeError, ValueError):  # a list that reads two ways: no shapes then
                return
            self.shapes = [
                [tuple(t.shape) for t in packed.sample(i)] for i in range(packed.num_samples)
            ]

    def sample(self, i: int) -> str:
        if self.shapes is None or i >= len(self.shapes):
            return f"sample {i}"
        levels = ", ".join(str(s) for s in self.shapes[i])
        return f"sample {i} (level shapes {levels})"

    def column(self, k: int) -> str:
        s = self.subset
        g = k if s.columns is None else int(s.columns[k])
        for name, (a, b) in s.offsets.items():
            if a <= g < b:
                idx = s.indices[name]
                flat = g - a if idx is None else int(idx[g - a])
                shape = tuple(s.shapes[name])
                at = ""
                if len(shape) > 1:  # the index within the tensor's shape, too
                    multi = torch.unravel_index(torch.tensor(flat), shape)
                    at = f" (index {tuple(int(v) for v in multi)})"
                return f"parameter {name!r} entry {flat}{at}, column {k}"
        raise IndexError(k)  # pragma: no cover - offsets cover every column


def _compare(
    got: Tensor, want: Tensor, rtol: float, atol: float, where: Callable[[tuple[int, ...]], str]
) -> tuple[str | None, float]:
    """``(None, max error)`` when ``|got - want| <= atol + rtol |want|`` everywhere, else a
    description of the worst entry (``where`` words its index) and the max error."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, the reference has {tuple(want.shape)}", math.inf
    got, want = got.detach().to(torch.float64).cpu(), want.detach().to(torch.float64).cpu()
    err = (got - want).abs()
    both_nan = got.isnan() & want.isnan()
    err = torch.where(both_nan, torch.zeros_like(err), err)
    excess = torch.nan_to_num(err - (atol + rtol * want.abs()), nan=math.inf)
    max_err = float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0
    bad = excess > 0
    if not bool(bad.any()):
        return None, max_err
    flat = int(torch.argmax(excess.reshape(-1)))
    idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), tuple(err.shape)))
    return (
        f"{where(idx)}: got {got[idx].item():.10g}, reference {want[idx].item():.10g}, "
        f"error {err[idx].item():.3g}; {int(bad.sum())} of {bad.numel()} entries outside "
        "the tolerance"
    ), max_err


def _status(mismatch: str | None, fallback: str | None) -> str:
    return "mismatch" if mismatch else "fell back" if fallback else "exact"


def _attempt(label: str, call: Callable[[], Any]) -> tuple[Any, str | None, RouteReport | None]:
    """Run one route with FallbackWarnings recorded, not shown: ``(result, their messages
    joined or None, None)``, or ``(None, None, an "error" report)`` when the route raised (a
    route that raises fails with its exception text)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FallbackWarning)
            out = call()
    except Exception as err:
        return None, None, RouteReport(label, "error", detail=f"{type(err).__name__}: {err}")
    reasons = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    for w in caught:  # anything else is shown as it would have been
        if not issubclass(w.category, FallbackWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out, "; ".join(reasons) or None, None


def _asserted(report: CheckReport) -> CheckReport:
    """``report``, or an AssertionError with its message when a route failed."""
    if not report.ok:
        raise AssertionError(report.message())
    return report


# ====================================================================== Jacobians
def _jacobian_route(
    label: str, call: Callable[[], Any], ref: Any, where: _Where, tol: tuple[float, float]
) -> RouteReport:
    """Run one route of ``per_sample_jacobian`` (``call``) and compare it with ``ref``."""
    res, _, error = _attempt(label, call)
    if error:
        return error
    ran = f"{res.strategy.value}, {res.mode.value}"
    if res.output_sizes != ref.output_sizes:
        i = next(k for k, (a, b) in enumerate(zip(res.output_sizes, ref.output_sizes)) if a != b)
        detail = (
            f"{where.sample(i)} has {res.output_sizes[i]} output rows, the reference "
            f"{ref.output_sizes[i]}"
        )
        return RouteReport(label, "mismatch", ran, res.fallback, detail, math.inf)

    def at(idx: tuple[int, ...]) -> str:
        i, o, k = idx
        return f"{where.sample(i)}, output row {o} of {ref.output_sizes[i]}, {where.column(k)}"

    detail, max_err = _compare(res.jacobian, ref.jacobian, *tol, at)
    return RouteReport(
        label, _status(detail, res.fallback), ran, res.fallback, detail or "", max_err
    )


def check_model(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | Sequence[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    strategies: Sequence[str] = ("auto", "bucketed", "padded"),
    modes: Sequence[str] = ("auto",),
    entries: Sequence[str] = ("auto",),
    strict: bool = False,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    chunk_size: int | None = None,
    batch_norm: str = "error",
    input_kind: str | None = None,
) -> CheckReport:
    """Run every requested route of :func:`~multiscale_jac.per_sample_jacobian` and compare
    it with the loop reference, in float64; report, do not assert.

    The model and the inputs are used as they are when every floating tensor is float64, else
    a float64 copy of each is made (the model is never changed). Each route is one
    combination of ``strategies x modes x entries``; its fallbacks are recorded, not warned.

    Args:
        model: The model.
        inputs: Anything :func:`~multiscale_jac.pack` accepts, or a ``PackedBatch``.
        params: Which entries (a :class:`~multiscale_jac.ParamSubset`, a name/glob or a list).
        output_fn: As for :func:`~multiscale_jac.per_sample_jacobian`.
        strategies: Strategies to run (``auto``, ``vmap``, ``bucketed``, ``padded``, ``loop``).
        modes: Modes to run (``auto``, ``rev``, ``fwd``).
        entries: Column paths to run (``auto``, ``structured``, ``generic``).
        strict: Count a fallback as a failure in ``report.ok``.
        rtol: Relative tolerance: ``|J - J_ref| <= atol + rtol |J_ref|`` entry by entry.
        atol: Absolute tolerance.
        chunk_size: Passed to every route.
        batch_norm: ``"error"`` or ``"eval"``, for the routes and the reference.
        input_kind: How to read an ambiguous list of tensors (see :func:`~multiscale_jac.pack`).

    Returns:
        A :class:`CheckReport`: per route exact / fell back (with the reason) / mismatch (with
        where) / error; ``str(report)`` is a table, ``report.ok`` a bool.

    Raises:
        Whatever the loop reference raises: a model that does not run on ``inputs``.
    """
    model, inputs = _float64_model(model), _float64(inputs)
    common = dict(params=params, output_fn=output_fn, batch_norm=batch_norm, input_kind=input_kind)
    ref = per_sample_jacobian_loop(model, inputs, **common)
    where = _Where(ref.subset, inputs, input_kind)
    show_entries = any(_value(e) != "auto" for e in entries)
    reports = []
    for s, m, e in itertools.product(strategies, modes, entries):
        label = f"strategy={_name(s)}, mode={_name(m)}"
        label += f", entries={_name(e)}" if show_entries else ""
        route = dict(strategy=s, mode=m, entries=e, chunk_size=chunk_size, **common)
        run = functools.partial(per_sample_jacobian, model, inputs, **route)
        reports.append(_jacobian_route(label, run, ref, where, (rtol, atol)))
    what = "per-sample Jacobian against the float64 loop reference"
    return CheckReport(what, tuple(reports), bool(strict), rtol, atol)


def assert_jacobian_matches(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | Sequence[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    strategies: Sequence[str] = ("auto", "bucketed", "padded"),
    modes: Sequence[str] = ("auto",),
    entries: Sequence[str] = ("auto",),
    strict: bool = False,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    chunk_size: int | None = None,
    batch_norm: str = "error",
    input_kind: str | None = None,
) -> CheckReport:
    """Assert that every requested route of :func:`~multiscale_jac.per_sample_jacobian` equals
    the loop reference in float64 (arguments as for :func:`check_model`).

    A route fails when an entry is off (the message names the route, the sample and its level
    shapes, the output row, the parameter, its index within the tensor and the error), when it
    raises (its exception text), and, with ``strict=True``, when it falls back (the recorded
    reason, naming the op and the module path). Without ``strict``, fallbacks do not fail but
    are listed in the table of any failure's message.

    Returns:
        The :class:`CheckReport` when every route passed.

    Raises:
        AssertionError: a route failed.
    """
    return _asserted(check_model(**locals()))  # every argument, passed on as it came


# ====================================================================== derived quantities
@dataclass(frozen=True)
class _Sample:
    """One sample's dense terms from the loop reference (float64)."""

    jac: Tensor  # (O_i, P)
    out: Tensor  # (O_i,)
    shape: tuple[int, ...] | None  # the output's shape after output_fn (batch dim 1), if a tensor
    target: Tensor  # flat


def _split_targets(targets: Any, n: int) -> list[Tensor]:
    if isinstance(targets, Tensor):
        if targets.dim() == 0 or targets.shape[0] != n:
            raise ValueError(f"targets need a leading batch dim of {n}; got {tuple(targets.shape)}")
        return list(targets)
    items = list(targets)
    if len(items) != n:
        raise ValueError(f"got {len(items)} targets for {n} samples")
    return [torch.as_tensor(t) for t in items]


def _dense_samples(
    model: nn.Module, batches: list, params: Any, output_fn: Any, options: dict
) -> tuple[ParamSubset, list[_Sample]]:
    """The loop reference on every batch, with each sample's output shape (recorded by a
    wrapper around ``output_fn``; the loop calls it once per sample, last)."""
    subset, samples = None, []
    for inputs, targets in batches:
        shapes: list[Any] = []

        def spy(out: Any, shapes: list = shapes) -> Any:
            out = out if output_fn is None else output_fn(out)
            shapes.append(tuple(out.shape) if isinstance(out, Tensor) else None)
            return out

        ref = per_sample_jacobian_loop(model, inputs, params=params, output_fn=spy, **options)
        subset = ref.subset
        n = ref.num_samples
        ys = _split_targets(targets, n)
        for i, (o, shape, y) in enumerate(zip(ref.output_sizes, shapes[-n:], ys)):
            samples.append(_Sample(ref.jacobian[i, :o], ref.outputs[i, :o], shape, y.reshape(-1)))
    if subset is None:
        raise ValueError("data yielded no batches")
    return subset, samples


def _classes(s: _Sample, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """Classification at the kept positions: ``(p (C, k), J (C, k, P), one-hot (C, k))``."""
    if s.shape is None or len(s.shape) < 2:
        raise ValueError("classification needs tensor logits (1, C, *spatial) after output_fn")
    c = s.shape[1]
    logits, jac = s.out.view(c, -1), s.jac.view(c, -1, s.jac.shape[-1])
    keep = s.target != ignore_index
    p = torch.softmax(logits[:, keep], dim=0)
    return p, jac[:, keep], F.one_hot(s.target[keep].long(), c).T.to(p.dtype)


def _gradient(s: _Sample, regression: bool, ignore_index: int) -> Tensor:
    """The per-sample gradient of the negative log-likelihood (at sigma 1), ``J^T dl/df``."""
    if regression:
        return s.jac.T @ (s.out - s.target.to(s.out.dtype))
    p, jac, onehot = _classes(s, ignore_index)
    return torch.einsum("ckp,ck->p", jac, p - onehot)


def _ggn(s: _Sample, regression: bool, ignore_index: int, diagonal: bool = False) -> Tensor:
    """``J^T Lambda J`` ``(P, P)`` at sigma 1, or only its diagonal ``(P,)``."""
    if regression:
        return (s.jac**2).sum(0) if diagonal else s.jac.T @ s.jac
    p, jac, _ = _classes(s, ignore_index)
    pj = torch.einsum("ck,ckp->kp", p, jac)
    if diagonal:
        return torch.einsum("ck,ckp->p", p, jac**2) - (pj**2).sum(0)
    return torch.einsum("ckp,ck,ckq->pq", jac, p, jac) - pj.T @ pj


def _curvature(
    samples: list[_Sample], regression: bool, ignore: int, empirical: bool, diagonal: bool
) -> Tensor:
    """``sum_i g_i g_i^T`` (``empirical``) or ``sum_i J_i^T Lambda_i J_i`` at sigma 1 (or
    the diagonal of either)."""
    if empirical:
        grads = [_gradient(s, regression, ignore) for s in samples]
        return sum(g**2 if diagonal else torch.outer(g, g) for g in grads)
    return sum(_ggn(s, regression, ignore, diagonal) for s in samples)


def _pairs(data: Iterable) -> list[tuple[Any, Any]]:
    """``data`` as a list of float64 ``(inputs, targets)`` (integer targets stay integer)."""
    return [(_float64(inputs), _float64(targets)) for inputs, targets in data]


def _fisher_route(
    model: nn.Module, batches: list, want: Tensor, where: _Where, kw: dict, tol: tuple
) -> RouteReport:
    label = f"kind={_name(kw['kind'])}, method={_name(kw['method'])}"
    res, reason, error = _attempt(label, lambda: diag_fisher(model, batches, progress=False, **kw))
    if error:
        return error
    detail, max_err = _compare(res.flat, want, *tol, lambda idx: where.column(idx[0]))
    return RouteReport(label, _status(detail, reason), res.method, reason, detail or "", max_err)


def assert_fisher_matches(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    *,
    params: ParamSubset | str | Sequence[str] | None = None,
    likelihood: str = "classification",
    kinds: Sequence[str] = ("empirical", "exact"),
    methods: Sequence[str] = ("auto",),
    output_fn: Callable[[Any], Any] | None = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    strict: bool = False,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    batch_norm: str = "error",
    input_kind: str | None = None,
) -> CheckReport:
    """Assert that :func:`~multiscale_jac.diag_fisher` equals a dense reference in float64.

    The reference takes every sample's Jacobian and output from the loop reference (plain
    autograd, one output row at a time): ``kind="empirical"`` is the mean of the squared
    per-sample gradients ``g_i = J_i^T d nll_i / d f_i``; ``kind="exact"`` the mean of
    ``diag(J_i^T Lambda_i J_i)`` (``Lambda = diag(p) - p p^T`` per position not labelled
    ``ignore_index``, or ``I / sigma^2``). Each route is one ``kind x method``; a failure
    names the route, the parameter and its index, the values and the error. ``kind="mc"``
    draws random labels and is not checked here.

    Args:
        model: The model (a float64 copy is used if it is not float64).
        data: An iterable of ``(inputs, targets)`` as for ``diag_fisher`` (it is read into a
            list: the routes and the reference each go through it).
        params: Which entries, as for ``diag_fisher``.
        likelihood: ``classification`` or ``regression``.
        kinds: ``empirical`` and/or ``exact``.
        methods: ``auto``, ``layerwise`` and/or ``vmap``.
        output_fn: As for ``diag_fisher``.
        sigma_noise: As for ``diag_fisher`` (regression).
        ignore_index: As for ``diag_fisher`` (classification).
        strict: A fallback (the call's ``FallbackWarning``, quoted) fails too.
        rtol: Relative tolerance: ``|F - F_ref| <= atol + rtol |F_ref|`` entry by entry.
        atol: Absolute tolerance.
        batch_norm: As for ``diag_fisher``.
        input_kind: As for ``diag_fisher``.

    Returns:
        The :class:`CheckReport` when every route passed.

    Raises:
        AssertionError: a route failed.
    """
    if any(_value(k) == "mc" for k in kinds):
        raise ValueError("kind='mc' draws random labels; check 'empirical' and 'exact'")
    model, batches = _float64_model(model), _pairs(data)
    regression = _value(likelihood) == "regression"
    options = {"batch_norm": batch_norm, "input_kind": input_kind}
    subset, samples = _dense_samples(model, batches, params, output_fn, options)
    scale = 1.0 / float(sigma_noise) ** 2 if regression else 1.0  # dl/df carries 1/sigma^2
    want = {  # the mean over samples; an empirical Fisher squares dl/df, so scale too
        k: _curvature(samples, regression, ignore_index, k == "empirical", True)
        * scale ** (2 if k == "empirical" else 1)
        / len(samples)
        for k in ("empirical", "exact")
    }
    kw = dict(params=subset, likelihood=likelihood, output_fn=output_fn, **options)
    kw.update(sigma_noise=sigma_noise, ignore_index=ignore_index)
    reports = tuple(
        _fisher_route(
            model,
            batches,
            want[_value(k)],
            _Where(subset),
            {**kw, "kind": k, "method": m},
            (rtol, atol),
        )
        for k, m in itertools.product(kinds, methods)
    )
    what = "diag_fisher against per-sample gradients and GGN diagonals from the loop reference"
    return _asserted(CheckReport(what, reports, bool(strict), rtol, atol))


def _compare_samples(
    got: Any, want: list[Tensor], tol: tuple[float, float], where: Callable[[int, tuple], str]
) -> tuple[str | None, float]:
    """Compare per-sample tensors (a stacked tensor or a list; each flattened) with
    ``want``; ``where(i, index within sample i)`` words a position."""
    gots = [torch.as_tensor(got[i]).reshape(-1) for i in range(len(want))]
    if len(got) != len(want) or any(g.numel() != w.numel() for g, w in zip(gots, want)):
        return (
            f"{len(got)} samples of sizes {[g.numel() for g in gots]}, the reference "
            f"{len(want)} of sizes {[w.numel() for w in want]}",
            math.inf,
        )
    starts = list(itertools.accumulate((w.numel() for w in want), initial=0))
    shapes = [w.shape for w in want]

    def at(idx: tuple[int, ...]) -> str:
        i = bisect.bisect_right(starts, idx[0]) - 1
        local = torch.unravel_index(torch.tensor(idx[0] - starts[i]), tuple(shapes[i]))
        return where(i, tuple(int(v) for v in local))

    flat_want = torch.cat([w.reshape(-1) for w in want])
    return _compare(torch.cat(gots), flat_want, *tol, at)


def _laplace_rows(
    la: SubnetLaplace,
    pred: Any,
    h_ref: Tensor,
    cov: Tensor,
    test: list[_Sample],
    where: _Where,
    tol: tuple[float, float],
) -> list[tuple[str, str | None, float]]:
    """``(quantity, mismatch or None, max error)`` for H and the GLM predictive."""

    def entry(idx: tuple[int, ...]) -> str:
        return f"H[{idx[0]}, {idx[1]}]: {where.column(idx[0])} and {where.column(idx[1])}"

    def row(i: int, idx: tuple) -> str:
        return f"{where.sample(i)}, output row {idx[0]}"

    def pair(i: int, idx: tuple) -> str:
        return f"{where.sample(i)}, output rows {idx[0]} and {idx[1]}"

    jsj = [s.jac @ cov @ s.jac.T for s in test]
    rows = [
        ("fit: H = sum_i J_i^T Lambda_i J_i", *_compare(la.H, h_ref, *tol, entry)),
        ("predictive: mean = f(x)", *_compare_samples(pred.mean, [s.out for s in test], tol, row)),
        (
            "predictive: variance = diag(J Sigma J^T)",
            *_compare_samples(pred.variance, [m.diagonal() for m in jsj], tol, row),
        ),
    ]
    if pred.covariance is not None:
        cov_row = _compare_samples(pred.covariance, jsj, tol, pair)
        rows.append(("predictive: covariance = J Sigma J^T", *cov_row))
    return rows


def _laplace_posterior(
    model: nn.Module, batches: list, subset: Any, prior_precision: Any, setting: dict, options: dict
) -> tuple[ParamSubset, Tensor, Tensor]:
    """The subset, ``H`` (``sum_i J_i^T Lambda_i J_i`` or ``sum_i g_i g_i^T``) and
    ``Sigma = (H / sigma^s + diag(prior))^{-1}`` (``s = 4`` for a regression's empirical
    Fisher, else 2), densely from the loop reference."""
    regression = _value(setting["likelihood"]) == "regression"
    empirical = _value(setting["hessian"]) == "empirical"
    sub, samples = _dense_samples(model, batches, subset, setting["output_fn"], options)
    h_ref = _curvature(samples, regression, setting["ignore_index"], empirical, False)
    factor = 1.0 / float(setting["sigma_noise"]) ** (4 if empirical and regression else 2)
    prior = torch.as_tensor(_float64(prior_precision), dtype=torch.float64).expand(sub.numel)
    return sub, h_ref, torch.linalg.inv(h_ref * factor + torch.diag(prior))


def assert_laplace_matches(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    subset: ParamSubset | str | Sequence[str],
    *,
    likelihood: str = "classification",
    inputs: Any = None,
    prior_precision: float | Tensor = 1.0,
    sigma_noise: float = 1.0,
    hessian: str = "ggn",
    output_fn: Callable[[Any], Any] | None = None,
    ignore_index: int = -100,
    strict: bool = False,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    batch_norm: str = "error",
    input_kind: str | None = None,
) -> CheckReport:
    """Assert that :class:`~multiscale_jac.SubnetLaplace` on a (small) subset equals dense
    computations from the loop reference's Jacobians, in float64.

    Checked: ``la.H`` after ``fit(data)`` against ``sum_i J_i^T Lambda_i J_i`` (or
    ``sum_i g_i g_i^T`` for ``hessian="empirical"``), and ``la.predictive(inputs)``'s mean,
    variance and, for vector outputs, covariance against ``f(x)``, ``diag(J Sigma J^T)`` and
    ``J Sigma J^T`` with ``Sigma = (H / sigma^2 + diag(prior_precision))^{-1}`` (inverted
    densely). Dense means ``P x P`` and ``O x O``: keep the subset and the outputs small.

    Args:
        model: The model at its MAP (a float64 copy is used if it is not float64).
        data: ``(inputs, targets)`` batches for ``fit`` (read into a list).
        subset: The entries (a :class:`~multiscale_jac.ParamSubset`, a name/glob or a list).
        likelihood: ``classification`` or ``regression``.
        inputs: Where the predictive is checked; default: the first batch's inputs.
        prior_precision: A number or a ``(P,)`` diagonal.
        sigma_noise: As for ``SubnetLaplace`` (regression).
        hessian: ``ggn`` or ``empirical``.
        output_fn: As for ``SubnetLaplace``.
        ignore_index: As for ``SubnetLaplace``.
        strict: A fallback (a ``FallbackWarning`` of ``fit`` or ``predictive``, quoted) fails
            too.
        rtol: Relative tolerance: ``|x - x_ref| <= atol + rtol |x_ref|`` entry by entry.
        atol: Absolute tolerance.
        batch_norm: As for ``SubnetLaplace``.
        input_kind: As for ``SubnetLaplace``.

    Returns:
        The :class:`CheckReport` (one row per quantity) when everything matched.

    Raises:
        AssertionError: a quantity is off, or the fit or the predictive raised.
    """
    model, batches = _float64_model(model), _pairs(data)
    options = {"batch_norm": batch_norm, "input_kind": input_kind}
    setting = {"likelihood": likelihood, "hessian": hessian, "output_fn": output_fn}
    setting.update(sigma_noise=sigma_noise, ignore_index=ignore_index)
    sub, h_ref, cov = _laplace_posterior(model, batches, subset, prior_precision, setting, options)
    test_inputs = batches[0][0] if inputs is None else _float64(inputs)
    ref = per_sample_jacobian_loop(model, test_inputs, params=sub, output_fn=output_fn, **options)
    test = [
        _Sample(ref.jacobian[i, :o], ref.outputs[i, :o], None, ref.outputs.new_zeros(0))
        for i, o in enumerate(ref.output_sizes)
    ]
    kw = {k: v for k, v in setting.items() if k != "likelihood"}

    def run() -> tuple[SubnetLaplace, Any]:
        la = SubnetLaplace(
            model, likelihood, sub, prior_precision=prior_precision, **kw, **options
        ).fit(batches)
        return la, la.predictive(test_inputs)

    label = f"SubnetLaplace(hessian={_name(hessian)})"
    fitted, reason, error = _attempt(label, run)  # the fit or the predictive may raise
    if error:
        routes: tuple[RouteReport, ...] = (error,)
    else:
        la, pred = fitted
        rows = _laplace_rows(
            la, pred, h_ref, cov, test, _Where(sub, test_inputs, input_kind), (rtol, atol)
        )
        routes = tuple(
            RouteReport(q, _status(d, reason), label, reason, d or "", e) for q, d, e in rows
        )
    what = "SubnetLaplace against dense J^T Lambda J and J Sigma J^T from the loop reference"
    return _asserted(CheckReport(what, routes, bool(strict), rtol, atol))


# ====================================================================== every entry point
#: what a route may raise instead of a number: a clear refusal, not a failure
_REFUSALS = (ValueError, TypeError)


def _route_report(
    label: str,
    call: Callable[[], Any],
    want: Callable[[Any], tuple[Tensor, Tensor]],
    where: Callable[[tuple[int, ...]], str],
    tol: tuple[float, float],
) -> RouteReport:
    """Run ``call``; ``want(result)`` gives ``(got, reference)``. A ``ValueError``/
    ``TypeError`` is a refusal (status ``"refused"``), anything else raised an error."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FallbackWarning)
            res = call()
    except _REFUSALS as err:
        return RouteReport(label, "refused", detail=f"{type(err).__name__}: {err}")
    except Exception as err:
        return RouteReport(label, "error", detail=f"{type(err).__name__}: {err}")
    reason = "; ".join(str(w.message) for w in caught if issubclass(w.category, FallbackWarning))
    got, ref = want(res)
    detail, max_err = _compare(got, ref, *tol, where)
    return RouteReport(
        label, _status(detail, reason or None), "", reason or None, detail or "", max_err
    )


def _jacnorm_reference(model: nn.Module, inputs: Any, subset: ParamSubset) -> tuple[Tensor, Tensor]:
    """``S = sum_i ||J_i||^2`` over ``subset`` and ``grad S`` w.r.t. every parameter that
    requires grad (flat, in ``named_parameters`` order), one sample and one output row at a
    time by plain double backward: the loop oracle of :func:`~multiscale_jac.jacobian_sq_norm`."""
    packed = pack(inputs)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    ones = next(iter(params.values())).new_ones(subset.numel)
    masks = subset.embed(ones)
    total = ones.new_zeros(())
    grads = [torch.zeros_like(params[n]) for n in names]
    for i in range(packed.num_samples):
        arg = packed.structure.arrange([lvl.unsqueeze(0) for lvl in packed.sample(i)])
        with torch.enable_grad():
            out = torch.func.functional_call(model, params, (arg,)).reshape(-1)
            s = out.new_zeros(())
            for o in range(out.numel()):
                wrt = [params[n] for n in subset.names]
                gs = torch.autograd.grad(out[o], wrt, create_graph=True, allow_unused=True)
                for n, g in zip(subset.names, gs):
                    s = s if g is None else s + ((g * masks[n]) ** 2).sum()
            if s.requires_grad:
                got = torch.autograd.grad(s, [params[n] for n in names], allow_unused=True)
                grads = [a if g is None else a + g for a, g in zip(grads, got)]
        total = total + s.detach()
    return total, torch.cat([g.reshape(-1) for g in grads])


def _mc_reference(samples: list[_Sample], likelihood: Any, seed: int, ignore: int) -> Tensor:
    """The Monte-Carlo Fisher's diagonal with the labels :func:`~multiscale_jac.diag_fisher`
    draws from ``seed`` for one batch in one chunk (one draw per sample)."""
    from ._likelihood import draw_noise, labels_from_noise  # the library's own convention

    lik = parse_enum(Likelihood, likelihood, "likelihood")
    regression = lik is Likelihood.REGRESSION
    shapes = [s.shape for s in samples]
    out = torch.stack([s.out.view(shapes[i][1:]) for i, s in enumerate(samples)])
    noise = draw_noise(out.shape, lik, 1, torch.Generator().manual_seed(seed))[0]
    per = out.shape[1:] if regression else out.shape[2:]
    ys = torch.stack([s.target.view(per) for s in samples])
    labels = labels_from_noise(out, noise, ys, lik, 1.0, ignore)
    drawn = [_Sample(s.jac, s.out, s.shape, labels[i].reshape(-1)) for i, s in enumerate(samples)]
    return _curvature(drawn, regression, ignore, True, True) / len(samples)


def _whole_layers(model: nn.Module) -> list[str]:
    """The weights and biases of the Linear and Conv layers (what K-FAC covers)."""
    layers = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [
        f"{m_name}.{p_name}" if m_name else p_name
        for m_name, m in model.named_modules()
        if isinstance(m, layers)
        for p_name, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]


def check_routes(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    entries: ParamSubset | str | Sequence[str] | None = None,
    likelihood: str = "classification",
    strategies: Sequence[str] = ("vmap", "loop", "bucketed", "padded"),
    modes: Sequence[str] = ("rev", "fwd"),
    seed: int = 0,
    rtol: float = 1e-10,
    atol: float = 1e-10,
    strict: bool = False,
) -> CheckReport:
    """Every route of every entry point on one batch against the loop oracle, in float64:
    each route agrees with it, falls back (a ``FallbackWarning``; exact all the same) or
    refuses (a ``ValueError``/``TypeError`` naming why); report, do not assert.

    Routes (all parameters that require grad, unless said otherwise):

    * :func:`~multiscale_jac.per_sample_jacobian`: ``strategies x modes``, and on the
      ``entries`` subset ``mode x entries="structured"/"generic"``, against
      :func:`~multiscale_jac.reference.per_sample_jacobian_loop`;
    * :func:`~multiscale_jac.diag_fisher`: ``kind="empirical"/"exact"/"mc"`` x
      ``method="layerwise"/"vmap"/"auto"`` against squared per-sample gradients and GGN
      diagonals from the loop reference's Jacobians (``mc``: with the labels the library draws
      from ``seed``);
    * :func:`~multiscale_jac.jacobian_sq_norm`: ``method="layerwise"/"vmap"/"hvp"/"auto"``,
      the value and its gradient w.r.t. every parameter, against a loop of double backward
      passes (one sample, one output row at a time);
    * :class:`~multiscale_jac.DiagLaplace` (``method="layerwise"/"vmap"``): ``H`` against the
      GGN's diagonal; :class:`~multiscale_jac.KronLaplace` (the Linear/Conv tensors): ``H``
      against the fit run one sample at a time (``chunk_size=1``: every batch a batch of
      one); :class:`~multiscale_jac.SubnetLaplace` on ``entries``: ``H`` against the dense GGN.

    Args:
        model: The model (a float64 copy is used if it is not float64; never changed).
        inputs: One batch, in any form :func:`~multiscale_jac.pack` accepts.
        targets: Its targets (class labels, or regression targets shaped like the outputs).
        entries: A small subset for the entry-level routes (default: the first entry of
            every tensor).
        likelihood: ``classification`` or ``regression``.
        strategies: The Jacobian strategies to run.
        modes: The Jacobian modes to run.
        seed: Seeds the labels ``kind="mc"`` draws.
        rtol: Relative tolerance, entry by entry.
        atol: Absolute tolerance.
        strict: A fallback fails too.

    Returns:
        A :class:`CheckReport` (statuses ``exact``, ``fell back``, ``refused``, ``mismatch``,
        ``error``; ``report.ok`` when no route mismatched or raised anything but a refusal).
    """
    model, inputs, targets = _float64_model(model), _float64(inputs), _float64(targets)
    tol = (rtol, atol)
    whole = ParamSubset.all(model, trainable_only=True)
    if entries is None:
        entries = ParamSubset.from_indices(model, {n: [0] for n in whole.names})
    ref = per_sample_jacobian_loop(model, inputs, params=whole)
    where = _Where(ref.subset, inputs)
    reports = [
        _jacobian_route(
            f"per_sample_jacobian(strategy={_name(st)}, mode={_name(m)})",
            functools.partial(per_sample_jacobian, model, inputs, strategy=st, mode=m),
            ref,
            where,
            tol,
        )
        for st, m in itertools.product(strategies, modes)
    ]
    sub = per_sample_jacobian_loop(model, inputs, params=entries)
    sub_where = _Where(sub.subset, inputs)
    reports += [
        _jacobian_route(
            f"per_sample_jacobian(params=entries, mode={_name(m)}, entries={_name(e)})",
            functools.partial(
                per_sample_jacobian, model, inputs, params=sub.subset, mode=m, entries=e
            ),
            sub,
            sub_where,
            tol,
        )
        for m, e in itertools.product(modes, ("structured", "generic"))
    ]
    reports += _derived_routes(model, inputs, targets, whole, sub.subset, likelihood, seed, tol)
    what = "every route of every entry point against the float64 loop oracle"
    return CheckReport(what, tuple(reports), bool(strict), rtol, atol)


def _derived_routes(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    whole: ParamSubset,
    entries: ParamSubset,
    likelihood: str,
    seed: int,
    tol: tuple[float, float],
) -> list[RouteReport]:
    """The routes of :func:`check_routes` beyond the Jacobian."""
    from .laplace import DiagLaplace, KronLaplace

    regression = _value(likelihood) == "regression"
    data = [(inputs, targets)]
    _, samples = _dense_samples(model, data, whole, None, {})
    n = len(samples)
    want = {
        "empirical": _curvature(samples, regression, -100, True, True) / n,
        "exact": _curvature(samples, regression, -100, False, True) / n,
        "mc": _mc_reference(samples, likelihood, seed, -100),
    }
    column = _Where(whole).column
    at = lambda idx: column(idx[0])  # noqa: E731
    reports = []
    for kind, method in itertools.product(
        ("empirical", "exact", "mc"), ("layerwise", "vmap", "auto")
    ):
        gen = torch.Generator().manual_seed(seed)
        call = functools.partial(
            diag_fisher, model, data, likelihood=likelihood, kind=kind, method=method, generator=gen
        )
        label = f"diag_fisher(kind={kind!r}, method={method!r})"
        reports.append(_route_report(label, call, lambda r, k=kind: (r.flat, want[k]), at, tol))
    value, grad = _jacnorm_reference(model, inputs, whole)
    for method in ("layerwise", "vmap", "hvp", "auto"):
        label = f"jacobian_sq_norm(method={method!r})"
        reports.append(
            _route_report(
                label,
                lambda m=method: _jacnorm_run(model, inputs, m),
                lambda r: (r, torch.cat([value.reshape(1), grad])),
                lambda idx: "the value" if idx[0] == 0 else f"gradient entry {idx[0] - 1}",
                tol,
            )
        )
    ggn = _curvature(samples, regression, -100, False, True)
    for method in ("layerwise", "vmap"):
        label = f"DiagLaplace(method={method!r}).fit"
        call = lambda m=method: DiagLaplace(model, likelihood, method=m).fit(data)  # noqa: E731
        reports.append(_route_report(label, call, lambda la: (la.H, ggn), at, tol))
    layers = _whole_layers(model)
    oracle = KronLaplace(model, likelihood, layers, chunk_size=1)
    label = "KronLaplace.fit, against the fit one sample at a time"
    try:
        oracle.fit(data)
        reports.append(
            _route_report(
                label,
                lambda: KronLaplace(model, likelihood, layers).fit(data),
                lambda la: (la.H.to_matrix(), oracle.H.to_matrix()),
                lambda idx: f"H[{idx[0]}, {idx[1]}]",
                tol,
            )
        )
    except _REFUSALS as err:
        reports.append(RouteReport(label, "refused", detail=f"{type(err).__name__}: {err}"))
    _, sub_samples = _dense_samples(model, data, entries, None, {})
    h_sub = _curvature(sub_samples, regression, -100, False, False)
    label = "SubnetLaplace(entries).fit"
    call = lambda: SubnetLaplace(model, likelihood, entries).fit(data)  # noqa: E731
    reports.append(
        _route_report(
            label, call, lambda la: (la.H, h_sub), lambda idx: f"H[{idx[0]}, {idx[1]}]", tol
        )
    )
    return reports


def _jacnorm_run(model: nn.Module, inputs: Any, method: str) -> Tensor:
    """``S`` and its gradient w.r.t. every trainable parameter, flat, on a copy of ``model``
    (the gradient goes into the copy's ``.grad``)."""
    from .jacnorm import jacobian_sq_norm

    copy_ = copy.deepcopy(model)
    for p in copy_.parameters():
        p.grad = None
    s = jacobian_sq_norm(copy_, inputs, method=method)
    s.backward()
    grads = [
        torch.zeros_like(p) if p.grad is None else p.grad
        for p in copy_.parameters()
        if p.requires_grad
    ]
    return torch.cat([s.detach().reshape(1), *(g.reshape(-1) for g in grads)])


def assert_routes_match(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    entries: ParamSubset | str | Sequence[str] | None = None,
    likelihood: str = "classification",
    strategies: Sequence[str] = ("vmap", "loop", "bucketed", "padded"),
    modes: Sequence[str] = ("rev", "fwd"),
    seed: int = 0,
    rtol: float = 1e-10,
    atol: float = 1e-10,
    strict: bool = False,
) -> CheckReport:
    """Assert that every route of every entry point agrees with the loop oracle, falls back
    or refuses (:func:`check_routes`, whose arguments it takes).

    Returns:
        The :class:`CheckReport` when no route mismatched or failed.

    Raises:
        AssertionError: a route gave another number, or raised anything but a ``ValueError``
            or ``TypeError``.
    """
    return _asserted(check_routes(**locals()))  # every argument, passed on as it came

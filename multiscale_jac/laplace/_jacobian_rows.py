"""Every sample's Jacobian rows on the subset, with its outputs from the same pass.

:class:`JacobianRows` streams them a chunk of samples at a time, in shape buckets, under the
memory budget (the posterior's kept bytes, the rows held and the engine's working set); a
sample whose rows do not fit comes in slices of its output positions. A fit
(:class:`~._subset_ggn.SubsetGGN`) accumulates them; the predictive whitens them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._checks import warn_fallback
from .._likelihood import check_target
from .._memory import (
    DEFAULT_JACOBIAN_BYTES,
    fit_budget,
    laplace_engine_growth,
    laplace_row,
    tensor_bytes,
)
from .._planning import EngineOptions, engine_minimum
from .._stream import Capture, raw_output
from ..adapter import PerSampleFunction
from ..engine import run_engine
from ..enums import Likelihood, Strategy
from ..packing import PackedBatch
from ..subset import ParamSubset
from ._options import LaplaceOptions

if TYPE_CHECKING:
    from .._checks import Prepared

#: output shapes :meth:`JacobianRows.differentiable` keeps per posterior
_KEPT_SHAPES = 64

__all__ = [
    "Block",
    "BlockMemo",
    "FitSpec",
    "JacobianRows",
    "Sampling",
    "block_rows",
    "positions",
    "span_fn",
]


class Block(NamedTuple):
    """Rows of one sample's Jacobian: ``out`` the outputs of the rows (classification:
    ``(C, m)``, all classes of ``m`` positions; regression: ``(rows,)``), ``jac`` ``(rows, P)``,
    ``span`` the positions (classification) or entries (regression) ``[a, b)`` covered and
    ``shape`` the sample's whole output shape (no batch dim). A fit's block of a whole sample
    may carry its curvature instead of rows (``jac`` ``None``): ``ggn`` ``(P, P)``, or the
    gradient ``(P,)`` for the empirical Fisher."""

    i: int
    out: Tensor
    jac: Tensor | None
    span: tuple[int, int]
    shape: torch.Size
    ggn: Tensor | None = None


@dataclass
class BlockMemo:
    """Jacobian blocks kept per input batch during a grid search, up to ``cap`` bytes."""

    cap: int
    used: int = 0
    blocks: dict[int, list[Block]] = field(default_factory=dict)

    def keep(self, key: int, blocks: Iterator[Block]) -> Iterator[Block]:
        """``blocks`` passed through; kept under ``key`` when all of them fit the cap."""
        kept: list[Block] | None = []
        size = 0
        for b in blocks:
            if kept is not None:
                size += tensor_bytes(b.jac.numel() + b.out.numel(), b.jac.element_size())
                if self.used + size <= self.cap:
                    kept.append(b)
                else:
                    kept = None
            yield b
        if kept is not None:
            self.blocks[key] = kept
            self.used += size


class Sampling(NamedTuple):
    """A fit's output-position subsampling: at most ``most`` positions per sample (``None``:
    exact), drawn with ``generator``."""

    most: int | None
    generator: torch.Generator | None

    def draw(self, positions: int, device: torch.device) -> tuple[Tensor, float]:
        """Sorted positions ``(m,)`` drawn uniformly without replacement and the factor
        ``positions / m`` that makes their GGN unbiased (all of them, 1, when exact)."""
        if self.most is None or positions <= self.most:
            return torch.arange(positions, device=device), 1.0
        picked = torch.randperm(positions, generator=self.generator)[: self.most]
        return picked.sort().values.to(device), positions / self.most


#: a fit's route for one sample's whole curvature: ``(packed, i, shape, fit, row_bytes)``
_WholeSample = Callable[[PackedBatch, int, torch.Size, "FitSpec", int], Block]


@dataclass
class FitSpec:
    """What :meth:`JacobianRows.jacobians` needs to hand a fit whole samples' curvature:
    the batch's targets (checked on use), the samples seen before it, the subsampling and the
    route that computes a whole sample's curvature from one forward pass (``curvature``)."""

    targets: list[Tensor]
    seen: int
    likelihood: Likelihood
    ignore_index: int
    sampling: Sampling
    curvature: _WholeSample

    def sampled(self, positions: int) -> bool:
        return self.sampling.most is not None and positions > self.sampling.most

    def target(self, i: int, shape: torch.Size) -> Tensor:
        return check_target(
            self.targets[i], shape, self.likelihood, self.ignore_index, self.seen + i
        )

    def whole(self, packed: PackedBatch, i: int, shape: torch.Size, row_bytes: int) -> Block:
        """Sample ``i``'s block carrying its whole curvature (``curvature``)."""
        return self.curvature(packed, i, shape, self, row_bytes)


class JacobianRows:
    """Every sample's Jacobian rows on the subset, with its outputs from the same pass, a chunk
    at a time under the memory budget: what a fit accumulates and the predictive whitens.

    Args:
        owner: The Laplace class's name (for messages).
        prep: The checked model, subset and policies.
        options: The posterior's options.
        theta: The MAP ``(P,)``.
        kept_bytes: Bytes the posterior keeps (its curvature and scale), part of the budget.
    """

    def __init__(
        self,
        owner: str,
        prep: Prepared,
        options: LaplaceOptions,
        theta: Tensor,
        kept_bytes: int,
    ) -> None:
        self._owner, self._prep, self._options = owner, prep, options
        self._subset: ParamSubset = prep.subset
        self._theta, self._kept = theta, kept_bytes
        self._memo: BlockMemo | None = None
        self._model_kwargs: dict[str, Any] = {}
        self._fallbacks: list[str] = []
        self._vmaps = True  # the model runs under vmap (False once it did not)
        #: the output shape of each shape signature seen by :meth:`differentiable` (plain
        #: data, at most ``_KEPT_SHAPES``; each call checks it against the run's own)
        self._shapes: dict[Any, torch.Size] = {}

    def set_options(self, options: LaplaceOptions) -> None:
        """The posterior's options after a change (``enable_backprop``)."""
        self._options = options

    @contextlib.contextmanager
    def remembering(self, cap: int) -> Iterator[None]:
        """Inside: the blocks of each input batch are kept (up to ``cap`` bytes) and served
        again for the same batch object (a grid search over the prior)."""
        self._memo = BlockMemo(cap)
        try:
            yield
        finally:
            self._memo = None

    @contextlib.contextmanager
    def calling(self, model_kwargs: dict[str, Any]) -> Iterator[None]:
        """Inside: every model call gets ``model_kwargs`` (laplace-torch's ``la(x, **kw)``)."""
        self._model_kwargs = model_kwargs
        try:
            yield
        finally:
            self._model_kwargs = {}

    def pack(self, inputs: Any, *, finite: bool = False) -> PackedBatch:
        """The inputs packed on the parameters' device."""
        return self._prep.pack(inputs, finite=finite)

    def blocks(self, inputs: Any, packed: PackedBatch, likelihood: Likelihood) -> Iterable[Block]:
        """:meth:`jacobians`, or the blocks kept for ``inputs`` inside :meth:`remembering`."""
        memo = self._memo
        if memo is None:
            return self.jacobians(packed, likelihood)
        key = id(inputs)
        if key in memo.blocks:
            return memo.blocks[key]
        return memo.keep(key, self.jacobians(packed, likelihood))

    def function(
        self, packed: PackedBatch, output_fn: Callable[[Any], Any] | None = None
    ) -> PerSampleFunction:
        """The per-sample function of the model on ``packed`` (``output_fn``: the user's,
        its output captured)."""
        return self._prep.function(
            packed,
            output_fn=output_fn or Capture(self._options.output_fn, self._owner),
            model_kwargs=self._model_kwargs,
        )

    def _budget(
        self,
        packed: PackedBatch,
        shapes: list[torch.Size],
        options: EngineOptions,
        cls: bool,
    ) -> tuple[int, int | None]:
        """Bytes of Jacobian rows held at once (3 copies of each: rows, a copy, a product) and
        the engine's ``memory_budget``, from the posterior's ``memory_budget``: the curvature
        and its factor, and the engine's working set for the rows (the engine's own minimum for
        the rows of one output position of the largest sample, :func:`engine_minimum`) must
        fit; every size from :mod:`~multiscale_jac._memory`."""
        budget = self._options.memory_budget
        if budget is None:
            return DEFAULT_JACOBIAN_BYTES, None
        p, s = self._subset.numel, self._theta.element_size()
        kept = self._kept
        i = packed.largest_sample
        least = int(shapes[i][0]) if cls else 1  # the rows of one output position
        one = packed.select([i])
        fn = self._prep.function(
            one,
            output_fn=span_fn(self._options.output_fn, 0, 1, cls),
            model_kwargs=self._model_kwargs,
        )
        strategy = Strategy.VMAP if options.strategy is Strategy.AUTO else options.strategy
        engine = engine_minimum(fn, one, strategy, options)
        ours = laplace_row(p, s)
        left = fit_budget(
            budget,
            kept,
            least * ours + engine,
            f"the posterior over P={p} entries takes {kept} bytes, the Jacobian rows of one "
            f"output position {least * ours} and the engine computing them {engine}",
        ).left
        grows = laplace_engine_growth(p, s)
        base = max(0, engine - least * grows)
        rows = max(least, (left - base) // (ours + grows))
        return rows * ours, left - rows * ours

    def jacobians(
        self, packed: PackedBatch, likelihood: Likelihood, fit: FitSpec | None = None
    ) -> Iterator[Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample
        order: from the engine (:meth:`engine_blocks`), or, for the predictive with
        ``enable_backprop``, with their graph to the inputs (:meth:`differentiable`)."""
        if fit is None and self._options.enable_backprop:
            return self.differentiable(packed, likelihood)
        return self.engine_blocks(packed, likelihood, fit)

    def engine_blocks(
        self, packed: PackedBatch, likelihood: Likelihood, fit: FitSpec | None = None
    ) -> Iterator[Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample order,
        a chunk of samples (or, for one sample above the budget, of its output positions) at a
        time. In a fit (``fit``), a sample above the budget or subsampled comes as one block
        carrying its curvature (``fit.whole``): the model is not re-run per slice."""
        fn = self.function(packed)
        values = fn.values()
        n = packed.num_samples
        cls = likelihood is Likelihood.CLASSIFICATION
        shapes: list[torch.Size] = [torch.Size()] * n
        with torch.no_grad():  # one forward pass per shape bucket: its samples' outputs agree
            for bucket in packed.buckets():
                shape = raw_output(fn, values, tuple(packed.sample(bucket.indices[0]))).shape
                for i in bucket.indices:
                    shapes[i] = shape[1:]
        per_row = laplace_row(self._subset.numel, self._theta.element_size())
        o = self._options
        options = EngineOptions(
            entries=o.entries,
            mode=o.mode,
            chunk_size=o.chunk_size,
            randomness=self._prep.randomness,
            strict=o.strict,
            tune=o.tune,
        )
        row_bytes, engine_budget = self._budget(packed, shapes, options, cls)
        options = dataclasses.replace(options, memory_budget=engine_budget)
        most = o.chunk_size or n

        def alone(i: int) -> bool:  # a fit's sample above the budget or subsampled
            big = math.prod(shapes[i]) * per_row > row_bytes
            return fit is not None and (big or fit.sampled(positions(shapes[i], cls)))

        start = 0
        while start < n:
            if alone(start):
                yield fit.whole(packed, start, shapes[start], row_bytes)
                start += 1
                continue
            stop, rows = start + 1, math.prod(shapes[start])
            while (
                stop < n
                and stop - start < most
                and not alone(stop)
                and (rows + math.prod(shapes[stop])) * per_row <= row_bytes
            ):
                rows += math.prod(shapes[stop])
                stop += 1
            if rows * per_row > row_bytes and stop - start == 1:  # slices of its positions
                yield from self._sliced(packed, start, shapes[start], row_bytes, options, cls)
            else:
                idx = list(range(start, stop))
                res = self._engine(packed.select(idx), None, options)
                for k, i in enumerate(idx):
                    width = res.output_sizes[k]
                    out = block_rows(res.outputs[k, :width], shapes[i], cls)
                    yield Block(i, out, res.jacobian[k, :width], (0, out.shape[-1]), shapes[i])
            start = stop

    def stacked(
        self, inputs: Any, likelihood: Likelihood, enable_backprop: bool, *, vector: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Every sample's Jacobian ``(N, O, P)`` and outputs ``(N, O)`` (``la.backend``'s
        ``jacobians``); outputs of one size per sample only (``vector``: one vector each)."""
        packed = self._prep.pack(inputs)
        rows: list[list[Tensor]] = [[] for _ in range(packed.num_samples)]
        outs: list[list[Tensor]] = [[] for _ in range(packed.num_samples)]
        blocks = (
            self.differentiable(packed, likelihood)
            if enable_backprop
            else self.engine_blocks(packed, likelihood)
        )
        for block in blocks:
            if block.jac is None:  # pragma: no cover - predictive blocks carry rows
                raise RuntimeError("internal error: a block without Jacobian rows")
            if vector and len(block.shape) != 1:
                raise ValueError(
                    "the outputs must be one vector (O,) per sample; got per-sample output "
                    f"shape {tuple(block.shape)} (dense outputs)"
                )
            rows[block.i].append(block.jac)
            outs[block.i].append(block.out.reshape(-1))
        js = [torch.cat(r) for r in rows]
        if len({j.shape for j in js}) != 1:
            raise ValueError(
                "jacobians: the samples' outputs differ in size "
                f"{sorted({j.shape[0] for j in js})}; use predictive() for ragged outputs"
            )
        return torch.stack(js), torch.stack([torch.cat(o) for o in outs])

    def differentiable(self, packed: PackedBatch, likelihood: Likelihood) -> Iterator[Block]:
        """``enable_backprop``: every sample's outputs and Jacobian rows with their graph to
        inputs that require grad (the engine runs without one): ``torch.func.jacrev`` vmapped
        over the samples of a shape bucket, a chunk at a time (``chunk_size``, or as many as
        the Jacobian rows' default bytes allow); one sample at a time where the model does
        not run under ``vmap``."""
        fn = self.function(packed)
        cls = likelihood is Likelihood.CLASSIFICATION
        per_row = laplace_row(self._subset.numel, self._theta.element_size())
        blocks: dict[int, Block] = {}
        next_i = 0  # blocks go out in sample order (the joint predictive's order)
        for bucket in packed.buckets():
            shape = self._shapes.get(bucket.signature)  # a repeated call skips the forward
            if shape is None:
                with torch.no_grad():
                    first = tuple(packed.sample(bucket.indices[0]))
                    shape = raw_output(fn, fn.values(), first).shape[1:]
            most = self._options.chunk_size or max(
                1, DEFAULT_JACOBIAN_BYTES // max(1, math.prod(shape) * per_row)
            )
            for a in range(0, len(bucket.indices), most):
                idx = bucket.indices[a : a + most]
                jac, flat, shape = self._jacrev(fn, packed, idx)
                if len(self._shapes) >= _KEPT_SHAPES:
                    self._shapes.clear()
                self._shapes[bucket.signature] = shape
                # unbind: one backward node for the chunk (indexing adds one per sample,
                # each writing a zero-filled chunk-sized gradient)
                for i, f, j in zip(idx, flat.unbind(0), jac.unbind(0), strict=True):
                    rows = block_rows(f, shape, cls)
                    blocks[i] = Block(i, rows, j, (0, rows.shape[-1]), shape)
                while next_i in blocks:
                    yield blocks.pop(next_i)
                    next_i += 1

    def _jacrev(
        self, fn: PerSampleFunction, packed: PackedBatch, idx: list[int]
    ) -> tuple[Tensor, Tensor, torch.Size]:
        """Jacobians ``(n, O, P)``, flat outputs ``(n, O)`` and the output shape (no batch
        dim) of samples ``idx`` (one shape), differentiable w.r.t. the inputs."""
        subset = self._subset
        shapes: list[torch.Size] = []

        def out(t: Tensor, *levels: Tensor) -> tuple[Tensor, Tensor]:
            flat = fn.call(fn.full_params(tuple(subset.split(t).values())), levels)
            shapes.append(fn.output_fn.last.shape[1:])  # type: ignore[union-attr]
            return flat, flat  # the output itself comes back as the aux (one model run)

        jacrev = torch.func.jacrev(out, has_aux=True)
        with torch.enable_grad():
            if len(idx) > 1 and self._vmaps:
                stacked = packed.stack(idx)
                dims = (None, *[0] * len(stacked))
                randomness = self._prep.randomness.value
                try:
                    jac, flat = torch.func.vmap(jacrev, in_dims=dims, randomness=randomness)(
                        self._theta, *stacked
                    )
                    return jac, flat, shapes[-1]
                except (RuntimeError, NotImplementedError, TypeError) as err:
                    self._vmaps = False  # a model whose ops have no batching rule
                    note = f"enable_backprop: rows one sample at a time ({err})"
                    self._fallbacks.append(note if len(note) <= 200 else note[:197] + "...")
            pairs = [jacrev(self._theta, *packed.sample(i)) for i in idx]
        return torch.stack([j for j, _ in pairs]), torch.stack([f for _, f in pairs]), shapes[-1]

    def _sliced(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        row_bytes: int,
        options: EngineOptions,
        cls: bool,
    ) -> Iterator[Block]:
        one = packed.select([i])
        width = math.prod(shape[1:]) if cls else math.prod(shape)
        per_row = laplace_row(self._subset.numel, self._theta.element_size())
        step = max(1, row_bytes // (per_row * (shape[0] if cls else 1)))
        for a in range(0, width, step):
            b = min(width, a + step)
            res = self._engine(one, span_fn(self._options.output_fn, a, b, cls), options)
            rows = res.output_sizes[0]
            out = block_rows(res.outputs[0, :rows], shape, cls)
            yield Block(i, out, res.jacobian[0, :rows], (a, b), shape)

    def _engine(
        self,
        packed: PackedBatch,
        output_fn: Callable[[Any], Any] | None,
        options: EngineOptions,
    ) -> Any:
        fn = self._prep.function(
            packed,
            output_fn=output_fn or self._options.output_fn,
            model_kwargs=self._model_kwargs,
        )
        res = run_engine(fn, packed, options)
        self._fallbacks.append(res.fallback or "")
        return res

    def warn_fallbacks(self) -> None:
        """One warning for the engine's fallbacks since the last call (none: nothing)."""
        fallbacks, self._fallbacks = self._fallbacks, []
        warn_fallback(fallbacks)


def block_rows(flat: Tensor, shape: torch.Size, cls: bool) -> Tensor:
    """A sample's flat outputs as block rows: ``(C, positions)`` (``cls``) or ``(entries,)``."""
    if cls:
        if len(shape) == 0:
            raise ValueError("classification needs logits with a class dim; got a scalar")
        return flat.reshape(shape[0], -1)
    return flat.reshape(-1)


def positions(shape: torch.Size, cls: bool) -> int:
    """Output positions of a sample (classification: pixels; regression: entries)."""
    return math.prod(shape[1:]) if cls else math.prod(shape)


def span_fn(
    user: Callable[[Any], Any] | None, a: int, b: int, classes: bool
) -> Callable[[Any], Any]:
    """``output_fn`` keeping output positions ``[a, b)`` of every class (``classes``) or flat
    output entries ``[a, b)``."""

    def fn(out: Any) -> Tensor:
        out = user(out) if user is not None else out
        if classes:
            return out.reshape(out.shape[0], out.shape[1], -1)[:, :, a:b]
        return out.reshape(out.shape[0], -1)[:, a:b]

    return fn

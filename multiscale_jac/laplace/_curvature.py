"""The curvature over the data, and the Jacobian rows it and the predictive stream.

:class:`JacobianStream` streams every sample's Jacobian rows with the outputs of the same pass:
a chunk of samples at a time, in shape buckets, under the memory budget (the posterior's kept
bytes, the rows held and the engine's working set); a sample whose rows do not fit comes in
slices of its output positions. :class:`SubsetCurvature` is :class:`SubnetLaplace`'s fit:
``H = sum_i J_i^T Lambda_i J_i`` (the GGN) or ``sum_i g_i g_i^T`` (the empirical Fisher) over
a subset, ``(P, P)``, from those rows, or, for a sample above the budget or subsampled, from
ONE forward pass kept for reverse mode (its rows pulled back in blocks, or ``H`` by column
chunks). :class:`DiagCurvature` is :class:`DiagLaplace`'s: the diagonal ``(P,)`` and the loss
from :func:`~multiscale_jac.diag_fisher`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._checks import check_bool, check_generator, warn_fallback
from .._distributed import Reducer
from .._likelihood import check_target, ggn_factors, nll_sum, output_gradient
from .._memory import (
    DEFAULT_JACOBIAN_BYTES,
    fit_budget,
    laplace_column_chunk,
    laplace_engine_growth,
    laplace_reverse_rows,
    laplace_row,
    tensor_bytes,
)
from .._ops import twice_differentiable
from .._planning import EngineOptions, engine_minimum
from .._stream import Capture, pair, raw_output, split_targets, with_progress
from ..adapter import PerSampleFunction
from ..engine import run_engine
from ..enums import HessianKind, Likelihood, Strategy
from ..fisher import diag_fisher
from ..packing import PackedBatch
from ._base import LaplaceBase, fitting

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "Block",
    "BlockMemo",
    "DiagCurvature",
    "FitSpec",
    "JacobianStream",
    "Sampling",
    "SubsetCurvature",
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
    """What :meth:`JacobianStream._jacobians` needs to hand a fit whole samples' curvature:
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


class JacobianStream(LaplaceBase):
    """Every sample's Jacobian rows on the subset, with its outputs from the same pass, a chunk
    at a time under the memory budget: what a fit accumulates and the predictive whitens."""

    #: the blocks a grid search keeps across its grid (set by it, ``None`` otherwise)
    _memo: BlockMemo | None

    def _blocks(self, inputs: Any, packed: PackedBatch) -> Iterable[Block]:
        """:meth:`_jacobians`, or the blocks kept for ``inputs`` during a grid search (kept
        while the memo's byte cap allows)."""
        memo = self._memo
        if memo is None:
            return self._jacobians(packed)
        key = id(inputs)
        if key in memo.blocks:
            return memo.blocks[key]
        return memo.keep(key, self._jacobians(packed))

    def _function(
        self, packed: PackedBatch, output_fn: Callable[[Any], Any] | None = None
    ) -> PerSampleFunction:
        return self._prep.function(
            packed,
            output_fn=output_fn or Capture(self.output_fn, type(self).__name__),
            model_kwargs=self._model_kwargs,
        )

    def _budget(
        self, packed: PackedBatch, shapes: list[torch.Size], options: EngineOptions
    ) -> tuple[int, int | None]:
        """Bytes of Jacobian rows held at once (3 copies of each: rows, a copy, a product) and
        the engine's ``memory_budget``, from :attr:`memory_budget`: the ``(P, P)`` curvature and
        its factor, and the engine's working set for the rows (the engine's own minimum for the
        rows of one output position of the largest sample, :func:`engine_minimum`) must fit;
        every size from :mod:`~multiscale_jac._memory`."""
        if self.memory_budget is None:
            return DEFAULT_JACOBIAN_BYTES, None
        p, s = self.subset.numel, self.mean.element_size()
        kept = self._kept_bytes()
        cls = self.likelihood is Likelihood.CLASSIFICATION
        i = packed.largest_sample
        least = int(shapes[i][0]) if cls else 1  # the rows of one output position
        one = packed.select([i])
        fn = self._prep.function(
            one, output_fn=_span_fn(self.output_fn, 0, 1, cls), model_kwargs=self._model_kwargs
        )
        strategy = Strategy.VMAP if options.strategy is Strategy.AUTO else options.strategy
        engine = engine_minimum(fn, one, strategy, options)
        ours = laplace_row(p, s)
        left = fit_budget(
            self.memory_budget,
            kept,
            least * ours + engine,
            f"the posterior over P={p} entries takes {kept} bytes, the Jacobian rows of one "
            f"output position {least * ours} and the engine computing them {engine}",
        ).left
        grows = laplace_engine_growth(p, s)
        base = max(0, engine - least * grows)
        rows = max(least, (left - base) // (ours + grows))
        return rows * ours, left - rows * ours

    def _jacobians(self, packed: PackedBatch, fit: FitSpec | None = None) -> Iterator[Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample
        order: from the engine (:meth:`_engine_blocks`), or, for the predictive with
        ``enable_backprop``, with their graph to the inputs (:meth:`_differentiable`)."""
        if fit is None and self.enable_backprop:
            return self._differentiable(packed)
        return self._engine_blocks(packed, fit)

    def _engine_blocks(self, packed: PackedBatch, fit: FitSpec | None = None) -> Iterator[Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample order,
        a chunk of samples (or, for one sample above the budget, of its output positions) at a
        time. In a fit (``fit``), a sample above the budget or subsampled comes as one block
        carrying its curvature (:meth:`_curvature`): the model is not re-run per slice."""
        fn = self._function(packed)
        values = fn.values()
        n = packed.num_samples
        shapes: list[torch.Size] = [torch.Size()] * n
        with torch.no_grad():  # one forward pass per shape bucket: its samples' outputs agree
            for bucket in packed.buckets():
                shape = raw_output(fn, values, tuple(packed.sample(bucket.indices[0]))).shape
                for i in bucket.indices:
                    shapes[i] = shape[1:]
        per_row = laplace_row(self.subset.numel, self.mean.element_size())
        options = EngineOptions(
            entries=self.entries,
            mode=self.mode,
            chunk_size=self.chunk_size,
            randomness=self._prep.randomness,
            strict=self.strict,
            tune=self.tune,
        )
        row_bytes, engine_budget = self._budget(packed, shapes, options)
        options = dataclasses.replace(options, memory_budget=engine_budget)
        most = self.chunk_size or n

        def alone(i: int) -> bool:  # a fit's sample above the budget or subsampled
            big = math.prod(shapes[i]) * per_row > row_bytes
            return fit is not None and (big or fit.sampled(self._positions(shapes[i])))

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
                yield from self._sliced(packed, start, shapes[start], row_bytes, options)
            else:
                idx = list(range(start, stop))
                res = self._engine(packed.select(idx), None, options)
                for k, i in enumerate(idx):
                    o = res.output_sizes[k]
                    out = self._rows(res.outputs[k, :o], shapes[i])
                    yield Block(i, out, res.jacobian[k, :o], (0, out.shape[-1]), shapes[i])
            start = stop

    def _stacked_jacobians(self, x: Any, enable_backprop: bool | None) -> tuple[Tensor, Tensor]:
        """Every sample's Jacobian ``(N, O, P)`` and outputs ``(N, O)`` (``la.backend``'s
        ``jacobians``); outputs of one size per sample only."""
        keep = (
            self.enable_backprop
            if enable_backprop is None
            else check_bool(enable_backprop, "enable_backprop")
        )
        packed = self._prep.pack(self._inputs(x))
        rows: list[list[Tensor]] = [[] for _ in range(packed.num_samples)]
        outs: list[list[Tensor]] = [[] for _ in range(packed.num_samples)]
        blocks = self._differentiable(packed) if keep else self._engine_blocks(packed)
        for block in blocks:
            if block.jac is None:  # pragma: no cover - predictive blocks carry rows
                raise RuntimeError("internal error: a block without Jacobian rows")
            rows[block.i].append(block.jac)
            outs[block.i].append(block.out.reshape(-1))
        js = [torch.cat(r) for r in rows]
        if len({j.shape for j in js}) != 1:
            raise ValueError(
                "jacobians: the samples' outputs differ in size "
                f"{sorted({j.shape[0] for j in js})}; use predictive() for ragged outputs"
            )
        return torch.stack(js), torch.stack([torch.cat(o) for o in outs])

    def _differentiable(self, packed: PackedBatch) -> Iterator[Block]:
        """``enable_backprop``: every sample's outputs and Jacobian rows by ``torch.func.jacrev``
        (one sample at a time), keeping the graph to inputs that require grad (the engine
        runs without one)."""
        fn = self._function(packed)
        theta = self._map
        for i in range(packed.num_samples):
            levels = tuple(packed.sample(i))

            def out(t: Tensor, levels: tuple[Tensor, ...] = levels) -> tuple[Tensor, Tensor]:
                flat = fn.call(fn.full_params(tuple(self.subset.split(t).values())), levels)
                return flat, flat  # the output itself comes back as the aux (one model run)

            with torch.enable_grad():
                jac, flat = torch.func.jacrev(out, has_aux=True)(theta)
            shape = fn.output_fn.last.shape[1:]  # type: ignore[union-attr]
            rows = self._rows(flat, shape)
            yield Block(i, rows, jac, (0, rows.shape[-1]), shape)

    def _rows(self, flat: Tensor, shape: torch.Size) -> Tensor:
        """A sample's flat outputs as block rows: ``(C, positions)`` or ``(entries,)``."""
        if self.likelihood is Likelihood.CLASSIFICATION:
            if len(shape) == 0:
                raise ValueError("classification needs logits with a class dim; got a scalar")
            return flat.reshape(shape[0], -1)
        return flat.reshape(-1)

    def _sliced(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        row_bytes: int,
        options: EngineOptions,
    ) -> Iterator[Block]:
        one = packed.select([i])
        cls = self.likelihood is Likelihood.CLASSIFICATION
        width = math.prod(shape[1:]) if cls else math.prod(shape)
        per_row = laplace_row(self.subset.numel, self.mean.element_size())
        step = max(1, row_bytes // (per_row * (shape[0] if cls else 1)))
        for a in range(0, width, step):
            b = min(width, a + step)
            res = self._engine(one, _span_fn(self.output_fn, a, b, cls), options)
            rows = res.output_sizes[0]
            out = self._rows(res.outputs[0, :rows], shape)
            yield Block(i, out, res.jacobian[0, :rows], (a, b), shape)

    def _positions(self, shape: torch.Size) -> int:
        """Output positions of a sample (classification: pixels; regression: entries)."""
        cls = self.likelihood is Likelihood.CLASSIFICATION
        return math.prod(shape[1:]) if cls else math.prod(shape)

    def _engine(
        self,
        packed: PackedBatch,
        output_fn: Callable[[Any], Any] | None,
        options: EngineOptions,
    ) -> Any:
        fn = self._prep.function(
            packed, output_fn=output_fn or self.output_fn, model_kwargs=self._model_kwargs
        )
        res = run_engine(fn, packed, options)
        self._fallbacks.append(res.fallback or "")
        return res

    def _warn_fallbacks(self) -> None:
        fallbacks, self._fallbacks = self._fallbacks, []
        warn_fallback(fallbacks)


class SubsetCurvature(JacobianStream):
    """The subset GGN (or empirical Fisher) ``H`` ``(P, P)`` over the data: rows from the
    stream, or a whole sample's curvature from one forward pass (its reverse or column route,
    or a subsample of its positions)."""

    @fitting
    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
        process_group: Any = None,
        max_outputs_per_sample: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Self:
        """Accumulate the subset curvature ``H`` (``(P, P)``) and the loss at the MAP.

        Args:
            train_loader: An iterable of ``(inputs, targets)`` (a DataLoader, a list of pairs);
                ``inputs`` in any form :func:`~multiscale_jac.pack` accepts, ``targets`` a
                tensor with a leading batch dim or a list of per-sample tensors (ragged label
                maps).
            override: Start from zero (``False`` adds to a previous fit: online / continual
                learning).
            progress_bar: laplace-torch's name for ``progress``.
            progress: A tqdm bar over the batches when a terminal is attached.
            process_group: With ``torch.distributed`` initialised, every rank fits its shard of
                the data and ``H``, the loss and the counts are all-reduced once at the end:
                every rank ends with the fit over all of the data (``None``: the default group).
            max_outputs_per_sample: Opt-in unbiased subsampling of the curvature (``None``:
                exact). A sample with more output positions ``M`` (classification: pixels, all
                classes of a pixel kept together; regression: output entries) than this
                contributes the GGN of ``m = max_outputs_per_sample`` positions drawn
                uniformly without replacement, times ``M / m``: its expectation is the exact
                GGN. Its rows are ``C m`` pullbacks through one forward pass: the cost follows
                ``m``, not the image size. The loss stays exact; ``hessian="ggn"`` only.
            generator: Seeds the subsampling.

        Returns:
            ``self``.
        """
        progress = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        sampling = Sampling(
            self._check_max_outputs(max_outputs_per_sample), check_generator(generator)
        )
        data = self._data(train_loader)
        reducer = Reducer(process_group)
        p = self.subset.numel
        previous = None if override or self.H is None else self.H
        stats = (0.0, 0, 0) if previous is None else (self._loss, self.n_data, self._n_entries)
        # this rank's shard from zero, summed over the ranks at the end
        self.H = self.mean.new_zeros(p, p)
        self._loss, self._n_entries = 0.0, 0
        seen = 0
        for batch in with_progress(reducer.shard(data), progress, f"{type(self).__name__}.fit"):
            inputs, targets = pair(batch)
            packed = self._prep.pack(inputs, finite=True)
            per_sample = [t.to(self.mean.device) for t in split_targets(targets, len(packed))]
            pending: Tensor | None = None  # empirical: a sample's gradient, over its blocks
            spec = FitSpec(
                per_sample, seen, self.likelihood, self.ignore_index, sampling, self._curvature
            )
            for block in self._jacobians(packed, spec):
                self._seen_output(block.shape)
                g = self._accumulate(block, spec.target(block.i, block.shape))
                if g is None:
                    continue
                if pending is not None and block.span[0] == 0:  # a new sample starts
                    self.H.addr_(pending, pending)
                    pending = None
                pending = g if pending is None else pending + g
            if pending is not None:
                self.H.addr_(pending, pending)
            seen += packed.num_samples
        reducer.sum_([self.H])
        loss, seen_f, n_out = reducer.sum_numbers(
            [self._loss, float(seen), float(self._n_entries)], self.H
        )
        if seen_f == 0:
            self.H = previous
            raise ValueError("data yielded no samples")
        if previous is not None:
            self.H += previous
        self._loss = stats[0] + loss
        self.n_data = stats[1] + int(seen_f)
        self._n_entries = stats[2] + int(n_out)
        self._scale = None
        self._warn_fallbacks()
        return self

    def _accumulate(self, block: Block, y: Tensor) -> Tensor | None:
        """Add one block's GGN and loss (``y``: the sample's checked, flat target); the
        empirical Fisher's gradient part is returned (its outer product is taken once a
        sample's blocks are summed)."""
        h = self._fitted()
        out, jac, (a, b) = block.out, block.jac, block.span
        regression = self.likelihood is Likelihood.REGRESSION
        y = y[a:b].to(out.dtype) if regression else y[a:b]
        valid = None if regression else y != self.ignore_index
        rows = out.reshape(1, -1) if regression else out.unsqueeze(0)
        self._loss += float(nll_sum(rows, y.unsqueeze(0), self.likelihood, 1.0, self.ignore_index))
        self._n_entries += out.numel() if regression else 0
        if block.ggn is not None:  # a whole sample's curvature (or gradient), computed already
            if block.ggn.dim() == 1:
                return block.ggn
            h.add_(block.ggn)
            return None
        if jac is None:  # pragma: no cover - a block without curvature carries its Jacobian
            raise RuntimeError("internal error: a Laplace block carries neither curvature nor rows")
        if self.hessian is HessianKind.EMPIRICAL:
            return jac.T @ output_gradient(out, y, self.likelihood, valid)
        root, mixed = ggn_factors(out, jac, self.likelihood, valid)
        h.addmm_(root.T, root)
        if mixed is not None:
            h.addmm_(mixed.T, mixed, alpha=-1.0)
        return None

    def _check_max_outputs(self, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"max_outputs_per_sample must be None or a positive int; got {value!r}"
            )
        if self.hessian is HessianKind.EMPIRICAL:
            raise ValueError(
                "max_outputs_per_sample subsamples the GGN; hessian='empirical' has no "
                f"unbiased subsample (got max_outputs_per_sample={value!r})"
            )
        return value

    def _curvature(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        fit: FitSpec,
        row_bytes: int,
    ) -> Block:
        """Sample ``i``'s block carrying its whole curvature, from ONE forward pass kept for
        reverse mode (its pullback ``pull``): the empirical gradient (one pullback); a random
        subset of its positions, or all of its rows when they are no more than ``P``, by
        pulling the rows back in blocks (:meth:`_reverse_ggn`); else ``H[:, A] = J^T Lambda
        J_A`` for column chunks ``A`` of the entries, ``J_A`` and its pullback from the same
        pass (:meth:`_column_ggn`). The model runs once for the sample, however many slices
        its rows would need."""
        one = packed.select([i])
        fn = self._function(one)
        levels = tuple(one.sample(0))
        with twice_differentiable():  # the column route differentiates the pullback
            flat, pull = torch.func.vjp(lambda *v: fn(v, *levels), *fn.values())
        out = self._rows(flat.detach(), shape)
        y = fit.target(i, shape)
        cls = self.likelihood is Likelihood.CLASSIFICATION
        valid = y != self.ignore_index if cls else None
        if self.hessian is HessianKind.EMPIRICAL:
            grad = output_gradient(out, y if cls else y.to(out.dtype), self.likelihood, valid)
            ggn = self._pulled(pull, grad.unsqueeze(0))[0]
        elif fit.sampled(self._positions(shape)) or out.numel() <= self.subset.numel:
            positions, scale = fit.sampling.draw(self._positions(shape), out.device)
            ggn = self._reverse_ggn(out, pull, valid, positions, row_bytes) * scale
        else:
            ggn = self._column_ggn(out, pull, valid, row_bytes)
        return Block(i, out, None, (0, out.shape[-1]), shape, ggn)

    def _pulled(self, pull: Callable[..., tuple[Tensor, ...]], cot: Tensor) -> Tensor:
        """``cot @ J`` ``(r, P)`` (flat order) for cotangents ``cot`` ``(r, O)`` through one
        kept forward pass."""
        grads = torch.func.vmap(pull)(cot)
        return self.subset.to_flat_order(torch.cat([g.reshape(len(cot), -1) for g in grads], 1))

    def _reverse_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        valid: Tensor | None,
        positions: Tensor,
        row_bytes: int,
    ) -> Tensor:
        """``sum J_q^T Lambda_q J_q`` over ``positions`` (all classes of each), the rows
        pulled back in blocks that fit ``row_bytes`` (each row: itself, its one-hot cotangent
        and the pulled copy)."""
        p, s = self.subset.numel, out.element_size()
        c = out.shape[0] if out.dim() == 2 else 1
        width, total = out.shape[-1], out.numel()
        step = laplace_reverse_rows(row_bytes, c, p, total, s)
        h = out.new_zeros(p, p)
        for a in range(0, len(positions), step):
            q = positions[a : a + step]
            rows = (torch.arange(c, device=q.device).unsqueeze(1) * width + q).reshape(-1)
            cot = out.new_zeros(rows.numel(), total)
            cot[torch.arange(rows.numel(), device=q.device), rows] = 1
            jac = self._pulled(pull, cot)
            sub = out[:, q] if out.dim() == 2 else out[q]
            root, mixed = ggn_factors(
                sub, jac, self.likelihood, None if valid is None else valid[q]
            )
            h.addmm_(root.T, root)
            if mixed is not None:
                h.addmm_(mixed.T, mixed, alpha=-1.0)
        return h

    def _column_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        valid: Tensor | None,
        row_bytes: int,
    ) -> Tensor:
        """``J^T Lambda J`` by column chunks ``A`` of the entries, all from the one kept
        forward pass: ``J_A`` by transposing the pullback (``v -> J^T v`` is linear, so its own
        pullback is ``u -> J u``: a double backward, vmapped over the chunk's one-hot
        tangents), then ``Lambda J_A`` pulled back gives the rows ``H[A, :]``. ``k`` columns
        at a time from ``row_bytes`` (the chunk, ``Lambda J_A`` and the pulled copy)."""
        p = self.subset.numel
        k = laplace_column_chunk(row_bytes, p, out.numel(), out.element_size())
        _, transposed = torch.func.vjp(pull, out.new_zeros(out.numel()))
        eye = torch.eye(p, dtype=out.dtype, device=out.device)

        def ggn_column(*tangent: Tensor) -> Tensor:  # J^T Lambda J e_j, grouped
            col = transposed(tangent)[0].unsqueeze(1)  # J e_j (O, 1)
            grads = pull(_lambda_times(out, col, self.likelihood, valid).squeeze(1))
            return torch.cat([g.reshape(-1) for g in grads])

        h = out.new_zeros(p, p)
        for a in range(0, p, k):
            tangents = tuple(self.subset.split(eye[a : a + k]).values())
            h[a : a + k] = self.subset.to_flat_order(torch.func.vmap(ggn_column)(*tangents))
        return (h + h.T) / 2


class DiagCurvature(LaplaceBase):
    """The diagonal ``h`` ``(P,)`` of the GGN (or of the empirical Fisher) and the loss at the
    MAP, in one pass of :func:`~multiscale_jac.diag_fisher` over the data."""

    #: :func:`~multiscale_jac.diag_fisher`'s options (set by the class's constructor)
    _fisher_options: dict[str, Any]

    @fitting
    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
        process_group: Any = None,
    ) -> Self:
        """Accumulate the diagonal curvature ``h`` (``(P,)``) and the loss at the MAP, in one
        pass over the data (arguments as :meth:`SubnetLaplace.fit`).

        Returns:
            ``self``.
        """
        show = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        kind = "exact" if self.hessian is HessianKind.GGN else "empirical"
        res = diag_fisher(  # the loss at the MAP from the fisher's own forward passes
            self.model,
            self._data(train_loader),
            params=self.subset,
            likelihood=self.likelihood,
            kind=kind,
            sigma_noise=1.0,
            progress=show,
            process_group=process_group,
            return_loss=True,
            **self._fisher_options,
        )
        n_out = res.num_outputs if self.likelihood is Likelihood.REGRESSION else 0
        h = (res.flat * res.num_samples).to(self.mean)
        loss = float(res.loss)  # type: ignore[arg-type]
        self._record_fit(h, loss, res.num_samples, int(n_out), res.output_dim, override)
        return self


def _lambda_times(out: Tensor, jac: Tensor, likelihood: Likelihood, valid: Tensor | None) -> Tensor:
    """``Lambda J`` for rows ``jac`` ``(O, k)`` of one sample: per position ``(diag(p) - p
    p^T) J`` (classification, ``out`` ``(C, m)``; ``p`` zero where not ``valid``) or ``J``."""
    if likelihood is Likelihood.REGRESSION:
        return jac
    c, m = out.shape
    prob = torch.softmax(out, dim=0)
    if valid is not None:
        prob = prob * valid.to(prob.dtype)
    pj = prob.unsqueeze(-1) * jac.reshape(c, m, -1)
    return (pj - prob.unsqueeze(-1) * pj.sum(0, keepdim=True)).reshape(c * m, -1)


def _span_fn(
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

"""The subset GGN (or empirical Fisher) ``H`` ``(P, P)`` over the data: :class:`SubnetLaplace`'s
curvature.

From every sample's Jacobian rows (:class:`~._jacobian_rows.JacobianRows`), or, for a sample
above the budget or subsampled, from ONE forward pass kept for reverse mode (its rows pulled
back in blocks, or ``H`` by column chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .._checks import check_generator
from .._distributed import Reducer
from .._likelihood import ggn_factors, nll_sum, output_dim, output_gradient
from .._memory import laplace_column_chunk, laplace_reverse_rows
from .._ops import twice_differentiable
from .._stream import pair, split_targets, with_progress
from ..enums import HessianKind, Likelihood
from ..packing import PackedBatch
from ..subset import ParamSubset
from ._fit import CurvatureFit
from ._jacobian_rows import Block, FitSpec, JacobianRows, Sampling, block_rows, positions

__all__ = ["SubsetGGN"]


class SubsetGGN:
    """``H = sum_i J_i^T Lambda_i J_i`` (``hessian="ggn"``) or ``sum_i g_i g_i^T``
    (``"empirical"``) over a subset, ``(P, P)``.

    Args:
        owner: The Laplace class's name (for messages and the progress bar).
        rows: The posterior's Jacobian rows.
        subset: The entries.
        hessian: ``ggn`` or ``empirical``.
        ignore_index: Label of positions left out of dense classification.
        like: A tensor of the curvature's dtype and device.
    """

    def __init__(
        self,
        owner: str,
        rows: JacobianRows,
        subset: ParamSubset,
        hessian: HessianKind,
        ignore_index: int,
        like: Tensor,
    ) -> None:
        self._owner, self._rows, self._subset = owner, rows, subset
        self._hessian, self._ignore = hessian, ignore_index
        self._like = like

    def fit(
        self,
        data: Iterable[tuple[Any, Any]],
        likelihood: Likelihood,
        *,
        progress: bool,
        process_group: Any,
        max_outputs_per_sample: int | None,
        generator: torch.Generator | None,
    ) -> CurvatureFit:
        """One pass over ``data``: ``H``, the loss at the MAP and the counts (with
        ``torch.distributed``, this rank's shard, all-reduced at the end)."""
        sampling = Sampling(
            self._check_max_outputs(max_outputs_per_sample), check_generator(generator)
        )
        reducer = Reducer(process_group)
        p = self._subset.numel
        h = self._like.new_zeros(p, p)
        totals = [0.0, 0]  # loss, regression entries
        n_outputs: int | None = None
        seen = 0
        for batch in with_progress(reducer.shard(data), progress, f"{self._owner}.fit"):
            inputs, targets = pair(batch)
            packed = self._rows.pack(inputs, finite=True)
            per_sample = [t.to(h.device) for t in split_targets(targets, len(packed))]
            pending: Tensor | None = None  # empirical: a sample's gradient, over its blocks
            spec = FitSpec(per_sample, seen, likelihood, self._ignore, sampling, self._whole)
            for block in self._rows.jacobians(packed, likelihood, spec):
                n_outputs = output_dim(tuple(block.shape))
                g = self._accumulate(h, totals, block, spec)
                if g is None:
                    continue
                if pending is not None and block.span[0] == 0:  # a new sample starts
                    h.addr_(pending, pending)
                    pending = None
                pending = g if pending is None else pending + g
            if pending is not None:
                h.addr_(pending, pending)
            seen += packed.num_samples
        reducer.sum_([h])
        loss, seen_f, n_out = reducer.sum_numbers([totals[0], float(seen), float(totals[1])], h)
        if seen_f == 0:
            raise ValueError("data yielded no samples")
        self._rows.warn_fallbacks()
        return CurvatureFit(h, loss, int(seen_f), int(n_out), n_outputs)

    def combine(self, old: CurvatureFit, new: CurvatureFit) -> Tensor:
        """``H`` of both fits: the sum."""
        return old.h + new.h

    def zeros(self, like: Tensor) -> Tensor:
        p = self._subset.numel
        return like.new_zeros(p, p)

    def h_state(self, h: Tensor) -> Tensor:
        return h

    def h_from_state(self, value: Any, like: Tensor) -> Tensor:
        p = self._subset.numel
        t = torch.as_tensor(value).to(like)
        if t.shape != (p, p):
            raise ValueError(f"load_state_dict: H of shape {tuple(t.shape)} for P={p}")
        return t

    def _accumulate(
        self, h: Tensor, totals: list[Any], block: Block, spec: FitSpec
    ) -> Tensor | None:
        """Add one block's GGN to ``h`` and its loss (and regression entries) to ``totals``;
        the empirical Fisher's gradient part is returned (its outer product is taken once a
        sample's blocks are summed)."""
        y = spec.target(block.i, block.shape)
        out, jac, (a, b) = block.out, block.jac, block.span
        regression = spec.likelihood is Likelihood.REGRESSION
        y = y[a:b].to(out.dtype) if regression else y[a:b]
        valid = None if regression else y != self._ignore
        rows = out.reshape(1, -1) if regression else out.unsqueeze(0)
        totals[0] += float(nll_sum(rows, y.unsqueeze(0), spec.likelihood, 1.0, self._ignore))
        totals[1] += out.numel() if regression else 0
        if block.ggn is not None:  # a whole sample's curvature (or gradient), computed already
            if block.ggn.dim() == 1:
                return block.ggn
            h.add_(block.ggn)
            return None
        if jac is None:  # pragma: no cover - a block without curvature carries its Jacobian
            raise RuntimeError("internal error: a Laplace block carries neither curvature nor rows")
        if self._hessian is HessianKind.EMPIRICAL:
            return jac.T @ output_gradient(out, y, spec.likelihood, valid)
        root, mixed = ggn_factors(out, jac, spec.likelihood, valid)
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
        if self._hessian is HessianKind.EMPIRICAL:
            raise ValueError(
                "max_outputs_per_sample subsamples the GGN; hessian='empirical' has no "
                f"unbiased subsample (got max_outputs_per_sample={value!r})"
            )
        return value

    def _whole(
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
        fn = self._rows.function(one)
        levels = tuple(one.sample(0))
        with twice_differentiable():  # the column route differentiates the pullback
            flat, pull = torch.func.vjp(lambda *v: fn(v, *levels), *fn.values())
        cls = fit.likelihood is Likelihood.CLASSIFICATION
        out = block_rows(flat.detach(), shape, cls)
        y = fit.target(i, shape)
        valid = y != self._ignore if cls else None
        if self._hessian is HessianKind.EMPIRICAL:
            grad = output_gradient(out, y if cls else y.to(out.dtype), fit.likelihood, valid)
            ggn = self._pulled(pull, grad.unsqueeze(0))[0]
        elif fit.sampled(positions(shape, cls)) or out.numel() <= self._subset.numel:
            picked, scale = fit.sampling.draw(positions(shape, cls), out.device)
            ggn = self._reverse_ggn(out, pull, fit.likelihood, valid, picked, row_bytes) * scale
        else:
            ggn = self._column_ggn(out, pull, fit.likelihood, valid, row_bytes)
        return Block(i, out, None, (0, out.shape[-1]), shape, ggn)

    def _pulled(self, pull: Callable[..., tuple[Tensor, ...]], cot: Tensor) -> Tensor:
        """``cot @ J`` ``(r, P)`` (flat order) for cotangents ``cot`` ``(r, O)`` through one
        kept forward pass."""
        grads = torch.func.vmap(pull)(cot)
        return self._subset.to_flat_order(torch.cat([g.reshape(len(cot), -1) for g in grads], 1))

    def _reverse_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        likelihood: Likelihood,
        valid: Tensor | None,
        positions: Tensor,
        row_bytes: int,
    ) -> Tensor:
        """``sum J_q^T Lambda_q J_q`` over ``positions`` (all classes of each), the rows
        pulled back in blocks that fit ``row_bytes`` (each row: itself, its one-hot cotangent
        and the pulled copy)."""
        p, s = self._subset.numel, out.element_size()
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
            root, mixed = ggn_factors(sub, jac, likelihood, None if valid is None else valid[q])
            h.addmm_(root.T, root)
            if mixed is not None:
                h.addmm_(mixed.T, mixed, alpha=-1.0)
        return h

    def _column_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        likelihood: Likelihood,
        valid: Tensor | None,
        row_bytes: int,
    ) -> Tensor:
        """``J^T Lambda J`` by column chunks ``A`` of the entries, all from the one kept
        forward pass: ``J_A`` by transposing the pullback (``v -> J^T v`` is linear, so its own
        pullback is ``u -> J u``: a double backward, vmapped over the chunk's one-hot
        tangents), then ``Lambda J_A`` pulled back gives the rows ``H[A, :]``. ``k`` columns
        at a time from ``row_bytes`` (the chunk, ``Lambda J_A`` and the pulled copy)."""
        p = self._subset.numel
        k = laplace_column_chunk(row_bytes, p, out.numel(), out.element_size())
        _, transposed = torch.func.vjp(pull, out.new_zeros(out.numel()))
        eye = torch.eye(p, dtype=out.dtype, device=out.device)

        def ggn_column(*tangent: Tensor) -> Tensor:  # J^T Lambda J e_j, grouped
            col = transposed(tangent)[0].unsqueeze(1)  # J e_j (O, 1)
            grads = pull(_lambda_times(out, col, likelihood, valid).squeeze(1))
            return torch.cat([g.reshape(-1) for g in grads])

        h = out.new_zeros(p, p)
        for a in range(0, p, k):
            tangents = tuple(self._subset.split(eye[a : a + k]).values())
            h[a : a + k] = self._subset.to_flat_order(torch.func.vmap(ggn_column)(*tangents))
        return (h + h.T) / 2


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

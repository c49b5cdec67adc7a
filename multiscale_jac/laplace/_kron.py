"""The Kronecker-factored posterior form (K-FAC): ``P_post`` block-diagonal over the selected
tensors, each block ``factor * (F_1 (x) F_2) + delta I``.

The curvature ``H`` (:class:`KronCurvatureFactors`) holds one block per selected tensor, in the
subset's order, as laplace-torch's ``Kron.kfacs``: a weight ``[G, A_w]`` (its block is
``G (x) A_w`` over ``weight.flatten()``), a bias ``[G]``. Each factor is eigendecomposed once (``F = Q diag(l) Q^T``), so every
block of ``P_post`` has eigenvectors ``Q_1 (x) Q_2`` and eigenvalues ``factor * l_1 l_2^T +
delta`` (``delta``: the block's prior precision, one value per tensor): the log-determinant, the
whitening of Jacobian rows, draws and marginal variances never form a ``P x P`` matrix, and are
differentiable in the prior and the noise (marginal-likelihood tuning).

:class:`KronPrecision` is what ``posterior_precision`` returns (laplace-torch's
``KronDecomposed``: ``logdet()``, ``to_matrix(exponent)``, ``bmm``, ``inv_square_form``,
``diag``); :class:`KronForm` implements :class:`~._posterior.PosteriorForm` with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._memory import laplace_kept
from ..subset import ParamSubset
from ._posterior import PrecisionTerms

__all__ = ["KronBlock", "KronCurvatureFactors", "KronForm", "KronPrecision"]


@dataclass
class KronBlock:
    """One selected tensor's curvature block ``F_1 (x) ... (x) F_k`` (``k`` 1 or 2) over its
    entries in flat (row-major) order."""

    name: str
    factors: list[Tensor]
    _eig: list[tuple[Tensor, Tensor]] | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for f in self.factors:
            n *= f.shape[0]
        return n

    def eig(self) -> list[tuple[Tensor, Tensor]]:
        """``(l, Q)`` of every factor (``F = Q diag(l) Q^T``; eigenvalues clamped at 0), cached."""
        if self._eig is None:
            pairs = []
            for f in self.factors:
                vals, q = torch.linalg.eigh((f + f.T) / 2)
                pairs.append((vals.clamp(min=0), q))
            self._eig = pairs
        return self._eig

    def outer(self) -> Tensor:
        """The eigenvalues of the block, ``l_1 l_2^T`` flattened ``(numel,)``."""
        vals = [v for v, _ in self.eig()]
        out = vals[0]
        for v in vals[1:]:
            out = (out.unsqueeze(-1) * v).reshape(-1)
        return out

    def rotate(self, x: Tensor, transpose: bool) -> Tensor:
        """``(Q_1 (x) Q_2) x`` (or its transpose) for ``x`` ``(numel, S)``."""
        qs = [q.T if transpose else q for _, q in self.eig()]
        if len(qs) == 1:
            return qs[0] @ x
        d1, d2 = qs[0].shape[0], qs[1].shape[0]
        s = x.shape[1]
        # Q_1 over the first index, then Q_2 over the second: two plain matrix products (a
        # broadcast batched product over the first index is half as fast)
        y = (qs[0] @ x.reshape(d1, d2 * s)).reshape(d1, d2, s).transpose(0, 1)
        y = qs[1] @ y.reshape(d2, d1 * s)
        return y.reshape(d2, d1, s).transpose(0, 1).reshape(d1 * d2, s)

    def dense(self) -> Tensor:
        out = self.factors[0]
        for f in self.factors[1:]:
            out = torch.kron(out, f)
        return out


@dataclass
class KronCurvatureFactors:
    """The fitted K-FAC curvature: one :class:`KronBlock` per selected tensor (subset order).

    ``kfacs`` is laplace-torch's list of factor lists; ``to_matrix()`` the dense block diagonal
    (small models only)."""

    blocks: list[KronBlock]

    @property
    def kfacs(self) -> list[list[Tensor]]:
        return [b.factors for b in self.blocks]

    def to_matrix(self) -> Tensor:
        return torch.block_diag(*[b.dense() for b in self.blocks])

    def clone(self) -> KronCurvatureFactors:
        """A copy with cloned factors."""
        return KronCurvatureFactors(
            [KronBlock(b.name, [f.clone() for f in b.factors]) for b in self.blocks]
        )

    def scaled(self, weight_scale: float) -> KronCurvatureFactors:
        """The blocks with the last factor of every two-factor block times ``weight_scale``
        (laplace-torch's rescaling of ``A`` when fits are combined)."""
        out = []
        for b in self.blocks:
            fs = (
                [*b.factors[:-1], b.factors[-1] * weight_scale]
                if len(b.factors) == 2
                else b.factors
            )
            out.append(KronBlock(b.name, fs))
        return KronCurvatureFactors(out)

    def __add__(self, other: KronCurvatureFactors) -> KronCurvatureFactors:
        return KronCurvatureFactors(
            [
                KronBlock(a.name, [x + y for x, y in zip(a.factors, b.factors)])
                for a, b in zip(self.blocks, other.blocks)
            ]
        )


class KronPrecision:
    """``P_post = factor * H + delta``, block by block in the eigenbases of ``H``'s factors
    (laplace-torch's ``KronDecomposed``).

    Args:
        h: The fitted factors.
        factor: ``1 / (sigma^s T)`` (a number or a 0-d tensor).
        deltas: The prior precision of every block (one value each).
    """

    def __init__(self, h: KronCurvatureFactors, factor: Tensor | float, deltas: Sequence[Any]):
        self.h, self.factor, self.deltas = h, factor, list(deltas)
        self._rsqrt: list[Tensor] | None = None  # kept when nothing requires grad

    def _inverse_roots(self) -> list[Tensor]:
        """Every block's eigenvalues to the power -1/2, kept unless the factor or the prior
        requires grad (a kept graph could not be differentiated twice)."""
        if self._rsqrt is not None:
            return self._rsqrt
        roots = [lam.rsqrt() for lam in self.eigenvalues]
        terms = [self.factor, *self.deltas]
        if not any(isinstance(t, Tensor) and t.requires_grad for t in terms):
            self._rsqrt = roots
        return roots

    def clone(self) -> KronPrecision:
        """A copy over cloned factors."""
        return KronPrecision(self.h.clone(), self.factor, self.deltas)

    @property
    def eigenvalues(self) -> list[Tensor]:
        """Every block's eigenvalues ``(numel,)``."""
        return [self.factor * b.outer() + d for b, d in zip(self.h.blocks, self.deltas)]

    def logdet(self) -> Tensor:
        """``log det P_post`` (differentiable in the factor and the prior)."""
        return sum(lam.log().sum() for lam in self.eigenvalues)  # type: ignore[return-value]

    def matmul(self, x: Tensor, exponent: float = 1) -> Tensor:
        """``P_post^exponent x`` for ``x`` ``(P,)`` or ``(P, S)``."""
        vec = x.dim() == 1
        x = x.unsqueeze(1) if vec else x
        parts, start = [], 0
        for b, lam in zip(self.h.blocks, self.eigenvalues):
            xb = x[start : start + b.numel]
            start += b.numel
            y = b.rotate(xb, transpose=True) * lam.pow(exponent).unsqueeze(1)
            parts.append(b.rotate(y, transpose=False))
        out = torch.cat(parts)
        return out.squeeze(1) if vec else out

    def bmm(self, w: Tensor, exponent: float = 1) -> Tensor:
        """``w P_post^exponent`` over ``w``'s last dim (``(P,)``, ``(K, P)`` or ``(B, K, P)``;
        ``P_post`` is symmetric)."""
        shape = w.shape
        flat = w.reshape(-1, shape[-1]).T
        return self.matmul(flat, exponent).T.reshape(shape)

    def inv_square_form(self, js: Tensor) -> Tensor:
        """``J P_post^{-1} J^T`` for Jacobians ``js`` ``(B, K, P)`` -> ``(B, K, K)``."""
        return torch.einsum("bkp,bcp->bkc", self.bmm(js, -1), js)

    def diag(self, exponent: float = 1) -> Tensor:
        """The diagonal of ``P_post^exponent`` ``(P,)``."""
        parts = []
        for b, lam in zip(self.h.blocks, self.eigenvalues):
            sq = [q.square() for _, q in b.eig()]
            v = lam.pow(exponent)
            if len(sq) == 1:
                parts.append(sq[0] @ v)
            else:
                d1, d2 = sq[0].shape[0], sq[1].shape[0]
                parts.append((sq[0] @ v.reshape(d1, d2) @ sq[1].T).reshape(-1))
        return torch.cat(parts)

    def to_matrix(self, exponent: float = 1) -> Tensor:
        """``P_post^exponent`` as a dense block-diagonal ``(P, P)`` matrix (small models)."""
        blocks = []
        for b, lam in zip(self.h.blocks, self.eigenvalues):
            eye = torch.eye(b.numel, dtype=lam.dtype, device=lam.device)
            v = b.rotate(eye, transpose=False)
            blocks.append(v @ torch.diag(lam.pow(exponent)) @ v.T)
        return torch.block_diag(*blocks)

    def whiten(self, jac: Tensor) -> Tensor:
        """``V`` ``(P, rows)`` with ``V^T V = J P_post^{-1} J^T`` for rows ``jac`` ``(rows, P)``."""
        parts, start = [], 0
        for b, root in zip(self.h.blocks, self._inverse_roots()):
            jb = jac[:, start : start + b.numel].T
            start += b.numel
            parts.append(b.rotate(jb, transpose=True) * root.unsqueeze(1))
        return torch.cat(parts)

    def __repr__(self) -> str:
        sizes = [b.numel for b in self.h.blocks]
        return f"KronPrecision({len(sizes)} blocks, P={sum(sizes)})"


class KronForm:
    """:class:`~._posterior.PosteriorForm` of K-FAC: ``terms.h`` is a
    :class:`KronCurvatureFactors`; the prior must be one value per selected tensor."""

    def precision(self, terms: PrecisionTerms) -> KronPrecision:
        return KronPrecision(terms.h, terms.factor, block_priors(terms.h, terms.prior))

    def scale(self, terms: PrecisionTerms) -> KronPrecision:
        return self.precision(terms)

    def logdet(self, terms: PrecisionTerms) -> Tensor:
        return self.precision(terms).logdet()

    def variance(self, terms: PrecisionTerms, scale: Callable[[], Any]) -> Tensor:
        return self.precision(terms).diag(-1)

    def covariance(self, terms: PrecisionTerms, scale: Callable[[], Any]) -> Tensor:
        return self.precision(terms).to_matrix(-1)

    def whiten(self, scale: KronPrecision, jac: Tensor) -> Tensor:
        return scale.whiten(jac)

    def draw(self, scale: KronPrecision, z: Tensor) -> Tensor:
        return scale.matmul(z, -0.5)

    def kept_bytes(self, subset: ParamSubset, itemsize: int) -> int:
        return laplace_kept("kron", subset.numel, itemsize)


def block_priors(h: KronCurvatureFactors, prior: Tensor) -> list[Tensor]:
    """One prior precision per block from the ``(P,)`` diagonal (constant on every block)."""
    out, start = [], 0
    for b in h.blocks:
        part = prior[start : start + b.numel]
        start += b.numel
        if part.numel() > 1 and not bool((part.detach() == part.detach()[0]).all()):
            raise ValueError(
                f"a Kronecker-factored posterior takes one prior precision per tensor; "
                f"{b.name!r} has {part.numel()} different values"
            )
        out.append(part[0])
    return out

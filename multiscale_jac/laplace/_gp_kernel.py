"""The function-space (GP) Laplace's algebra on a context of ``M`` samples (laplace-torch's
``FunctionalLaplace``, Immer et al. 2021): the neural tangent kernel ``K = J J^T`` of the
context, the likelihood's output Hessian ``Lambda`` (its diagonal, as laplace-torch) and the
residual ``mu`` of the marginal likelihood's scatter term.

Shapes: ``M`` context samples, ``O`` outputs, ``n`` query samples. With dependent outputs the
kernel is ``(M O, M O)`` (sample-major); with ``independent_outputs`` one ``(M, M)`` per output,
``(O, M, M)``. ``s`` is the kernel's prior variance, ``(M / N) / prior_precision``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._likelihood import check_target, nll_sum
from ..enums import Likelihood


def chunk_terms(
    js: Tensor, f: Tensor, ys: Tensor, first: int, likelihood: Likelihood, shift: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's loss at the MAP, output-Hessian diagonals ``(b, O)`` and scatter residuals
    (``J (mu_0 - theta)`` taken off; ``shift`` is ``mu_0 - theta`` ``(P,)``), from its
    Jacobians ``js`` ``(b, O, P)``, outputs ``f`` ``(b, O)`` and targets ``ys``."""
    targets = [check_target(t, f.shape[1:], likelihood, -100, first + i) for i, t in enumerate(ys)]
    regression = likelihood is Likelihood.REGRESSION
    target = torch.stack(targets).reshape(f.shape if regression else f.shape[:1])
    loss = nll_sum(f, target, likelihood, 1.0, -100)
    moved = torch.einsum("bcp,p->bc", js, shift)
    if regression:
        return loss, torch.ones_like(f), target.to(f.dtype) - (f + moved)
    p = torch.softmax(f, dim=-1)
    return loss, p - p * p, -moved  # the diagonal of diag(p) - p p^T


def kernel(ja: Tensor, jb: Tensor, independent: bool) -> Tensor:
    """``J_a J_b^T`` of Jacobians ``(a, O, P)`` and ``(b, O, P)``: ``(a O, b O)``, or
    ``(O, a, b)`` per output."""
    if independent:
        return torch.einsum("acp,bcp->cab", ja, jb)
    return ja.reshape(-1, ja.shape[-1]) @ jb.reshape(-1, jb.shape[-1]).T


@dataclass
class GPTerms:
    """A fitted context: ``k`` (see the module), ``lam`` ``(M, O)`` (the diagonal of each
    sample's output Hessian at ``sigma = 1``) and ``mu`` ``(M, O)``."""

    k: Tensor
    lam: Tensor
    mu: Tensor
    independent: bool

    def _outputs(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(K, lambda, mu)`` per independent block: one per output, or the whole."""
        if self.independent:
            return [(self.k[c], self.lam[:, c], self.mu[:, c]) for c in range(self.k.shape[0])]
        return [(self.k, self.lam.reshape(-1), self.mu.reshape(-1))]

    def cholesky(self, s: Tensor, h_factor: Tensor) -> list[Tensor]:
        """Lower factors of ``s K + diag(1 / (h_factor lambda))`` per block (laplace-torch's
        ``Sigma_inv``; an infinite entry of the noise, a zero ``lambda``, becomes 10 as there)."""
        return [
            torch.linalg.cholesky(
                s * k + torch.diag(torch.nan_to_num(1 / (h_factor * lam), posinf=10.0))
            )
            for k, lam, _ in self._outputs()
        ]

    def variance(
        self, chol: list[Tensor], s: Tensor, j_star: Tensor, k_m_star: Tensor, joint: bool
    ) -> Tensor:
        """The GP posterior's (co)variance ``k_** - k_*M (s K + Lambda^-1)^-1 k_M*`` at queries
        with Jacobians ``j_star`` ``(n, O, P)``; ``k_m_star``: ``kernel(J_M, j_star)`` unscaled.

        Returns:
            ``(n, O, O)``, or with ``joint`` ``(n O, n O)`` (sample-major).
        """
        n, o = j_star.shape[:2]
        k_m_star = s * k_m_star
        if self.independent:  # one (M, n) block per output
            v = [
                torch.linalg.solve_triangular(c, k_m_star[i], upper=False)
                for i, c in enumerate(chol)
            ]
            if joint:
                cov = s * kernel(j_star, j_star, True) - torch.stack([x.T @ x for x in v])
                out = torch.zeros(n, o, n, o, dtype=cov.dtype, device=cov.device)
                for c in range(o):
                    out[:, c, :, c] = cov[c]
                return out.reshape(n * o, n * o)
            var = s * (j_star * j_star).sum(-1) - torch.stack([(x * x).sum(0) for x in v]).T
            return torch.diag_embed(var)  # (n, O, O)
        v = torch.linalg.solve_triangular(chol[0], k_m_star, upper=False)  # (M O, n O)
        if joint:
            return s * kernel(j_star, j_star, False) - v.T @ v
        vv = v.reshape(-1, n, o)
        return s * torch.einsum("iop,iqp->ioq", j_star, j_star) - torch.einsum(
            "kio,kip->iop", vv, vv
        )

    def log_det_ratio(self, s: Tensor, h_factor: Tensor, noise: Tensor | None) -> Tensor:
        """laplace-torch's ``log_det_ratio``: regression (``noise``: ``sigma^2``)
        ``log det(s K + sigma^2 I)``; classification ``log det(W s K W + I)`` with
        ``W = sqrt(h_factor lambda)``; summed over the blocks."""
        total = torch.zeros((), dtype=self.k.dtype, device=self.k.device)
        for k, lam, _ in self._outputs():
            eye = torch.eye(k.shape[0], dtype=k.dtype, device=k.device)
            if noise is not None:
                total = total + torch.logdet(s * k + eye * noise)
            else:
                w = torch.sqrt(h_factor * lam)
                total = total + torch.logdet(w[:, None] * s * k * w + eye)
        return total

    def scatter(self, s: Tensor, noise: Tensor) -> Tensor:
        """laplace-torch's ``scatter``: ``|L^-1 mu|^2`` with ``L L^T = s K + noise I`` per
        block (``noise``: ``sigma^2``, or ``1e-5`` for classification)."""
        total = torch.zeros((), dtype=self.k.dtype, device=self.k.device)
        for k, _, mu in self._outputs():
            eye = torch.eye(k.shape[0], dtype=k.dtype, device=k.device)
            chol = torch.linalg.cholesky(s * k + eye * noise)
            t = torch.linalg.solve_triangular(chol, mu.unsqueeze(-1), upper=False).squeeze(-1)
            total = total + t @ t
        return total

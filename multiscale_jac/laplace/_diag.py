""":class:`DiagLaplace`: the diagonal posterior, from :func:`~multiscale_jac.diag_fisher`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..enums import HessianKind, Likelihood
from ..fisher import diag_fisher
from ._base import LaplaceBase, Parts
from ._fit import CurvatureFit, refuse_unsupported
from ._forms import DiagForm
from ._options import LaplaceOptions

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["DiagGGN", "DiagLaplace"]


class DiagGGN:
    """The diagonal ``h`` ``(P,)`` of the GGN (or of the empirical Fisher) and the loss at the
    MAP, in one pass of :func:`~multiscale_jac.diag_fisher` over the data.

    Args:
        prep: The checked model, subset and policies.
        options: The posterior's options.
        like: A tensor of the curvature's dtype and device.
    """

    def __init__(self, prep: Prepared, options: LaplaceOptions, like: Tensor) -> None:
        self._prep, self._like = prep, like
        self._kind = "exact" if options.hessian is HessianKind.GGN else "empirical"
        self._options = {
            **options.batched(prep),
            "strict": options.strict,
            "method": options.method,
            "tune": options.tune,
        }

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
        """One pass of :func:`~multiscale_jac.diag_fisher` (its own forward passes give the
        loss at the MAP)."""
        refuse_unsupported(
            "DiagLaplace", max_outputs_per_sample=max_outputs_per_sample, generator=generator
        )
        res = diag_fisher(
            self._prep.model,
            data,
            params=self._prep.subset,
            likelihood=likelihood,
            kind=self._kind,
            sigma_noise=1.0,
            progress=progress,
            process_group=process_group,
            return_loss=True,
            **self._options,
        )
        n_out = res.num_outputs if likelihood is Likelihood.REGRESSION else 0
        h = (res.flat * res.num_samples).to(self._like)
        loss = float(res.loss)  # type: ignore[arg-type]
        return CurvatureFit(h, loss, res.num_samples, int(n_out), res.output_dim)

    def combine(self, old: CurvatureFit, new: CurvatureFit) -> Tensor:
        """``h`` of both fits: the sum."""
        return old.h + new.h

    def zeros(self, like: Tensor) -> Tensor:
        return like.new_zeros(self._prep.subset.numel)

    def h_state(self, h: Tensor) -> Tensor:
        return h

    def h_from_state(self, value: Any, like: Tensor) -> Tensor:
        p = self._prep.subset.numel
        t = torch.as_tensor(value).to(like)
        if t.shape != (p,):
            raise ValueError(f"load_state_dict: H of shape {tuple(t.shape)} for P={p}")
        return t


class DiagLaplace(LaplaceBase):
    """Diagonal Laplace: ``P_post = diag(h) / (sigma^s T) + diag(p_0)``, where ``h`` ``(P,)`` is
    the diagonal of ``sum_i J_i^T Lambda_i J_i`` (``hessian="ggn"``) or of ``sum_i g_i g_i^T``
    (``hessian="empirical"``).

    ``h`` comes from :func:`~multiscale_jac.diag_fisher`'s closed forms (per-layer sums of
    squares from batched passes; ``vmap`` or per-sample Jacobians where a layer has none), so the
    memory is ``O(P)`` and every weight of a network can be covered. Everything else is shared
    with :class:`SubnetLaplace`, with the diagonal in place of the full matrix: the marginal
    likelihood (``log det P_post`` is the sum of the logs of the diagonal), the GLM predictive
    ``f_var = J diag(Sigma) J^T`` (per-sample Jacobian rows in chunks, never ``N x P``), the
    link approximations, sampling, prior tuning and laplace-torch's calls. laplace-torch's
    ``DiagLaplace`` computes the same quantities. ``subset`` defaults to every parameter that
    requires grad; ``method`` is how :func:`~multiscale_jac.diag_fisher` computes ``h``;
    ``chunk_size`` is the samples per batched run of the fit and per engine call of the
    predictive; ``memory_budget`` bounds the fit's working set (see
    :func:`~multiscale_jac.diag_fisher`) and the predictive's. The fit takes no
    ``max_outputs_per_sample``.
    """

    def _parts(self, prep: Prepared, options: LaplaceOptions, theta: Tensor) -> Parts:
        return Parts(DiagForm(), lambda rows: DiagGGN(prep, options, theta), takes_method=True)

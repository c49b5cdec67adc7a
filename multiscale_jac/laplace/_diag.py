""":class:`DiagLaplace`: the diagonal posterior, from :func:`~multiscale_jac.diag_fisher`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..enums import (
    FisherMethod,
    Likelihood,
    parse_enum,
)
from ..subset import ParamSubset
from ._curvature import DiagCurvature
from ._marglik import MarginalLikelihood
from ._posterior import DiagForm
from ._predictive import Predictive
from ._saving import Saving

__all__ = ["DiagLaplace"]


class DiagLaplace(DiagCurvature, Predictive, MarginalLikelihood, Saving):
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
    ``DiagLaplace`` computes the same quantities.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed.
        likelihood: ``classification`` or ``regression``.
        subset: The entries the posterior is over (a :class:`ParamSubset`, a name/glob or a
            list of them); default: every parameter that requires grad.
        method: How :func:`~multiscale_jac.diag_fisher` computes ``h`` (``auto``,
            ``layerwise`` or ``vmap``).
        **options: :class:`SubnetLaplace`'s keyword arguments, with its meaning
            (``chunk_size``: samples per batched run of the fit and per engine call of the
            predictive; ``memory_budget``: bytes of the working set of :meth:`fit`, see
            :func:`~multiscale_jac.diag_fisher`, and of :meth:`predictive`).

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    form = DiagForm()

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str] | None = None,
        *,
        method: str | FisherMethod = "auto",
        **options: Any,
    ) -> None:
        if subset is None and isinstance(model, nn.Module):
            subset = ParamSubset.all(model, trainable_only=True)
        super().__init__(model, likelihood, subset, **options)  # type: ignore[arg-type]
        self._fisher_options = {
            **self._batched_options(),
            "strict": self.strict,
            "method": parse_enum(FisherMethod, method, "method"),
            "tune": self.tune,
        }

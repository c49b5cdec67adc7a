""":class:`DiagLaplace`: the diagonal posterior, from :func:`~multiscale_jac.diag_fisher`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..enums import (
    BatchNormPolicy,
    Entries,
    FisherMethod,
    HessianKind,
    InputKind,
    Likelihood,
    Randomness,
    parse_enum,
)
from ..subset import ParamSubset
from ._curvature import DiagCurvature
from ._marglik import MarginalLikelihood
from ._posterior import DiagForm
from ._predictive import Predictive

__all__ = ["DiagLaplace"]


class DiagLaplace(DiagCurvature, Predictive, MarginalLikelihood):
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
        prior_precision: A number, a ``(P,)`` diagonal or one value per selected tensor.
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default; one backward pass per class, or per regression output, of
            a chunk) or ``empirical`` (one backward pass per chunk).
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per batched run (fit) and per engine call (predictive).
        memory_budget: Bytes of the working set of :meth:`fit` (see
            :func:`~multiscale_jac.diag_fisher`) and of :meth:`predictive`.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back.
        entries: How the predictive's engine forms single-entry columns.
        method: How :func:`~multiscale_jac.diag_fisher` computes ``h`` (``auto``,
            ``layerwise`` or ``vmap``).

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
        prior_precision: Any = 1.0,
        sigma_noise: float = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        hessian: str | HessianKind = "ggn",
        output_fn: Callable[[Any], Any] | None = None,
        ignore_index: int = -100,
        input_kind: str | InputKind | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        randomness: str | Randomness = "error",
        batch_norm: str | BatchNormPolicy = "error",
        strict: bool = False,
        entries: str | Entries = "auto",
        method: str | FisherMethod = "auto",
    ) -> None:
        if subset is None and isinstance(model, nn.Module):
            subset = ParamSubset.all(model, trainable_only=True)
        super().__init__(
            model,
            likelihood,
            subset,  # type: ignore[arg-type]
            prior_precision=prior_precision,
            sigma_noise=sigma_noise,
            temperature=temperature,
            prior_mean=prior_mean,
            hessian=hessian,
            output_fn=output_fn,
            ignore_index=ignore_index,
            input_kind=input_kind,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
            randomness=randomness,
            batch_norm=batch_norm,
            strict=strict,
            entries=entries,
        )
        self._fisher_options = {
            **self._batched_options(),
            "strict": self.strict,
            "method": parse_enum(FisherMethod, method, "method"),
        }

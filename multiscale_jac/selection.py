"""Subnetwork selection by curvature: which parameter entries a subnetwork Laplace keeps.

Structural selections (every entry of the last layer, the largest magnitudes, a random draw)
are :class:`~multiscale_jac.ParamSubset` constructors; the selection here needs the data and
the diagonal GGN (:func:`~multiscale_jac.diag_fisher`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ._checks import check_positive_number
from .enums import BatchNormPolicy, FisherKind, InputKind, Likelihood, Randomness, Tune
from .fisher import diag_fisher
from .subset import ParamSubset

__all__ = ["largest_variance"]


def largest_variance(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    k: int,
    *,
    likelihood: str | Likelihood = "classification",
    prior_precision: float = 1.0,
    params: ParamSubset | str | Sequence[str] | None = None,
    kind: str | FisherKind = "exact",
    output_fn: Any = None,
    input_kind: str | InputKind | None = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "error",
    strict: bool = False,
    progress: bool = False,
    generator: torch.Generator | None = None,
    process_group: Any = None,
    tune: str | bool | Tune = "auto",
) -> ParamSubset:
    """The ``k`` entries with the largest marginal variance under a diagonal Laplace
    (Daxberger et al. 2021): ``1 / (sum_i diag GGN_i + prior_precision)``.

    Entries with zero curvature (dead units) get the prior variance, the largest there is,
    although they change no prediction.

    Args:
        model: The model at its MAP.
        data: As for :func:`~multiscale_jac.diag_fisher` (one pass).
        k: How many entries.
        likelihood: ``classification`` or ``regression``.
        prior_precision: Added to the summed diagonal GGN.
        params: Candidate entries (default: every parameter).
        kind: The curvature: ``exact`` (the GGN, default), ``empirical`` (cheaper for dense
            outputs) or ``mc``.
        output_fn: As for :func:`~multiscale_jac.diag_fisher`, like every option below.
        input_kind: How to read ``inputs`` where it is ambiguous (:func:`~multiscale_jac.pack`).
        sigma_noise: Gaussian noise scale for ``regression``.
        ignore_index: Label of positions left out (classification).
        chunk_size: Shared option (the options table in ``docs/design.md``).
        memory_budget: Shared option.
        randomness: Shared option.
        batch_norm: Shared option.
        strict: Shared option.
        progress: Shared option.
        generator: Seeds the labels of ``kind="mc"``.
        process_group: Shared option.
        tune: Shared option (:class:`~multiscale_jac.Tune`; ``True``/``False``: measure or
            estimate), for :func:`~multiscale_jac.diag_fisher`'s choice.

    Returns:
        The selected entries.

    Raises:
        ValueError: ``k`` out of range, or what ``diag_fisher`` raises.
    """
    prior = check_positive_number(prior_precision, "prior_precision")
    res = diag_fisher(
        model,
        data,
        params=params,
        likelihood=likelihood,
        kind=kind,
        output_fn=output_fn,
        input_kind=input_kind,
        sigma_noise=sigma_noise,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        randomness=randomness,
        batch_norm=batch_norm,
        strict=strict,
        progress=progress,
        generator=generator,
        process_group=process_group,
        tune=tune,
    )
    variance = 1.0 / (res.flat * res.num_samples + prior)
    return ParamSubset.top(model, res.subset, variance, k, "largest_variance")

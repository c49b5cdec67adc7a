""":class:`SubnetLaplace`: the full posterior over a subset, from the subset GGN."""

from __future__ import annotations

from ._curvature import SubsetCurvature
from ._marglik import MarginalLikelihood
from ._posterior import FullForm
from ._predictive import Predictive
from ._saving import Saving

__all__ = ["SubnetLaplace"]


class SubnetLaplace(SubsetCurvature, Predictive, MarginalLikelihood, Saving):
    """Laplace approximation over a subset of a model's parameter entries.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed (inputs: anything
            :func:`~multiscale_jac.pack` accepts).
        likelihood: ``classification`` or ``regression``.
        subset: A :class:`ParamSubset` (entries or whole tensors), a name/glob or list of them.
        prior_precision: A number, a ``(P,)`` diagonal, one value per selected tensor (a
            sequence or ``{name: value}``).
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default; also where ``backend`` says) or ``empirical``.
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per engine call (default: as many as the Jacobian rows allow).
        memory_budget: Bytes of the working set of :meth:`fit` and :meth:`predictive`,
            including the ``(P, P)`` curvature and its factor. Samples are taken in chunks and
            a sample whose Jacobian rows do not fit in slices of its output positions. Default:
            32 MiB of Jacobian rows at a time and the engine's default working set.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``; the
            outputs and Jacobians of a sample come from one pass (one set of masks).
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode (the shared
            option; :func:`Laplace`, laplace-torch's front door, defaults to ``"eval"`` as
            laplace-torch fits in eval mode; the model's own mode is never changed).
        strict: Raise instead of letting the engine fall back to another strategy.
        entries: How the engine forms single-entry columns (``auto``, ``structured`` or
            ``generic``; see :func:`~multiscale_jac.per_sample_jacobian`).
        mode: The engine's mode for the Jacobian rows (``auto``, ``rev`` or ``fwd``; see
            :func:`~multiscale_jac.per_sample_jacobian`).
        tune: How the engine's ``auto`` choices are made (:class:`~multiscale_jac.Tune`:
            ``auto``, ``measure`` or ``True``, ``estimate`` or ``False``; for
            :class:`DiagLaplace` also :func:`~multiscale_jac.diag_fisher`'s choice; K-FAC's
            fit times nothing; nothing is timed unless ``True``).
        enable_backprop: The predictive (``la(x)``, :meth:`predictive`,
            :meth:`functional_samples`) keeps its graph to inputs that require grad, so its
            mean and variance can be differentiated w.r.t. them (laplace-torch's option; its
            Jacobian rows then come from ``torch.func.jacrev`` per sample, not the engine).
        backend: laplace-torch's curvature backend (a class, a subclass of one, or its name):
            a GGN backend means ``hessian="ggn"``, an empirical-Fisher one
            ``hessian="empirical"``; the curvature is always this library's (docs/laplace.md
            "From laplace-torch").
        backend_kwargs: With ``backend``: empty or ``{"stochastic": False}``.
        asdl_fisher_kwargs: Empty (ASDL's options have no counterpart).

    The options shared with the other entry points mean the same everywhere (the options table
    in ``docs/design.md``); the subset is called ``subset`` here, as in laplace-torch.

    laplace-torch's calls work too: ``la(x, pred_type=, link_approx=, n_samples=)`` (probabilities
    or ``(f_mu, f_var)``), :meth:`predictive_samples`, ``fit(train_loader, override,
    progress_bar)`` and ``optimize_prior_precision(method="marglik" | "gridsearch", ...)``;
    :func:`Laplace` builds this class from laplace-torch's arguments.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    form = FullForm()

"""laplace-torch's front door: ``Laplace(model, likelihood, subset_of_weights,
hessian_structure, ...)`` picks the class and the subset, and names the laplace-torch options
that have no counterpart here."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..enums import (
    ArgumentTypeError,
    BatchNormPolicy,
    Entries,
    FisherMethod,
    HessianKind,
    HessianStructure,
    InputKind,
    Likelihood,
    Mode,
    Randomness,
    SubsetOfWeights,
    Tune,
    parse_enum,
)
from ..subset import ParamSubset
from ._base import LaplaceBase
from ._diag import DiagLaplace
from ._gp import GPLaplace
from ._kronlaplace import KronLaplace
from ._last_layer import default_last_layer
from ._subnet import SubnetLaplace

__all__ = ["CLASS_OPTIONS", "Laplace"]

#: the classes' keyword options that :func:`Laplace` passes on by name (all of
#: :class:`LaplaceBase`'s but the subset, which it chooses)
CLASS_OPTIONS = tuple(
    name
    for name, p in inspect.signature(LaplaceBase.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "subset_of_weights"
)


def Laplace(
    model: nn.Module,
    likelihood: str | Likelihood,
    subset_of_weights: str | SubsetOfWeights = "last_layer",
    hessian_structure: str | HessianStructure = "kron",
    *,
    subnetwork_indices: Tensor | ParamSubset | None = None,
    last_layer_name: str | None = None,
    feature_reduction: str | None = None,
    sigma_noise: Any = 1.0,
    prior_precision: Any = 1.0,
    prior_mean: Any = 0.0,
    temperature: float = 1.0,
    hessian: str | HessianKind | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    ignore_index: int = -100,
    input_kind: str | InputKind | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: str | Randomness = "error",
    batch_norm: str | BatchNormPolicy = "eval",
    strict: bool = False,
    entries: str | Entries = "auto",
    mode: str | Mode = "auto",
    tune: str | bool | Tune = "auto",
    method: str | FisherMethod = "auto",
    enable_backprop: bool = False,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    backend: Any = None,
    backend_kwargs: dict[str, Any] | None = None,
    asdl_fisher_kwargs: dict[str, Any] | None = None,
    n_subset: int | None = None,
    independent_outputs: bool = False,
    seed: int = 0,
    **unsupported: Any,
) -> SubnetLaplace | DiagLaplace | KronLaplace | GPLaplace:
    """laplace-torch's ``Laplace``: the approximation chosen by two strings: over
    ``subnetwork_indices``, the ``"last_layer"`` (default) or ``"all"`` weights,
    :class:`KronLaplace` (``"kron"``, the default; not on a subnetwork), :class:`SubnetLaplace`
    (``"full"``: ``P x P``), :class:`DiagLaplace` (``"diag"``) or :class:`GPLaplace` (``"gp"``).

    The classes' keyword options pass through by name with the meaning :class:`LaplaceBase`
    documents (``batch_norm`` is ``"eval"`` by default here, as laplace-torch fits in eval
    mode); ``backend`` is laplace-torch's curvature backend (a class or its name): a GGN
    backend means ``hessian="ggn"``, an empirical-Fisher one ``hessian="empirical"``.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed.
        likelihood: ``classification``, ``regression`` or ``reward_modeling``.
        subset_of_weights: ``subnetwork``, ``last_layer`` (default: the last ``nn.Linear``
            registered, else module with parameters; the fit checks it runs last) or ``all``.
        hessian_structure: ``kron`` (default, as laplace-torch), ``full``, ``diag`` or ``gp``.
        subnetwork_indices: For ``subnetwork``: a 1-d LongTensor of indices into
            ``parameters_to_vector(model.parameters())`` (the posterior's order), or a
            :class:`ParamSubset`.
        last_layer_name: For ``last_layer``: the module whose parameters are the last layer.
        feature_reduction: For ``last_layer``: ``pick_first``, ``pick_last``, ``average``.
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        prior_precision: A number, one value per selected tensor, or a ``(P,)`` diagonal.
        prior_mean: A number or ``(P,)``.
        temperature: ``T``; the curvature is divided by it.
        n_subset: ``hessian_structure="gp"``: the context samples ``M`` (:class:`GPLaplace`).
        independent_outputs: ``gp``: one kernel per output.
        seed: ``gp``: seeds the draw of the context.
        **unsupported: laplace-torch's options without a counterpart here (``subset=``,
            low-rank options, ``damping``): refused by name, never accepted and ignored.

    Returns:
        The chosen class's posterior, not fitted.

    Raises:
        ValueError, TypeError: an unknown string (named with the choices), ``subnetwork``
            without indices or indices with another subset, a model that is not a module.
    """
    cls, subset, which, output_fn = _chosen(
        model,
        (subset_of_weights, hessian_structure, subnetwork_indices),
        (last_layer_name, feature_reduction, output_fn),
        unsupported,
    )
    given = locals()
    if cls is GPLaplace or (n_subset, independent_outputs, seed) != (None, False, 0):
        la = _gp(given, cls is GPLaplace, subset, which, output_fn)
    else:
        options = {k: given[k] for k in CLASS_OPTIONS}
        la = cls(model, likelihood, subset, **options, subset_of_weights=which)
    if which is SubsetOfWeights.LAST_LAYER and last_layer_name is None:
        la._check_last_layer_at_fit(default_last_layer(model)[0])
    return la


def _chosen(
    model: Any, choice: tuple[Any, Any, Any], last: tuple[Any, Any, Any], unsupported: dict
) -> tuple[type[LaplaceBase], ParamSubset, SubsetOfWeights, Any]:
    """:func:`Laplace`'s class, subset, ``subset_of_weights`` and ``output_fn`` from
    ``(subset_of_weights, hessian_structure, subnetwork_indices)`` and ``(last_layer_name,
    feature_reduction, output_fn)``, checked."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    which = parse_enum(SubsetOfWeights, choice[0], "subset_of_weights")
    structure = _hessian_structure(choice[1])
    _refuse(unsupported)
    output_fn = _last_layer_options(which, *last)
    if last[0] is not None:
        subset = _named_last_layer(model, last[0])
    else:
        subset = _subset_of_weights(model, which, choice[2])
    if which is SubsetOfWeights.SUBNETWORK and structure is HessianStructure.KRON:
        raise ValueError(
            "subset_of_weights='subnetwork' takes hessian_structure='full' or 'diag'; got "
            "'kron' (Kronecker factors cover whole layers)"
        )
    cls = {
        HessianStructure.GP: GPLaplace,
        HessianStructure.DIAG: DiagLaplace,
        HessianStructure.KRON: KronLaplace,
        HessianStructure.FULL: SubnetLaplace,
    }[structure]
    return cls, subset, which, output_fn


#: the options :class:`GPLaplace` takes besides the context's; the others must keep their
#: defaults (they name the parametric posterior's curvature and engine choices)
_GP_OPTIONS = (
    "sigma_noise", "prior_precision", "prior_mean", "temperature", "enable_backprop",
    "dict_key_x", "dict_key_y", "backend", "backend_kwargs", "chunk_size", "memory_budget",
    "batch_norm",
)  # fmt: skip


def _gp(
    given: dict[str, Any], gp: bool, subset: ParamSubset, which: SubsetOfWeights, output_fn: Any
) -> Any:
    """``hessian_structure="gp"``: a :class:`GPLaplace` (``n_subset`` required); the
    parametric posterior's options left at their defaults (and the GP's at theirs for the
    other structures)."""
    if not gp:
        raise ValueError(
            "n_subset, independent_outputs and seed are options of hessian_structure='gp'; got "
            f"hessian_structure={given['hessian_structure']!r}"
        )
    if given["n_subset"] is None:
        raise ArgumentTypeError("hessian_structure='gp' needs n_subset, the context samples M")
    defaults = inspect.signature(Laplace).parameters
    changed = [k for k in CLASS_OPTIONS if k not in _GP_OPTIONS and k != "output_fn"
               and given[k] is not defaults[k].default]  # fmt: skip
    if changed:
        raise ValueError(f"hessian_structure='gp' does not take {changed}")
    options = {k: given[k] for k in _GP_OPTIONS}
    return GPLaplace(
        given["model"], given["likelihood"], subset, n_subset=given["n_subset"],
        independent_outputs=given["independent_outputs"], seed=given["seed"],
        output_fn=output_fn, subset_of_weights=which, **options,
    )  # fmt: skip


def _refuse(unsupported: dict[str, Any]) -> None:
    """laplace-torch's options that have no counterpart here, named with what to do."""
    if "subset" in unsupported:
        raise TypeError(
            "Laplace() takes the subset as subset_of_weights='subnetwork' with "
            "subnetwork_indices=...; SubnetLaplace(model, likelihood, subset) takes it directly"
        )
    if unsupported:
        raise TypeError(
            f"Laplace() got options with no counterpart here: {sorted(unsupported)} "
            "(laplace-torch's options of a structure not provided, or misspelt; see "
            "help(multiscale_jac.laplace.Laplace) for every option)"
        )


def _hessian_structure(value: Any) -> HessianStructure:
    try:
        return parse_enum(HessianStructure, value, "hessian_structure")
    except ValueError as err:
        if value == "lowrank":
            raise ValueError(
                f"{err} (laplace-torch's {value!r} has no counterpart here: 'full' is exact on "
                "a subnetwork or the last layer, 'kron' and 'diag' cover every weight)"
            ) from None
        raise


#: laplace-torch's ``feature_reduction`` values (its ``FeatureReduction``)
FEATURE_REDUCTIONS = ("pick_first", "pick_last", "average")


def _last_layer_options(which: SubsetOfWeights, name: Any, reduction: Any, output_fn: Any) -> Any:
    """laplace-torch's last-layer options checked; ``feature_reduction`` reduces the features
    between the batch and the feature dim before the last layer: as the last layer is linear
    and the model's output, that is the same reduction of the output, so it becomes part of
    ``output_fn`` (returned)."""
    reduction = getattr(reduction, "value", reduction)
    if which is not SubsetOfWeights.LAST_LAYER and (name is not None or reduction is not None):
        given = "last_layer_name" if name is not None else "feature_reduction"
        raise ValueError(
            f"{given} is an option of subset_of_weights='last_layer'; got "
            f"subset_of_weights={which.value!r}"
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"last_layer_name must be a module name (str); got {name!r}")
    if reduction is None:
        return output_fn
    if reduction not in FEATURE_REDUCTIONS:
        raise ValueError(
            f"unknown feature_reduction {reduction!r}; expected one of {FEATURE_REDUCTIONS} or None"
        )
    return _Reduced(output_fn, reduction)


class _Reduced:
    """``output_fn`` reducing ``(1, *middle, C)`` outputs over the middle dims (laplace-torch's
    ``feature_reduction`` moved past the linear last layer); 2-d outputs pass unchanged."""

    def __init__(self, user: Any, reduction: str) -> None:
        self.user, self.reduction = user, reduction

    def __call__(self, out: Any) -> Any:
        out = self.user(out) if self.user is not None else out
        if not isinstance(out, Tensor) or out.dim() <= 2:
            return out
        middle = tuple(range(1, out.dim() - 1))
        if self.reduction == "average":
            return out.mean(dim=middle)
        k = 0 if self.reduction == "pick_first" else -1
        return out[(slice(None), *[k] * len(middle), slice(None))]


def _named_last_layer(model: nn.Module, name: str) -> ParamSubset:
    """The parameters of module ``name`` (laplace-torch's ``last_layer_name``)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        names = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
        raise ValueError(
            f"last_layer_name {name!r} is not a module of the model; modules with "
            f"parameters: {names[:12]}"
        ) from None
    owned = [f"{name}.{n}" if name else n for n, p in module.named_parameters() if p.requires_grad]
    if not owned:
        raise ValueError(f"last_layer_name {name!r} has no parameters that require grad")
    return ParamSubset.from_names(model, owned)


def _subset_of_weights(model: nn.Module, which: SubsetOfWeights, indices: Any) -> ParamSubset:
    """The entries ``subset_of_weights`` names (laplace-torch's conventions)."""
    if which is not SubsetOfWeights.SUBNETWORK:
        if indices is not None:
            raise ValueError(
                "subnetwork_indices is used only with subset_of_weights='subnetwork'; got "
                f"subset_of_weights={which.value!r}"
            )
        if which is SubsetOfWeights.ALL:
            return ParamSubset.all(model, trainable_only=True)
        return default_last_layer(model)[1]
    if indices is None:
        raise ArgumentTypeError(  # a missing argument: TypeError, as laplace-torch
            "subset_of_weights='subnetwork' needs subnetwork_indices: a 1-d LongTensor of "
            "indices into parameters_to_vector(model.parameters()), or a ParamSubset"
        )
    if isinstance(indices, ParamSubset):
        indices.check_model(model)
        return indices
    if isinstance(indices, Tensor) and indices.dtype != torch.int64:
        raise ArgumentTypeError(  # laplace-torch refuses int32 indices with a ValueError too
            f"subnetwork_indices must be a LongTensor (int64), as laplace-torch's; got "
            f"{indices.dtype}: convert it with .long()"
        )
    if not isinstance(indices, Tensor) or indices.dim() != 1:
        what = (
            f"shape {tuple(indices.shape)}"
            if isinstance(indices, Tensor)
            else type(indices).__name__
        )
        raise ArgumentTypeError(f"subnetwork_indices must be a 1-d LongTensor; got {what}")
    try:
        return ParamSubset.from_flat_indices(model, indices)
    except (TypeError, ValueError) as err:
        # a wrong dtype: a TypeError and, as laplace-torch raises, a ValueError
        cls = ArgumentTypeError if isinstance(err, TypeError) else ValueError
        raise cls(f"subnetwork_indices: {err}") from None

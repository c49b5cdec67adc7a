"""laplace-torch's subnetwork masks (``laplace.utils.subnetmask``), for scripts that import
them: ``mask.select(train_loader)`` gives the indices into
``parameters_to_vector(model.parameters())`` that ``Laplace(..., subset_of_weights="subnetwork",
subnetwork_indices=...)`` takes. The model is never changed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from .._checks import check_positive_int
from ..enums import SubsetOfWeights
from ..subset import ParamSubset

__all__ = [
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetMask",
]


class SubnetMask:
    """The base of every mask: ``select(train_loader)`` once, then ``indices`` (a
    ``LongTensor`` of positions in ``parameters_to_vector(model.parameters())``, ascending) and
    ``n_params_subnet``."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
        self.model = model
        self.parameter_vector = parameters_to_vector(model.parameters()).detach()
        self._n_params = self.parameter_vector.numel()
        self._indices: Tensor | None = None

    @property
    def indices(self) -> Tensor:
        if self._indices is None:
            raise AttributeError("the subnetwork mask is not selected: call select() first")
        return self._indices

    @property
    def n_params_subnet(self) -> int:
        return int(self.indices.numel())

    def convert_subnet_mask_to_indices(self, subnet_mask: Tensor) -> Tensor:
        """The positions of the ones of a 0/1 (or boolean) vector of ``n_params`` entries."""
        integral = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
        if not isinstance(subnet_mask, Tensor) or subnet_mask.dtype not in integral:
            raise ValueError(
                f"a subnetwork mask is a 1-d boolean or 0/1 tensor; got {subnet_mask!r}"
            )
        if subnet_mask.shape != (self._n_params,) or bool(
            ((subnet_mask != 0) & (subnet_mask != 1)).any()
        ):
            raise ValueError(
                f"a subnetwork mask is a 0/1 vector of the model's {self._n_params} parameters; "
                f"got shape {tuple(subnet_mask.shape)}"
            )
        return subnet_mask.nonzero(as_tuple=True)[0]

    def select(self, train_loader: Iterable[Any] | None = None) -> Tensor:
        """Choose the subnetwork (once) and return its indices."""
        if self._indices is not None:
            raise ValueError("the subnetwork mask is already selected")
        self._indices = self.convert_subnet_mask_to_indices(self.get_subnet_mask(train_loader))
        return self._indices

    def get_subnet_mask(self, train_loader: Iterable[Any] | None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no get_subnet_mask")


class ScoreBasedSubnetMask(SubnetMask):
    """The ``n_params_subnet`` parameters of the highest score (``compute_param_scores``)."""

    def __init__(self, model: nn.Module, n_params_subnet: int) -> None:
        super().__init__(model)
        n = check_positive_int(n_params_subnet, "n_params_subnet")
        if n > self._n_params:
            raise ValueError(
                f"n_params_subnet={n} is more than the model's {self._n_params} parameters"
            )
        self._n_subnet = n
        self._param_scores: Tensor | None = None

    def compute_param_scores(self, train_loader: Iterable[Any] | None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no compute_param_scores")

    def get_subnet_mask(self, train_loader: Iterable[Any] | None) -> Tensor:
        if self._param_scores is None:
            self._param_scores = self.compute_param_scores(train_loader)
        if self._param_scores.shape != self.parameter_vector.shape:
            raise ValueError(
                f"the scores have shape {tuple(self._param_scores.shape)}; the parameter vector "
                f"{tuple(self.parameter_vector.shape)}"
            )
        top = torch.argsort(self._param_scores, descending=True)[: self._n_subnet]
        mask = torch.zeros_like(self.parameter_vector, dtype=torch.bool)
        mask[top] = True
        return mask


class RandomSubnetMask(ScoreBasedSubnetMask):
    """Parameters drawn uniformly at random (``torch.rand``, the global generator)."""

    def compute_param_scores(self, train_loader: Iterable[Any] | None) -> Tensor:
        return torch.rand_like(self.parameter_vector)


class LargestMagnitudeSubnetMask(ScoreBasedSubnetMask):
    """The parameters of the largest magnitude."""

    def compute_param_scores(self, train_loader: Iterable[Any] | None) -> Tensor:
        return self.parameter_vector.abs()


class LargestVarianceDiagLaplaceSubnetMask(ScoreBasedSubnetMask):
    """The parameters of the largest marginal variance under ``diag_laplace_model``, a
    diagonal Laplace over the model's weights (fitted on ``train_loader`` here when it was
    not); parameters it leaves out score zero."""

    def __init__(self, model: nn.Module, n_params_subnet: int, diag_laplace_model: Any) -> None:
        super().__init__(model, n_params_subnet)
        from ._diag import DiagLaplace

        if not isinstance(diag_laplace_model, DiagLaplace):
            raise TypeError(
                "diag_laplace_model must be a DiagLaplace (e.g. Laplace(model, likelihood, "
                f"'all', 'diag')); got {type(diag_laplace_model).__name__}"
            )
        self.diag_laplace_model = diag_laplace_model

    def compute_param_scores(self, train_loader: Iterable[Any] | None) -> Tensor:
        la = self.diag_laplace_model
        if la.n_data == 0:  # not fitted yet
            if train_loader is None:
                raise ValueError("select(train_loader) needs the data to fit the diagonal Laplace")
            la.fit(train_loader)
        scores = torch.zeros_like(self.parameter_vector)
        scores[la.subset.flat_indices().to(scores.device)] = la.posterior_variance.detach().to(
            scores
        )
        return scores


class LargestVarianceSWAGSubnetMask(ScoreBasedSubnetMask):
    """laplace-torch's SWAG-variance mask: not provided here (it trains the model further,
    which this library never does); refused with the alternative."""

    def __init__(self, model: nn.Module, n_params_subnet: int, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "LargestVarianceSWAGSubnetMask trains the model with SWAG, which this library never "
            "does; use LargestVarianceDiagLaplaceSubnetMask (the diagonal Laplace's variances) "
            "or multiscale_jac.selection.largest_variance"
        )


class ParamNameSubnetMask(SubnetMask):
    """Every entry of the parameters named ``parameter_names`` (``model.named_parameters()``)."""

    def __init__(self, model: nn.Module, parameter_names: Sequence[str]) -> None:
        super().__init__(model)
        names = _names(parameter_names, "parameter_names")
        known = dict(model.named_parameters())
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"parameter_names {unknown} are not parameters of the model")
        self._subset = ParamSubset.from_names(model, names)

    def get_subnet_mask(self, train_loader: Iterable[Any] | None) -> Tensor:
        mask = torch.zeros_like(self.parameter_vector, dtype=torch.bool)
        mask[self._subset.flat_indices().to(mask.device)] = True
        return mask


class ModuleNameSubnetMask(ParamNameSubnetMask):
    """Every parameter of the modules named ``module_names`` (``model.named_modules()``, their
    submodules' included); a module without parameters is refused."""

    def __init__(self, model: nn.Module, module_names: Sequence[str]) -> None:
        names = _names(module_names, "module_names")
        modules = dict(model.named_modules())
        params: list[str] = []
        for name in names:
            if name not in modules:
                raise ValueError(f"module_names: {name!r} is not a module of the model")
            own = [f"{name}.{p}" if name else p for p, _ in modules[name].named_parameters()]
            if not own:
                raise ValueError(f"module_names: {name!r} has no parameters")
            params += own
        super().__init__(model, list(dict.fromkeys(params)))


class LastLayerSubnetMask(ModuleNameSubnetMask):
    """The last layer: the module named ``last_layer_name``, or by default the one
    ``Laplace(subset_of_weights="last_layer")`` takes (the last ``nn.Linear``)."""

    def __init__(self, model: nn.Module, last_layer_name: str | None = None) -> None:
        if last_layer_name is None:
            from ._frontdoor import _subset_of_weights

            names = _subset_of_weights(model, SubsetOfWeights.LAST_LAYER, None).names
            last_layer_name = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        super().__init__(model, [last_layer_name])


def _names(value: Any, what: str) -> list[str]:
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, str) for v in value)
    ):
        raise ValueError(f"{what} must be a non-empty list of names; got {value!r}")
    return list(value)

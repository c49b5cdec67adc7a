"""Saving a fitted posterior: ``state_dict`` / ``load_state_dict`` (laplace-torch's calls) as
plain values, with what identifies the model and the subset checked on loading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._checks import check_bool
from ._fit import Curvature, CurvatureFit
from ._posterior import REWARD_MODELING, Posterior

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["load_state_dict", "state_dict"]

#: the keys :func:`load_state_dict` reads
_STATE_KEYS = (
    "cls_name",
    "likelihood",
    "hessian",
    "subset_names",
    "subnetwork_indices",
    "parameter_shapes",
    "mean",
    "H",
    "loss",
    "prior_mean",
    "prior_precision",
    "sigma_noise",
    "n_data",
    "n_outputs",
    "n_entries",
    "temperature",
    "enable_backprop",
)


def state_dict(
    owner: str,
    posterior: Posterior,
    curvature: Curvature,
    prep: Prepared,
    enable_backprop: bool,
    hessian: str,
) -> dict[str, Any]:
    """The fitted posterior as plain values (tensors, numbers, strings, lists: no pickled
    objects), for ``torch.save``; laplace-torch's keys, plus what identifies the model and
    the subset (checked by :func:`load_state_dict`).

    Raises:
        RuntimeError: not fitted.
    """
    h = posterior.fitted()
    return {
        "cls_name": owner,
        "likelihood": _likelihood(posterior),
        "hessian": hessian,
        "subset_names": list(prep.subset.names),
        "subnetwork_indices": prep.subset.flat_indices(),
        "parameter_shapes": [[n, list(p.shape)] for n, p in prep.model.named_parameters()],
        "mean": posterior.mean,
        "H": curvature.h_state(h),
        "loss": posterior.loss,
        "prior_mean": posterior.prior.mean,
        "prior_precision": posterior.prior.precision,
        "sigma_noise": posterior.sigma_noise,
        "n_data": posterior.n_data,
        "n_outputs": posterior.n_outputs,
        "n_entries": posterior.n_entries,
        "temperature": posterior.temperature,
        "enable_backprop": enable_backprop,
    }


def load_state_dict(
    state_dict: Mapping[str, Any],
    owner: str,
    posterior: Posterior,
    curvature: Curvature,
    prep: Prepared,
    hessian: str,
) -> bool:
    """Load a posterior saved by :func:`state_dict` into ``posterior`` (tensors go to its
    device and dtype). The class, likelihood, curvature (``hessian``), model parameters (names
    and shapes), subset and MAP (the model's current values of the subset) must be those it
    was saved with; the prior, noise and temperature are taken from it.

    Returns:
        The saved ``enable_backprop``.

    Raises:
        ValueError: anything of the above that differs, naming it, or a missing key.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict lacks {missing}: not saved by state_dict()")
    params = [[n, list(p.shape)] for n, p in prep.model.named_parameters()]
    theta = posterior.map
    mean = state_dict["mean"].to(theta)
    checks = [
        ("class", state_dict["cls_name"], owner),
        ("likelihood", state_dict["likelihood"], _likelihood(posterior)),
        ("hessian", state_dict["hessian"], hessian),
        ("model parameters (names and shapes)", state_dict["parameter_shapes"], params),
        ("subset", list(state_dict["subset_names"]), list(prep.subset.names)),
    ]
    for what, saved, here in checks:
        if saved != here:
            raise ValueError(f"load_state_dict: different {what}: saved {saved}, here {here}")
    if not torch.equal(state_dict["subnetwork_indices"].cpu(), prep.subset.flat_indices().cpu()):
        raise ValueError("load_state_dict: different subset entries (subnetwork_indices)")
    if not torch.allclose(mean, theta):
        raise ValueError(
            "load_state_dict: the model's values of the subset differ from the saved MAP "
            "(load the model's weights first: the predictive runs the model)"
        )
    h = curvature.h_from_state(state_dict["H"], theta)
    backprop = check_bool(state_dict["enable_backprop"], "enable_backprop")
    posterior.set_prior_mean(state_dict["prior_mean"])
    posterior.set_prior_precision(state_dict["prior_precision"])
    posterior.set_temperature(state_dict["temperature"])
    posterior.set_sigma_noise(state_dict["sigma_noise"])
    fit = CurvatureFit(
        h,
        float(state_dict["loss"]),
        int(state_dict["n_data"]),
        int(state_dict["n_entries"]),
        state_dict["n_outputs"],
    )
    posterior.restore(fit)
    return backprop


def _likelihood(posterior: Posterior) -> str:
    return REWARD_MODELING if posterior.reward_modeling else posterior.likelihood.value

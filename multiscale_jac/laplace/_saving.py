"""Saving a fitted posterior: ``state_dict`` / ``load_state_dict`` (laplace-torch's calls) as
plain values, with what identifies the model and the subset checked on loading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._checks import check_bool, check_positive_number
from ._base import REWARD_MODELING, LaplaceBase

__all__ = ["Saving"]

#: the keys :meth:`Saving.load_state_dict` reads
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


class Saving(LaplaceBase):
    """``state_dict`` and ``load_state_dict``; a posterior form whose curvature is not one
    tensor overrides :meth:`_h_state` and :meth:`_h_from_state`."""

    def state_dict(self) -> dict[str, Any]:
        """The fitted posterior as plain values (tensors, numbers, strings, lists: no pickled
        objects), for ``torch.save``; laplace-torch's keys, plus what identifies the model and
        the subset (checked by :meth:`load_state_dict`).

        Raises:
            RuntimeError: not fitted.
        """
        h = self._fitted()
        return {
            "cls_name": type(self).__name__,
            "likelihood": REWARD_MODELING if self._reward else self.likelihood.value,
            "hessian": self.hessian.value,
            "subset_names": list(self.subset.names),
            "subnetwork_indices": self.subset.flat_indices(),
            "parameter_shapes": [[n, list(p.shape)] for n, p in self.model.named_parameters()],
            "mean": self.mean,
            "H": self._h_state(h),
            "loss": self._loss,
            "prior_mean": self.prior_mean,
            "prior_precision": self.prior_precision,
            "sigma_noise": self.sigma_noise,
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "n_entries": self._n_entries,
            "temperature": self.temperature,
            "enable_backprop": self.enable_backprop,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a posterior saved by :meth:`state_dict` (tensors go to this posterior's device
        and dtype). The class, likelihood, curvature (``hessian``), model parameters (names
        and shapes), subset and MAP (the model's current values of the subset) must be those
        it was saved with; the prior, noise, temperature and ``enable_backprop`` are taken
        from it.

        Raises:
            ValueError: anything of the above that differs, naming it, or a missing key.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks {missing}: not saved by state_dict()")
        params = [[n, list(p.shape)] for n, p in self.model.named_parameters()]
        mean = state_dict["mean"].to(self.mean)
        checks = [
            ("class", state_dict["cls_name"], type(self).__name__),
            (
                "likelihood",
                state_dict["likelihood"],
                REWARD_MODELING if self._reward else self.likelihood.value,
            ),
            ("hessian", state_dict["hessian"], self.hessian.value),
            ("model parameters (names and shapes)", state_dict["parameter_shapes"], params),
            ("subset", list(state_dict["subset_names"]), list(self.subset.names)),
        ]
        for what, saved, here in checks:
            if saved != here:
                raise ValueError(f"load_state_dict: different {what}: saved {saved}, here {here}")
        if not torch.equal(
            state_dict["subnetwork_indices"].cpu(), self.subset.flat_indices().cpu()
        ):
            raise ValueError("load_state_dict: different subset entries (subnetwork_indices)")
        if not torch.allclose(mean, self._map):
            raise ValueError(
                "load_state_dict: the model's values of the subset differ from the saved MAP "
                "(load the model's weights first: the predictive runs the model)"
            )
        h = self._h_from_state(state_dict["H"])
        self.prior_mean = self._vector(state_dict["prior_mean"], "prior_mean", positive=False)
        self.prior_precision = state_dict["prior_precision"]
        self.temperature = check_positive_number(state_dict["temperature"], "temperature")
        self.sigma_noise = state_dict["sigma_noise"]
        self.enable_backprop = check_bool(state_dict["enable_backprop"], "enable_backprop")
        self.H, self._loss, self.mean = h, float(state_dict["loss"]), self._map
        self.n_data, self._n_entries = int(state_dict["n_data"]), int(state_dict["n_entries"])
        self.n_outputs = state_dict["n_outputs"]
        self._scale = None

    def _h_state(self, h: Any) -> Any:
        """The curvature as plain values (a tensor here; forms with factors override)."""
        return h

    def _h_from_state(self, value: Any) -> Any:
        """:meth:`_h_state`'s inverse, on this posterior's device and dtype, shape checked."""
        p = self.subset.numel
        t = torch.as_tensor(value).to(self.mean)
        if t.shape != (p, p) and t.shape != (p,):
            raise ValueError(f"load_state_dict: H of shape {tuple(t.shape)} for P={p}")
        return t

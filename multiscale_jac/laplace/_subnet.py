""":class:`SubnetLaplace`: the full posterior over a subset, from the subset GGN."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ._base import LaplaceBase, Parts
from ._forms import FullForm
from ._options import LaplaceOptions
from ._subset_ggn import SubsetGGN

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["SubnetLaplace"]


class SubnetLaplace(LaplaceBase):
    """Laplace approximation over a subset of a model's parameter entries: the full ``(P, P)``
    posterior precision ``H / (sigma^s T) + diag(p_0)`` from the subset GGN (or empirical
    Fisher) ``H``, computed from per-sample Jacobian rows on the subset alone (never the
    model's full Jacobian).

    The arguments (every option) are :class:`LaplaceBase`'s. laplace-torch's calls work too:
    ``la(x, pred_type=, link_approx=, n_samples=)`` (probabilities or ``(f_mu, f_var)``),
    :meth:`predictive_samples`, ``fit(train_loader, override, progress_bar)`` and
    ``optimize_prior_precision(method="marglik" | "gridsearch", ...)``; :func:`Laplace` builds
    this class from laplace-torch's arguments.
    """

    def _parts(self, prep: Prepared, options: LaplaceOptions, theta: Tensor) -> Parts:
        name = type(self).__name__
        return Parts(
            FullForm(),
            lambda rows: SubsetGGN(
                name, rows, prep.subset, options.hessian, options.ignore_index, theta
            ),
        )

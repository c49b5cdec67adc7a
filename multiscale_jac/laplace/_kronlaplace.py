""":class:`KronLaplace`: the Kronecker-factored (K-FAC) posterior, from
:func:`~multiscale_jac._kfac.kron_factors`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from .._checks import check_bool
from .._kfac import KronResult, kron_factors
from ..enums import HessianKind, Likelihood
from ..subset import ParamSubset
from ._base import LaplaceBase, fitting
from ._kron import KronBlock, KronCurvatureFactors, KronForm
from ._marglik import MarginalLikelihood
from ._predictive import Predictive
from ._saving import Saving

__all__ = ["KronLaplace"]

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self


class KronCurvature(LaplaceBase):
    """K-FAC factors of the selected Linear/Conv tensors and the loss at the MAP, in one pass
    of :func:`~multiscale_jac._kfac.kron_factors` over the data (shape buckets of a ragged
    batch run apart: the factors are those of the samples run one at a time, unpadded)."""

    #: :func:`~multiscale_jac._kfac.kron_factors`'s options (set by the constructor)
    _kron_options: dict[str, Any]

    @fitting
    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
    ) -> Self:
        """Accumulate the Kronecker factors and the loss at the MAP in one pass over the data.

        ``override=False`` adds this data to an earlier fit as laplace-torch does: the input
        factors ``A`` (means over samples) are weighted by each fit's share of the samples and
        the output factors ``G`` (sums) added.

        Returns:
            ``self``.
        """
        show = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        kind = "ggn" if self.hessian is HessianKind.GGN else "empirical"
        res = kron_factors(
            self.model,
            self._data(train_loader),
            params=self.subset,
            likelihood=self.likelihood,
            kind=kind,
            sigma_noise=1.0,
            progress=show,
            **self._kron_options,
        )
        h = _blocks(res, self.subset)
        n_old, n_new = self.n_data, res.num_data

        def weighted(old: KronCurvatureFactors, new: KronCurvatureFactors) -> Any:
            total = n_old + n_new
            return old.scaled(n_old / total) + new.scaled(n_new / total)

        n_out = _regression_outputs(res, self.likelihood)
        self._record_fit(h, float(res.loss), n_new, n_out, res.output_dim, override, weighted)
        return self


def _blocks(res: KronResult, subset: ParamSubset) -> KronCurvatureFactors:
    """One block per selected tensor, in the flat order: weight ``[G, A_w]``, bias ``[G]``
    (curvlinops' separate bias, laplace-torch's: for a layer called ``c`` times per sample,
    e.g. an output head run on every pyramid level, ``G`` sums the calls' output gradients,
    the exact GGN of an output layer's bias; the augmented ``A``'s bias row would make it
    ``c G``)."""
    by_name: dict[str, list[Tensor]] = {}
    for f in res.layers:
        if f.weight is not None:
            by_name[f.weight] = [f.G, f.weight_A]
        if f.bias is not None:
            by_name[f.bias] = [f.G]
    order = sorted(subset.offsets, key=lambda n: subset.offsets[n][0])
    return KronCurvatureFactors([KronBlock(n, by_name[n]) for n in order])


def _regression_outputs(res: KronResult, likelihood: Likelihood) -> int:
    return 0 if likelihood is Likelihood.CLASSIFICATION else res.num_outputs


class KronLaplace(KronCurvature, Predictive, MarginalLikelihood, Saving):
    """Kronecker-factored Laplace (K-FAC): ``P_post`` block-diagonal over the selected tensors,
    each weight's block ``G (x) A / (sigma^s T) + delta I`` and each bias's ``G / (sigma^s T)
    + delta I`` (laplace-torch's ``KronLaplace`` with ``separate_weight_and_bias``).

    ``A`` and ``G`` are curvlinops' KFAC-expand factors (:mod:`~multiscale_jac._kfac`; the
    same as laplace-torch's default backend ``CurvlinopsGGN``, and ``CurvlinopsEF`` for
    ``hessian="empirical"``) computed over ragged multi-level inputs one shape bucket at a
    time, so the factors of a ragged batch are those of its samples run one by one, unpadded.
    Every factor is eigendecomposed once; the marginal likelihood, the GLM predictive,
    sampling and prior tuning work in those eigenbases (:class:`~._kron.KronPrecision`), never
    with a ``P x P`` matrix. The prior precision is one value, or one per selected tensor.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed.
        likelihood: ``classification`` or ``regression``.
        subset: Whole weights and biases of ``nn.Linear``/``nn.Conv1d/2d/3d`` layers (a
            :class:`ParamSubset`, a name/glob or a list); default: every parameter that
            requires grad (a model with other parameters needs a subset).
        **options: :class:`SubnetLaplace`'s keyword arguments, with its meaning, except:
            ``prior_precision`` is a number or one value per selected tensor;
            ``memory_budget`` bounds the working set of :meth:`fit` (the factors included) and
            of :meth:`predictive`; ``randomness="same"`` is refused by the fit's batched runs.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value), a selected
            tensor that is not a Linear/Conv weight or bias, a per-entry prior precision.
    """

    form = KronForm()

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        if subset is None and isinstance(model, nn.Module):
            subset = ParamSubset.all(model, trainable_only=True)
        super().__init__(model, likelihood, subset, **options)  # type: ignore[arg-type]
        if not self.subset.all_whole or self.subset.columns is not None:
            raise ValueError(
                "KronLaplace covers whole tensors laid out one after the other (Kronecker "
                f"factors of a layer); got a subset of entries of {list(self.subset.names)}: "
                "use SubnetLaplace or DiagLaplace for single entries"
            )
        self._per_tensor(self._prior_precision)
        self._kron_options = self._batched_options()

    @property
    def H_facs(self) -> KronCurvatureFactors | None:
        """laplace-torch's name for the factors ``H`` (``None`` before :meth:`fit`)."""
        return self.H

    def _h_state(self, h: KronCurvatureFactors) -> list[list[Tensor]]:
        return [list(b.factors) for b in h.blocks]

    def _h_from_state(self, value: Any) -> KronCurvatureFactors:
        order = sorted(self.subset.offsets, key=lambda n: self.subset.offsets[n][0])
        if not isinstance(value, (list, tuple)) or len(value) != len(order):
            raise ValueError(
                f"load_state_dict: H must hold one factor list per selected tensor ({len(order)})"
            )
        blocks = [KronBlock(n, [f.to(self.mean) for f in fs]) for n, fs in zip(order, value)]
        for b in blocks:
            a, z = self.subset.offsets[b.name]
            if b.numel != z - a:
                raise ValueError(f"load_state_dict: factors of {b.name!r} do not match its size")
        return KronCurvatureFactors(blocks)

    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as given: ``(1,)`` or one value per selected tensor ``(K,)``."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self._prior_precision = self._per_tensor(
            self._prior_form(value, "prior_precision", positive=True)
        )
        self._scale = None

    def _per_tensor(self, t: Tensor) -> Tensor:
        k = len(self.subset.names)
        if t.numel() not in (1, k):
            raise ValueError(
                f"a Kronecker-factored posterior takes one prior precision or one per "
                f"selected tensor ({k}); got {t.numel()} values"
            )
        return t

""":class:`KronLaplace`: the Kronecker-factored (K-FAC) posterior, from
:func:`~multiscale_jac._kfac.kron_factors`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._kfac import KronResult, kron_factors
from ..enums import HessianKind, Likelihood
from ..subset import ParamSubset
from ._base import LaplaceBase, Parts
from ._fit import CurvatureFit, refuse_unsupported
from ._kron import KronBlock, KronCurvatureFactors, KronForm
from ._options import LaplaceOptions

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["KronGGN", "KronLaplace"]


class KronGGN:
    """K-FAC factors of the selected Linear/Conv tensors and the loss at the MAP, in one pass
    of :func:`~multiscale_jac._kfac.kron_factors` over the data (shape buckets of a ragged
    batch run apart: the factors are those of the samples run one at a time, unpadded).

    Args:
        prep: The checked model, subset and policies.
        options: The posterior's options.
    """

    def __init__(self, prep: Prepared, options: LaplaceOptions) -> None:
        subset = prep.subset
        if not subset.all_whole or subset.columns is not None:
            raise ValueError(
                "KronLaplace covers whole tensors laid out one after the other (Kronecker "
                f"factors of a layer); got a subset of entries of {list(subset.names)}: "
                "use SubnetLaplace or DiagLaplace for single entries"
            )
        self._prep = prep
        self._kind = "ggn" if options.hessian is HessianKind.GGN else "empirical"
        self._options = options.batched(prep)

    def fit(
        self,
        data: Iterable[tuple[Any, Any]],
        likelihood: Likelihood,
        *,
        progress: bool,
        process_group: Any,
        max_outputs_per_sample: int | None,
        generator: torch.Generator | None,
    ) -> CurvatureFit:
        """One pass of :func:`~multiscale_jac._kfac.kron_factors`."""
        refuse_unsupported(
            "KronLaplace",
            process_group=process_group,
            max_outputs_per_sample=max_outputs_per_sample,
            generator=generator,
        )
        res = kron_factors(
            self._prep.model,
            data,
            params=self._prep.subset,
            likelihood=likelihood,
            kind=self._kind,
            sigma_noise=1.0,
            progress=progress,
            **self._options,
        )
        n_out = 0 if likelihood is Likelihood.CLASSIFICATION else res.num_outputs
        h = _blocks(res, self._prep.subset)
        return CurvatureFit(h, float(res.loss), res.num_data, n_out, res.output_dim)

    def combine(self, old: CurvatureFit, new: CurvatureFit) -> KronCurvatureFactors:
        """laplace-torch's rule for ``override=False``: the input factors ``A`` (means over
        samples) weighted by each fit's share of the samples, the output factors ``G``
        (sums) added."""
        total = old.n_data + new.n_data
        return old.h.scaled(old.n_data / total) + new.h.scaled(new.n_data / total)

    def zeros(self, like: Tensor) -> KronCurvatureFactors:
        """Zero factors: ``G`` ``(out, out)`` and ``A`` ``(in, in)`` of each weight (``in``:
        its entries per output), ``G`` of each bias."""
        subset = self._prep.subset
        shapes = {n: p.shape for n, p in self._prep.model.named_parameters()}
        blocks = []
        for name in sorted(subset.offsets, key=lambda n: subset.offsets[n][0]):
            out = shapes[name][0]
            fan_in = subset.offsets[name][1] - subset.offsets[name][0]
            factors = [like.new_zeros(out, out)]
            if len(shapes[name]) > 1:
                factors.append(like.new_zeros(fan_in // out, fan_in // out))
            blocks.append(KronBlock(name, factors))
        return KronCurvatureFactors(blocks)

    def h_state(self, h: KronCurvatureFactors) -> list[list[Tensor]]:
        return [list(b.factors) for b in h.blocks]

    def h_from_state(self, value: Any, like: Tensor) -> KronCurvatureFactors:
        subset = self._prep.subset
        order = sorted(subset.offsets, key=lambda n: subset.offsets[n][0])
        if not isinstance(value, (list, tuple)) or len(value) != len(order):
            raise ValueError(
                f"load_state_dict: H must hold one factor list per selected tensor ({len(order)})"
            )
        blocks = [KronBlock(n, [f.to(like) for f in fs]) for n, fs in zip(order, value)]
        for b in blocks:
            a, z = subset.offsets[b.name]
            if b.numel != z - a:
                raise ValueError(f"load_state_dict: factors of {b.name!r} do not match its size")
        return KronCurvatureFactors(blocks)


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


class KronLaplace(LaplaceBase):
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

    The arguments (every option) are :class:`LaplaceBase`'s, except: ``subset`` is whole
    weights and biases of ``nn.Linear``/``nn.Conv1d/2d/3d`` layers (default: every parameter
    that requires grad; a model with other parameters needs a subset); ``prior_precision`` is
    a number or one value per selected tensor; ``memory_budget`` bounds the working set of
    :meth:`fit` (the factors included) and of :meth:`predictive`; ``randomness="same"`` is
    refused by the fit's batched runs; the fit takes no ``process_group`` or
    ``max_outputs_per_sample``.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value), a selected
            tensor that is not a Linear/Conv weight or bias, a per-entry prior precision.
    """

    def _parts(self, prep: Prepared, options: LaplaceOptions, theta: Tensor) -> Parts:
        curvature = KronGGN(prep, options)
        return Parts(KronForm(), lambda rows: curvature, per_tensor=True)

    @property
    def H_facs(self) -> KronCurvatureFactors | None:
        """laplace-torch's name for the factors ``H`` (``None`` before :meth:`fit`)."""
        return self.H

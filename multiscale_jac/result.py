"""The result of a per-sample Jacobian computation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .enums import Mode, Strategy
from .subset import ParamSubset

__all__ = ["JacobianResult", "output_mask_from_sizes"]


@dataclass(frozen=True)
class JacobianResult:
    """Per-sample Jacobians and a record of how they were computed.

    Attributes:
        jacobian: ``(N, O, P)``: row ``o`` of sample ``i`` is the derivative of output entry
            ``o`` (the per-sample output flattened, batch dim dropped) w.r.t. the ``P`` selected
            entries in the subset's flat order.
        output_mask: ``(N, O)`` bool, True for real output rows, or ``None`` when every sample
            has ``O`` outputs. Padded rows of ``jacobian`` are exactly zero.
        output_sizes: The number of outputs ``O_i`` of every sample.
        subset: The :class:`~multiscale_jac.subset.ParamSubset` that defines the columns.
        strategy: The strategy that actually ran (``vmap``, ``bucketed``, ``padded`` or
            ``loop``).
        mode: The autodiff mode that actually ran (``rev`` or ``fwd``).
        requested_strategy: What the caller asked for (possibly ``auto``).
        requested_mode: What the caller asked for (possibly ``auto``).
        chunk_size: Samples per vectorised call (``None`` for the loop).
        inner_chunk_size: Output rows (rev) or tangents (fwd) per vectorised step, ``None`` when
            all at once.
        fallback: Why the engine ran another strategy than requested, else ``None``.
        notes: How ``auto`` decided (estimated costs, strategies it ruled out and why).
        structured: The selected tensors whose columns came from the structured path
            (``entries``; forward: :mod:`~multiscale_jac.entries`, reverse:
            :mod:`~multiscale_jac.structured`); the others ran the generic path.
        outputs: ``(N, O)``: every sample's flattened output from the same pass as its
            Jacobian (the same random masks), padded rows zero.
    """

    jacobian: Tensor
    output_mask: Tensor | None
    output_sizes: tuple[int, ...]
    subset: ParamSubset
    strategy: Strategy
    mode: Mode
    requested_strategy: Strategy
    requested_mode: Mode
    chunk_size: int | None = None
    inner_chunk_size: int | None = None
    fallback: str | None = field(default=None)
    notes: tuple[str, ...] = ()
    structured: tuple[str, ...] = ()
    outputs: Tensor | None = None

    @property
    def num_samples(self) -> int:
        """N."""
        return int(self.jacobian.shape[0])

    @property
    def num_outputs(self) -> int:
        """O, the (largest) number of outputs per sample."""
        return int(self.jacobian.shape[1])

    @property
    def numel(self) -> int:
        """P, the number of selected parameter entries."""
        return int(self.jacobian.shape[2])

    def as_dict(self) -> dict[str, Tensor]:
        """Per-parameter-tensor blocks ``(N, O, *selected_shape)`` (views).

        ``selected_shape`` is the parameter's shape for whole-tensor selections and ``(k,)``
        for ``k`` selected entries.
        """
        return self.subset.split(self.jacobian)

    def __repr__(self) -> str:
        fb = f", fallback={self.fallback!r}" if self.fallback else ""
        return (
            f"JacobianResult(jacobian={tuple(self.jacobian.shape)}, strategy={self.strategy.value!r}, "
            f"mode={self.mode.value!r}, ragged_outputs={self.output_mask is not None}{fb})"
        )


def output_mask_from_sizes(sizes: tuple[int, ...], device: torch.device) -> Tensor | None:
    """``(N, max(sizes))`` bool mask of real output rows, or ``None`` when all sizes are equal."""
    if len(set(sizes)) <= 1:
        return None
    o = torch.tensor(sizes, device=device)
    return torch.arange(max(sizes), device=device).unsqueeze(0) < o.unsqueeze(1)

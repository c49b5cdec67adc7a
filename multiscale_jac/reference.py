"""The loop reference: slow, obviously correct, the oracle for every test.

One sample at a time (run as a batch of one, exactly as the engine calls the model), one output
row at a time, plain ``torch.autograd.grad`` w.r.t. the *whole* selected parameter tensors,
then the selected entries are picked out. The engine's ``strategy="loop"``
(:mod:`~multiscale_jac._loop`) is a faster loop, a sample's rows at once by ``jacrev``; it
runs this one's code (:func:`loop_jacobian`) only for a sample whose rows ``jacrev`` cannot
vectorise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ._checks import prepare
from .adapter import PerSampleFunction
from .enums import BatchNormPolicy, InputKind, Mode, Randomness, Strategy
from .packing import PackedBatch
from .result import JacobianResult, output_mask_from_sizes
from .subset import ParamSubset

__all__ = ["per_sample_jacobian_loop"]


def per_sample_jacobian_loop(
    model: nn.Module,
    inputs: Any,
    *,
    params: ParamSubset | str | list[str] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
    batch_norm: str | BatchNormPolicy = "error",
    randomness: str | Randomness = "error",
    input_kind: str | InputKind | None = None,
) -> JacobianResult:
    """Per-sample Jacobians by a plain loop over samples and output rows.

    Arguments mean what they mean for :func:`multiscale_jac.per_sample_jacobian`.

    Returns:
        A :class:`~multiscale_jac.result.JacobianResult` with ``strategy="loop"``,
        ``mode="rev"``; ``jacobian`` is ``(N, O, P)``.
    """
    prep = prepare(
        model,
        inputs,
        params=params,
        output_fn=output_fn,
        batch_norm=batch_norm,
        randomness=randomness,
        input_kind=input_kind,
    )
    jac, outputs, sizes = loop_jacobian(prep.function(prep.packed), prep.packed)
    return JacobianResult(
        jacobian=jac,
        output_mask=output_mask_from_sizes(sizes, jac.device),
        output_sizes=sizes,
        outputs=outputs,
        subset=prep.subset,
        strategy=Strategy.LOOP,
        mode=Mode.REV,
        requested_strategy=Strategy.LOOP,
        requested_mode=Mode.REV,
    )


def loop_jacobian(
    fn: PerSampleFunction, packed: PackedBatch
) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """The loop itself: ``(jacobian (N, O, P), outputs (N, O), output sizes)``, padded rows
    zero."""
    subset = fn.subset
    device = next(iter(fn.values())).device
    packed = packed.to(device)
    rows_per_sample: list[Tensor] = []
    outs: list[Tensor] = []
    for i in range(packed.num_samples):
        levels = tuple(packed.sample(i))
        leaves = {n: fn.params[n].clone().requires_grad_(True) for n in subset.names}
        with torch.enable_grad():
            out = fn.call(fn.full_params(leaves), levels)
            rows = []
            for r in range(out.numel()):
                grads = torch.autograd.grad(
                    out[r], list(leaves.values()), retain_graph=True, allow_unused=True
                )
                full = {
                    n: torch.zeros_like(leaves[n]) if g is None else g
                    for n, g in zip(leaves, grads)
                }
                rows.append(subset.flatten(full))
        outs.append(out.detach())
        rows_per_sample.append(torch.stack(rows) if rows else out.new_zeros((0, subset.numel)))
    sizes = tuple(int(r.shape[0]) for r in rows_per_sample)
    jac = rows_per_sample[0].new_zeros((packed.num_samples, max(sizes), subset.numel))
    outputs = jac.new_zeros(jac.shape[:2])
    for i, (r, o) in enumerate(zip(rows_per_sample, outs)):
        jac[i, : r.shape[0]] = r
        outputs[i, : o.numel()] = o
    return jac, outputs, sizes

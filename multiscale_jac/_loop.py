"""The engine's ``loop`` strategy (private): one sample at a time, as a batch of one, its
Jacobian rows at once by ``torch.func.jacrev`` w.r.t. the selected entries only: what the
per-sample ``jacrev`` loop a user writes does, so that a model that cannot run vectorised over
samples (an op with no batching rule, an in-place write into a tensor made inside the forward
pass, data-dependent control flow) costs what that loop costs. A sample whose rows ``jacrev``
cannot vectorise either runs one row at a time (the loop reference,
:func:`~multiscale_jac.reference.loop_jacobian`), noted.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.func import jacrev

from .adapter import PerSampleFunction
from .packing import PackedBatch
from .reference import loop_jacobian

__all__ = ["sample_loop"]


def sample_loop(
    fn: PerSampleFunction, packed: PackedBatch, notes: list[str]
) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """``(jacobian (N, O, P), outputs (N, O), output sizes)``, padded rows zero, the columns
    in the subset's order."""
    values = fn.values()
    packed = packed.to(values[0].device)
    subset = fn.subset

    def with_output(vals: tuple[Tensor, ...], *levels: Tensor) -> tuple[Tensor, Tensor]:
        out = fn(vals, *levels)
        return out, out.detach()

    rows_of = jacrev(with_output, argnums=0, has_aux=True)
    n = packed.num_samples
    # the subset's columns already tensor by tensor: each tensor's rows go straight into place
    grouped_order = subset.columns is None
    jac = values[0].new_empty((n, 0, subset.numel))
    outputs = values[0].new_empty((n, 0))
    sizes: list[int] = []
    for i in range(n):
        levels = tuple(packed.sample(i))
        try:
            with torch.enable_grad():
                parts, out = rows_of(values, *levels)
        except (RuntimeError, NotImplementedError) as err:
            notes.append(
                f"loop: jacrev cannot vectorise sample {i}'s rows ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:160]}); one row at a time from there"
            )
            rest, out_rest, sizes_rest = loop_jacobian(fn, packed.select(list(range(i, n))))
            jac, outputs = _fit_rows(jac, outputs, rest.shape[1], i)
            jac[i:, : rest.shape[1]] = rest
            jac[i:, rest.shape[1] :] = 0
            outputs[i:, : rest.shape[1]] = out_rest
            outputs[i:, rest.shape[1] :] = 0
            sizes += sizes_rest
            break
        rows = out.numel()
        jac, outputs = _fit_rows(jac, outputs, rows, i)
        target = jac[i, :rows]
        if grouped_order:
            start = 0
            for part in parts:
                width = math.prod(part.shape[1:])
                target[:, start : start + width] = part.reshape(rows, width)
                start += width
        else:
            target.copy_(subset.to_flat_order(torch.cat([p.reshape(rows, -1) for p in parts], 1)))
        jac[i, rows:] = 0
        outputs[i, :rows] = out.reshape(-1)
        outputs[i, rows:] = 0
        sizes.append(rows)
    return jac, outputs, tuple(sizes)


def _fit_rows(jac: Tensor, outputs: Tensor, rows: int, filled: int) -> tuple[Tensor, Tensor]:
    """``jac`` ``(N, O, P)`` and ``outputs`` ``(N, O)`` with room for ``rows`` rows: grown (the
    ``filled`` samples so far copied, their new rows zero) where a sample has more outputs
    than any before it."""
    if rows <= jac.shape[1]:
        return jac, outputs
    grown = jac.new_empty((jac.shape[0], rows, jac.shape[2]))
    grown_out = outputs.new_empty((outputs.shape[0], rows))
    grown[:filled, : jac.shape[1]] = jac[:filled]
    grown[:filled, jac.shape[1] :] = 0
    grown_out[:filled, : outputs.shape[1]] = outputs[:filled]
    grown_out[:filled, outputs.shape[1] :] = 0
    return grown, grown_out

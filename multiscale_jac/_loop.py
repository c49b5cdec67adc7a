"""The engine's ``loop`` strategy (private): one sample at a time, as a batch of one, its
Jacobian rows at once by ``torch.func.jacrev`` w.r.t. the selected entries only: what the
per-sample ``jacrev`` loop a user writes does, so that a model that cannot run vectorised over
samples (an op with no batching rule, an in-place write into a tensor made inside the forward
pass, data-dependent control flow) costs what that loop costs. A sample whose rows ``jacrev``
cannot vectorise either runs one row at a time (the loop reference,
:func:`~multiscale_jac.reference.loop_jacobian`), noted.
"""

from __future__ import annotations

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
    rows: list[Tensor] = []
    outs: list[Tensor] = []
    for i in range(packed.num_samples):
        levels = tuple(packed.sample(i))
        try:
            with torch.enable_grad():
                jac, out = rows_of(values, *levels)
        except (RuntimeError, NotImplementedError) as err:
            notes.append(
                f"loop: jacrev cannot vectorise sample {i}'s rows ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:160]}); one row at a time from there"
            )
            jac_rest, out_rest, sizes_rest = loop_jacobian(
                fn, packed.select(list(range(i, packed.num_samples)))
            )
            rows += [jac_rest[k, :o] for k, o in enumerate(sizes_rest)]
            outs += [out_rest[k, :o] for k, o in enumerate(sizes_rest)]
            break
        grouped = torch.cat([j.reshape(j.shape[0], -1) for j in jac], 1)
        rows.append(subset.to_flat_order(grouped))
        outs.append(out)
    sizes = tuple(int(r.shape[0]) for r in rows)
    result = values[0].new_zeros((packed.num_samples, max(sizes, default=0), subset.numel))
    outputs = result.new_zeros(result.shape[:2])
    for i, (r, o) in enumerate(zip(rows, outs)):
        result[i, : r.shape[0]] = r
        outputs[i, : o.numel()] = o
    return result, outputs, sizes

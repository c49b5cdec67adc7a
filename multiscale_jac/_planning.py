"""Memory estimate and chunk planning for the vectorised engine.

The estimate (documented in ``docs/design.md``) uses three numbers measured on one forward pass
of one sample of each bucket: ``A``, the bytes autograd saves for the backward pass (the
activations); ``M``, the bytes of the largest single saved tensor; and ``O``, the number of
outputs. With ``P`` selected entries, itemsize ``s`` and ``c`` output rows (rev) or tangents
(fwd) processed at once, one sample needs about

* rev: ``A + c * (2 M + P s) + 2 O P s`` (one forward, ``c`` cotangents per layer and ``c``
  parameter-gradient rows alive, the per-sample Jacobian and its chunk pieces);
* fwd: ``A + c * (2 M + O s) + 2 O P s`` (``c`` tangents per layer, ``c`` output tangents).

A vectorised call over ``n`` samples needs ``n`` times that; the returned ``(N, O, P)`` result
is counted once on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .adapter import PerSampleFunction
from .enums import Mode

__all__ = [
    "Footprint",
    "Plan",
    "estimate_seconds",
    "measure",
    "minimum_bytes",
    "per_sample_bytes",
    "plan_chunks",
]

#: Working-set target per vectorised call when neither ``chunk_size`` nor ``memory_budget`` is
#: given: small on CPU (cache-friendly; measured fastest on the seed workload), larger on GPUs.
DEFAULT_WORKSET_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}


@dataclass(frozen=True)
class Footprint:
    """Per-sample facts of one bucket, measured on its first sample."""

    activations: int
    largest: int
    outputs: int


@dataclass(frozen=True)
class Plan:
    """How one bucket is run: ``samples`` per vectorised call and ``inner`` rows/tangents
    per step (``None``: all at once)."""

    samples: int
    inner: int | None


def measure(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> Footprint:
    """Run one sample forward with autograd on and record saved-tensor sizes and ``O``."""
    seen: dict[int, int] = {}

    def pack_hook(t: Tensor) -> Tensor:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without plain storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    leaves = tuple(v.detach().requires_grad_(True) for v in values)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        out = fn(leaves, *levels)
    return Footprint(
        activations=sum(seen.values()),
        largest=max(seen.values(), default=0),
        outputs=int(out.numel()),
    )


def per_sample_bytes(fp: Footprint, mode: Mode, numel: int, itemsize: int, inner: int) -> int:
    """The estimate above for one sample with ``inner`` rows (rev) or tangents (fwd) at once."""
    per_step = 2 * fp.largest + (numel if mode is Mode.REV else fp.outputs) * itemsize
    return fp.activations + inner * per_step + 2 * fp.outputs * numel * itemsize


def plan_chunks(
    fp: Footprint,
    *,
    mode: Mode,
    numel: int,
    full_inner: int,
    itemsize: int,
    bucket_size: int,
    chunk_size: int | None,
    available: int | None,
    device: torch.device,
) -> Plan:
    """Choose samples per call and rows/tangents per step for one bucket.

    Args:
        fp: The bucket's footprint.
        mode: ``rev`` or ``fwd``.
        numel: P.
        full_inner: Rows (rev: O) or tangents (fwd: the largest tangent group) of one sample.
        itemsize: Bytes per element of the Jacobian.
        bucket_size: Samples in the bucket.
        chunk_size: Samples per call fixed by the caller, or ``None``.
        available: Bytes left under the caller's ``memory_budget`` after the result, or
            ``None`` for no budget (then a default working-set target is used).
        device: Where it runs (picks the default target).

    Raises:
        ValueError: ``available`` is below :func:`minimum_bytes` (callers check that first, to
            report the minimum over all buckets).
    """
    full = per_sample_bytes(fp, mode, numel, itemsize, full_inner)
    if available is None:
        target = DEFAULT_WORKSET_BYTES.get(device.type, DEFAULT_WORKSET_BYTES["cuda"])
        n = chunk_size or max(1, target // max(full, 1))
        return Plan(min(n, bucket_size), None)
    n = chunk_size or max(1, available // max(full, 1))
    n = min(n, bucket_size)
    if n * full <= available:
        return Plan(n, None)
    one = per_sample_bytes(fp, mode, numel, itemsize, 1)
    step = one - per_sample_bytes(fp, mode, numel, itemsize, 0)
    inner = (available // n - (one - step)) // max(step, 1)
    if inner < 1:  # the caller checks minimum_bytes first
        raise ValueError(f"memory_budget too small for {n} sample(s) with one row/tangent each")
    return Plan(n, int(min(inner, full_inner)))


def minimum_bytes(fp: Footprint, *, mode: Mode, numel: int, itemsize: int, samples: int) -> int:
    """Working memory of ``samples`` samples with one output row (rev) or tangent (fwd) each."""
    return samples * per_sample_bytes(fp, mode, numel, itemsize, 1)


#: Cost-model constants per device type: seconds per vectorised forward pass (Python tracing of
#: the model under vmap/jacrev: the same order for every small model), seconds per unit of work
#: (activation byte of one sample's forward x output rows or tangents), and the extra factor
#: masked execution costs (a where() and an index_select per op). CPU numbers were measured with
#: TinyFPN on 2 cores (torch 2.13, float32); CUDA numbers are estimates until measured.
COST_CONSTANTS = {
    "cpu": {"call_s": 3e-3, "unit_s": 1.2e-9, "masked": 1.3},
    "cuda": {"call_s": 4e-3, "unit_s": 2e-12, "masked": 1.3},
}


def estimate_seconds(
    groups: list[tuple[int, int, Footprint, int]],
    *,
    mode: Mode,
    numel: int,
    padded: bool,
    device: torch.device,
) -> float:
    """Expected time of a vectorised plan: for every group ``(samples, samples per call,
    footprint, forward passes per call)``,

    ``calls * passes * call_s * f + samples * activations * width * unit_s * f``

    with ``width`` = O (rev) or P (fwd) and ``f`` = ``masked`` for the padded strategy, else 1.
    Only the comparison between strategies matters (``auto``), not the absolute value.
    """
    c = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])
    factor = c["masked"] if padded else 1.0
    total = 0.0
    for samples, per_call, fp, passes in groups:
        calls = -(-samples // per_call)
        width = fp.outputs if mode is Mode.REV else numel
        total += calls * passes * c["call_s"] + samples * fp.activations * width * c["unit_s"]
    return total * factor

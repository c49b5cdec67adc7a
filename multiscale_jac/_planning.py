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
from .entries import NotStructuredError
from .enums import Entries, Mode

__all__ = [
    "EntryCost",
    "Footprint",
    "Plan",
    "estimate_seconds",
    "measure",
    "minimum_bytes",
    "per_sample_bytes",
    "plan_chunks",
    "choose_mode",
    "rev_structured",
    "survey",
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


def per_sample_bytes(
    fp: Footprint, mode: Mode, numel: int, itemsize: int, inner: int, per_step: int | None = None
) -> int:
    """The estimate above for one sample with ``inner`` rows (rev) or tangents (fwd) at once;
    ``per_step`` replaces ``2 M + O s`` (fwd) where the tangents' size was measured (the
    structured pass counts them, :class:`EntryCost`)."""
    if per_step is None:
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
    per_step: int | None = None,
) -> Plan:
    """Choose samples per call and rows/tangents per step for one bucket (and, in fwd, one
    tensor's tangents).

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
        per_step: Measured bytes per row/tangent (see :func:`per_sample_bytes`).

    Raises:
        ValueError: ``available`` is below :func:`minimum_bytes` (callers check that first, to
            report the minimum over all buckets).
    """
    full = per_sample_bytes(fp, mode, numel, itemsize, full_inner, per_step)
    if available is None:
        target = DEFAULT_WORKSET_BYTES.get(device.type, DEFAULT_WORKSET_BYTES["cuda"])
        n = chunk_size or max(1, target // max(full, 1))
        return Plan(min(n, bucket_size), None)
    n = chunk_size or max(1, available // max(full, 1))
    n = min(n, bucket_size)
    if n * full <= available:
        return Plan(n, None)
    one = per_sample_bytes(fp, mode, numel, itemsize, 1, per_step)
    step = one - per_sample_bytes(fp, mode, numel, itemsize, 0, per_step)
    inner = (available // n - (one - step)) // max(step, 1)
    if inner < 1:  # the caller checks minimum_bytes first
        raise ValueError(f"memory_budget too small for {n} sample(s) with one row/tangent each")
    return Plan(n, int(min(inner, full_inner)))


def minimum_bytes(
    fp: Footprint,
    *,
    mode: Mode,
    numel: int,
    itemsize: int,
    samples: int,
    per_step: int | None = None,
) -> int:
    """Working memory of ``samples`` samples with one output row (rev) or tangent (fwd) each."""
    return samples * per_sample_bytes(fp, mode, numel, itemsize, 1, per_step)


#: Cost-model constants per device type: seconds per vectorised forward pass (Python tracing of
#: the model under vmap/jacrev: the same order for every small model), seconds per unit of work
#: (activation byte of one sample's forward x output rows or tangents), and the extra factor
#: masked execution costs (a where() and an index_select per op). CPU numbers were measured with
#: TinyFPN on 2 cores (torch 2.13, float32); CUDA numbers are estimates until measured.
COST_CONSTANTS = {
    "cpu": {
        "call_s": 3e-3,
        "unit_s": 1.2e-9,
        "masked": 1.3,
        "work_s": 2e-10,
        "structured_factor": 3.0,
        "rev_structured_min_numel": 4096,
    },
    "cuda": {
        "call_s": 4e-3,
        "unit_s": 2e-12,
        "masked": 1.3,
        "work_s": 2e-13,
        "structured_factor": 3.0,
        "rev_structured_min_numel": 4096,
    },
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


# ---------------------------------------------------------------------- mode and entries
@dataclass(frozen=True)
class EntryCost:
    """Per-tangent work of one selected tensor, from one structured forward pass of one sample
    (:class:`~multiscale_jac.entries.EntryMode`, no tangents): ``structured`` for the structured
    pass (``None`` if it cannot run the model), ``generic`` for one-hot tangents through the
    same ops (multiply-adds of conv/linear layers, elements of other ops)."""

    structured: int | None
    generic: int
    structured_elems: int | None = None
    generic_elems: int | None = None
    #: why the structured pass cannot run (``structured is None``)
    reason: str = ""


def survey(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> dict[str, EntryCost]:
    """:class:`EntryCost` of every selected tensor (one primal forward pass each)."""
    costs: dict[str, EntryCost] = {}
    with torch.no_grad():
        for pos, name in enumerate(fn.subset.names):
            rec: dict[str, int] = {}
            try:
                fn.entry_call(
                    name, values, levels, values[pos], values[pos].new_zeros(()), stats=rec
                )
            except NotStructuredError as err:
                costs[name] = EntryCost(None, rec.get("dense_work", 0), reason=str(err))
                continue
            structurable = name in fn.entry_names and rec["entry"] + rec["dense_entry"] > 0
            reason = ""
            if not structurable:
                reason = (
                    "not a weight/bias of a Conv1d/Conv2d/Linear module"
                    if name not in fn.entry_names
                    else "never reaches conv/linear as its weight/bias"
                )
            costs[name] = EntryCost(
                rec["work"] if structurable else None,
                rec["dense_work"],
                rec["elems"] if structurable else None,
                rec["dense_elems"],
                reason,
            )
    return costs


def choose_mode(
    costs: dict[str, EntryCost],
    *,
    numel: dict[str, int],
    outputs: float,
    samples: int,
    mode: Mode,
    entries: Entries,
    device: torch.device,
    tensor_numel: dict[str, int] | None = None,
) -> tuple[Mode, tuple[str, ...], dict[str, float]]:
    """Pick ``rev``/``fwd`` (when ``mode`` is ``auto``) and the tensors that run structured.

    Per sample, with ``O`` outputs, ``k_t`` entries of tensor ``t`` and per-tangent work
    ``w_t`` (structured) / ``d_t`` (generic) from :func:`survey`:

    * fwd: ``sum_t k_t (min(f w_t, d_t) + O)`` (``w_t`` only with ``entries`` auto/structured;
      ``f = structured_factor``: a structured multiply-add runs about 3x slower than one of a
      dense batched conv, measured on CPU: one-channel GEMMs, gathers, a Python mode per op);
    * rev: ``O (2 max_t d_t + P)``: one backward per output row through every op after the
      earliest selected tensor (input and weight gradients), then the row written.

    Times ``work_s`` and the sample count, plus ``call_s`` per vectorised call (one per tensor in
    fwd, one in rev). Returns the mode, the structured tensors (in fwd: those whose structured
    work is lower; in rev: with ``entries='auto'`` the tensors of at least
    ``rev_structured_min_numel`` entries (``tensor_numel``), every candidate with
    ``'structured'``; the caller keeps weight entries) and the estimates in seconds (keys
    ``fwd``, ``rev``).
    """
    c = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])
    slow = c["structured_factor"]
    use = {
        n: ec.structured is not None
        and entries is not Entries.GENERIC
        and (entries is Entries.STRUCTURED or slow * ec.structured < ec.generic)
        for n, ec in costs.items()
    }
    fwd_work = sum(
        numel[n] * ((slow * ec.structured if use[n] else ec.generic) + outputs)  # type: ignore[operator]
        for n, ec in costs.items()
    )
    dense = max((ec.generic for ec in costs.values()), default=0)
    rev_work = outputs * (2 * dense + sum(numel.values()))
    est = {
        "fwd": samples * fwd_work * c["work_s"] + len(costs) * c["call_s"],
        "rev": samples * rev_work * c["work_s"] + c["call_s"],
    }
    if mode is Mode.AUTO:
        mode = Mode.FWD if est["fwd"] <= est["rev"] else Mode.REV
    if mode is Mode.FWD:
        return mode, tuple(n for n in costs if use[n]), est
    return mode, rev_structured(tuple(costs), tensor_numel or {}, entries, device), est


def rev_structured(
    names: tuple[str, ...], tensor_numel: dict[str, int], entries: Entries, device: torch.device
) -> tuple[str, ...]:
    """Candidates for the entry-only backward in rev mode (``structured.py``): it saves a full
    weight gradient per output row, so under ``auto`` it runs where that gradient is large (its
    fixed overhead loses on small tensors); all with ``structured``, none with ``generic``.
    The caller keeps weight entries (``PerSampleFunction.with_structured``)."""
    if entries is Entries.GENERIC:
        return ()
    big = COST_CONSTANTS.get(device.type, COST_CONSTANTS["cuda"])["rev_structured_min_numel"]
    return tuple(n for n in names if entries is Entries.STRUCTURED or tensor_numel.get(n, 0) >= big)

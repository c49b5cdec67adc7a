"""One memory model: every route's working set as a function of the job, in bytes. Planning
(samples per call, rows or tangents per step), the minimum a :class:`MemoryBudgetError` states
and every entry point's budget read these functions; nothing else computes a working set, holds
a byte constant or raises :class:`MemoryBudgetError` (:func:`fit_budget` does, for every entry
point; ``tests/test_architecture.py`` checks all three).

The inputs are what planning measured on one forward pass of one sample
(:class:`~multiscale_jac._planning.Footprint`): ``A``, the bytes autograd saves for the backward
pass (``activations``); ``M``, the largest single saved tensor (``largest``); ``O``, the outputs.
``P`` is the number of selected entries and ``s`` the itemsize. The formulas are documented for
users in ``docs/design.md`` ("Memory").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .enums import MemoryBudgetError

__all__ = [
    # byte constants (every one the package has)
    "CACHE_BYTES",
    "CPU_TENSOR_BYTES",
    "DEFAULT_JACOBIAN_BYTES",
    "GP_CONTEXT_BYTES",
    "DEFAULT_TEMP_BYTES",
    "DEFAULT_WORKSET_BYTES",
    "JACNORM_LAYERWISE_BYTES",
    "JACNORM_VMAP_BYTES",
    "MIN_TEMP_BYTES",
    # the budget
    "Fit",
    "fit_budget",
    # working sets
    "chunk_in",
    "cpu_chunk_cap",
    "engine_call",
    "engine_rev_step",
    "engine_tangent",
    "tensor_bytes",
    "engine_result",
    "engine_sample",
    "engine_survey",
    "fisher_kept",
    "fisher_sample",
    "fisher_chunks",
    "jacnorm_kept",
    "kfac_kept",
    "kfac_sample",
    "jacnorm_sample",
    "laplace_column_chunk",
    "laplace_engine_growth",
    "laplace_kept",
    "laplace_reverse_rows",
    "laplace_row",
    "mib",
]


class _Footprint(Protocol):
    activations: int
    largest: int
    outputs: int


#: CPU: the most bytes one tensor of a vectorised chunk should take by default. glibc serves
#: a larger allocation (over its largest dynamic mmap threshold, 32 MiB on 64-bit) with a fresh
#: mapping that every use page-faults in and every free unmaps, and PyTorch's CPU allocator
#: keeps nothing: on a 3-conv CNN (a 369k-entry conv weight) the Jacobian-norm gradient in
#: chunks of 32 samples (47 MB of per-sample gradient for that weight) took 0.44-0.96 s from
#: call to call, in chunks of 16 a steady 0.42 s (2 cores, torch 2.13).
CPU_TENSOR_BYTES = 32 * 2**20
#: Working-set target per vectorised call when neither ``chunk_size`` nor ``memory_budget`` is
#: given: small on CPU (cache-friendly; measured fastest on the ConvBlock subset workload),
#: larger on GPUs.
DEFAULT_WORKSET_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}
#: bytes of per-layer temporaries (unfolded columns, per-sample gradients) per chunk of samples
DEFAULT_TEMP_BYTES = 8 * 2**20
#: the smallest per-layer (or per-call: K-FAC's patches) temporaries a batched run works with
MIN_TEMP_BYTES = 2**16
#: per-sample gradients formed per chunk at most (squared while still in cache)
CACHE_BYTES = 4 * 2**20
#: the Laplace fits' default bytes for the Jacobian rows held at once (per chunk of samples or
#: output positions); the prior search's default budget is four times it
DEFAULT_JACOBIAN_BYTES = 32 * 2**20
#: the GP Laplace's default bytes for its context's Jacobians ``(M, O, P)`` kept between its
#: calls (above it, or above a ``memory_budget``, they are recomputed a chunk at a time for every
#: kernel block and every predictive call, as laplace-torch does for every batch)
GP_CONTEXT_BYTES = 2**30
#: ``jacobian_sq_norm``: per-sample gradients a layer-wise chunk keeps in its graph, at most
#: (its default chunk size)
JACNORM_LAYERWISE_BYTES = 16 * 2**20
#: ``jacobian_sq_norm``: per-sample gradients a ``vmap`` / ``hvp`` chunk keeps, at most (its
#: default chunk size)
JACNORM_VMAP_BYTES = 256 * 2**20


# ---------------------------------------------------------------------- the budget
@dataclass(frozen=True)
class Fit:
    """What a ``memory_budget`` leaves a call (:func:`fit_budget`).

    Attributes:
        units: How many units (samples, rows) of the stated working set fit in :attr:`left`
            (at least one).
        left: Bytes left after what the call keeps throughout and its temporaries.
        temp: Bytes of per-layer temporaries (0 unless asked for).
    """

    units: int
    left: int
    temp: int


def fit_budget(budget: int, kept: int, one: int, detail: str, *, temp: bool = False) -> Fit:
    """The one budget rule: ``kept`` bytes (what the call holds throughout: results, sums,
    factors) and one unit's working set ``one`` (a sample's pass, a row) must fit ``budget``;
    with ``temp``, also the smallest per-layer temporaries (:data:`MIN_TEMP_BYTES`), which then
    take a quarter of what ``kept`` leaves (between that and :data:`DEFAULT_TEMP_BYTES`).

    Raises:
        MemoryBudgetError: ``kept + one`` (and the temporaries) exceed ``budget``; ``detail``
            says what takes the bytes.
    """
    least = kept + one + (MIN_TEMP_BYTES if temp else 0)
    if least > budget:
        raise MemoryBudgetError(budget, least, detail)
    available = budget - kept
    share = max(MIN_TEMP_BYTES, min(DEFAULT_TEMP_BYTES, available // 4)) if temp else 0
    left = available - share
    return Fit(max(1, left // max(1, one)), left, share)


def mib(nbytes: int) -> str:
    """``nbytes`` for a note: ``"12.3 MiB"``."""
    return f"{nbytes / 2**20:.1f} MiB"


def tensor_bytes(elems: int, itemsize: int) -> int:
    """One tensor of ``elems`` entries."""
    return elems * itemsize


def cpu_chunk_cap(device: torch.device, elems_per_sample: int, itemsize: int) -> int | None:
    """Samples per vectorised chunk that keep a tensor of ``elems_per_sample`` entries per
    sample under :data:`CPU_TENSOR_BYTES` on CPU (at least one); ``None`` elsewhere."""
    if device.type != "cpu":
        return None
    return max(1, (CPU_TENSOR_BYTES - 1) // max(1, elems_per_sample * itemsize))


def chunk_in(budget: int, elems_per_sample: int, itemsize: int, samples: int) -> int:
    """Samples (at most ``samples``, at least one) whose temporaries of ``elems_per_sample``
    entries each fit ``budget``."""
    return max(1, min(samples, budget // max(1, elems_per_sample * itemsize)))


# ---------------------------------------------------------------------- the engine
def engine_sample(
    fp: _Footprint,
    rev: bool,
    numel: int,
    itemsize: int,
    inner: int,
    per_step: int | None = None,
    bound: bool = False,
    tangent: int = 0,
    held: int = 0,
) -> int:
    """One sample's working memory with ``inner`` rows (``rev``) or tangents (fwd) at once:
    ``A + inner * per_step + 2 O P s`` (one forward, the per-sample Jacobian and its chunk
    pieces), ``per_step`` being ``2 M + P s`` (rev: cotangents per layer and a parameter-
    gradient row) or ``2 M + O s`` (fwd: tangents per layer and an output tangent) unless
    measured (the structured pass counts it), and in fwd ``(inner + 1) * tangent`` more
    (:func:`engine_tangent`) and what a structured pass holds whatever its tangents
    (``held``: each entry layer's unfolded input and the rows of it the entries multiply).
    Under a ``memory_budget`` (``bound``) the forward counts twice: a structured pass saves
    its layers' unfolded inputs besides the plain forward's tensors, and the call's slices of
    the inputs are copies (a 2-conv CNN's structured fit held 57 kB of them over a 30 kB
    forward)."""
    if per_step is None:
        per_step = 2 * fp.largest + (numel if rev else fp.outputs) * itemsize
    forward = 2 * fp.activations if bound else fp.activations
    tangents = (inner + 1) * tangent
    return forward + inner * per_step + tangents + held + 2 * fp.outputs * numel * itemsize


def engine_survey(fp: _Footprint, held: int) -> int:
    """Planning's structured forward pass of one sample, no tangents (the survey of each
    selected tensor's cost): the forward's tensors (at most ``A``) and what the pass ``held``
    (a conv's unfolded input and its selected rows: 57 kB over a 30 kB forward on a 2-conv
    CNN)."""
    return 2 * fp.activations + held


def engine_rev_step(fp: _Footprint, numel: int, dense: int, itemsize: int, bound: bool) -> int:
    """One output row of a reverse step: the row of ``P`` entries and the full gradients of
    the ``dense`` entries of generic selected tensors, and the cotangents the backward holds
    for it: ``2 M`` (the estimate: a layer's input and output cotangents), or under a
    ``memory_budget`` (``bound``) ``A + 2 M``. A vmapped backward holds more per row than
    two layers' cotangents where a cotangent waits for its other branch (a residual's skip)
    and where batching rules expand a saved tensor over the rows (a BatchNorm's backward):
    a residual block with BatchNorm held 8.8-11.2 MiB a row against ``2 M`` = 3.0 MiB, a
    3-conv CNN 2.55 against 1.91 MiB; no backward holds more cotangents than the forward
    saved tensors, so ``A`` bounds them, and ``2 M`` more covers a batching rule's copies
    (the bound is what a budget promises; without one the estimate plans the chunks). The
    bound also counts the row five times: the gradients' pieces, their flattened copy, the
    row they are concatenated into and a batching rule's copies (one row of an MLP's (256, 64)
    weight held four row-sized gradient pieces and a 64 kB cotangent buffer at once)."""
    if bound:
        return fp.activations + 2 * fp.largest + 5 * (numel + dense) * itemsize
    return 2 * fp.largest + (numel + dense) * itemsize


def engine_tangent(width: int, whole: int, itemsize: int) -> int:
    """What each forward tangent adds to a sample: its one-hot over the span's ``width``
    entries and, for generic entries of tensors selected by index, the tangent of each whole
    tensor (``whole`` entries in all) that putting the entries into it makes; the sample
    also holds one copy of the whole tensors the entries are put into (counted as one more
    tangent). 196 entries of a (256, 2048) weight: 196 tangents of 2 MiB a sample."""
    return (width + whole) * itemsize


def engine_call(sample: int, samples: int) -> int:
    """One vectorised call: ``samples`` times one sample's working set (:func:`engine_sample`)."""
    return samples * sample


def engine_result(samples: int, rows: int, numel: int, itemsize: int) -> int:
    """The returned ``(N, O, P)`` Jacobian and its ``(N, O)`` outputs."""
    return samples * rows * (numel + 1) * itemsize


# ---------------------------------------------------------------------- diag_fisher
def fisher_kept(numel: int, itemsize: int) -> int:
    """The accumulators and the result over ``P`` entries."""
    return 3 * numel * itemsize


def fisher_sample(activations: int, numel: int, itemsize: int) -> int:
    """One sample's forward and backward (the layer-wise temporaries apart:
    :func:`fit_budget`)."""
    return 2 * activations + 2 * numel * itemsize


def fisher_chunks(available: int, activations: int, numel: int, itemsize: int) -> tuple[int, int]:
    """Samples per layer-wise run (the forward kept for its backward passes, twice) and per
    ``vmap`` call (three copies of the activations and the per-sample gradients) in
    ``available`` bytes."""
    layerwise = max(1, available // max(1, 2 * activations))
    vmapped = max(1, available // max(1, 3 * activations + 2 * numel * itemsize))
    return layerwise, vmapped


# ---------------------------------------------------------------------- jacobian_sq_norm
def jacnorm_kept(trainable: int, itemsize: int) -> int:
    """The gradient of the trainable parameters and its chunk's part."""
    return 2 * trainable * itemsize


def jacnorm_sample(
    layerwise: bool, activations: int, numel: int, trainable: int, rows: int, itemsize: int
) -> int:
    """One sample's pass: layer-wise, the forward kept for a double backward (three copies)
    and the per-sample gradients of the ``P`` entries; ``vmap`` / ``hvp``, per output row a
    forward and the trainable parameters' gradient with its graph."""
    if layerwise:
        return 3 * activations + 2 * numel * itemsize
    return rows * (activations + 2 * trainable * itemsize)


# ---------------------------------------------------------------------- K-FAC
def kfac_kept(factor_numel: int, itemsize: int) -> int:
    """The Kronecker factors (their entries) and their running sums."""
    return 2 * factor_numel * itemsize


def kfac_sample(activations: int) -> int:
    """One sample's batched run: the graph, the output copies and one objective's output
    gradients (three copies of the activations)."""
    return 3 * activations


# ---------------------------------------------------------------------- the Laplace fits
def laplace_row(numel: int, itemsize: int) -> int:
    """One Jacobian row the fit holds: the row, a copy and a product (three of ``P s``)."""
    return max(1, 3 * numel * itemsize)


def laplace_engine_growth(numel: int, itemsize: int) -> int:
    """What the engine's working set grows by per row it returns: its result, the outputs and
    the per-sample pieces (about three rows)."""
    return 3 * (numel + 1) * itemsize


def laplace_kept(structure: str, numel: int, itemsize: int) -> int:
    """What a posterior keeps over ``P`` entries: ``full``, the ``(P, P)`` curvature and its
    factor; ``diag``, six vectors; ``kron``, the factors and their eigenvectors (a bound for
    wide layers)."""
    if structure == "full":
        return 2 * numel * numel * itemsize + 4 * numel * itemsize
    if structure == "diag":
        return 6 * numel * itemsize
    if structure == "kron":
        return 4 * numel * itemsize
    raise ValueError(f"unknown posterior structure {structure!r}")


def laplace_reverse_rows(
    row_bytes: int, classes: int, numel: int, outputs: int, itemsize: int
) -> int:
    """Output positions whose rows one block of a sample's pullbacks may hold in ``row_bytes``:
    per row its one-hot cotangent (``O``), the pulled copy and the row (``3 P``)."""
    return max(1, row_bytes // (classes * (3 * numel + 2 * outputs) * itemsize))


def laplace_column_chunk(row_bytes: int, numel: int, outputs: int, itemsize: int) -> int:
    """Columns of ``J`` the column route holds at once in ``row_bytes``: each column, its
    ``Lambda J`` and the pulled copy (three of ``O s``)."""
    return max(1, min(numel, row_bytes // (3 * outputs * itemsize)))

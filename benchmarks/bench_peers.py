"""The benchmark grid: the library against the code a user would write instead, a cell a process.

A cell is a workload on a model with its named grid's parameters (batch size ``n``, entries
``k``: ``workload/model[@n=..,k=..]``). Every method of a cell is timed side by side in ONE
fresh worker process, the training step every ratio is divided by included; checked against
one float64 reference; and measured for peak memory in a fresh process of its own. One timing
method: ``torch.utils.benchmark.Timer`` (``_common.timer_median``, ``_common.timed_call``).

Named grids (``--grid``, ``FAMILIES``; ``all``: every one; ``--quick``: each one's small form)
    main           every workload x model below, every method
    choice         the main cells' library methods: auto against every forced route
    batch          the Fisher and the Jacobian norm at several batch sizes, peak memory
    entries        subset Jacobians at several numbers of entries
    dense          a Laplace fit of per-pixel outputs, sliced (``memory_budget``) or not
    laplace_torch  SubnetLaplace against laplace-torch's subnetwork Laplace (optional peer)
    first_call     each role in a fresh process (``run_roles``): the library's first and warm
                   calls, the user's code, ``tune=False``, the first call after
                   ``multiscale_jac.tuning.load``, ``memory_budget=`` on the batch and on
                   one sample (the fixed overhead); peak RSS of each first call

Workloads
    jacobian  per-sample Jacobian of all outputs w.r.t. all parameters, uniform batch (N=16)
    ragged    the same on a ragged batch of multi-level samples (several shape buckets)
    subset    element-subset Jacobian of 200 random entries (``ParamSubset.from_flat_indices``)
    fisher    diagonal empirical Fisher, classification (N=128)
    jacnorm   ``jacobian_sq_norm(model, x).backward()``, one scalar output per sample (n=128)
    laplace   ``SubnetLaplace(model, "classification", subset).fit(data)``, 100 entries (B=32)

Models (``SPECS``; ``_models.py``): ``vgg11_bn_q``, ``resnet8``, ``cnn3``, ``cnn8``,
``convblock``, ``convblock_wide``, ``tinyfpn``, ``sharedfpn``, ``cifarnet32``/``48``,
``seg_head`` (per-pixel classes), and architectures the cost model was not tuned on, fixed
before measuring: ``tanh_cnn``, ``gelu_cnn``, ``gn_dw``, ``det_head`` (a detection head over
ragged pyramid levels), ``transformer``, ``bifpn`` (the zoo's effdet-style BiFPN, whose ragged
cell gives every sample a shape of its own and one entry in every tensor of every node).

Methods (``--methods``: names or glob patterns; one that does not apply is recorded with the
reason)
    train_step         forward, loss, backward, SGD step (per shape bucket): every ratio's unit
    loop_func          a Python loop over samples of ``torch.func.jacrev`` (fisher: ``grad``;
                       jacnorm: ``grad`` of the squared norm of ``jacrev``)
    vmap_chunks        ``vmap(jacrev)`` / ``vmap(grad)`` in chunks, per shape bucket
    vmap_double_bwd    jacnorm: ``grad`` of the squared norm of ``vmap(grad)``, 16 a chunk
    fwd_over_rev       jacnorm: ``vmap(grad)``, then ``2 sum_i H_i g_i`` by ``jvp`` of ``grad``
    autograd_jacobian  ``torch.autograd.functional.jacobian(vectorize=True)`` per shape bucket
    backpack, opacus, curvlinops, laplace_torch   the peers, where installed
    library_auto       the library with its defaults; ``library_<route>``: every forced route

Timing: each method first runs on a small slice (its time scaled to the batch decides whether
it runs at all: ``--method-limit``), then once on the batch (a library method's first call:
fresh model copy, plan cache cleared), then ``Timer.blocked_autorange``. The contenders (the
training step, auto, the two fastest peers and forced routes) then run interleaved, one call
each per round, ``--rounds`` rounds, their ``seconds`` the median over the rounds.

Output: ``grid.json`` (``grid_quick.json``) in ``--out`` (benchmarks/results): ``runs`` (each
with its environment stamp and configuration) and ``cells`` (each naming its ``family`` and
``run``; a run replaces the cells it measured and keeps the others); then ``render.py``
writes ``grid.md`` and the plots beside it.

Usage::

    python benchmarks/bench_peers.py --grid all --quick   # every named grid, small cells
    python benchmarks/bench_peers.py --grid main batch    # two named grids, full size
    python benchmarks/bench_peers.py --check              # float64 agreement of every method
    python benchmarks/bench_peers.py --dry --grid all     # list the cells and methods only
    python benchmarks/bench_peers.py --cells fisher/resnet8 --memory none
    python benchmarks/bench_peers.py --device cuda --quick --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import json
import math
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    MEMORY_CAVEAT_CPU,
    MEMORY_CAVEAT_CUDA,
    TimeLimit,
    Timer,
    env_stamp,
    error_text,
    load_average,
    malloc_env,
    markdown_table,
    measure_peak_memory,
    run_worker,
    time_limit,
    timed_call,
    timer_median,
    write_json,
)
from _models import (
    NUM_CLASSES,
    WIDTHS,
    CifarNet,
    DetectionHead,
    GeluCNN,
    GroupNormDepthwise,
    PlainCNN,
    SegHead,
    StridedTanhCNN,
    TinyTransformer,
    build_bn_model,
)
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_leaves

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock, MultiBranchNet, SharedHeadFPN, TinyFPN

SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parents[1] / "tests"))  # the zoo's BiFPN: one definition
from cases import BiFPN  # noqa: E402

DEFAULT_OUT = SCRIPT.parent / "results"

WORKLOADS = ("jacobian", "ragged", "subset", "fisher", "jacnorm", "laplace")
JACOBIAN_LIKE = ("jacobian", "ragged", "subset")
_NEW = ("tanh_cnn", "gelu_cnn", "gn_dw")
#: which models run in which workload (``--quick``: ``QUICK_GRID``)
GRID: dict[str, tuple[str, ...]] = {
    "jacobian": ("resnet8", "convblock", "tinyfpn", *_NEW, "det_head", "transformer"),
    "ragged": ("convblock", "tinyfpn", "sharedfpn", "det_head", "bifpn"),
    "subset": (
        "convblock_wide",
        "resnet8",
        "vgg11_bn_q",
        *_NEW,
        "det_head",
        "transformer",
        "bifpn",
    ),
    "fisher": ("vgg11_bn_q", "resnet8", *_NEW, "transformer"),
    "jacnorm": ("cnn3", "cnn8", *_NEW, "transformer"),
    "laplace": ("resnet8", "vgg11_bn_q", *_NEW, "transformer"),
}
QUICK_GRID: dict[str, tuple[str, ...]] = {
    "jacobian": ("gelu_cnn",),
    "ragged": ("det_head",),
    "subset": ("gelu_cnn",),
    "fisher": ("resnet8",),
    "jacnorm": ("gelu_cnn",),
    "laplace": ("gelu_cnn",),
}
#: batch size per workload (full, quick)
SIZES = {
    "jacobian": (16, 8),
    "ragged": (16, 8),
    "subset": (16, 8),
    "fisher": (128, 32),
    "jacnorm": (128, 16),
    "laplace": (32, 16),
}
SUBSET_K = {"subset": 200, "laplace": 100}
CHECK_SAMPLES = 3  # the float64 slice (ragged: 3 samples, else 2) and the warm-up slice
VMAP_CHUNK = 16  # samples per vmap call of the Jacobian / Jacobian-norm peers
#: the timing workers' glibc malloc settings (``--malloc fixed``): freed memory stays in the
#: heap (no trim) and blocks up to 32 MiB (glibc's largest threshold) come from it. With
#: glibc's dynamic default the heap is trimmed after large frees, and the next call's page
#: faults made a route's time depend on what ran before it in the process: the same route on
#: the same data took 47 or 74-156 ms (subset/gelu_cnn, vmap/16), and the fastest samples per
#: call changed with it. Fixed, every method (peers and library alike) runs 30-40% faster here
#: and repeats within a few percent. ``--malloc default`` keeps glibc's behaviour.
MALLOC_FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
FISHER_VMAP_CHUNK = 32  # bench_fisher's
CHUNK_BYTES = 256 * 2**20  # vmap(jacrev): fewer samples per call when their Jacobian is larger


class Skip(Exception):
    """A method that does not apply to this cell, or a peer that is not installed."""


# ---------------------------------------------------------------------- models and cells
@dataclass(frozen=True)
class ModelSpec:
    """``kind``: ``image`` (``(3, 32, 32)`` per sample), ``tokens`` (``(16, 16)``) or ``levels``
    (a list of ``(C_l, H_l, W_l)`` maps, ``levels(h, w)`` their shapes); ``classifier``: the
    output is ``(B, classes)`` logits."""

    name: str
    build: Callable[[int], nn.Module]  # num_outputs -> model (built under a fixed seed)
    kind: str
    description: str
    classifier: bool = True
    levels: Callable[[int, int], list[tuple[int, ...]]] | None = None
    uniform_hw: tuple[int, int] = (0, 0)
    ragged_hw: tuple[tuple[int, int], ...] = ()
    #: the ragged workload differentiates these entries (flat indices into the parameter
    #: vector) instead of every parameter
    ragged_entries: Callable[[nn.Module], Tensor] | None = None
    #: ``image``: the input's height and width; ``dense``: per-pixel classes (targets
    #: ``(N, H, W)``, outputs ``(N, C, H, W)``, the classes first)
    image_hw: tuple[int, int] = (32, 32)
    dense: int = 0


def _half(n: int, k: int) -> int:
    return math.ceil(n / 2**k)


def _fixed(factory: Callable[[], nn.Module], outputs: tuple[int, ...], why: str) -> Any:
    def build(num_outputs: int) -> nn.Module:
        if num_outputs not in outputs:
            raise Skip(why)
        return factory()

    return build


def _zoo(name: str, desc: str, *, jacnorm: bool = False) -> ModelSpec:
    if jacnorm:
        build = lambda: PlainCNN(WIDTHS[name], pool_every=1 if name == "cnn3" else 2)  # noqa: E731
        return ModelSpec(
            name, _fixed(build, (1,), f"{name} has one scalar output"), "image", desc, False
        )
    build = lambda: build_bn_model(name, 0)  # noqa: E731  (BatchNorm statistics set, eval)
    return ModelSpec(
        name, _fixed(build, (NUM_CLASSES,), f"{name} is a 10-class classifier"), "image", desc
    )


def _pyramid(h: int, w: int, ch: int = 8, n: int = 3) -> list[tuple[int, ...]]:
    return [(ch, _half(h, k), _half(w, k)) for k in range(n)]


def _levels(
    name: str, factory: Callable[[], nn.Module], desc: str, levels: Any, hw: Any, ragged: Any = ()
) -> ModelSpec:
    build = _fixed(factory, (0, NUM_CLASSES), f"{name} has a fixed dense output")
    return ModelSpec(name, build, "levels", desc, False, levels, hw, ragged)


_RAGGED4 = ((12, 12), (12, 16), (16, 12), (8, 16))
#: the BiFPN's pyramids: 8/12/16 channels at strides 1, 2, 4 (sizes divisible by 4)
BIFPN_CHANNELS = (8, 12, 16)
#: 16 shapes: a ragged batch of 16 where every sample has a shape of its own (the coarsest
#: level at least 2x2: the training step's BatchNorm needs more than one value a channel)
_BIFPN_HW = tuple((h, w) for h in (8, 12, 16, 20) for w in (8, 12, 16, 20))


def _bifpn() -> nn.Module:
    """``tests/cases.py``'s BiFPN, 3 cells of width 8 over 3 levels, a head of 2 separable
    convs (9 outputs a position), non-trivial BatchNorm statistics."""
    model = BiFPN(BIFPN_CHANNELS, width=8, cells=3, outputs=9, head_repeats=2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def _bifpn_levels(h: int, w: int) -> list[tuple[int, ...]]:
    return [(c, h >> k, w >> k) for k, c in enumerate(BIFPN_CHANNELS)]


def _bifpn_spread(model: nn.Module) -> Tensor:
    """One entry (seeded) in every tensor of every BiFPN node: edge weights, depthwise and
    pointwise convs, BatchNorm scales and shifts (60 entries; flat indices)."""
    g = torch.Generator().manual_seed(3)
    picks, offset = [], 0
    for name, p in model.named_parameters():
        if name.startswith("cells.") and ("edge_weights" in name or "after_combine" in name):
            picks.append(offset + int(torch.randint(p.numel(), (), generator=g)))
        offset += p.numel()
    return torch.tensor(picks)


SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _zoo("vgg11_bn_q", "bench_fisher's CIFAR VGG11-BN, channels x 1/4 (eval mode)"),
        _zoo("resnet8", "bench_fisher's CIFAR ResNet-8 (BatchNorm, eval mode)"),
        _zoo("cnn3", "bench_jacnorm's 3-conv CNN (64/128/320), scalar head", jacnorm=True),
        _zoo("cnn8", "bench_jacnorm's 8-conv CNN (32..128), scalar head", jacnorm=True),
        ModelSpec("tanh_cnn", StridedTanhCNN, "image", "new: strided tanh CNN, 2048->256 head"),
        ModelSpec("gelu_cnn", GeluCNN, "image", "new: 4-conv GELU CNN, average pooling"),
        ModelSpec("gn_dw", GroupNormDepthwise, "image", "new: stem + 2 GroupNorm/depthwise blocks"),
        ModelSpec("transformer", TinyTransformer, "tokens", "new: 2-block transformer, 16 tokens"),
        ModelSpec(
            "multibranch",
            lambda c: MultiBranchNet(ch=16, outputs=c).eval(),
            "image",
            "new: HRNet-style backbone (models.MultiBranchNet: 3 branches, 3 fuse stages), "
            "a 10-class readout",
        ),
        *(
            ModelSpec(
                f"cifarnet{w}",
                lambda c, w=w: CifarNet(w, c),
                "image",
                f"compare_laplace_torch's CIFAR net, width {w} (convs {w}/{2 * w}/{2 * w})",
            )
            for w in (32, 48)
        ),
        ModelSpec(
            "seg_head",
            _fixed(lambda: SegHead(3), (NUM_CLASSES,), "seg_head has 3 classes a pixel"),
            "image",
            "per-pixel classifier (3 classes) on 48x48 images: conv 16/16, conv1x1",
            image_hw=(48, 48),
            dense=3,
        ),
        _levels(
            "convblock",
            lambda: ConvBlock(in_ch=8, out_ch=8),
            "multiscale_jac.models.ConvBlock(in_ch=8, out_ch=8), two levels",
            lambda h, w: [(8, h, w), (8, h // 2 + 2, w // 2 + 2)],
            (16, 16),
            ((16, 16), (14, 18), (18, 14), (12, 20)),
        ),
        _levels(
            "convblock_wide",
            lambda: ConvBlock(in_ch=32, out_ch=8),
            "ConvBlock(in_ch=32, out_ch=8) on 24x24 and 14x14 (the README's)",
            lambda h, w: [(32, h, w), (32, h - 10, w - 10)],
            (24, 24),
        ),
        _levels(
            "tinyfpn",
            lambda: TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1),
            "TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1)",
            lambda h, w: [(8, h, w), (16, _half(h, 1), _half(w, 1))],
            (12, 12),
            ((12, 12), (12, 16), (16, 16), (20, 16)),
        ),
        _levels(
            "sharedfpn",
            lambda: SharedHeadFPN((8, 8, 8), width=8, num_outputs=4, depth=2),
            "SharedHeadFPN((8, 8, 8), width=8, num_outputs=4, depth=2)",
            _pyramid,
            (12, 12),
            (*_RAGGED4, (9, 16), (16, 9)),
        ),
        _levels(
            "det_head",
            lambda: DetectionHead(in_ch=8, num_classes=3),
            "new: detection head (cls 3 + box 4) shared over 3 pyramid levels",
            _pyramid,
            (12, 12),
            _RAGGED4,
        ),
        dataclasses.replace(
            _levels(
                "bifpn",
                _bifpn,
                "new: effdet-style BiFPN (tests/cases.py), 3 cells of width 8 over 3 levels, "
                "a 9-output head; ragged: every sample a shape of its own, one entry in every "
                "BiFPN-node tensor",
                _bifpn_levels,
                (12, 12),
                _BIFPN_HW,
            ),
            ragged_entries=_bifpn_spread,
        ),
    )
}


def flat_out(out: Any) -> Tensor:
    """A model's output (tensor, or list/tuple/dict of them) as ``(B, O)``, leaf by leaf."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tree_leaves(out)], 1)


def flat_grads(params: Sequence[Tensor], gs: Sequence[Tensor | None]) -> Tensor:
    """Gradients (``None``: zero) as one flat vector in parameter order."""
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, gs)]
    )


@dataclass
class Bucket:
    indices: list[int]
    levels: list[Tensor]  # batched (N_b, C_l, ...) per level


@dataclass
class Batch:
    """Samples in the forms the methods need (all views of the same data)."""

    samples: list[list[Tensor]]  # per sample, its unbatched levels
    buckets: list[Bucket]
    inputs: Any  # what the library gets
    targets: Tensor | None  # class labels (N,) or None
    out_sizes: list[int]  # O_i

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def o_max(self) -> int:
        return max(self.out_sizes)

    def labels(self, idx: Any) -> Tensor:
        """The labels of ``idx`` (zeros where the batch has none: a dummy for vmap)."""
        if self.targets is None:
            return torch.zeros(self.n, dtype=torch.long, device=self.samples[0][0].device)[idx]
        return self.targets[idx]


@dataclass
class Cell:
    workload: str
    spec: ModelSpec
    model: nn.Module  # eval mode, on the device, in the cell's dtype
    device: torch.device
    dtype: torch.dtype
    batch: Batch = None  # type: ignore[assignment]
    subset: mj.ParamSubset = None  # type: ignore[assignment]
    cols: Tensor | None = None  # the subset's flat indices (None: all, in order)
    names: list[str] = field(default_factory=list)
    num_params: int = 0

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.spec.name}"

    @property
    def ragged(self) -> bool:
        return self.workload == "ragged"

    @property
    def tensor_input(self) -> bool:
        return self.spec.kind != "levels"

    @property
    def jacobian_like(self) -> bool:
        return self.workload in JACOBIAN_LIKE or self.workload == "laplace"

    def model_input(self, levels: Sequence[Tensor]) -> Any:
        return levels[0] if self.tensor_input else list(levels)

    def forward(self, model: nn.Module, levels: Sequence[Tensor]) -> Tensor:
        """``(B, O)`` outputs of ``model`` on batched levels."""
        return flat_out(model(self.model_input(levels)))

    def params(self, model: nn.Module) -> dict[str, Tensor]:
        return {n: p.detach() for n, p in model.named_parameters()}

    def sample_fn(self, model: nn.Module) -> Callable[..., Tensor]:
        """``f(params, *levels) -> (O,)`` for one unbatched sample (the torch.func peers)."""

        def f(p: dict[str, Tensor], *levels: Tensor) -> Tensor:
            out = functional_call(model, p, (self.model_input([t.unsqueeze(0) for t in levels]),))
            return flat_out(out)[0]

        return f

    def flat(self, per_tensor: dict[str, Tensor], batch_dims: int = 0) -> Tensor:
        """Per-tensor ``(*batch, *shape)`` -> ``(*batch, P_total)`` in parameter order."""
        return torch.cat(
            [per_tensor[n].reshape(*per_tensor[n].shape[:batch_dims], -1) for n in self.names], -1
        )

    def select(self, full: Tensor) -> Tensor:
        """``(..., P_total)`` -> the subset's columns."""
        return full if self.cols is None else full.index_select(-1, self.cols.to(full.device))

    def slice(self, k: int) -> Batch:
        """The first ``k`` samples as a batch of their own."""
        b, k = self.batch, min(k, self.batch.n)
        tg = None if b.targets is None else b.targets[:k]
        return make_batch(self, b.samples[:k], tg, b.out_sizes[:k])

    def small(self) -> Batch:
        """The warm-up and float64 slice: 3 samples of a ragged batch (3 buckets), else 2."""
        return self.slice(CHECK_SAMPLES if self.ragged else CHECK_SAMPLES - 1)


def make_batch(
    cell: Cell, samples: list[list[Tensor]], targets: Any, out_sizes: list[int]
) -> Batch:
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(tuple(t.shape) for t in s), []).append(i)
    buckets = [
        Bucket(idx, [torch.stack([samples[i][lv] for i in idx]) for lv in range(len(samples[0]))])
        for idx in groups.values()
    ]
    if cell.ragged:
        inputs: Any = [list(s) for s in samples]
    else:
        (only,) = buckets
        inputs = cell.model_input(only.levels)
    return Batch(samples, buckets, inputs, targets, out_sizes)


def build_cell(
    workload: str,
    model_name: str,
    *,
    quick: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    n: int | None = None,
    k: int | None = None,
) -> Cell:
    """The cell's model, batch and subset, deterministic in ``seed`` (every worker builds the
    same one; float64 is the float32 model converted); ``n``, ``k``: a named grid's batch size
    and entries (default: the workload's)."""
    spec = SPECS[model_name]
    device = torch.device(device)
    torch.manual_seed(seed)
    outputs = 1 if workload == "jacnorm" else (NUM_CLASSES if spec.classifier else 0)
    model = spec.build(outputs).eval().to(device=device, dtype=dtype)
    cell = Cell(workload, spec, model, device, dtype)
    n = n or SIZES[workload][1 if quick else 0]
    if cell.ragged and spec.kind != "levels":
        raise Skip(f"{model_name} takes one tensor, not a list of levels")
    g = torch.Generator().manual_seed(seed + 1)
    if spec.kind == "levels":
        assert spec.levels is not None
        hws = [spec.uniform_hw] * n
        if cell.ragged:  # the first samples differ in size (the slices span several buckets),
            # the rest shuffled (buckets not contiguous)
            rest = torch.randperm(n - CHECK_SAMPLES, generator=g) + CHECK_SAMPLES
            order = list(range(CHECK_SAMPLES)) + rest.tolist()
            hws = [spec.ragged_hw[order[i] % len(spec.ragged_hw)] for i in range(n)]
        samples = [[torch.randn(*shp, generator=g) for shp in spec.levels(*hw)] for hw in hws]
    else:
        shape = (16, 16) if spec.kind == "tokens" else (3, *spec.image_hw)
        samples = [[torch.randn(*shape, generator=g)] for _ in range(n)]
    samples = [[t.to(device=device, dtype=dtype) for t in s] for s in samples]
    targets = None
    if workload in ("fisher", "laplace") or (spec.classifier and workload != "jacnorm"):
        if not spec.classifier:
            raise Skip(f"{model_name} is not a classifier")
        classes, pixels = (spec.dense, spec.image_hw) if spec.dense else (NUM_CLASSES, ())
        targets = torch.randint(0, classes, (n, *pixels), generator=g).to(device)
    cell.names = [name for name, _ in model.named_parameters()]
    cell.num_params = sum(p.numel() for p in model.parameters())
    cell.subset = mj.ParamSubset.all(model)
    if workload in SUBSET_K or k:
        gs = torch.Generator().manual_seed(seed + 2)
        idx = torch.randperm(cell.num_params, generator=gs)[: k or SUBSET_K[workload]]
        cell.subset = mj.ParamSubset.from_flat_indices(model, idx)
        cell.cols = idx.to(device)
    if cell.ragged and spec.ragged_entries is not None and not k:
        idx = spec.ragged_entries(model)
        cell.subset = mj.ParamSubset.from_flat_indices(model, idx)
        cell.cols = idx.to(device)
    with torch.no_grad():
        out_sizes = [cell.forward(model, [t[None] for t in s]).shape[1] for s in samples]
    cell.batch = make_batch(cell, samples, targets, out_sizes)
    return cell


def cell_summary(cell: Cell) -> dict[str, Any]:
    b = cell.batch
    return {
        "workload": cell.workload,
        "model": cell.spec.name,
        "description": cell.spec.description,
        "N": b.n,
        "O": b.o_max,
        "O_min": min(b.out_sizes),
        "P": cell.subset.numel,
        "params_total": cell.num_params,
        "shape_buckets": len(b.buckets),
        "input_shapes": sorted({str([tuple(t.shape) for t in s]) for s in b.samples}),
    }


# ---------------------------------------------------------------------- the training step
def loss_of(out: Tensor, targets: Tensor | None) -> Tensor:
    """CrossEntropy (sum) for classifiers with labels (per pixel: ``out`` has the classes
    first), else half the sum of squared outputs."""
    if targets is not None and targets.dim() > 1:
        return F.cross_entropy(
            out.reshape(len(out), -1, *targets.shape[1:]), targets, reduction="sum"
        )
    if targets is not None:
        return F.cross_entropy(out, targets, reduction="sum")
    return 0.5 * out.pow(2).sum()


def train_step(cell: Cell, _model: nn.Module) -> Run:
    """Forward, loss, backward (one per shape bucket), SGD step, zero_grad on a train-mode
    copy of the model."""
    model = copy.deepcopy(cell.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(batch: Batch) -> None:
        for b in batch.buckets:
            t = None if batch.targets is None else batch.targets[b.indices]
            loss_of(cell.forward(model, b.levels), t).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


# ---------------------------------------------------------------------- shared pieces
Run = Callable[[Batch], Any]  # a prepared method: a batch -> its result (see ``compare``)
Prepare = Callable[[Cell, nn.Module], Run]


class Sink:
    """Where a method puts per-sample results ``(n, [O,] P_total)``: the Jacobian ``(N, O, P)``
    (the subset's columns) of the Jacobian workloads and Laplace, the Fisher's mean of squares,
    the Jacobian norm's sum."""

    def __init__(self, cell: Cell, batch: Batch) -> None:
        self.cell, self.n = cell, batch.n
        shape = (
            (batch.n, batch.o_max, cell.subset.numel) if cell.jacobian_like else (cell.num_params,)
        )
        self.value = torch.zeros(shape, dtype=cell.dtype, device=cell.device)

    def add(self, idx: Any, t: Tensor, row: int | None = None) -> None:
        if not self.cell.jacobian_like:
            self.value += (t**2 if self.cell.workload == "fisher" else t).sum(0)
        elif row is None:
            self.value[idx, : t.shape[1]] = self.cell.select(t)
        else:
            self.value[idx, row] = self.cell.select(t)

    def result(self) -> Tensor:
        return self.value / self.n if self.cell.workload == "fisher" else self.value


def ggn(jac: Tensor, logits: Tensor, classes: int = 0) -> Tensor:
    """``sum_i J_i^T (diag p_i - p_i p_i^T) J_i`` for ``J`` ``(N, C, K)``, logits ``(N, C)``;
    ``classes``: dense outputs ``(N, classes * pixels)``, a softmax per pixel."""
    if classes:
        n, o, k = jac.shape
        jac = jac.reshape(n, classes, o // classes, k).transpose(1, 2).reshape(-1, classes, k)
        logits = logits.reshape(n, classes, -1).transpose(1, 2).reshape(-1, classes)
    p = logits.softmax(-1)
    jp = torch.einsum("nck,nc->nk", jac, p)
    return torch.einsum("nck,nc,ncl->kl", jac, p, jac) - jp.T @ jp


def activation_numels(cell: Cell) -> tuple[int, int]:
    """``(max, sum)`` of the leaf modules' output sizes on the largest sample."""
    sizes: list[int] = []
    hook = lambda _m, _i, out: sizes.extend(t.numel() for t in tree_leaves(out))  # noqa: E731
    leaves = [m for m in cell.model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    i = max(range(cell.batch.n), key=lambda k: cell.batch.out_sizes[k])
    try:
        with torch.no_grad():
            cell.forward(cell.model, [t[None] for t in cell.batch.samples[i]])
    finally:
        for h in handles:
            h.remove()
    return max(sizes, default=1), sum(sizes)


def lanes_estimate(cell: Cell, batch: Batch) -> int:
    """Bytes of a vectorised backward with one lane per output row through a whole bucket
    (``autograd.functional.jacobian(vectorize=True)``, curvlinops' transposed Jacobian): about
    six of the largest layer's ``(lanes, N_b, ...)`` tensors (bench_fisher's measured rule) plus
    the ``(lanes, P)`` Jacobian three times; the Fisher has one lane per sample; the Jacobian
    norm keeps every layer's output for its second backward."""
    act_max, act_sum = activation_numels(cell)
    item = torch.empty((), dtype=cell.dtype).element_size()
    worst = 0
    for b in batch.buckets:
        nb = len(b.indices)
        if cell.workload == "jacnorm":
            worst = max(worst, nb * nb * act_sum * item * 2 + nb * cell.num_params * item * 3)
            continue
        lanes = nb * (1 if cell.workload == "fisher" else batch.out_sizes[b.indices[0]])
        worst = max(worst, lanes * nb * act_max * item * 6 + lanes * cell.num_params * item * 3)
    return worst


def functional_forward(cell: Cell, model: nn.Module) -> Callable[..., Tensor]:
    """``g(params_tuple, levels) -> (B, O)`` through ``functional_call``."""
    names = [n for n, _ in model.named_parameters()]

    def g(ps: Sequence[Tensor], levels: Sequence[Tensor]) -> Tensor:
        return flat_out(functional_call(model, dict(zip(names, ps)), (cell.model_input(levels),)))

    return g


def _import(module: str, what: str) -> Any:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{what} not installed (pip install it to compare)")
    return importlib.import_module(module)


def _reuses_modules(cell: Cell) -> bool:
    """Whether a forward calls a module holding parameters more than once (a shared head)."""
    calls: dict[int, int] = {}
    hook = lambda m, _i, _o: calls.__setitem__(id(m), calls.get(id(m), 0) + 1)  # noqa: E731
    owners = [m for m in cell.model.modules() if any(True for _ in m.parameters(recurse=False))]
    handles = [m.register_forward_hook(hook) for m in owners]
    try:
        with torch.no_grad():
            cell.forward(cell.model, [t[None] for t in cell.batch.samples[0]])
    finally:
        for h in handles:
            h.remove()
    return max(calls.values(), default=1) > 1


def _clear(params: Sequence[nn.Parameter]) -> None:
    """Drop ``.grad`` and what BackPACK and Opacus store on the parameters."""
    for p in params:
        p.grad = None
        p.grad_sample = None
        for attr in ("grad_batch", "sum_grad_squared"):
            if hasattr(p, attr):
                delattr(p, attr)


# ---------------------------------------------------------------------- the peers
REUSED = "a module is applied more than once per forward (shared over levels); its hooks keep one"
NO_SECOND = "no per-sample second derivatives (the regulariser's gradient needs them)"


def _per_sample(cell: Cell, model: nn.Module) -> Callable[..., dict[str, Tensor]]:
    """``h(params, label, *levels)`` for one sample: its Jacobian (per tensor, ``(O, *shape)``),
    the gradient of its log-likelihood (fisher) or of its squared Jacobian norm (jacnorm)."""
    f = cell.sample_fn(model)
    if cell.workload == "fisher":

        def nll(p: dict[str, Tensor], y: Tensor, *levels: Tensor) -> Tensor:
            return F.cross_entropy(f(p, *levels)[None], y[None], reduction="sum")

        return grad(nll)
    if cell.workload == "jacnorm":

        def sq_norm(p: dict[str, Tensor], _y: Tensor, *levels: Tensor) -> Tensor:
            return sum((j**2).sum() for j in jacrev(f)(p, *levels).values())

        return grad(sq_norm)
    return jacrev(lambda p, _y, *levels: f(p, *levels))


def loop_func(cell: Cell, model: nn.Module) -> Run:
    """A Python loop over the samples of :func:`_per_sample`; a Jacobian w.r.t. a subset
    differentiates the tensors that hold its entries only (the rest constant), as a user
    would write it."""
    h, params, dims = _per_sample(cell, model), cell.params(model), int(cell.jacobian_like)
    if cell.cols is not None and cell.workload in JACOBIAN_LIKE:
        held = set(cell.subset.names)
        f = cell.sample_fn(model)
        jf = jacrev(lambda sel, *levels: f({**params, **sel}, *levels))
        chosen = {n: p for n, p in params.items() if n in held}

        def run_selected(batch: Batch) -> Tensor:
            sink = Sink(cell, batch)
            for i, s in enumerate(batch.samples):
                jac = jf(chosen, *s)
                o = batch.out_sizes[i]
                full = {
                    n: jac[n] if n in jac else params[n].new_zeros(o, *p.shape)
                    for n, p in params.items()
                }
                sink.add([i], cell.flat(full, 1)[None])
            return sink.result()

        return run_selected

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for i, s in enumerate(batch.samples):
            sink.add([i], cell.flat(h(params, batch.labels(i), *s), dims)[None])
        return sink.result()

    return run


def vmap_chunks(cell: Cell, model: nn.Module) -> Run:
    """``vmap`` of :func:`_per_sample` in chunks, per shape bucket."""
    h, params, dims = _per_sample(cell, model), cell.params(model), int(cell.jacobian_like) + 1
    item = torch.empty((), dtype=cell.dtype).element_size()

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for b in batch.buckets:
            vh = vmap(h, in_dims=(None, 0, *[0] * len(b.levels)))
            c = FISHER_VMAP_CHUNK
            if cell.jacobian_like:
                o = batch.out_sizes[b.indices[0]]
                c = max(1, min(VMAP_CHUNK, CHUNK_BYTES // max(1, o * cell.num_params * item)))
            for s in range(0, len(b.indices), c):
                idx = b.indices[s : s + c]
                out = vh(params, batch.labels(idx), *[t[s : s + c] for t in b.levels])
                sink.add(idx, cell.flat(out, dims))
        return sink.result()

    return run


def _scalar_chunks(cell: Cell, model: nn.Module, batch: Batch):
    """jacnorm peers: ``(grad of the scalar output, params, chunks of levels)``."""
    f = cell.sample_fn(model)
    g1 = grad(lambda p, *levels: f(p, *levels).sum())
    chunks = [
        [t[s : s + VMAP_CHUNK] for t in b.levels]
        for b in batch.buckets
        for s in range(0, len(b.indices), VMAP_CHUNK)
    ]
    return g1, cell.params(model), chunks


def vmap_double_bwd(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``vmap_grad_chunks``: ``grad`` of the squared norm of ``vmap(grad)``."""

    def run(batch: Batch) -> Tensor:
        g1, params, chunks = _scalar_chunks(cell, model, batch)
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for lv in chunks:

            def sq_norm(p: dict[str, Tensor], lv: list[Tensor] = lv) -> Tensor:
                per = vmap(g1, in_dims=(None, *[0] * len(lv)))(p, *lv)
                return sum((g**2).sum() for g in per.values())

            for n, g in grad(sq_norm)(params).items():
                acc[n] += g
        return cell.flat(acc)

    return run


def fwd_over_rev(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``fwd_over_rev``: ``2 sum_i H_i g_i`` with ``jvp`` of ``grad``."""

    def run(batch: Batch) -> Tensor:
        g1, params, chunks = _scalar_chunks(cell, model, batch)
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for lv in chunks:

            def hvp(gi: dict[str, Tensor], *x: Tensor) -> dict[str, Tensor]:
                return jvp(lambda p: g1(p, *x), (params,), (gi,))[1]

            gs = vmap(g1, in_dims=(None, *[0] * len(lv)))(params, *lv)
            for n, h in vmap(hvp)(gs, *lv).items():
                acc[n] += 2 * h.sum(0)
        return cell.flat(acc)

    return run


def autograd_jacobian(cell: Cell, model: nn.Module) -> Run:
    """``torch.autograd.functional.jacobian(vectorize=True)`` per bucket: of the outputs, of the
    log-likelihoods (fisher: the EWC code users write), or with ``create_graph`` and a second
    ``autograd.grad`` of the squared sum (jacnorm)."""
    g, w = functional_forward(cell, model), cell.workload
    ps = tuple(p.detach() for p in model.parameters())

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for b in batch.buckets:
            y = batch.labels(b.indices)

            def vec(*q: Tensor, lv: list[Tensor] = b.levels, y: Tensor = y) -> Tensor:
                out = g(q, lv)
                return (
                    out.log_softmax(1).gather(1, y[:, None])[:, 0]
                    if w == "fisher"
                    else out.reshape(-1)
                )

            leaves = tuple(p.clone().requires_grad_(True) for p in ps) if w == "jacnorm" else ps
            jac = torch.autograd.functional.jacobian(
                vec, leaves, vectorize=True, create_graph=w == "jacnorm"
            )
            rows = torch.cat([j.reshape(j.shape[0], -1) for j in jac], 1)
            if w == "jacnorm":
                gs = torch.autograd.grad(rows.pow(2).sum(), leaves, allow_unused=True)
                sink.add(None, flat_grads(ps, gs)[None])
            else:
                sink.add(
                    b.indices,
                    rows.reshape(len(b.indices), -1, rows.shape[1]) if cell.jacobian_like else rows,
                )
        return sink.result()

    return run


def backpack(cell: Cell, model: nn.Module) -> Run:
    """BackPACK: ``BatchGrad``, one backward per output row; fisher: ``SumGradSquared``."""
    if cell.workload == "jacnorm":
        raise Skip(f"BackPACK: {NO_SECOND}")
    if _reuses_modules(cell):
        raise Skip(f"BackPACK: {REUSED}")
    bp = _import("backpack", "BackPACK")
    from backpack.extensions import BatchGrad, SumGradSquared

    ext, lossfunc = bp.extend(copy.deepcopy(model)), bp.extend(nn.CrossEntropyLoss(reduction="sum"))
    params = list(ext.parameters())

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for b in batch.buckets:
            nb, o, y = len(b.indices), batch.out_sizes[b.indices[0]], cell.forward(ext, b.levels)
            if cell.workload == "fisher":
                with bp.backpack(SumGradSquared()):
                    lossfunc(y, batch.targets[b.indices]).backward()
                sink.value += torch.cat([p.sum_grad_squared.reshape(-1) for p in params])
                _clear(params)
                continue
            for r in range(o):
                keep = r < o - 1  # BackPACK frees the stored module IO unless told not to
                with bp.backpack(BatchGrad(), retain_graph=keep):
                    y[:, r].sum().backward(retain_graph=keep)
                if not all(hasattr(p, "grad_batch") for p in params):
                    raise Skip("BackPACK has no BatchGrad rule for a module holding parameters")
                sink.add(b.indices, torch.cat([p.grad_batch.reshape(nb, -1) for p in params], 1), r)
                _clear(params)
        return sink.result()

    return run


def opacus(cell: Cell, model: nn.Module) -> Run:
    """Opacus ``GradSampleModule``: a forward and backward per output row (it pops its
    activations in the backward); fisher: per-sample gradients of the loss, squared."""
    if cell.workload == "jacnorm":
        raise Skip(f"Opacus: {NO_SECOND}")
    if _reuses_modules(cell):
        raise Skip(f"Opacus: {REUSED}")
    op = _import("opacus", "Opacus")
    if any(True for _ in model.buffers()):
        raise Skip("Opacus does not support layers with buffers (BatchNorm)")
    try:
        gsm = op.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    except Exception:  # refused for DP training: run without the checks
        gsm = op.GradSampleModule(copy.deepcopy(model), loss_reduction="sum", strict=False)
    params = list(gsm._module.parameters())

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            for r in [None] if cell.workload == "fisher" else range(o):
                _clear(params)
                out = cell.forward(gsm, b.levels)
                loss = (
                    out[:, r].sum()
                    if r is not None
                    else F.cross_entropy(out, batch.targets[b.indices], reduction="sum")
                )
                try:
                    loss.backward()
                except (ValueError, NotImplementedError) as e:  # a layer it does not support
                    raise Skip(f"Opacus: {str(e)[:120]}") from None
                if any(p.grad_sample is None for p in params):
                    raise RuntimeError("opacus left no grad_sample for a parameter tensor")
                sink.add(
                    b.indices, torch.cat([p.grad_sample.reshape(nb, -1) for p in params], 1), r
                )
        _clear(params)
        return sink.result()

    return run


class _Flat(nn.Module):
    """The model as curvlinops wants it: one tensor or a dict of levels in, ``(B, O)`` out."""

    def __init__(self, cell: Cell, model: nn.Module) -> None:
        super().__init__()
        self.cell, self.model = cell, model

    def forward(self, x: Any) -> Tensor:
        levels = [x] if self.cell.tensor_input else [x[str(k)] for k in range(len(x))]
        return self.cell.forward(self.model, levels)


def curvlinops(cell: Cell, model: nn.Module) -> Run:
    """curvlinops: ``JacobianLinearOperator`` @ one-hot columns (subset),
    ``TransposedJacobianLinearOperator`` @ identity (jacobian, ragged), the subset submatrix of
    ``GGNLinearOperator`` @ identity (laplace)."""
    if cell.workload in ("fisher", "jacnorm"):
        raise Skip(
            "curvlinops has no exact diagonal (only Hutchinson estimates, or P matvecs)"
            if cell.workload == "fisher"
            else "curvlinops: operators of one batch, no per-sample Jacobian-norm gradient"
        )
    cl = _import("curvlinops", "curvlinops")
    wrapped = _Flat(cell, model)
    params = list(wrapped.parameters())
    size = (lambda v: v.shape[0]) if cell.tensor_input else (lambda v: v["0"].shape[0])
    kw = {"check_deterministic": False, "batch_size_fn": size}

    def run(batch: Batch) -> Tensor:
        out = Sink(cell, batch).value
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            x = b.levels[0] if cell.tensor_input else {str(k): t for k, t in enumerate(b.levels)}
            data = [(x, batch.labels(b.indices))]
            if cell.workload == "laplace":
                idx = [int(i) for i in cell.cols.tolist()]  # type: ignore[union-attr]
                loss = nn.CrossEntropyLoss(reduction="sum")
                op = cl.GGNLinearOperator(wrapped, loss, params, data, num_data=nb, **kw)
                eye = torch.eye(len(idx), dtype=cell.dtype, device=cell.device)
                return cl.SubmatrixLinearOperator(op, idx, idx) @ eye
            if cell.cols is not None:  # J @ one-hot columns of the subset (forward mode)
                op = cl.JacobianLinearOperator(wrapped, params, data, num_data=nb, **kw)
                e = torch.zeros(
                    cell.num_params, len(cell.cols), dtype=cell.dtype, device=cell.device
                )
                e[cell.cols, torch.arange(len(cell.cols), device=cell.device)] = 1
                out[b.indices, :o] = (op @ e).reshape(nb, o, -1)
            else:  # J^T @ identity (one vector-Jacobian product per output row)
                op = cl.TransposedJacobianLinearOperator(wrapped, params, data, num_data=nb, **kw)
                eye = torch.eye(nb * o, dtype=cell.dtype, device=cell.device)
                out[b.indices, :o] = (op @ eye).T.reshape(nb, o, -1)
        return out

    return run


def laplace_torch(cell: Cell, model: nn.Module) -> Run:
    """laplace-torch's subnetwork Laplace: ``Laplace(model, "classification",
    subset_of_weights="subnetwork", hessian_structure="full", subnetwork_indices=...)``
    ``.fit`` on a ``DataLoader`` of the batch; its ``H`` in the subset's order."""
    if cell.workload != "laplace" or not cell.tensor_input or cell.spec.dense:
        raise Skip("laplace-torch: one tensor and one label a sample")
    lt = _import("laplace", "laplace-torch")
    from torch.utils.data import DataLoader, TensorDataset

    cols, order = cell.cols.sort()  # type: ignore[union-attr]
    inv = order.argsort()

    def run(batch: Batch) -> Tensor:
        data = TensorDataset(batch.buckets[0].levels[0], batch.targets)
        la = lt.Laplace(
            model,
            "classification",
            subset_of_weights="subnetwork",
            hessian_structure="full",
            subnetwork_indices=cols.clone(),
        )
        la.fit(DataLoader(data, batch_size=batch.n))
        return la.H[inv][:, inv]

    return run


def with_ggn(prep: Prepare) -> Prepare:
    """laplace: a Jacobian peer, then what a user adds: the logits and ``J^T Lambda J``."""

    def wrapped(cell: Cell, model: nn.Module) -> Run:
        jac_run = prep(cell, model)

        def run(batch: Batch) -> Tensor:
            logits = torch.zeros(batch.n, batch.o_max, dtype=cell.dtype, device=cell.device)
            with torch.no_grad():
                for b in batch.buckets:
                    logits[b.indices] = cell.forward(model, b.levels)
            return ggn(jac_run(batch), logits, cell.spec.dense)

        return run

    return wrapped


# ---------------------------------------------------------------------- the library
@dataclass
class LibraryResult:
    value: Any
    info: dict[str, Any]


def library(tune: Any = None, **kw: Any) -> Prepare:
    """The library's entry point for the cell's workload, with defaults (no ``kw``) or a forced
    route (``kw`` and ``strict=True``): ``per_sample_jacobian``, ``diag_fisher``,
    ``jacobian_sq_norm(...).backward()``, ``SubnetLaplace(...).fit``; ``tune`` passed where
    given (the memory workers force a route with ``tune=False``: nothing timed)."""
    opts: dict[str, Any] = {**kw, "strict": True} if kw else {}
    if tune is not None:
        opts["tune"] = tune

    def prep(cell: Cell, model: nn.Module) -> Run:
        w = cell.workload
        if kw.get("strategy") == "vmap" and cell.ragged:
            raise Skip("strategy='vmap' needs one shape signature (a ragged batch has several)")
        subset = {} if cell.cols is None else {"params": cell.subset}
        params = list(model.parameters())
        if kw.get("memory_budget") == "sliced":
            opts["memory_budget"] = sliced_budget(cell, model)

        def run(batch: Batch) -> LibraryResult:
            before = mj.plan_cache_info()
            info: dict[str, Any] = {}
            if w in JACOBIAN_LIKE:
                res = mj.per_sample_jacobian(model, batch.inputs, **subset, **opts)
                value = res.jacobian
                info = {k: str(getattr(res, k, None)) for k in ("strategy", "mode", "fallback")}
                info["chosen"] = {"strategy": str(res.strategy), "mode": str(res.mode)}
                info["chosen"].update(_route_of(res))
                notes = [str(n) for n in getattr(res, "notes", ()) or ()]
                info["notes"] = [n[:200] for n in notes[:6]]
                priced = [re.search(r"^plan: \S+ estimated ([\d.e+-]+) ms", n) for n in notes]
                info["estimate_s"] = next((float(m[1]) / 1e3 for m in priced if m), None)
            elif w == "fisher":
                res = mj.diag_fisher(model, [(batch.inputs, batch.targets)], **opts)
                plan = {str(v) for v in (res.plan or {}).values()}
                value, info = res.flat, {"method": str(res.method), "plan": sorted(plan)}
                valid = {m.value for m in mj.FisherMethod}  # else a mix: auto's own
                info["chosen"] = {"method": str(res.method)} if str(res.method) in valid else {}
            elif w == "jacnorm":
                model.zero_grad(set_to_none=True)
                with _jacnorm_jobs() as jobs:
                    mj.jacobian_sq_norm(model, batch.inputs, **opts).backward()
                notes = [str(n) for job in jobs for n in job.notes]
                value = flat_grads(params, [p.grad for p in params])
                model.zero_grad(set_to_none=True)
                chose = [re.search(r"(?:chose |^plan: )(\w+)/(\d+)", n) for n in notes]
                ran = next((m for m in reversed(chose) if m), None)  # tune=True's, or recalled
                if ran:
                    info["method"] = f"{ran[1]}/{ran[2]}"
                    info["chosen"] = {"method": ran[1], "chunk_size": int(ran[2])}
                info["notes"] = [n[:300] for n in notes[:6]]
            else:
                la = mj.SubnetLaplace(model, "classification", cell.subset, **opts)
                with _engine_routes() as routes:
                    la.fit([(batch.inputs, batch.targets)])
                value = la.H
                if routes:  # what SubnetLaplace takes of a route: mode, entries, samples per call
                    info["chosen"] = max(routes, key=lambda r: r.get("chunk_size", 0))
            after = mj.plan_cache_info()
            info["probed"] = after.probed - before.probed
            return LibraryResult(value, info)

        return run

    return prep


def sliced_budget(cell: Cell, model: nn.Module, slices: int = 20) -> int:
    """A ``memory_budget`` for about ``slices`` row slices a sample: the least budget the fit
    accepts plus a slice's share of the rows, about 6 copies of each (float32)."""
    data = [(cell.batch.inputs, cell.batch.targets)]
    try:
        mj.SubnetLaplace(model, "classification", cell.subset, memory_budget=1).fit(data)
        least = 0
    except mj.MemoryBudgetError as err:
        least = err.minimum
    return least + cell.batch.o_max // slices * 6 * cell.subset.numel * 4


def _route_of(res: Any) -> dict[str, Any]:
    """The entries (where generic) and samples per call of a ``JacobianResult``."""
    return {
        **({"entries": "generic"} if not res.structured else {}),
        **({"chunk_size": res.chunk_size} if res.chunk_size else {}),
    }


@contextmanager
def _engine_routes() -> Iterator[list[dict[str, Any]]]:
    """The routes (mode and :func:`_route_of`) of the engine calls a Laplace fit makes in the
    block."""
    from multiscale_jac.laplace import _jacobian_rows as _curvature

    routes: list[dict[str, Any]] = []
    run = _curvature.run_engine

    def spy(*args: Any, **kwargs: Any) -> Any:
        res = run(*args, **kwargs)
        routes.append({"mode": str(res.mode), **_route_of(res)})
        return res

    _curvature.run_engine = spy
    try:
        yield routes
    finally:
        _curvature.run_engine = run


@contextmanager
def _jacnorm_jobs() -> Iterator[list[Any]]:
    """The library's jobs of the ``jacobian_sq_norm`` calls in the block, for their notes (the
    route choice): the function returns a bare tensor, so the benchmark reads them there."""
    from multiscale_jac import jacnorm

    jobs: list[Any] = []
    init = jacnorm._Job.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        jobs.append(self)

    jacnorm._Job.__init__ = keep  # type: ignore[method-assign]
    try:
        yield jobs
    finally:
        jacnorm._Job.__init__ = init  # type: ignore[method-assign]


# ---------------------------------------------------------------------- the method registry
@dataclass(frozen=True)
class Method:
    """One method of a cell; ``kind``: ``train``, ``peer`` (what a user writes or another
    library), ``library`` (auto) or ``route`` (a forced library route)."""

    name: str
    kind: str
    what: str
    prepare: Prepare
    estimate: Callable[[Cell, Batch], int] | None = None  # bytes; not run above --max-gb
    scaling: float = 1.0  # time grows as N ** scaling (the slice-based estimate)
    route: dict[str, str] | None = None  # a forced route's options (kind "route")

    @property
    def is_library(self) -> bool:
        return self.kind in ("library", "route")


def methods_for(workload: str, per_pixel: int = 0) -> list[Method]:
    """Every method of a workload, in the order they are timed (peers before the library);
    ``per_pixel``: per-pixel classes (the Laplace fit also in row slices)."""
    then = {"subset": ", the subset's columns", "laplace": ", the subset's columns, J^T Lambda J"}
    then_ = then.get(workload, "")
    wrap = with_ggn if workload == "laplace" else (lambda p: p)
    auto = {
        "fisher": "mj.diag_fisher with defaults",
        "jacnorm": "mj.jacobian_sq_norm(model, x).backward() with defaults",
        "laplace": "mj.SubnetLaplace(model, 'classification', subset).fit(data)",
    }.get(workload, "mj.per_sample_jacobian with defaults")
    ms = [
        Method("train_step", "train", "forward, loss, backward, SGD step (train copy)", train_step)
    ]
    if workload == "jacnorm":
        ms += [
            Method("loop_func", "peer", "per sample: grad of ||jacrev||^2", loop_func),
            Method(
                "vmap_double_bwd",
                "peer",
                f"grad of ||vmap(grad)||^2, {VMAP_CHUNK} a chunk",
                vmap_double_bwd,
            ),
            Method(
                "fwd_over_rev",
                "peer",
                f"vmap(grad), 2 sum_i H_i g_i by jvp of grad, {VMAP_CHUNK} a chunk",
                fwd_over_rev,
            ),
        ]
    else:
        fn = "grad" if workload == "fisher" else "jacrev"
        chunk = FISHER_VMAP_CHUNK if workload == "fisher" else VMAP_CHUNK
        ms += [
            Method("loop_func", "peer", f"per-sample torch.func.{fn} loop{then_}", wrap(loop_func)),
            Method(
                "vmap_chunks",
                "peer",
                f"vmap({fn}) in chunks of <= {chunk} per shape bucket{then_}",
                wrap(vmap_chunks),
            ),
        ]
    auto_what = "torch.autograd.functional.jacobian(vectorize=True) per shape bucket" + {
        "fisher": " of the N log-likelihoods, squared",
        "jacnorm": " with create_graph, autograd.grad of the squared sum",
    }.get(workload, then_)
    ms.append(
        Method("autograd_jacobian", "peer", auto_what, wrap(autograd_jacobian), lanes_estimate, 2.0)
    )
    bp = "SumGradSquared" if workload == "fisher" else "BatchGrad, a backward per output row"
    op = "per-sample loss gradients, squared" if workload == "fisher" else "a pass per output row"
    cl = {
        "subset": "JacobianLinearOperator @ one-hot columns",
        "laplace": "GGNLinearOperator, the subset's submatrix @ identity",
    }.get(workload, "TransposedJacobianLinearOperator @ identity, per shape bucket")
    dense = workload in ("jacobian", "ragged")
    ms += [
        Method("backpack", "peer", f"BackPACK {bp}{then_}", wrap(backpack)),
        Method("opacus", "peer", f"Opacus GradSampleModule, {op}{then_}", wrap(opacus)),
        Method(
            "curvlinops",
            "peer",
            f"curvlinops {cl}",
            curvlinops,
            lanes_estimate if dense else None,
            2.0 if dense else 1.0,
        ),
    ]
    if workload == "laplace":
        what = "laplace-torch Laplace(subset_of_weights='subnetwork', hessian_structure='full')"
        ms.append(Method("laplace_torch", "peer", what + ".fit", laplace_torch))
    ms.append(Method("library_auto", "library", auto, library()))
    if workload in JACOBIAN_LIKE:
        routes = [
            {"strategy": s, "mode": m, **({"entries": e} if e else {})}
            for s in ("vmap", "bucketed", "padded")
            for m in ("rev", "fwd")
            for e in (("structured", "generic") if workload == "subset" else (None,))
        ]
    elif workload == "fisher":
        routes = [{"method": m} for m in ("layerwise", "vmap")]
    elif workload == "jacnorm":  # read at run time: members may be added
        routes = [{"method": m.value} for m in mj.JacNormMethod if m.value != "auto"]
    else:
        routes = [{"entries": e} for e in ("structured", "generic")]
    if per_pixel:  # the dense Laplace cell: the fit in row slices (bench_laplace's --dense)
        routes.append({"memory_budget": "sliced"})
    for kw in routes:
        name = "library_" + "_".join(kw.values())
        what = ", ".join(f"{k}={v}" for k, v in kw.items()) + ", strict=True"
        ms.append(Method(name, "route", what, library(**kw), route=kw))
    return ms


# ---------------------------------------------------------------------- the float64 reference
def reference(cell: Cell, batch: Batch) -> Tensor:
    """Plain ``autograd.grad``, one sample at a time (rows by one-hot ``grad_outputs``, batched),
    independent of every method."""
    params = list(cell.model.parameters())
    sink = Sink(cell, batch)
    logits = torch.zeros(batch.n, batch.o_max, dtype=cell.dtype, device=cell.device)
    math = sdpa_kernel([SDPBackend.MATH]) if cell.workload == "jacnorm" else nullcontext()
    with math:
        _reference_rows(cell, batch, params, sink, logits)
    return (
        ggn(sink.result(), logits, cell.spec.dense) if cell.workload == "laplace" else sink.result()
    )


def _reference_rows(
    cell: Cell, batch: Batch, params: list[Tensor], sink: Sink, logits: Tensor
) -> None:
    for i, s in enumerate(batch.samples):
        y = cell.forward(cell.model, [t[None] for t in s])[0]
        logits[i, : y.numel()] = y.detach()
        if cell.workload == "fisher":
            logp = torch.log_softmax(y, 0)[batch.targets[i]]  # type: ignore[index]
            sink.add(None, flat_grads(params, torch.autograd.grad(logp, params))[None])
            continue
        if cell.workload != "jacnorm":  # every row's gradient, one-hot grad_outputs
            for r0 in range(0, y.numel(), 256):
                eye = torch.eye(y.numel(), dtype=y.dtype, device=y.device)[r0 : r0 + 256]
                gs = torch.autograd.grad(
                    y, params, eye, retain_graph=True, allow_unused=True, is_grads_batched=True
                )
                rows = torch.cat(
                    [
                        (y.new_zeros(len(eye), p.numel()) if g is None else g.reshape(len(eye), -1))
                        for p, g in zip(params, gs)
                    ],
                    1,
                )
                sink.value[i, r0 : r0 + len(eye)] = cell.select(rows)
            continue
        for r in range(y.numel()):  # jacnorm: grad of sum_o ||d y_o / d theta||^2
            # (attention's fused kernels have no double backward: the forward above ran the
            # math form, see the caller)
            gs = torch.autograd.grad(
                y[r], params, retain_graph=True, allow_unused=True, create_graph=True
            )
            sq = sum((g**2).sum() for g in gs if g is not None)
            gs = torch.autograd.grad(sq, params, retain_graph=True, allow_unused=True)
            sink.add(None, flat_grads(params, gs)[None])


def value_of(result: Any) -> Tensor:
    return (result.value if isinstance(result, LibraryResult) else result).detach()


def compare(a: Tensor, ref: Tensor) -> dict[str, Any]:
    if tuple(a.shape) != tuple(ref.shape):
        return {"mismatch": f"shape {tuple(a.shape)} vs reference {tuple(ref.shape)}"}
    diff = float((a.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    return {"max_abs_diff": diff, "rel_diff": diff / scale if scale > 0 else diff}


# ---------------------------------------------------------------------- one cell, one process
def log(msg: str) -> None:
    """Progress to stderr (a worker's stdout carries its JSON)."""
    print(msg, file=sys.stderr, flush=True)


def wants(args: argparse.Namespace, name: str) -> bool:
    """Whether ``--methods`` (names or glob patterns) selects ``name`` (the step always)."""
    return name == "train_step" or not args.methods or any(fnmatch(name, p) for p in args.methods)


def _reset_forward_ad() -> None:
    """Leave every forward-AD level a method left entered: a time limit's interrupt inside a
    ``dual_level`` block (curvlinops' Jacobian-vector products) skips its exit, and every later
    forward-mode call in the process failed ("Nested forward mode AD is not supported")."""
    import torch.autograd.forward_ad as fwad

    while fwad._current_level >= 0:
        torch._C._exit_dual_level(level=fwad._current_level)
        fwad._current_level -= 1


def bench_method(
    cell: Cell, m: Method, args: argparse.Namespace, baseline: dict[str, Any]
) -> dict[str, Any]:
    """Warm-up on a slice (its time scaled to the batch decides whether to go on), the first
    call on the batch (library: a fresh model copy, the plan cache cleared), then the Timer."""
    rec: dict[str, Any] = {"method": m.name, "kind": m.kind, "what": m.what}
    batch, device = cell.batch, torch.device(args.device)
    fresh = (lambda: copy.deepcopy(cell.model)) if m.is_library else (lambda: cell.model)
    try:
        if m.estimate is not None:
            rec["estimated_bytes"] = est = m.estimate(cell, batch)
            if est > args.max_gb * 2**30:
                raise Skip(f"not run: estimated {est / 2**30:.1f} GiB > --max-gb {args.max_gb:g}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run, small = m.prepare(cell, fresh()), cell.small()
            scale = (batch.n / small.n) ** m.scaling
            # seconds a call, or that many training steps where the machine is slower
            cap = max(args.method_limit, args.limit_steps * baseline.get("step", 0.0))
            limit = cap / scale
            try:  # a first call on the slice pays one-time costs; the second is the estimate
                with time_limit(None if m.kind == "train" else cap):
                    run(small)
                with time_limit(None if m.kind == "train" else limit):
                    rec["slice_seconds"], _ = timed_call(lambda: run(small), device)
            except TimeLimit:
                _reset_forward_ad()
                raise Skip(
                    f"not run: over {limit:.3g} s on {small.n} samples (> --method-limit on {batch.n})"
                ) from None
            if rec["slice_seconds"] * scale > cap and m.kind != "train":
                raise Skip(
                    f"not run: {rec['slice_seconds']:.2f} s on {small.n} samples suggests "
                    f"{rec['slice_seconds'] * scale:.0f} s on {batch.n} > --method-limit"
                )
            if m.is_library:  # a fresh copy and a cold plan cache: the first call plans
                run = m.prepare(cell, fresh())
                mj.clear_plan_cache()
            t_first, res = timed_call(lambda: run(batch), device)
            rec["first_call_seconds" if m.is_library else "warmup_seconds"] = t_first
            if m.kind == "train":
                baseline["step"] = t_first
            if isinstance(res, LibraryResult):
                rec["library"] = res.info
            if m.kind != "train":
                value = value_of(res)
                if "value" not in baseline:
                    baseline.update(value=value, method=m.name)
                    rec["float32_baseline"] = True
                else:
                    d = compare(value, baseline["value"])
                    rec["float32_vs"] = baseline["method"]
                    rec["float32_rel_diff"] = d.get("rel_diff")
                    if "mismatch" in d:
                        rec["float32_mismatch"] = d["mismatch"]
                del value
            del res
            rec.update(
                timer_median(
                    lambda: run(batch),
                    threads=args.threads,
                    min_run_time=args.min_run_time,
                    warm_s=t_first,
                )
            )
    except Skip as e:
        rec["skipped"] = str(e) if str(e).startswith("not run") else f"not applicable: {e}"
    except Exception as e:
        rec["error"] = error_text(e)
    return rec


def _contenders(methods: Sequence[Method], results: dict[str, dict[str, Any]]) -> list[Method]:
    """The training step, ``library_auto``, and the two fastest peers and forced routes."""
    timed = [m for m in methods if "seconds" in results[m.name]]
    out = [m for m in timed if m.kind in ("train", "library")]
    for kind in ("peer", "route"):
        group = sorted(
            (m for m in timed if m.kind == kind), key=lambda m: results[m.name]["seconds"]
        )
        out += group[:2]
    return out


def interleave(
    cell: Cell,
    methods: Sequence[Method],
    results: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> int:
    """The contenders (:func:`_contenders`) timed again in ``--rounds`` rounds, one call each a
    round in a rotating order: a drift of the machine's speed during the cell (the training
    step's own time moved 10-45% between processes) then falls on every method alike. Their
    ``seconds`` become the median over the rounds (``seconds_alone`` keeps the first
    measurement). Fewer rounds (at least 3) where they would take over ``--rounds-budget``;
    returns the rounds run (0: none)."""
    contenders = _contenders(methods, results)
    if args.rounds <= 0 or len(contenders) < 2:
        return 0
    per_round = sum(results[m.name]["seconds"] for m in contenders)
    rounds = max(3, min(args.rounds, int(args.rounds_budget / max(per_round, 1e-9))))
    timers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in contenders:
            run = m.prepare(cell, copy.deepcopy(cell.model) if m.is_library else cell.model)
            # warm: plans cached, buffers allocated; a library method twice, as auto measures
            # on a job's second call (a first call runs the estimate and defers)
            for _ in range(2 if m.is_library else 1):
                res = run(cell.batch)
            if isinstance(res, LibraryResult):  # the library chose again (cache cleared since)
                results[m.name]["library_rounds"] = res.info
            timers[m.name] = Timer(
                stmt="run(batch)",
                globals={"run": run, "batch": cell.batch},
                num_threads=args.threads,
            )
        times: dict[str, list[float]] = {name: [] for name in timers}
        names = list(timers)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(timers[name]._timeit(1))  # one call (timeit adds two)
    for name, ts in times.items():
        rec = results[name]
        rec["seconds_alone"], rec["seconds"] = rec["seconds"], median(ts)
        rec["timing"] = f"interleaved with {len(names) - 1} others: {rounds} rounds, median"
        rec["times"], rec["timed_calls"] = ts, rounds
    return rounds


def check_methods(
    spot: Spot,
    methods: Sequence[Method],
    args: argparse.Namespace,
    limits: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every method on a float64 slice of the cell against :func:`reference` (each under
    ``limits[name]`` seconds, default ``--check-limit``). Per-pixel cells are not: their
    reference would differentiate every pixel's classes one row at a time; the sliced fit is
    compared with the unsliced one in float32 instead (``float32_rel_diff``)."""
    if SPECS[spot.model].dense:
        why = "not checked in float64 (per-pixel outputs): float32 against the unsliced fit"
        return {"skipped": why}, {m.name: {"ok": True, "skipped": why} for m in methods}
    cell = spot.build(args, torch.float64)
    batch, t0 = cell.small(), time.perf_counter()
    ref = reference(cell, batch)
    meta = {
        "reference": "plain autograd.grad, one sample and one output row at a time, float64",
        "samples": batch.n,
        "reference_seconds": time.perf_counter() - t0,
        "tol": args.check_tol,
    }
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        if m.kind == "train":
            continue
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            with (
                warnings.catch_warnings(),
                time_limit((limits or {}).get(m.name, args.check_limit)),
            ):
                warnings.simplefilter("ignore")
                model = copy.deepcopy(cell.model) if m.is_library else cell.model
                row.update(compare(value_of(m.prepare(cell, model)(batch)), ref))
        except Skip as e:
            row["skipped"] = str(e)
        except TimeLimit as e:
            _reset_forward_ad()
            row["skipped"] = f"not checked: {e} (--check-limit)"
        except Exception as e:
            row["error"] = error_text(e)
        if "rel_diff" in row:
            row["ok"] = row["rel_diff"] <= args.check_tol
        row["seconds_in_check"] = round(time.perf_counter() - t0, 3)
        log(f"  check {cell.name} {m.name}: {row}")
        out[m.name] = row
    return meta, out


def cell_worker(args: argparse.Namespace) -> int:
    """Time every method of one cell in this process; print the cell's record as JSON."""
    spot = Spot.parse(args.worker_cell)
    torch.set_num_threads(args.threads)
    cell = spot.build(args)
    rec: dict[str, Any] = {"name": spot.name, **cell_summary(cell)}
    rec["malloc_env"] = malloc_env()
    methods = [m for m in methods_for(spot.workload, cell.spec.dense) if wants(args, m.name)]
    baseline: dict[str, Any] = {}
    results = {m.name: bench_method(cell, m, args, baseline) for m in methods[:1]}
    for m in methods[1:]:
        results[m.name] = r = bench_method(cell, m, args, baseline)
        log(f"[{cell.name}] {m.name}: " + _short(r))
    train_end = bench_method(cell, methods[0], args, {})  # the step again, after the others
    step = [t["seconds"] for t in (results["train_step"], train_end) if "seconds" in t]
    rec["train_step_seconds"] = sum(step) / len(step) if step else None
    rec["train_step_seconds_start_end"] = step
    rec["rounds"] = interleave(cell, methods, results, args)
    if "seconds" in results["train_step"] and rec["rounds"]:
        rec["train_step_seconds"] = results["train_step"]["seconds"]
    del cell, baseline
    ran = [m for m in methods if "seconds" in results[m.name] and m.kind != "train"]
    limits = {
        m.name: max(args.check_limit, 10 * results[m.name].get("slice_seconds", 0.0)) for m in ran
    }
    try:
        rec["check"], checks = check_methods(spot, ran, args, limits)
    except Exception as e:
        rec["check"], checks = {"error": error_text(e)}, {}
    base_ok = True
    for name, c in checks.items():
        r = results[name]
        r.update(
            checked=c.get("max_abs_diff"),
            checked_rel=c.get("rel_diff"),
            check_ok=c.get("ok", False),
        )
        if "ok" not in c:
            r["check_error"] = c.get("error") or c.get("skipped") or c.get("mismatch")
        if r.get("float32_baseline"):
            base_ok = r["check_ok"]
    for r in results.values():
        if "seconds" not in r:
            continue
        if rec["train_step_seconds"]:
            r["ratio_to_train_step"] = r["seconds"] / rec["train_step_seconds"]
        if r["kind"] != "train":
            f32 = r.get("float32_rel_diff")
            f32_ok = (
                r.get("float32_baseline")
                or not base_ok
                or (f32 is not None and f32 <= args.f32_tol)
            )
            r["valid"] = bool(r.get("check_ok")) and bool(f32_ok)
    rec["methods"] = results
    print(json.dumps(rec, default=str))
    return 0


def _short(r: dict[str, Any]) -> str:
    if "seconds" not in r:
        return str(r.get("skipped") or r.get("error"))[:160]
    extra = f", first call {r['first_call_seconds']:.3g} s" if "first_call_seconds" in r else ""
    f32 = r.get("float32_rel_diff")
    return f"{r['seconds']:.4g} s{extra}" + ("" if f32 is None else f", f32 rel diff {f32:.1e}")


def memory_worker(args: argparse.Namespace) -> int:
    """Peak memory of one method on the batch, in this fresh process (after a slice warm-up).
    ``library_auto`` also reports the route it ran (``chosen``); ``chosen`` with ``--route``
    forces that route with ``tune=False`` (:func:`run_cell`)."""
    name, method = args.worker_mem
    spot = Spot.parse(name)
    torch.set_num_threads(args.threads)
    importlib.import_module("torch._dynamo")  # a one-time import: MEMORY_CAVEAT_CPU
    cell = spot.build(args)
    if method == CHOSEN:  # auto's route forced, nothing timed: the reference of auto's peak
        prepare = library(tune=False, **json.loads(args.route))
    else:
        (m,) = [m for m in methods_for(spot.workload, cell.spec.dense) if m.name == method]
        # a forced route with tune=False: the reference of auto's peak, which includes its timing
        prepare = m.prepare if m.route is None else library(tune=False, **m.route)
    run = prepare(cell, cell.model)
    out: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == CHOSEN or method.startswith("library"):
            # the library's one-time costs paid alike: its full planning (a structured
            # survey's code paths: 13 MiB on subset/tanh_cnn) also where auto's slice call
            # takes the small-job path and a forced route's does not
            library(tune=False)(cell, copy.deepcopy(cell.model))(cell.small())
        run(cell.small())
        rec = measure_peak_memory(lambda: out.append(run(cell.batch)), args.device)
    if method == "library_auto":
        rec["chosen"] = out[0].info.get("chosen", {})
    print(json.dumps(rec))
    return 0


#: a rise below one page is counted as one page (a ratio's denominator)
PAGE = 4096

#: the memory workers' name for library_auto's route forced (``--route``: its options)
CHOSEN = "library_chosen"


# ---------------------------------------------------------------------- the named grids
@dataclass(frozen=True)
class Spot:
    """A cell of a named grid: a workload on a model with the grid's batch size ``n`` and
    entries ``k`` (``None``: the workload's), its ``methods`` (names or glob patterns; empty:
    all) and ``roles`` (the first-call grid: each role in a fresh process, :func:`run_roles`)."""

    workload: str
    model: str
    n: int | None = None
    k: int | None = None
    methods: tuple[str, ...] = ()
    roles: bool = False

    @property
    def name(self) -> str:
        extra = ",".join(f"{a}={v}" for a, v in (("n", self.n), ("k", self.k)) if v)
        return f"{self.workload}/{self.model}" + (f"@{extra}" if extra else "")

    @classmethod
    def parse(cls, name: str) -> Spot:
        """``workload/model[@n=N,k=K]`` (a cell's name) back to its spot."""
        cell, _, extra = name.partition("@")
        w, m = cell.split("/", 1)
        return cls(w, m, **{a: int(v) for a, v in (p.split("=") for p in extra.split(",") if p)})

    def wants(self, name: str) -> bool:
        return (
            name == "train_step" or not self.methods or any(fnmatch(name, p) for p in self.methods)
        )

    def build(self, args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> Cell:
        return build_cell(
            self.workload,
            self.model,
            quick=args.quick,
            device=args.device,
            dtype=dtype,
            seed=args.seed,
            n=self.n,
            k=self.k,
        )


def _main_cells(quick: bool) -> list[Spot]:
    table = QUICK_GRID if quick else GRID
    return [Spot(w, m) for w in WORKLOADS for m in table[w]]


def _choice(quick: bool) -> list[Spot]:
    extra = [Spot("subset", "multibranch", k=36)]  # a few dozen entries, a low-dim readout
    cells = [*_main_cells(quick), *([] if quick else extra)]
    return [dataclasses.replace(s, methods=("library_*",)) for s in cells]


def _batch(quick: bool) -> list[Spot]:
    ms = ("library_auto", "loop_func", "vmap_chunks", "vmap_double_bwd", "backpack")
    ms += ("autograd_jacobian",)
    if quick:
        sweep = [("fisher", "resnet8", (8, 16)), ("jacnorm", "cnn3", (4, 8))]
    else:
        sweep = [("fisher", m, (32, 64, 128)) for m in ("vgg11_bn_q", "resnet8")]
        sweep += [("jacnorm", m, (10, 128)) for m in ("cnn3", "cnn8")]
    return [Spot(w, m, n=n, methods=ms) for w, m, ns in sweep for n in ns]


def _entries(quick: bool) -> list[Spot]:
    ms = ("library_auto", "loop_func", "vmap_chunks", "library_vmap_fwd_generic")
    if quick:
        sweep = [("subset", "gelu_cnn", (20, 200)), ("laplace", "cifarnet32", (20, 50))]
    else:
        sweep = [("subset", "convblock_wide", (50, 500)), ("subset", "resnet8", (100, 1000, 10000))]
        sweep += [("laplace", "cifarnet32", (50, 100, 200))]
    n = {"laplace": 8 if quick else 32}
    return [Spot(w, m, n=n.get(w), k=k, methods=ms) for w, m, ks in sweep for k in ks]


def _dense(quick: bool) -> list[Spot]:
    return [
        Spot("laplace", "seg_head", n=2 if quick else 4, methods=("library_auto", "library_sliced"))
    ]


def _laplace_torch(quick: bool) -> list[Spot]:
    ms = ("library_auto", "laplace_torch")
    widths = (32,) if quick else (32, 48)
    return [
        Spot("laplace", f"cifarnet{w}", n=8 if quick else 32, k=100, methods=ms) for w in widths
    ]


def _first_call(quick: bool) -> list[Spot]:
    cells = [
        ("subset", "convblock_wide", (8, 2), 500),  # seed thread 3: ConvBlock, 500 entries
        ("fisher", "vgg11_bn_q", (32, 16), None),  # seed thread 1: the VGG Fisher
        ("jacnorm", "cnn3", (128, 32), None),  # seed thread 2: the CNN's Jacobian norm
        ("ragged", "sharedfpn", (16, 6), 100),  # ragged dense outputs (segmentation-like)
        ("laplace", "cifarnet32", (32, 16), 100),  # a SubnetLaplace fit
    ]
    return [Spot(w, m, n=ns[quick], k=k, roles=True) for w, m, ns, k in cells]


#: the named grids: name -> (what they measure, their cells (quick or full)); ``--grid all``
#: runs every one
FAMILIES: dict[str, tuple[str, Callable[[bool], list[Spot]]]] = {
    "main": ("every method of each workload x model: peers, auto, every forced route", _main_cells),
    "choice": ("the main cells' library methods only: auto against every forced route", _choice),
    "batch": ("time and peak memory against the batch size (Fisher, Jacobian norm)", _batch),
    "entries": ("subset Jacobians: time and memory against the number of entries", _entries),
    "dense": ("a Laplace fit of dense (per-pixel) outputs, sliced against unsliced", _dense),
    "laplace_torch": ("SubnetLaplace against laplace-torch's subnetwork Laplace", _laplace_torch),
    "first_call": (
        "first calls in fresh processes: auto, the user's code, tune=False, loaded",
        _first_call,
    ),
}
#: first_call: the code a user would write instead, per workload
USER_CODE = {"fisher": "vmap_chunks", "jacnorm": "vmap_double_bwd"}
FIRST_TARGETS = {"first": 1.25, "second": 1.2, "loaded": 1.2, "rss": 1.2, "budget": 1.0}
#: first_call: the ``memory_budget`` of the roles ``budget`` (the batch) and ``overhead`` (its
#: first sample alone: the process's fixed overhead, what any first call adds to its job)
FIRST_BUDGET = 20_000_000  # issue 27's Laplace fit rose 137 MiB under this budget
#: where the result alone is larger (the subset Jacobian of 500 entries: 47 MiB)
FIRST_BUDGETS = {"subset": 64 * 2**20}


def first_budget(workload: str) -> int:
    """The ``memory_budget`` of a first-call cell's budget roles."""
    return FIRST_BUDGETS.get(workload, FIRST_BUDGET)


# ---------------------------------------------------------------------- the main process
def grid(args: argparse.Namespace) -> list[tuple[str, Spot]]:
    """``(family, spot)`` of the named grids in ``--grid``, filtered by ``--workloads``,
    ``--models`` and ``--cells`` (cell names, ``workload/model[@n=..,k=..]``)."""
    names = list(FAMILIES) if "all" in args.grid else args.grid
    # the main cells time auto and every forced route: the choice grid's cells among them are
    # not run twice (its table renders from the main cells, render.choice_table)
    timed = {s.name for s in FAMILIES["main"][1](args.quick)} if "main" in names else set()
    out = []
    for fam in names:
        for s in FAMILIES[fam][1](args.quick):
            if fam == "choice" and s.name in timed:
                continue
            if args.workloads and s.workload not in args.workloads:
                continue
            if (args.models and s.model not in args.models) or (
                args.cells
                and s.name not in args.cells
                and f"{s.workload}/{s.model}" not in args.cells
            ):
                continue
            out.append((fam, s))
    return out


def malloc_fixed(args: argparse.Namespace) -> dict[str, str] | None:
    return MALLOC_FIXED if args.malloc == "fixed" else None


def slow_note(c: dict[str, Any]) -> str:
    """A note for a cell where ``library_auto`` is slower than the best other method."""
    lob = c.get("library_over_best_other")
    if lob is None and c.get("best_route") and not c.get("best_other"):
        errors = [r.get("error") for r in c.get("methods", {}).values() if r.get("kind") == "peer"]
        first = next((e for e in errors if e), "")
        return "only the library ran here" + (f"; the others fail: {first}" if first else "")
    if lob is None or lob <= 1.0:
        return ""
    route, other = c.get("best_route_seconds"), c.get("best_other_seconds")
    if route is not None and other is not None and route > other:
        return (
            f"no library route is as fast as {c['best_other']} here (the fastest, "
            f"{c['best_route']}, takes {route / other:.2f}x its time): a faster route is missing"
        )
    if (c.get("auto_over_best_route") or 1.0) > 1.0:
        return (
            f"auto did not run the fastest route ({c['best_route']}): the route choice "
            "(cost model or probe) picked a slower one"
        )
    return "auto's overhead (planning, checks) outweighs the route's margin at this size"


def summarise(cell: dict[str, Any]) -> None:
    """``best_other``, ``library_over_best_other``, ``best_route``, ``auto_over_best_route``,
    ``note``."""
    ms = cell.get("methods", {})
    timed = {n: r["seconds"] for n, r in ms.items() if "seconds" in r and r.get("valid")}
    auto = timed.get("library_auto")
    for key, kind in (("best_other", "peer"), ("best_route", "route")):
        group = {n: s for n, s in timed.items() if ms[n]["kind"] == kind}
        best = min(group, key=group.__getitem__) if group else None
        cell[key], cell[f"{key}_seconds"] = best, group.get(best)  # type: ignore[arg-type]
    cell["library_over_best_other"] = (
        auto / cell["best_other_seconds"] if auto and cell["best_other"] else None
    )
    cell["auto_over_best_route"] = (
        auto / cell["best_route_seconds"] if auto and cell["best_route"] else None
    )
    if "library_auto" in ms and not auto:
        r = ms["library_auto"]
        cell["auto_problem"] = (
            r.get("error") or r.get("skipped") or r.get("check_error") or "failed the check"
        )
    cell["note"] = slow_note(cell)


#: ``--quick`` without ``--memory``: peak memory where it is the grid's subject, none elsewhere
#: (every memory figure is a fresh process: four a cell took half the quick grid's time)
QUICK_MEMORY = {"batch": "main", "entries": "main"}


def memory_of(args: argparse.Namespace, family: str) -> str:
    """The ``--memory`` setting for a cell of ``family``."""
    if args.memory:
        return args.memory
    return QUICK_MEMORY.get(family, "none") if args.quick else "all"


def run_cell(
    spot: Spot, args: argparse.Namespace, deadline: float | None, memory: str = "all"
) -> dict[str, Any]:
    """Every method of a cell timed in one fresh worker, then peak memory per method (a fresh
    worker each: ``memory``, :func:`memory_of`)."""
    name, w, m = spot.name, spot.workload, spot.model
    log(f"== {name}: timing all methods in one worker ...")
    t0 = time.perf_counter()
    methods = ["--methods", *spot.methods] if spot.methods else []
    rec = run_worker(
        [str(SCRIPT), *args.argv, "--worker-cell", name, *methods],
        timeout_s=args.timeout,
        env=malloc_fixed(args),
    )
    rec = {"name": name, "workload": w, "model": m, **rec}
    if "error" in rec or "methods" not in rec:
        log(f"   {name}: {rec.get('error')}")
        return rec
    summarise(rec)
    ms = rec["methods"]
    keep = {"train_step", "library_auto", rec.get("best_other"), rec.get("best_route")}
    for method in [n for n, r in ms.items() if "seconds" in r and (memory == "all" or n in keep)]:
        if memory == "none" or (deadline is not None and time.time() > deadline):
            break
        mem = run_worker(
            [str(SCRIPT), *args.argv, "--worker-mem", name, method], timeout_s=args.timeout
        )
        ms[method].update(memory=mem, peak_memory_bytes=mem.get("peak_memory_bytes"))
    base = ms.get("train_step", {}).get("peak_memory_bytes")
    for r in ms.values():
        if r.get("peak_memory_bytes") is not None and base:
            r["memory_ratio_to_train_step"] = r["peak_memory_bytes"] / base
    auto = ms.get("library_auto", {})
    if auto.get("peak_memory_bytes") and memory != "none":
        _auto_against_chosen(name, auto, rec, args)
    rec["cell_seconds"] = round(time.perf_counter() - t0, 1)
    lob, aor = rec.get("library_over_best_other"), rec.get("auto_over_best_route")
    log(
        f"   {name}: auto / best other ({rec.get('best_other')}) = {lob}, auto / best "
        f"route ({rec.get('best_route')}) = {aor} ({rec['cell_seconds']} s)"
    )
    return rec


#: auto's peak memory against its route forced: pairs of fresh processes (auto, then the route
#: it ran forced with tune=False), medians: one process's RSS rise of a small call varied by
#: 5-10 MiB (subset/vgg11_bn_q's route: 11.6-17.0 MiB)
MEMORY_PAIRS = 3


def _auto_against_chosen(
    name: str, auto: dict[str, Any], rec: dict[str, Any], args: argparse.Namespace
) -> None:
    """auto, its timing included, against the route it ran (``chosen``: strategy, mode,
    entries, samples per call; or method and chunk) forced with ``tune=False``, each a fresh
    process, :data:`MEMORY_PAIRS` pairs (auto's first from the method's own measurement)."""
    autos, forced = [auto["memory"]], []
    for i in range(MEMORY_PAIRS):
        if i:
            autos.append(
                run_worker(
                    [str(SCRIPT), *args.argv, "--worker-mem", name, "library_auto"],
                    timeout_s=args.timeout,
                )
            )
        chosen = autos[-1].get("chosen")
        if chosen is None:
            return
        route = ["--worker-mem", name, CHOSEN, "--route", json.dumps(chosen)]
        forced.append(run_worker([str(SCRIPT), *args.argv, *route], timeout_s=args.timeout))
    peaks = [[r.get("peak_memory_bytes") for r in rs] for rs in (autos, forced)]
    if any(None in peak for peak in peaks):
        auto.update(chosen_route_memory=forced[-1])
        return
    # each pair's ratio: auto's choice can differ from process to process (a route within
    # TIE of another), and each pair forces its own auto's choice
    ratios = [a / max(f, PAGE) for a, f in zip(*peaks)]
    at = ratios.index(median(ratios)) if len(ratios) % 2 else None
    auto_peak, forced_peak = (median(peak) if at is None else peak[at] for peak in peaks)
    auto.update(
        chosen_route=autos[at or 0]["chosen"],
        chosen_route_memory={**forced[at or 0], "peak_memory_bytes": forced_peak},
        memory_pairs={"auto": autos, "chosen": forced, "ratios": ratios},
        peak_memory_median_bytes=auto_peak,
    )
    rec["auto_memory_over_chosen_route"] = median(ratios)


def _counters() -> dict[str, int]:
    info = mj.plan_cache_info()
    return {k: int(getattr(info, k, 0)) for k in ("measured", "surveyed", "probed")}


def role_worker(args: argparse.Namespace) -> int:
    """One role of a first-call cell in this fresh process: setup (model, data, one no-grad
    forward), then the first call (timed, its peak memory), a second call, warm calls;
    ``library`` then saves its decisions to ``path``, ``loaded`` loads them first; ``budget``
    and ``overhead`` run under :func:`first_budget`, ``overhead`` on one sample."""
    name, role, path = args.worker_role
    spot = Spot.parse(name)
    torch.set_num_threads(args.threads)
    cell = spot.build(args)
    with torch.no_grad():  # the model has run before: its one-time set-up charged to no one
        for b in cell.batch.buckets:
            cell.forward(cell.model, b.levels)
    user = USER_CODE.get(spot.workload, "loop_func")
    prep = {
        "library": library(),
        "loaded": library(),
        "estimate": library(tune=False),
        "user": next(m for m in methods_for(spot.workload) if m.name == user).prepare,
        "budget": library(memory_budget=first_budget(spot.workload)),
        "overhead": library(memory_budget=first_budget(spot.workload)),
    }[role]
    batch = cell.slice(1) if role == "overhead" else cell.batch
    rec: dict[str, Any] = {"role": role, "code": user if role == "user" else "library"}
    tuning = getattr(mj, "tuning", None)
    if role == "loaded":
        if tuning is None or not Path(path).exists():
            print(json.dumps({**rec, "skipped": "no decisions saved (tuning.save/load)"}))
            return 0
        rec["load_seconds"], rec["loaded"] = timed_call(lambda: tuning.load(path), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run, box = prep(cell, cell.model), []
        before = _counters()
        call = lambda: box.append(timed_call(lambda: run(batch), args.device, args.threads))  # noqa: E731
        rec.update(measure_peak_memory(call, args.device))
        rec["first_seconds"], rec["counters"] = (
            box[0][0],
            {k: v - before[k] for k, v in _counters().items()},
        )
        second, _ = timed_call(lambda: run(batch), args.device, args.threads)
        rec["second_seconds"] = second
        warm = timer_median(
            lambda: run(batch),
            threads=args.threads,
            min_run_time=args.min_run_time,
            warm_s=second,
        )
        rec["warm_seconds"], rec["warm_timing"] = warm["seconds"], warm["timing"]
    if role == "library" and tuning is not None:
        rec["saved"] = tuning.save(path)
    print(json.dumps(rec, default=str))
    return 0


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


ROLES = ("library", "user", "estimate", "loaded", "budget", "overhead")
#: a first-call role's figures that are medians over the rounds
ROLE_MEDIANS = ("first_seconds", "second_seconds", "warm_seconds", "peak_memory_bytes")


def _median_role(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One role over its rounds: the round of the median first call, with the median of each
    figure (:data:`ROLE_MEDIANS`) and every round's figures under ``rounds``."""
    ok = [r for r in runs if r.get("first_seconds") is not None]
    if not ok:
        return runs[-1]
    ok.sort(key=lambda r: r["first_seconds"])
    out = dict(ok[len(ok) // 2])
    for k in ROLE_MEDIANS:
        values = [r[k] for r in ok if r.get(k) is not None]
        if values:
            out[k] = median(values)
    out["rounds"] = [{k: r.get(k) for k in (*ROLE_MEDIANS, "error")} for r in runs]
    return out


def run_roles(spot: Spot, args: argparse.Namespace) -> dict[str, Any]:
    """A first-call cell: the roles ``library`` (auto's first and warm calls, then its decisions
    saved), ``user`` (the code a user would write), ``estimate`` (``tune=False``), ``loaded``
    (``multiscale_jac.tuning.load`` of the library's decisions, then the first call), ``budget``
    (under :func:`first_budget`) and ``overhead`` (the same on one sample), each in a fresh
    process, ``--repeats`` interleaved rounds (each role's figures their medians: one
    first call is one sample of a noisy quantity); the ratios against their targets (issue
    27)."""
    log(f"== {spot.name}: first calls, a fresh process per role, {args.repeats} rounds ...")
    rec: dict[str, Any] = {"name": spot.name, "workload": spot.workload, "model": spot.model}
    runs: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for _ in range(args.repeats):  # interleaved: a round runs every role once
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "decisions.json")
            for role in ROLES:
                cmd = [str(SCRIPT), *args.argv, "--worker-role", spot.name, role, path]
                r = run_worker(cmd, timeout_s=args.timeout, env=malloc_fixed(args))
                runs[role].append(r)
                log(f"   {role}: " + str({k: r.get(k) for k in (*ROLE_MEDIANS[:2], "error")}))
    for role in ROLES:
        rec[role] = _median_role(runs[role])
    lib, user, est, loaded, budget, overhead = (rec[r] for r in ROLES)
    cap = first_budget(spot.workload)
    budgeted = [r.get("peak_memory_bytes") for r in (budget, overhead)]
    one_time = None
    if user.get("first_seconds") is not None and user.get("warm_seconds") is not None:
        one_time = max(user["first_seconds"] - user["warm_seconds"], 0.0)
    allowance = None
    if loaded.get("warm_seconds") is not None and one_time is not None:
        allowance = FIRST_TARGETS["loaded"] * loaded["warm_seconds"] + one_time
    rec["ratios"] = ratios = {
        "first": _div(lib.get("first_seconds"), user.get("first_seconds")),
        "second": _div(lib.get("second_seconds"), lib.get("warm_seconds")),
        "warm": _div(lib.get("warm_seconds"), user.get("warm_seconds")),
        "loaded": _div(loaded.get("first_seconds"), allowance),
        "rss": _div(lib.get("peak_memory_bytes"), est.get("peak_memory_bytes")),
        # the budgeted call's rise less the fixed overhead, over the budget
        "budget": None if None in budgeted else _div(budgeted[0] - budgeted[1], cap),
    }
    rec["budget_bytes"] = cap
    rec["user_one_time_seconds"] = one_time
    targets = {**FIRST_TARGETS, "loaded": 1.0}
    rec["over_target"] = [k for k, t in targets.items() if (ratios[k] or 0) > t]
    return rec


NOTES = {
    "seconds": "median per call from torch.utils.benchmark.Timer (blocked_autorange, or single "
    "timed calls for calls >= min_run_time), after a warm-up on a slice and one call on the "
    "batch; every method of a cell in one fresh process",
    "ratio_to_train_step": "seconds / the training step of the same process (mean of the "
    "medians before and after the other methods)",
    "first_call_seconds": "library methods: the first call on the batch, a fresh copy of the "
    "model, plan cache cleared (torch already warmed up by the slice call)",
    "checked": "max abs difference from the float64 reference (plain autograd loops) on a slice "
    "(2 samples; ragged: 3 in 3 shape buckets); valid needs checked_rel <= check_tol and "
    "float32_rel_diff (vs the first peer on the batch) <= f32_tol",
    "library_over_best_other": "library_auto seconds / the fastest valid non-library method's",
    "auto_over_best_route": "library_auto seconds / the fastest valid forced library route's",
    "auto_memory_over_chosen_route": "library_auto's peak memory (its timing included: a "
    "fresh process, a slice call, then the batch) / the route it ran (its chosen_route: "
    "strategy, mode, entries, samples per call; or method and chunk) forced with tune=False; "
    "the median of pairs of fresh processes, each pair's ratio (auto's choice may differ "
    "between processes: each pair forces its own auto's)",
    "note": "why auto is slower than the best other method, where it is",
    "backpack_DiagGGNExact": "not used: the GGN diagonal is neither the empirical Fisher nor "
    "the off-diagonal subset block a subnetwork Laplace needs",
}


def results_path(args: argparse.Namespace) -> Path:
    stem = args.name or ("grid" + ("_quick" if args.quick else ""))
    return (Path(args.out) if args.out else DEFAULT_OUT) / f"{stem}.json"


def load_results(path: Path) -> dict[str, Any]:
    """The results file (``{"runs": [...], "cells": [...]}``), or an empty one."""
    if path.exists():
        return json.loads(path.read_text())
    return {"benchmark": "bench_peers", "notes": NOTES, "runs": [], "cells": []}


def merge(results: dict[str, Any], rec: dict[str, Any]) -> None:
    """``rec`` replaces the cell of the same family and name (the others stay: one file holds
    every family, each cell naming the run that measured it); a method of the old cell that
    this run did not measure (a peer not installed here) keeps its old record and run."""
    key = (rec["family"], rec["name"])
    old = [c for c in results["cells"] if (c.get("family"), c.get("name")) == key]
    for name, r in (old[0].get("methods", {}) if old else {}).items():
        new = rec.get("methods", {}).get(name, {})
        measured = ("seconds", "peak_memory_bytes")
        if any(k in r for k in measured) and not any(k in new for k in measured):
            rec.setdefault("methods", {})[name] = {"run": old[0].get("run"), **r}
    results["cells"] = [c for c in results["cells"] if c not in old] + [rec]


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("--device cuda: CUDA is not available")
        return 2
    torch.set_num_threads(args.threads)
    cells = grid(args)
    path = results_path(args)
    results = load_results(path)
    results["notes"] = {
        **NOTES,
        "peak_memory_bytes": MEMORY_CAVEAT_CUDA if device.type == "cuda" else MEMORY_CAVEAT_CPU,
    }
    run_id = max((r["id"] for r in results["runs"]), default=0) + 1
    config = {k: getattr(args, k) for k in CONFIG_KEYS}
    config["malloc_env"] = malloc_fixed(args)
    config["peers_installed"] = {
        p: importlib.util.find_spec(p) is not None
        for p in ("backpack", "opacus", "curvlinops", "laplace")
    }
    run = {"id": run_id, "env": {**env_stamp(device), "threads": args.threads}, "config": config}
    run["cells"] = [f"{fam}:{s.name}" for fam, s in cells]
    results["runs"].append(run)
    start = time.time()
    deadline = start + args.budget if args.budget else None
    for fam, spot in cells:
        if deadline is not None and time.time() > deadline:
            log(f"{fam}:{spot.name}: not run (--budget spent)")
            continue
        rec = (
            run_roles(spot, args)
            if spot.roles
            else run_cell(spot, args, deadline, memory_of(args, fam))
        )
        merge(results, {"family": fam, "run": run_id, **rec})
        write_json(path, results)
    run["env"]["load_average_at_end"] = load_average()
    run["total_seconds"] = round(time.time() - start, 1)
    write_json(path, results)
    import render

    render.write_outputs(results, path.parent, path.stem)
    return 0


CONFIG_KEYS = (
    *("grid", "quick", "device", "threads", "min_run_time", "method_limit", "limit_steps"),
    "max_gb",
    *("memory", "check_tol", "f32_tol", "seed", "malloc", "rounds", "repeats"),
)


# ---------------------------------------------------------------------- check and dry modes
def check_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows, table, failed = [], [], False
    for _fam, spot in grid(args):
        if spot.roles:
            continue
        methods = [
            x for x in methods_for(spot.workload, SPECS[spot.model].dense) if wants(args, x.name)
        ]
        try:
            meta, checks = check_methods(spot, methods, args)
        except Skip as e:
            log(f"{spot.name}: not applicable: {e}")
            continue
        for name, r in checks.items():
            bad = "ok" in r and not r["ok"]
            failed |= bad
            rows.append({"cell": spot.name, "method": name, **r})
            what = str(r.get("skipped") or r.get("error") or r.get("mismatch"))[:90]
            diffs = [_sci(r.get("max_abs_diff")), _sci(r.get("rel_diff"))]
            table.append(
                [spot.name, name, *diffs, ("FAIL" if bad else "ok") if "ok" in r else what]
            )
        n_ok = sum(1 for r in checks.values() if r.get("ok"))
        log(
            f"{spot.name}: {n_ok}/{len(checks)} ok (reference {meta.get('reference_seconds', 0):.1f} s)"
        )
    path = results_path(args)
    data = {"env": env_stamp(args.device), "tol": args.check_tol, "rows": rows}
    path = write_json(path.with_name(path.stem + "_check.json"), data)
    print(markdown_table(["cell", "method", "max abs diff", "rel diff", "result"], table))
    log(f"wrote {path}" + ("; FAILED" if failed else ""))
    return 1 if failed else 0


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def dry_main(args: argparse.Namespace) -> int:
    """The named grids' cells and methods; nothing measured."""
    rows = []
    for fam, s in grid(args):
        ms = methods_for(s.workload, SPECS[s.model].dense)
        if s.roles:
            rows.append([fam, s.name, "library, user, estimate, loaded: fresh processes", "roles"])
            continue
        rows += [
            [fam, s.name, x.name, x.kind] for x in ms if s.wants(x.name) and wants(args, x.name)
        ]
    print(markdown_table(["grid", "cell", "method", "kind"], rows))
    print(f"\n{len(grid(args))} cells, {len(rows)} (cell, method) pairs; device {args.device}")
    return 0


# ---------------------------------------------------------------------- command line
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="See the module docstring."
    )
    add = p.add_argument
    add(
        "--grid",
        nargs="+",
        default=["main"],
        choices=["all", *FAMILIES],
        help="named grids to run (default main; all: every one): "
        + "; ".join(f"{k}: {v[0]}" for k, v in FAMILIES.items()),
    )
    add("--quick", action="store_true", help="small cells, short timing (every grid's quick form)")
    add("--check", action="store_true", help="float64 agreement of every method; exit 1 on failure")
    add("--dry", action="store_true", help="list the cells and methods; run nothing")
    add("--render", metavar="JSON", help="rebuild the tables and plots from a results file")
    add("--workloads", nargs="*", choices=WORKLOADS, help="only these workloads")
    add("--models", nargs="*", choices=sorted(SPECS), help="only these models")
    add("--cells", nargs="*", metavar="W/M", help="only these cells (workload/model[@n=..,k=..])")
    add(
        "--methods",
        nargs="*",
        help="only these methods, names or glob patterns (train_step always)",
    )
    add("--device", default="cpu", help="cpu or cuda (default cpu)")
    add("--threads", type=int, default=2, help="torch threads and Timer num_threads (2)")
    add("--min-run-time", type=float, default=0.0, help="Timer min_run_time (0.5; quick 0.1)")
    add("--method-limit", type=float, help="skip a method estimated slower (s/call; 40, quick 10)")
    add(
        "--limit-steps",
        type=float,
        default=200.0,
        help="or, where larger, skip a method estimated slower than this many training steps "
        "(200: a loaded machine slows every method alike)",
    )
    add("--max-gb", type=float, default=4.0, help="skip a method whose memory estimate is larger")
    add(
        "--memory",
        choices=("all", "main", "none"),
        help="peak memory per method in a fresh process: all (default), main (train step, "
        "auto, best other, best route; quick's default for the batch and entries grids) or "
        "none (quick's default elsewhere)",
    )
    add("--check-tol", type=float, default=1e-9, help="float64 relative tolerance (1e-9)")
    add("--f32-tol", type=float, default=1e-3, help="float32 relative tolerance vs the first peer")
    add("--check-limit", type=float, help="seconds per method on the float64 slice (30; quick 5)")
    add("--budget", type=float, default=0.0, help="seconds; start no new cell after (0: none)")
    add("--timeout", type=float, default=1200.0, help="seconds per worker process")
    add("--rounds", type=int, help="interleaved rounds of the contenders (5, quick 3; 0: none)")
    add(
        "--repeats",
        type=int,
        help="first_call: interleaved rounds of the fresh-process roles, medians (3, quick 1)",
    )
    add("--rounds-budget", type=float, default=60.0, help="seconds for the rounds at most (60)")
    add(
        "--malloc",
        choices=("fixed", "default"),
        default="fixed",
        help="the timing workers' glibc malloc thresholds: fixed (default; MALLOC_FIXED) or "
        "glibc's dynamic default",
    )
    add("--seed", type=int, default=0)
    add("--out", help="output folder (default: benchmarks/results)")
    add("--name", help="results file stem (default: grid, or grid_quick; --check adds _check)")
    add("--worker-cell", help=argparse.SUPPRESS)
    add("--worker-mem", nargs=2, help=argparse.SUPPRESS)
    add("--route", help=argparse.SUPPRESS)
    add("--worker-role", nargs=3, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv  # what the workers get (their --worker-* flag takes precedence)
    args.min_run_time = args.min_run_time or (0.1 if args.quick else 0.5)
    args.method_limit = args.method_limit or (10.0 if args.quick else 40.0)
    args.check_limit = args.check_limit or (5.0 if args.quick else 30.0)
    args.rounds = (3 if args.quick else 5) if args.rounds is None else args.rounds
    args.repeats = (1 if args.quick else 3) if args.repeats is None else args.repeats
    return args


def guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A worker's exception becomes a one-line ``{"error": ...}`` (traceback on stderr)."""
    try:
        return fn(args)
    except Exception as e:
        traceback.print_exc()
        print(json.dumps({"error": error_text(e)}))
        return 0


if __name__ == "__main__":
    args = parse()
    for flag, worker in (("worker_cell", cell_worker), ("worker_mem", memory_worker)):
        if getattr(args, flag):
            sys.exit(guarded(worker, args))
    if args.worker_role:
        sys.exit(guarded(role_worker, args))
    if args.render:
        import render

        path = Path(args.render)
        sys.exit(
            render.write_outputs(
                json.loads(path.read_text()), Path(args.out or path.parent), path.stem
            )
        )
    sys.exit(dry_main(args) if args.dry else check_main(args) if args.check else main(args))

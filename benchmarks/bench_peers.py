"""The benchmark grid: the library against the code a user would write, a cell a process.

A cell (``workload/model[@n=..,k=..]``) times every method (:func:`methods_for`) in ONE fresh
worker with ``torch.utils.benchmark.Timer``, checks it against a float64 reference and measures
its peak memory in a fresh process; the named grids (``--grid``) are :data:`FAMILIES`, and
docs/benchmarks.md says how numbers are taken. Writes ``grid.json`` (``--quick``:
``grid_quick.json``) in ``--out``, a run replacing the cells it measured, then ``render.py``'s
``grid.md`` and plots. ``--dry`` lists the cells and methods, ``--check`` runs the float64
check alone, ``--grid all --quick`` every named grid's small cells.
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

import _common as common
import _models as zoo
import torch
import torch.nn.functional as F
from _common import TimeLimit, error_text, run_worker, time_limit, timed_call
from _models import GeluCNN, GroupNormDepthwise, StridedTanhCNN, TinyTransformer
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
CLASSES = zoo.NUM_CLASSES

WORKLOADS = ("jacobian", "ragged", "subset", "fisher", "jacnorm", "laplace")
JACOBIAN_LIKE = ("jacobian", "ragged", "subset")
_NEW, _NEWER = ("tanh_cnn", "gelu_cnn", "gn_dw"), ("det_head", "transformer")
#: which models run in which workload (``--quick``: ``QUICK_GRID``)
GRID: dict[str, tuple[str, ...]] = {
    "jacobian": ("resnet8", "convblock", "tinyfpn", *_NEW, *_NEWER),
    "ragged": ("convblock", "tinyfpn", "sharedfpn", "det_head", "bifpn"),
    "subset": ("convblock_wide", "resnet8", "vgg11_bn_q", *_NEW, *_NEWER, "bifpn"),
    "fisher": ("vgg11_bn_q", "resnet8", *_NEW, "transformer"),
    "jacnorm": ("cnn3", "cnn8", *_NEW, "transformer"),
    "laplace": ("resnet8", "vgg11_bn_q", *_NEW, "transformer"),
}
QUICK_GRID = {w: ({"ragged": "det_head", "fisher": "resnet8"}.get(w, "gelu_cnn"),) for w in GRID}
#: batch size per workload (full, quick)
SIZES = {"fisher": (128, 32), "jacnorm": (128, 16), "laplace": (32, 16)}
SIZES.update(dict.fromkeys(JACOBIAN_LIKE, (16, 8)))
SUBSET_K = {"subset": 200, "laplace": 100}
CHECK_SAMPLES = 3  # the float64 slice (ragged: 3 samples, else 2) and the warm-up slice
VMAP_CHUNK = 16  # samples per vmap call of the Jacobian / Jacobian-norm peers
#: the timing workers' glibc malloc settings (``--malloc fixed``): freed memory stays in the
#: heap and blocks up to 32 MiB come from it. With glibc's dynamic default a route's time
#: depended on what ran before it in the process (47 or 74-156 ms for the same call); fixed,
#: every method runs 30-40% faster here and repeats within a few percent.
MALLOC_FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
FISHER_VMAP_CHUNK = 32  # bench_fisher's
CHUNK_BYTES = 256 * 2**20  # vmap(jacrev): fewer samples per call when their Jacobian is larger
#: auto's peak memory against its route forced: pairs of fresh processes (auto, then the route
#: it ran forced with tune=False), medians: one process's RSS rise of a small call varied by
#: 5-10 MiB (subset/vgg11_bn_q's route: 11.6-17.0 MiB); a rise below one page counts as one
MEMORY_PAIRS, PAGE = 3, 4096
CHOSEN = "library_chosen"  # the memory workers' name for auto's route forced (--route: its options)
REUSED = "a module is applied more than once per forward (shared over levels); its hooks keep one"
NO_SECOND = "no per-sample second derivatives (the regulariser's gradient needs them)"


class Skip(Exception):
    """A method that does not apply to this cell, or a peer that is not installed."""


# ---------------------------------------------------------------------- models and cells
@dataclass(frozen=True)
class ModelSpec:
    """``kind``: ``image`` (``(3, *image_hw)`` a sample), ``tokens`` (``(16, 16)``) or ``levels``
    (a list of ``(C_l, H_l, W_l)`` maps, ``levels(h, w)`` their shapes); ``classifier``: the
    output is ``(B, classes)`` logits; ``dense``: per-pixel classes (targets ``(N, H, W)``);
    ``ragged_entries``: the flat indices the ragged workload differentiates (else all)."""

    name: str
    build: Callable[[int], nn.Module]  # num_outputs -> model (built under a fixed seed)
    kind: str
    description: str
    classifier: bool = True
    levels: Callable[[int, int], list[tuple[int, ...]]] | None = None
    uniform_hw: tuple[int, int] = (0, 0)
    ragged_hw: tuple[tuple[int, int], ...] = ()
    ragged_entries: Callable[[nn.Module], Tensor] | None = None
    image_hw: tuple[int, int] = (32, 32)
    dense: int = 0


def _fixed(factory: Callable[[], nn.Module], outputs: tuple[int, ...], why: str) -> Any:
    def build(num_outputs: int) -> nn.Module:
        if num_outputs not in outputs:
            raise Skip(why)
        return factory()

    return build


def _zoo(name: str, desc: str, *, jacnorm: bool = False) -> ModelSpec:
    if jacnorm:  # a plain CNN, one scalar output
        build = lambda: zoo.PlainCNN(zoo.WIDTHS[name], pool_every=1 if name == "cnn3" else 2)  # noqa: E731
    else:  # a BatchNorm classifier, its statistics set, eval mode
        build = lambda: zoo.build_bn_model(name, 0)  # noqa: E731
    out, why = (
        ((1,), "has one scalar output") if jacnorm else ((CLASSES,), "is a 10-class classifier")
    )
    return ModelSpec(name, _fixed(build, out, f"{name} {why}"), "image", desc, not jacnorm)


def _pyramid(h: int, w: int, ch: int = 8, n: int = 3) -> list[tuple[int, ...]]:
    return [(ch, math.ceil(h / 2**k), math.ceil(w / 2**k)) for k in range(n)]


def _levels(name: str, factory: Callable[[], nn.Module], desc: str, *shape: Any, **kw: Any) -> Any:
    build = _fixed(factory, (0, CLASSES), f"{name} has a fixed dense output")
    return ModelSpec(name, build, "levels", desc, False, *shape, **kw)


_RAGGED4 = ((12, 12), (12, 16), (16, 12), (8, 16))
#: the BiFPN's pyramids: 8/12/16 channels at strides 1, 2, 4; 16 shapes, every sample of a
#: ragged batch of 16 its own (the coarsest level at least 2x2, for the step's BatchNorm)
BIFPN_CHANNELS = (8, 12, 16)
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
                lambda c, w=w: zoo.CifarNet(w, c),
                "image",
                f"compare_laplace_torch's CIFAR net, width {w} (convs {w}/{2 * w}/{2 * w})",
            )
            for w in (32, 48)
        ),
        ModelSpec(
            "seg_head",
            _fixed(lambda: zoo.SegHead(3), (CLASSES,), "seg_head has 3 classes a pixel"),
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
            lambda h, w: [(8, h, w), (16, math.ceil(h / 2), math.ceil(w / 2))],
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
            lambda: zoo.DetectionHead(in_ch=8, num_classes=3),
            "new: detection head (cls 3 + box 4) shared over 3 pyramid levels",
            _pyramid,
            (12, 12),
            _RAGGED4,
        ),
        _levels(
            "bifpn",
            _bifpn,
            "new: effdet-style BiFPN (tests/cases.py), 3 cells of width 8 over 3 levels, a "
            "9-output head; ragged: every sample a shape of its own, one entry in every "
            "BiFPN-node tensor",
            lambda h, w: [(c, h >> k, w >> k) for k, c in enumerate(BIFPN_CHANNELS)],
            (12, 12),
            _BIFPN_HW,
            ragged_entries=_bifpn_spread,
        ),
    )
}


def flat_out(out: Any) -> Tensor:
    """A model's output (tensor, or list/tuple/dict of them) as ``(B, O)``, leaf by leaf."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tree_leaves(out)], 1)


def flat_grads(params: Sequence[Tensor], gs: Sequence[Tensor | None]) -> Tensor:
    """Gradients (``None``: zero) as one flat vector in parameter order."""
    zeros = [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]
    return torch.cat([g.reshape(-1) for g in zeros])


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
        t = per_tensor
        return torch.cat([t[n].reshape(*t[n].shape[:batch_dims], -1) for n in self.names], -1)

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

    def hooked_forward(self, modules: Sequence[nn.Module], hook: Callable, i: int = 0) -> None:
        """A no-grad forward of sample ``i`` alone with ``hook`` on ``modules``."""
        handles = [m.register_forward_hook(hook) for m in modules]
        try:
            with torch.no_grad():
                self.forward(self.model, [t[None] for t in self.batch.samples[i]])
        finally:
            for h in handles:
                h.remove()


def make_batch(cell: Cell, samples: list[list[Tensor]], targets: Any, sizes: list[int]) -> Batch:
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
    return Batch(samples, buckets, inputs, targets, sizes)


def build_cell(
    workload: str, name: str, *, quick: bool, device="cpu", dtype=None, seed=0, n=None, k=None
) -> Cell:
    """The cell's model, batch and subset, deterministic in ``seed`` (every worker builds the
    same one; float64 is the float32 model converted); ``n``, ``k``: a named grid's batch size
    and entries (default: the workload's); ``dtype``: float32 by default."""
    spec, device, dtype = SPECS[name], torch.device(device), dtype or torch.float32
    torch.manual_seed(seed)
    outputs = 1 if workload == "jacnorm" else (CLASSES if spec.classifier else 0)
    model = spec.build(outputs).eval().to(device=device, dtype=dtype)
    cell = Cell(workload, spec, model, device, dtype)
    n = n or SIZES[workload][1 if quick else 0]
    if cell.ragged and spec.kind != "levels":
        raise Skip(f"{name} takes one tensor, not a list of levels")
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
            raise Skip(f"{name} is not a classifier")
        classes, pixels = (spec.dense, spec.image_hw) if spec.dense else (CLASSES, ())
        targets = torch.randint(0, classes, (n, *pixels), generator=g).to(device)
    cell.names = [n for n, _ in model.named_parameters()]
    cell.num_params = sum(p.numel() for p in model.parameters())
    cell.subset = mj.ParamSubset.all(model)
    idx = None
    if workload in SUBSET_K or k:
        gs = torch.Generator().manual_seed(seed + 2)
        idx = torch.randperm(cell.num_params, generator=gs)[: k or SUBSET_K[workload]]
    if cell.ragged and spec.ragged_entries is not None and not k:
        idx = spec.ragged_entries(model)
    if idx is not None:
        cell.subset, cell.cols = mj.ParamSubset.from_flat_indices(model, idx), idx.to(device)
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
        out = out.reshape(len(out), -1, *targets.shape[1:])
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
        jac = (batch.n, batch.o_max, cell.subset.numel)
        shape = jac if cell.jacobian_like else (cell.num_params,)
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


def lanes_estimate(cell: Cell, batch: Batch) -> int:
    """Bytes of a vectorised backward with a lane per output row through a bucket (``jacobian(
    vectorize=True)``, curvlinops' transposed Jacobian): six of the largest layer's ``(lanes,
    N_b, ...)`` tensors (a measured rule) and the ``(lanes, P)`` Jacobian thrice; the Fisher has
    a lane a sample, the Jacobian norm keeps every layer's output for its second backward."""
    sizes: list[int] = []  # the leaf modules' output sizes on the largest sample
    leaves = [m for m in cell.model.modules() if not list(m.children())]
    largest = max(range(cell.batch.n), key=lambda k: cell.batch.out_sizes[k])
    record = lambda _m, _i, out: sizes.extend(t.numel() for t in tree_leaves(out))  # noqa: E731
    cell.hooked_forward(leaves, record, largest)
    act_max, act_sum = max(sizes, default=1), sum(sizes)
    item, worst = torch.empty((), dtype=cell.dtype).element_size(), 0
    for b in batch.buckets:
        nb = len(b.indices)
        if cell.workload == "jacnorm":
            worst = max(worst, nb * nb * act_sum * item * 2 + nb * cell.num_params * item * 3)
            continue
        lanes = nb * (1 if cell.workload == "fisher" else batch.out_sizes[b.indices[0]])
        worst = max(worst, lanes * nb * act_max * item * 6 + lanes * cell.num_params * item * 3)
    return worst


def _import(module: str, what: str) -> Any:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{what} not installed (pip install it to compare)")
    return importlib.import_module(module)


def _hooks_apply(cell: Cell, peer: str) -> None:
    """Skip a per-module hook library (BackPACK, Opacus) where its hooks cannot work: the
    Jacobian norm's second derivatives, or a module called more than once per forward."""
    if cell.workload == "jacnorm":
        raise Skip(f"{peer}: {NO_SECOND}")
    calls: dict[nn.Module, int] = {}
    owners = [m for m in cell.model.modules() if any(True for _ in m.parameters(recurse=False))]
    cell.hooked_forward(owners, lambda m, _i, _o: calls.__setitem__(m, calls.get(m, 0) + 1))
    if max(calls.values(), default=1) > 1:
        raise Skip(f"{peer}: {REUSED}")


def _clear(params: Sequence[nn.Parameter]) -> None:
    """Drop ``.grad`` and what BackPACK and Opacus store on the parameters."""
    for p in params:
        p.grad = None
        p.grad_sample = None
        for attr in ("grad_batch", "sum_grad_squared"):
            if hasattr(p, attr):
                delattr(p, attr)


# ---------------------------------------------------------------------- the peers
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
    selected = cell.cols is not None and cell.workload in JACOBIAN_LIKE
    if selected:
        f = cell.sample_fn(model)
        h = jacrev(lambda sel, _y, *levels: f({**params, **sel}, *levels))
    chosen = (
        {n: p for n, p in params.items() if n in set(cell.subset.names)} if selected else params
    )

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for i, s in enumerate(batch.samples):
            jac = h(chosen, batch.labels(i), *s)
            if selected:
                o = batch.out_sizes[i]
                jac = {
                    n: jac[n] if n in jac else p.new_zeros(o, *p.shape) for n, p in params.items()
                }
            sink.add([i], cell.flat(jac, dims)[None])
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


def _scalar_peer(cell: Cell, model: nn.Module, per_chunk: Callable) -> Run:
    """A jacnorm peer: ``per_chunk(g1, params, levels)``, ``g1`` the gradient of one sample's
    scalar output, summed over chunks of :data:`VMAP_CHUNK` samples per shape bucket."""
    f = cell.sample_fn(model)
    g1 = grad(lambda p, *levels: f(p, *levels).sum())

    def run(batch: Batch) -> Tensor:
        params = cell.params(model)
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for b in batch.buckets:
            for s in range(0, len(b.indices), VMAP_CHUNK):
                lv = [t[s : s + VMAP_CHUNK] for t in b.levels]
                for n, g in per_chunk(g1, params, lv).items():
                    acc[n] += g
        return cell.flat(acc)

    return run


def vmap_double_bwd(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``vmap_grad_chunks``: ``grad`` of the squared norm of ``vmap(grad)``."""

    def chunk(g1: Callable, params: dict[str, Tensor], lv: list[Tensor]) -> dict[str, Tensor]:
        def sq_norm(p: dict[str, Tensor]) -> Tensor:
            per = vmap(g1, in_dims=(None, *[0] * len(lv)))(p, *lv)
            return sum((g**2).sum() for g in per.values())

        return grad(sq_norm)(params)

    return _scalar_peer(cell, model, chunk)


def fwd_over_rev(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``fwd_over_rev``: ``2 sum_i H_i g_i`` with ``jvp`` of ``grad``."""

    def chunk(g1: Callable, params: dict[str, Tensor], lv: list[Tensor]) -> dict[str, Tensor]:
        def hvp(gi: dict[str, Tensor], *x: Tensor) -> dict[str, Tensor]:
            return jvp(lambda p: g1(p, *x), (params,), (gi,))[1]

        gs = vmap(g1, in_dims=(None, *[0] * len(lv)))(params, *lv)
        return {n: 2 * h.sum(0) for n, h in vmap(hvp)(gs, *lv).items()}

    return _scalar_peer(cell, model, chunk)


def autograd_jacobian(cell: Cell, model: nn.Module) -> Run:
    """``torch.autograd.functional.jacobian(vectorize=True)`` per bucket: of the outputs, of the
    log-likelihoods (fisher: the EWC code users write), or with ``create_graph`` and a second
    ``autograd.grad`` of the squared sum (jacnorm)."""
    names, w = [n for n, _ in model.named_parameters()], cell.workload
    ps = tuple(p.detach() for p in model.parameters())

    def run(batch: Batch) -> Tensor:
        sink = Sink(cell, batch)
        for b in batch.buckets:
            y = batch.labels(b.indices)

            def vec(*q: Tensor, lv: list[Tensor] = b.levels, y: Tensor = y) -> Tensor:
                out = flat_out(functional_call(model, dict(zip(names, q)), (cell.model_input(lv),)))
                if w == "fisher":
                    return out.log_softmax(1).gather(1, y[:, None])[:, 0]
                return out.reshape(-1)

            leaves = tuple(p.clone().requires_grad_(True) for p in ps) if w == "jacnorm" else ps
            jac = torch.autograd.functional.jacobian(
                vec, leaves, vectorize=True, create_graph=w == "jacnorm"
            )
            rows = torch.cat([j.reshape(j.shape[0], -1) for j in jac], 1)
            if w == "jacnorm":
                gs = torch.autograd.grad(rows.pow(2).sum(), leaves, allow_unused=True)
                sink.add(None, flat_grads(ps, gs)[None])
            elif cell.jacobian_like:
                sink.add(b.indices, rows.reshape(len(b.indices), -1, rows.shape[1]))
            else:
                sink.add(b.indices, rows)
        return sink.result()

    return run


def backpack(cell: Cell, model: nn.Module) -> Run:
    """BackPACK: ``BatchGrad``, one backward per output row; fisher: ``SumGradSquared`` (its
    ``DiagGGNExact`` is neither the empirical Fisher nor the subset block a Laplace needs)."""
    _hooks_apply(cell, "BackPACK")
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
    _hooks_apply(cell, "Opacus")
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
                if r is None:
                    loss = F.cross_entropy(out, batch.targets[b.indices], reduction="sum")
                else:
                    loss = out[:, r].sum()
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
    if cell.workload == "fisher":
        raise Skip("curvlinops has no exact diagonal (only Hutchinson estimates, or P matvecs)")
    if cell.workload == "jacnorm":
        raise Skip("curvlinops: operators of one batch, no per-sample Jacobian-norm gradient")
    cl = _import("curvlinops", "curvlinops")
    wrapped = _Flat(cell, model)
    params = list(wrapped.parameters())
    size = (lambda v: v.shape[0]) if cell.tensor_input else (lambda v: v["0"].shape[0])
    kw = {"check_deterministic": False, "batch_size_fn": size}
    eye = lambda n: torch.eye(n, dtype=cell.dtype, device=cell.device)  # noqa: E731

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
                return cl.SubmatrixLinearOperator(op, idx, idx) @ eye(len(idx))
            if cell.cols is not None:  # J @ one-hot columns of the subset (forward mode)
                op = cl.JacobianLinearOperator(wrapped, params, data, num_data=nb, **kw)
                e = out.new_zeros(cell.num_params, len(cell.cols))
                e[cell.cols, torch.arange(len(cell.cols), device=cell.device)] = 1
                out[b.indices, :o] = (op @ e).reshape(nb, o, -1)
            else:  # J^T @ identity (one vector-Jacobian product per output row)
                op = cl.TransposedJacobianLinearOperator(wrapped, params, data, num_data=nb, **kw)
                out[b.indices, :o] = (op @ eye(nb * o)).T.reshape(nb, o, -1)
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
    inv, opts = order.argsort(), {"subset_of_weights": "subnetwork", "hessian_structure": "full"}

    def run(batch: Batch) -> Tensor:
        data = TensorDataset(batch.buckets[0].levels[0], batch.targets)
        la = lt.Laplace(model, "classification", **opts, subnetwork_indices=cols.clone())
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
                from multiscale_jac import jacnorm  # its notes: the route choice

                with _spy(jacnorm._Job, "__init__", lambda job, _r: job) as jobs:
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
                from multiscale_jac.laplace import _jacobian_rows as rows

                route = lambda _a, res: {"mode": str(res.mode), **_route_of(res)}  # noqa: E731
                with _spy(rows, "run_engine", route) as routes:
                    la.fit([(batch.inputs, batch.targets)])
                value = la.H
                if routes:  # what SubnetLaplace takes of a route: mode, entries, samples per call
                    info["chosen"] = max(routes, key=lambda r: r.get("chunk_size", 0))
            info["probed"] = mj.plan_cache_info().probed - before.probed
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
def _spy(owner: Any, name: str, record: Callable[[Any, Any], Any]) -> Iterator[list[Any]]:
    """``record(first argument, result)`` of every call of ``owner.name`` in the block: what the
    library ran where its result does not say (a Laplace fit, ``jacobian_sq_norm``)."""
    real, seen = getattr(owner, name), []

    def spy(*args: Any, **kwargs: Any) -> Any:
        res = real(*args, **kwargs)
        seen.append(record(args[0] if args else None, res))
        return res

    setattr(owner, name, spy)
    try:
        yield seen
    finally:
        setattr(owner, name, real)


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
    ms = [
        Method("train_step", "train", "forward, loss, backward, SGD step (train copy)", train_step)
    ]

    def peer(name: str, what: str, prep: Prepare, *estimate: Any) -> None:
        ms.append(Method(name, "peer", what, prep, *estimate))

    chunk = f"{VMAP_CHUNK} a chunk"
    if workload == "jacnorm":
        peer("loop_func", "per sample: grad of ||jacrev||^2", loop_func)
        peer("vmap_double_bwd", f"grad of ||vmap(grad)||^2, {chunk}", vmap_double_bwd)
        peer("fwd_over_rev", f"vmap(grad), 2 sum_i H_i g_i by jvp of grad, {chunk}", fwd_over_rev)
    else:
        fn = "grad" if workload == "fisher" else "jacrev"
        chunk = f"<= {FISHER_VMAP_CHUNK if workload == 'fisher' else VMAP_CHUNK} per shape bucket"
        peer("loop_func", f"per-sample torch.func.{fn} loop{then_}", wrap(loop_func))
        peer("vmap_chunks", f"vmap({fn}) in chunks of {chunk}{then_}", wrap(vmap_chunks))
    of = {
        "fisher": " of the N log-likelihoods, squared",
        "jacnorm": " with create_graph, autograd.grad of the squared sum",
    }.get(workload, then_)
    what = "torch.autograd.functional.jacobian(vectorize=True) per shape bucket" + of
    peer("autograd_jacobian", what, wrap(autograd_jacobian), lanes_estimate, 2.0)
    bp = "SumGradSquared" if workload == "fisher" else "BatchGrad, a backward per output row"
    op = "per-sample loss gradients, squared" if workload == "fisher" else "a pass per output row"
    cl = {
        "subset": "JacobianLinearOperator @ one-hot columns",
        "laplace": "GGNLinearOperator, the subset's submatrix @ identity",
    }.get(workload, "TransposedJacobianLinearOperator @ identity, per shape bucket")
    peer("backpack", f"BackPACK {bp}{then_}", wrap(backpack))
    peer("opacus", f"Opacus GradSampleModule, {op}{then_}", wrap(opacus))
    dense = (lanes_estimate, 2.0) if workload in ("jacobian", "ragged") else ()
    peer("curvlinops", f"curvlinops {cl}", curvlinops, *dense)
    if workload == "laplace":
        what = "laplace-torch Laplace(subset_of_weights='subnetwork', hessian_structure='full')"
        peer("laplace_torch", what + ".fit", laplace_torch)
    auto = {
        "fisher": "mj.diag_fisher with defaults",
        "jacnorm": "mj.jacobian_sq_norm(model, x).backward() with defaults",
        "laplace": "mj.SubnetLaplace(model, 'classification', subset).fit(data)",
    }.get(workload, "mj.per_sample_jacobian with defaults")
    ms.append(Method("library_auto", "library", auto, library()))
    if workload in JACOBIAN_LIKE:
        entries = ("structured", "generic") if workload == "subset" else (None,)
        routes = [
            {"strategy": s, "mode": m, **({"entries": e} if e else {})}
            for s in ("vmap", "bucketed", "padded")
            for m in ("rev", "fwd")
            for e in entries
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
        what = ", ".join(f"{k}={v}" for k, v in kw.items()) + ", strict=True"
        ms.append(
            Method("library_" + "_".join(kw.values()), "route", what, library(**kw), route=kw)
        )
    return ms


# ---------------------------------------------------------------------- the float64 reference
def reference(cell: Cell, batch: Batch) -> Tensor:
    """Plain ``autograd.grad``, one sample at a time (rows by one-hot ``grad_outputs``, batched),
    independent of every method; the Jacobian norm's forward in attention's math form (its
    fused kernels have no double backward)."""
    params = list(cell.model.parameters())
    sink = Sink(cell, batch)
    logits = torch.zeros(batch.n, batch.o_max, dtype=cell.dtype, device=cell.device)
    keep = {"retain_graph": True, "allow_unused": True}
    math_sdpa = sdpa_kernel([SDPBackend.MATH]) if cell.workload == "jacnorm" else nullcontext()
    with math_sdpa:
        for i, s in enumerate(batch.samples):
            y = cell.forward(cell.model, [t[None] for t in s])[0]
            logits[i, : y.numel()] = y.detach()
            if cell.workload == "fisher":
                logp = torch.log_softmax(y, 0)[batch.targets[i]]  # type: ignore[index]
                sink.add(None, flat_grads(params, torch.autograd.grad(logp, params))[None])
            elif cell.workload != "jacnorm":  # every row's gradient, one-hot grad_outputs
                for r0 in range(0, y.numel(), 256):
                    eye = torch.eye(y.numel(), dtype=y.dtype, device=y.device)[r0 : r0 + 256]
                    gs = torch.autograd.grad(y, params, eye, is_grads_batched=True, **keep)
                    rows = [
                        y.new_zeros(len(eye), p.numel()) if g is None else g.reshape(len(eye), -1)
                        for p, g in zip(params, gs)
                    ]
                    sink.value[i, r0 : r0 + len(eye)] = cell.select(torch.cat(rows, 1))
            else:
                for r in range(y.numel()):  # jacnorm: grad of sum_o ||d y_o / d theta||^2
                    gs = torch.autograd.grad(y[r], params, create_graph=True, **keep)
                    sq = sum((g**2).sum() for g in gs if g is not None)
                    gs = torch.autograd.grad(sq, params, **keep)
                    sink.add(None, flat_grads(params, gs)[None])
    result = sink.result()
    return ggn(result, logits, cell.spec.dense) if cell.workload == "laplace" else result


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


def wants(patterns: Sequence[str] | None, name: str) -> bool:
    """Whether ``patterns`` (method names or globs; none: all) select ``name`` (the step always)."""
    return name == "train_step" or not patterns or any(fnmatch(name, p) for p in patterns)


def _reset_forward_ad() -> None:
    """Leave every forward-AD level a time limit's interrupt left entered (inside curvlinops'
    ``dual_level``): later forward-mode calls failed ("Nested forward mode AD ...")."""
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
            if m.kind != "train" and "value" not in baseline:
                baseline.update(value=value_of(res), method=m.name)
                rec["float32_baseline"] = True
            elif m.kind != "train":
                d = compare(value_of(res), baseline["value"])
                rec.update(float32_vs=baseline["method"], float32_rel_diff=d.get("rel_diff"))
                if "mismatch" in d:
                    rec["float32_mismatch"] = d["mismatch"]
            del res
            kw = {"threads": args.threads, "min_run_time": args.min_run_time, "warm_s": t_first}
            rec.update(common.timer_median(lambda: run(batch), **kw))
    except Skip as e:
        rec["skipped"] = str(e) if str(e).startswith("not run") else f"not applicable: {e}"
    except Exception as e:
        rec["error"] = error_text(e)
    return rec


def interleave(
    cell: Cell, methods: Sequence[Method], results: dict[str, dict[str, Any]], args: Any
) -> int:
    """The contenders (the training step, ``library_auto``, the two fastest peers and forced
    routes) timed again, one call each a round in a rotating order, so that the machine's drift
    falls on every method alike; their ``seconds`` become the medians (``seconds_alone``: the
    first). At least 3 rounds, at most ``--rounds`` within ``--rounds-budget``; returns them."""
    timed = [m for m in methods if "seconds" in results[m.name]]
    contenders = [m for m in timed if m.kind in ("train", "library")]
    for kind in ("peer", "route"):
        group = [m for m in timed if m.kind == kind]
        contenders += sorted(group, key=lambda m: results[m.name]["seconds"])[:2]
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
            glob = {"run": run, "batch": cell.batch}
            timers[m.name] = common.Timer("run(batch)", globals=glob, num_threads=args.threads)
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
    spot: Spot, methods: Sequence[Method], args: Any, limits: dict[str, float] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every method on a float64 slice of the cell against :func:`reference` (each under
    ``limits[name]`` seconds, default ``--check-limit``); not the per-pixel cells, whose sliced
    fit is compared with the unsliced one in float32 (``float32_rel_diff``)."""
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
    for m in (m for m in methods if m.kind != "train"):
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
    rec["malloc_env"] = common.malloc_env()
    methods = methods_for(spot.workload, cell.spec.dense)
    methods = [m for m in methods if wants(args.methods, m.name)]
    baseline: dict[str, Any] = {}
    results = {}
    for m in methods:
        results[m.name] = r = bench_method(cell, m, args, baseline)
        if m.kind != "train":
            what = f"{r['seconds']:.4g} s" if "seconds" in r else r.get("skipped") or r.get("error")
            log(f"[{cell.name}] {m.name}: {str(what)[:160]}")
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
        r.update(checked=c.get("max_abs_diff"), checked_rel=c.get("rel_diff"))
        r["check_ok"] = c.get("ok", False)
        if "ok" not in c:
            r["check_error"] = c.get("error") or c.get("skipped") or c.get("mismatch")
        if r.get("float32_baseline"):
            base_ok = r["check_ok"]
    for r in (r for r in results.values() if "seconds" in r):
        if rec["train_step_seconds"]:
            r["ratio_to_train_step"] = r["seconds"] / rec["train_step_seconds"]
        if r["kind"] != "train":
            f32 = r.get("float32_rel_diff")
            agrees = f32 is not None and f32 <= args.f32_tol
            ok32 = r.get("float32_baseline") or not base_ok or agrees
            r["valid"] = bool(r.get("check_ok") and ok32)
    rec["methods"] = results
    print(json.dumps(rec, default=str))
    return 0


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
        rec = common.measure_peak_memory(lambda: out.append(run(cell.batch)), args.device)
    if method == "library_auto":
        rec["chosen"] = out[0].info.get("chosen", {})
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- the named grids
@dataclass(frozen=True)
class Spot:
    """A cell of a named grid: a workload on a model, batch size ``n`` and entries ``k`` (``None``:
    the workload's), ``methods`` (names or globs; empty: all), ``roles`` (:func:`run_roles`)."""

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

    def build(self, args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> Cell:
        kw = {"quick": args.quick, "device": args.device, "seed": args.seed}
        return build_cell(self.workload, self.model, dtype=dtype, n=self.n, k=self.k, **kw)


def _main_cells(quick: bool) -> list[Spot]:
    return [Spot(w, m) for w in WORKLOADS for m in (QUICK_GRID if quick else GRID)[w]]


def _choice(quick: bool) -> list[Spot]:
    extra = [] if quick else [Spot("subset", "multibranch", k=36)]  # a low-dim readout
    return [dataclasses.replace(s, methods=("library_*",)) for s in _main_cells(quick) + extra]


def _batch(quick: bool) -> list[Spot]:
    ms = ("library_auto", "loop_func", "vmap_chunks", "vmap_double_bwd", "backpack")
    if quick:
        sweep = [("fisher", "resnet8", (8, 16)), ("jacnorm", "cnn3", (4, 8))]
    else:
        sweep = [("fisher", m, (32, 64, 128)) for m in ("vgg11_bn_q", "resnet8")]
        sweep += [("jacnorm", m, (10, 128)) for m in ("cnn3", "cnn8")]
    return [Spot(w, m, n=n, methods=(*ms, "autograd_jacobian")) for w, m, ns in sweep for n in ns]


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
        Spot("laplace", "seg_head", 2 if quick else 4, methods=("library_auto", "library_sliced"))
    ]


def _laplace_torch(quick: bool) -> list[Spot]:
    ms, n = ("library_auto", "laplace_torch"), 8 if quick else 32
    return [Spot("laplace", f"cifarnet{w}", n, 100, ms) for w in ((32,) if quick else (32, 48))]


def _first_call(quick: bool) -> list[Spot]:
    cells = [
        ("subset", "convblock_wide", (8, 2), 500),  # ConvBlock, 500 entries
        ("fisher", "vgg11_bn_q", (32, 16), None),  # the VGG Fisher
        ("jacnorm", "cnn3", (128, 32), None),  # the CNN's Jacobian norm
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
    "first_call": ("first calls, a fresh process each: auto, user's code, loaded", _first_call),
}
#: first_call: the code a user would write instead, per workload
USER_CODE = {"fisher": "vmap_chunks", "jacnorm": "vmap_double_bwd"}
FIRST_TARGETS = {"first": 1.25, "second": 1.2, "loaded": 1.2, "rss": 1.2, "budget": 1.0}
#: first_call: the ``memory_budget`` of the roles ``budget`` (the batch) and ``overhead`` (its
#: first sample alone: the process's fixed overhead): 20 MB (a user's Laplace fit rose 137 MiB
#: under it), 64 MiB where the result alone is larger (the subset Jacobian: 47 MiB)
FIRST_BUDGETS = {**dict.fromkeys(WORKLOADS, 20_000_000), "subset": 64 * 2**20}


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
            if (
                (fam == "choice" and s.name in timed)
                or (args.workloads and s.workload not in args.workloads)
                or (args.models and s.model not in args.models)
                or (args.cells and not {s.name, f"{s.workload}/{s.model}"} & set(args.cells))
            ):
                continue
            out.append((fam, s))
    return out


def worker(args: argparse.Namespace, *flags: str, env: dict[str, str] | None = None) -> dict:
    """This script with ``flags`` (``--worker-*``) in a fresh process: its JSON record."""
    return run_worker([str(SCRIPT), *args.argv, *flags], timeout_s=args.timeout, env=env)


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
    other, route = cell["best_other_seconds"], cell["best_route_seconds"]
    cell["library_over_best_other"] = auto / other if auto and cell["best_other"] else None
    cell["auto_over_best_route"] = auto / route if auto and cell["best_route"] else None
    if "library_auto" in ms and not auto:
        why = (ms["library_auto"].get(k) for k in ("error", "skipped", "check_error"))
        cell["auto_problem"] = next((w for w in why if w), "failed the check")
    cell["note"] = slow_note(cell)


def memory_of(args: argparse.Namespace, family: str) -> str:
    """The ``--memory`` setting for a cell of ``family``: ``--quick`` measures peak memory
    where it is the grid's subject only (every figure is a fresh process)."""
    if args.memory:
        return args.memory
    return {"batch": "main", "entries": "main"}.get(family, "none") if args.quick else "all"


def run_cell(
    spot: Spot, args: argparse.Namespace, deadline: float | None, memory: str = "all"
) -> dict[str, Any]:
    """Every method of a cell timed in one fresh worker, then peak memory per method (a fresh
    worker each: ``memory``, :func:`memory_of`)."""
    name = spot.name
    log(f"== {name}: timing all methods in one worker ...")
    t0 = time.perf_counter()
    methods = ["--methods", *spot.methods] if spot.methods else []
    rec = worker(args, "--worker-cell", name, *methods, env=args.malloc_env)
    rec = {"name": name, "workload": spot.workload, "model": spot.model, **rec}
    if "error" in rec or "methods" not in rec:
        log(f"   {name}: {rec.get('error')}")
        return rec
    summarise(rec)
    ms = rec["methods"]
    keep = {"train_step", "library_auto", rec.get("best_other"), rec.get("best_route")}
    for method in [n for n, r in ms.items() if "seconds" in r and (memory == "all" or n in keep)]:
        if memory == "none" or (deadline is not None and time.time() > deadline):
            break
        mem = worker(args, "--worker-mem", name, method)
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


def _auto_against_chosen(
    name: str, auto: dict[str, Any], rec: dict[str, Any], args: argparse.Namespace
) -> None:
    """auto, its timing included, against the route it ran (``chosen``: strategy, mode,
    entries, samples per call; or method and chunk) forced with ``tune=False``, each a fresh
    process, :data:`MEMORY_PAIRS` pairs (auto's first from the method's own measurement)."""
    autos, forced = [auto["memory"]], []
    for i in range(MEMORY_PAIRS):
        if i:
            autos.append(worker(args, "--worker-mem", name, "library_auto"))
        chosen = autos[-1].get("chosen")
        if chosen is None:
            return
        forced.append(worker(args, "--worker-mem", name, CHOSEN, "--route", json.dumps(chosen)))
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
    and ``overhead`` run under :data:`FIRST_BUDGETS`, ``overhead`` on one sample."""
    name, role, path = args.worker_role
    spot = Spot.parse(name)
    torch.set_num_threads(args.threads)
    cell = spot.build(args)
    with torch.no_grad():  # the model has run before: its one-time set-up charged to no one
        for b in cell.batch.buckets:
            cell.forward(cell.model, b.levels)
    user = USER_CODE.get(spot.workload, "loop_func")
    budget = library(memory_budget=FIRST_BUDGETS[spot.workload])
    prep = {
        **dict.fromkeys(("library", "loaded"), library()),
        **dict.fromkeys(("budget", "overhead"), budget),
        "estimate": library(tune=False),
        "user": next(m for m in methods_for(spot.workload) if m.name == user).prepare,
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
        rec.update(common.measure_peak_memory(call, args.device))
        rec["first_seconds"] = box[0][0]
        rec["counters"] = {k: v - before[k] for k, v in _counters().items()}
        second, _ = timed_call(lambda: run(batch), args.device, args.threads)
        rec["second_seconds"] = second
        kw = {"threads": args.threads, "min_run_time": args.min_run_time, "warm_s": second}
        warm = common.timer_median(lambda: run(batch), **kw)
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
    ok.sort(key=lambda r: r["first_seconds"])
    if not ok:
        return runs[-1]
    out = dict(ok[len(ok) // 2])
    for k in ROLE_MEDIANS:
        values = [r[k] for r in ok if r.get(k) is not None]
        if values:
            out[k] = median(values)
    out["rounds"] = [{k: r.get(k) for k in (*ROLE_MEDIANS, "error")} for r in runs]
    return out


def run_roles(spot: Spot, args: argparse.Namespace) -> dict[str, Any]:
    """A first-call cell: every role of :func:`role_worker` in a fresh process, ``--repeats``
    interleaved rounds (each role's figures their medians: one first call is one sample of a
    noisy quantity); the ratios against their targets (:data:`FIRST_TARGETS`)."""
    log(f"== {spot.name}: first calls, a fresh process per role, {args.repeats} rounds ...")
    rec: dict[str, Any] = {"name": spot.name, "workload": spot.workload, "model": spot.model}
    runs: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for _ in range(args.repeats):  # interleaved: a round runs every role once
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "decisions.json")
            for role in ROLES:
                r = worker(args, "--worker-role", spot.name, role, path, env=args.malloc_env)
                runs[role].append(r)
                log(f"   {role}: " + str({k: r.get(k) for k in (*ROLE_MEDIANS[:2], "error")}))
    for role in ROLES:
        rec[role] = _median_role(runs[role])
    lib, user, est, loaded, budget, overhead = (rec[r] for r in ROLES)
    cap = FIRST_BUDGETS[spot.workload]
    budgeted = [r.get("peak_memory_bytes") for r in (budget, overhead)]
    one_time = allowance = None
    if user.get("first_seconds") is not None and user.get("warm_seconds") is not None:
        one_time = max(user["first_seconds"] - user["warm_seconds"], 0.0)
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
    "seconds": "median per call (torch.utils.benchmark.Timer) after a warm-up on a slice and one "
    "call on the batch, every method of a cell in one fresh process; the contenders' the median "
    "of interleaved rounds",
    "ratio_to_train_step": "seconds / the training step of the same process",
    "first_call_seconds": "library methods: the first call on the batch, a fresh copy of the "
    "model, plan cache cleared (torch warmed up by the slice call)",
    "checked": "max abs difference from the float64 reference (plain autograd loops) on a slice; "
    "valid: checked_rel <= check_tol and float32_rel_diff (vs the first peer) <= f32_tol",
    "library_over_best_other": "library_auto seconds / the fastest valid non-library method's",
    "auto_over_best_route": "library_auto seconds / the fastest valid forced library route's",
    "auto_memory_over_chosen_route": "library_auto's peak memory / the route it ran forced with "
    "tune=False: the median of MEMORY_PAIRS pairs of fresh processes",
    "note": "why auto is slower than the best other method, where it is",
}


def results_path(args: argparse.Namespace) -> Path:
    stem = args.name or ("grid" + ("_quick" if args.quick else ""))
    return (Path(args.out) if args.out else DEFAULT_OUT) / f"{stem}.json"


def merge(results: dict[str, Any], rec: dict[str, Any]) -> None:
    """``rec`` replaces the cell of the same family and name (the others stay); a method of the
    old cell this run did not measure (a peer not installed here) keeps its record and run."""
    key = (rec["family"], rec["name"])
    old = [c for c in results["cells"] if (c.get("family"), c.get("name")) == key]
    measured = ("seconds", "peak_memory_bytes")
    for name, r in (old[0].get("methods", {}) if old else {}).items():
        new = rec.get("methods", {}).get(name, {})
        if any(k in r for k in measured) and not any(k in new for k in measured):
            rec.setdefault("methods", {})[name] = {"run": old[0].get("run"), **r}
    results["cells"] = [c for c in results["cells"] if c not in old] + [rec]


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("--device cuda: CUDA is not available")
        return 2
    torch.set_num_threads(args.threads)
    cells, path = grid(args), results_path(args)
    new = {"benchmark": "bench_peers", "notes": NOTES, "runs": [], "cells": []}
    results = json.loads(path.read_text()) if path.exists() else new
    caveat = common.MEMORY_CAVEAT_CUDA if device.type == "cuda" else common.MEMORY_CAVEAT_CPU
    results["notes"] = {**NOTES, "peak_memory_bytes": caveat}
    run_id = max((r["id"] for r in results["runs"]), default=0) + 1
    config = {k: getattr(args, k) for k in CONFIG_KEYS}
    config["malloc_env"] = args.malloc_env
    peers = ("backpack", "opacus", "curvlinops", "laplace")
    config["peers_installed"] = {p: importlib.util.find_spec(p) is not None for p in peers}
    env = {**common.env_stamp(device), "threads": args.threads}
    run = {"id": run_id, "env": env, "config": config}
    run["cells"] = [f"{fam}:{s.name}" for fam, s in cells]
    results["runs"].append(run)
    start = time.time()
    deadline = start + args.budget if args.budget else None
    for fam, spot in cells:
        if deadline is not None and time.time() > deadline:
            log(f"{fam}:{spot.name}: not run (--budget spent)")
            continue
        memory = memory_of(args, fam)
        rec = run_roles(spot, args) if spot.roles else run_cell(spot, args, deadline, memory)
        merge(results, {"family": fam, "run": run_id, **rec})
        common.write_json(path, results)
    run["env"]["load_average_at_end"] = common.load_average()
    run["total_seconds"] = round(time.time() - start, 1)
    common.write_json(path, results)
    import render

    return render.write_outputs(results, path.parent, path.stem)


CONFIG_KEYS = (
    *("grid", "quick", "device", "threads", "min_run_time", "method_limit", "limit_steps"),
    *("max_gb", "memory", "check_tol", "f32_tol", "seed", "malloc", "rounds", "repeats"),
)


# ---------------------------------------------------------------------- check and dry modes
def check_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows, table = [], []
    for _fam, spot in (s for s in grid(args) if not s[1].roles):
        methods = methods_for(spot.workload, SPECS[spot.model].dense)
        try:
            _, checks = check_methods(
                spot, [x for x in methods if wants(args.methods, x.name)], args
            )
        except Skip as e:
            log(f"{spot.name}: not applicable: {e}")
            continue
        for name, r in checks.items():
            rows.append({"cell": spot.name, "method": name, **r})
            what = str(r.get("skipped") or r.get("error") or r.get("mismatch"))[:90]
            diffs = [
                "-" if r.get(k) is None else f"{r[k]:.2e}" for k in ("max_abs_diff", "rel_diff")
            ]
            table.append(
                [spot.name, name, *diffs, ("ok" if r["ok"] else "FAIL") if "ok" in r else what]
            )
    path = results_path(args)
    data = {"env": common.env_stamp(args.device), "tol": args.check_tol, "rows": rows}
    path = common.write_json(path.with_name(path.stem + "_check.json"), data)
    print(common.markdown_table(["cell", "method", "max abs diff", "rel diff", "result"], table))
    failed = any(row[-1] == "FAIL" for row in table)
    log(f"wrote {path}" + ("; FAILED" if failed else ""))
    return 1 if failed else 0


def dry_main(args: argparse.Namespace) -> int:
    """The named grids' cells and methods; nothing measured."""
    rows = []
    for fam, s in grid(args):
        if s.roles:
            rows.append([fam, s.name, "library, user, estimate, loaded: fresh processes", "roles"])
            continue
        ms = methods_for(s.workload, SPECS[s.model].dense)
        rows += [
            [fam, s.name, x.name, x.kind]
            for x in ms
            if wants(s.methods, x.name) and wants(args.methods, x.name)
        ]
    print(common.markdown_table(["grid", "cell", "method", "kind"], rows))
    print(f"\n{len(grid(args))} cells, {len(rows)} (cell, method) pairs; device {args.device}")
    return 0


# ---------------------------------------------------------------------- command line
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the docstring.")
    add = p.add_argument
    grids = "; ".join(f"{k}: {v[0]}" for k, v in FAMILIES.items())
    grids = f"named grids to run (default main; all: every one): {grids}"
    add("--grid", nargs="+", default=["main"], choices=["all", *FAMILIES], help=grids)
    add("--quick", action="store_true", help="small cells, short timing (every grid's quick form)")
    add("--check", action="store_true", help="float64 agreement of every method; exit 1 on failure")
    add("--dry", action="store_true", help="list the cells and methods; run nothing")
    add("--workloads", nargs="*", choices=WORKLOADS, help="only these workloads")
    add("--models", nargs="*", choices=sorted(SPECS), help="only these models")
    add("--cells", nargs="*", metavar="W/M", help="only these cells (workload/model[@n=..,k=..])")
    add("--methods", nargs="*", help="only these methods, names or globs (train_step always)")
    add("--device", default="cpu", help="cpu or cuda (default cpu)")
    add("--threads", type=int, default=2, help="torch threads and Timer num_threads (2)")
    add("--min-run-time", type=float, default=0.0, help="Timer min_run_time (0.5; quick 0.1)")
    add("--method-limit", type=float, help="skip a method estimated slower (s/call; 40, quick 10)")
    add("--limit-steps", type=float, default=200.0, help="or than this many training steps (200)")
    add("--max-gb", type=float, default=4.0, help="skip a method whose memory estimate is larger")
    memory = (
        "peak memory per method in a fresh process: all (default), main (train step, auto, best "
        "other, best route; quick's default for the batch and entries grids) or none (quick's)"
    )
    add("--memory", choices=("all", "main", "none"), help=memory)
    add("--check-tol", type=float, default=1e-9, help="float64 relative tolerance (1e-9)")
    add("--f32-tol", type=float, default=1e-3, help="float32 relative tolerance vs the first peer")
    add("--check-limit", type=float, help="seconds per method on the float64 slice (30; quick 5)")
    add("--budget", type=float, default=0.0, help="seconds; start no new cell after (0: none)")
    add("--timeout", type=float, default=1200.0, help="seconds per worker process")
    add("--rounds", type=int, help="interleaved rounds of the contenders (5, quick 3; 0: none)")
    add("--repeats", type=int, help="first_call: interleaved rounds of the roles (3, quick 1)")
    add("--rounds-budget", type=float, default=60.0, help="seconds for the rounds at most (60)")
    malloc = "the timing workers' glibc malloc thresholds: fixed (MALLOC_FIXED) or glibc's"
    add("--malloc", choices=("fixed", "default"), default="fixed", help=malloc)
    add("--seed", type=int, default=0)
    add("--out", help="output folder (default: benchmarks/results)")
    add("--name", help="results file stem (default: grid, or grid_quick; --check adds _check)")
    hidden = {"--worker-cell": None, "--worker-mem": 2, "--route": None, "--worker-role": 3}
    for flag, nargs in hidden.items():
        add(flag, nargs=nargs, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv  # what the workers get (their --worker-* flag takes precedence)
    args.min_run_time = args.min_run_time or (0.1 if args.quick else 0.5)
    args.method_limit = args.method_limit or (10.0 if args.quick else 40.0)
    args.check_limit = args.check_limit or (5.0 if args.quick else 30.0)
    args.rounds = (3 if args.quick else 5) if args.rounds is None else args.rounds
    args.repeats = (1 if args.quick else 3) if args.repeats is None else args.repeats
    args.malloc_env = MALLOC_FIXED if args.malloc == "fixed" else None
    return args


if __name__ == "__main__":
    args = parse()
    workers = {"worker_cell": cell_worker, "worker_mem": memory_worker, "worker_role": role_worker}
    for flag, fn in workers.items():
        if getattr(args, flag):
            try:  # a worker's exception is a one-line {"error": ...} (traceback on stderr)
                sys.exit(fn(args))
            except Exception as e:
                traceback.print_exc()
                print(json.dumps({"error": error_text(e)}))
                sys.exit(0)
    sys.exit(dry_main(args) if args.dry else check_main(args) if args.check else main(args))

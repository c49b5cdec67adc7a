"""Benchmark: the library against the code a user would write instead, one process per cell.

The library claims to be at least as fast as the alternatives. This suite checks that claim on
a grid of (workload, model) cells; every method of a cell is timed side by side in ONE fresh
worker process (the training step every ratio is divided by included), checked against one
float64 reference, and measured for peak memory in its own fresh process.

Workloads (each a function of a model and a batch; ``--workloads``)
    jacobian  per-sample Jacobian of all outputs w.r.t. all parameters, uniform batch (N=16)
    ragged    the same on a ragged batch of multi-level samples (a list of samples, each a list
              of levels whose sizes differ per sample; N=16, several shape buckets)
    subset    element-subset Jacobian: 200 random single entries,
              ``ParamSubset.from_flat_indices(model, torch.randperm(P)[:200])`` (N=16)
    fisher    diagonal empirical Fisher, classification (N=128)
    jacnorm   gradient of the Jacobian-norm regulariser, ``jacobian_sq_norm(model, x).backward()``
              with one scalar output per sample (n=128)
    laplace   subnetwork Laplace fit, 100 random entries,
              ``SubnetLaplace(model, "classification", subset).fit(data)`` (B=32)

Models (``--models``; the grid in ``GRID`` says which model runs in which workload)
    existing zoo: ``vgg11_bn_q``, ``resnet8`` (``bench_fisher``), ``cnn3``, ``cnn8``
    (``bench_jacnorm``), ``convblock`` / ``convblock_wide`` (``multiscale_jac.models.ConvBlock``,
    in_ch 8 / 32), ``tinyfpn``, ``sharedfpn`` (``TinyFPN``, ``SharedHeadFPN``);
    architectures the cost model was not tuned on (fixed before measuring): ``tanh_cnn`` (strided
    tanh convs, a large linear head), ``gelu_cnn``, ``gn_dw`` (GroupNorm + depthwise-conv
    blocks), ``det_head`` (a detection head shared over ragged FPN levels, outputs per level),
    ``transformer`` (two pre-norm blocks over 16 tokens, ``F.scaled_dot_product_attention``).

Methods per cell (``--methods`` filters by name; a method that does not apply is recorded with
the reason)
    train_step         forward, loss, backward, SGD step on a train-mode copy (the reference of
                       every ratio; a ragged batch: one forward/backward per shape bucket)
    loop_func          a Python loop over samples of ``torch.func.jacrev`` (fisher: ``grad``;
                       jacnorm: ``grad`` of the squared norm of ``jacrev``)
    vmap_chunks        ``vmap(jacrev)`` in chunks (per shape bucket; fisher: ``vmap(grad)``)
    vmap_double_bwd    jacnorm: ``grad`` of the squared norm of ``vmap(grad)``, 16 samples a chunk
    fwd_over_rev       jacnorm: ``vmap(grad)``, then ``2 sum_i H_i g_i`` by ``jvp`` of ``grad``
    autograd_jacobian  ``torch.autograd.functional.jacobian(vectorize=True)`` over the batch (per
                       shape bucket); not run above ``--max-gb`` by its memory estimate
    backpack           BackPACK: ``BatchGrad`` (one backward per output row) or ``SumGradSquared``
    opacus             Opacus ``GradSampleModule`` (one forward/backward per output row)
    curvlinops         curvlinops: ``JacobianLinearOperator`` on one-hot columns (subset),
                       ``TransposedJacobianLinearOperator`` on the identity (jacobian, ragged),
                       the ``GGNLinearOperator`` submatrix of the subset (laplace)
    library_auto       the library with its defaults (``per_sample_jacobian``, ``diag_fisher``,
                       ``jacobian_sq_norm(...).backward()``, ``SubnetLaplace(...).fit``)
    library_<route>    every forced route, ``strict=True``: ``strategy`` x ``mode`` (x
                       ``entries`` for subset), Fisher ``method``, every ``JacNormMethod`` but
                       ``auto`` (read at run time), Laplace ``entries``

Timing: ``torch.utils.benchmark.Timer(...).blocked_autorange(min_run_time=...)`` with
``num_threads=--threads`` (a method slower than ``--min-run-time`` after its warm-up: up to three
single timed runs instead; the Timer's own clock synchronises CUDA). The median is reported.
Each method first runs on a small slice (warm-up; its time scaled to the batch decides whether
the method is run at all, ``--method-limit``), then once on the batch (warm-up, excluded). A
library method's first call on the batch is made on a fresh deep copy of the model (any plan
cache cold) and reported as ``first_call_seconds``; its timed runs then use that copy.

Correctness: every method also runs on a small float64 slice of the cell and is compared with
one reference (plain ``autograd.grad`` loops, one sample and one output row at a time):
``checked`` is the max abs difference, ``checked_rel`` that over the reference's max. Its float32
result on the batch is compared with the first peer's (``float32_rel_diff``). A method over
``--check-tol`` (float64) or ``--f32-tol`` is marked ``valid: false`` and never counts as the
best. ``--check`` runs the float64 comparison alone for every cell and exits 1 on a failure.

Memory: one fresh worker per (cell, method) (``--memory all``; ``main``: the training step,
``library_auto``, the best other method and the best route; ``none``): a warm-up on the slice,
then one call on the batch under ``_common.measure_peak_memory`` (CPU: peak RSS rise; CUDA:
``max_memory_allocated`` rise).

Per cell: ``best_other`` (the fastest valid non-library method), ``library_over_best_other``
(``library_auto`` seconds / that), ``best_route`` and ``auto_over_best_route``
(``library_auto`` / the fastest valid forced route).

Results: ``benchmarks/results/bench_peers.json`` (``_quick``, ``_check``; ``--out``,
``--name``), ``bench_peers.md`` (the tables) and ``bench_peers.png`` (``library_over_best_other``
per cell, log scale, with ``auto_over_best_route``; needs matplotlib).

Usage::

    python benchmarks/bench_peers.py                       # the full grid (~20 min, 2 cores)
    python benchmarks/bench_peers.py --quick               # a few minutes
    python benchmarks/bench_peers.py --check               # float64 agreement of every method
    python benchmarks/bench_peers.py --dry                 # list the cells and methods only
    python benchmarks/bench_peers.py --workloads fisher --models resnet8 --memory none
    python benchmarks/bench_peers.py --device cuda --quick --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    MEMORY_CAVEAT_CPU,
    MEMORY_CAVEAT_CUDA,
    env_stamp,
    fmt_bytes,
    fmt_seconds,
    markdown_table,
    measure_peak_memory,
    run_worker,
    sync,
    write_json,
)
from bench_fisher import build_model as build_fisher_model
from bench_jacnorm import WIDTHS as JACNORM_WIDTHS
from bench_jacnorm import PlainCNN
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vmap
from torch.utils._pytree import tree_leaves
from torch.utils.benchmark import Timer

import multiscale_jac as mj
from multiscale_jac.models import ConvBlock, SharedHeadFPN, TinyFPN

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results"

WORKLOADS = ("jacobian", "ragged", "subset", "fisher", "jacnorm", "laplace")
NEW_MODELS = ("tanh_cnn", "gelu_cnn", "gn_dw", "det_head", "transformer")

#: which models run in which workload (the full grid; ``--quick`` uses ``QUICK_GRID``)
GRID: dict[str, tuple[str, ...]] = {
    "jacobian": (
        "resnet8",
        "convblock",
        "tinyfpn",
        "tanh_cnn",
        "gelu_cnn",
        "gn_dw",
        "det_head",
        "transformer",
    ),
    "ragged": ("convblock", "tinyfpn", "sharedfpn", "det_head"),
    "subset": (
        "convblock_wide",
        "resnet8",
        "vgg11_bn_q",
        "tanh_cnn",
        "gelu_cnn",
        "gn_dw",
        "det_head",
        "transformer",
    ),
    "fisher": ("vgg11_bn_q", "resnet8", "tanh_cnn", "gelu_cnn", "gn_dw", "transformer"),
    "jacnorm": ("cnn3", "cnn8", "tanh_cnn", "gelu_cnn", "gn_dw", "transformer"),
    "laplace": ("resnet8", "vgg11_bn_q", "tanh_cnn", "gelu_cnn", "gn_dw", "transformer"),
}
QUICK_GRID: dict[str, tuple[str, ...]] = {
    "jacobian": ("resnet8", "det_head"),
    "ragged": ("det_head",),
    "subset": ("resnet8", "det_head"),
    "fisher": ("resnet8",),
    "jacnorm": ("gelu_cnn",),
    "laplace": ("resnet8",),
}
ALL_MODELS = tuple(dict.fromkeys(m for ms in GRID.values() for m in ms))

#: batch size per workload (full, quick)
SIZES: dict[str, tuple[int, int]] = {
    "jacobian": (16, 8),
    "ragged": (16, 8),
    "subset": (16, 8),
    "fisher": (128, 32),
    "jacnorm": (128, 16),
    "laplace": (32, 16),
}
SUBSET_K = {"subset": 200, "laplace": 100}
NUM_CLASSES = 10
CHECK_SAMPLES = 3  # the float64 slice (and the warm-up slice)
VMAP_CHUNK = 16  # samples per vmap call of the Jacobian / Jacobian-norm peers
FISHER_VMAP_CHUNK = 32  # bench_fisher's
CHUNK_BYTES = 256 * 2**20  # vmap peers: fewer samples per call when their Jacobian is larger


class Skip(Exception):
    """A method that does not apply to this cell, or a peer that is not installed."""


# ---------------------------------------------------------------------- new architectures
class StridedTanhCNN(nn.Module):
    """Two strided tanh convs (3->16->32 channels, stride 2) and a large linear head
    (2048 -> 256 -> outputs); most of the ~0.53M parameters are in the head."""

    def __init__(self, num_outputs: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2, padding=2),
            nn.Tanh(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.Tanh(),
        )
        self.head = nn.Sequential(
            nn.Linear(32 * 8 * 8, 256), nn.Tanh(), nn.Linear(256, num_outputs)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class GeluCNN(nn.Module):
    """3x3 convs with GELU (32/32/64/64 channels, 2x2 average pooling twice), global average
    pooling, a linear classifier."""

    def __init__(self, num_outputs: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.GELU(),
            nn.AvgPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.GELU(),
            nn.AvgPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.GELU(),
        )
        self.fc = nn.Linear(64, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class DepthwiseBlock(nn.Module):
    """ConvNeXt-style: depthwise 7x7, GroupNorm, 1x1 expand x4, GELU, 1x1 project, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.GroupNorm(4, c)
        self.pw1 = nn.Conv2d(c, 4 * c, 1)
        self.pw2 = nn.Conv2d(4 * c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class GroupNormDepthwise(nn.Module):
    """A 4x4 stride-4 stem (3->48), two depthwise blocks, GroupNorm, global average pooling,
    a linear classifier."""

    def __init__(self, num_outputs: int = NUM_CLASSES, width: int = 48) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 4, stride=4)
        self.blocks = nn.Sequential(DepthwiseBlock(width), DepthwiseBlock(width))
        self.norm = nn.GroupNorm(1, width)
        self.fc = nn.Linear(width, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(self.blocks(self.stem(x))).mean(dim=(2, 3)))


class DetectionHead(nn.Module):
    """A RetinaNet-style head shared by every pyramid level: a classification branch
    (conv3x3-ReLU-conv3x3 to ``num_classes``) and a box branch (to 4), on each level of a list of
    ``(B, C, H_l, W_l)`` maps; the output is one tensor per level (class logits and boxes
    flattened and concatenated), so a sample's output size follows its pyramid."""

    def __init__(self, in_ch: int = 8, num_classes: int = 3) -> None:
        super().__init__()
        self.cls = nn.Sequential(
            nn.Conv2d(in_ch, in_ch, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(in_ch, num_classes, 3, padding=1),
        )
        self.box = nn.Sequential(
            nn.Conv2d(in_ch, in_ch, 3, padding=1), nn.ReLU(), nn.Conv2d(in_ch, 4, 3, padding=1)
        )

    def forward(self, levels: Sequence[Tensor]) -> list[Tensor]:
        return [torch.cat([self.cls(x).flatten(1), self.box(x).flatten(1)], 1) for x in levels]


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Tokens ``(B, 16, 16)`` -> a linear embedding (64) plus a learned position embedding, two
    pre-norm blocks (4 heads, ``F.scaled_dot_product_attention``, GELU MLP x2), LayerNorm, mean
    over tokens, a linear head."""

    def __init__(self, num_outputs: int = NUM_CLASSES, tokens: int = 16, d_in: int = 16) -> None:
        super().__init__()
        d = 64
        self.embed = nn.Linear(d_in, d)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, d))
        self.blocks = nn.Sequential(TransformerBlock(d, 4), TransformerBlock(d, 4))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.embed(x) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


# ---------------------------------------------------------------------- models and cells
@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and its inputs.

    ``kind``: ``image`` (one ``(3, 32, 32)`` tensor per sample), ``tokens`` (``(16, 16)``), or
    ``levels`` (a list of ``(C_l, H_l, W_l)`` maps, ``levels(h, w)`` their shapes from the
    finest level's size). ``classifier``: the output is ``(B, classes)`` logits.
    """

    name: str
    build: Callable[[int], nn.Module]  # num_outputs -> model (built under a fixed seed)
    kind: str
    classifier: bool = True
    levels: Callable[[int, int], list[tuple[int, ...]]] | None = None
    uniform_hw: tuple[int, int] = (0, 0)
    ragged_hw: tuple[tuple[int, int], ...] = ()
    description: str = ""


def _half(n: int, k: int) -> int:
    return math.ceil(n / 2**k)


def _fisher_model(name: str) -> Callable[[int], nn.Module]:
    def build(num_outputs: int) -> nn.Module:
        if num_outputs != NUM_CLASSES:
            raise Skip(f"{name} is a {NUM_CLASSES}-class classifier")
        return build_fisher_model(name, 0)  # BatchNorm statistics set, eval mode

    return build


def _jacnorm_model(name: str) -> Callable[[int], nn.Module]:
    def build(num_outputs: int) -> nn.Module:
        if num_outputs != 1:
            raise Skip(f"{name} has one scalar output")
        return PlainCNN(JACNORM_WIDTHS[name], pool_every=1 if name == "cnn3" else 2)

    return build


def _no_outputs_arg(factory: Callable[[], nn.Module], what: str) -> Callable[[int], nn.Module]:
    def build(num_outputs: int) -> nn.Module:
        if num_outputs not in (0, NUM_CLASSES):
            raise Skip(f"{what} has a fixed dense output")
        return factory()

    return build


SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "vgg11_bn_q",
            _fisher_model("vgg11_bn_q"),
            "image",
            description="bench_fisher's CIFAR VGG11-BN, channels x 1/4 (eval mode)",
        ),
        ModelSpec(
            "resnet8",
            _fisher_model("resnet8"),
            "image",
            description="bench_fisher's CIFAR ResNet-8 (BatchNorm, eval mode)",
        ),
        ModelSpec(
            "cnn3",
            _jacnorm_model("cnn3"),
            "image",
            classifier=False,
            description="bench_jacnorm's 3-conv CNN (64/128/320), scalar head",
        ),
        ModelSpec(
            "cnn8",
            _jacnorm_model("cnn8"),
            "image",
            classifier=False,
            description="bench_jacnorm's 8-conv CNN (32..128), scalar head",
        ),
        ModelSpec(
            "tanh_cnn",
            StridedTanhCNN,
            "image",
            description="new: strided tanh CNN, 2048->256->out linear head",
        ),
        ModelSpec("gelu_cnn", GeluCNN, "image", description="new: 4-conv GELU CNN, avg pooling"),
        ModelSpec(
            "gn_dw",
            GroupNormDepthwise,
            "image",
            description="new: stem + 2 GroupNorm/depthwise-7x7 blocks (ConvNeXt-like)",
        ),
        ModelSpec(
            "transformer",
            TinyTransformer,
            "tokens",
            description="new: 2-block transformer over 16 tokens (SDPA, LayerNorm)",
        ),
        ModelSpec(
            "convblock",
            _no_outputs_arg(lambda: ConvBlock(in_ch=8, out_ch=8), "ConvBlock"),
            "levels",
            classifier=False,
            levels=lambda h, w: [(8, h, w), (8, h // 2 + 2, w // 2 + 2)],
            uniform_hw=(16, 16),
            ragged_hw=((16, 16), (14, 18), (18, 14), (12, 20)),
            description="multiscale_jac.models.ConvBlock(in_ch=8, out_ch=8), two levels",
        ),
        ModelSpec(
            "convblock_wide",
            _no_outputs_arg(lambda: ConvBlock(in_ch=32, out_ch=8), "ConvBlock"),
            "levels",
            classifier=False,
            levels=lambda h, w: [(32, h, w), (32, h - 10, w - 10)],
            uniform_hw=(24, 24),
            description="ConvBlock(in_ch=32, out_ch=8) on 24x24 and 14x14 (the README's)",
        ),
        ModelSpec(
            "tinyfpn",
            _no_outputs_arg(
                lambda: TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1),
                "TinyFPN",
            ),
            "levels",
            classifier=False,
            levels=lambda h, w: [(8, h, w), (16, _half(h, 1), _half(w, 1))],
            uniform_hw=(12, 12),
            ragged_hw=((12, 12), (12, 16), (16, 16), (20, 16)),
            description="TinyFPN(in_channels=(8, 16), width=16, num_outputs=4, extra_levels=1)",
        ),
        ModelSpec(
            "sharedfpn",
            _no_outputs_arg(
                lambda: SharedHeadFPN((8, 8, 8), width=8, num_outputs=4, depth=2), "SharedHeadFPN"
            ),
            "levels",
            classifier=False,
            levels=lambda h, w: [
                (8, h, w),
                (8, _half(h, 1), _half(w, 1)),
                (8, _half(h, 2), _half(w, 2)),
            ],
            uniform_hw=(12, 12),
            ragged_hw=((12, 12), (12, 16), (16, 12), (9, 16), (16, 9), (8, 16)),
            description="SharedHeadFPN((8, 8, 8), width=8, num_outputs=4, depth=2), map_levels head",
        ),
        ModelSpec(
            "det_head",
            _no_outputs_arg(lambda: DetectionHead(in_ch=8, num_classes=3), "DetectionHead"),
            "levels",
            classifier=False,
            levels=lambda h, w: [
                (8, h, w),
                (8, _half(h, 1), _half(w, 1)),
                (8, _half(h, 2), _half(w, 2)),
            ],
            uniform_hw=(12, 12),
            ragged_hw=((12, 12), (12, 16), (16, 12), (8, 16)),
            description="new: detection head (cls 3 + box 4) shared over 3 FPN levels, per-level outputs",
        ),
    )
}


def flat_out(out: Any) -> Tensor:
    """A model's output (a tensor, or a list/tuple/dict of them) as ``(B, O)``, leaf by leaf
    (the library's flattening)."""
    leaves = tree_leaves(out)
    return torch.cat([t.reshape(t.shape[0], -1) for t in leaves], 1)


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


@dataclass
class Cell:
    workload: str
    spec: ModelSpec
    model: nn.Module  # eval mode, on the device, in the cell's dtype
    batch: Batch
    subset: mj.ParamSubset
    device: torch.device
    dtype: torch.dtype
    ragged: bool
    names: list[str] = field(default_factory=list)
    num_params: int = 0
    cols: Tensor | None = None  # the subset's flat indices (None: all, in order)

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.spec.name}"

    @property
    def tensor_input(self) -> bool:
        return self.spec.kind != "levels"

    def model_input(self, levels: Sequence[Tensor]) -> Any:
        return levels[0] if self.tensor_input else list(levels)

    def forward(self, model: nn.Module, levels: Sequence[Tensor]) -> Tensor:
        """``(B, O)`` outputs of ``model`` on batched levels."""
        return flat_out(model(self.model_input(levels)))

    def params(self, model: nn.Module | None = None) -> dict[str, Tensor]:
        return {n: p.detach() for n, p in (model or self.model).named_parameters()}

    def sample_fn(self, model: nn.Module | None = None) -> Callable[..., Tensor]:
        """``f(params, *levels) -> (O,)`` for one unbatched sample (the torch.func peers)."""
        model = model or self.model

        def f(p: dict[str, Tensor], *levels: Tensor) -> Tensor:
            out = functional_call(model, p, (self.model_input([t.unsqueeze(0) for t in levels]),))
            return flat_out(out)[0]

        return f

    def flat(self, per_tensor: dict[str, Tensor], batch_dims: int = 0) -> Tensor:
        """Per-tensor ``(*batch, *shape)`` -> ``(*batch, P_total)`` in parameter order."""
        return torch.cat(
            [per_tensor[n].reshape(*per_tensor[n].shape[:batch_dims], -1) for n in self.names],
            -1,
        )

    def select(self, full: Tensor) -> Tensor:
        """``(..., P_total)`` -> the subset's columns."""
        return full if self.cols is None else full.index_select(-1, self.cols.to(full.device))

    def slice(self, k: int) -> Batch:
        """The first ``k`` samples as a batch of their own."""
        b = self.batch
        k = min(k, b.n)
        return make_batch(
            self, b.samples[:k], None if b.targets is None else b.targets[:k], b.out_sizes[:k]
        )


def num_outputs_for(workload: str, spec: ModelSpec) -> int:
    if workload == "jacnorm":
        return 1
    return NUM_CLASSES if spec.classifier else 0


def make_batch(
    cell: Cell, samples: list[list[Tensor]], targets: Tensor | None, out_sizes: list[int]
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
        inputs = only.levels[0] if cell.tensor_input else list(only.levels)
    return Batch(samples, buckets, inputs, targets, out_sizes)


def build_cell(
    workload: str,
    model_name: str,
    *,
    quick: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Cell:
    """The cell's model, batch and subset: deterministic in ``seed`` (every worker builds the
    same one; float64 is the float32 model converted)."""
    spec = SPECS[model_name]
    device = torch.device(device)
    torch.manual_seed(seed)
    model = spec.build(num_outputs_for(workload, spec)).eval()
    model = model.to(device=device, dtype=dtype)
    n = SIZES[workload][1 if quick else 0]
    ragged = workload == "ragged"
    if ragged and spec.kind != "levels":
        raise Skip(f"{model_name} takes one tensor, not a list of levels")
    g = torch.Generator().manual_seed(seed + 1)
    if spec.kind == "levels":
        assert spec.levels is not None
        if ragged:
            # sizes cycle through ragged_hw; the first samples have different sizes (the check
            # slice spans several buckets), the rest are shuffled (buckets not contiguous)
            rest = torch.randperm(n - CHECK_SAMPLES, generator=g) + CHECK_SAMPLES
            order = list(range(CHECK_SAMPLES)) + rest.tolist()
            hws = [spec.ragged_hw[order[i] % len(spec.ragged_hw)] for i in range(n)]
        else:
            hws = [spec.uniform_hw] * n
        samples = [[torch.randn(*shp, generator=g) for shp in spec.levels(*hw)] for hw in hws]
    elif spec.kind == "tokens":
        samples = [[torch.randn(16, 16, generator=g)] for _ in range(n)]
    else:
        samples = [[torch.randn(3, 32, 32, generator=g)] for _ in range(n)]
    samples = [[t.to(device=device, dtype=dtype) for t in s] for s in samples]
    targets = None
    if workload in ("fisher", "laplace") or (spec.classifier and workload != "jacnorm"):
        if not spec.classifier:
            raise Skip(f"{model_name} is not a classifier")
        targets = torch.randint(0, NUM_CLASSES, (n,), generator=g).to(device)
    cell = Cell(
        workload,
        spec,
        model,
        None,
        None,
        device,
        dtype,
        ragged,  # type: ignore[arg-type]
    )
    cell.names = [name for name, _ in model.named_parameters()]
    cell.num_params = sum(p.numel() for p in model.parameters())
    gs = torch.Generator().manual_seed(seed + 2)
    if workload in SUBSET_K:
        idx = torch.randperm(cell.num_params, generator=gs)[: SUBSET_K[workload]]
        cell.subset = mj.ParamSubset.from_flat_indices(model, idx)
        cell.cols = idx.to(device)
    else:
        cell.subset = mj.ParamSubset.all(model)
    out_sizes = []
    with torch.no_grad():
        for s in samples:
            out_sizes.append(cell.forward(model, [t.unsqueeze(0) for t in s]).shape[1])
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
        "O_mean": sum(b.out_sizes) / b.n,
        "P": cell.subset.numel,
        "params_total": cell.num_params,
        "shape_buckets": len(b.buckets),
        "input_shapes": sorted({str([tuple(t.shape) for t in s]) for s in b.samples}),
    }


# ---------------------------------------------------------------------- the training step
def loss_of(cell: Cell, out: Tensor, targets: Tensor | None) -> Tensor:
    """CrossEntropy (sum) for classifiers with labels, else half the sum of squared outputs."""
    if targets is not None:
        return F.cross_entropy(out, targets, reduction="sum")
    return 0.5 * out.pow(2).sum()


def prepare_train_step(cell: Cell) -> Callable[[Batch], None]:
    """Forward, loss, backward (one per shape bucket), SGD step, zero_grad on a train-mode
    copy of the model."""
    model = copy.deepcopy(cell.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(batch: Batch) -> None:
        for b in batch.buckets:
            out = cell.forward(model, b.levels)
            t = None if batch.targets is None else batch.targets[b.indices]
            loss_of(cell, out, t).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


# ---------------------------------------------------------------------- shared pieces
Run = Callable[[Batch], Any]  # a prepared method: a batch -> its result (see ``compare``)


def zeros_jacobian(cell: Cell, batch: Batch) -> Tensor:
    return torch.zeros(
        batch.n, batch.o_max, cell.subset.numel, dtype=cell.dtype, device=cell.device
    )


def ggn(jac: Tensor, logits: Tensor) -> Tensor:
    """``sum_i J_i^T (diag p_i - p_i p_i^T) J_i`` for ``J`` ``(N, C, K)``, logits ``(N, C)``."""
    p = logits.softmax(-1)
    jp = torch.einsum("nck,nc->nk", jac, p)
    return torch.einsum("nck,nc,ncl->kl", jac, p, jac) - jp.T @ jp


def activation_numels(cell: Cell) -> tuple[int, int]:
    """``(max, sum)`` of the leaf modules' output sizes on the largest sample (estimates)."""
    sizes: list[int] = []
    hooks = [
        m.register_forward_hook(
            lambda _m, _i, out: sizes.extend(t.numel() for t in tree_leaves(out))
        )
        for m in cell.model.modules()
        if not list(m.children())
    ]
    i = max(range(cell.batch.n), key=lambda k: cell.batch.out_sizes[k])
    try:
        with torch.no_grad():
            cell.forward(cell.model, [t.unsqueeze(0) for t in cell.batch.samples[i]])
    finally:
        for h in hooks:
            h.remove()
    return max(sizes, default=1), sum(sizes)


def lanes_estimate(cell: Cell, batch: Batch, lanes_per_sample: int | None = None) -> int:
    """Bytes of a vectorised backward with one lane per output row through a whole bucket
    (``autograd.functional.jacobian(vectorize=True)``, curvlinops' transposed Jacobian): about
    six of the largest layer's ``(lanes, N_b, ...)`` tensors at once (bench_fisher's measured
    rule) plus the ``(lanes, P)`` Jacobian three times."""
    act_max, _ = activation_numels(cell)
    item = torch.empty((), dtype=cell.dtype).element_size()
    worst = 0
    for b in batch.buckets:
        nb = len(b.indices)
        o = lanes_per_sample or batch.out_sizes[b.indices[0]]
        lanes = nb * o
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


def _backpack_model(cell: Cell, model: nn.Module) -> tuple[Any, nn.Module]:
    bp = _import("backpack", "BackPACK")
    return bp, bp.extend(copy.deepcopy(model))


def _clear_backpack(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
        for attr in ("grad_batch", "sum_grad_squared"):
            if hasattr(p, attr):
                delattr(p, attr)


def _opacus_module(model: nn.Module) -> tuple[nn.Module, list[nn.Parameter], str]:
    opacus = _import("opacus", "Opacus")
    note = "GradSampleModule(strict=True)"
    try:
        gsm = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    except Exception as e:  # BatchNorm etc. are refused for DP training; retry without checks
        first = f"{type(e).__name__}: {e}"[:200]
        gsm = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction="sum", strict=False)
        note = f"strict=True refused ({first}); ran with strict=False"
    return gsm, list(gsm._module.parameters()), note


def _grad_samples(params: list[nn.Parameter], nb: int) -> Tensor:
    missing = [k for k, p in enumerate(params) if getattr(p, "grad_sample", None) is None]
    if missing:
        raise RuntimeError(f"opacus left no grad_sample for {len(missing)} parameter tensor(s)")
    return torch.cat([p.grad_sample.reshape(nb, -1) for p in params], 1)


def _clear_opacus(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad_sample = None
        p.grad = None


class _Flat(nn.Module):
    """The model as curvlinops wants it: one tensor or a dict of levels in, ``(B, O)`` out."""

    def __init__(self, cell: Cell, model: nn.Module) -> None:
        super().__init__()
        self.cell, self.model = cell, model

    def forward(self, x: Any) -> Tensor:
        levels = [x] if self.cell.tensor_input else [x[str(k)] for k in range(len(x))]
        return self.cell.forward(self.model, levels)


def _curvlinops_data(cell: Cell, b: Bucket, targets: Tensor | None) -> tuple[Any, Any, Any]:
    x: Any = b.levels[0] if cell.tensor_input else {str(k): t for k, t in enumerate(b.levels)}
    y = targets if targets is not None else torch.zeros(len(b.indices), device=cell.device)
    size = (lambda v: v.shape[0]) if cell.tensor_input else (lambda v: v["0"].shape[0])
    return x, y, size


# ---------------------------------------------------------------------- Jacobian workloads
def jac_loop_func(cell: Cell, model: nn.Module) -> Run:
    f, params = cell.sample_fn(model), cell.params(model)
    jf = jacrev(f)

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for i, s in enumerate(batch.samples):
            out[i, : batch.out_sizes[i]] = cell.select(cell.flat(jf(params, *s), 1))
        return out

    return run


def _chunk_for(cell: Cell, o: int) -> int:
    item = torch.empty((), dtype=cell.dtype).element_size()
    return max(1, min(VMAP_CHUNK, CHUNK_BYTES // max(1, o * cell.num_params * item)))


def jac_vmap_chunks(cell: Cell, model: nn.Module) -> Run:
    f, params = cell.sample_fn(model), cell.params(model)

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for b in batch.buckets:
            o = batch.out_sizes[b.indices[0]]
            vf = vmap(jacrev(f), in_dims=(None, *[0] * len(b.levels)))
            c = _chunk_for(cell, o)
            for s in range(0, len(b.indices), c):
                jac = vf(params, *[t[s : s + c] for t in b.levels])
                out[b.indices[s : s + c], :o] = cell.select(cell.flat(jac, 2))
        return out

    return run


def jac_autograd(cell: Cell, model: nn.Module) -> Run:
    g = functional_forward(cell, model)
    ps = tuple(p.detach() for p in model.parameters())

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            jac = torch.autograd.functional.jacobian(
                lambda *q, lv=b.levels: g(q, lv).reshape(-1), ps, vectorize=True
            )
            full = torch.cat([j.reshape(nb * o, -1) for j in jac], 1).reshape(nb, o, -1)
            out[b.indices, :o] = cell.select(full)
        return out

    return run


def jac_backpack(cell: Cell, model: nn.Module) -> Run:
    bp, ext = _backpack_model(cell, model)
    from backpack.extensions import BatchGrad

    params = list(ext.parameters())

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            y = cell.forward(ext, b.levels)
            for r in range(o):
                keep = r < o - 1  # BackPACK frees the stored module IO unless told not to
                with bp.backpack(BatchGrad(), retain_graph=keep):
                    y[:, r].sum().backward(retain_graph=keep)
                g = torch.cat([p.grad_batch.reshape(nb, -1) for p in params], 1)
                out[b.indices, r] = cell.select(g)
                _clear_backpack(ext)
        return out

    return run


def jac_opacus(cell: Cell, model: nn.Module) -> Run:
    gsm, params, _ = _opacus_module(model)

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            for r in range(o):  # opacus pops its activations in backward: a forward per row
                _clear_opacus(params)
                cell.forward(gsm, b.levels)[:, r].sum().backward()
                out[b.indices, r] = cell.select(_grad_samples(params, nb))
        _clear_opacus(params)
        return out

    return run


def jac_curvlinops(cell: Cell, model: nn.Module) -> Run:
    cl = _import("curvlinops", "curvlinops")
    wrapped = _Flat(cell, model)
    params = list(wrapped.parameters())

    def run(batch: Batch) -> Tensor:
        out = zeros_jacobian(cell, batch)
        for b in batch.buckets:
            nb, o = len(b.indices), batch.out_sizes[b.indices[0]]
            x, y, size = _curvlinops_data(cell, b, None)
            kw = {"check_deterministic": False, "num_data": nb, "batch_size_fn": size}
            if cell.cols is not None:  # J @ one-hot columns of the subset (forward mode)
                op = cl.JacobianLinearOperator(wrapped, params, [(x, y)], **kw)
                e = torch.zeros(
                    cell.num_params, len(cell.cols), dtype=cell.dtype, device=cell.device
                )
                e[cell.cols, torch.arange(len(cell.cols), device=cell.device)] = 1
                out[b.indices, :o] = (op @ e).reshape(nb, o, -1)
            else:  # J^T @ identity (one vector-Jacobian product per output row)
                op = cl.TransposedJacobianLinearOperator(wrapped, params, [(x, y)], **kw)
                eye = torch.eye(nb * o, dtype=cell.dtype, device=cell.device)
                out[b.indices, :o] = (op @ eye).T.reshape(nb, o, -1)
        return out

    return run


def jac_library(
    strategy: str | None = None, mode: str | None = None, entries: str | None = None
) -> Callable[[Cell, nn.Module], Run]:
    """``per_sample_jacobian`` with defaults (all None), or a forced route (``strict=True``)."""
    kw: dict[str, Any] = {}
    if strategy is not None:
        kw = {"strategy": strategy, "mode": mode, "strict": True}
        if entries is not None:
            kw["entries"] = entries

    def prep(cell: Cell, model: nn.Module) -> Run:
        if strategy == "vmap" and cell.ragged:
            raise Skip("strategy='vmap' needs one shape signature (a ragged batch has several)")
        params = {} if cell.cols is None else {"params": cell.subset}

        def run(batch: Batch) -> Any:
            res = mj.per_sample_jacobian(model, batch.inputs, **params, **kw)
            return LibraryResult(res.jacobian, _jacobian_info(res))

        return run

    return prep


@dataclass
class LibraryResult:
    value: Any
    info: dict[str, Any]


def _jacobian_info(res: Any) -> dict[str, Any]:
    info = {
        "strategy": str(res.strategy),
        "mode": str(res.mode),
        "structured": list(getattr(res, "structured", ()) or ()),
        "chunk_size": getattr(res, "chunk_size", None),
    }
    if getattr(res, "fallback", None):
        info["fallback"] = str(res.fallback)
    notes = [str(n) for n in getattr(res, "notes", ()) or ()]
    if notes:
        info["notes"] = [n[:200] for n in notes[:6]]
    return info


# ---------------------------------------------------------------------- the Fisher
def _log_lik_sum(cell: Cell, model: nn.Module) -> Callable[..., Tensor]:
    g = functional_forward(cell, model)

    def nll(ps: Sequence[Tensor], levels: Sequence[Tensor], y: Tensor) -> Tensor:
        return F.cross_entropy(g(ps, levels), y, reduction="sum")

    return nll


def fisher_loop_func(cell: Cell, model: nn.Module) -> Run:
    f, params = cell.sample_fn(model), cell.params(model)

    def nll(p: dict[str, Tensor], y: Tensor, *levels: Tensor) -> Tensor:
        return F.cross_entropy(f(p, *levels).unsqueeze(0), y.unsqueeze(0), reduction="sum")

    gf = grad(nll)

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for i, s in enumerate(batch.samples):
            acc += cell.flat(gf(params, batch.targets[i], *s)) ** 2
        return acc / batch.n

    return run


def fisher_vmap_chunks(cell: Cell, model: nn.Module) -> Run:
    f, params = cell.sample_fn(model), cell.params(model)

    def nll(p: dict[str, Tensor], y: Tensor, *levels: Tensor) -> Tensor:
        return F.cross_entropy(f(p, *levels).unsqueeze(0), y.unsqueeze(0), reduction="sum")

    def run(batch: Batch) -> Tensor:
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for b in batch.buckets:
            vf = vmap(grad(nll), in_dims=(None, 0, *[0] * len(b.levels)))
            y = batch.targets[b.indices]
            for s in range(0, len(b.indices), FISHER_VMAP_CHUNK):
                sl = slice(s, s + FISHER_VMAP_CHUNK)
                for n, t in vf(params, y[sl], *[t[sl] for t in b.levels]).items():
                    acc[n] += (t**2).sum(0)
        return cell.flat(acc) / batch.n

    return run


def fisher_autograd(cell: Cell, model: nn.Module) -> Run:
    """The EWC code users write: the Jacobian of the (N,) log-likelihoods (bench_fisher's)."""
    g = functional_forward(cell, model)
    ps = tuple(p.detach() for p in model.parameters())

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for b in batch.buckets:
            y = batch.targets[b.indices]

            def loglik(*q: Tensor, lv: list[Tensor] = b.levels, y: Tensor = y) -> Tensor:
                return torch.log_softmax(g(q, lv), 1).gather(1, y.unsqueeze(1)).squeeze(1)

            jac = torch.autograd.functional.jacobian(loglik, ps, vectorize=True)
            acc += torch.cat([(j**2).sum(0).reshape(-1) for j in jac])
        return acc / batch.n

    return run


def fisher_backpack(cell: Cell, model: nn.Module) -> Run:
    bp, ext = _backpack_model(cell, model)
    from backpack.extensions import SumGradSquared

    lossfunc = bp.extend(nn.CrossEntropyLoss(reduction="sum"))
    params = list(ext.parameters())

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for b in batch.buckets:
            loss = lossfunc(cell.forward(ext, b.levels), batch.targets[b.indices])
            with bp.backpack(SumGradSquared()):
                loss.backward()
            acc += torch.cat([p.sum_grad_squared.reshape(-1) for p in params])
            _clear_backpack(ext)
        return acc / batch.n

    return run


def fisher_opacus(cell: Cell, model: nn.Module) -> Run:
    gsm, params, _ = _opacus_module(model)

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for b in batch.buckets:
            _clear_opacus(params)
            out = cell.forward(gsm, b.levels)
            F.cross_entropy(out, batch.targets[b.indices], reduction="sum").backward()
            acc += (_grad_samples(params, len(b.indices)) ** 2).sum(0)
        _clear_opacus(params)
        return acc / batch.n

    return run


def fisher_library(method: str | None = None) -> Callable[[Cell, nn.Module], Run]:
    kw: dict[str, Any] = {} if method is None else {"method": method, "strict": True}

    def prep(cell: Cell, model: nn.Module) -> Run:
        def run(batch: Batch) -> Any:
            res = mj.diag_fisher(model, [(batch.inputs, batch.targets)], **kw)
            return LibraryResult(
                res.flat,
                {"method": str(res.method), "plan": _count(res.plan), "notes": list(res.notes)[:4]},
            )

        return run

    return prep


def _count(plan: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in (plan or {}).values():
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


# ---------------------------------------------------------------------- Jacobian norm
def _scalar_fn(cell: Cell, model: nn.Module) -> Callable[..., Tensor]:
    f = cell.sample_fn(model)
    return lambda p, *levels: f(p, *levels).sum()  # one output per sample


def jacnorm_loop_func(cell: Cell, model: nn.Module) -> Run:
    f, params = cell.sample_fn(model), cell.params(model)

    def sq_norm(p: dict[str, Tensor], *levels: Tensor) -> Tensor:
        return sum((j**2).sum() for j in jacrev(f)(p, *levels).values())

    gf = grad(sq_norm)

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for s in batch.samples:
            acc += cell.flat(gf(params, *s))
        return acc

    return run


def jacnorm_vmap_double_bwd(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``vmap_grad_chunks``: grad of the squared norm of ``vmap(grad)``."""
    fs, params = _scalar_fn(cell, model), cell.params(model)

    def run(batch: Batch) -> Tensor:
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for b in batch.buckets:
            per_sample = vmap(grad(fs), in_dims=(None, *[0] * len(b.levels)))

            def sq_norm(p: dict[str, Tensor], *lv: Tensor, ps: Any = per_sample) -> Tensor:
                return sum((g**2).sum() for g in ps(p, *lv).values())

            for s in range(0, len(b.indices), VMAP_CHUNK):
                chunk = [t[s : s + VMAP_CHUNK] for t in b.levels]
                for n, g in grad(sq_norm)(params, *chunk).items():
                    acc[n] += g
        return cell.flat(acc)

    return run


def jacnorm_fwd_over_rev(cell: Cell, model: nn.Module) -> Run:
    """bench_jacnorm's ``fwd_over_rev``: ``2 sum_i H_i g_i`` with ``jvp`` of ``grad``."""
    fs, params = _scalar_fn(cell, model), cell.params(model)
    g_single = grad(fs)

    def run(batch: Batch) -> Tensor:
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for b in batch.buckets:
            dims = (None, *[0] * len(b.levels))

            def hvp(gi: dict[str, Tensor], *lv: Tensor) -> dict[str, Tensor]:
                return jvp(lambda p: g_single(p, *lv), (params,), (gi,))[1]

            for s in range(0, len(b.indices), VMAP_CHUNK):
                chunk = [t[s : s + VMAP_CHUNK] for t in b.levels]
                gs = vmap(g_single, in_dims=dims)(params, *chunk)
                for n, h in vmap(hvp)(gs, *chunk).items():
                    acc[n] += 2 * h.sum(0)
        return cell.flat(acc)

    return run


def jacnorm_autograd(cell: Cell, model: nn.Module) -> Run:
    g = functional_forward(cell, model)
    ps = tuple(p.detach() for p in model.parameters())

    def run(batch: Batch) -> Tensor:
        acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
        for b in batch.buckets:
            leaves = tuple(p.clone().requires_grad_(True) for p in ps)
            jac = torch.autograd.functional.jacobian(
                lambda *q, lv=b.levels: g(q, lv).reshape(-1),
                leaves,
                vectorize=True,
                create_graph=True,
            )
            s = sum((j**2).sum() for j in jac)
            gs = torch.autograd.grad(s, leaves, allow_unused=True)
            acc += torch.cat(
                [(torch.zeros_like(p) if h is None else h).reshape(-1) for p, h in zip(ps, gs)]
            )
        return acc

    return run


def jacnorm_library(method: str | None = None) -> Callable[[Cell, nn.Module], Run]:
    kw: dict[str, Any] = {} if method is None else {"method": method, "strict": True}

    def prep(cell: Cell, model: nn.Module) -> Run:
        params = list(model.parameters())

        def run(batch: Batch) -> Any:
            model.zero_grad(set_to_none=True)
            mj.jacobian_sq_norm(model, batch.inputs, **kw).backward()
            out = torch.cat(
                [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
            )
            model.zero_grad(set_to_none=True)
            return out

        return run

    return prep


# ---------------------------------------------------------------------- subnetwork Laplace
def _logits(cell: Cell, model: nn.Module, batch: Batch) -> Tensor:
    out = torch.zeros(batch.n, batch.o_max, dtype=cell.dtype, device=cell.device)
    with torch.no_grad():
        for b in batch.buckets:
            out[b.indices] = cell.forward(model, b.levels)
    return out


def laplace_from(jac_prep: Callable[[Cell, nn.Module], Run]) -> Callable[[Cell, nn.Module], Run]:
    """A Jacobian peer followed by what a user adds for the subset GGN: the forward's logits
    and ``sum_i J_i^T (diag p_i - p_i p_i^T) J_i``."""

    def prep(cell: Cell, model: nn.Module) -> Run:
        jac_run = jac_prep(cell, model)

        def run(batch: Batch) -> Tensor:
            return ggn(jac_run(batch), _logits(cell, model, batch))

        return run

    return prep


def laplace_curvlinops(cell: Cell, model: nn.Module) -> Run:
    cl = _import("curvlinops", "curvlinops")
    wrapped = _Flat(cell, model)
    params = list(wrapped.parameters())
    idx = [int(i) for i in cell.cols.tolist()]  # type: ignore[union-attr]
    eye = torch.eye(len(idx), dtype=cell.dtype, device=cell.device)

    def run(batch: Batch) -> Tensor:
        (b,) = batch.buckets
        x, y, size = _curvlinops_data(cell, b, batch.targets)
        op = cl.GGNLinearOperator(
            wrapped,
            nn.CrossEntropyLoss(reduction="sum"),
            params,
            [(x, y)],
            check_deterministic=False,
            num_data=batch.n,
            batch_size_fn=size,
        )
        return cl.SubmatrixLinearOperator(op, idx, idx) @ eye

    return run


def laplace_library(entries: str | None = None) -> Callable[[Cell, nn.Module], Run]:
    kw: dict[str, Any] = {} if entries is None else {"entries": entries, "strict": True}

    def prep(cell: Cell, model: nn.Module) -> Run:
        def run(batch: Batch) -> Any:
            la = mj.SubnetLaplace(model, "classification", cell.subset, **kw)
            la.fit([(batch.inputs, batch.targets)])
            return la.H

        return run

    return prep


# ---------------------------------------------------------------------- the method registry
@dataclass(frozen=True)
class Method:
    """One method of a cell. ``kind``: ``train``, ``peer`` (what a user writes or another
    library), ``library`` (auto) or ``route`` (a forced library route)."""

    name: str
    kind: str
    what: str
    prepare: Callable[[Cell, nn.Module], Run] | None = None
    estimate: Callable[[Cell, Batch], int] | None = None  # bytes; not run above --max-gb
    scaling: float = 1.0  # time grows as N ** scaling (the slice-based estimate)
    not_applicable: str | None = None

    @property
    def is_library(self) -> bool:
        return self.kind in ("library", "route")


JACOBIAN_LIKE = ("jacobian", "ragged", "subset")


def _jacnorm_estimate(cell: Cell, batch: Batch) -> int:
    _, act_sum = activation_numels(cell)
    item = torch.empty((), dtype=cell.dtype).element_size()
    n = max(len(b.indices) for b in batch.buckets)
    return n * n * act_sum * item * 2 + n * cell.num_params * item * 3


def methods_for(workload: str) -> list[Method]:
    """Every method of a workload, in the order they are timed (peers before the library)."""
    train = Method("train_step", "train", "forward, loss, backward, SGD step (train-mode copy)")
    na_second = "no per-sample second derivatives (the regulariser's gradient needs them)"
    if workload in JACOBIAN_LIKE:
        subset = workload == "subset"
        sel = ", then the subset's columns" if subset else ""
        ms = [
            Method("loop_func", "peer", f"per-sample torch.func.jacrev loop{sel}", jac_loop_func),
            Method(
                "vmap_chunks",
                "peer",
                f"vmap(jacrev) in chunks of <= {VMAP_CHUNK} per shape bucket{sel}",
                jac_vmap_chunks,
            ),
            Method(
                "autograd_jacobian",
                "peer",
                f"torch.autograd.functional.jacobian(vectorize=True) per shape bucket{sel}",
                jac_autograd,
                estimate=lanes_estimate,
                scaling=2.0,
            ),
            Method(
                "backpack",
                "peer",
                f"BackPACK BatchGrad, a backward per output row{sel}",
                jac_backpack,
            ),
            Method(
                "opacus", "peer", f"Opacus GradSampleModule, a pass per output row{sel}", jac_opacus
            ),
            Method(
                "curvlinops",
                "peer",
                "curvlinops JacobianLinearOperator @ one-hot columns of the subset"
                if subset
                else "curvlinops TransposedJacobianLinearOperator @ identity, per shape bucket",
                jac_curvlinops,
                estimate=None if subset else lanes_estimate,
                scaling=1.0 if subset else 2.0,
            ),
            Method(
                "library_auto", "library", "mj.per_sample_jacobian with defaults", jac_library()
            ),
        ]
        for s in ("vmap", "bucketed", "padded"):
            for m in ("rev", "fwd"):
                for e in ("structured", "generic") if subset else (None,):
                    name = f"library_{s}_{m}" + (f"_{e}" if e else "")
                    what = f"strategy={s}, mode={m}" + (f", entries={e}" if e else "")
                    ms.append(Method(name, "route", what + ", strict=True", jac_library(s, m, e)))
        return [train, *ms]
    if workload == "fisher":
        ms = [
            Method(
                "loop_func",
                "peer",
                "per-sample torch.func.grad loop, squared, summed",
                fisher_loop_func,
            ),
            Method(
                "vmap_chunks",
                "peer",
                f"vmap(grad) in chunks of {FISHER_VMAP_CHUNK}",
                fisher_vmap_chunks,
            ),
            Method(
                "autograd_jacobian",
                "peer",
                "torch.autograd.functional.jacobian(vectorize=True) of the N log-likelihoods "
                "(the EWC code users write)",
                fisher_autograd,
                estimate=lambda c, b: lanes_estimate(c, b, 1),
                scaling=2.0,
            ),
            Method("backpack", "peer", "BackPACK SumGradSquared", fisher_backpack),
            Method(
                "opacus",
                "peer",
                "Opacus GradSampleModule, per-sample gradients squared",
                fisher_opacus,
            ),
            Method(
                "curvlinops",
                "peer",
                "",
                not_applicable=(
                    "curvlinops has no exact diagonal (only Hutchinson estimates, or P matvecs)"
                ),
            ),
            Method("library_auto", "library", "mj.diag_fisher with defaults", fisher_library()),
            Method(
                "library_layerwise",
                "route",
                "method=layerwise, strict=True",
                fisher_library("layerwise"),
            ),
            Method("library_vmap", "route", "method=vmap, strict=True", fisher_library("vmap")),
        ]
        return [train, *ms]
    if workload == "jacnorm":
        ms = [
            Method(
                "loop_func",
                "peer",
                "per sample: torch.func.grad of ||jacrev||^2",
                jacnorm_loop_func,
            ),
            Method(
                "vmap_double_bwd",
                "peer",
                f"grad of the squared norm of vmap(grad), {VMAP_CHUNK} samples a chunk",
                jacnorm_vmap_double_bwd,
            ),
            Method(
                "fwd_over_rev",
                "peer",
                f"vmap(grad), then 2 sum_i H_i g_i by jvp of grad, {VMAP_CHUNK} a chunk",
                jacnorm_fwd_over_rev,
            ),
            Method(
                "autograd_jacobian",
                "peer",
                "torch.autograd.functional.jacobian(vectorize=True, create_graph=True), "
                "squared sum, autograd.grad",
                jacnorm_autograd,
                estimate=_jacnorm_estimate,
                scaling=2.0,
            ),
            Method("backpack", "peer", "", not_applicable=f"BackPACK: {na_second}"),
            Method("opacus", "peer", "", not_applicable=f"Opacus: {na_second}"),
            Method(
                "curvlinops",
                "peer",
                "",
                not_applicable=(
                    "curvlinops: operators of one batch, no per-sample Jacobian norm gradient"
                ),
            ),
            Method(
                "library_auto",
                "library",
                "mj.jacobian_sq_norm(model, x).backward()",
                jacnorm_library(),
            ),
        ]
        for m in mj.JacNormMethod:  # read at run time: members may be added
            if m.value != "auto":
                ms.append(
                    Method(
                        f"library_{m.value}",
                        "route",
                        f"method={m.value}, strict=True",
                        jacnorm_library(m.value),
                    )
                )
        return [train, *ms]
    if workload == "laplace":
        then = ", the subset's columns, J^T Lambda J"
        ms = [
            Method(
                "loop_func",
                "peer",
                f"per-sample torch.func.jacrev loop{then}",
                laplace_from(jac_loop_func),
            ),
            Method(
                "vmap_chunks",
                "peer",
                f"vmap(jacrev) in chunks{then}",
                laplace_from(jac_vmap_chunks),
            ),
            Method(
                "autograd_jacobian",
                "peer",
                f"torch.autograd.functional.jacobian(vectorize=True){then}",
                laplace_from(jac_autograd),
                estimate=lanes_estimate,
                scaling=2.0,
            ),
            Method(
                "backpack",
                "peer",
                f"BackPACK BatchGrad per class{then}",
                laplace_from(jac_backpack),
            ),
            Method(
                "opacus",
                "peer",
                f"Opacus GradSampleModule per class{then}",
                laplace_from(jac_opacus),
            ),
            Method(
                "curvlinops",
                "peer",
                "curvlinops GGNLinearOperator (CrossEntropyLoss sum), its subset submatrix "
                "@ identity",
                laplace_curvlinops,
            ),
            Method(
                "library_auto",
                "library",
                "mj.SubnetLaplace(model, 'classification', subset).fit(data)",
                laplace_library(),
            ),
            Method(
                "library_structured",
                "route",
                "entries=structured, strict=True",
                laplace_library("structured"),
            ),
            Method(
                "library_generic",
                "route",
                "entries=generic, strict=True",
                laplace_library("generic"),
            ),
        ]
        return [train, *ms]
    raise ValueError(f"unknown workload {workload!r}")


# ---------------------------------------------------------------------- the float64 reference
def reference(cell: Cell, batch: Batch) -> Tensor:
    """Plain autograd, one sample and one output row at a time (independent of every method)."""
    params = list(cell.model.parameters())

    def flat_grads(gs: Sequence[Tensor | None]) -> Tensor:
        return torch.cat(
            [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, gs)]
        )

    if cell.workload in JACOBIAN_LIKE or cell.workload == "laplace":
        out = zeros_jacobian(cell, batch)
        logits = torch.zeros(batch.n, batch.o_max, dtype=cell.dtype, device=cell.device)
        for i, s in enumerate(batch.samples):
            y = cell.forward(cell.model, [t.unsqueeze(0) for t in s])[0]
            logits[i, : y.numel()] = y.detach()
            for r in range(y.numel()):
                gs = torch.autograd.grad(y[r], params, retain_graph=True, allow_unused=True)
                out[i, r] = cell.select(flat_grads(gs))
        return ggn(out, logits) if cell.workload == "laplace" else out
    acc = torch.zeros(cell.num_params, dtype=cell.dtype, device=cell.device)
    for i, s in enumerate(batch.samples):
        y = cell.forward(cell.model, [t.unsqueeze(0) for t in s])[0]
        if cell.workload == "fisher":
            logp = torch.log_softmax(y, 0)[batch.targets[i]]
            acc += flat_grads(torch.autograd.grad(logp, params)) ** 2
        else:  # jacnorm: grad of sum_o ||d y_o / d theta||^2
            for r in range(y.numel()):
                gs = torch.autograd.grad(y[r], params, create_graph=True, allow_unused=True)
                sq = sum((g**2).sum() for g in gs if g is not None)
                acc += flat_grads(
                    torch.autograd.grad(sq, params, retain_graph=True, allow_unused=True)
                )
    return acc / batch.n if cell.workload == "fisher" else acc


def value_of(result: Any) -> Tensor:
    return result.value if isinstance(result, LibraryResult) else result


def compare(result: Any, ref: Tensor) -> dict[str, Any]:
    a = value_of(result).detach()
    if tuple(a.shape) != tuple(ref.shape):
        return {"mismatch": f"shape {tuple(a.shape)} vs reference {tuple(ref.shape)}"}
    diff = float((a.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    return {"max_abs_diff": diff, "rel_diff": diff / scale if scale > 0 else diff}


# ---------------------------------------------------------------------- timing (one cell)
def log(msg: str) -> None:
    """Progress to stderr (a worker's stdout carries its JSON)."""
    print(msg, file=sys.stderr, flush=True)


def timed_once(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


class TimeLimit(Exception):
    """Raised inside a call that ran past its time limit (``time_limit``)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TimeLimit` in this (main) thread after ``seconds`` (SIGALRM; between two
    Python-level steps of the call, so a long single kernel finishes first)."""
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(_sig: int, _frame: Any) -> None:
        raise TimeLimit(f"ran past {seconds:.3g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def time_callable(
    fn: Callable[[], Any], *, threads: int, min_run_time: float, warm_s: float
) -> dict[str, Any]:
    """``torch.utils.benchmark.Timer``: ``blocked_autorange(min_run_time)``, or, for a call
    that alone takes ``min_run_time`` or more, up to three single runs (``timeit(1)``) until
    they add up to it; the median."""
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads, label="bench_peers")
    if warm_s >= min_run_time:
        times: list[float] = []
        while len(times) < 3 and (not times or sum(times) < min_run_time):
            times.append(timer.timeit(1).median)
        return {
            "seconds": statistics.median(times),
            "timing": f"Timer.timeit(1) x {len(times)} (one call >= min_run_time), median",
            "timed_calls": len(times),
            "times": times,
        }
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {
        "seconds": m.median,
        "timing": f"Timer.blocked_autorange(min_run_time={min_run_time:g}), median per call",
        "timed_calls": len(m.raw_times) * m.number_per_run,
        "number_per_block": m.number_per_run,
        "iqr": m.iqr,
    }


@dataclass
class Settings:
    quick: bool
    device: torch.device
    threads: int
    min_run_time: float
    method_limit: float
    max_gb: float
    check_tol: float
    f32_tol: float
    check_limit: float
    seed: int
    methods: list[str] | None = None  # None: all

    def wants(self, name: str) -> bool:
        return name == "train_step" or self.methods is None or name in self.methods


def bench_method(cell: Cell, m: Method, st: Settings, baseline: dict[str, Any]) -> dict[str, Any]:
    """Warm-up on a slice (its time scaled to the batch decides whether to go on), the first
    call on the batch (a fresh model copy for the library), then the Timer."""
    rec: dict[str, Any] = {"method": m.name, "kind": m.kind, "what": m.what}
    if m.not_applicable:
        rec["skipped"] = f"not applicable: {m.not_applicable}"
        return rec
    batch = cell.batch
    if m.estimate is not None:
        est = m.estimate(cell, batch)
        rec["estimated_bytes"] = est
        if est > st.max_gb * 2**30:
            rec["skipped"] = f"not run: estimated {est / 2**30:.1f} GiB > --max-gb {st.max_gb:g}"
            return rec
    k = CHECK_SAMPLES if cell.ragged else CHECK_SAMPLES - 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = (lambda: copy.deepcopy(cell.model)) if m.is_library else (lambda: cell.model)
            assert m.prepare is not None
            run = m.prepare(cell, fresh())
            small = cell.slice(k)
            scale = (batch.n / small.n) ** m.scaling
            try:
                with time_limit(st.method_limit / scale):
                    t_small, _ = timed_once(lambda: run(small), st.device)
            except TimeLimit:
                rec["skipped"] = (
                    f"not run: more than {st.method_limit / scale:.3g} s on {small.n} samples "
                    f"(suggests > --method-limit {st.method_limit:g} s on {batch.n})"
                )
                return rec
            est_s = t_small * scale
            rec["slice_seconds"] = t_small
            if est_s > st.method_limit:
                rec["skipped"] = (
                    f"not run: {t_small:.2f} s on {small.n} samples suggests {est_s:.0f} s on "
                    f"{batch.n} > --method-limit {st.method_limit:g}"
                )
                return rec
            if m.is_library:  # a fresh copy: the first call plans with a cold cache
                run = m.prepare(cell, fresh())
            t_first, res = timed_once(lambda: run(batch), st.device)
            rec["first_call_seconds" if m.is_library else "warmup_seconds"] = t_first
            if isinstance(res, LibraryResult):
                rec["library"] = res.info
            value = value_of(res).detach()
            del res
            if m.kind != "train":
                if "value" not in baseline:
                    baseline.update(value=value, method=m.name)
                    rec["float32_baseline"] = True
                else:
                    d = compare(value, baseline["value"])
                    rec["float32_vs"] = baseline["method"]
                    rec["float32_max_abs_diff"] = d.get("max_abs_diff")
                    rec["float32_rel_diff"] = d.get("rel_diff")
                    if "mismatch" in d:
                        rec["float32_mismatch"] = d["mismatch"]
            del value
            rec.update(
                time_callable(
                    lambda: run(batch),
                    threads=st.threads,
                    min_run_time=st.min_run_time,
                    warm_s=t_first,
                )
            )
    except Skip as e:
        rec["skipped"] = f"not applicable: {e}"
    except Exception as e:
        rec["error"] = _error(e)
    return rec


def _error(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = tb[-1] if tb else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return f"{type(e).__name__}: {e}"[:600] + at


def check_methods(
    workload: str,
    model_name: str,
    methods: Sequence[Method],
    st: Settings,
    verbose: bool = False,
    limits: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every method on a float64 slice of the cell against :func:`reference` (each under
    ``limits[name]`` seconds, default ``--check-limit``)."""
    limits = limits or {}
    cell = build_cell(
        workload, model_name, quick=st.quick, device=st.device, dtype=torch.float64, seed=st.seed
    )
    k = CHECK_SAMPLES if cell.ragged else CHECK_SAMPLES - 1
    batch = cell.slice(k)
    t0 = time.perf_counter()
    ref = reference(cell, batch)
    meta = {
        "reference": "plain autograd.grad, one sample and one output row at a time, float64",
        "samples": batch.n,
        "reference_seconds": time.perf_counter() - t0,
        "reference_max_abs": float(ref.abs().max()),
        "tol": st.check_tol,
    }
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        if m.kind == "train" or m.prepare is None:
            continue
        row: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = copy.deepcopy(cell.model) if m.is_library else cell.model
                with time_limit(limits.get(m.name, st.check_limit)):
                    row.update(compare(m.prepare(cell, model)(batch), ref))
        except Skip as e:
            row["skipped"] = str(e)
        except TimeLimit as e:
            row["skipped"] = f"not checked: {e} (--check-limit)"
        except Exception as e:
            row["error"] = _error(e)
        if "rel_diff" in row:
            row["ok"] = row["rel_diff"] <= st.check_tol
        row["seconds_in_check"] = round(time.perf_counter() - t0, 3)
        if verbose:
            log(f"  check {cell.name} {m.name}: {row}")
        out[m.name] = row
    return meta, out


def cell_worker(args: argparse.Namespace) -> int:
    """Time every method of one cell in this process; print the cell's record as JSON."""
    st = settings(args)
    workload, model_name = args.worker_cell
    torch.set_num_threads(st.threads)
    cell = build_cell(workload, model_name, quick=st.quick, device=st.device, seed=st.seed)
    rec: dict[str, Any] = {"name": f"{workload}/{model_name}", **cell_summary(cell)}
    methods = [m for m in methods_for(workload) if st.wants(m.name)]
    train = Method("train_step", "train", "", prepare=lambda c, _m: prepare_train_step(c))
    train_start = bench_method(cell, train, st, {})
    log(
        f"[{rec['name']}] N={rec['N']} O={rec['O']} P={rec['P']}: training step "
        f"{train_start.get('seconds', float('nan')):.4f} s"
    )
    baseline: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    for m in methods:
        if m.kind == "train":
            results[m.name] = {**train_start, "what": m.what}
            continue
        r = bench_method(cell, m, st, baseline)
        results[m.name] = r
        log(f"[{rec['name']}] {m.name}: " + _short(r))
    baseline.clear()
    train_end = bench_method(cell, train, st, {})
    step = [t["seconds"] for t in (train_start, train_end) if "seconds" in t]
    rec["train_step_seconds"] = sum(step) / len(step) if step else None
    rec["train_step_seconds_start_end"] = step
    del cell
    ran = [m for m in methods if "seconds" in results[m.name] and m.kind != "train"]
    try:
        limits = {
            m.name: max(st.check_limit, 4 * results[m.name].get("slice_seconds", 0.0)) for m in ran
        }
        meta, checks = check_methods(workload, model_name, ran, st, limits=limits)
    except Exception as e:
        meta, checks = {"error": _error(e)}, {}
    rec["check"] = meta
    base_ok = True
    for name, r in results.items():
        if name in checks:
            c = checks[name]
            r["checked"] = c.get("max_abs_diff")
            r["checked_rel"] = c.get("rel_diff")
            r["check_ok"] = c.get("ok", False)
            if "ok" not in c:
                r["check_error"] = c.get("error") or c.get("skipped") or c.get("mismatch")
            if r.get("float32_baseline"):
                base_ok = r["check_ok"]
    for r in results.values():
        if "seconds" not in r:
            continue
        if rec["train_step_seconds"]:
            r["ratio_to_train_step"] = r["seconds"] / rec["train_step_seconds"]
        if r["kind"] == "train":
            continue
        f32 = r.get("float32_rel_diff")
        f32_ok = r.get("float32_baseline") or not base_ok or (f32 is not None and f32 <= st.f32_tol)
        r["valid"] = bool(r.get("check_ok")) and bool(f32_ok)
    rec["methods"] = results
    print(json.dumps(rec, default=str))
    return 0


def _short(r: dict[str, Any]) -> str:
    if "seconds" not in r:
        return str(r.get("skipped") or r.get("error"))[:160]
    extra = ""
    if "first_call_seconds" in r:
        extra = f", first call {r['first_call_seconds']:.3g} s"
    lib = r.get("library") or {}
    if "strategy" in lib:
        extra += f", ran {lib['strategy']}/{lib['mode']}"
    f32 = r.get("float32_rel_diff")
    return f"{r['seconds']:.4g} s{extra}" + ("" if f32 is None else f", f32 rel diff {f32:.1e}")


def memory_worker(args: argparse.Namespace) -> int:
    """Peak memory of one method on the batch, in this fresh process (after a slice warm-up)."""
    st = settings(args)
    workload, model_name, method = args.worker_mem
    torch.set_num_threads(st.threads)
    cell = build_cell(workload, model_name, quick=st.quick, device=st.device, seed=st.seed)
    if method == "train_step":
        run = prepare_train_step(cell)
    else:
        (m,) = [m for m in methods_for(workload) if m.name == method]
        assert m.prepare is not None
        run = m.prepare(cell, cell.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = CHECK_SAMPLES if cell.ragged else CHECK_SAMPLES - 1
        run(cell.slice(k))
        rec = measure_peak_memory(lambda: run(cell.batch), st.device)
    print(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------- the main process
def settings(args: argparse.Namespace) -> Settings:
    return Settings(
        quick=args.quick,
        device=torch.device(args.device),
        threads=args.threads,
        min_run_time=args.min_run_time if args.min_run_time else (0.2 if args.quick else 0.5),
        method_limit=args.method_limit,
        max_gb=args.max_gb,
        check_tol=args.check_tol,
        f32_tol=args.f32_tol,
        check_limit=args.check_limit,
        seed=args.seed,
        methods=args.methods,
    )


def common_argv(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--threads", str(args.threads), "--seed", str(args.seed)]
    out += ["--method-limit", str(args.method_limit), "--max-gb", str(args.max_gb)]
    out += ["--check-tol", str(args.check_tol), "--f32-tol", str(args.f32_tol)]
    out += ["--check-limit", str(args.check_limit)]
    if args.min_run_time:
        out += ["--min-run-time", str(args.min_run_time)]
    if args.quick:
        out.append("--quick")
    if args.methods:
        out += ["--methods", *args.methods]
    return out


def grid(args: argparse.Namespace) -> list[tuple[str, str]]:
    table = QUICK_GRID if args.quick else GRID
    cells = []
    for w in args.workloads or WORKLOADS:
        for m in table[w] if not args.models else GRID[w]:
            if args.models and m not in args.models:
                continue
            cells.append((w, m))
    return cells


def summarise(cell: dict[str, Any]) -> None:
    """``best_other``, ``library_over_best_other``, ``best_route``, ``auto_over_best_route``."""
    ms = cell.get("methods", {})
    timed = {n: r for n, r in ms.items() if "seconds" in r and r.get("valid")}
    others = {n: r for n, r in timed.items() if r["kind"] == "peer"}
    routes = {n: r for n, r in timed.items() if r["kind"] == "route"}
    auto = timed.get("library_auto")
    best = min(others, key=lambda n: others[n]["seconds"]) if others else None
    route = min(routes, key=lambda n: routes[n]["seconds"]) if routes else None
    cell["best_other"] = best
    cell["best_other_seconds"] = others[best]["seconds"] if best else None
    cell["library_over_best_other"] = (
        auto["seconds"] / others[best]["seconds"] if auto and best else None
    )
    cell["best_route"] = route
    cell["best_route_seconds"] = routes[route]["seconds"] if route else None
    cell["auto_over_best_route"] = (
        auto["seconds"] / routes[route]["seconds"] if auto and route else None
    )
    if "library_auto" in ms and not auto:
        r = ms["library_auto"]
        cell["auto_problem"] = (
            r.get("error")
            or r.get("skipped")
            or r.get("check_error")
            or "did not pass the correctness check"
        )


def memory_methods(cell: dict[str, Any], mode: str) -> list[str]:
    ms = cell.get("methods", {})
    ran = [n for n, r in ms.items() if "seconds" in r]
    if mode == "none":
        return []
    if mode == "all":
        return ran
    main = {"train_step", "library_auto", cell.get("best_other"), cell.get("best_route")}
    return [n for n in ran if n in main]


def run_cell(
    w: str, m: str, args: argparse.Namespace, results: dict[str, Any], deadline: float | None
) -> dict[str, Any]:
    name = f"{w}/{m}"
    log(f"== {name}: timing all methods in one worker ...")
    t0 = time.perf_counter()
    rec = run_worker(
        [str(SCRIPT), "--worker-cell", w, m, *common_argv(args)], timeout_s=args.timeout
    )
    rec.setdefault("name", name)
    rec.setdefault("workload", w)
    rec.setdefault("model", m)
    rec["timing_worker_seconds"] = round(time.perf_counter() - t0, 1)
    if "error" in rec or "methods" not in rec:
        log(f"   {name}: {rec.get('error')}")
        return rec
    summarise(rec)
    for method in memory_methods(rec, args.memory):
        if deadline is not None and time.time() > deadline:
            rec["methods"][method]["memory"] = {"skipped": "--budget spent"}
            continue
        mem = run_worker(
            [str(SCRIPT), "--worker-mem", w, m, method, *common_argv(args)],
            timeout_s=args.timeout,
        )
        r = rec["methods"][method]
        r["memory"] = mem
        r["peak_memory_bytes"] = mem.get("peak_memory_bytes")
    base = rec["methods"].get("train_step", {}).get("peak_memory_bytes")
    for r in rec["methods"].values():
        if r.get("peak_memory_bytes") is not None and base:
            r["memory_ratio_to_train_step"] = r["peak_memory_bytes"] / base
    rec["cell_seconds"] = round(time.perf_counter() - t0, 1)
    log(f"   {name}: {_cell_line(rec)} ({rec['cell_seconds']} s)")
    return rec


def _cell_line(rec: dict[str, Any]) -> str:
    lob, aor = rec.get("library_over_best_other"), rec.get("auto_over_best_route")
    return (
        f"library/best other ({rec.get('best_other')}) = "
        f"{'-' if lob is None else f'{lob:.2f}'}, auto/best route ({rec.get('best_route')}) = "
        f"{'-' if aor is None else f'{aor:.2f}'}"
    )


def out_paths(args: argparse.Namespace, suffix: str = "") -> tuple[Path, str]:
    out_dir = Path(args.out) if args.out else DEFAULT_OUT
    stem = args.name or ("bench_peers" + ("_quick" if args.quick else ""))
    return out_dir, stem + suffix


def main(args: argparse.Namespace) -> int:
    st = settings(args)
    if st.device.type == "cuda" and not torch.cuda.is_available():
        log("--device cuda: CUDA is not available")
        return 2
    torch.set_num_threads(args.threads)
    cells = grid(args)
    out_dir, stem = out_paths(args)
    env = env_stamp(st.device)
    env["threads"] = args.threads
    env["cpu_model"] = cpu_model()
    results: dict[str, Any] = {
        "benchmark": "bench_peers",
        "env": env,
        "config": {
            "quick": args.quick,
            "device": args.device,
            "threads": args.threads,
            "min_run_time": st.min_run_time,
            "method_limit_s": args.method_limit,
            "max_gb": args.max_gb,
            "memory": args.memory,
            "check_tol": args.check_tol,
            "f32_tol": args.f32_tol,
            "seed": args.seed,
            "sizes": {w: SIZES[w][1 if args.quick else 0] for w in WORKLOADS},
            "grid": [f"{w}/{m}" for w, m in cells],
            "peers_installed": {
                p: importlib.util.find_spec(p) is not None
                for p in ("backpack", "opacus", "curvlinops")
            },
        },
        "notes": NOTES
        | {
            "peak_memory_bytes": MEMORY_CAVEAT_CUDA
            if st.device.type == "cuda"
            else MEMORY_CAVEAT_CPU,
        },
        "cells": [],
    }
    start = time.time()
    deadline = start + args.budget if args.budget else None
    for w, m in cells:
        if deadline is not None and time.time() > deadline:
            results["cells"].append(
                {"name": f"{w}/{m}", "workload": w, "model": m, "not_run": "--budget spent"}
            )
            continue
        results["cells"].append(run_cell(w, m, args, results, deadline))
        write_json(out_dir / f"{stem}.json", results)
    results["env"]["load_average_at_end"] = _load()
    results["total_seconds"] = round(time.time() - start, 1)
    path = write_json(out_dir / f"{stem}.json", results)
    text = render_tables(results)
    (out_dir / f"{stem}.md").write_text(text)
    print(text)
    png = plot(results, out_dir / f"{stem}.png")
    log(f"wrote {path}, {out_dir / (stem + '.md')}" + (f", {png}" if png else ""))
    return 0


def _load() -> list[float] | None:
    from _common import load_average

    return load_average()


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


NOTES = {
    "seconds": (
        "median per call from torch.utils.benchmark.Timer (blocked_autorange, or single timed "
        "calls for calls >= min_run_time), after a warm-up on a slice and one call on the "
        "batch; every method of a cell in one fresh process"
    ),
    "ratio_to_train_step": (
        "seconds / the training step of the same process (mean of the medians measured "
        "before and after the other methods)"
    ),
    "first_call_seconds": (
        "library methods: the first call on the batch with a fresh deep copy of the model "
        "(plan cache cold; torch already warmed up by the slice call)"
    ),
    "checked": (
        "max abs difference from the float64 reference (plain autograd loops) on a slice of "
        "the cell (2 samples; ragged: 3 spanning 3 shape buckets); checked_rel divides by the "
        "reference's max; valid needs checked_rel <= check_tol and float32_rel_diff (vs the "
        "first peer on the whole batch) <= f32_tol"
    ),
    "best_other": "the fastest valid non-library method (train_step excluded)",
    "library_over_best_other": "library_auto seconds / best_other seconds (< 1: the library wins)",
    "auto_over_best_route": "library_auto seconds / the fastest valid forced library route",
    "backpack_DiagGGNExact": (
        "not used: it gives the GGN diagonal, which is neither the empirical Fisher (fisher) "
        "nor the off-diagonal subset block a subnetwork Laplace needs (laplace)"
    ),
}


# ---------------------------------------------------------------------- tables and plot
def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def summary_table(results: dict[str, Any]) -> str:
    rows = []
    for c in results["cells"]:
        ms = c.get("methods", {})
        auto = ms.get("library_auto", {})
        ran = auto.get("library") or {}
        what = "/".join(str(ran[k]) for k in ("strategy", "mode") if k in ran) or ran.get(
            "method", ""
        )
        rows.append(
            [
                c["name"],
                fmt_seconds(c.get("train_step_seconds")),
                _fmt_ratio(auto.get("ratio_to_train_step")),
                c.get("best_other") or "-",
                _fmt_ratio((ms.get(c.get("best_other") or "", {})).get("ratio_to_train_step")),
                _fmt_ratio(c.get("library_over_best_other")),
                c.get("best_route") or "-",
                _fmt_ratio(c.get("auto_over_best_route")),
                fmt_seconds(auto.get("first_call_seconds")),
                (c.get("not_run") or c.get("error") or c.get("auto_problem") or what)[:60],
            ]
        )
    return markdown_table(
        [
            "cell",
            "train step s",
            "auto x step",
            "best other",
            "other x step",
            "library / best other",
            "best route",
            "auto / best route",
            "auto first call s",
            "auto ran / note",
        ],
        rows,
    )


def cell_table(c: dict[str, Any]) -> str:
    rows = []
    for name, r in c.get("methods", {}).items():
        note = r.get("skipped") or r.get("error") or r.get("check_error") or ""
        lib = r.get("library") or {}
        if not note and lib:
            note = ", ".join(
                f"{k}={v}" for k, v in lib.items() if k in ("strategy", "mode", "method", "plan")
            )
        if "seconds" in r and not r.get("valid") and r["kind"] != "train":
            note = "INVALID " + note
        rows.append(
            [
                name,
                fmt_seconds(r.get("seconds")),
                _fmt_ratio(r.get("ratio_to_train_step")),
                fmt_seconds(r.get("first_call_seconds")),
                fmt_bytes(r.get("peak_memory_bytes")),
                "-" if r.get("checked") is None else f"{r['checked']:.1e}",
                "-" if r.get("float32_rel_diff") is None else f"{r['float32_rel_diff']:.1e}",
                note[:100],
            ]
        )
    return markdown_table(
        ["method", "s", "x step", "first call s", "peak MiB", "checked", "f32 rel", "note"], rows
    )


def render_tables(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [
        f"# bench_peers ({'quick' if results['config']['quick'] else 'full'})",
        "",
        f"torch {env['torch']}, {env['device']}"
        f"{' (' + env['cuda_device_name'] + ')' if env.get('cuda_device_name') else ''}, "
        f"{env['threads']} threads, CPU {env.get('cpu_model')}, commit "
        f"{(env.get('git_commit') or '?')[:10]}{' (dirty)' if env.get('git_dirty') else ''}, "
        f"{env['date_utc']}, load average {env.get('load_average_at_start')} at start, "
        f"{env.get('load_average_at_end')} at end.",
        "",
        "`library / best other` = library_auto seconds / the fastest valid non-library method; "
        "`auto / best route` = library_auto / the fastest valid forced route (< 1: auto wins).",
        "",
        summary_table(results),
    ]
    for c in results["cells"]:
        if "methods" not in c:
            continue
        lines += [
            "",
            f"## {c['name']}: N={c.get('N')}, O={c.get('O')}, P={c.get('P')} "
            f"(of {c.get('params_total')}), {c.get('shape_buckets')} shape bucket(s)",
            "",
            cell_table(c),
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("(no plot: matplotlib is not installed)")
        return None
    cells = [c for c in results["cells"] if c.get("library_over_best_other") is not None]
    if not cells:
        return None
    names = [c["name"] for c in cells]
    lob = [c["library_over_best_other"] for c in cells]
    aor = [c.get("auto_over_best_route") or float("nan") for c in cells]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(cells)), 5))
    x = list(range(len(cells)))
    ax.bar(
        [i - 0.2 for i in x],
        lob,
        width=0.4,
        label="library_auto / best other method",
        color=["tab:green" if v <= 1 else "tab:red" for v in lob],
    )
    ax.bar(
        [i + 0.2 for i in x],
        aor,
        width=0.4,
        label="library_auto / best forced route",
        color="tab:gray",
        alpha=0.6,
    )
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=90, fontsize=7)
    ax.set_ylabel("time ratio (log; < 1: the library is faster)")
    env = results["env"]
    ax.set_title(f"bench_peers: {env['device']}, {env['threads']} threads, torch {env['torch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- check and dry modes
def check_main(args: argparse.Namespace) -> int:
    st = settings(args)
    torch.set_num_threads(args.threads)
    rows, failed, table = [], False, []
    for w, m in grid(args):
        methods = [x for x in methods_for(w) if st.wants(x.name)]
        try:
            meta, checks = check_methods(w, m, methods, st, verbose=True)
        except Skip as e:
            log(f"{w}/{m}: not applicable: {e}")
            continue
        for name, r in checks.items():
            bad = "ok" in r and not r["ok"]
            failed |= bad
            rows.append({"cell": f"{w}/{m}", "method": name, **r})
            table.append(
                [
                    f"{w}/{m}",
                    name,
                    "-" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}",
                    "-" if r.get("rel_diff") is None else f"{r['rel_diff']:.2e}",
                    ("FAIL" if bad else "ok")
                    if "ok" in r
                    else (str(r.get("skipped") or r.get("error") or r.get("mismatch"))[:90]),
                ]
            )
        log(
            f"{w}/{m}: {sum(1 for r in checks.values() if r.get('ok'))}/{len(checks)} ok "
            f"(reference {meta['reference_seconds']:.1f} s)"
        )
    out_dir, stem = out_paths(args, "_check")
    path = write_json(
        out_dir / f"{stem}.json",
        {
            "benchmark": "bench_peers --check",
            "env": env_stamp(st.device),
            "config": {"quick": args.quick, "tol": args.check_tol, "seed": args.seed},
            "notes": {"checked": NOTES["checked"]},
            "rows": rows,
        },
    )
    print(markdown_table(["cell", "method", "max abs diff", "rel diff", "result"], table))
    done = [r["max_abs_diff"] for r in rows if r.get("ok")]
    if done:
        print(f"\nlargest max abs diff among passing methods: {max(done):.2e}")
    log(f"wrote {path}")
    return 1 if failed else 0


def dry_main(args: argparse.Namespace) -> int:
    """The grid and its methods, what would be skipped before running, nothing measured."""
    rows = []
    for w, m in grid(args):
        for x in methods_for(w):
            if not settings(args).wants(x.name):
                continue
            note = x.not_applicable or ""
            pkg = {"backpack": "backpack", "opacus": "opacus", "curvlinops": "curvlinops"}.get(
                x.name
            )
            if not note and pkg and importlib.util.find_spec(pkg) is None:
                note = f"{pkg} not installed"
            rows.append([f"{w}/{m}", x.name, x.kind, note or x.what])
    print(markdown_table(["cell", "method", "kind", "what / why not"], rows))
    print(f"\n{len(grid(args))} cells, {len(rows)} (cell, method) pairs; device {args.device}")
    return 0


# ---------------------------------------------------------------------- command line
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Workloads, models, methods and how numbers are taken: see the module docstring.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small grid and batches, short timing (a few minutes on 2 cores)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="float64 agreement of every method with the reference; exit 1 on failure",
    )
    p.add_argument("--dry", action="store_true", help="list the cells and methods; run nothing")
    p.add_argument("--workloads", nargs="*", choices=WORKLOADS, help="default: all")
    p.add_argument(
        "--models",
        nargs="*",
        choices=sorted(SPECS),
        help="only these models (from the full grid); default: the grid's",
    )
    p.add_argument(
        "--methods", nargs="*", help="only these methods (train_step always runs); default: all"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch threads and Timer num_threads")
    p.add_argument(
        "--min-run-time",
        type=float,
        default=0.0,
        help="Timer.blocked_autorange min_run_time (default 0.5; quick 0.2)",
    )
    p.add_argument(
        "--method-limit",
        type=float,
        default=40.0,
        help="skip a method whose slice time suggests more seconds than this per call",
    )
    p.add_argument(
        "--max-gb",
        type=float,
        default=4.0,
        help="skip a method whose memory estimate exceeds this (GiB)",
    )
    p.add_argument(
        "--memory",
        choices=("all", "main", "none"),
        default="all",
        help="peak memory per method in a fresh process: all, main "
        "(train step, auto, best other, best route), none",
    )
    p.add_argument(
        "--check-tol",
        type=float,
        default=1e-9,
        help="float64 relative tolerance vs the reference (1e-9)",
    )
    p.add_argument(
        "--f32-tol",
        type=float,
        default=1e-3,
        help="float32 relative tolerance vs the first peer on the batch (1e-3)",
    )
    p.add_argument(
        "--check-limit",
        type=float,
        default=30.0,
        help="seconds per method on the float64 slice (timing runs: at least 4x its float32 "
        "slice time)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds; start no new cell or memory worker after this (0: no limit)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per worker process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--name", help="file stem (default: bench_peers[_quick]; --check adds _check)")
    p.add_argument("--worker-cell", nargs=2, metavar=("WORKLOAD", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument(
        "--worker-mem", nargs=3, metavar=("WORKLOAD", "MODEL", "METHOD"), help=argparse.SUPPRESS
    )
    return p.parse_args(argv)


def guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A worker's exception becomes a one-line ``{"error": ...}`` (traceback on stderr)."""
    try:
        return fn(args)
    except Exception as e:
        traceback.print_exc()
        print(json.dumps({"error": _error(e)}))
        return 0


if __name__ == "__main__":
    args = parse()
    if args.worker_cell:
        sys.exit(guarded(cell_worker, args))
    if args.worker_mem:
        sys.exit(guarded(memory_worker, args))
    if args.dry:
        sys.exit(dry_main(args))
    sys.exit(check_main(args) if args.check else main(args))

"""Real third-party detection/segmentation modules, unmodified, through the engine (optional).

One small module from each library, random init, float64, eval mode, CPU, no downloads:

* ultralytics: the ``Detect`` head alone (two levels) and a tiny ``DetectionModel`` built from a
  yaml dict; ``Detect`` caches ``anchors``/``strides``/``shape`` on itself in its forward;
* effdet: ``BiFpn`` (two cells, fast-attention edge weights) and its ``HeadNet``;
* segmentation_models_pytorch: a ``Unet`` (resnet18 encoder) under ``SubnetLaplace``;
* timm: a ``features_only`` backbone with a head shared by its levels.

Each test asserts (i) exactness against the loop reference (``per_sample_jacobian_loop``, run
on a copy taken before the call) and (ii) that the call leaves the model as it found it: every
``state_dict`` tensor, every module's tensor-valued instance attributes outside parameters and
buffers (caches such as ``Detect.anchors``: equal and not a functorch wrapper), its plain
attributes (``Detect.shape``), and the model's own forward on every input shape seen, run on the
model as the call left it (each shape from that same state), equal to before the call.

Each library is imported with ``pytest.importorskip`` inside its test, so the module is skipped
where they are absent (the project's own CI). To run it, in an environment with the libraries
(torch and torchvision from one release, e.g. torch 2.14.1 with torchvision 0.29.1):
``pip install ultralytics effdet segmentation-models-pytorch timm`` (torch pinned by a
constraints file), then ``python -m pytest tests/test_real_libraries.py``.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

import multiscale_jac as mj
from multiscale_jac.reference import per_sample_jacobian_loop

# ultralytics reads these at import: no DNS probe, no pip at run time, settings out of $HOME
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "0")
os.environ.setdefault("YOLO_VERBOSE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning"),
]

DTYPE = torch.float64
RTOL = ATOL = 1e-10


# ----------------------------------------------------------------------------- state snapshots
def _wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (a tensor that escaped a ``vmap``/``grad``/``jvp``)."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


def _plain(v: Any) -> bool:
    return not isinstance(v, (torch.Tensor, nn.Module)) and not callable(v)


def _copy_plain(v: Any) -> Any:
    """Builtin containers by value (an in-place change shows); other objects by reference."""
    return copy.copy(v) if isinstance(v, (list, dict, set)) else v


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


class Snapshot:
    """The state of every module that a forward may write: ``state_dict`` tensors, tensor-valued
    instance attributes outside parameters and buffers, and plain (non-tensor) attributes."""

    def __init__(self, model: nn.Module) -> None:
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.plain: dict[str, dict[str, Any]] = {}
        for path, m in model.named_modules():
            self.tensors[path] = {
                k: v.detach().clone() for k, v in vars(m).items() if isinstance(v, torch.Tensor)
            }
            self.plain[path] = {
                k: _copy_plain(v) for k, v in vars(m).items() if not k.startswith("_") and _plain(v)
            }

    def differences(self, model: nn.Module) -> list[str]:
        """What differs in ``model`` now (empty: nothing)."""
        out = []
        state = model.state_dict()
        for k in self.state.keys() | state.keys():
            a, b = self.state.get(k), state.get(k)
            if a is None or b is None or not _equal(a, b):
                out.append(f"state_dict[{k!r}] changed")
        for path, m in model.named_modules():
            where = path or "<root>"
            now = {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}
            before = self.tensors.get(path, {})
            for k in before.keys() | now.keys():
                a, b = before.get(k), now.get(k)
                if b is not None and _wrapped(b):
                    out.append(f"{where}.{k} is a functorch wrapper: {type(b).__name__} {_repr(b)}")
                elif a is None or b is None or not _equal(a, b):
                    out.append(f"{where}.{k} (tensor attribute) changed: {_repr(a)} -> {_repr(b)}")
            now_plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and _plain(v)}
            before_plain = self.plain.get(path, {})
            for k in before_plain.keys() | now_plain.keys():
                a, b = before_plain.get(k, "<absent>"), now_plain.get(k, "<absent>")
                if not _same(a, b):
                    out.append(f"{where}.{k} changed: {a!r} -> {b!r}")
        return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if _wrapped(a) or _wrapped(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b))


def _repr(t: torch.Tensor | None) -> str:
    if t is None:
        return "<absent>"
    try:
        return f"shape {tuple(t.shape)} {str(t).splitlines()[0][:60]}"
    except Exception as err:
        return f"<unprintable: {type(err).__name__}>"


def _public_attrs(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Every module's public instance attributes that are not submodules (references)."""
    return [
        (m, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in model.modules()
    ]


def _restore_attrs(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    for m, attrs in saved:
        for k in [k for k in vars(m) if not k.startswith("_") and k not in attrs]:
            delattr(m, k)
        for k, v in attrs.items():
            object.__setattr__(m, k, v)


def _forward_all(
    model: nn.Module, batches: Iterable[Any], output_fn: Callable[[Any], torch.Tensor] | None
) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = [model(x) for x in batches]
    return [(output_fn(o) if output_fn else o).detach().clone() for o in outs]


def check_left_as_found(
    model: nn.Module,
    snapshot: Snapshot,
    batches: list[Any],
    before: list[torch.Tensor],
    output_fn: Callable[[Any], torch.Tensor] | None = None,
) -> None:
    """Assert that ``model`` is as ``snapshot`` recorded and that its forward on each of
    ``batches``, each run from the state the call left, gives the output recorded before."""
    problems = snapshot.differences(model)
    left = _public_attrs(model)  # the state as the call left it, to run every shape from it
    for k, (x, ref) in enumerate(zip(batches, before)):
        _restore_attrs(left)
        shape = _shapes(x)
        try:
            (out,) = _forward_all(model, [x], output_fn)
        except Exception as err:
            msg = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            problems.append(f"forward #{k} on {shape} raised {type(err).__name__}: {msg}")
            continue
        if out.shape != ref.shape or not torch.equal(out, ref):
            problems.append(f"forward #{k} on {shape} gives another output than before the call")
    _restore_attrs(left)
    assert not problems, "the call changed the model:\n  " + "\n  ".join(problems)


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    return [tuple(t.shape) for t in x]


def assert_exact(res: mj.JacobianResult, ref: mj.JacobianResult) -> None:
    assert res.output_sizes == ref.output_sizes
    torch.testing.assert_close(res.jacobian, ref.jacobian, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(res.outputs, ref.outputs, rtol=RTOL, atol=ATOL)


def _as_batch(sample: Any) -> Any:
    """A per-sample input as a batch of one (a tensor, or a list of levels)."""
    if isinstance(sample, torch.Tensor):
        return sample.unsqueeze(0)
    return [t.unsqueeze(0) for t in sample]


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics, so that an eval-mode BatchNorm is not the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(1 + 0.2 * torch.rand(m.running_var.shape, generator=g))
    return model


def run_checked(
    model: nn.Module,
    samples: list[Any],
    subset: mj.ParamSubset,
    output_fn: Callable[[Any], Any] | None = None,
    **kwargs: Any,
) -> mj.JacobianResult:
    """The user's forward on every sample's shape, then the engine on ``samples``: exact against
    the loop reference, and the model left as found."""
    batches = [_as_batch(s) for s in samples]
    before = _forward_all(model, batches, output_fn)  # sets whatever caches the forward keeps
    snapshot = Snapshot(model)
    ref = per_sample_jacobian_loop(
        copy.deepcopy(model), samples, params=subset, output_fn=output_fn
    )
    res = mj.per_sample_jacobian(model, samples, params=subset, output_fn=output_fn, **kwargs)
    assert_exact(res, ref)
    check_left_as_found(model, snapshot, batches, before, output_fn)
    return res


def _predictions(out: Any) -> torch.Tensor:
    """ultralytics ``Detect`` in eval returns ``(decoded predictions, raw dict)``."""
    return out[0]


# ----------------------------------------------------------------------------- ultralytics
def _detect_head() -> nn.Module:
    head_mod = pytest.importorskip("ultralytics.nn.modules.head")
    torch.manual_seed(0)
    det = head_mod.Detect(nc=3, ch=(8, 16))
    det.stride = torch.tensor([8.0, 16.0])  # set by DetectionModel's build otherwise
    return _randomize_bn(det.to(DTYPE).eval())


def _detect_samples() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            torch.randn(8, h, w, generator=g, dtype=DTYPE),
            torch.randn(16, h // 2, w // 2, generator=g, dtype=DTYPE),
        ]
        for h, w in ((4, 4), (4, 6), (6, 4), (4, 4))
    ]


def _detect_subset(det: nn.Module) -> mj.ParamSubset:
    return mj.ParamSubset.from_indices(
        det,
        {
            "cv2.0.2.weight": [0, 5, 17],
            "cv2.1.0.conv.weight": [1, 100],
            "cv3.0.2.weight": [0, 7],
            "cv3.1.2.bias": [0, 2],
        },
    )


@pytest.mark.parametrize("strategy", ["auto", "bucketed"])
def test_ultralytics_detect_head(strategy):
    det = _detect_head()
    samples = _detect_samples()
    run_checked(det, samples, _detect_subset(det), _predictions, strategy=strategy)


def test_ultralytics_detect_head_padded_after_a_call():
    """A second call on the head the first call ran, asking for the padded route: it runs, or
    falls back (DFL's view of levels flattened and concatenated has no box-shaped padding) to
    an exact result, and the head is still left as found."""
    det = _detect_head()
    samples = _detect_samples()
    subset = _detect_subset(det)
    batches = [_as_batch(s) for s in samples]
    before = _forward_all(det, batches, _predictions)
    snapshot = Snapshot(det)
    ref = per_sample_jacobian_loop(
        copy.deepcopy(det), samples, params=subset, output_fn=_predictions
    )
    mj.per_sample_jacobian(det, samples, params=subset, output_fn=_predictions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.FallbackWarning)
        res = mj.per_sample_jacobian(
            det, samples, params=subset, output_fn=_predictions, strategy="padded"
        )
    assert res.strategy is mj.Strategy.PADDED or res.fallback is not None
    assert_exact(res, ref)
    check_left_as_found(det, snapshot, batches, before, _predictions)


def test_ultralytics_tiny_detection_model():
    tasks = pytest.importorskip("ultralytics.nn.tasks")
    cfg = {
        "nc": 3,
        "backbone": [
            [-1, 1, "Conv", [8, 3, 2]],  # /2
            [-1, 1, "Conv", [8, 3, 2]],  # /4
            [-1, 1, "Conv", [8, 3, 2]],  # /8
            [-1, 1, "Conv", [16, 3, 2]],  # /16
        ],
        "head": [[[2, 3], 1, "Detect", ["nc"]]],
    }
    torch.manual_seed(0)
    model = tasks.DetectionModel(cfg=cfg, ch=3, nc=3, verbose=False)
    model = _randomize_bn(model.to(DTYPE).eval())
    g = torch.Generator().manual_seed(2)
    images = [
        torch.rand(3, h, w, generator=g, dtype=DTYPE) for h, w in ((32, 32), (32, 64), (64, 32))
    ]
    subset = mj.ParamSubset.from_indices(
        model,
        {
            "model.0.conv.weight": [0, 3, 9],
            "model.2.conv.weight": [1, 50],
            "model.4.cv3.0.2.weight": [0, 4],
        },
    )
    run_checked(model, images, subset, _predictions)


# ----------------------------------------------------------------------------- effdet
class _BiFpnDetector(nn.Module):
    """A user's model: effdet's BiFpn over three backbone levels and its HeadNet (convs shared by
    the levels, a BatchNorm per level), every level's prediction flattened and concatenated."""

    def __init__(self, effdet: Any, in_chs: tuple[int, ...] = (4, 6, 8)) -> None:
        super().__init__()
        ed = effdet.efficientdet
        cfg = effdet.get_efficientdet_config("tf_efficientdet_d0")
        cfg.fpn_channels, cfg.fpn_cell_repeats, cfg.box_class_repeats = 4, 2, 1
        cfg.min_level, cfg.max_level, cfg.num_levels = 3, 5, 3
        cfg.image_size = (32, 32)
        cfg.num_scales, cfg.aspect_ratios = 1, [(1.0, 1.0)]
        info = [{"num_chs": c, "reduction": 2 ** (3 + i)} for i, c in enumerate(in_chs)]
        self.fpn = ed.BiFpn(cfg, info)
        self.head = ed.HeadNet(cfg, num_outputs=1)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        levels = self.fpn(list(feats))  # BiFpn appends to the list it is given
        return torch.cat([o.flatten(1) for o in self.head(levels)], dim=1)


def test_effdet_bifpn_and_head(monkeypatch):
    effdet = pytest.importorskip("effdet")
    ed = effdet.efficientdet
    # upsample by a factor of 2, not to the config's fixed sizes, so that any input size runs
    monkeypatch.setattr(ed, "_USE_SCALE", True)
    torch.manual_seed(0)
    model = _BiFpnDetector(effdet)
    with torch.no_grad():  # edge weights off their init of ones, so the fusion weights differ
        for name, p in model.named_parameters():
            if name.endswith("edge_weights"):
                p.uniform_(0.5, 1.5)
    model = _randomize_bn(model.to(DTYPE).eval())
    g = torch.Generator().manual_seed(3)
    samples = [
        [torch.randn(c, h >> i, w >> i, generator=g, dtype=DTYPE) for i, c in enumerate((4, 6, 8))]
        for h, w in ((4, 4), (4, 8), (8, 4))
    ]
    subset = mj.ParamSubset.from_indices(
        model,
        {
            "fpn.cell.0.fnode.0.combine.edge_weights": [0, 1],
            "fpn.cell.0.fnode.0.after_combine.conv.conv_dw.weight": [3, 20],
            "fpn.cell.1.fnode.2.combine.edge_weights": [2],
            "fpn.cell.1.fnode.1.after_combine.conv.conv_pw.weight": [0, 9],
            "head.predict.conv_pw.weight": [1, 3],
        },
    )
    run_checked(model, samples, subset, strategy="bucketed")


# ----------------------------------------------------------------------------- smp
def test_smp_unet_subnet_laplace():
    smp = pytest.importorskip("segmentation_models_pytorch")
    classes = 2
    torch.manual_seed(0)
    model = smp.Unet(
        encoder_name="resnet18",
        encoder_weights=None,
        encoder_depth=3,
        decoder_channels=(16, 8, 8),
        classes=classes,
    )
    model = _randomize_bn(model.to(DTYPE).eval())
    g = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=g, dtype=DTYPE) for h, w in ((16, 16), (16, 24))]
    labels = [torch.randint(0, classes, x.shape[1:], generator=g) for x in images]
    subset = mj.ParamSubset.from_indices(
        model,
        {
            "encoder.layer1.0.conv1.weight": [0, 11, 123],
            "decoder.blocks.1.conv1.0.weight": [3, 40],
            "segmentation_head.0.weight": [0, 5, 9],
            "segmentation_head.0.bias": [1],
        },
    )
    batches = [_as_batch(x) for x in images]
    before = _forward_all(model, batches, None)
    snapshot = Snapshot(model)
    ref = per_sample_jacobian_loop(copy.deepcopy(model), images, params=subset)

    la = mj.SubnetLaplace(model, "classification", subset, prior_precision=1.0)
    la.fit([(images, labels)])
    pred = la.predictive(images, link_approx="probit")

    # the GGN from the loop reference: per pixel, J^T (diag(p) - p p^T) J over the classes
    h = torch.zeros(subset.numel, subset.numel, dtype=DTYPE)
    for i, size in enumerate(ref.output_sizes):
        jac = ref.jacobian[i, :size].reshape(classes, -1, subset.numel)
        p = torch.softmax(ref.outputs[i, :size].reshape(classes, -1), dim=0)
        pj = torch.einsum("cq,cqa->qa", p, jac)
        h += torch.einsum("cq,cqa,cqb->ab", p, jac, jac) - pj.T @ pj
    torch.testing.assert_close(la.H, h, rtol=RTOL, atol=ATOL)
    for mean, x in zip(pred.mean, before):
        torch.testing.assert_close(mean, x[0], rtol=RTOL, atol=ATOL)
    check_left_as_found(model, snapshot, batches, before)


# ----------------------------------------------------------------------------- timm
class _SharedHeadOverLevels(nn.Module):
    """A user's model: a timm ``features_only`` backbone, a 1x1 lateral per level and one head
    shared by the levels; every level's output flattened and concatenated."""

    def __init__(self, timm: Any) -> None:
        super().__init__()
        self.backbone = timm.create_model(
            "resnet18", pretrained=False, features_only=True, out_indices=(2, 3)
        )
        self.lateral = nn.ModuleList(
            nn.Conv2d(c, 8, 1) for c in self.backbone.feature_info.channels()
        )
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [lat(f) for lat, f in zip(self.lateral, self.backbone(x))]
        return torch.cat([self.head(f).flatten(1) for f in feats], dim=1)


@pytest.mark.parametrize("strategy", ["auto", "padded"])
def test_timm_features_only_shared_head(strategy):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = _randomize_bn(_SharedHeadOverLevels(timm).to(DTYPE).eval())
    g = torch.Generator().manual_seed(5)
    images = [
        torch.randn(3, h, w, generator=g, dtype=DTYPE) for h, w in ((32, 32), (32, 48), (48, 32))
    ]
    subset = mj.ParamSubset.from_names(model, "head.*")
    res = run_checked(model, images, subset, strategy=strategy, strict=True)
    if strategy == "padded":
        assert res.strategy is mj.Strategy.PADDED

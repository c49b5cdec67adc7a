"""Subnetwork Laplace for semantic segmentation on ragged batches of multi-resolution images.

A small FPN-style network (defined below, SiLU activations) takes every image as two levels, the
image and its half-resolution copy, builds a three-level pyramid (strides 1, 2, 4), runs one
shared head over every level and upsamples the per-level logits to the input size
(``F.interpolate(size=...)``). The synthetic images come in three sizes (24x24, 32x28 and
20x32): noisy backgrounds with bright squares and dimmer discs; the label map says which pixel
belongs to which, and the outline of every shape is ``ignore_index`` in the training targets
(the "void" band of VOC).

After a few seconds of training, :class:`multiscale_jac.SubnetLaplace` puts a Gaussian posterior
over the 1,000 weights of largest marginal variance under a diagonal Laplace
(``largest_variance``, ranked on 12 images), tunes the prior precision on the
marginal likelihood and gives the linearised predictive per pixel (probit link). Batches are
lists of samples that mix the three sizes, with a list of label maps as targets; every sample
runs unpadded, so nothing is computed for padding.

Prints what it did and the mean predictive entropy on correctly and wrongly labelled test
pixels. The fit and the predictive are timed twice: the first call (planning included) and a
warm call (the same call again, after the first). Saves a PNG when matplotlib is installed
(one row per test image of every size; columns: input, true labels, predicted labels,
predictive entropy, and the predictive variance of the GLM predictive per pixel, i.e. the
variance of the linearised logits ``diag(J Sigma J^T)`` summed over the classes; every column
has one colour scale shared by its rows, with a colour bar); ``--out`` sets where (default: a
folder in the system's temporary directory; the path is printed).

Run: python examples/subnet_laplace_segmentation.py [--quick] [--out PATH]

``--quick`` (also implied when the environment sets ``CI`` or ``MULTISCALE_JAC_QUICK=1``, or
when pytest runs it) uses tiny images, fewer steps and 200 weights: seconds. The full run takes
about a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import multiscale_jac as mj

CLASSES = ("background", "square", "disc")
SIZES = ((24, 24), (32, 28), (20, 32))
QUICK_SIZES = ((12, 12), (16, 12), (12, 16))
IGNORE = -100
DEFAULT_OUT = Path(tempfile.gettempdir()) / "multiscale_jac_examples" / "subnet_laplace_seg.png"


# ---------------------------------------------------------------------- model
class SegFPN(nn.Module):
    """A tiny FPN-style segmentation network.

    Input: a list ``[image (B, 1, H, W), half-resolution image (B, 1, H/2, W/2)]`` (H, W even).
    A backbone of 3x3 convs gives levels at strides 1, 2 and 4 (the half-resolution image joins
    at stride 2 through a 1x1 lateral), a top-down pathway adds each coarser level to the finer
    one, and one shared head maps every level to class logits, which are upsampled to ``(H, W)``
    and summed. Output: ``(B, num_classes, H, W)``.
    """

    def __init__(self, width: int = 12, num_classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.down1 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.lateral = nn.Conv2d(1, width, 1)
        self.down2 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.head = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, num_classes, 1),
        )

    def forward(self, levels: list[Tensor]) -> Tensor:
        image, half = levels
        size = image.shape[-2:]
        c1 = F.silu(self.stem(image))
        c2 = F.silu(self.down1(c1) + self.lateral(half))
        c3 = F.silu(self.down2(c2))
        p2 = c2 + F.interpolate(c3, size=c2.shape[-2:], mode="nearest")
        p1 = c1 + F.interpolate(p2, size=c1.shape[-2:], mode="nearest")
        return sum(
            F.interpolate(self.head(p), size=size, mode="bilinear", align_corners=False)
            for p in (p1, p2, c3)
        )


# ---------------------------------------------------------------------- data
def make_image(h: int, w: int, g: torch.Generator) -> tuple[list[Tensor], Tensor, Tensor]:
    """One sample: levels ``[(1, h, w), (1, h/2, w/2)]``, the label map ``(h, w)`` and the
    training target (the label map with the outline of every shape set to ``IGNORE``)."""
    img = 0.35 * torch.randn(1, h, w, generator=g)
    label = torch.zeros(h, w, dtype=torch.long)
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    outline = torch.zeros(h, w, dtype=torch.bool)
    n_shapes = int(torch.randint(1, 4, (), generator=g))
    for _ in range(n_shapes):
        cls = int(torch.randint(1, 3, (), generator=g))
        r = int(torch.randint(2, max(3, min(h, w) // 4) + 1, (), generator=g))
        cy = int(torch.randint(r, h - r, (), generator=g))
        cx = int(torch.randint(r, w - r, (), generator=g))
        if cls == 1:  # square, bright
            mask = ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
            level = 1.0
        else:  # disc, dimmer
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r + r
            level = 0.55
        img[0][mask] += level
        label[mask] = cls
        inner = -F.max_pool2d(-mask[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0.5
        outline |= mask & ~inner
    target = label.masked_fill(outline, IGNORE)
    half = F.avg_pool2d(img[None], 2)[0]
    return [img, half], label, target


def make_split(sizes, per_size: int, seed: int):
    """``per_size`` images of every size, interleaved so that consecutive images differ in size."""
    g = torch.Generator().manual_seed(seed)
    samples = [make_image(h, w, g) for _ in range(per_size) for h, w in sizes]
    inputs = [s[0] for s in samples]
    labels = [s[1] for s in samples]
    targets = [s[2] for s in samples]
    return inputs, labels, targets


def ragged_batches(inputs, targets, batch_size: int):
    """``(list of samples, list of label maps)`` batches; every batch mixes the sizes."""
    return [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, len(inputs), batch_size)
    ]


# ---------------------------------------------------------------------- training
def train(model: nn.Module, inputs, targets, steps: int, batch_size: int = 8) -> float:
    """Adam on the pixel cross-entropy; one batch of one image size per step (a batch of one
    size is a list of two batched tensors)."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, x in enumerate(inputs):
        by_size.setdefault(tuple(x[0].shape[-2:]), []).append(i)
    groups = list(by_size.values())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(math.nan)
    for step in range(steps):
        group = groups[step % len(groups)]
        pick = [group[int(j)] for j in torch.randperm(len(group), generator=g)[:batch_size]]
        levels = [torch.stack([inputs[i][lvl] for i in pick]) for lvl in range(2)]
        y = torch.stack([targets[i] for i in pick])
        opt.zero_grad()
        loss = F.cross_entropy(model(levels), y, ignore_index=IGNORE)
        loss.backward()
        opt.step()
    return float(loss.detach())


def entropy(probs: Tensor) -> Tensor:
    """Per-pixel entropy (nats) of ``(C, H, W)`` class probabilities."""
    return -(probs * probs.clamp_min(1e-12).log()).sum(0)


def _first_and_warm(call) -> tuple[float, float]:
    """Seconds of the first call of ``call()`` (planning and one-off set-up included) and of
    a warm call (the same call again right after)."""
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    return seconds[0], seconds[1]


def _as_list(x) -> list[Tensor]:
    return list(x.unbind(0)) if isinstance(x, Tensor) else list(x)


# ---------------------------------------------------------------------- picture
def _figure(
    plt,
    out: Path,
    *,
    inputs: list[Tensor],
    truth: list[Tensor],
    predicted: list[Tensor],
    entropies: list[Tensor],
    variances: list[Tensor],
    k: int,
) -> None:
    """The PNG: one row per test image, five columns; every column has one colour scale for
    all its rows (the input's and the variance's from the smallest to the largest value shown,
    labels 0-2, entropy 0 to ln 3) and one colour bar under it."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    label_cmap = ListedColormap(["#2b2b2b", "#e8a33d", "#3d8be8"])
    label_norm = BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3)
    lo = min(float(x.min()) for x in inputs)
    hi = max(float(x.max()) for x in inputs)
    var_hi = max(float(v.max()) for v in variances)
    columns = (
        ("input image", inputs, {"cmap": "gray", "vmin": lo, "vmax": hi}, "intensity"),
        ("true labels", truth, {"cmap": label_cmap, "norm": label_norm}, "class"),
        ("predicted labels", predicted, {"cmap": label_cmap, "norm": label_norm}, "class"),
        (
            "predictive entropy",
            entropies,
            {"cmap": "magma", "vmin": 0.0, "vmax": math.log(len(CLASSES))},
            "nats",
        ),
        (
            "GLM predictive variance",
            variances,
            {"cmap": "magma", "vmin": 0.0, "vmax": var_hi},
            "logit variance, summed over classes",
        ),
    )
    rows = len(inputs)
    fig, axes = plt.subplots(
        rows,
        len(columns),
        figsize=(2.5 * len(columns), 2.2 * rows + 1.9),
        squeeze=False,
        layout="constrained",
    )
    for col, (title, maps, style, unit) in enumerate(columns):
        for row, img in enumerate(maps):
            ax = axes[row][col]
            im = ax.imshow(img.detach().numpy(), **style)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(title, fontsize=9)
            if col == 0:
                h, w = img.shape
                ax.set_ylabel(f"test image {row + 1}\n{h}x{w} pixels", fontsize=8)
        bar = fig.colorbar(im, ax=axes[:, col], orientation="horizontal", shrink=0.85, aspect=18)
        bar.set_label(unit, fontsize=8)
        bar.ax.tick_params(labelsize=7)
        if "norm" in style:
            bar.set_ticks([0, 1, 2], labels=["bg", "square", "disc"])
    fig.suptitle(f"Subnetwork Laplace over {k} weights: one test image of each size per row")
    fig.supxlabel(
        "Each column has one colour scale for all rows (colour bar below it). Input: the image "
        "(finest level). True / predicted labels: 0 background, 1 square, 2 disc; the\n"
        "prediction is the arg-max of the probit-approximated predictive. Predictive entropy: "
        "entropy of those predictive class probabilities per pixel, 0 to ln 3 nats.\n"
        "GLM predictive variance: per pixel, the variance of the linearised (GLM) predictive's "
        "logits, diag(J Sigma J^T), summed over the 3 classes: the Laplace posterior's\n"
        "weight uncertainty seen in the output (J: Jacobian of the logits w.r.t. the selected "
        "weights; Sigma: their posterior covariance).",
        fontsize=7.5,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="tiny images, 200 weights: seconds")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG path ({DEFAULT_OUT})")
    args, _ = p.parse_known_args(argv)  # unknown options (e.g. a test runner's) are ignored
    env_quick = (
        os.environ.get("CI", "").lower() not in ("", "0", "false")
        or os.environ.get("MULTISCALE_JAC_QUICK") == "1"
        or "PYTEST_CURRENT_TEST" in os.environ
    )
    quick = args.quick or env_quick
    sizes = QUICK_SIZES if quick else SIZES
    # images per size (training, test), Adam steps, subset size, width, images for the selection
    per_size, n_test, steps, k, width, n_select = (
        (4, 1, 40, 200, 8, 6) if quick else (16, 2, 200, 1000, 12, 12)
    )
    t_start = time.perf_counter()

    torch.manual_seed(0)
    x_train, _, y_train = make_split(sizes, per_size, seed=0)
    x_test, l_test, _ = make_split(sizes, n_test, seed=1)
    model = SegFPN(width=width)
    n_params = sum(p.numel() for p in model.parameters())
    size_list = ", ".join(f"{h}x{w}" for h, w in sizes)
    print(
        f"{'quick run: ' if quick else ''}{len(x_train)} training and {len(x_test)} test images "
        f"of sizes {size_list}; SegFPN with {n_params} weights"
    )

    t0 = time.perf_counter()
    loss = train(model, x_train, y_train, steps)
    model.eval()
    print(f"trained {steps} Adam steps in {time.perf_counter() - t0:.1f} s (last loss {loss:.3f})")

    # batches of 6 mixing the three sizes: a list of samples (each [image, half image]) and a
    # list of label maps
    data = ragged_batches(x_train, y_train, batch_size=6)
    # The selection needs the exact diagonal GGN over every weight (per-sample Jacobians of all
    # pixels' logits): a few images rank the weights well enough and cost less than the fit.
    t0 = time.perf_counter()
    subset = mj.largest_variance(
        model, ragged_batches(x_train[:n_select], y_train[:n_select], 6), k
    )
    per_tensor = ", ".join(f"{n} {b - a}" for n, (a, b) in subset.offsets.items())
    print(
        f"subset: {subset.numel} of {n_params} weights by largest_variance on {n_select} images "
        f"({time.perf_counter() - t0:.1f} s): {per_tensor}"
    )

    la = mj.SubnetLaplace(model, "classification", subset, prior_precision=1.0)
    t_fit = _first_and_warm(lambda: la.fit(data, progress=False))
    lml_before = float(la.log_marginal_likelihood())
    la.optimize_prior_precision(n_steps=50)  # a scalar prior precision, on the marginal likelihood
    prec = float(la.prior_precision.flatten()[0])
    lml_after = float(la.log_marginal_likelihood())
    print(
        f"fit on {la.n_data} images: first call {t_fit[0]:.2f} s (planning included), warm "
        f"{t_fit[1]:.2f} s (the same fit again); prior precision 1 -> {prec:.3g} "
        f"(log marginal likelihood {lml_before:.1f} -> {lml_after:.1f})"
    )

    outputs: list = []
    t_pred = _first_and_warm(lambda: outputs.append(la.predictive(x_test, link_approx="probit")))
    pred = outputs[-1]
    probs, means, variances = _as_list(pred.probs), _as_list(pred.mean), _as_list(pred.variance)
    ent = [entropy(pr) for pr in probs]
    ent_map = [entropy(torch.softmax(m, dim=0)) for m in means]
    right = [pr.argmax(0) == lab for pr, lab in zip(probs, l_test)]
    ok = torch.cat([r.flatten() for r in right])

    def split_mean(maps: list[Tensor]) -> tuple[float, float]:
        flat = torch.cat([m.flatten() for m in maps])
        wrong = float(flat[~ok].mean()) if (~ok).any() else math.nan
        return float(flat[ok].mean()), wrong

    (e_ok, e_bad), (m_ok, m_bad) = split_mean(ent), split_mean(ent_map)
    print(
        f"predictive (probit) on {len(x_test)} test images: first call {t_pred[0]:.2f} s, warm "
        f"{t_pred[1]:.2f} s; pixel accuracy "
        f"{float(ok.float().mean()):.3f} ({int((~ok).sum())} of {ok.numel()} pixels wrong)"
    )
    print(
        f"mean predictive entropy: {e_ok:.3f} nats on correct pixels, {e_bad:.3f} on wrong "
        f"ones (MAP softmax alone: {m_ok:.3f} / {m_bad:.3f})"
    )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no picture")
    else:
        shown = list(range(min(3, len(x_test))))  # one image of every size
        _figure(
            plt,
            args.out,
            inputs=[x_test[i][0][0] for i in shown],
            truth=[l_test[i] for i in shown],
            predicted=[probs[i].argmax(0) for i in shown],
            entropies=[ent[i] for i in shown],
            variances=[variances[i].sum(0) for i in shown],
            k=subset.numel,
        )
        print(f"saved {args.out}")
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The examples say what they time and draw what their pictures claim (no timing is asserted)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _load(name: str) -> dict:
    """The example's functions, without running its ``__main__`` part."""
    return runpy.run_path(str(EXAMPLES / name), run_name="example_under_test")


@pytest.fixture
def plt():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_timed_examples_say_warm(name: str) -> None:
    """An example that reads a clock says in its printed text which calls it timed: warm
    calls, and the first call apart from them."""
    text = (EXAMPLES / name).read_text()
    if "perf_counter" not in text:
        pytest.skip("times nothing")
    printed = " ".join(re.findall(r'f?"([^"\n]*)"', text))
    assert "warm" in printed, name
    if "per_sample_jacobian(" in text or ".fit(" in text:
        assert "first call" in printed, name
    assert "speed-up" not in printed or "warm speed-up" in printed, name


def test_regularisation_plot_has_baseline_labels_and_legend(plt, tmp_path, monkeypatch) -> None:
    module = _load("jacobian_regularisation.py")
    runs = {
        0.0: ([(0.7, 500.0), (0.6, 700.0), (0.5, 900.0)], 0.01),
        1e-3: ([(0.7, 500.0), (0.68, 150.0), (0.67, 100.0)], 0.2),
    }
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    out = tmp_path / "reg.png"
    module["plot_runs"](plt, runs, str(out))
    assert out.is_file() and out.stat().st_size > 1000
    (fig,) = figures
    for ax in fig.axes:
        assert ax.get_xlabel() == "training step" and ax.get_ylabel()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["λ = 0 (no penalty)", "λ = 0.001"]
        assert len(ax.get_lines()) == 2


def test_segmentation_figure_shares_scales_and_explains_panels(plt, tmp_path, monkeypatch):
    import torch

    module = _load("subnet_laplace_segmentation.py")
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 6), (8, 6), (6, 8)]
    maps = {
        "inputs": [torch.randn(s, generator=g) * (k + 1) for k, s in enumerate(shapes)],
        "truth": [torch.randint(3, s, generator=g) for s in shapes],
        "predicted": [torch.randint(3, s, generator=g) for s in shapes],
        "entropies": [torch.rand(s, generator=g) for s in shapes],
        "variances": [torch.rand(s, generator=g) * (k + 1) for k, s in enumerate(shapes)],
    }
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    out = tmp_path / "seg.png"
    module["_figure"](plt, out, k=200, **maps)
    assert out.is_file() and out.stat().st_size > 1000
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 15  # 3 rows x 5 columns
    by_column: dict[str, list] = {}
    for ax in panels:
        by_column.setdefault(ax.get_subplotspec().colspan.start, []).append(ax)
    assert len(by_column) == 5
    for column in by_column.values():  # one colour scale per column, shared by its rows
        limits = {ax.get_images()[0].get_clim() for ax in column}
        assert len(limits) == 1, limits
    inputs = torch.cat([m.flatten() for m in maps["inputs"]])
    clim = by_column[0][0].get_images()[0].get_clim()
    assert clim == pytest.approx((float(inputs.min()), float(inputs.max())))
    variances = torch.cat([m.flatten() for m in maps["variances"]])
    assert by_column[4][0].get_images()[0].get_clim()[1] == pytest.approx(float(variances.max()))
    colourbars = [ax for ax in fig.axes if not ax.get_images() and ax.get_label() == "<colorbar>"]
    assert len(colourbars) == 5
    titles = [ax.get_title() for ax in panels if ax.get_title()]
    assert titles[-1] == "GLM predictive variance" and "predictive entropy" in titles
    caption = fig.get_supxlabel()
    for words in ("one colour scale for all rows", "GLM", "variance", "diag(J Sigma J^T)"):
        assert words in caption


@pytest.mark.slow
def test_regularisation_example_prints_both_runs_and_warm_times(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    module = _load("jacobian_regularisation.py")
    out = tmp_path / "reg.png"
    module["main"](["--steps", "3", "--plot", str(out)])
    printed = capsys.readouterr().out
    assert "lam = 0 (no penalty; S only measured)" in printed and "lam = 0.001:" in printed
    assert "one training step, warm" in printed and out.is_file()


@pytest.mark.slow
def test_convblock_example_prints_first_and_warm(capsys) -> None:
    runpy.run_path(str(EXAMPLES / "seed_convblock.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "first call" in printed and "(planning included), warm" in printed
    assert "warm speed-up" in printed

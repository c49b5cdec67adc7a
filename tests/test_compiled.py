"""Models with ``torch.compile``'d functions inside: exact on the first call in a fresh process.

Dynamo traced a compiled helper through the library's transforms and modes and failed on the
first call (``arange() ... got (int, device=torch.Size)``; torchvision's compiled ``_roi_align``
the same way). The library runs such functions eagerly while it runs the model
(:func:`multiscale_jac.adapter.eager_compiled`); dynamo's switch and the environment are put back
after. Each case runs in a subprocess: the failure needs a process where nothing ran before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    import multiscale_jac as mj
    from multiscale_jac.reference import per_sample_jacobian_loop

    @torch.compile(dynamic=True, backend="eager")
    def weighted_pool(x):
        w = torch.arange(x.shape[-1], device=x.device).to(x.dtype) / x.shape[-1]
        return (x * w).sum(-1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 3, padding=1)
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(torch.tanh(weighted_pool(self.conv(x))))

    torch.manual_seed(0)
    model = Net().double().eval()
    x = torch.randn(5, 2, 6, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    what = sys.argv[1]
    if what == "jacobian":
        got = mj.per_sample_jacobian(model, x).jacobian
        ref = per_sample_jacobian_loop(model, x).jacobian
    elif what == "entries":
        params = mj.ParamSubset.from_indices(model, {"fc.weight": [0, 3], "conv.weight": [1]})
        got = mj.per_sample_jacobian(model, x, params=params).jacobian
        ref = per_sample_jacobian_loop(model, x, params=params).jacobian
    else:
        got = mj.diag_fisher(model, [(x, y)]).flat  # the default: layer-wise
        ref = mj.diag_fisher(model, [(x, y)], method="vmap", chunk_size=1).flat
    dynamo = sys.modules.get("torch._dynamo")
    print(json.dumps({
        "error": float((got - ref).abs().max()),
        "scale": float(ref.abs().max()),
        "env": os.environ.get("TORCH_COMPILE_DISABLE"),
        "disabled": None if dynamo is None else bool(dynamo.config.disable),
    }))
    """
)


def _run(what: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHDYNAMO", "TORCH_COMPILE"))
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, what],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["jacobian", "entries", "fisher"])
def test_compiled_inner_function_is_exact_on_the_first_call(what: str) -> None:
    out = _run(what)
    assert out["scale"] > 0
    assert out["error"] <= 1e-10 * max(1.0, out["scale"])
    # dynamo's switch and the environment as the user had them
    assert out["env"] is None
    assert out["disabled"] in (None, False)


def _torchvision_ok() -> bool:
    """torchvision imports and its ops load (a build for another torch fails at import)."""
    probe = "import torchvision.ops; torchvision.ops.MultiScaleRoIAlign"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


_ROI = textwrap.dedent(
    """
    import json
    from collections import OrderedDict
    import torch
    from torch import nn
    from torchvision.ops import MultiScaleRoIAlign
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    import multiscale_jac as mj
    from multiscale_jac.reference import per_sample_jacobian_loop

    class RoIHead(nn.Module):
        def __init__(self, c=4, rep=16, classes=3):
            super().__init__()
            self.pool = MultiScaleRoIAlign(["p2", "p3"], output_size=4, sampling_ratio=2)
            self.box_head = TwoMLPHead(c * 16, rep)
            self.predictor = FastRCNNPredictor(rep, classes)
            boxes = [[2.0, 2.0, 20.0, 20.0], [8.0, 4.0, 30.0, 28.0], [0.0, 0.0, 31.0, 31.0]]
            self.register_buffer("boxes", torch.tensor(boxes))

        def forward(self, feats):
            n = feats["p2"].shape[0]
            x = self.pool(feats, [self.boxes] * n, [(32, 32)] * n)
            scores, _ = self.predictor(self.box_head(x))
            return scores.reshape(n, -1)

    torch.manual_seed(0)
    model = RoIHead().double().eval()
    feats = OrderedDict(
        p2=torch.randn(3, 4, 16, 16, dtype=torch.float64),
        p3=torch.randn(3, 4, 8, 8, dtype=torch.float64),
    )
    got = mj.per_sample_jacobian(model, feats, params="predictor.*").jacobian
    ref = per_sample_jacobian_loop(model, feats, params="predictor.*").jacobian
    print(json.dumps({"error": float((got - ref).abs().max()), "scale": float(ref.abs().max())}))
    """
)


@pytest.mark.slow
def test_torchvision_roi_head_is_exact_on_the_first_call() -> None:
    if not _torchvision_ok():
        pytest.skip("torchvision does not import with this torch")
    proc = subprocess.run([sys.executable, "-c", _ROI], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scale"] > 0 and out["error"] <= 1e-10 * max(1.0, out["scale"])

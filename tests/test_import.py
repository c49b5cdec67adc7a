"""Importing the package initialises no CUDA and pulls in no optional dependency."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

OPTIONAL = [
    "tqdm",
    "hypothesis",
    "pytest",
    "matplotlib",
    "scipy",
    "pandas",
    "curvlinops",
    "laplace",
    "backpack",
]


@pytest.mark.slow
def test_import_is_light() -> None:
    code = (
        "import json, sys, torch\n"
        "before = set(sys.modules)  # torch itself may import tqdm when it is installed\n"
        "import multiscale_jac, multiscale_jac.reference, multiscale_jac.models, multiscale_jac.cli\n"
        f"opt = [m for m in {OPTIONAL!r} if m in sys.modules and m not in before]\n"
        "print(json.dumps({'cuda_init': torch.cuda.is_initialized(), 'optional': opt}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"cuda_init": False, "optional": []}


def test_public_names() -> None:
    import multiscale_jac as mj

    for name in mj.__all__:
        assert hasattr(mj, name), name
    assert callable(mj.per_sample_jacobian) and callable(mj.reference.per_sample_jacobian_loop)

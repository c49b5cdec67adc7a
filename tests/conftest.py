from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

from cases import CASES, make_subset

import multiscale_jac as mj
from multiscale_jac.reference import per_sample_jacobian_loop

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# by hand, to explore: HYPOTHESIS_PROFILE=deep python -m pytest -k "random or hypothesis or
# property or round_trip" (thousands of examples per property, a fresh seed every run)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    derandomize=False,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def examples(ci: int, dev: int) -> int:
    """Examples for a property that sets its own count: ``ci`` under CI, ``dev`` in the edit
    loop, the profile's thousands under ``HYPOTHESIS_PROFILE=deep``."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "deep":
        return settings().max_examples
    return ci if os.environ.get("CI") else dev


torch.set_num_threads(min(torch.get_num_threads(), 2))

CASE_BY_ID = {c.id: c for c in CASES}


@functools.cache
def zoo_model(case_id: str) -> torch.nn.Module:
    return CASE_BY_ID[case_id].build()


@functools.cache
def zoo_reference(case_id: str, subset_kind: str) -> tuple[mj.ParamSubset, mj.JacobianResult]:
    """The loop oracle for a zoo case and subset kind (computed once per session)."""
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    subset = make_subset(model, subset_kind, case)
    ref = per_sample_jacobian_loop(model, case.inputs(), params=subset, output_fn=case.output_fn)
    return subset, ref


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


def smallest_budget(call) -> int:
    """The smallest ``memory_budget`` a call accepts: ``call(budget)`` with one byte raises the
    library's too-small error, whose message states the minimum."""
    import re

    with pytest.raises(ValueError, match="below the estimated minimum") as err:
        call(1)
    return int(re.search(r"estimated minimum of (\d+) bytes", str(err.value)).group(1))


def reference_machine():
    """The machine every test prices routes on (``_calibration.use_machine``): a 2-core x86
    CPU's calibration (float32), so that a test's expected route depends on neither the
    machine nor its load (``tests/test_tuning.py`` calibrates the real one)."""
    from multiscale_jac._calibration import Machine

    return Machine(
        {
            "fwd": (5.5e-05, 2.3e-05, 2.0e-06, 3.4e-06),
            "jvp": (2.5e-04, 3.0e-04, 5.2e-06, 1.0e-05),
            "vjp": (4.9e-04, 1.2e-04, 1.0e-05, 1.8e-05),
        },
        6.3e-12,
        {"fwd": 5.0e-05, "jvp": 5.0e-04, "vjp": 3.0e-04},
        1.2e-09,
    )


@pytest.fixture(autouse=True)
def _reference_machine():
    """Every test starts with no decisions and prices routes on :func:`reference_machine`
    (the default ``tune="auto"`` runs as users run it: the estimate, nothing timed)."""
    from multiscale_jac import _calibration, clear_plan_cache

    clear_plan_cache()
    before = _calibration.use_machine(reference_machine())
    yield
    _calibration.use_machine(before)


def jacnorm_jobs(monkeypatch) -> list:
    """The ``jacobian_sq_norm`` jobs created from here on (for their notes)."""
    from multiscale_jac import jacnorm

    jobs: list = []
    init = jacnorm._Job.__init__

    def keep(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        jobs.append(self)

    monkeypatch.setattr(jacnorm._Job, "__init__", keep)
    return jobs


# ------------------------------------------------------------------ laplace-torch, where installed
#: an interpreter with laplace-torch 0.3 for the tests that run laplace-torch beside the library
#: (its examples, where its numbers differ); without one they are skipped
ENV_VAR = "MJ_LAPLACE_TORCH_PYTHON"

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, pathlib, sys
try:
    dist = md.distribution("laplace-torch")
except md.PackageNotFoundError:
    sys.exit("the distribution laplace-torch is not installed")
spec = iu.find_spec("laplace")
theirs = pathlib.Path(dist.locate_file("laplace/__init__.py")).resolve()
if spec is None or spec.origin is None or pathlib.Path(spec.origin).resolve() != theirs:
    sys.exit(f"import laplace gives {spec and spec.origin}, not laplace-torch's {theirs}")
import laplace, numpy, torch
print(f"laplace-torch {dist.version}, torch {torch.__version__}")
"""


def _base_env(keep_pythonpath: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LT_SHIM_MODE", None)
    if not keep_pythonpath:
        env.pop("PYTHONPATH", None)
    # the tolerances were measured single-threaded; two cores are shared with other work
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _probe(python: str, env: dict[str, str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"{type(err).__name__}: {err}"
    out = (done.stdout + done.stderr).strip()
    return done.returncode == 0, out.splitlines()[-1] if out else f"exit {done.returncode}"


@functools.cache
def _laplace_torch() -> tuple[str, dict[str, str]] | str:
    """(interpreter, its environment) with laplace-torch, or why there is none."""
    env = _base_env(keep_pythonpath=True)
    ok, said = _probe(sys.executable, env)
    if ok:
        return sys.executable, env
    named = os.environ.get(ENV_VAR)
    if not named:
        return (
            f"laplace-torch is not importable here ({said}); set {ENV_VAR} to a Python "
            "interpreter that has laplace-torch 0.3 to run laplace-torch beside the library"
        )
    env = _base_env(keep_pythonpath=False)
    ok, said = _probe(named, env)
    if not ok:
        # named on purpose: a wrong name is an error, not a reason to skip
        pytest.fail(f"{ENV_VAR}={named} is not an interpreter with laplace-torch: {said}")
    return named, env


@pytest.fixture(scope="session")
def laplace_torch() -> tuple[str, dict[str, str]]:
    found = _laplace_torch()
    if isinstance(found, str):
        pytest.skip(found)
    return found

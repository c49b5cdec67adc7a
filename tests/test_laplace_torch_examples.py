"""laplace-torch 0.3's own examples, run with laplace-torch and with ``import laplace`` resolved to
:mod:`multiscale_jac.laplace` (slow; skipped without laplace-torch).

``tests/laplace_torch_examples/`` holds laplace-torch's eight examples (aleximmer/Laplace
``examples/`` at 44ea62a, MIT), adapted to run offline, and a shim package (``shim/laplace``)
that makes ``import laplace`` give this library (its README.md says what was adapted). Each test
runs one example in two subprocesses, in a temporary copy of that folder, with an interpreter that
has laplace-torch installed: as it is ("lt"), and with ``PYTHONPATH=shim:<this checkout>`` and
``LT_SHIM_MODE=frontdoor`` ("mj": every laplace-torch class the example builds is
``multiscale_jac.laplace.Laplace(...)``). Both must exit 0. Each example
prints ``R| name = numbers`` lines; every name must appear on both sides with as many numbers,
and every number must agree to the example's tolerance (:data:`RTOL`, :data:`LOOSER`), except
the :data:`KNOWN_DIFFERENCES`, where laplace-torch's number is wrong (those are only required
to exist on both sides).

Which interpreter: the one running pytest when its ``import laplace`` is laplace-torch (the
``laplace-torch`` distribution's own ``laplace/__init__.py``, not a shim), else the one named by
the environment variable ``MJ_LAPLACE_TORCH_PYTHON`` (it needs laplace-torch 0.3, torch and
numpy); else every example is skipped. All eight take about 10 minutes on 2 cores::

    MJ_LAPLACE_TORCH_PYTHON=/path/to/venv/bin/python python -m pytest \\
        tests/test_laplace_torch_examples.py -m slow -v
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = Path(__file__).resolve().parent / "laplace_torch_examples"
SHIM = EXAMPLES / "shim"
#: seconds each side of one example may run (the slowest, bayesopt_example, takes 1-3 minutes
#: per side on a loaded 2-core machine)
TIMEOUT_S = 900

NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py"))

# ------------------------------------------------------------------------------ tolerances
#: example -> relative tolerance of its numbers; the largest relative difference measured
#: (laplace-torch 0.3, torch 2.13.0, float32 unless said, OMP_NUM_THREADS=1) in the comment
RTOL: dict[str, float] = {
    # float64 throughout (the example sets it): every number equal in all 10 printed digits
    "bayesopt_example": 1e-7,
    # 1.8e-5: prior_precision (100 Adam steps on the float32 marglik); the rest <= 1.0e-6
    "calibration_example": 1e-4,
    # 8.0e-6 (nll_m50: float32 kernels of 50 context samples, 892,010 weights)
    "calibration_gp_example": 1e-4,
    # 9.6e-7 (glm_f_var), 7.1e-7 (prior_precision)
    "expectation_example": 1e-5,
    # 8.7e-7 (ll_prior_precision); lora_prior in LOOSER, ll_probs in KNOWN_DIFFERENCES
    "huggingface_example": 1e-5,
    # 1.6e-7 (pred_at_prior_1); the gridsearch's numbers in KNOWN_DIFFERENCES
    "readme_snippet": 1e-5,
    # marglik_at_e_e and f_mu equal in all 10 digits; the rest in LOOSER
    "regression_example": 1e-5,
    # 1.2e-6 (log_marginal_likelihood)
    "reward_modeling_example": 1e-5,
}
#: the absolute part of every tolerance: this fraction of the largest magnitude on the same
#: ``R|`` line (a summary's mean of entries that cancel carries their round-off: huggingface's
#: ll_H mean is -3.9e-10 against -5.3e-10, of a 64 x 64 matrix with entries up to 2.5)
ATOL_FRACTION = 1e-6

# The regression example tunes (log prior precision, log sigma) by 1000 Adam steps on the
# float32 marginal likelihood of a full posterior over 151 weights whose GGN has 141 of its 151
# eigenvalues below 1e-2 (largest 1.2e4): near the optimum float32 cannot resolve it. Measured on
# the example's own MAP network: in float64 both libraries give the same marglik, gradients,
# tuned values and predictives to 10 digits (prior 0.1005945305, sigma 0.2818510963; on a
# float64-trained network the gradients also equal central differences), while in float32 the
# gradient w.r.t. log sigma at the optimum is off by 45% (laplace-torch) and 66% (here), and
# each side's printed numbers are off the float64 ones by up to the "lt"/"mj" figures below;
# the "gap" is between the two sides.
_F32_REGRESSION = "float32 round-off of an ill-conditioned full posterior (see above)"
#: (example, name) -> (relative tolerance, why it is looser than the example's)
LOOSER: dict[tuple[str, str], tuple[float, str]] = {
    # gap 3.7e-3 / 3.8e-3 / 3.8e-3; lt 2.3e-3, mj 6.0e-3
    ("regression_example", "tuned_prior_precision"): (2e-2, _F32_REGRESSION),
    ("regression_example", "la.prior_precision_after_loop"): (2e-2, _F32_REGRESSION),
    ("regression_example", "loaded_prior_precision"): (2e-2, _F32_REGRESSION),
    # gap 8.9e-5 / 2.8e-4 / 2.8e-4; lt 1.5e-4, mj 4.3e-4
    ("regression_example", "tuned_sigma"): (3e-3, _F32_REGRESSION),
    ("regression_example", "la.sigma_noise_after_loop"): (3e-3, _F32_REGRESSION),
    ("regression_example", "loaded_sigma"): (3e-3, _F32_REGRESSION),
    # gap 8.7e-3; lt 7.2e-3, mj 1.2e-2
    ("regression_example", "f_var"): (5e-2, _F32_REGRESSION),
    # gap 4.3e-3; lt 3.6e-3, mj 6.0e-3
    ("regression_example", "pred_std"): (5e-2, _F32_REGRESSION),
    # gap 4.9e-2 (the most negative covariance: -0.785 against -0.825); lt 4.5e-2, mj 1.2e-2;
    # at the same hyperparameters laplace-torch's float32 min is 13% off float64's (here 0.5%)
    ("regression_example", "f_cov"): (2e-1, _F32_REGRESSION),
    # marglik_training: the network and (prior precision, sigma) trained together for 1,000
    # epochs in float32, where round-off grows through the training (in float64 both sides
    # agree to 1e-13: tests/test_laplace_torch_differences.py); gap 2.8e-2 / 5.1e-3 / 4.4e-2
    ("regression_example", "mt_prior_precision"): (1e-1, "float32 round-off over 1,000 epochs"),
    ("regression_example", "mt_sigma"): (3e-2, "float32 round-off over 1,000 epochs"),
    ("regression_example", "mt_pred_std"): (1e-1, "float32 round-off over 1,000 epochs"),
    # gap 6.9e-5: the prior precision after 100 Adam steps on the float32 marglik of a Kron
    # posterior over the LoRA weights; float64 gives 0.3695125624 on both sides, float32
    # laplace-torch is off it by 2.3e-6, this library by 7.2e-5
    ("huggingface_example", "lora_prior"): (3e-4, "float32 optimum of a flat marginal likelihood"),
}

# ------------------------------------------------------------------------ known differences
#: (example, name) -> why laplace-torch's number is wrong. These are not compared, only
#: required on both sides. Measured (laplace-torch vs this library, largest relative difference):
#: readme_snippet prior_precision 9.326e-4 vs 5.337e-4 (0.43), pred 2.5e-3 (absmax 0.13792 vs
#: 0.13758), log_marginal_likelihood -15452.81 vs -17074.52 (0.095); huggingface_example
#: ll_probs 6.5e-2 (min 0.27337 vs 0.25557, absmax 0.72663 vs 0.74443, last 0.58918 vs 0.60073).
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    # Both libraries' validation NLLs agree (8 digits at the first 20 of the 100 grid values,
    # which hold the minimum; predictives to 3.5e-7): the minimum is at grid index 9 (5.34e-4). laplace-torch 0.3's _gridsearch hands the same RunningNLLMetric to
    # every grid value without reset(), so each "loss" is the mean over all grid values so far,
    # whose minimum is at index 12 (9.33e-4).
    ("readme_snippet", "prior_precision"): "laplace-torch's gridsearch never resets its metric",
    ("readme_snippet", "pred"): "the predictive at that prior precision",
    ("readme_snippet", "log_marginal_likelihood"): "the marglik at that prior precision",
    # feature_reduction="pick_last": laplace-torch's predictive takes the Jacobian's features
    # at the last position, a pad token for three of the four (padded) sequences, while the
    # model's logits come from the last non-pad token (GPT2ForSequenceClassification's pooling),
    # as does laplace-torch's own Hessian (equal to ours to 3e-7). Here the Jacobian is that of
    # the model's output; the unpadded sequence's probabilities agree on both sides.
    ("huggingface_example", "ll_probs"): "laplace-torch's pick_last Jacobian reads pad tokens",
}


# ---------------------------------------------------------------------------- interpreter
# ------------------------------------------------------------------------ running, reading
def _run(name: str, side: str, python: str, env: dict[str, str], where: Path) -> tuple[int, str]:
    """Run the example in its own copy of the folder (the regression example writes
    state_dict.bin beside itself); exit status and stdout + stderr."""
    work = where / side
    shutil.copytree(EXAMPLES, work, ignore=shutil.ignore_patterns("__pycache__", "shim"))
    env = dict(env)
    if side == "mj":
        path = [str(SHIM), str(ROOT)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env.update(PYTHONPATH=os.pathsep.join(path), LT_SHIM_MODE="frontdoor")
    try:
        done = subprocess.run(
            [python, f"{name}.py"],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        out = err.output.decode(errors="replace") if isinstance(err.output, bytes) else err.output
        pytest.fail(f"{name} ({side}) ran past {TIMEOUT_S} s; its output:\n{(out or '')[-4000:]}")
    return done.returncode, done.stdout


def read_numbers(text: str) -> dict[str, list[float] | str]:
    """``R| name = numbers  # comment`` lines: name -> numbers (a line that is not numbers
    stays text). A name printed again gets ``#2``, ``#3``, ... appended."""
    found: dict[str, list[float] | str] = {}
    for name, value in re.findall(r"^R\| (.+?) = (.*)$", text, re.MULTILINE):
        value = value.split("#")[0].strip()
        try:
            parsed: list[float] | str = [float(v) for v in value.split()]
        except ValueError:
            parsed = value
        key, n = name, 1
        while key in found:
            n += 1
            key = f"{name}#{n}"
        found[key] = parsed
    return found


def _base(key: str) -> str:
    return key.split("#")[0]


def compare(
    example: str, lt: dict[str, list[float] | str], mj: dict[str, list[float] | str]
) -> tuple[list[str], list[str]]:
    """(problems, one line per number compared) for one example's two sides."""
    problems: list[str] = []
    lines: list[str] = []
    for key in sorted(set(lt) | set(mj)):
        if key not in lt or key not in mj:
            problems.append(f"{key}: printed only by {'laplace-torch' if key in lt else 'mj'}")
            continue
        a, b = lt[key], mj[key]
        if isinstance(a, str) or isinstance(b, str) or len(a) != len(b):
            if a != b:
                problems.append(f"{key}: {a!r} (laplace-torch) vs {b!r} (mj)")
            continue
        if (example, _base(key)) in KNOWN_DIFFERENCES:
            lines.append(f"{key}: known difference, {a} vs {b}")
            continue
        rtol = LOOSER.get((example, _base(key)), (RTOL[example], ""))[0]
        atol = ATOL_FRACTION * max((abs(v) for v in a + b if math.isfinite(v)), default=0.0)
        worst = used = 0.0  # the largest relative difference, the largest share of a tolerance
        for x, y in zip(a, b):
            if x == y or (math.isnan(x) and math.isnan(y)):
                continue
            diff, scale = abs(x - y), max(abs(x), abs(y))
            worst = max(worst, diff / scale)
            used = max(used, diff / (rtol * scale + atol))
            if not diff <= rtol * scale + atol:
                problems.append(
                    f"{key}: {x!r} (laplace-torch) vs {y!r} (mj), relative {diff / scale:.2e}, "
                    f"tolerance rtol {rtol:g} + atol {atol:.1e}"
                )
        lines.append(f"{key}: relative {worst:.1e}, {used:.0%} of its tolerance (rtol {rtol:g})")
    return problems, lines


def _errors(text: str) -> list[str]:
    """The sections the example reported failing (huggingface_example goes on after one)."""
    return sorted(set(re.findall(r"^ERROR in (\S+):", text, re.MULTILINE)))


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


# ------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_example(name: str, laplace_torch, tmp_path) -> None:
    python, env = laplace_torch
    rc_lt, out_lt = _run(name, "lt", python, env, tmp_path)
    assert rc_lt == 0 and "DONE" in out_lt, f"{name} failed with laplace-torch:\n{_tail(out_lt)}"
    rc_mj, out_mj = _run(name, "mj", python, env, tmp_path)
    assert rc_mj == 0 and "DONE" in out_mj, f"{name} failed with multiscale_jac:\n{_tail(out_mj)}"
    assert _errors(out_lt) == _errors(out_mj), (
        f"{name}: sections failing differ: {_errors(out_lt)} (laplace-torch) vs "
        f"{_errors(out_mj)} (mj)\n--- laplace-torch:\n{_tail(out_lt)}\n--- mj:\n{_tail(out_mj)}"
    )
    lt, mj = read_numbers(out_lt), read_numbers(out_mj)
    assert lt, f"{name} printed no R| line:\n{_tail(out_lt)}"
    problems, lines = compare(name, lt, mj)
    print(f"{name}:\n  " + "\n  ".join(lines))
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_tables_name_printed_numbers() -> None:
    """Every example has a tolerance, and every entry of the tables names an example here and
    a number it prints (``R("name", ...)`` or ``R(f"name...``)."""
    assert len(NAMES) == 8 and set(RTOL) == set(NAMES)
    for example, key in [*LOOSER, *KNOWN_DIFFERENCES]:
        assert example in NAMES, example
        text = (EXAMPLES / f"{example}.py").read_text()
        assert re.search(rf"R\(\s*f?\"{re.escape(key)}\"", text), (example, key)

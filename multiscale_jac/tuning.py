"""Decisions that outlive the process: what ``tune=True`` measured (routes, chunks,
layer-wise kernels), written to a file and read back, like a compiled-kernel cache.

A second process that loads the file measures nothing for calls it covers::

    import multiscale_jac as mj

    mj.diag_fisher(model, loader, tune=True)  # measures (first call of these shapes)
    mj.tuning.save("decisions.pt")

    # another process, the same model structure, inputs, options, machine and torch
    mj.tuning.load("decisions.pt")
    mj.diag_fisher(model, loader)  # nothing timed: the saved choice runs

Or name a file in the environment variable ``MULTISCALE_JAC_TUNING_CACHE``: it is read on
the first call that looks a decision up and written when the process exits.

A decision is keyed by everything it depends on: the model's structure (module types and
names, train/eval flags, parameter and buffer shapes, dtypes and devices: not their values),
the inputs' shape signatures and dtypes, the parameter subset, the options, the output
function (by its code), the library version and the machine (torch version, CPU threads,
CUDA device names). An
entry whose key does not match a call is never used; a decision whose key cannot be written
(an output function that is not a plain function or method) stays in the process only.
Files are read with ``torch.load(weights_only=True)``: plain data and the library's own
decision types only.

The machine's calibration (what an op and a flop cost here, which ``tune="auto"`` prices
routes with) is kept apart, in ``~/.cache/multiscale_jac/machine.json``
(:func:`calibration_path`; ``MULTISCALE_JAC_CACHE_DIR`` names another folder, ``off`` none);
:func:`calibrate` measures it again.
"""

from __future__ import annotations

from ._calibration import Machine, calibrate
from ._calibration import cache_path as calibration_path
from ._tuning import ENV_VAR, clear, load, save

__all__ = ["ENV_VAR", "Machine", "calibrate", "calibration_path", "clear", "load", "save"]

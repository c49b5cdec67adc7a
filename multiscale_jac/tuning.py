"""Choices that outlive the process: what ``tune=True`` measured (routes, chunks, layer-wise
kernels), written to a JSON file and read back. A process that loads the file times nothing
for the calls it covers::

    import multiscale_jac as mj

    mj.diag_fisher(model, loader, tune=True)  # measures (first call of these shapes)
    mj.tuning.save("decisions.json")

    # another process: the same model structure, inputs, options, library and machine
    mj.tuning.load("decisions.json")
    mj.diag_fisher(model, loader)  # nothing timed: the saved choice runs

A choice is a route's name and chunk, keyed by a digest of the model's structure (module
types, names and settings, train/eval flags, parameter and buffer shapes, dtypes and devices:
not their values), the inputs' shapes and dtypes, the subset, the options, the output
function (by its name), the library and torch versions and the machine (CPU threads, CUDA
device names). A choice only picks among routes that all give the same numbers: a key that
matches where it should not costs speed, never a wrong number.

The machine's calibration (what an op and a flop cost here, which ``tune="auto"`` prices
routes with) is kept apart, in ``~/.cache/multiscale_jac/machine.json``
(:func:`calibration_path`; ``MULTISCALE_JAC_CACHE_DIR`` names another folder, ``off`` none);
:func:`calibrate` measures it again.
"""

from __future__ import annotations

from ._calibration import Machine, calibrate
from ._calibration import cache_path as calibration_path
from ._tuning import clear, load, save

__all__ = ["Machine", "calibrate", "calibration_path", "clear", "load", "save"]

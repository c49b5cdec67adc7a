"""multiscale_jac: per-sample Jacobians and curvature for multi-resolution PyTorch networks.

Layers (each its own module; data flows one way):

1. packing   -- :func:`pack`, :class:`PackedBatch`
2. adapter   -- :class:`PerSampleFunction` (unmodified model -> pure per-sample function)
3. masked    -- masked execution of padded levels (:class:`UnsupportedOpError`) and
                :func:`map_levels` (one call of a shared head over all levels)
4. subset    -- :class:`ParamSubset` (which parameter entries are differentiated)
5. engine    -- :func:`per_sample_jacobian`, :class:`JacobianResult`
6. derived   -- :func:`diag_fisher` (diagonal Fisher / GGN over data),
                :func:`jacobian_sq_norm` (the Jacobian-norm regulariser and its exact gradient),
                both on the per-layer closed forms of :mod:`~multiscale_jac.layerwise`;
                :class:`SubnetLaplace` (subset GGN, marginal likelihood, GLM predictive),
                :class:`DiagLaplace` (diagonal GGN over every weight) and laplace-torch's
                front door :func:`Laplace`
7. reference -- :func:`reference.per_sample_jacobian_loop` (the oracle)

:mod:`~multiscale_jac.tuning` saves and loads what ``tune=True`` measured.
"""

from . import reference, tuning
from .adapter import PerSampleFunction
from .engine import PlanCacheInfo, clear_plan_cache, per_sample_jacobian, plan_cache_info
from .enums import (
    ArgumentTypeError,
    BatchNormPolicy,
    Entries,
    Estimator,
    FallbackWarning,
    FisherKind,
    FisherMethod,
    HessianKind,
    HessianStructure,
    InputKind,
    JacNormMethod,
    Layout,
    Likelihood,
    LinkApprox,
    MemoryBudgetError,
    Mode,
    ModuleStateWarning,
    PredType,
    PriorStructure,
    Randomness,
    Strategy,
    SubsetOfWeights,
    Tune,
    TuningMethod,
    UnsupportedOpError,
)
from .fisher import DiagFisherResult, diag_fisher
from .jacnorm import jacobian_sq_norm, jacobian_sq_norm_backward
from .laplace import DiagLaplace, GLMPredictive, KronLaplace, Laplace, SubnetLaplace
from .levels import LevelOutputs, map_levels
from .packing import Bucket, PackedBatch, Signature, pack
from .result import JacobianResult
from .selection import largest_variance
from .subset import ParamSubset

__version__ = "0.1.0"

__all__ = [
    # packing
    "Bucket",
    "PackedBatch",
    "Signature",
    "pack",
    # adapter
    "PerSampleFunction",
    # masked execution and level packing
    "LevelOutputs",
    "UnsupportedOpError",
    "map_levels",
    # parameter subsets
    "ParamSubset",
    # engine
    "JacobianResult",
    "PlanCacheInfo",
    "clear_plan_cache",
    "per_sample_jacobian",
    "plan_cache_info",
    "tuning",
    # derived quantities
    "DiagFisherResult",
    "Estimator",
    "FisherKind",
    "FisherMethod",
    "JacNormMethod",
    "Likelihood",
    "diag_fisher",
    "jacobian_sq_norm",
    "jacobian_sq_norm_backward",
    # subnetwork and diagonal Laplace
    "DiagLaplace",
    "GLMPredictive",
    "HessianKind",
    "HessianStructure",
    "KronLaplace",
    "Laplace",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "SubnetLaplace",
    "SubsetOfWeights",
    "TuningMethod",
    "largest_variance",
    # reference
    "reference",
    # option enums, warnings and errors
    "ArgumentTypeError",
    "BatchNormPolicy",
    "Entries",
    "FallbackWarning",
    "InputKind",
    "MemoryBudgetError",
    "Layout",
    "Mode",
    "ModuleStateWarning",
    "Randomness",
    "Strategy",
    "Tune",
]

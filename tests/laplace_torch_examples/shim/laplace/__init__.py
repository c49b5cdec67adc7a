"""A ``laplace`` package for running laplace-torch's own tests against multiscale_jac.

Put the folder above this one first on ``sys.path`` (with multiscale_jac importable and the
real laplace-torch installed). ``import laplace`` then:

1. loads the installed laplace-torch (found on ``sys.path`` past this shim) as ``laplace``
   itself, so its own modules import each other exactly as without the shim;
2. copies its top-level namespace here and replaces, in the namespaces the tests import
   from, the names listed in ``NAMES`` (and, with ``LT_SHIM_MODE=frontdoor``, ``ROUTES``)
   by multiscale_jac's. The modules ``laplace.baselaplace``, ``laplace.laplace``,
   ``laplace.subnetlaplace`` and ``laplace.lllaplace`` seen through ``sys.modules`` become
   copies with those names replaced; laplace-torch's own code keeps its own module globals,
   so its internals (backends, subnet masks, ``isinstance`` checks) still see laplace-torch's
   classes. Everything not listed comes from laplace-torch unchanged.

Modes (environment variable ``LT_SHIM_MODE``):

``names`` (default)
    Only the names that ``multiscale_jac.laplace`` exports under laplace-torch's own names:
    ``Laplace``, ``SubnetLaplace``, ``DiagLaplace``.
``frontdoor``
    Also laplace-torch's concrete classes that its ``Laplace(...)`` dispatches to, each
    routed through ``multiscale_jac.laplace.Laplace`` with the matching
    ``subset_of_weights``/``hessian_structure`` (what a user gets by changing the import and
    calling the front door); ``isinstance(obj, FullLaplace)`` etc. answer for
    multiscale_jac objects by their structure and subset.
``lenient``
    ``frontdoor`` plus one translation that multiscale_jac refuses: ``backend=`` of a GGN
    backend is dropped and of an empirical-Fisher backend becomes ``hessian="empirical"``
    (other backends are passed on and refused). It measures what accepting ``backend=``
    would unlock and shows the value assertions hidden behind it; it is not the library's
    behaviour.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types

_SHIM_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODE = os.environ.get("LT_SHIM_MODE", "names") or "names"
if MODE not in ("names", "frontdoor", "lenient"):
    raise ImportError(f"LT_SHIM_MODE must be 'names', 'frontdoor' or 'lenient'; got {MODE!r}")


def _load_real() -> types.ModuleType:
    """The installed laplace-torch, executed as ``laplace`` (this module is put back after)."""
    paths = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _SHIM_ROOT]
    spec = importlib.machinery.PathFinder.find_spec("laplace", paths)
    if spec is None or spec.loader is None:
        raise ImportError("laplace-torch is not installed beside the shim")
    real = importlib.util.module_from_spec(spec)
    me = sys.modules[__name__]
    sys.modules["laplace"] = real
    try:
        spec.loader.exec_module(real)
    finally:
        sys.modules["laplace"] = me
    return real


_real = _load_real()
REAL = _real  # laplace-torch's top-level module, for the runner and for comparisons
import multiscale_jac.laplace as _mjl  # noqa: E402

_mj_Laplace, _mj_DiagLaplace, _mj_SubnetLaplace = _mjl.Laplace, _mjl.DiagLaplace, _mjl.SubnetLaplace
if MODE == "lenient":
    from laplace.curvature.curvature import EFInterface as _EF  # noqa: E402
    from laplace.curvature.curvature import GGNInterface as _GGN  # noqa: E402

    def _translate(kwargs: dict) -> dict:
        backend = kwargs.get("backend")
        if isinstance(backend, type) and issubclass(backend, (_EF, _GGN)):
            kwargs = dict(kwargs)
            del kwargs["backend"]
            kwargs.pop("backend_kwargs", None)
            if issubclass(backend, _EF):
                kwargs["hessian"] = "empirical"
        return kwargs

    def _lenient_laplace(model, likelihood, *args, **kwargs):
        return _mj_Laplace(model, likelihood, *args, **_translate(kwargs))

    _lenient_laplace.__name__ = _lenient_laplace.__qualname__ = "Laplace"
    _lenient_laplace.__wrapped__ = _mj_Laplace

    class _Lenient(type):
        def __call__(cls, *args, **kwargs):
            return cls._target(*args, **_translate(kwargs))

        def __instancecheck__(cls, obj):
            return isinstance(obj, cls._target)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, cls._target)

        def __getattr__(cls, name):
            return getattr(cls._target, name)

    _LDiag = _Lenient("DiagLaplace", (), {"_target": _mj_DiagLaplace})
    _LSubnet = _Lenient("SubnetLaplace", (), {"_target": _mj_SubnetLaplace})
else:
    _lenient_laplace, _LDiag, _LSubnet = _mj_Laplace, _mj_DiagLaplace, _mj_SubnetLaplace


class _SubnetName(type):
    """[shim fix, 2026-12-05] laplace-torch's ``SubnetLaplace`` is the base class of
    FullSubnetLaplace and DiagSubnetLaplace: calling the name builds multiscale_jac's
    SubnetLaplace (as before); ``isinstance`` also holds for a multiscale_jac DiagLaplace
    over a subnetwork (multiscale_jac's DiagLaplace is not a SubnetLaplace subclass)."""

    def __call__(cls, *args, **kwargs):
        return cls._target(*args, **kwargs)

    def __instancecheck__(cls, obj):
        if isinstance(obj, cls._target):
            return True
        return isinstance(obj, _mj_DiagLaplace) and "subnetwork" in _kinds(obj)

    def __subclasscheck__(cls, sub):
        # [shim fix, 2026-12-07] a routed FullSubnetLaplace / DiagSubnetLaplace is one too
        if getattr(sub, "_subset_of_weights", None) == "subnetwork":
            return True
        return issubclass(sub, cls._target)

    def __getattr__(cls, name):
        return getattr(cls._target, name)


_LSubnet = _SubnetName("SubnetLaplace", (), {"_target": _LSubnet})

# -- mode "names": the names multiscale_jac.laplace exports, as laplace-torch spells them ---------
#: namespace -> {name: replacement}
NAMES: dict[str, dict[str, object]] = {
    "laplace": {
        "Laplace": _lenient_laplace,
        "SubnetLaplace": _LSubnet,
        "DiagLaplace": _LDiag,
        # [shim fix, 2026-12-07] the library exports marglik_training too
        "marglik_training": _mjl.marglik_training,
    },
    "laplace.laplace": {"Laplace": _lenient_laplace},
    "laplace.baselaplace": {"DiagLaplace": _LDiag},
    "laplace.subnetlaplace": {"SubnetLaplace": _LSubnet},
}


# -- mode "frontdoor": laplace-torch's concrete classes routed through mj's Laplace() -------------
def _total_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _kinds(obj) -> set[str]:
    """Which of laplace-torch's subsets a multiscale_jac object covers (by its entries)."""
    chosen = getattr(obj, "subset_of_weights", None)  # [shim fix] Laplace()'s own choice
    if chosen is not None:
        return {getattr(chosen, "value", chosen)}
    kinds = set()
    model = obj.model
    names = set(obj.subset.names)
    if obj.n_params == _total_params(model):
        kinds.add("all")
    last = None
    for name, module in model.named_modules():
        if module.__class__.__name__ == "Linear":
            last = name
    if last is not None:
        owned = {
            f"{last}.{n}" if last else n
            for n, _ in model.get_submodule(last).named_parameters(recurse=False)
        }
        if names == owned and obj.subset.all_whole:
            kinds.add("last_layer")
    if "all" not in kinds and "last_layer" not in kinds:
        kinds.add("subnetwork")
    return kinds


def _structure(obj) -> str | None:
    """The hessian_structure of a multiscale_jac Laplace object (None for anything else).
    [shim fix, 2026-12-05: DiagLaplace and KronLaplace are not SubnetLaplace subclasses]"""
    # [shim fix, 2026-12-08] the library's GPLaplace (hessian_structure="gp") too
    for cls, name in ((getattr(_mjl, "KronLaplace", None), "kron"), (_mjl.DiagLaplace, "diag"),
                      (_mjl.SubnetLaplace, "full"), (getattr(_mjl, "GPLaplace", None), "gp")):
        if cls is not None and isinstance(obj, cls):
            return name
    return None


class _Route(type):
    """Metaclass of a routed class: calling it builds ``mj.Laplace(model, likelihood,
    subset_of_weights=..., hessian_structure=..., **kwargs)`` (positional arguments bound by
    laplace-torch's own signature of the class); ``isinstance`` is true for laplace-torch's
    objects of the class and for multiscale_jac objects of the same structure and subset."""

    def __call__(cls, *args, **kwargs):
        bound = cls._signature.bind(None, *args, **kwargs)  # None stands for ``self``
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        extra = arguments.pop("kwargs", {})
        model = arguments.pop("model")
        likelihood = arguments.pop("likelihood")
        arguments.update(extra)
        return _lenient_laplace(
            model,
            likelihood,
            subset_of_weights=cls._subset_of_weights,
            hessian_structure=cls._hessian_structure,
            **arguments,
        )

    def __instancecheck__(cls, obj):
        if isinstance(obj, cls._real):
            return True
        return _structure(obj) == cls._hessian_structure and cls._subset_of_weights in _kinds(obj)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls._real)

    def __getattr__(cls, name):  # class constants such as ``_key``
        return getattr(cls._real, name)


def _route(real_cls, subset_of_weights: str, hessian_structure: str):
    return _Route(
        real_cls.__name__,
        (),
        {
            "_real": real_cls,
            "_subset_of_weights": subset_of_weights,
            "_hessian_structure": hessian_structure,
            "_signature": inspect.signature(real_cls.__init__),
            "__module__": real_cls.__module__,
            "__doc__": f"laplace-torch's {real_cls.__name__} routed through "
            f"multiscale_jac.laplace.Laplace(subset_of_weights={subset_of_weights!r}, "
            f"hessian_structure={hessian_structure!r})",
        },
    )


#: name -> (module it lives in, subset_of_weights, hessian_structure)
ROUTE_TABLE = {
    "FullLaplace": ("laplace.baselaplace", "all", "full"),
    "KronLaplace": ("laplace.baselaplace", "all", "kron"),
    "LowRankLaplace": ("laplace.baselaplace", "all", "lowrank"),
    "FunctionalLaplace": ("laplace.baselaplace", "all", "gp"),
    "FullLLLaplace": ("laplace.lllaplace", "last_layer", "full"),
    "KronLLLaplace": ("laplace.lllaplace", "last_layer", "kron"),
    "DiagLLLaplace": ("laplace.lllaplace", "last_layer", "diag"),
    "FunctionalLLLaplace": ("laplace.lllaplace", "last_layer", "gp"),
    "FullSubnetLaplace": ("laplace.subnetlaplace", "subnetwork", "full"),
    "DiagSubnetLaplace": ("laplace.subnetlaplace", "subnetwork", "diag"),
}
ROUTES: dict[str, dict[str, object]] = {}
if MODE in ("frontdoor", "lenient"):
    for _name, (_module, _w, _s) in ROUTE_TABLE.items():
        _cls = _route(getattr(sys.modules[_module], _name), _w, _s)
        for _ns in ("laplace", _module):
            ROUTES.setdefault(_ns, {})[_name] = _cls

# -- assemble -------------------------------------------------------------------------------------
_me = sys.modules[__name__]
for _k, _v in vars(_real).items():
    if _k not in ("__name__", "__file__", "__spec__", "__loader__", "__doc__", "__builtins__"):
        setattr(_me, _k, _v)
__path__ = list(_real.__path__)  # submodules not yet imported load from laplace-torch

REPLACED: dict[str, dict[str, object]] = {}
for _table in (NAMES, ROUTES):
    for _ns, _names in _table.items():
        REPLACED.setdefault(_ns, {}).update(_names)

for _ns, _names in REPLACED.items():
    if _ns == "laplace":
        for _k, _v in _names.items():
            setattr(_me, _k, _v)
        continue
    _orig = sys.modules[_ns]
    _proxy = types.ModuleType(_ns, _orig.__doc__)
    for _k, _v in vars(_orig).items():
        if _k not in ("__name__", "__doc__"):
            setattr(_proxy, _k, _v)
    for _k, _v in _names.items():
        setattr(_proxy, _k, _v)
    _proxy.__lt_real__ = _orig
    sys.modules[_ns] = _proxy
    setattr(_me, _ns.rsplit(".", 1)[1], _proxy)

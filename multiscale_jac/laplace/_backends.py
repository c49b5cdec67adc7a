"""laplace-torch's curvature backends (``backend=``, ``backend_kwargs``, ``asdl_fisher_kwargs``)
as this library's ``hessian=``: the curvature is always computed here; the table says what
each backend name means (docs/laplace.md "From laplace-torch")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..enums import HessianKind, parse_enum

__all__ = ["BACKENDS", "CurvatureBackend", "backend_hessian"]


#: laplace-torch's curvature backends by name: what each means here (docs/laplace.md); its
#: interfaces ``GGNInterface`` and ``EFInterface`` (a class of either kind) too
BACKENDS = {
    **dict.fromkeys(
        ["BackPackGGN", "CurvlinopsGGN", "AsdlGGN", "AsdfghjklGGN", "GGNInterface"],
        HessianKind.GGN,
    ),
    **dict.fromkeys(
        ["BackPackEF", "CurvlinopsEF", "AsdlEF", "AsdfghjklEF", "EFInterface"],
        HessianKind.EMPIRICAL,
    ),
}
_HESSIAN_BACKENDS = ("CurvlinopsHessian", "AsdlHessian", "AsdfghjklHessian", "BackPackHessian")


def backend_hessian(
    backend: Any, backend_kwargs: Any, asdl_fisher_kwargs: Any, hessian: Any
) -> tuple[HessianKind | None, str | None]:
    """laplace-torch's ``backend=`` (a backend class, a subclass of one, or a name),
    ``backend_kwargs`` and ``asdl_fisher_kwargs`` as this library's ``hessian``.

    Args:
        backend: ``None`` or a backend (class or name).
        backend_kwargs: ``None``, ``{}`` or ``{"stochastic": False}``.
        asdl_fisher_kwargs: ``None`` or ``{}``.
        hessian: The ``hessian=`` given with it (``None``: not given).

    Returns:
        ``(hessian, name)``: the curvature the backend means (``hessian`` unchanged without a
        backend) and the backend's name (``None`` without one).

    Raises:
        ValueError: an unknown or Hessian backend, options without a counterpart, a ``hessian``
            that contradicts the backend.
        TypeError: ``backend_kwargs`` that is not a dict.
    """
    if asdl_fisher_kwargs:
        raise ValueError(
            f"asdl_fisher_kwargs={asdl_fisher_kwargs!r}: ASDL's Fisher options have no "
            "counterpart (the curvature is this library's exact GGN or empirical Fisher)"
        )
    backend_kwargs = {} if backend_kwargs is None else backend_kwargs
    if not isinstance(backend_kwargs, dict):
        raise TypeError(f"backend_kwargs must be a dict; got {type(backend_kwargs).__name__}")
    if backend is None:
        if backend_kwargs:
            raise ValueError(f"backend_kwargs={backend_kwargs!r} given without a backend")
        return hessian, None
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    kinds = [name] if isinstance(backend, str) else _names(backend)
    if any(k in _HESSIAN_BACKENDS for k in kinds):
        raise ValueError(
            f"backend={name}: the exact Hessian has no counterpart here; use a GGN backend "
            "(the generalised Gauss-Newton) or an EF backend (the empirical Fisher)"
        )
    known = [BACKENDS[k] for k in kinds if k in BACKENDS]
    if not known:
        ggn = ", ".join(k for k, v in BACKENDS.items() if v is HessianKind.GGN)
        ef = ", ".join(k for k, v in BACKENDS.items() if v is HessianKind.EMPIRICAL)
        raise ValueError(
            f"unknown backend {name!r}; laplace-torch's GGN backends ({ggn}) and "
            f"empirical-Fisher backends ({ef}), or subclasses of them, are accepted"
        )
    unknown = {k: v for k, v in backend_kwargs.items() if not (k == "stochastic" and v is False)}
    if unknown:
        raise ValueError(
            f"backend_kwargs={unknown!r} of {name}: only stochastic=False (the exact GGN) has a "
            "counterpart here"
        )
    meant = known[0]
    if hessian is not None and parse_enum(HessianKind, hessian, "hessian") is not meant:
        raise ValueError(
            f"backend={name} means hessian={meant.value!r}, but hessian={hessian!r} was given"
        )
    return meant, name


def _names(backend: Any) -> list[str]:
    """The class names of ``backend``'s MRO (a subclass of a backend is that backend)."""
    mro = getattr(backend, "__mro__", None)
    if mro is None:
        raise TypeError(f"backend must be a backend class or its name; got {backend!r}")
    return [c.__name__ for c in mro]


class CurvatureBackend:
    """laplace-torch's ``la.backend``: what computes the curvature, always this library.

    Args:
        name: The laplace-torch backend a caller named (``None``: none).
        hessian: What it means here (``ggn`` or ``empirical``).
        subnetwork_indices: The posterior's entries as indices into
            ``parameters_to_vector(model.parameters())``, in the posterior's order.
        jacobians: ``(x, enable_backprop, vector) -> (Js, f)`` from the posterior's own stream.
        last_layer: The posterior is over the last layer.
    """

    def __init__(
        self,
        name: str | None,
        hessian: HessianKind,
        subnetwork_indices: Tensor,
        jacobians: Callable[[Any, bool | None, bool], tuple[Tensor, Tensor]],
        *,
        last_layer: bool,
    ) -> None:
        self.name, self.hessian = name, hessian
        self.subnetwork_indices = subnetwork_indices
        self._jacobians, self._last_layer = jacobians, last_layer

    def jacobians(
        self, x: Any, enable_backprop: bool | None = None, *, vector: bool = False
    ) -> tuple[Tensor, Tensor]:
        """laplace-torch's ``backend.jacobians``: per-sample Jacobians over the posterior's
        entries ``(N, O, P)`` and the outputs ``(N, O)`` (after ``output_fn``; every sample's
        output of one size, flattened), from the posterior's own stream.

        Args:
            x: The inputs (anything :func:`~multiscale_jac.pack` accepts).
            enable_backprop: Keep the graph to ``x`` (``None``: the posterior's setting).
            vector: Refuse outputs that are not one vector ``(O,)`` per sample (dense maps).
        """
        return self._jacobians(x, enable_backprop, vector)

    def last_layer_jacobians(
        self, x: Any, enable_backprop: bool | None = None
    ) -> tuple[Tensor, Tensor]:
        """laplace-torch's ``backend.last_layer_jacobians``: :meth:`jacobians`, for a posterior
        over the last layer (refused for another subset: this backend has no feature
        extractor)."""
        if not self._last_layer:
            raise ValueError(
                "last_layer_jacobians: this posterior is not over the last layer; use "
                "jacobians(x), over its own entries"
            )
        return self.jacobians(x, enable_backprop)

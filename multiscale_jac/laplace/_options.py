"""The one options object of a Laplace posterior: every option but the prior's, checked once.

:class:`LaplaceOptions` is plain data (frozen): the parts of a posterior (its curvature, its
Jacobian rows, the predictive) read what they need from it; nothing else holds an option.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._checks import check_bool, check_chunk_size, check_int, check_memory_budget
from ..enums import Entries, FisherMethod, HessianKind, Mode, Tune, parse_enum, parse_tune
from ._backends import backend_hessian

if TYPE_CHECKING:
    from .._checks import Prepared

__all__ = ["LaplaceOptions"]


@dataclass(frozen=True)
class LaplaceOptions:
    """A posterior's options, checked (see :class:`~multiscale_jac.SubnetLaplace` for each
    one's meaning).

    Attributes:
        hessian: ``ggn`` or ``empirical`` (also what a laplace-torch ``backend`` means).
        backend_name: The laplace-torch backend a caller named (``None``: none).
        output_fn: Applied to the model's output.
        ignore_index: Label of positions left out of dense classification.
        chunk_size: Samples per engine call (``None``: as many as the budget allows).
        memory_budget: Bytes of the working set (``None``: the defaults).
        strict: Raise instead of falling back.
        entries: The engine's single-entry columns.
        mode: The engine's mode.
        tune: How the ``auto`` choices are made.
        method: :class:`DiagLaplace`'s :func:`~multiscale_jac.diag_fisher` method.
        enable_backprop: The predictive keeps its graph to the inputs.
        dict_key_x: The inputs' key of a dict batch.
        dict_key_y: The targets' key of a dict batch.
    """

    hessian: HessianKind = HessianKind.GGN
    backend_name: str | None = None
    output_fn: Callable[[Any], Any] | None = None
    ignore_index: int = -100
    chunk_size: int | None = None
    memory_budget: int | None = None
    strict: bool = False
    entries: Entries = Entries.AUTO
    mode: Mode = Mode.AUTO
    tune: Tune = Tune.AUTO
    method: FisherMethod = FisherMethod.AUTO
    enable_backprop: bool = False
    dict_key_x: str = "input_ids"
    dict_key_y: str = "labels"

    @classmethod
    def checked(
        cls,
        *,
        hessian: Any,
        output_fn: Any,
        ignore_index: Any,
        chunk_size: Any,
        memory_budget: Any,
        strict: Any,
        entries: Any,
        mode: Any,
        tune: Any,
        method: Any,
        enable_backprop: Any,
        dict_key_x: Any,
        dict_key_y: Any,
        backend: Any,
        backend_kwargs: Any,
        asdl_fisher_kwargs: Any,
    ) -> LaplaceOptions:
        """The options from a constructor's arguments, each checked (laplace-torch's
        ``backend``, ``backend_kwargs`` and ``asdl_fisher_kwargs`` as ``hessian``).

        Raises:
            TypeError, ValueError: a bad value, named.
        """
        hessian, name = backend_hessian(backend, backend_kwargs, asdl_fisher_kwargs, hessian)
        for key, what in ((dict_key_x, "dict_key_x"), (dict_key_y, "dict_key_y")):
            if not isinstance(key, str):
                raise TypeError(f"{what} must be a str; got {key!r}")
        return cls(
            hessian=parse_enum(HessianKind, "ggn" if hessian is None else hessian, "hessian"),
            backend_name=name,
            output_fn=output_fn,
            ignore_index=check_int(ignore_index, "ignore_index"),
            chunk_size=check_chunk_size(chunk_size),
            memory_budget=check_memory_budget(memory_budget),
            strict=check_bool(strict, "strict"),
            entries=parse_enum(Entries, entries, "entries"),
            mode=parse_enum(Mode, mode, "mode"),
            tune=parse_tune(tune),
            method=parse_enum(FisherMethod, method, "method"),
            enable_backprop=check_bool(enable_backprop, "enable_backprop"),
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
        )

    @classmethod
    def arguments(cls) -> frozenset[str]:
        """The constructor arguments :meth:`checked` takes."""
        return frozenset(inspect.signature(cls.checked).parameters)

    def batched(self, prep: Prepared) -> dict[str, Any]:
        """The options a fit by batched runs takes (:func:`~multiscale_jac.diag_fisher`,
        ``kron_factors``), with the policies ``prep`` checked."""
        return {
            "output_fn": self.output_fn,
            "ignore_index": self.ignore_index,
            "input_kind": prep.input_kind,
            "chunk_size": self.chunk_size,
            "memory_budget": self.memory_budget,
            "randomness": prep.randomness,
            "batch_norm": "eval" if prep.eval_batch_norm else "error",
        }

    def replace(self, **changes: Any) -> LaplaceOptions:
        """A copy with ``changes`` (checked by the caller)."""
        return dataclasses.replace(self, **changes)

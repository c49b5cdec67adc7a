"""Turn an unmodified ``nn.Module`` into a pure per-sample function.

:class:`PerSampleFunction` maps ``(selected values, one sample)`` to the sample's flattened
output ``(O,)``. The sample is run as a batch of one: every level ``(C_l, *spatial)`` gets a
leading ``1`` and the model receives the structure the user passed to :func:`pack` (one tensor
``(1, C, *spatial)`` or a list of ``(1, C_l, *spatial_l)`` tensors). The model's output (after
the optional ``output_fn``) must keep that batch dim of one; it is dropped and the result is
flattened. Outputs may be a tensor or a (nested) list/tuple/dict of tensors, flattened leaf by
leaf in order.

The model itself is never changed: parameters are substituted with
``torch.func.functional_call``, buffers are used as they are, and the instance attributes a
module's forward writes (caches, counters) are put back after every run (:mod:`._state`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from ._ops import SIGNATURES, bind_call, bind_op
from ._state import ModuleState
from .enums import InputKind
from .packing import Structure
from .subset import ParamSubset

__all__ = [
    "PerSampleFunction",
    "check_model_kwargs",
    "dense_weight",
    "eager_compiled",
    "flatten_output",
]


class PerSampleFunction:
    """A pure function ``f(values, *levels) -> (O,)`` of one sample.

    Args:
        model: The unmodified model.
        subset: The parameters to differentiate.
        kind: How the model takes its input (:class:`~multiscale_jac.InputKind`, or the
            :class:`~multiscale_jac.packing.Structure` of a ``PackedBatch``, which also knows
            the keys of mapping inputs).
        output_fn: Optional callable applied to the model's output (batch dim of one kept).
        eval_batch_norm: Run train-mode BatchNorm layers with their running statistics.
        tokens: Give the model every level as tokens ``(1, positions, C_l)`` instead of
            ``(1, C_l, *spatial)`` (inputs packed with ``layout="nested"``).
        model_kwargs: Keyword arguments given to every call of the model (not tensors: a
            tensor with a batch dim would have to be split per sample).

    ``values`` is a tuple with one tensor per selected parameter tensor, in ``subset.names``
    order, shaped ``subset.selected_shape(name)``. ``levels`` are the sample's levels
    ``(C_l, *spatial_l)``. Selected entries are placed into their tensors by :meth:`place`
    (the structured paths, :mod:`~multiscale_jac.entries` and
    :mod:`~multiscale_jac.structured`, wrap this function).

    Attributes:
        flat_indices: The selected flat indices of every selected tensor on the parameters'
            device (``None``: the whole tensor).
    """

    def __init__(
        self,
        model: nn.Module,
        subset: ParamSubset,
        kind: InputKind | Structure,
        output_fn: Callable[[Any], Any] | None = None,
        *,
        eval_batch_norm: bool = False,
        tokens: bool = False,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        params = subset.check_model(model)
        self.model_kwargs = check_model_kwargs(model_kwargs)
        self.model = model
        self.subset = subset
        self.structure = kind if isinstance(kind, Structure) else Structure(InputKind(kind))
        self.kind = self.structure.kind
        self.tokens = tokens
        self.output_fn = output_fn
        self.eval_batch_norm = eval_batch_norm
        self._base = {n: p.detach() for n, p in params.items()}
        # train-mode BatchNorm bumps its ``num_batches_tracked`` buffer in place: give it a
        # fresh copy per call so neither the model nor a captured tensor is mutated
        self._bn_counters = {
            f"{name}.num_batches_tracked" if name else "num_batches_tracked": m.num_batches_tracked
            for name, m in model.named_modules()
            if eval_batch_norm
            and isinstance(m, _BatchNorm)
            and m.training
            and m.num_batches_tracked is not None
        }
        # an Embedding's max_norm renormalises its weight in place: run it out of place
        self._max_norm = any(
            isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
            for m in model.modules()
        )
        self.flat_indices = {
            n: (None if i is None else i.to(self._base[n].device))
            for n, i in subset.indices.items()
        }
        self._state = ModuleState(model)

    @property
    def params(self) -> dict[str, Tensor]:
        """All model parameters by name, detached (the point the Jacobian is taken at)."""
        return dict(self._base)

    @property
    def device(self) -> torch.device:
        """Device of the selected parameters (the engine runs there)."""
        return self._base[self.subset.names[0]].device

    def values(self) -> tuple[Tensor, ...]:
        """Current values of the selected entries, detached, in ``subset.names`` order."""
        sel = self.subset.gather(self._base)
        return tuple(sel[n] for n in self.subset.names)

    def full_params(self, values: tuple[Tensor, ...] | Mapping[str, Tensor]) -> dict[str, Tensor]:
        """All parameters by name, with the selected entries replaced by ``values``.

        ``values`` may also be a mapping name -> full-shaped tensor (the reference path uses
        that to differentiate w.r.t. whole tensors).
        """
        params = dict(self._base)
        if isinstance(values, Mapping):
            params.update(values)
            return params
        for name, v in zip(self.subset.names, values):
            params[name] = self.place(name, v)
        return params

    def place(self, name: str, v: Tensor) -> Tensor:
        """The full tensor ``name`` with its selected entries set to ``v`` (differentiable)."""
        idx = self.flat_indices[name]
        return v if idx is None else dense_weight(self._base[name], idx, v)

    def call(
        self,
        params: Mapping[str, Tensor],
        levels: tuple[Tensor, ...],
        *,
        around: Callable[[contextlib.ExitStack, list[Tensor]], None] | None = None,
    ) -> Tensor:
        """Run the model on one sample with ``params``; returns the flat output ``(O,)``.

        Args:
            params: All parameters by name (see :meth:`full_params`).
            levels: The sample's levels ``(C_l, *spatial_l)``.
            around: Called with an ``ExitStack`` and the batch-of-one levels before the model
                runs; whatever it enters stays active through ``output_fn`` and the flattening
                (masked execution uses this to track the levels).
        """
        batched = [lvl.unsqueeze(0) for lvl in levels]
        with contextlib.ExitStack() as stack:
            if around is not None:
                around(stack, batched)
            return flatten_output(self._run(stack, dict(params), batched))

    def call_batch(self, levels: list[Tensor]) -> Any:
        """Run the model itself (its own parameters, no functional call) on stacked samples.

        Args:
            levels: ``(n, C_l, *spatial_l)`` per level, samples of one shape signature.

        Returns:
            The output after ``output_fn``, not flattened (batch dim ``n``). Only valid where
            samples do not interact in a batch (the caller checks).
        """
        with contextlib.ExitStack() as stack:
            return self._run(stack, {}, list(levels))

    def _run(self, stack: contextlib.ExitStack, params: dict[str, Tensor], batched: list) -> Any:
        stack.enter_context(eager_compiled())
        if self.tokens:  # (n, C, *spatial) -> (n, positions, C), row-major positions
            batched = [b.flatten(2).transpose(1, 2) for b in batched]
        arg = self.structure.arrange(batched)
        if self._max_norm:
            stack.enter_context(_OutOfPlaceMaxNorm())
        if self.eval_batch_norm:
            params.update((n, b.clone()) for n, b in self._bn_counters.items())
            stack.enter_context(_EvalBatchNormMode())
        # inside the transform: nothing it wraps stays on the user's modules
        kw = self.model_kwargs
        out = self._state.run(
            lambda: (
                functional_call(self.model, params, (arg,), kw) if params else self.model(arg, **kw)
            )
        )
        return self.output_fn(out) if self.output_fn is not None else out

    def __call__(self, values: tuple[Tensor, ...], *levels: Tensor) -> Tensor:
        return self.call(self.full_params(values), levels)


@contextlib.contextmanager
def eager_compiled() -> Iterator[None]:
    """Functions compiled with ``torch.compile`` inside the model (the model's own, or a
    library's: torchvision compiles its RoI ops on their first use) run eagerly while the library
    runs the model. Dynamo would trace them through the library's transforms and torch-function
    modes, which it does not follow (seen: ``input.device`` read as a ``torch.Size`` inside
    torchvision's compiled ``_roi_align``, the first call in a fresh process failing).

    Dynamo's own switch (``torch._dynamo.config.disable``) for the call when dynamo is loaded;
    when it is not (importing it takes seconds), ``TORCH_COMPILE_DISABLE=1`` for the call, which
    dynamo reads if the model loads it meanwhile; both are put back after."""
    dynamo = sys.modules.get("torch._dynamo")
    config = getattr(dynamo, "config", None)
    if config is not None:
        with config.patch(disable=True):
            yield
        return
    old = os.environ.get(_COMPILE_DISABLE)
    os.environ[_COMPILE_DISABLE] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_COMPILE_DISABLE, None)
        else:
            os.environ[_COMPILE_DISABLE] = old
        config = getattr(sys.modules.get("torch._dynamo"), "config", None)
        if config is not None:  # loaded during the call: it read the variable set above
            config.disable = old == "1"


_COMPILE_DISABLE = "TORCH_COMPILE_DISABLE"


def check_model_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments for the model's forward, checked: a mapping with string keys and no
    tensor values (a tensor with a batch dim would have to be split per sample: pass it in the
    inputs instead)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"model keyword arguments must be a mapping; got {type(kwargs).__name__}")
    tensors = [k for k, v in kwargs.items() if isinstance(v, Tensor)]
    if tensors:
        raise TypeError(
            f"model keyword argument(s) {tensors} are tensors: a tensor with a batch dim would "
            "have to be split per sample; pass it as part of the inputs"
        )
    return dict(kwargs)


def dense_weight(w0: Tensor, idx: Tensor, v: Tensor) -> Tensor:
    """``w0`` with the entries at flat indices ``idx`` replaced by ``v`` (differentiable)."""
    return w0.reshape(-1).index_put((idx,), v).view(w0.shape)


def flatten_output(out: Any, path: str = "output") -> Tensor:
    """Flatten a per-sample output (tensor or nested list/tuple/dict of tensors) to ``(O,)``.

    Every tensor leaf must have a leading batch dim of one (or be a 0-d scalar).

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: a leaf's leading dim is not one.
    """
    leaves: list[Tensor] = []
    _collect(out, path, leaves)
    if not leaves:
        raise ValueError(f"{path} contains no tensors")
    flat = [t.reshape(-1) for t in leaves]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _collect(out: Any, path: str, leaves: list[Tensor]) -> None:
    if isinstance(out, Tensor):
        if out.dim() > 0 and out.shape[0] != 1:
            raise ValueError(
                f"{path} has shape {tuple(out.shape)}, but for one sample (a batch of one) every "
                "output must keep a leading batch dim of 1. If the model reduces over the batch, "
                "move that reduction out of the model or into output_fn"
            )
        leaves.append(out)
    elif isinstance(out, Mapping):
        for k, v in out.items():
            _collect(v, f"{path}[{k!r}]", leaves)
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            _collect(v, f"{path}[{i}]", leaves)
    else:
        raise TypeError(
            f"{path} is a {type(out).__name__}; model outputs must be tensors or lists/tuples/dicts of tensors"
        )


class _OutOfPlaceMaxNorm(TorchFunctionMode):
    """``F.embedding`` with ``max_norm`` without writing the weight: the looked-up rows are
    renormalised out of place, with the derivative of torch's in-place renorm (the identity:
    torch renormalises the weight without recording it)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        b = bind_call(func, args, kwargs) if func is F.embedding else None
        if b is None or b["max_norm"] is None:
            return func(*args, **kwargs)
        max_norm, p = b["max_norm"], b["norm_type"]
        rows = func(**{**b, "max_norm": None})
        norms = torch.linalg.vector_norm(rows.detach(), ord=p, dim=-1, keepdim=True)
        scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
        return rows + (rows * (scale - 1)).detach()


class _EvalBatchNormMode(TorchFunctionMode):
    """Run ``F.batch_norm`` with its running statistics (``training=False``)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            b = bind_op("batch_norm", args, kwargs)
            if b["running_mean"] is not None:
                b["training"] = False
            return func(*(b[n] for n in SIGNATURES["batch_norm"][0]))
        return func(*args, **kwargs)

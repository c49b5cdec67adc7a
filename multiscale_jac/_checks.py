"""The front door of every public entry point (private): argument checks, :func:`prepare`
(model, inputs, subset, batch-norm and randomness policy), the one too-small-budget error and
fallbacks reported once at the user's call site."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .adapter import PerSampleFunction
from .enums import (
    ArgumentTypeError,
    BatchNormPolicy,
    FallbackWarning,
    InputKind,
    Layout,
    Randomness,
    parse_enum,
)
from .packing import PackedBatch, ambiguous, pack, readings
from .subset import ParamSubset, resolve_subset

__all__ = [
    "Prepared",
    "check_bool",
    "check_chunk_size",
    "check_generator",
    "check_int",
    "check_memory_budget",
    "check_model",
    "check_output_fn",
    "check_positive_int",
    "check_positive_number",
    "check_train_mode_layers",
    "prepare",
    "warn_fallback",
]

#: frames in these folders are not the user's (see :func:`user_stacklevel`)
_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


@dataclass(frozen=True)
class Prepared:
    """What every public entry point checks before it computes anything.

    Attributes:
        model: The user's model (never changed).
        subset: The selected entries.
        output_fn: The user's ``output_fn`` (checked callable) or ``None``.
        eval_batch_norm: Run train-mode BatchNorm with running statistics (``batch_norm="eval"``).
        randomness: The random-ops policy.
        packed: The inputs packed and moved to the parameters' device (``None`` when the entry
            point streams data and packs batch by batch with :meth:`pack`).
    """

    model: nn.Module
    subset: ParamSubset
    output_fn: Callable[[Any], Any] | None
    eval_batch_norm: bool
    randomness: Randomness
    packed: PackedBatch | None = None
    input_kind: InputKind | None = None

    @functools.cached_property
    def device(self) -> torch.device:
        """Where the selected parameters live (the computation runs there); read once per
        call (looking it up cost 14 ms per ``diag_fisher`` call of 128 samples)."""
        return dict(self.model.named_parameters())[self.subset.names[0]].device

    def pack(self, inputs: Any, *, finite: bool = False) -> PackedBatch:
        """``inputs`` (anything :func:`~multiscale_jac.pack` takes) on the parameters' device,
        read as ``input_kind``.

        Raises:
            TypeError: floating-point inputs of another dtype than the selected parameters.
            ValueError: with ``finite``, a NaN or infinity in the inputs (named by sample and
                level: the result would be meaningless).
        """
        layout = inputs.layout if isinstance(inputs, PackedBatch) else Layout.PADDED
        kind = self.input_kind or self._read(inputs)
        packed = pack(inputs, layout=layout, input_kind=kind).to(self.device)
        dtype = dict(self.model.named_parameters())[self.subset.names[0]].dtype
        for lvl, t in enumerate(packed.levels):
            if t.is_floating_point() and t.dtype != dtype:
                raise TypeError(
                    f"the inputs (level {lvl}) have dtype {t.dtype} but the model's parameters "
                    f"{dtype}: convert the inputs (.to({dtype})) or the model (.to({t.dtype}))"
                )
            if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                i = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0, 0])
                bad = packed.sample(i)[lvl]
                value = bad[~torch.isfinite(bad)][0].item()
                raise ValueError(
                    f"the inputs hold {value} in sample {i}, level {lvl}: a non-finite input "
                    "makes the result meaningless"
                )
        return packed

    def _read(self, inputs: Any) -> InputKind | None:
        """For a list of tensors that reads two ways, the reading the model runs on (one
        sample of each, no gradient, the random state kept); both or neither: refused."""
        tensors = isinstance(inputs, (list, tuple)) and all(isinstance(t, Tensor) for t in inputs)
        if not tensors or not inputs:
            return None
        found = readings(inputs)
        if len(found) == 1:
            return None
        errors: dict[InputKind, str] = {}
        for kind in found:
            packed = pack(inputs, input_kind=kind).to(self.device)
            fn = self.function(packed)
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    fn.call(fn.params, tuple(packed.sample(0)))
            except Exception as err:  # the model refuses this reading, however it does
                errors[kind] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        runs = [k for k in found if k not in errors]
        if len(runs) == 1:
            return runs[0]
        why = (
            "; the model runs on both"
            if runs
            else "; the model fails on both ("
            + "; ".join(f"{k.value}: {e}" for k, e in errors.items())
            + ")"
        )
        raise ambiguous(inputs, why)

    def function(
        self,
        packed: PackedBatch,
        *,
        output_fn: Callable[[Any], Any] | None = None,
        subset: ParamSubset | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ) -> PerSampleFunction:
        """The model as a per-sample function of ``subset`` (default: the selected entries) for
        inputs shaped like ``packed``, with ``output_fn`` (default: the user's) and keyword
        arguments for the model's forward."""
        return PerSampleFunction(
            self.model,
            self.subset if subset is None else subset,
            packed.structure,
            self.output_fn if output_fn is None else output_fn,
            eval_batch_norm=self.eval_batch_norm,
            tokens=packed.layout is Layout.NESTED,
            model_kwargs=model_kwargs,
        )


def prepare(
    model: Any,
    inputs: Any = None,
    *,
    params: Any,
    output_fn: Any,
    batch_norm: Any,
    randomness: Any,
    input_kind: Any = None,
    params_name: str = "params",
) -> Prepared:
    """Check the arguments every entry point shares and apply the batch-norm and randomness
    policies (see :class:`Prepared`); ``inputs=None`` for entry points that stream data.

    Raises:
        TypeError, ValueError: the message names the offending argument as the user wrote it
            (``params_name`` is ``"subset"`` for :class:`~multiscale_jac.SubnetLaplace`).
    """
    model = check_model(model)
    output_fn = check_output_fn(output_fn)
    policy = parse_enum(BatchNormPolicy, batch_norm, "batch_norm")
    randomness = parse_enum(Randomness, randomness, "randomness")
    subset = resolve_subset(params, model, params_name)
    named = dict(model.named_parameters())
    for name in subset.names:
        if not named[name].is_floating_point():
            raise TypeError(
                f"parameter {name!r} has dtype {named[name].dtype}; only floating-point "
                "parameters can be differentiated"
            )
    eval_bn = check_train_mode_layers(model, policy, randomness)
    kind = None if input_kind is None else parse_enum(InputKind, input_kind, "input_kind")
    prepared = Prepared(model, subset, output_fn, eval_bn, randomness, input_kind=kind)
    if inputs is None:
        return prepared
    return dataclasses.replace(prepared, packed=prepared.pack(inputs))


def user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside this package and torch (the user's
    line, also when torch's autograd calls back into the package)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def warn_fallback(messages: Any) -> None:
    """One :class:`~multiscale_jac.FallbackWarning` for the distinct ``messages`` of a call,
    pointing at the user's line."""
    distinct = list(dict.fromkeys(m for m in messages if m))
    if distinct:
        warnings.warn("; then ".join(distinct), FallbackWarning, stacklevel=user_stacklevel())


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    return model


def check_chunk_size(chunk_size: Any) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a positive int or None; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return chunk_size


def check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def check_generator(generator: Any) -> Any:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None; got {type(generator).__name__}"
        )
    return generator


def check_memory_budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget must be a number of bytes or None; got {budget!r}")
    if not budget > 0:
        raise ValueError(f"memory_budget must be > 0 bytes; got {budget!r}")
    return int(budget)


def check_noise(value: Any, name: str = "sigma_noise") -> float | Tensor:
    """A positive noise scale: a number (-> float) or a tensor of one value (-> 0-d tensor,
    kept: a tuned noise may require grad)."""
    if isinstance(value, Tensor):
        if value.dim() > 1 or value.numel() != 1 or value.is_complex():
            raise ValueError(
                f"{name} must be a number or a tensor of one value; got shape {tuple(value.shape)}"
            )
        if not bool(value.detach() > 0) or not bool(torch.isfinite(value.detach())):
            raise ValueError(f"{name} must be positive; got {float(value)!r}")
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a positive number; got {value!r}")
    return check_positive_number(value, name)


def check_positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number; got {value!r}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number; got {value!r}")
    return float(value)


def check_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def check_output_fn(fn: Any) -> Callable[[Any], Any] | None:
    if fn is not None and not callable(fn):
        raise TypeError(f"output_fn must be callable or None; got {type(fn).__name__}")
    return fn


def check_train_mode_layers(
    model: nn.Module, batch_norm: BatchNormPolicy, randomness: Randomness
) -> bool:
    """Refuse layers whose behaviour on a batch of one would make per-sample results ambiguous.

    Any BatchNorm that normalises with batch statistics (in train mode, or built with
    ``track_running_stats=False``, in any mode) follows ``batch_norm``; InstanceNorm and
    GroupNorm are per sample and need nothing.

    Returns:
        True when batch-statistics layers must be run with their running statistics (the
        ``batch_norm="eval"`` choice for a model that has BatchNorm in train mode).

    Raises:
        ValueError: BatchNorm with batch statistics without an explicit ``batch_norm`` choice
            (or with ``"eval"`` but no running statistics), or dropout in train mode with
            ``randomness="error"``.
    """
    batch_stats = [
        (name or "<model>", m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
    ]
    for name, m in batch_stats:
        if m.running_mean is not None and batch_norm is BatchNormPolicy.ERROR:
            raise ValueError(
                f"module {name!r} ({type(m).__name__}) is in train mode: it would normalise each "
                "sample with statistics of a batch of one, which is not what the model computes "
                "on a batch. Put the model in eval mode (model.eval()), or pass "
                "batch_norm='eval' to use the running statistics without changing the model"
            )
        if m.running_mean is None:
            mode = "in train mode" if m.training else "in eval mode"
            raise ValueError(
                f"module {name!r} ({type(m).__name__}) was built with "
                f"track_running_stats=False, so {mode} it normalises with the statistics of "
                "the batch: for one sample, a batch of one, which is not what the model "
                "computes on a batch, and there are no running statistics for "
                "batch_norm='eval'. Use a per-sample norm (GroupNorm, InstanceNorm, LayerNorm) "
                "or track running statistics"
            )
    if randomness is Randomness.ERROR:
        for name, m in model.named_modules():
            if isinstance(m, _DropoutNd) and m.training and m.p > 0:
                raise ValueError(
                    f"module {name or '<model>'!r} ({type(m).__name__}, p={m.p}) is in train "
                    "mode, so every forward pass is random. Put the model in eval mode, or pass "
                    "randomness='different' (independent masks per sample) or 'same'"
                )
    return bool(batch_stats)

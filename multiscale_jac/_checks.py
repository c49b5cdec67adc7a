"""Private validation helpers shared by the public entry points."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .enums import BatchNormPolicy, Randomness

__all__ = [
    "check_bool",
    "check_chunk_size",
    "check_generator",
    "check_memory_budget",
    "check_model",
    "check_output_fn",
    "check_positive_int",
    "check_train_mode_layers",
]


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
    """Refuse layers whose train-mode behaviour would make per-sample results ambiguous.

    Returns:
        True when batch-statistics layers must be run with their running statistics (the
        ``batch_norm="eval"`` choice for a model that has BatchNorm in train mode).

    Raises:
        ValueError: BatchNorm in train mode without an explicit ``batch_norm`` choice (or with
            ``"eval"`` but no running statistics), or dropout in train mode with
            ``randomness="error"``.
    """
    bn_train = [
        (name or "<model>", m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.training
    ]
    if bn_train and batch_norm is BatchNormPolicy.ERROR:
        name, m = bn_train[0]
        raise ValueError(
            f"module {name!r} ({type(m).__name__}) is in train mode: it would normalise each "
            "sample with statistics of a batch of one, which is not what the model computes on "
            "a batch. Put the model in eval mode (model.eval()), or pass batch_norm='eval' to "
            "use the running statistics without changing the model"
        )
    if bn_train:
        for name, m in bn_train:
            if m.running_mean is None:
                raise ValueError(
                    f"batch_norm='eval' needs running statistics, but module {name!r} "
                    f"({type(m).__name__}) was built with track_running_stats=False"
                )
    if randomness is Randomness.ERROR:
        for name, m in model.named_modules():
            if isinstance(m, _DropoutNd) and m.training and m.p > 0:
                raise ValueError(
                    f"module {name or '<model>'!r} ({type(m).__name__}, p={m.p}) is in train "
                    "mode, so every forward pass is random. Put the model in eval mode, or pass "
                    "randomness='different' (independent masks per sample) or 'same'"
                )
    return bool(bn_train)

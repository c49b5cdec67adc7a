"""The last layer when ``last_layer_name`` is not given: found by registration order at
construction, checked against the forward on the first batch of :meth:`fit` (laplace-torch
finds it by that forward; a model that registers its head before its body would otherwise
get a Laplace over a layer that is not its last, silently)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..subset import ParamSubset


def default_last_layer(model: nn.Module) -> tuple[str, ParamSubset]:
    """The last ``nn.Linear`` (registration order) and its parameters; without one, the
    last module that owns parameters (``ParamSubset.last_layer``)."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        subset = ParamSubset.last_layer(model)
        return subset.names[0].rpartition(".")[0], subset
    owned = [n for n, _ in model.get_submodule(last).named_parameters(recurse=False)]
    return last, ParamSubset.from_names(model, [f"{last}.{n}" if last else n for n in owned])


def check_last_layer(model: nn.Module, name: str, run: Callable[[], Any]) -> None:
    """Run the model once (``run``) and check that ``name`` is the last module owning
    parameters to finish its forward (hooks on the model's modules, removed after).

    Raises:
        ValueError: another module ran after it, or it did not run.
    """
    order: list[str] = []
    owners = {
        n: m for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))
    }
    handles = [m.register_forward_hook(lambda *_, n=n: order.append(n)) for n, m in owners.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    ran = order[-1] if order else None
    if ran != name:
        found = "did not run" if name not in order else f"ran before {ran!r}"
        raise ValueError(
            f"subset_of_weights='last_layer' without last_layer_name took {name!r} (the last "
            f"nn.Linear the model registers), but in the forward it {found}, the last module "
            "with parameters to run; pass last_layer_name= to say which module is the last layer"
        )

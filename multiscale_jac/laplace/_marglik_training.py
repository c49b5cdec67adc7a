"""laplace-torch's ``marglik_training``: the network and the prior precision (and a
regression's noise) trained together, the network on the log joint and the hyperparameters
on the log marginal likelihood of a Laplace over every weight (Immer et al. 2021, Algorithm
1), for scripts that call it. The model passed is never changed: a copy is trained and
returned."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from .._checks import check_bool, check_int, check_positive_int, check_positive_number
from .._stream import with_progress
from ..enums import Likelihood, PriorStructure, parse_enum
from ._base import LaplaceBase
from ._frontdoor import Laplace

__all__ = ["marglik_training"]


def marglik_training(
    model: nn.Module,
    train_loader: Iterable[Any],
    likelihood: str | Likelihood = "classification",
    hessian_structure: str = "kron",
    backend: Any = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict[str, Any] | None = None,
    scheduler_cls: Any = None,
    scheduler_kwargs: dict[str, Any] | None = None,
    n_epochs: int = 300,
    lr_hyp: float = 0.1,
    prior_structure: str | PriorStructure = "layerwise",
    n_epochs_burnin: int = 0,
    n_hypersteps: int = 10,
    marglik_frequency: int = 1,
    prior_prec_init: float = 1.0,
    sigma_noise_init: float = 1.0,
    temperature: float = 1.0,
    fix_sigma_noise: bool = False,
    progress_bar: bool = False,
    enable_backprop: bool = False,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
) -> tuple[LaplaceBase, nn.Module, list[float], list[float]]:
    """laplace-torch's ``marglik_training`` with its arguments and results.

    Each epoch trains a copy of ``model`` with ``optimizer_cls`` on the mean loss (cross
    entropy, or mean squared error for a regression) plus the prior's ``0.5 theta^T diag(p)
    theta / (N T)`` (for a regression times ``2 sigma^2``); every ``marglik_frequency``
    epochs from ``n_epochs_burnin`` on it fits ``Laplace(copy, likelihood, "all",
    hessian_structure)`` and takes ``n_hypersteps`` Adam steps (``lr_hyp``) on the log prior
    precision (and log noise) against ``-log_marginal_likelihood``; the copy at the best
    marginal likelihood is kept. ``weight_decay`` in ``optimizer_kwargs`` is set to 0 (the
    prior is the decay). The other arguments mean what they mean in laplace-torch
    (``backend`` as :func:`Laplace` takes it).

    Args:
        model: The network (left as it was; the one returned is the trained copy).
        train_loader: ``(inputs, targets)`` batches or dicts (``dict_key_x``, ``dict_key_y``);
            ``len(train_loader.dataset)`` or a count of the samples gives ``N``.
        prior_structure: ``scalar``, ``layerwise`` (one per tensor) or ``diag``.

    Returns:
        ``(la, model, margliks, losses)``: the Laplace fitted at the best copy and
        hyperparameters, that copy, the negative log marginal likelihood of every hyperstep
        and the mean training loss of every epoch.
    """
    lik = parse_enum(Likelihood, likelihood, "likelihood")
    structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
    kwargs = dict(optimizer_kwargs or {})
    if "weight_decay" in kwargs:
        kwargs["weight_decay"] = 0.0
    trainer = _Trainer(
        copy.deepcopy(model),
        train_loader,
        lik,
        structure,
        math.log(
            check_positive_number(temperature, "temperature")
            * check_positive_number(prior_prec_init, "prior_prec_init")
        ),
        math.log(check_positive_number(sigma_noise_init, "sigma_noise_init")),
        check_bool(fix_sigma_noise, "fix_sigma_noise"),
    )
    trainer.equip(
        lambda params: optimizer_cls(params, **kwargs),
        None
        if scheduler_cls is None
        else lambda opt: scheduler_cls(opt, **(scheduler_kwargs or {})),
        check_positive_number(lr_hyp, "lr_hyp"),
        {
            "hessian_structure": hessian_structure,
            "temperature": temperature,
            "dict_key_x": dict_key_x,
            "dict_key_y": dict_key_y,
            **({} if backend is None else {"backend": backend}),
        },
    )
    epochs = check_positive_int(n_epochs, "n_epochs")
    steps = check_positive_int(n_hypersteps, "n_hypersteps")
    every = check_positive_int(marglik_frequency, "marglik_frequency")
    burnin = check_int(n_epochs_burnin, "n_epochs_burnin")
    show = check_bool(progress_bar, "progress_bar")
    for epoch in with_progress(range(1, epochs + 1), show, "marglik_training", epochs):
        trainer.epoch()
        if epoch % every == 0 and epoch >= burnin:
            trainer.tune(steps)
    return trainer.result(check_bool(enable_backprop, "enable_backprop"))


class _Trainer:
    """The state of one ``marglik_training``: the copy trained, the hyperparameters (log
    prior precision, log noise), the optimisers and the best copy so far."""

    optimizer: torch.optim.Optimizer
    hyper_optimizer: torch.optim.Optimizer
    scheduler: Any = None
    laplace_options: dict[str, Any]

    def __init__(
        self,
        net: nn.Module,
        loader: Iterable[Any],
        lik: Likelihood,
        structure: PriorStructure,
        log_prior: float,
        log_sigma: float,
        fixed: bool,
    ) -> None:
        self.net, self.loader, self.lik, self.structure = net, loader, lik, structure
        params = [p for p in net.parameters() if p.requires_grad]
        like = {"dtype": params[0].dtype, "device": params[0].device}
        self.sizes = torch.tensor([p.numel() for p in params], device=params[0].device)
        total = int(self.sizes.sum())
        k = {PriorStructure.SCALAR: 1, PriorStructure.DIAG: total}.get(structure, len(params))
        self.log_prior = torch.full((k,), log_prior, **like, requires_grad=True)
        self.log_sigma = torch.full((1,), log_sigma, **like)
        self.hypers = [self.log_prior]
        self.tuned_noise = lik is Likelihood.REGRESSION and not fixed
        if self.tuned_noise:
            self.hypers.append(self.log_sigma.requires_grad_(True))
        self.criterion = nn.CrossEntropyLoss() if lik is Likelihood.CLASSIFICATION else nn.MSELoss()
        self.n = _count(loader)
        self.margliks: list[float] = []
        self.losses: list[float] = []
        self.best: tuple[float, Any, Tensor, Tensor] | None = None

    def equip(
        self,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        scheduler: Callable[[torch.optim.Optimizer], Any] | None,
        lr_hyp: float,
        laplace_options: dict[str, Any],
    ) -> None:
        """The network's optimiser (and scheduler), the hyperparameters' Adam and the options
        of every Laplace fitted on the way."""
        self.optimizer = optimizer(self.net.parameters())
        self.scheduler = None if scheduler is None else scheduler(self.optimizer)
        self.hyper_optimizer = torch.optim.Adam(self.hypers, lr=lr_hyp)
        self.laplace_options = laplace_options

    def sigma(self) -> Tensor:
        if self.lik is Likelihood.CLASSIFICATION:
            return torch.ones((), dtype=self.log_sigma.dtype)
        return self.log_sigma.exp().reshape(())

    def epoch(self) -> None:
        """One pass over the data on the log joint; its mean loss is kept."""
        total, temp = 0.0, self.laplace_options["temperature"]
        for batch in self.loader:
            x, y = (
                (batch, batch[self.laplace_options["dict_key_y"]])
                if isinstance(batch, MutableMapping)
                else batch
            )
            self.optimizer.zero_grad()
            factor = temp
            if self.lik is Likelihood.REGRESSION:
                factor = temp / (2 * self.sigma().item() ** 2)
            delta = _expand(self.log_prior.detach().exp(), self.sizes, self.structure)
            theta = parameters_to_vector([p for p in self.net.parameters() if p.requires_grad])
            loss = self.criterion(self.net(x), y) + 0.5 * (delta * theta) @ theta / self.n / factor
            loss.backward()
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            total += loss.item() * len(y)
        self.losses.append(total / self.n)

    def laplace(self, prior: Tensor, noise: Tensor, backprop: bool = False) -> LaplaceBase:
        la = Laplace(self.net, self.lik, "all", sigma_noise=noise, prior_precision=prior,
                     enable_backprop=backprop, **self.laplace_options)  # fmt: skip
        return la.fit(self.loader)

    def tune(self, steps: int) -> None:
        """A Laplace at the copy, ``steps`` Adam steps on the hyperparameters; the copy is kept
        where the last step's value is the best so far (with the values it was taken at)."""
        la = self.laplace(self.log_prior.exp().detach(), self.sigma().detach())
        for _ in range(steps):
            self.hyper_optimizer.zero_grad()
            noise = self.sigma() if self.tuned_noise else None
            neg = -la.log_marginal_likelihood(self.log_prior.exp(), noise)
            neg.backward()
            self.hyper_optimizer.step()
            self.margliks.append(neg.item())
        if self.best is None or self.margliks[-1] < self.best[0]:
            state = copy.deepcopy(self.net.state_dict())
            noise = la.sigma_noise.detach().clone()
            self.best = (self.margliks[-1], state, la.prior_precision.detach().clone(), noise)

    def result(self, backprop: bool) -> tuple[LaplaceBase, nn.Module, list[float], list[float]]:
        prior, noise = self.log_prior.exp().detach(), self.sigma().detach()
        if self.best is not None:
            self.net.load_state_dict(self.best[1])
            prior, noise = self.best[2], self.best[3]
        return self.laplace(prior, noise, backprop), self.net, self.margliks, self.losses


def _expand(prior: Tensor, sizes: Tensor, structure: PriorStructure) -> Tensor:
    """The prior precision per entry of the trainable parameters."""
    if structure is PriorStructure.DIAG:
        return prior
    if structure is PriorStructure.SCALAR:
        return prior.expand(int(sizes.sum()))
    return torch.repeat_interleave(prior, sizes)


def _count(loader: Iterable[Any]) -> int:
    """``N``: ``len(loader.dataset)``, else the samples of one pass."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        return len(dataset)
    return sum(
        len(b[1]) if not isinstance(b, MutableMapping) else len(next(iter(b.values())))
        for b in loader
    )

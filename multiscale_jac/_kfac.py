"""Kronecker-factored curvature (K-FAC / KFLR) of Linear and Conv layers, streamed over data.

:func:`kron_factors` runs the model on stacked samples of one shape signature at a time (a
ragged batch is split into its shape buckets, as :func:`~multiscale_jac.diag_fisher` splits
it; no sample is ever padded) and sums, per layer, two Kronecker factors over everything the
data yields. The layers are untouched ``nn.Linear`` and ``nn.Conv1d/2d/3d`` modules (any
stride, dilation, groups, padding including asymmetric ``'same'``, any ``padding_mode``); a
module called several times per forward pass (a head shared by every pyramid level) is one
layer whose calls all count (a head run through :func:`~multiscale_jac.map_levels` runs its
per-level loop meanwhile: a canvas would add its gutters' positions).

What is computed (stated once; curvlinops' KFAC-*expand*, Eschenhagen et al. 2023)
---------------------------------------------------------------------------------
``N`` samples; sample ``n`` calls the layer ``c = 1..C_n`` times (once for a plain layer);
call ``c`` has ``L_nc`` positions (Linear on ``(n, *, in)``: the positions ``*``, one for a
``(n, in)`` input; Conv: the output positions). A model that folds a dimension into the batch
(pairs ``(B, 2, d) -> (2B, d)``, video frames ``(B, T, ...) -> (B T, ...)``, same-size levels
stacked with ``torch.cat(levels, 0)``, sample-major or sample-minor) gives a layer several rows
of dim 0 per sample: **each such row counts as a call of its own** (``L`` = the positions of
one row), which is what curvlinops computes (it takes dim 0 for the samples and divides by the
data's ``N``), so laplace-torch's ``KronLaplace`` on such a model (its reward-modelling
example) gets the same factors. Every row of every call must belong to one sample
(:mod:`~multiscale_jac.rows` follows which, through the forward pass): ``G`` sums the rows'
gradients, each a sample's own only then; a call whose rows mix samples, or are computed from
no sample's data, is refused naming the module. At position ``l``:

* ``a_ncl``: what the weight multiplies: Linear, the input row ``x[..., :]``; Conv, the patch
  the kernel reads, in ``weight.flatten(1)``'s order (input channel, then kernel offsets),
  zero or ``padding_mode`` padding included; a grouped convolution's input is first averaged
  over its channel groups (curvlinops' choice: one ``A`` serves every group). With the bias
  covered, a trailing ``1`` is appended (the bias row of ``A``).
* ``g_nkcl``: the gradient at the layer's output (call ``c``, position ``l``) of the sample's
  ``k``-th objective ``s_nk``, with weight ``w_k``:

  - ``kind="ggn"`` (KFLR, curvlinops' ``type-2``): ``s_nk = f_n . q_nk`` for the columns
    ``q_nk`` of a root of ``Lambda_n = sum_k q_nk q_nk^T``, the Hessian of the negative
    log-likelihood w.r.t. the outputs ``f_n``, ``w_k = 1``: classification ``sqrt(p_c)
    (e_c - p)`` per class ``c`` and output position (``diag(p) - p p^T`` per position;
    positions labelled ``ignore_index`` left out), regression ``e_o / sigma`` per output entry.
    Dense outputs are exact per position, at ``C x positions`` (classification) or ``O``
    (regression) backward passes per chunk of samples (``kind="mc"`` needs ``mc_samples``).
  - ``kind="mc"``: ``s_nk = NLL(f_n, y~_nk)`` with ``y~`` drawn from the model's predictive
    (``mc_samples`` draws, ``w_k = 1 / mc_samples``, seeded by ``generator``; the noise is
    drawn per chunk of samples, as :func:`~multiscale_jac.diag_fisher` draws it).
  - ``kind="empirical"``: ``s_n = NLL(f_n, y_n)`` at the given targets, ``w = 1``.

Then, with the negative log-likelihood ``NLL`` the cross-entropy summed over positions
(``classification``, logits ``(n, C, *spatial)``) or ``0.5 |f - y|^2 / sigma^2``
(``regression``)::

    A = 1/N sum_n sum_c 1/L_nc sum_l a_ncl a_ncl^T          (in [+1]) x (in [+1])
    G =     sum_n sum_k w_k sum_c sum_l g_nkcl g_nkcl^T         out x out

and ``G (x) A`` approximates the layer's block of ``sum_n J_n^T Lambda_n J_n`` (``ggn``;
its expectation for ``mc``; ``sum_n grad_n grad_n^T`` for ``empirical``) over
``[vec(W) row-major, b]``. ``A`` is a mean over samples (positions of a call averaged, the
calls summed), ``G`` a sum; so the factors of a ragged batch are exactly the factors of its
samples run one at a time, unpadded (``A`` averaged, ``G`` summed), and so are those of any
split of the data into batches.

laplace-torch 0.3 (``KronLaplace``), and which backend this matches
-------------------------------------------------------------------
* **CurvlinopsGGN** (laplace-torch's default), **CurvlinopsGGN(stochastic=True)** and
  **CurvlinopsEF**: ``kind="ggn"``, ``"mc"`` (in distribution: curvlinops draws its own
  labels) and ``"empirical"``. Same placement of the scales: ``A`` carries the ``1/N`` (laplace
  rescales the per-batch ``1/M`` by ``M/N``) and the ``1/L`` of weight sharing, ``G`` the sums
  (loss reduction ``sum``); a shared module's calls each normalised by their own positions
  (curvlinops' hooks fire once per call); the conv patches in ``F.unfold`` order, groups
  averaged. laplace-torch keeps the bias a block of its own (``separate_weight_and_bias=True``):
  weight ``[G, A_w]``, bias ``[G]``, with ``A_w`` = ``A`` without its bias row;
  :meth:`KronResult.laplace_torch_kfacs` gives that list, including laplace-torch's regression
  scales (it builds ``G`` from ``MSELoss(reduction="sum")``, twice the Gaussian NLL at
  ``sigma = 1``, then multiplies the Kronecker product by ``1/2``, split as ``sqrt(1/2)`` on
  each factor: weight ``[sqrt(2) G, A_w / sqrt(2)]``, bias ``[G]``; for ``empirical`` the
  gradients are doubled, so ``[2 sqrt(2) G, A_w / sqrt(2)]`` and ``[2 G]``). ``A`` with its
  bias row is curvlinops' ``separate_weight_and_bias=False`` input factor. laplace-torch's
  factors are at ``sigma_noise = 1`` (it applies ``sigma`` later); with the default
  ``sigma_noise=1.0`` the numbers are the same.
* curvlinops refuses ``Conv1d``/``Conv3d`` and asymmetric ``'same'`` padding; the same
  definition is used for them here. For dense classification logits curvlinops' ``type-2``
  back-propagates each class column summed over all output positions (cross-position terms);
  here every position has its own columns (the GGN's ``Lambda`` is block-diagonal over
  positions), which is also what ``mc`` estimates.
* **AsdlGGN** / **AsdlEF** give the same numbers, except that AsdlGGN splits a regression
  weight's scale between ``G`` and ``A`` its own way (same products).
* **BackPackGGN** (KFLR / KFAC) agrees for Linear layers on ``(n, in)`` inputs and differs for
  convolutions: BackPACK's ``G`` sums the output gradient over positions before the outer
  product and its ``A`` sums (does not average) over positions; it refuses ``groups > 1`` and
  Linear inputs with more than two dims.
* Parameters that are not the weight or bias of a Linear/Conv layer (norm affine parameters,
  embeddings, ...) are refused with a ``ValueError`` naming the parameter and its module:
  laplace-torch's ``Kron.init_from_model`` would give a 1-d parameter a dense block, but no
  backend fills it (curvlinops raises "Found parameters in un-supported layers", BackPACK "does
  not have an extension for Module LayerNorm", ASDL fails on a shape mismatch). Select the Linear/Conv tensors with ``params=``. Also refused: a
  module subclass that overrides ``forward``, a selected parameter also read outside its
  modules (``F.linear(x, self.fc.weight)``), a model that mixes samples in a batch.

``tests/test_kfac_laplace_torch.py`` checks all of this against laplace-torch (every factor of
CurvlinopsGGN/EF measured within ``1e-15`` relative, tested at ``1e-12``).

Not here (the Laplace posterior's job): eigendecompositions, damping, the prior, the
log-determinant and the predictive.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (
    Prepared,
    check_bool,
    check_chunk_size,
    check_generator,
    check_int,
    check_memory_budget,
    check_positive_int,
    check_positive_number,
    prepare,
)
from ._likelihood import check_targets, draw_noise, labels_from_noise, nll_sum, output_dim
from ._memory import DEFAULT_TEMP_BYTES, chunk_in, fit_budget, kfac_kept, kfac_sample
from ._planning import measure
from ._stream import pair, split_targets, with_progress
from .adapter import PerSampleFunction
from .enums import Likelihood, Randomness, parse_enum
from .layerwise import NotLayerwiseError, _UseWatch, check_separable
from .levels import _LOOP_ONLY
from .packing import PackedBatch
from .rows import RowTracker, groups_of, output_rows
from .subset import ParamSubset

__all__ = ["KINDS", "KronFactors", "KronResult", "kron_factors"]

#: the curvature kinds (see the module docstring)
KINDS = ("ggn", "mc", "empirical")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_LAYERS = (nn.Linear, *_CONVS)


@dataclass(frozen=True)
class KronFactors:
    """One layer's factors: ``G (x) A`` approximates its curvature block.

    Attributes:
        modules: The names of the modules holding the tensors (several for tied weights).
        weight: The weight's parameter name, or ``None`` (bias alone selected).
        bias: The bias's parameter name, or ``None``.
        A: ``(k, k)`` input factor: ``k = in + 1`` with a weight and a bias (the bias row
            last), ``in`` with a weight alone (``in = in_features``, or ``C_in / groups *
            prod(kernel)``), ``1`` with a bias alone.
        G: ``(out, out)`` output-gradient factor.
        num_data: The samples ``N`` the factors were summed over (``A`` is divided by it).
    """

    modules: tuple[str, ...]
    weight: str | None
    bias: str | None
    A: Tensor
    G: Tensor
    num_data: int

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names covered, weight first."""
        return tuple(n for n in (self.weight, self.bias) if n is not None)

    @property
    def weight_A(self) -> Tensor | None:
        """``A`` without the bias row (the weight's own input factor), or ``None``."""
        if self.weight is None:
            return None
        return self.A[:-1, :-1] if self.bias is not None else self.A

    def dense(self) -> Tensor:
        """``G (x) A`` as a dense matrix over ``[weight.flatten(), bias]`` (the bias block is
        ``A[-1, -1] G``). Materialises ``P_layer^2`` entries: for checks and small layers."""
        full = torch.kron(self.G, self.A)
        if self.weight is None or self.bias is None:
            return full
        co, k = self.G.shape[0], self.A.shape[0]
        order = torch.arange(co * k, device=full.device).view(co, k)
        perm = torch.cat([order[:, :-1].reshape(-1), order[:, -1]])
        return full[perm][:, perm]


@dataclass(frozen=True)
class KronResult:
    """The factors of every selected layer and the data's loss.

    Attributes:
        layers: One :class:`KronFactors` per layer, in the order of the model's parameters.
        num_data: The samples ``N`` seen.
        loss: The negative log-likelihood summed over the data at ``sigma_noise`` (the
            cross-entropy sum, or ``0.5 SSE / sigma^2``), from the same forward passes.
        kind: ``ggn``, ``mc`` or ``empirical``.
        likelihood: ``classification`` or ``regression``.
        sigma_noise: The regression noise scale the factors and loss were computed at.
        num_outputs: The output entries seen (every sample's, summed).
        output_dim: The size of dim 1 of the output (batch dim first: classes, channels or
            regression outputs; 1 for one value per sample).
    """

    layers: tuple[KronFactors, ...]
    num_data: int
    loss: Tensor
    kind: str
    likelihood: Likelihood
    sigma_noise: float = 1.0
    num_outputs: int = 0
    output_dim: int = 0

    def __getitem__(self, name: str) -> KronFactors:
        """The layer holding parameter ``name``, or the layer of module ``name``."""
        for f in self.layers:
            if name in f.names or name in f.modules:
                return f
        raise KeyError(f"no layer holds a parameter or module named {name!r}")

    def laplace_torch_kfacs(self) -> list[list[Tensor]]:
        """laplace-torch 0.3's ``KronLaplace.H.kfacs`` (``Kron``, before ``decompose``) for
        these layers, one entry per parameter in the model's order: a weight ``[G, A_w]``
        (``[G * A_w]`` for a ``1 x 1`` weight, as curvlinops returns it), a bias ``[G]``, with
        laplace-torch's regression scales (module docstring). Equal to what laplace-torch
        computes with ``sigma_noise=1`` (it never puts ``sigma`` into ``H``)."""
        g_scale = a_scale = b_scale = 1.0
        if self.likelihood is Likelihood.REGRESSION:
            doubled = 2.0 if self.kind == "empirical" else 1.0
            g_scale, a_scale, b_scale = doubled * math.sqrt(2.0), 1 / math.sqrt(2.0), doubled
        out: list[list[Tensor]] = []
        for f in self.layers:
            a_w = f.weight_A
            if a_w is not None:
                g, a = f.G * g_scale, a_w * a_scale
                out.append([g * a] if g.numel() == a.numel() == 1 else [g, a])
            if f.bias is not None:
                out.append([f.G * b_scale])
        return out


def kron_factors(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    *,
    params: ParamSubset | str | list[str] | None = None,
    likelihood: str | Likelihood = "classification",
    kind: str = "ggn",
    mc_samples: int = 1,
    output_fn: Any = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    input_kind: Any = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    randomness: Any = "error",
    batch_norm: Any = "error",
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> KronResult:
    """K-FAC factors of the selected Linear/Conv layers over ``data`` (module docstring).

    Options shared with the other entry points (``params``, ``output_fn``, ``chunk_size``,
    ``memory_budget``, ``randomness``, ``batch_norm``, ``progress``, ``input_kind``) mean what
    they mean for :func:`~multiscale_jac.diag_fisher`.

    Args:
        model: Any ``nn.Module`` (never changed); the selected tensors must be whole weights
            or biases of ``nn.Linear``/``nn.Conv1d/2d/3d`` modules.
        data: An iterable of ``(inputs, targets)``; ``inputs`` in any form
            :func:`~multiscale_jac.pack` accepts (ragged multi-level samples included),
            ``targets`` a tensor with a leading batch dim or a list of per-sample tensors.
        params: Which tensors (default: all; a model with other parameters needs this).
        likelihood: ``classification`` (logits ``(n, C, *spatial)``) or ``regression``.
        kind: ``ggn`` (exact ``Lambda``), ``mc`` or ``empirical``.
        mc_samples: Label draws per sample for ``kind="mc"`` (must stay 1 otherwise).
        output_fn: Applied to the model's output (batch dim kept); must give one tensor.
        sigma_noise: Gaussian noise scale (``regression``).
        ignore_index: Label of positions left out (classification).
        input_kind: How to read ``inputs`` where it is ambiguous (see ``pack``).
        chunk_size: Samples per batched run (default: a whole shape bucket, or what
            ``memory_budget`` allows).
        memory_budget: Bytes of the call's working set, the factors included.
        randomness: ``error`` or ``different`` (dropout in train mode: every sample its own
            masks, all objectives of a sample from one pass); ``same`` is refused.
        batch_norm: ``error`` or ``eval`` for BatchNorm layers in train mode.
        generator: Seeds the labels drawn for ``kind="mc"``.
        progress: A tqdm bar over the batches when a terminal is attached.

    Returns:
        A :class:`KronResult`.

    Raises:
        TypeError, ValueError: bad arguments or data (the message names the value), a
            selected tensor without Kronecker factors, a model that mixes samples in a batch.
    """
    prep = prepare(
        model,
        params=params,
        output_fn=output_fn,
        batch_norm=batch_norm,
        randomness=randomness,
        input_kind=input_kind,
    )
    opts = _options(likelihood, kind, mc_samples, sigma_noise, ignore_index, chunk_size)
    opts.memory_budget = check_memory_budget(memory_budget)
    opts.generator = check_generator(generator)
    show = check_bool(progress, "progress")
    if prep.randomness is Randomness.SAME:
        raise ValueError(
            "randomness='same' draws one mask for a whole vectorised call; kron_factors runs "
            "batches, where every sample draws its own: use randomness='different'"
        )
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be an iterable of (inputs, targets) pairs; got {type(data).__name__}"
        )
    run = _KronRun(prep, opts, _layers(prep.model, prep.subset))
    for batch in with_progress(data, show, "kron_factors"):
        inputs, targets = pair(batch)
        run.add(prep.pack(inputs, finite=True), targets)
    return run.result()


@dataclass
class _Options:
    likelihood: Likelihood
    kind: str
    mc_samples: int
    sigma: float
    ignore: int
    chunk: int | None
    memory_budget: int | None = None
    generator: torch.Generator | None = None


def _options(
    likelihood: Any, kind: Any, mc_samples: Any, sigma: Any, ignore: Any, chunk: Any
) -> _Options:
    lik = parse_enum(Likelihood, likelihood, "likelihood")
    if not isinstance(kind, str) or kind not in KINDS:
        hint = " (the exact GGN is kind='ggn')" if kind in ("exact", "type-2", "kflr") else ""
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}; got {kind!r}{hint}")
    draws = check_positive_int(mc_samples, "mc_samples")
    if kind != "mc" and draws != 1:
        raise ValueError(f"mc_samples={draws} applies to kind='mc' only; got kind={kind!r}")
    return _Options(
        likelihood=lik,
        kind=kind,
        mc_samples=draws,
        sigma=check_positive_number(sigma, "sigma_noise"),
        ignore=check_int(ignore, "ignore_index"),
        chunk=check_chunk_size(chunk),
    )


# ---------------------------------------------------------------------- layers
@dataclass
class _Layer:
    """One layer's modules, covered tensors, sizes and running sums."""

    modules: tuple[nn.Module, ...]
    module_names: tuple[str, ...]
    weight: str | None = None
    bias: str | None = None
    a: Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    g: Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    calls: int = 0

    def add_input(self, joint: Tensor) -> None:
        """Add a call's ``(in + 1)^2`` input moments, the part this layer covers."""
        self.calls += 1
        part = joint if self.weight is not None and self.bias is not None else None
        if part is None:
            part = joint[:-1, :-1] if self.bias is None else joint[-1:, -1:]
        self.a.add_(part)


def _layers(model: nn.Module, subset: ParamSubset) -> list[_Layer]:
    """The selected tensors grouped into layers (weight and bias of the same modules
    together), in the order of the model's parameters.

    Raises:
        ValueError: an entry subset, or a tensor that is not a whole Linear/Conv weight/bias.
    """
    named = dict(model.named_parameters())
    order = {n: k for k, n in enumerate(named)}
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, m in model.named_modules():
        for role in ("weight", "bias"):
            t = m._parameters.get(role)
            if t is not None:
                owners.setdefault(id(t), []).append((mname or "<model>", m, role))
    groups: dict[tuple[int, ...], _Layer] = {}
    for name in subset.names:
        if not subset.is_whole(name):
            raise ValueError(
                f"params: K-FAC covers whole tensors, but {name!r} has "
                f"{subset.selected_shape(name).numel()} of its {named[name].numel()} entries "
                f"selected; select whole tensors (e.g. params=[{name!r}])"
            )
        found = owners.get(id(named[name]), [])
        role = _check_owners(name, found)
        key = tuple(sorted(id(m) for _, m, _ in found))
        layer = groups.setdefault(
            key, _Layer(tuple(m for _, m, _ in found), tuple(n for n, _, _ in found))
        )
        setattr(layer, role, name)
    layers = sorted(groups.values(), key=lambda g: min(order[n] for n in (g.weight, g.bias) if n))
    like = named[subset.names[0]]
    for layer in layers:
        m = layer.modules[0]
        k = (_patch_size(m) if layer.weight else 0) + (1 if layer.bias else 0)
        co = m.out_features if isinstance(m, nn.Linear) else m.out_channels
        layer.a = like.new_zeros(k, k).detach()
        layer.g = like.new_zeros(co, co).detach()
    return layers


def _check_owners(name: str, found: list[tuple[str, nn.Module, str]]) -> str:
    """The role (``weight``/``bias``) of parameter ``name`` in the modules holding it."""
    how = "leave it out with params= (e.g. the Linear/Conv tensors by name or glob)"
    if not found:
        raise ValueError(
            f"parameter {name!r} is not the weight or bias of a module: K-FAC has no "
            f"Kronecker factors for it; {how}"
        )
    for mname, m, _ in found:
        base = next((b for b in _LAYERS if isinstance(m, b)), None)
        if base is None:
            raise ValueError(
                f"parameter {name!r} belongs to module {mname!r} ({type(m).__name__}), not a "
                "Linear or Conv1d/2d/3d layer: K-FAC has no Kronecker factors for it "
                f"(laplace-torch's KronLaplace refuses it too); {how}"
            )
        if type(m).forward is not base.forward:
            raise ValueError(
                f"parameter {name!r} belongs to module {mname!r} ({type(m).__name__}), which "
                f"overrides {base.__name__}.forward: its input-output relation is unknown; {how}"
            )
    if len({r for _, _, r in found}) > 1 or len({type(m) for _, m, _ in found}) > 1:
        holders = ", ".join(f"{n!r} ({type(m).__name__}.{r})" for n, m, r in found)
        raise ValueError(
            f"parameter {name!r} is held by modules of different kinds or roles ({holders}); "
            f"K-FAC needs one layer type; {how}"
        )
    return found[0][2]


def _patch_size(m: nn.Module) -> int:
    if isinstance(m, nn.Linear):
        return m.in_features
    return m.in_channels // m.groups * math.prod(m.kernel_size)


# ---------------------------------------------------------------------- per layer call
def _patches(m: nn.Module, x: Tensor) -> Tensor:
    """The patches ``(n * L, C_in / groups * prod(kernel))`` a convolution's weight reads
    on ``x`` ``(n, C_in, *spatial)``, rows sample-major then output position, columns in
    ``weight.flatten(1)`` order; grouped inputs averaged over their groups first."""
    d = x.dim() - 2
    if m.groups > 1:
        x = x.unflatten(1, (m.groups, -1)).mean(1)
    if any(m._reversed_padding_repeated_twice):
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
    n, c = x.shape[:2]
    kernel, stride, dilation = m.kernel_size, m.stride, m.dilation
    out = [(x.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(d)]
    st = x.stride()
    view = x.as_strided(
        (n, c, *kernel, *out),
        (
            st[0],
            st[1],
            *(st[2 + i] * dilation[i] for i in range(d)),
            *(st[2 + i] * stride[i] for i in range(d)),
        ),
        x.storage_offset(),
    )
    perm = (0, *range(2 + d, 2 + 2 * d), 1, *range(2, 2 + d))
    return view.permute(perm).reshape(n * math.prod(out), c * math.prod(kernel))


def _input_moments(m: nn.Module, x: Tensor, temp_bytes: int, name: str) -> Tensor:
    """``1/L sum_l [a_l; 1] [a_l; 1]^T`` ``(in + 1, in + 1)`` summed over the entries of dim 0
    of one call's input (the rows), ``L`` positions per row; formed a chunk of rows at a
    time."""
    n = x.shape[0] if x.dim() > 1 else 1
    if isinstance(m, nn.Linear):
        rows = x.reshape(-1, x.shape[-1])
        per = rows.shape[0] // n
        blocks = lambda s, e: rows[s * per : e * per]  # noqa: E731
        size = per * rows.shape[1]
    else:
        if x.dim() != m.weight.dim():
            raise ValueError(
                f"module {name!r} ({type(m).__name__}) was called on an input of shape "
                f"{tuple(x.shape)} without a batch dim"
            )
        blocks = lambda s, e: _patches(m, x[s:e])  # noqa: E731
        per = _positions(m, x)
        size = per * _patch_size(m)
    k = _patch_size(m)
    joint = x.new_zeros(k + 1, k + 1)
    step = chunk_in(temp_bytes, 2 * size, x.element_size(), n)
    total = 0
    for s in range(0, n, step):
        u = blocks(s, min(n, s + step))
        joint[:k, :k].addmm_(u.T, u)
        col = u.sum(0)
        joint[:k, k] += col
        joint[k, :k] += col
        total += u.shape[0]
    joint[k, k] = total
    return joint / per


def _positions(m: nn.Module, x: Tensor) -> int:
    """Output positions per sample of a convolution on ``x`` ``(n, C, *spatial)``."""
    d = x.dim() - 2
    pads = m._reversed_padding_repeated_twice
    total = 1
    for i in range(d):
        size = x.shape[2 + i] + pads[2 * (d - 1 - i)] + pads[2 * (d - 1 - i) + 1]
        total *= (size - m.dilation[i] * (m.kernel_size[i] - 1) - 1) // m.stride[i] + 1
    return total


def _output_moments(m: nn.Module, g: Tensor) -> Tensor:
    """``sum_{rows} g g^T`` ``(out, out)`` over the samples and positions of one call's
    output gradient ``g`` (Linear ``(*, out)``; Conv ``(n, out, *spatial)``)."""
    if isinstance(m, nn.Linear):
        rows = g.reshape(-1, g.shape[-1])
    else:
        rows = g.transpose(0, 1).reshape(g.shape[1], -1).T
    return rows.T @ rows


class _Recorder:
    """Hooks for one batched forward pass: each selected module's call adds its input
    moments to its layers and hands the model a copy of its output, keeping the output itself
    as the place its gradient is read (an in-place op after the layer, such as
    ``ReLU(inplace=True)``, changes only the copy). Parameters read outside their modules are
    noted (``watch.misused``). Removed on exit."""

    def __init__(self, layers: list[_Layer], n: int, temp_bytes: int) -> None:
        self.n, self.temp_bytes = n, temp_bytes
        self.by_module: dict[int, list[_Layer]] = {}
        self.names: dict[int, str] = {}
        self.modules: dict[int, nn.Module] = {}
        watched = {}
        for layer in layers:
            for m, mname in zip(layer.modules, layer.module_names):
                self.by_module.setdefault(id(m), []).append(layer)
                self.names[id(m)], self.modules[id(m)] = mname, m
            for pname, role in ((layer.weight, "weight"), (layer.bias, "bias")):
                if pname is not None:
                    watched[id(layer.modules[0]._parameters[role])] = pname
        self.watch = _UseWatch(watched)
        self.calls: list[tuple[int, Tensor]] = []
        # which sample each row of a call's output belongs to (:meth:`check_rows`)
        self.tracker = RowTracker(n)
        self.rows: list[tuple[nn.Module, Any, tuple[int, ...]]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        try:
            for m in self.modules.values():
                self._handles.append(m.register_forward_pre_hook(self._pre_hook))
                self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
            self.watch.__enter__()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.watch.__exit__(*exc)
        finally:
            self._remove()

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        self.watch.inside += 1

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Tensor:
        try:
            name = self.names[id(module)]
            x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input")
            if len(args) + len(kwargs) != 1 or not isinstance(x, Tensor):
                raise ValueError(f"module {name!r} was called with other than one input tensor")
            # the bookkeeping is not the model's: no torch-function mode around the call
            # (map_levels' canvas, a user's) sees it
            with torch._C.DisableTorchFunction(), self.tracker.paused():
                joint = _input_moments(module, x.detach(), self.temp_bytes, name)
            for layer in self.by_module[id(module)]:
                layer.add_input(joint)
            anchor = output if output.requires_grad else output.detach().requires_grad_()
            self.calls.append((id(module), anchor))
            self.rows.append((module, self.tracker.owner(anchor), tuple(anchor.shape)))
            return anchor.clone()
        finally:
            self.watch.inside -= 1

    def check_rows(self, out: Tensor) -> None:
        """Every row of every call's output belongs to one sample, and the output's row ``i``
        is sample ``i`` (:mod:`~multiscale_jac.rows`): ``G`` sums the rows' gradients, each a
        sample's own only then.

        Raises:
            ValueError: naming the module and why.
        """
        why = output_rows(self.tracker, out)
        if why is not None:
            raise ValueError(
                f"kron_factors runs batches of samples, but the model's output rows are not its "
                f"samples in order: {why}"
            )
        for module, owner, shape in self.rows:
            found = groups_of(
                owner, shape, len(shape) - 1 if isinstance(module, nn.Linear) else 1, self.n
            )
            if isinstance(found, str):
                raise ValueError(
                    f"module {self.names[id(module)]!r} ({type(module).__name__}): {found}, so "
                    "K-FAC's output factor would sum gradients of several samples; leave its "
                    "tensors out with params= or use a diagonal or full curvature"
                )

    def backward(self, objectives: list[tuple[Tensor, float]]) -> None:
        """One backward pass per ``(scalar, weight)``: ``G += weight sum g g^T`` per call."""
        anchors = [a for _, a in self.calls]
        last = len(objectives) - 1
        for k, (scalar, weight) in enumerate(objectives):
            if not anchors or not scalar.requires_grad:
                continue
            grads = torch.autograd.grad(scalar, anchors, retain_graph=k < last, allow_unused=True)
            for (mid, _), g in zip(self.calls, grads):
                if g is None:
                    continue
                moments = _output_moments(self.modules[mid], g)
                for layer in self.by_module[mid]:
                    layer.g.add_(moments, alpha=weight)


# ---------------------------------------------------------------------- the run
class _KronRun:
    """The state across batches: the layers' sums, the loss, the sample count."""

    def __init__(self, prep: Prepared, opts: _Options, layers: list[_Layer]) -> None:
        self.prep, self.opts, self.layers = prep, opts, layers
        self.count = 0
        self.outputs = 0
        self.output_dim = 0
        self.loss = layers[0].a.new_zeros(())
        self.separable_checked = False

    def add(self, packed: PackedBatch, targets: Any) -> None:
        per_sample = [t.to(self.prep.device) for t in split_targets(targets, len(packed))]
        fn = self.prep.function(packed)
        chunk, temp = self._chunking(fn, packed)
        for b in packed.buckets():
            step = chunk or len(b.indices)
            for s in range(0, len(b.indices), step):
                idx = b.indices[s : s + step]
                self._chunk(
                    fn,
                    packed.stack(idx),
                    [per_sample[i] for i in idx],
                    [self.count + i for i in idx],
                    temp,
                )
        self.count += len(packed)

    def _chunking(self, fn: PerSampleFunction, packed: PackedBatch) -> tuple[int | None, int]:
        """Samples per batched run and bytes of per-call temporaries, from ``chunk_size`` or
        ``memory_budget`` (against one sample's measured working set)."""
        opts = self.opts
        if opts.memory_budget is None:
            return opts.chunk, DEFAULT_TEMP_BYTES
        itemsize = self.layers[0].a.element_size()
        kept = kfac_kept(sum(la.a.numel() + la.g.numel() for la in self.layers), itemsize)
        fp = measure(fn, fn.values(), tuple(packed.sample(packed.largest_sample)), count=False)
        one = kfac_sample(fp.activations)
        fit = fit_budget(
            opts.memory_budget,
            kept,
            one,
            f"the factors take {kept} bytes and one sample's forward and backward about {one}",
            temp=True,
        )
        return opts.chunk or fit.units, fit.temp

    def _chunk(
        self,
        fn: PerSampleFunction,
        levels: list[Tensor],
        targets: list[Tensor],
        numbers: list[int],
        temp: int,
    ) -> None:
        """One batched run of samples of one shape: input moments in the forward pass, the
        loss, then one backward pass per objective."""
        rec = _Recorder(self.layers, levels[0].shape[0], temp)
        rec.tracker.mark_inputs(levels)
        loop_only = _LOOP_ONLY.set("kron_factors: every level's call counts its own positions")
        try:
            with torch.enable_grad(), rec, rec.tracker:
                out = fn.call_batch(levels)
            self._check_run(fn, levels, out, rec)
            rec.check_rows(out)
        finally:
            _LOOP_ONLY.reset(loop_only)
        opts = self.opts
        y = torch.stack(
            check_targets(targets, out.shape[1:], opts.likelihood, opts.ignore, numbers)
        )
        self.loss += nll_sum(out.detach(), y, opts.likelihood, opts.sigma, opts.ignore)
        self.outputs += out[0].numel() * out.shape[0]
        self.output_dim = output_dim(out.shape[1:])
        rec.backward(self._objectives(out, y))

    def _check_run(
        self, fn: PerSampleFunction, levels: list[Tensor], out: Any, rec: _Recorder
    ) -> None:
        """The batched run's output is one tensor, no selected parameter was read outside its
        modules, and (once per call) the model does not mix samples in a batch."""
        if not isinstance(out, Tensor):
            raise TypeError(
                "kron_factors needs the model (after output_fn) to return one tensor; got "
                f"{type(out).__name__}"
            )
        if rec.watch.misused:
            names = ", ".join(repr(n) for n in sorted(rec.watch.misused))
            raise ValueError(
                f"parameter(s) {names} are also read outside their Linear/Conv modules (a tied "
                "output embedding, F.linear(x, self.fc.weight), ...): their Kronecker factors "
                "would miss those uses; leave them out with params="
            )
        if not self.separable_checked:
            try:
                check_separable(
                    fn, levels, out, random=self.prep.randomness is not Randomness.ERROR
                )
            except NotLayerwiseError as err:
                raise ValueError(f"kron_factors runs batches of samples, but {err}") from err
            self.separable_checked = True

    def _objectives(self, out: Tensor, y: Tensor) -> list[tuple[Tensor, float]]:
        """The scalars whose output gradients make ``G``, with their weights."""
        opts = self.opts
        if opts.kind == "empirical":
            return [(nll_sum(out, y, opts.likelihood, opts.sigma, opts.ignore), 1.0)]
        if opts.kind == "mc":
            noise = draw_noise(out.shape, opts.likelihood, opts.mc_samples, opts.generator)
            return [
                (
                    nll_sum(
                        out,
                        labels_from_noise(out, u, y, opts.likelihood, opts.sigma, opts.ignore),
                        opts.likelihood,
                        opts.sigma,
                        opts.ignore,
                    ),
                    1.0 / opts.mc_samples,
                )
                for u in noise
            ]
        n = out.shape[0]
        if opts.likelihood is Likelihood.REGRESSION:
            flat = out.reshape(n, -1)
            return [(flat[:, o].sum() / opts.sigma, 1.0) for o in range(flat.shape[1])]
        return _ggn_class_objectives(out, y, opts.ignore)

    def result(self) -> KronResult:
        if self.count == 0:
            raise ValueError("data yielded no samples")
        for la in self.layers:
            if not la.calls:
                names = ", ".join(repr(n) for n in la.module_names)
                covered = ", ".join(repr(n) for n in (la.weight, la.bias) if n)
                raise ValueError(
                    f"module(s) {names} were never called in the forward pass: no factors for "
                    f"{covered}; leave them out with params="
                )
        layers = tuple(
            KronFactors(
                modules=la.module_names,
                weight=la.weight,
                bias=la.bias,
                A=la.a / self.count,
                G=la.g.clone(),
                num_data=self.count,
            )
            for la in self.layers
        )
        opts = self.opts
        return KronResult(
            layers,
            self.count,
            self.loss,
            opts.kind,
            opts.likelihood,
            opts.sigma,
            self.outputs,
            self.output_dim,
        )


def _ggn_class_objectives(out: Tensor, y: Tensor, ignore: int) -> list[tuple[Tensor, float]]:
    """``f . sqrt(p_c) (e_c - p)`` per class ``c`` and output position (``Lambda = diag(p) -
    p p^T = sum_c q_c q_c^T`` per position), positions labelled ``ignore`` left out."""
    n, classes = out.shape[:2]
    logits = out.reshape(n, classes, -1)  # (n, C, positions)
    valid = (y.reshape(n, -1) != ignore).to(out.dtype)
    p = torch.softmax(logits.detach(), dim=1) * valid.unsqueeze(1)
    root = p.sqrt()
    eye = torch.eye(classes, dtype=out.dtype, device=out.device)
    objectives = []
    for j in range(logits.shape[2]):
        if not bool(valid[:, j].any()):
            continue
        for c in range(classes):
            coef = root[:, c, j : j + 1] * (eye[c] - p[:, :, j])  # (n, C)
            objectives.append(((logits[:, :, j] * coef).sum(), 1.0))
    return objectives

"""The op library of the execution layer (private): how ops are named and their arguments
bound (by :data:`SIGNATURES` for torch builtins, which have no Python signature, else by
``inspect``), which ops are elementwise and how they treat zeros, pooling and padding
arithmetic, and :class:`RuleMode`, the rule-table ``TorchFunctionMode`` under masked execution
(:class:`~multiscale_jac.masked.MaskedMode`) and level packing
(:class:`~multiscale_jac.levels.CanvasMode`).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .enums import UnsupportedOpError


def tensors(args: tuple, kwargs: dict) -> Iterator[Tensor]:
    """The tensors among ``args`` and ``kwargs`` values, also inside lists and tuples."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, Tensor))


def op_name(func: Any) -> str:
    """How users write the op: ``F.conv2d``-style, ``torch.cat``-style or ``Tensor.view``."""
    name = getattr(func, "__name__", None) or repr(func)
    qual = getattr(func, "__qualname__", "") or ""
    if getattr(F, name, None) is func or "boolean_dispatch" in qual:
        return f"F.{name}"
    if qual.startswith(("TensorBase.", "Tensor.")) or getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"F.{name}" if module.startswith("torch.nn.functional") else f"torch.{name}"


def ntuple(x: Any, n: int) -> tuple:
    """``x`` as an ``n``-tuple: a scalar or a 1-sequence repeated, other sequences as they are."""
    if isinstance(x, (list, tuple)):
        return tuple(x) if len(x) == n else tuple(x) * n if len(x) == 1 else tuple(x)
    return (x,) * n


def _signature(spec: str) -> tuple[list[str], dict[str, Any]]:
    """``"input weight bias=None"`` -> ``(["input", "weight", "bias"], {"bias": None})``."""
    names, defaults = [], {}
    for arg in spec.split():
        name, _, default = arg.partition("=")
        names.append(name)
        if default:
            defaults[name] = ast.literal_eval(default)
    return names, defaults


#: Argument names (positional order) and defaults of the ops whose arguments rules read.
SIGNATURES: dict[str, tuple[list[str], dict[str, Any]]] = {
    kind: _signature(spec)
    for kind, spec in {
        "conv": "input weight bias=None stride=1 padding=0 dilation=1 groups=1",
        "max_pool": "input kernel_size stride=None padding=0 dilation=1 ceil_mode=False "
        "return_indices=False",
        "avg_pool": "input kernel_size stride=None padding=0 ceil_mode=False "
        "count_include_pad=True divisor_override=None",
        "interpolate": "input size=None scale_factor=None mode='nearest' align_corners=None "
        "recompute_scale_factor=None antialias=False",
        "batch_norm": "input running_mean running_var weight=None bias=None training=False "
        "momentum=0.1 eps=1e-5",
        "group_norm": "input num_groups weight=None bias=None eps=1e-5",
        "layer_norm": "input normalized_shape weight=None bias=None eps=1e-5",
        "rms_norm": "input normalized_shape weight=None eps=None",
        "instance_norm": "input running_mean=None running_var=None weight=None bias=None "
        "use_input_stats=True momentum=0.1 eps=1e-5",
        "linear": "input weight bias=None",
        "cat": "tensors dim=0",
        "adaptive_pool": "input output_size return_indices=False",
        "reduce": "input dim=None keepdim=False",
        "softmax": "input dim=None",
        "unbind": "input dim=0",
        "chunk": "input chunks dim=0",
        "split": "input split_size_or_sections dim=0",
        "hardtanh": "input min_val=-1.0 max_val=1.0",
        "clamp": "input min=None max=None",
        "sdpa": "query key value attn_mask=None dropout_p=0.0 is_causal=False scale=None "
        "enable_gqa=False",
    }.items()
}


def bind_op(kind: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of a :data:`SIGNATURES` op by name, defaults filled in."""
    names, defaults = SIGNATURES[kind]
    return {**defaults, **dict(zip(names, args)), **kwargs}


_INSPECTED: dict[Any, inspect.Signature | None] = {}


def bind_call(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The arguments of a call of a Python function by name, defaults filled in; ``None`` if it
    has no signature or the call does not bind to it."""
    if func not in _INSPECTED:
        try:
            _INSPECTED[func] = inspect.signature(func)
        except (TypeError, ValueError):
            _INSPECTED[func] = None
    sig = _INSPECTED[func]
    if sig is None:
        return None
    try:
        b = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    b.apply_defaults()
    return dict(b.arguments)


def with_input(args: tuple, kwargs: dict, new: Tensor) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the first argument (``input``) replaced by ``new``."""
    if args:
        return (new, *args[1:]), kwargs
    return (), {**kwargs, "input": new}


# ---------------------------------------------------------------------- elementwise
def named(owner: Any, names: str) -> list[Any]:
    """``owner.<name>`` for every name of the space-separated ``names``."""
    return [getattr(owner, n) for n in names.split()]


def pairs(names: str) -> list[Any]:
    """``torch.<name>`` and ``Tensor.<name>`` for every name of ``names``."""
    return [*named(torch, names), *named(torch.Tensor, names)]


#: Tensor methods whose tensor arguments after ``self`` only lend a dtype, device or shape (a
#: template): the output's data, so its region, come from ``self`` alone
TEMPLATE_OPS = frozenset(named(torch.Tensor, "type_as to view_as reshape_as expand_as"))
#: Tensor methods that make a new tensor of a given size, taking only dtype and device from
#: ``self``: no data operand, so never tracked
NEW_OPS = frozenset(named(torch.Tensor, "new_zeros new_ones new_full new_empty new_tensor"))


def data_operands(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors whose values reach ``func``'s output (:func:`tensors`, less the templates of
    :data:`TEMPLATE_OPS` and the ``self`` of :data:`NEW_OPS`)."""
    if func in NEW_OPS:
        return []
    if func in TEMPLATE_OPS:
        return [args[0]] if args and isinstance(args[0], Tensor) else []
    return list(tensors(args, kwargs))


#: pure elementwise activations (out of place), shared with the structured forward pass
#: (``entries``), which keeps a pending tangent through them
ACTIVATIONS = [
    *pairs("relu sigmoid tanh"),
    *named(F, "relu relu6 leaky_relu elu selu celu gelu silu mish hardswish hardsigmoid"),
    *named(F, "hardtanh softplus softsign sigmoid tanh prelu"),
]
UNARY = [
    *ACTIVATIONS,
    *pairs("relu_ sigmoid_ tanh_ exp abs neg clamp clip square sin cos erf clone gt lt ge le"),
    *named(F, "tanhshrink logsigmoid dropout dropout1d dropout2d dropout3d alpha_dropout"),
    *named(torch.Tensor, "contiguous detach to float double half type_as long int bool"),
    *named(torch.Tensor, "clamp_ mul_ add_ sub_ div_"),
    *named(torch, "zeros_like ones_like full_like rand_like randn_like empty_like"),
]
BINARY = [
    *pairs("add sub mul where"),
    *named(torch.Tensor, "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ masked_fill"),
    torch.maximum,
    torch.minimum,
]
#: Ops that are singular at 0 (value or derivative), by the positions of their singular
#: operands (divisor, ``log``/``sqrt`` input, ``pow`` base): their padded inputs are set to 1
#: first, so that no inf/nan is produced there (``where`` would hide it in the forward pass but
#: not in the backward pass).
SINGULAR = {
    **dict.fromkeys([*pairs("div"), *named(torch.Tensor, "__truediv__ div_")], (1,)),
    torch.true_divide: (1,),
    **dict.fromkeys(pairs("log sqrt rsqrt reciprocal pow"), (0,)),
    **dict.fromkeys(named(torch.Tensor, "__rtruediv__ __rdiv__ __pow__ __rpow__"), (0,)),
    **dict.fromkeys(named(torch, "log2 log10"), (0,)),
}
#: In-place ops that keep zeros zero (their output must not be modified again: autograd may have
#: saved it); ``div_``'s padded divisor is set to 1 first (:data:`SINGULAR`).
ZERO_PRESERVING_INPLACE = {*pairs("relu_ tanh_"), torch.Tensor.mul_, torch.Tensor.div_}
#: In-place ops that do not keep zeros zero and whose backward uses their output: re-zeroing
#: that output in place would corrupt the saved tensor, so they are unsupported.
SAVES_OUTPUT_INPLACE = set(pairs("sigmoid_ exp_"))


def zero_preserving(func: Any, args: tuple, kwargs: dict, mode: Any) -> bool:
    """In-place ops that map 0 to 0 given these arguments (``mode.region`` tells tracked
    tensors)."""
    if func in (F.relu, F.relu6, F.leaky_relu, F.elu, F.hardtanh):
        if func is F.hardtanh:
            lo = bind_op("hardtanh", args, kwargs)
            return lo["min_val"] <= 0 <= lo["max_val"]
        return True
    if func in (torch.Tensor.add_, torch.Tensor.sub_):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return mode.region(other) is not None or (not isinstance(other, Tensor) and other == 0)
    if func is torch.Tensor.clamp_:
        b = bind_op("clamp", args, kwargs)
        lo, hi = b["min"], b["max"]
        if isinstance(lo, Tensor) or isinstance(hi, Tensor):
            return False
        return (lo is None or lo <= 0) and (hi is None or hi >= 0)
    return False


# ---------------------------------------------------------------------- windows and norms
def pool_args(b: dict, nsp: int) -> tuple:
    """``(kernel, stride, padding)`` of a bound pooling call, as ``nsp``-tuples."""
    kernel = ntuple(b["kernel_size"], nsp)
    stride = ntuple(b["stride"] if b["stride"] not in (None, [], ()) else kernel, nsp)
    padding = ntuple(b["padding"], nsp)
    return kernel, stride, padding


def avg_divisor(sizes: Tensor, out_extent: Sequence[int], b: dict, dtype: torch.dtype) -> Tensor:
    """Per-sample divisor table ``(N, *out_extent)`` of a bound ``avg_pool`` call ``b`` as
    PyTorch computes it for inputs of valid size ``sizes`` ``(N, d)`` (1 where the output is
    padding, to avoid dividing by zero)."""
    kernel, stride, padding = pool_args(b, len(out_extent))
    n = sizes.shape[0]
    dev = sizes.device
    table = torch.ones((n, *out_extent), dtype=dtype, device=dev)
    for k, m in enumerate(out_extent):
        o = torch.arange(m, device=dev).unsqueeze(0)  # (1, m)
        s_in = sizes[:, k : k + 1]  # (N, 1)
        start = o * stride[k] - padding[k]
        end = torch.minimum(start + kernel[k], s_in + padding[k])
        if b["count_include_pad"]:
            count = end - start
        else:
            count = torch.minimum(end, s_in) - torch.clamp(start, min=0)
        count = torch.clamp(count, min=1).to(dtype)
        table = table * count.reshape(n, *(m if j == k else 1 for j in range(len(out_extent))))
    return table


def numeric_padding(
    padding: Any, dilation: tuple[int, ...], kernel: tuple[int, ...]
) -> tuple | None:
    """A conv's ``padding`` as numbers: ``'valid'`` -> zeros, ``'same'`` -> half the dilated
    kernel, or ``None`` for ``'same'`` with an even dilated kernel (asymmetric padding)."""
    nd = len(kernel)
    if not isinstance(padding, str):
        return ntuple(padding, nd)
    if padding == "valid":
        return (0,) * nd
    if any(d * (k - 1) % 2 for d, k in zip(dilation, kernel)):
        return None
    return tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))


def require_more_than_one(counts: Tensor, func: Any, context: str, unit: str) -> None:
    """Instance/group norm of a single value raises in PyTorch; so must a packed run.
    ``counts``: the values every ``unit`` (sample, level) normalises together."""
    if bool((counts <= 1).any()):
        i = int((counts <= 1).nonzero()[0, 0])
        raise ValueError(
            f"{context}: {op_name(func)}: {unit} {i} normalises a single value; PyTorch "
            "expects more than 1 value per group (the unpadded model fails too)"
        )


# ---------------------------------------------------------------------- rule modes
#: the attribute an error raised inside a rule mode gets: the op and module it was raised at
AT = "multiscale_jac_at"


class RuleMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that runs every op touching a tracked tensor by its rule.

    A subclass says what a tensor is tracked with (:meth:`region`, ``None`` if untracked) and
    defines ``mask(region, like)`` (bool, true where real, broadcasting against ``like``),
    ``track(t, region)`` and ``rezero(out, region)`` (``out`` zeroed outside ``region``, tracked);
    it registers rules ``rule(mode, func, args, kwargs)`` in its own table with :meth:`rule`, and
    names its errors (``context``, ``no_rule``, ``root``: the model's own name). An op with no
    tracked tensor argument runs as it is; one without a rule runs and raises
    :meth:`unsupported` if it returned a tensor (shape and dtype queries pass).

    Args:
        model: Names the module of an unsupported op in errors (``None``: no names).
    """

    rules: ClassVar[dict[Any, Callable[..., Any]]] = {}
    #: ops whose rule runs even without a tracked tensor argument (a size read from a tracked
    #: tensor's shape reaches them as plain ints)
    untracked: ClassVar[frozenset[Any]] = frozenset()
    context: ClassVar[str]
    no_rule: ClassVar[str]
    root: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.rules = {}

    def __init__(self, model: Any = None) -> None:
        super().__init__()
        modules = model.named_modules() if isinstance(model, nn.Module) else ()
        self._module_names = {id(m): n for n, m in modules}

    @classmethod
    def rule(cls, *funcs: Any) -> Callable[[Callable], Callable]:
        """Decorator: the rule of ``funcs`` (``None`` entries skipped) in this mode's table."""

        def register(fn: Callable) -> Callable:
            cls.rules.update((f, fn) for f in funcs if f is not None)
            return fn

        return register

    def region(self, t: Any) -> Any:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def fill(self, t: Any, region: Any, value: float) -> Any:
        """``t`` with ``value`` outside ``region`` (``t`` itself where ``region`` is ``None``)."""
        return t if region is None else torch.where(self.mask(region, t), t, value)

    def singular_safe(self, func: Any, args: tuple) -> tuple:
        """``args`` with the padding of :data:`SINGULAR` operands set to 1 (no inf/nan there)."""
        if func not in SINGULAR:
            return args
        return tuple(
            self.fill(a, self.region(a), 1.0) if i in SINGULAR[func] else a
            for i, a in enumerate(args)
        )

    def settle(
        self, func: Any, args: tuple, kwargs: dict, operands: list, out: Tensor, region: Any
    ) -> Tensor:
        """An elementwise op's output tracked with ``region``: re-zeroed (a new tensor), or in
        place when the op wrote into an operand and does not keep zeros zero."""
        if any(out is t for t in operands) or kwargs.get("inplace", False):
            if func not in ZERO_PRESERVING_INPLACE and not zero_preserving(
                func, args, kwargs, self
            ):
                out.masked_fill_(~self.mask(region, out), 0)
            return self.track(out, region)
        return self.rezero(out, region)

    def unsupported(self, func: Any, reason: str) -> UnsupportedOpError:
        """The error for ``func``, naming where it ran (:meth:`where`)."""
        return UnsupportedOpError(*self.where(func), reason, context=self.context)

    def where(self, func: Any) -> tuple[str, str | None]:
        """``func``'s name and the innermost module of the model whose method is running
        (found by walking the stack; ``None`` if none)."""
        name = "" if func is None else op_name(func)
        frame = sys._getframe(1)
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and id(obj) in self._module_names:
                return name, self._module_names[id(obj)] or self.root
            frame = frame.f_back
        return name, None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            if func not in self.untracked and not any(
                self.region(t) is not None for t in data_operands(func, args, kwargs)
            ):
                return func(*args, **kwargs)
            rule = self.rules.get(func)
            if rule is not None:
                return rule(self, func, args, kwargs)
            out = func(*args, **kwargs)
        except UnsupportedOpError:
            raise
        except Exception as err:
            # the innermost op names where the run failed (notes and fallbacks say it)
            if not hasattr(err, AT):
                op, module = self.where(func)
                setattr(err, AT, op + (f" in module {module!r}" if module else ""))
            raise
        if any(True for _ in tensors((out,), {})):
            raise self.unsupported(func, self.no_rule)
        return out  # shape/dtype queries and the like


def twice_differentiable() -> Any:
    """A context in which every op's derivative has a correct derivative under ``vmap``:
    attention runs by its math form (``F.scaled_dot_product_attention``'s fused CPU/CUDA
    kernels have no double backward) and layer and instance normalisation by their formulas
    (torch's batching rule for the derivative of ``native_layer_norm``'s backward gives wrong
    numbers under ``vmap``: seen on torch 2.13, ``grad`` of a ``vmap(grad)`` off by O(1)). For
    the routes that differentiate twice: the Jacobian-norm gradient and the column chunks of a
    dense-output GGN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
    stack.enter_context(_NormFormulas())
    return stack


_INSTANCE_NORM = inspect.signature(F.instance_norm)


class _NormFormulas(TorchFunctionMode):
    """``F.layer_norm`` and ``F.instance_norm`` (with input statistics) as their formulas."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in (F.layer_norm, torch.layer_norm):
            return _layer_norm(*args, **kwargs)
        if func in (F.instance_norm, torch.instance_norm):
            bound = _INSTANCE_NORM.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["use_input_stats"]:
                a = bound.arguments
                x = a["input"]
                return _normalise(x, tuple(range(2, x.dim())), a["eps"], a["weight"], a["bias"], 1)
        return func(*args, **kwargs)


def _layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    return _normalise(input, dims, eps, weight, bias, 0)


def _normalise(
    x: Tensor,
    dims: tuple[int, ...],
    eps: float,
    weight: Tensor | None,
    bias: Tensor | None,
    channel_dim: int,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over ``dims`` (biased variance);
    ``weight``/``bias`` over the trailing dims (``channel_dim=0``) or per channel (dim 1)."""
    centred = x - x.mean(dims, keepdim=True)
    y = centred * torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)
    shape = (-1, *[1] * (x.dim() - 2)) if channel_dim else None
    if weight is not None:
        y = y * (weight.reshape(shape) if shape else weight)
    if bias is not None:
        y = y + (bias.reshape(shape) if shape else bias)
    return y

"""The row tracker (multiscale_jac.rows): the owner it gives each output element is sound
(the element's true dependence, by autograd, is on that sample's data alone) and, for the ops
with a rule, known; what it cannot follow is Unknown, with a reason naming the op."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import multiscale_jac as mj
from multiscale_jac import rows
from multiscale_jac._row_rules import Unknown, combine, compress, reshape_owner
from multiscale_jac.rows import RowTracker, clear_row_cache, groups_of, output_rows

N = 4
DTYPE = torch.float64
PERM = torch.tensor([2, 0, 3, 1])
W = torch.randn(3, 5, dtype=DTYPE, generator=torch.Generator().manual_seed(0))


def _track(f: Callable, x: torch.Tensor):
    tracker = RowTracker(x.shape[0])
    tracker.mark_inputs([x])
    with tracker:
        out = f(x)
    return tracker, out


def _dependence(f: Callable, x: torch.Tensor) -> torch.Tensor:
    """``(out elements, samples)``: whether each output element's derivative reaches each
    sample's input."""
    jac = torch.autograd.functional.jacobian(f, x)
    out_numel = jac.numel() // x.numel()
    return (jac.reshape(out_numel, x.shape[0], -1) != 0).any(-1)


def _check_sound(f: Callable, x: torch.Tensor) -> object:
    tracker, out = _track(f, x)
    owner = tracker.owner(out)
    if isinstance(owner, Unknown):
        return owner
    dep = _dependence(f, x.detach())
    full = (
        torch.full(out.shape, -1, dtype=torch.int32) if owner is None else owner.expand(out.shape)
    ).reshape(-1)
    for e in range(full.numel()):
        samples = dep[e].nonzero().view(-1).tolist()
        o = int(full[e])
        assert samples in ([], [o]), f"element {e}: owner {o}, depends on samples {samples}"
    return owner


def _lin(x):
    return x @ W


def _write_rows(x):
    y = x.new_zeros(2 * N, 3)
    y[::2] = x[:, 0]
    y[1::2] = x[:, 1] * 2
    return y


def _index_put(x):
    y = x.new_zeros(N, 2, 3)
    y.index_put_((PERM,), x)
    return y


def _scatter(x):
    idx = torch.tensor([[1, 0, 1], [0, 1, 0]]).expand(N, 2, 3)
    return x.new_zeros(N, 2, 3).scatter_add(1, idx, x)


def _canvas(x):
    c = x.new_zeros(N, 3, 6, 6)
    c[:, :, 1:4, 2:5] = (
        x.reshape(N, 2, 3)[:, :, :, None].expand(N, 2, 3, 3)[:, :1].expand(N, 3, 3, 3)
    )
    return F.conv2d(c, torch.ones(2, 3, 3, 3, dtype=DTYPE))


def _attention(x):
    q = x.reshape(N, 1, 2, 3)
    return F.scaled_dot_product_attention(q, q, q)


#: (id, function of x (N, 2, 3), owner known?)
OPS: list[tuple[str, Callable, bool]] = [
    ("fold sample-major", lambda x: _lin(x.reshape(2 * N, 3)), True),
    ("fold sample-minor", lambda x: _lin(x.transpose(0, 1).reshape(2 * N, 3)), True),
    ("fold and unfold", lambda x: _lin(x.reshape(-1, 3)).reshape(N, -1), True),
    ("split the sample dim", lambda x: x.reshape(2, 2, 2, 3) * 2, True),
    ("permuted rows", lambda x: x[PERM], True),
    ("permuted folded rows", lambda x: x.reshape(-1, 3)[torch.arange(2 * N).flip(0)], True),
    ("repeated rows", lambda x: x[torch.tensor([0, 0, 3])], True),
    ("bool mask", lambda x: x[torch.tensor([True, False, True, True])], True),
    ("slices", lambda x: x[1:3, :, ::2], True),
    ("select", lambda x: x[:, 0] + x[:, 1], True),
    ("index_select", lambda x: x.index_select(0, PERM), True),
    ("gather", lambda x: x.gather(1, torch.tensor([[[1, 0, 1]]]).expand(N, 1, 3)), True),
    ("cat along the batch", lambda x: torch.cat([x, x.flip(0)], 0), True),
    ("cat along features", lambda x: torch.cat([x, torch.ones(N, 2, 1, dtype=DTYPE)], -1), True),
    ("stack", lambda x: torch.stack([x, 2 * x], 1).flatten(0, 1), True),
    ("split and cat back", lambda x: torch.cat(list(reversed(x.split(1, 0))), 0), True),
    ("unbind", lambda x: torch.stack(x.unbind(0)[::-1]), True),
    ("repeat", lambda x: x.repeat(2, 1, 1), True),
    ("repeat_interleave", lambda x: x.repeat_interleave(2, 0), True),
    ("expand", lambda x: x[:, None].expand(N, 3, 2, 3).reshape(N * 3, 6), True),
    ("flip and roll", lambda x: x.flip(0).roll(1, 0), True),
    ("pad", lambda x: F.pad(x, (1, 1, 0, 1)), True),
    ("writes into rows", _write_rows, True),
    ("index_put", _index_put, True),
    ("scatter_add", _scatter, True),
    ("canvas", _canvas, True),
    ("sum over items", lambda x: x.sum(1), True),
    ("mean over the batch", lambda x: x - x.mean(0), False),
    ("softmax over features", lambda x: torch.softmax(x, -1), True),
    ("softmax over the batch", lambda x: torch.softmax(x, 0), False),
    ("cumsum", lambda x: x.cumsum(1), True),
    ("sort over items", lambda x: x.sort(1).values, True),
    ("topk over the batch", lambda x: x.topk(2, 0).values, False),
    ("matmul", lambda x: x @ x.transpose(1, 2), True),
    ("einsum", lambda x: torch.einsum("nkd,nld->nkl", x, x), True),
    ("bmm across samples", lambda x: x.reshape(2, 2, 6) @ x.reshape(2, 6, 2), False),
    ("layer_norm", lambda x: F.layer_norm(x, (3,)), True),
    ("group_norm", lambda x: F.group_norm(x.reshape(N, 6, 1), 2), True),
    (
        "batch norm with batch statistics",
        lambda x: F.batch_norm(x, None, None, training=True),
        False,
    ),
    ("instance_norm", lambda x: F.instance_norm(x), True),
    ("attention", _attention, True),
    (
        "conv over folded rows",
        lambda x: F.conv1d(x.reshape(2 * N, 1, 3), torch.ones(2, 1, 2, dtype=DTYPE)),
        True,
    ),
    (
        "conv with samples in channels",
        lambda x: F.conv1d(x.reshape(1, 2 * N, 3), torch.ones(1, 2 * N, 2, dtype=DTYPE)),
        False,
    ),
    ("pooling", lambda x: F.max_pool1d(x, 2) + F.avg_pool1d(x, 2), True),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2.0, mode="linear"), True),
    ("unfold", lambda x: F.unfold(x.reshape(N, 1, 2, 3), 2), True),
    ("where and clamp", lambda x: torch.where(x > 0, x, x.clamp(min=-0.5) * 2), True),
]


@pytest.mark.parametrize(("name", "f", "known"), OPS, ids=[o[0] for o in OPS])
def test_owners_are_sound_and_known(name: str, f: Callable, known: bool) -> None:
    x = torch.randn(N, 2, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    owner = _check_sound(f, x)
    if known:
        assert not isinstance(owner, Unknown), owner
    else:
        assert isinstance(owner, Unknown) and "mixes samples" in owner.reason


def _same_owner(a: object, b: object) -> bool:
    if isinstance(a, Unknown) or isinstance(b, Unknown):
        return isinstance(a, Unknown) and isinstance(b, Unknown) and a.reason == b.reason
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize(("name", "f", "known"), OPS, ids=[o[0] for o in OPS])
def test_kept_rule_results_give_the_owners_the_rules_give(
    name: str, f: Callable, known: bool
) -> None:
    """The second run of the same shapes reads the rules' kept results: the same owners,
    sound; a rule that reads values (indices, masks) is never kept."""
    x = torch.randn(N, 2, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    clear_row_cache()
    first, first_out = _track(f, x)  # the rules run
    kept = len(rows._MEMO)
    tracker, out = _track(f, x)  # their kept results
    assert _same_owner(tracker.owner(out), first.owner(first_out))
    assert len(rows._MEMO) == kept  # every kept question answered from the cache
    _check_sound(f, x)  # sound with the kept results in place


def test_rows_permuted_by_values_are_followed_on_every_call() -> None:
    """Index values are read on every call: the same shapes with another permutation give
    other owners."""
    clear_row_cache()
    for seed in range(3):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        tracker, out = _track(lambda x, perm=perm: (x * 2)[perm].tanh(), torch.randn(N, 3))
        assert tracker.owner(out).reshape(-1).tolist() == perm.tolist()


def test_clear_plan_cache_forgets_the_kept_rule_results() -> None:
    _track(lambda x: (x @ W.T).tanh().sum(1), torch.randn(N, 5, dtype=DTYPE))
    assert rows._MEMO
    mj.clear_plan_cache()
    assert not rows._MEMO


def test_a_fold_gives_each_row_its_sample() -> None:
    x = torch.randn(N, 2, 3, dtype=DTYPE)
    tracker, out = _track(lambda x: x.reshape(2 * N, 3), x)
    assert tracker.owner(out).reshape(-1).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    tracker, out = _track(lambda x: x.transpose(0, 1).reshape(2 * N, 3), x)
    assert tracker.owner(out).reshape(-1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    groups = groups_of(tracker.owner(out), out.shape, 1, N)
    assert groups.per == 0 and groups.table.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_output_must_have_sample_i_on_row_i() -> None:
    x = torch.randn(N, 3, dtype=DTYPE)
    tracker, out = _track(lambda x: x[PERM], x)
    assert "output row 0 is computed from sample 2's data" in output_rows(tracker, out)
    tracker, out = _track(lambda x: x[PERM][torch.argsort(PERM)], x)
    assert output_rows(tracker, out) is None
    tracker, out = _track(lambda x: x.reshape(2, -1), x)
    assert "shape (2, 6) for 4 samples" in output_rows(tracker, out)


def test_a_row_written_through_another_view_after_it_was_read_is_unknown() -> None:
    def f(x):
        base = x.clone()
        top, bottom = base[:2], base[2:]
        read = bottom * 1  # read before the write: still sample 2 and 3's
        top.copy_(x[2:])  # rows 0, 1 now hold samples 2, 3
        return base, read, bottom

    tracker, (base, read, bottom) = _track(f, torch.randn(N, 3, dtype=DTYPE))
    assert tracker.owner(base).reshape(-1).tolist() == [2, 3, 2, 3]  # written through a view
    assert tracker.owner(read).reshape(-1).tolist() == [2, 3]
    assert isinstance(tracker.owner(bottom), Unknown)  # a sibling view: stale, not guessed


def test_a_custom_autograd_function_is_unknown() -> None:
    """Its backward is not seen: it could send a row's gradient anywhere."""

    class FlipGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g.flip(0)

    x = torch.randn(N, 3, dtype=DTYPE, requires_grad=True)
    tracker, out = _track(lambda x: FlipGrad.apply(x) * 2, x)
    owner = tracker.owner(out)
    assert isinstance(owner, Unknown) and "FlipGrad" in owner.reason


def test_an_op_without_a_rule_is_unknown_naming_it_unless_one_sample_owns_everything() -> None:
    tracker, out = _track(lambda x: torch.fft.fft(x).real, torch.randn(N, 4, dtype=DTYPE))
    owner = tracker.owner(out)
    assert isinstance(owner, Unknown) and "fft" in owner.reason
    tracker, out = _track(lambda x: torch.fft.fft(x).real, torch.randn(1, 4, dtype=DTYPE))
    assert tracker.owner(out).reshape(-1).tolist() == [0]  # a batch of one


def test_a_learned_row_expanded_over_the_batch_has_no_owner() -> None:
    token = torch.randn(1, 1, 3, dtype=DTYPE)
    tracker, out = _track(
        lambda x: token.expand(x.shape[0], 2, 3) @ W, torch.randn(N, 3, dtype=DTYPE)
    )
    assert tracker.owner(out) is None
    assert "no sample's data" in groups_of(tracker.owner(out), out.shape, 2, N)
    # put in front of each sample's own rows, it takes the sample's owner
    tracker, out = _track(
        lambda x: torch.cat([token.expand(N, 1, 3), x[:, None]], 1), torch.randn(N, 3, dtype=DTYPE)
    )
    assert tracker.owner(out).reshape(-1).tolist() == [0, 1, 2, 3]


def test_the_library_s_own_bookkeeping_is_not_tracked() -> None:
    tracker, out = _track(lambda x: x * 2, torch.randn(N, 3, dtype=DTYPE))
    with tracker.paused(), tracker:
        other = out.sum(0)
    assert tracker.owner(other) is None  # not seen (a fresh leaf)


# ---------------------------------------------------------------------- the owner algebra
owners = st.lists(st.integers(-1, 3), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(values=owners, cols=st.integers(1, 3))
def test_compress_keeps_every_owned_element(values: list[int], cols: int) -> None:
    o = torch.tensor(values, dtype=torch.int32).repeat_interleave(cols).view(len(values), cols)
    c = compress(o)
    if all(v < 0 for v in values):
        assert c is None
        return
    full = c.expand(o.shape)
    owned = o >= 0
    assert bool((full[owned] == o[owned]).all())


@settings(max_examples=100, deadline=None)
@given(a=owners, b=owners)
def test_combine_agrees_or_raises(a: list[int], b: list[int]) -> None:
    k = min(len(a), len(b))
    ta, tb = torch.tensor(a[:k], dtype=torch.int32), torch.tensor(b[:k], dtype=torch.int32)
    clash = any(x >= 0 and y >= 0 and x != y for x, y in zip(a[:k], b[:k]))
    if clash:
        with pytest.raises(Unknown):
            combine([ta, tb], "op")
        return
    out = combine([ta, tb], "op")
    assert out.tolist() == [max(x, y) for x, y in zip(a[:k], b[:k])]


def test_reshape_expands_only_the_groups_that_carry_owners() -> None:
    o = torch.arange(4, dtype=torch.int32).view(4, 1, 1)
    assert reshape_owner(o, (4, 2, 1000), (8, 1000)).shape == (8, 1)
    assert reshape_owner(o, (4, 2, 1000), (4, 2000)).shape == (4, 1)

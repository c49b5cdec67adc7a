"""Two CPU processes with gloo give the single-process results (float64, 1e-12)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cases import CASES, DTYPE, make_subset

import multiscale_jac as mj

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

CASE = "dense_per_pixel"  # ragged samples, per-pixel logits with ignored pixels
TOL = 1e-12


def make_data() -> tuple[torch.nn.Module, mj.ParamSubset, list]:
    """The model, a subset and 5 batches of 3, 1, 2, 4, 1 ragged samples (uneven per rank)."""
    case = next(c for c in CASES if c.id == CASE)
    model = case.build()
    subset = make_subset(model, "elements", case)
    g = torch.Generator().manual_seed(0)
    data = []
    for size in (3, 1, 2, 4, 1):
        xs, ys = [], []
        for _ in range(size):
            h, w = (int(v) for v in torch.randint(1, 5, (2,), generator=g))
            xs.append([torch.randn(2, h, w, generator=g, dtype=DTYPE)])
            y = torch.randint(2, (h, w), generator=g)
            y.view(-1)[0] = -100
            ys.append(y)
        data.append((xs, ys))
    return model, subset, data


def compute(process_group=None) -> dict[str, torch.Tensor]:
    model, subset, data = make_data()
    fisher = mj.diag_fisher(
        model,
        data,
        params=subset,
        kind="exact",
        progress=False,
        process_group=process_group,
        return_loss=True,
    )
    emp = mj.diag_fisher(model, data, params=subset, progress=False, process_group=process_group)
    la = mj.SubnetLaplace(model, "classification", subset, prior_precision=0.7)
    la.fit(data, progress=False, process_group=process_group)
    diag = mj.DiagLaplace(model, "classification", subset, prior_precision=0.7)
    diag.fit(data, progress=False, process_group=process_group)
    return {
        "fisher_exact": fisher.flat,
        "fisher_empirical": emp.flat,
        "count": torch.tensor(fisher.num_samples),
        "ggn": la.H,
        "lml": la.log_marginal_likelihood().detach(),
        "n_data": torch.tensor(la.n_data),
        "fisher_loss": torch.tensor(fisher.loss, dtype=DTYPE),
        "fisher_outputs": torch.tensor(fisher.num_outputs),
        "diag_h": diag.H,
        "diag_lml": diag.log_marginal_likelihood().detach(),
        "diag_n_data": torch.tensor(diag.n_data),
    }


def jacnorm(samples: slice, process_group=None) -> dict[str, torch.Tensor]:
    """``S`` and its gradient on ``samples`` of 5 inputs to an MLP."""
    case = next(c for c in CASES if c.id == "mlp_vectors")
    model = case.build()
    x = torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    value = mj.jacobian_sq_norm_backward(model, x[samples], process_group=process_group)
    return {"S": value, **{f"grad {n}": p.grad for n, p in model.named_parameters()}}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        result = compute()
        result.update(jacnorm(slice(0, 3) if rank == 0 else slice(3, 5)))
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # both ranks done before gloo tears down
    finally:
        dist.destroy_process_group()
    # gloo's worker threads can abort the interpreter's own teardown ("terminate called
    # without an active exception", SIGABRT, about 1 run in 10 on 2 cores): the results are
    # saved and the group destroyed, so leave without running the C++ static destructors.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_processes_match_one(tmp_path) -> None:
    single = compute()
    single.update(jacnorm(slice(None)))
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert set(got) == set(single)
        for key, ref in single.items():
            torch.testing.assert_close(got[key], ref, atol=TOL, rtol=0, msg=f"{key} on {rank}")
    assert int(single["count"]) == 11


def test_process_group_without_distributed() -> None:
    model, subset, data = make_data()
    with pytest.raises(ValueError, match="not initialised"):
        mj.diag_fisher(model, data, params=subset, progress=False, process_group=object())
    with pytest.raises(ValueError, match="not initialised"):
        mj.SubnetLaplace(model, "classification", subset).fit(data, process_group=object())
    with pytest.raises(ValueError, match="accumulate_grad=True"):
        mj.jacobian_sq_norm(model, data[0][0], process_group=object())

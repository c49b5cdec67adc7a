"""Diagonal Fisher and subnetwork Laplace over a dataset sharded across processes.

Launch with ``torchrun --nproc_per_node=2 examples/distributed_fisher.py`` (gloo on CPU; use
``--backend nccl`` with one GPU per process). Every rank passes the same DataLoader; the library
gives rank ``r`` of ``W`` batches ``r, r + W, ...`` (a loader with a ``DistributedSampler`` is
taken as already sharded and used as is, but that sampler repeats samples to even out the
shards). ``diag_fisher`` and ``SubnetLaplace.fit`` all-reduce their sums once at the end, so
every rank prints the same result: the one a single process gets on all of the data. Run
without ``torchrun`` it is one process (what CI runs).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multiscale_jac as mj


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args, _ = parser.parse_known_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group(args.backend)
    rank = dist.get_rank() if launched else 0
    device = torch.device(f"cuda:{rank}" if args.backend == "nccl" else "cpu")
    try:
        torch.manual_seed(0)  # the same model on every rank
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        ).to(device)
        g = torch.Generator().manual_seed(1)
        dataset = TensorDataset(torch.randn(101, 3, 16, 16, generator=g), torch.randint(4, (101,)))
        loader = DataLoader(dataset, batch_size=16)  # batches are moved to the model's device
        fisher = mj.diag_fisher(model, loader, progress=False)
        subset = mj.ParamSubset.last_layer(model)
        la = mj.SubnetLaplace(model, "classification", subset)
        la.fit(loader, progress=False)
        print(
            f"rank {rank}: Fisher over {fisher.num_samples} samples, mean "
            f"{float(fisher.flat.mean()):.6g}; Laplace on {la.n_data} samples, "
            f"log marginal likelihood {float(la.log_marginal_likelihood()):.6f}"
        )
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

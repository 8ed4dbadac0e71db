"""Train a small CNN on scikit-learn's digits with DDP + distributed K-FAC under torchrun.

One node, 2 processes::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 examples/torchrun_digits.py --strategy dkfac

Two nodes (run once per node, NODE_RANK 0 and 1)::

    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=2 \
        --master_addr=HOST --master_port=29500 examples/torchrun_digits.py --strategy kaisa
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import dkfac
from dkfac.comm import destroy_process_groups
from dkfac.data.builtin import load_digits_tensors
from dkfac.models import SmallCNN


def main(argv: list[str] | None = None) -> int:
    """Train, print the K-FAC layer table and per-epoch accuracy on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", default="dkfac", choices=["local", "dkfac", "kaisa", "spd", "pad", "dp"]
    )
    parser.add_argument("--grad-worker-fraction", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    args = parser.parse_args(argv)

    # One GPU per process when the machine has one for every local process, else the CPU.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpus = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if on_gpus:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpus else "gloo")
    train(args, torch.device("cuda", local_rank) if on_gpus else torch.device("cpu"))
    dist.barrier()  # nobody tears the groups down while a peer still talks to them
    # Frees what still holds a group (DDP and the preconditioner sit in reference cycles)
    # before destroying them: freed at interpreter exit instead, gloo can abort the process.
    destroy_process_groups()
    return 0


def train(args: argparse.Namespace, device: torch.device) -> None:
    """One rank's training; everything that holds a process group is released on return."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train, test = load_digits_tensors()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(SmallCNN().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    pre = dkfac.KFACPreconditioner(
        model, strategy=args.strategy, lr=args.lr, grad_worker_fraction=args.grad_worker_fraction
    )
    if rank == 0:
        print(pre)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            pre.step()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            x, y = test.tensors
            correct = (model(x.to(device)).argmax(1) == y.to(device)).sum()
        checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        sums = [torch.zeros_like(checksum) for _ in range(world)]
        dist.all_gather(sums, checksum)
        if rank == 0:
            spread = max(float(s) for s in sums) - min(float(s) for s in sums)
            print(
                f"epoch {epoch + 1}: test accuracy {float(correct) / len(y):.4f}, "
                f"comm {sum(v['bytes'] for v in pre.comm_stats().values()) / 1e6:.2f} MB/step, "
                f"parameter checksum spread across ranks {spread:.2e}"
            )
    pre.remove()  # detaches the hooks and releases the strategy's process groups


if __name__ == "__main__":
    raise SystemExit(main())

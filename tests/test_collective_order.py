"""Why hook-launched collectives cannot deadlock next to DDP's on NCCL: the same issue order.

NCCL runs each communicator's collectives on its own stream; two ranks deadlock when they
issue collectives of two communicators in different orders (each kernel waits for a peer
that is blocked in the other). dkfac launches collectives from backward hooks (SPD/PAD's
factor pipeline, DeAR's reduce-scatters) next to DDP's bucket allreduces, on a group of its
own. All of them are launched by the autograd engine's thread in the backward graph's order,
and dkfac's step-time collectives follow a plan every rank shares, so every rank issues the
same sequence. This test records that sequence on each of two gloo ranks (what is launched,
on which group, how many elements: the order NCCL would see) over several steps, including a
decomposition step, and checks the two ranks issue the same one, interleaving included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dkfac
from distributed_harness import run_workers

LAUNCHERS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 10),
    )


def _issue_order(rank: int, world: int, strategy: str, sync: str) -> list[tuple[Any, ...]]:
    launched: list[tuple[Any, ...]] = []
    with pytest.MonkeyPatch.context() as patch:
        for name in LAUNCHERS:
            original = getattr(dist, name)

            def record(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
                group = kw.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group else "world"
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                launched.append((_name, ranks, sum(t.numel() for t in tensors)))
                return _original(*args, **kw)

            patch.setattr(dist, name, record)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        dear = None
        if sync == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)

            def ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
                # DDP's own allreduce, recorded.
                launched.append(("ddp_bucket", bucket.index(), bucket.buffer().numel()))
                work = dist.distributed_c10d.all_reduce(bucket.buffer(), async_op=True)
                return work.get_future().then(lambda f: f.value()[0] / world)

            ddp.register_comm_hook(None, ddp_hook)
            trained: nn.Module = ddp
        else:
            dear = dkfac.DeAR(model, optimizer, bucket_cap_mb=0.001)
            trained = model
        pre = dkfac.KFACPreconditioner(
            trained, strategy=strategy, lr=0.05, factor_update_steps=1, inv_update_steps=3
        )
        generator = torch.Generator().manual_seed(rank)
        for step in range(4):
            x = torch.randn(8, 3, 8, 8, generator=generator)
            y = torch.randint(0, 10, (8,), generator=generator)
            launched.append(("step", step))
            optimizer.zero_grad()
            F.cross_entropy(trained(x), y).backward()
            if dear is not None:
                dear.gather_gradients()
            pre.step()
            if dear is not None:
                dear.step()
            else:
                optimizer.step()
        pre.remove()
        if dear is not None:
            dear.remove()
    return launched


@pytest.mark.parametrize(
    ("strategy", "sync"), [("spd", "ddp"), ("pad", "ddp"), ("kaisa", "ddp"), ("dkfac", "dear")]
)
def test_every_rank_issues_the_same_collectives_in_the_same_order(strategy: str, sync: str) -> None:
    ranks = run_workers(_issue_order, world_size=2, args=(strategy, sync), timeout=120)
    assert ranks[0] == ranks[1]
    kinds = {entry[0] for entry in ranks[0]}
    # Both sources interleave in what was recorded: the test sees DDP's (or DeAR's) and
    # dkfac's collectives, in backward and at step().
    assert ("ddp_bucket" in kinds) == (sync == "ddp")
    assert len([e for e in ranks[0] if e[0] not in ("step", "ddp_bucket")]) > 4

"""``dkfac bench``'s timed window trains K-FAC + DeAR as K-FAC + DDP does (P=2, gloo).

The window of a ``STRATEGY+dear`` row must precondition the averaged gradients, as DDP hands
them to K-FAC: with different batches on the two ranks, the weights it trains must be those of
the same strategy's DDP row, within float32 rounding. The ``auto+dear`` row chooses among
DeAR candidates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distributed_harness import run_workers
from dkfac.bench import timed_window
from dkfac.bench.configs import NUM_CLASSES, configurations

FEATURES = 6
BATCH = 8
SEED = 0


def _train_both(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Per row key: the weights its window trained on this rank, and its last loss."""
    built: list[nn.Module] = []

    def tiny(num_classes: int) -> nn.Module:
        # Two K-FAC layers, small enough that a window takes milliseconds; time_window
        # seeds torch before building it, so both rows start from the same weights.
        net = nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, num_classes))
        built.append(net)
        return net

    # This process only: a tiny model, and a fixed DeAR bucket size, so that DeAR takes no
    # extra warm-up steps to search one and both rows take the same number of steps.
    timed_window.MODELS = {"tiny": tiny}
    timed_window.DEAR_BUCKET_CAP_MB = 25.0
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    trained: dict[str, dict[str, Any]] = {}
    for config in configurations(world_size, ("dkfac", "dkfac+dear", "auto+dear"), ((1, 1),))[1:]:
        window = timed_window.time_window(
            config, "tiny", x, y, warmup=2, iters=2, seed=SEED, bucket_cap_mb=25.0
        )
        trained[config.key] = {
            "params": [p.detach().clone() for p in built[-1].parameters()],
            "final_loss": window["final_loss"],
            "warmup_steps": window["warmup_steps"],
            "chosen": window["chosen"],
        }
    return trained


def test_kfac_with_dear_preconditions_the_gradients_ddp_averages() -> None:
    for rank, trained in enumerate(run_workers(_train_both, 2, timeout=120)):
        ddp, dear = trained["dkfac_1_1"], trained["dkfac_dear_1_1"]
        assert dear["warmup_steps"] == ddp["warmup_steps"] == 2
        for got, want in zip(dear["params"], ddp["params"], strict=True):
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}"
            )
        assert dear["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
        # The auto+dear row's AutoOptions chose for DeAR's averaging: a DeAR candidate (or,
        # where a loaded machine's calibration cannot be fitted, its fallback, labelled so).
        chosen = trained["auto_dear_1_1"]["chosen"]
        assert chosen is not None and "dear" in chosen.split(), chosen
        assert ddp["chosen"] is None

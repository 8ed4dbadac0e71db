"""How a training step's gradients are averaged over the ranks: DDP or DeAR."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import dkfac
from dkfac.cli.config import TrainConfig
from dkfac.cli.device import Precision


class GradientSync:
    """How a step's gradients are averaged over the ranks and the optimizer applied.

    ``--grad-sync ddp``: the model is wrapped in DDP (on several ranks) and ``optimizer.step()``
    updates. ``--grad-sync dear``: :class:`dkfac.DeAR` hooks the plain model; its step launches
    the all-gathers and the update lands in the next forward pass (or at once when K-FAC needs
    the averaged gradients first).

    Args:
        model: the model on this rank.
        optimizer: the optimizer over ``model``'s parameters.
        config: the run's configuration (``grad_sync``, ``bucket_mb``).
        world: number of ranks.
        precision: the run's precision (under fp16 the optimizer steps through its scaler).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        world: int,
        precision: Precision,
    ) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.dear: dkfac.DeAR | None = None
        self.model = model
        if config.grad_sync == "dear":
            self.dear = dkfac.DeAR(model, optimizer, bucket_cap_mb=config.bucket_cap_mb)
        elif world > 1:
            cap = config.bucket_cap_mb
            assert isinstance(cap, float)  # "auto" is refused for DDP by TrainConfig
            device = next(model.parameters()).device
            self.model = nn.parallel.DistributedDataParallel(
                model,
                device_ids=[device] if device.type == "cuda" else None,
                bucket_cap_mb=cap,
            )

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """A micro-batch's backward: DDP averages only the ``last`` one's (with the rest)."""
        if last or not isinstance(self.model, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def before_preconditioning(self) -> None:
        """Make ``.grad`` hold the averaged, unscaled gradients (DDP: averaged after backward)."""
        if self.dear is not None:
            self.dear.gather_gradients()
        self.precision.unscale(self.optimizer)

    def step(self) -> None:
        """The optimizer step of this iteration."""
        if self.dear is not None:
            self.dear.step()
        else:
            self.precision.step(self.optimizer)

    def close(self) -> None:
        """Apply what is still pending and detach (DeAR); nothing to do for DDP."""
        if self.dear is not None:
            self.dear.remove()

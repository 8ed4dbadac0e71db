"""Which training examples each rank sees, resumable at an exact position in the epoch.

Every epoch has one order of the whole training set, the same on every rank and for every
number of ranks: a permutation seeded by ``seed + epoch`` (PyTorch's ``DistributedSampler``
draws the same one). Ranks take turns along it (rank ``r`` of ``W`` takes positions
``r, r + W, ...``), so after ``b`` steps of batch ``B`` the first ``b·B·W`` positions are
consumed, whatever ``W`` is. A run resumed at position ``p`` (on any number of ranks)
continues with the positions from ``p`` on, so every example of the epoch is seen exactly
once; what cannot fill a last global batch is dropped, as ``drop_last`` does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """This rank's share of an epoch's order, from a start position on.

    With ``start=0`` it yields exactly what ``DistributedSampler(shuffle=True,
    drop_last=True, seed=seed)`` yields for the same epoch.

    Args:
        size: number of training examples.
        world_size: number of ranks.
        rank: this rank.
        seed: base seed of the epochs' permutations.
    """

    def __init__(self, size: int, world_size: int, rank: int, seed: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not allowed with world_size={world_size}")
        self.size, self.world_size, self.rank, self.seed = size, world_size, rank, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch``'s order from position ``start`` (examples consumed by all ranks)."""
        if not 0 <= start <= self.size:
            raise ValueError(f"start={start} is not allowed for {self.size} examples")
        self.epoch, self.start = epoch, start

    def order(self) -> torch.Tensor:
        """The epoch's order of all examples (the same on every rank)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator)

    def __len__(self) -> int:
        return (self.size - self.start) // self.world_size

    def __iter__(self) -> Iterator[int]:
        remaining = self.order()[self.start :]
        end = len(self) * self.world_size  # every rank gets as many
        return iter(remaining[self.rank : end : self.world_size].tolist())

"""Where a rank trains (``--device``) and in which precision (``--amp``).

One GPU per local worker: worker ``LOCAL_RANK`` of a machine takes ``cuda:LOCAL_RANK``, as
torchrun and Slurm lay jobs out. ``--device auto`` uses the GPUs when there is one for every
local worker, the CPU otherwise; ``--device cuda`` refuses a machine that cannot do that
instead of falling back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
AMP_MODES: tuple[str, ...] = ("none", "bf16", "fp16")


class DeviceError(ValueError):
    """A ``--device`` or ``--amp`` this machine cannot run; the message says what to use."""


@dataclass(frozen=True)
class LocalSlot:
    """This process's place among the workers of its machine."""

    rank: int
    world: int


def local_slot(environ: Mapping[str, str] | None = None, default_world: int = 1) -> LocalSlot:
    """This process's local rank and the number of workers on its machine.

    torchrun sets ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (``dkfac train``'s own workers too),
    Slurm ``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``; otherwise rank 0 of
    ``default_world``.
    """
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" in env:
        return LocalSlot(int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", default_world)))
    if "SLURM_LOCALID" in env:
        # SLURM_NTASKS_PER_NODE exists only with --ntasks-per-node; the step's per-node task
        # list ("4(x2),3": two nodes of 4, one of 3) always does: take this node's entry.
        layout = next(
            (
                env[name]
                for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                if env.get(name)
            ),
            env.get("SLURM_NTASKS_PER_NODE", str(default_world)),
        )
        per_node = slurm_task_counts(layout)
        node = int(env.get("SLURM_NODEID", "0"))
        return LocalSlot(int(env["SLURM_LOCALID"]), per_node[min(node, len(per_node) - 1)])
    return LocalSlot(0, default_world)


def slurm_task_counts(layout: str) -> list[int]:
    """Slurm's compressed per-node task counts, expanded: ``"4(x2),3"`` is ``[4, 4, 3]``."""
    counts: list[int] = []
    for part in layout.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def resolve_device(choice: str, slot: LocalSlot, cuda_count: int) -> torch.device:
    """The device of ``--device choice`` for the worker in ``slot``.

    Args:
        choice: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        slot: the worker's local rank and the local worker count.
        cuda_count: GPUs this process sees (``torch.cuda.device_count()``).

    Raises:
        DeviceError: ``cuda`` without CUDA, or fewer GPUs than local workers.
    """
    if choice not in DEVICES:
        raise DeviceError(f"--device {choice!r} is not allowed: choose one of {DEVICES}")
    if choice == "cpu":
        return torch.device("cpu")
    enough = cuda_count >= slot.world
    if choice == "cuda" and cuda_count == 0:
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        raise DeviceError(
            f"--device cuda is not allowed here: torch {torch.__version__} ({built}) sees no "
            "GPU on this machine; use --device cpu (or auto)"
        )
    if choice == "cuda" and not enough:
        raise DeviceError(
            f"--device cuda is not allowed with {slot.world} workers on this machine: it has "
            f"{cuda_count} GPU(s) and each worker takes its own (use --nproc {cuda_count}, "
            "or --device cpu)"
        )
    if not enough:  # auto
        if cuda_count:
            logger.info(
                "--device auto: %d workers but %d GPU(s) here, training on the CPU",
                slot.world,
                cuda_count,
            )
        return torch.device("cpu")
    return torch.device("cuda", slot.rank)


def backend_for(device: torch.device) -> str:
    """The process group backend for a run on ``device``.

    On CUDA, NCCL for CUDA tensors and gloo for the few CPU tensors some agreements use (one
    group serves both); gloo alone on the CPU.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_amp(amp: str, device: torch.device) -> None:
    """Refuse an ``--amp`` mode ``device`` does not run.

    Raises:
        DeviceError: an unknown mode, or fp16 on the CPU (it needs loss scaling and gains no
            speed there: bf16 is the CPU's 16-bit format).
    """
    if amp not in AMP_MODES:
        raise DeviceError(f"--amp {amp!r} is not allowed: choose one of {AMP_MODES}")
    if amp == "fp16" and device.type != "cuda":
        raise DeviceError(
            "--amp fp16 is not allowed on the CPU: float16 needs loss scaling and is not "
            "faster there; use --amp bf16 (or train on a GPU)"
        )


def check_plain_step_graphs(graphs: bool, device: torch.device) -> None:
    """Refuse ``--plain-step-graphs`` on a device without CUDA graphs.

    Raises:
        DeviceError: the flag is on and ``device`` is not a CUDA device.
    """
    if graphs and device.type != "cuda":
        raise DeviceError(
            f"--plain-step-graphs is not allowed on the {device.type.upper()}: CUDA graphs "
            "need a GPU (train with --device cuda, or leave the flag off)"
        )


class Precision:
    """Autocast for the forward pass and, for fp16, the GradScaler of the run.

    Args:
        amp: ``"none"``, ``"bf16"`` or ``"fp16"`` (checked by :func:`check_amp`).
        device: the device the run trains on.
    """

    def __init__(self, amp: str, device: torch.device) -> None:
        check_amp(amp, device)
        self.amp = amp
        self.device = device
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if amp == "fp16" else None
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward pass is autocast to (``None`` without ``--amp``)."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.amp)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's precision (a no-op context without ``--amp``)."""
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (scaled under fp16)."""
        torch.autograd.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients before K-FAC reads them (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step: through the scaler under fp16 (skipped on inf/NaN)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

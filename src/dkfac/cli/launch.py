"""Join a job started by an outside launcher: one rank of ``torchrun`` or Slurm ``srun``.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) or Slurm ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``), this process is one rank: it joins the job's process
group, and a collective that fails because a peer is gone is said in one line. Local workers
are started by :mod:`dkfac.cli.local_workers` instead.

The process group backend follows the device the run trains on
(:func:`dkfac.cli.device.backend_for`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExternalRank:
    """This process's place in a job started by torchrun or Slurm."""

    rank: int
    world_size: int
    launcher: str


def external_rank(environ: dict[str, str] | None = None) -> ExternalRank | None:
    """The rank given by torchrun or Slurm, if this process was started by one."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return ExternalRank(int(env["RANK"]), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return ExternalRank(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "slurm")
    return None


#: How gloo and NCCL say that a peer of a collective vanished or stopped answering.
_LOST_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "communicator was aborted",
)


def lost_peer_message(error: BaseException) -> str | None:
    """One line for a collective that failed because a peer is gone, or None if it did not.

    Under torchrun or Slurm every surviving rank sees the same failure; its launcher's own
    report names the rank that was lost (torchrun: "Root Cause").
    """
    text = " ".join(str(error).split())
    if not isinstance(error, RuntimeError) or not any(s in text for s in _LOST_PEER_SIGNS):
        return None
    brief = text if len(text) <= 160 else text[:157] + "..."
    return (
        f"a peer worker was lost or stopped answering: a collective failed ({brief}); the "
        "launcher's report names the lost rank"
    )


def join_external(
    rank: ExternalRank, threads: int, backend: str, collective_timeout: float = 600.0
) -> None:
    """Initialise the job's process group.

    Args:
        rank: this process's place in the job (:func:`external_rank`).
        threads: intra-op threads of this process.
        backend: from :func:`dkfac.cli.device.backend_for` of the run's device.
        collective_timeout: seconds a collective may wait before the process group fails.
    """
    torch.set_num_threads(threads)
    if rank.launcher == "slurm":  # srun sets no rendezvous variables of torch's own
        os.environ.setdefault(
            "MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
        )
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank.rank), str(rank.world_size)
    timeout = timedelta(seconds=collective_timeout)
    dist.init_process_group(
        backend,
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=timeout,
        store=_attempt_store(rank, timeout),
    )


def _attempt_store(rank: ExternalRank, timeout: timedelta) -> Any:
    """Under torchrun, the job's store with keys of its own per restart attempt (else None).

    torchrun's agent keeps its store across ``--max-restarts`` attempts; restarted workers
    could read the previous attempt's gloo addresses and fail to connect to processes that
    are gone ("Connection refused", seen in 3 of 6 restarts here; pytorch issue 167288 for
    NCCL). A prefix per attempt keeps each attempt's rendezvous apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if rank.launcher != "torchrun" or attempt is None:
        return None
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, not in the stubs
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        rank.world_size,
        is_master=not agent_hosts_it and rank.rank == 0,
        timeout=timeout,
    )
    return dist.PrefixStore(f"dkfac/attempt-{attempt}/", store)  # type: ignore[attr-defined]

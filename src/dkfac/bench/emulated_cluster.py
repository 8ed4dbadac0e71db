"""An emulated cluster on one machine: every worker in its own network namespace, shaped link.

Layout (nothing is created in the namespace this process runs in)::

    dkfac-<pid>-<id>-sw        the switch: bridge br0 and one port p<r> per worker
    dkfac-<pid>-<id>-w<r>      worker r: lo, and eth0 = 10.213.0.<r+1>/24, the other end of p<r>

Both directions of every worker's link are shaped with a token bucket (``tbf``) to the link's
rate: ``eth0``'s egress inside the worker's namespace and ``p<r>``'s egress inside the switch's
(which is the worker's ingress), so each worker has a full-duplex link of that rate to a
switch, as in a switched cluster. A delay, when asked for, is a ``netem`` child of the
worker's own token bucket: one worker's packets reach another DELAY later. gloo runs over
real TCP between the namespaces (``GLOO_SOCKET_IFNAME=eth0``).

Workers are started by :meth:`EmulatedCluster.command` (``ip netns exec`` then ``taskset``),
each pinned to its own core; more workers than cores is allowed and reported as
oversubscribed (:attr:`EmulatedCluster.oversubscribed`).

Tear-down: :meth:`EmulatedCluster.destroy` deletes the namespaces (their interfaces and the
bridge go with them). It runs when the ``with`` block ends, normally or by an exception,
Ctrl-C included; while the cluster exists SIGTERM and SIGHUP raise :class:`SystemExit` so that
it runs for them too. Namespaces left by a process that was killed outright (SIGKILL) are
removed by the next cluster made on this machine (their creator's pid is in their name).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

from dkfac.bench.link_shape import LinkShape

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "dkfac-"
#: The workers' subnet; it exists only inside the namespaces made here.
SUBNET = "10.213.0"
MAX_WORKERS = 250
WORKER_INTERFACE = "eth0"
#: Where rank 0 listens for the rendezvous (a fresh namespace: nothing else uses it).
RENDEZVOUS_PORT = 29500
#: Longest a packet may wait in a token bucket before it is dropped.
QUEUE_LATENCY_S = 0.02
#: Smallest token bucket: larger than one 64 KiB segmentation-offload packet with headers.
MIN_BURST_BYTES = 128 * 1024


class ClusterUnavailableError(RuntimeError):
    """This machine cannot make the emulated cluster (the message says why, in one line)."""


def _ip(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)


def _checked(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ClusterUnavailableError(f"{' '.join(argv)}: {result.stderr.strip() or 'failed'}")


def unavailable_reason() -> str | None:
    """Why no emulated cluster can be made here, or ``None`` when it can.

    Creates and deletes one empty namespace to find out (that needs CAP_NET_ADMIN).
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc", "taskset") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{NAMESPACE_PREFIX}{os.getpid()}-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return (
            f"cannot create network namespaces (needs root or CAP_NET_ADMIN): {made.stderr.strip()}"
        )
    _ip("netns", "del", probe)
    return None


def netem_missing(namespace: str, interface: str) -> str | None:
    """Why ``netem`` (delays) cannot be used on this kernel, or ``None``; probes ``interface``."""
    added = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "netem"],
        capture_output=True,
        text=True,
        check=False,
    )
    if added.returncode != 0:
        return (
            "this kernel has no netem queueing discipline (CONFIG_NET_SCH_NETEM), so links "
            "cannot be given a delay; give a rate only"
        )
    _checked(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", interface, "root"])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of emulated clusters whose creating process is gone."""
    listed = _ip("netns", "list")
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        pid_text = name[len(NAMESPACE_PREFIX) :].split("-")[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            _ip("netns", "del", name)
            removed.append(name)
    if removed:
        logger.info("removed %d namespaces left by dead runs: %s", len(removed), removed)
    return removed


class EmulatedCluster:
    """``workers`` network namespaces joined by a switch through links of shape ``link``.

    Use it as a context manager; the namespaces exist inside the ``with`` block only.

    Args:
        workers: number of workers (ranks), 1 to :data:`MAX_WORKERS`.
        link: every worker's link.
        cores: the CPUs to pin workers to, rank ``r`` on ``cores[r % len(cores)]`` (default:
            the CPUs this process may run on).

    Raises:
        ValueError: a bad worker count or an empty ``cores``.
    """

    def __init__(
        self, workers: int, link: LinkShape, *, cores: Sequence[int] | None = None
    ) -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers={workers}: expected 1 to {MAX_WORKERS}")
        self.workers = workers
        self.link = link
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if not self.cores:
            raise ValueError("cores is empty: the workers need at least one CPU")
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.name}-sw"
        self.namespaces = [f"{self.name}-w{rank}" for rank in range(workers)]
        self._made: list[str] = []
        self._saved_handlers: dict[int, Any] = {}

    # -- addresses and commands ------------------------------------------------------------
    def address(self, rank: int) -> str:
        """Worker ``rank``'s IPv4 address (inside its namespace)."""
        return f"{SUBNET}.{rank + 1}"

    @property
    def oversubscribed(self) -> bool:
        """Whether some workers share a core."""
        return self.workers > len(self.cores)

    def core(self, rank: int) -> int:
        """The CPU worker ``rank`` is pinned to."""
        return self.cores[rank % len(self.cores)]

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``rank``'s namespace, pinned to its core."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[rank],
            "taskset",
            "-c",
            str(self.core(rank)),
            *argv,
        ]

    def environment(self, rank: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's) plus what ``init_process_group("gloo")`` reads.

        Each worker is a node of its own: ``LOCAL_RANK`` 0 of ``LOCAL_WORLD_SIZE`` 1.
        """
        env = dict(os.environ if base is None else base)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.workers),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            MASTER_ADDR=self.address(0),
            MASTER_PORT=str(RENDEZVOUS_PORT),
            GLOO_SOCKET_IFNAME=WORKER_INTERFACE,
        )
        return env

    def describe(self) -> dict[str, Any]:
        """The cluster for reports."""
        return {
            "workers": self.workers,
            "link": self.link.as_dict(),
            "link_label": self.link.label(),
            "cores": [self.core(rank) for rank in range(self.workers)],
            "oversubscribed": self.oversubscribed,
            "shaping": "tbf on both directions of every worker link"
            + (", netem delay" if self.link.delay_s else ""),
        }

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.create()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.destroy()

    def create(self) -> None:
        """Make the namespaces, the switch and the shaped links.

        Raises:
            ClusterUnavailableError: this machine cannot (the reason in one line); whatever was
                made is deleted first.
        """
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailableError(reason)
        remove_stale_namespaces()
        self._catch_termination()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        logger.info(
            "emulated cluster %s: %d workers, %s links", self.name, self.workers, self.link.label()
        )

    def _namespace(self, name: str) -> None:
        _checked(["ip", "netns", "add", name])
        self._made.append(name)
        _checked(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._namespace(self.switch)
        _checked(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _checked(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for rank, namespace in enumerate(self.namespaces):
            port = f"p{rank}"
            self._namespace(namespace)
            _checked(
                ["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                 WORKER_INTERFACE, "netns", namespace]
            )  # fmt: skip
            _checked(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _checked(["ip", "-n", self.switch, "link", "set", port, "up"])
            _checked(
                ["ip", "-n", namespace, "addr", "add", f"{self.address(rank)}/24", "dev",
                 WORKER_INTERFACE]
            )  # fmt: skip
            _checked(["ip", "-n", namespace, "link", "set", WORKER_INTERFACE, "up"])
            if rank == 0 and self.link.delay_s:
                reason = netem_missing(namespace, WORKER_INTERFACE)
                if reason is not None:
                    raise ClusterUnavailableError(reason)
            # Both directions at the rate; the delay once per path (on the sender's side), so
            # a packet from one worker to another is delayed by DELAY, not twice.
            self._shape(namespace, WORKER_INTERFACE, delay=True)  # the worker's sending side
            self._shape(self.switch, port, delay=False)  # its receiving side

    def _shape(self, namespace: str, interface: str, *, delay: bool) -> None:
        """Token bucket at the link's rate on ``interface``'s egress, then the delay if asked."""
        rate_bytes = self.link.bytes_per_second
        # The bucket must hold a whole segmentation-offload packet (64 KiB of payload plus
        # headers): tbf splits a larger packet into MTU-sized ones in software, which costs
        # the workers' cores far more than the traffic itself (measured: 0.2-0.3 CPU-s per
        # 8 MB allreduce at 100 Mbit/s with a 64 KiB bucket, none with 128 KiB). At high rates
        # it holds a millisecond of traffic so that timer granularity does not cap the rate.
        # The queue holds QUEUE_LATENCY_S of traffic, and at least two buckets.
        burst = max(MIN_BURST_BYTES, int(rate_bytes * 1e-3))
        limit = max(2 * burst, int(rate_bytes * QUEUE_LATENCY_S))
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface]
        _checked(
            [*tc, "root", "handle", "1:", "tbf", "rate", self.link.tc_rate(), "burst", str(burst),
             "limit", str(limit)]
        )  # fmt: skip
        if delay and self.link.delay_s:
            _checked(
                [*tc, "parent", "1:1", "handle", "10:", "netem", "delay", self.link.tc_delay()]
            )

    def destroy(self) -> None:
        """Delete every namespace this cluster made (idempotent); restore signal handlers."""
        made, self._made = self._made, []
        for name in reversed(made):
            deleted = _ip("netns", "del", name)
            if deleted.returncode != 0:
                logger.warning("could not delete namespace %s: %s", name, deleted.stderr.strip())
        self._restore_termination()

    # -- signals ---------------------------------------------------------------------------
    def _catch_termination(self) -> None:
        """SIGTERM/SIGHUP raise SystemExit while the cluster exists (main thread only)."""
        if self._saved_handlers:
            return
        try:
            for number in (signal.SIGTERM, signal.SIGHUP):
                self._saved_handlers[number] = signal.signal(number, _exit_on_signal)
        except ValueError:  # not the main thread: the caller's handlers stay
            self._restore_termination()

    def _restore_termination(self) -> None:
        saved, self._saved_handlers = self._saved_handlers, {}
        for number, handler in saved.items():
            signal.signal(number, handler)


def _exit_on_signal(number: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + number)

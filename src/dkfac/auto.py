"""``strategy=dkfac.AutoOptions(...)``: the strategy the simulator predicts fastest, here.

At construction, on every rank together, the preconditioner asks :meth:`AutoOptions.choose`:

1. **Compute**: one worker's :class:`~dkfac.sim.profile.ComputeProfile`, measured on a copy
   of the model with the given example batch (:func:`~dkfac.sim.profiling.measure_profile`;
   the model, its gradients and the random number generators are left as they were), or
   given; the ranks agree on the slowest worker's times (elementwise maximum).
2. **Network and decompositions**: the cluster's cost model (an allreduce line and the
   decompositions' ``c0 + c3·d³``, :class:`~dkfac.comm.CostModelCache`; measured on first
   use, or given), as SPD/PAD measure it; the link is derived from the allreduce line.
3. **Choice**: every candidate (strategies, KAISA's fractions, bucket caps:
   :mod:`dkfac.sim.choice`) simulated at the run's schedule; rank 0's fastest is broadcast,
   so every rank builds the same strategy. SPD and PAD get the cost model just measured.

``pre.plan()["chosen"]`` has the ranking, the profile's totals and the link; the choice is
logged. Where the calibration cannot describe the cluster (:meth:`ClusterCostModel.problems`:
too noisy a network, decompositions whose time does not grow with size), nothing is
predicted: ``fallback`` runs, and the report says why. If profiling or timing the
decompositions fails on any rank (out of memory, say), every rank raises (none waits for the
others); only a collective that fails inside the network itself is left to the process
group's timeout. Measuring costs a few training steps of the copy and
the calibration (about a second here), once per preconditioner (reuse a ``CostModelCache``
across preconditioners).
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dkfac.comm import ClusterCostModel, CostModelCache, StepRecorder
from dkfac.comm.communicator import Communicator
from dkfac.comm.groups import require_distributed
from dkfac.config import DEFAULT_BUCKET_CAP_MB, KFACConfig, check_float
from dkfac.curvature.factor_side import largest_dense_side
from dkfac.dear.bucket_search import DEFAULT_AUTO_RANGE_MB
from dkfac.sim.choice import (
    AUTO_BUCKET_CAPS_MB,
    AUTO_STRATEGIES,
    Candidate,
    RankedCandidate,
    candidates,
    rank_candidates,
)
from dkfac.sim.network import LinkModel
from dkfac.sim.profile import ComputeProfile
from dkfac.sim.profiling import measure_profile
from dkfac.sim.run import SimulatedCluster, SimulatedRun
from dkfac.strategies.chooser import StrategyChoice, StrategyChooser
from dkfac.strategies.registry import LocalOptions, option_keywords, resolve_options

logger = logging.getLogger(__name__)

Loss = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AutoOptions(StrategyChooser):
    """Choose the strategy, KAISA fraction and bucket cap at construction (see the module).

    Attributes:
        example: ``(inputs, targets)``: one worker's batch, on the model's device, to profile
            the model with (with ``loss_fn``); or give ``profile``.
        loss_fn: ``loss_fn(model(inputs), targets)``, the training loss.
        profile: a compute profile of one worker (``dkfac simulate --profile-here``'s JSON,
            :meth:`ComputeProfile.load`) instead of measuring one.
        strategies: the strategies to choose among.
        bucket_caps_mb: the bucket caps to choose among (MiB, each > 0).
        cost_model: the cluster's cost model, or a cache to take it from (``None``: measured).
        measure_steps: steps of the copy timed per kind when measuring (after one warm-up).
        ddp_bucket_cap_mb: the ``bucket_cap_mb`` of the ``DistributedDataParallel`` that
            averages the gradients (its buckets share the links with K-FAC's traffic).
        dear_bucket_cap_mb: when :class:`dkfac.DeAR` averages the gradients instead of DDP,
            its ``bucket_cap_mb``: every candidate is then simulated with DeAR's
            reduce-scatters under the backward pass and its all-gathers before K-FAC's step
            (``gather_gradients``). ``"auto"`` (DeAR searches its cap online) is simulated at
            the geometric middle of DeAR's default search range, 2 MiB: the simulator cannot
            choose DeAR's cap (it models no per-bucket work on the training thread, so it
            predicts the smallest cap fastest). ``None``: DDP.
        fallback: the strategy run when the calibration cannot predict (see the module;
            ``None``: the first of ``strategies``).
        autocast: the dtype of the ``torch.autocast`` that training runs its forward pass
            under (mixed precision: ``torch.bfloat16`` or ``torch.float16``): the copy is
            profiled under it too. ``None``: no autocast.
    """

    name: ClassVar[str] = "auto"

    example: tuple[Tensor, Tensor] | None = field(default=None, compare=False, repr=False)
    loss_fn: Loss | None = field(default=None, compare=False, repr=False)
    profile: ComputeProfile | None = None
    strategies: tuple[str, ...] = AUTO_STRATEGIES
    bucket_caps_mb: tuple[float, ...] = AUTO_BUCKET_CAPS_MB
    cost_model: ClusterCostModel | CostModelCache | None = None
    measure_steps: int = 3
    ddp_bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    dear_bucket_cap_mb: float | str | None = None
    fallback: str | None = None
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        measured = self.example is not None and self.loss_fn is not None
        if measured == (self.profile is not None) or (self.example is None) != (
            self.loss_fn is None
        ):
            raise ValueError(
                "AutoOptions needs what to profile: example=(inputs, targets) with loss_fn=, "
                "or profile= (a ComputeProfile), not both"
            )
        candidates(SimulatedRun("dkfac"), 2, strategies=self.strategies)  # validates the names
        if not self.bucket_caps_mb or min(self.bucket_caps_mb) <= 0:
            raise ValueError(f"bucket_caps_mb={self.bucket_caps_mb!r}: expected caps > 0 MiB")
        check_float(
            "ddp_bucket_cap_mb",
            self.ddp_bucket_cap_mb,
            low=0.0,
            low_open=True,
            allowed="a finite number of MiB > 0",
        )
        if self.dear_bucket_cap_mb is not None and self.dear_bucket_cap_mb != "auto":
            check_float(
                "dear_bucket_cap_mb",
                self.dear_bucket_cap_mb,
                low=0.0,
                low_open=True,
                allowed='a finite number of MiB > 0, "auto" or None',
            )
        if self.fallback is not None and self.fallback not in self.strategies:
            raise ValueError(
                f"fallback={self.fallback!r}: expected one of the strategies "
                f"{', '.join(self.strategies)}"
            )
        if isinstance(self.measure_steps, bool) or not (
            isinstance(self.measure_steps, int) and self.measure_steps >= 1
        ):
            raise ValueError(f"measure_steps={self.measure_steps!r}: expected an integer >= 1")
        if self.autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast={self.autocast!r}: expected torch.bfloat16, torch.float16 or None"
            )

    def choose(self, model: nn.Module, config: Any) -> StrategyChoice:
        """The fastest predicted strategy for ``model`` on this cluster (collective)."""
        assert isinstance(config, KFACConfig)
        require_distributed("strategy=AutoOptions(...)")
        world_size = dist.get_world_size()
        if world_size == 1:
            report = self._unranked("local", "one process: local")
            return StrategyChoice(LocalOptions(), report["bucket_cap_mb"], report)
        parameters = list(model.parameters())
        if not parameters:
            raise ValueError("strategy=AutoOptions(...): the model has no parameters")
        device = parameters[0].device
        comm = Communicator(StepRecorder(keep_steps=1))
        mine: ComputeProfile | None = self.profile
        failure: Exception | None = None
        if mine is None:
            try:
                mine = self._measure(model, config, device)
            except Exception as error:  # every rank must hear of it before raising
                failure = error
        profile = agree_on_profile(mine, comm, device, failure)
        if not profile.layers:
            raise ValueError(
                "strategy=AutoOptions(...): the model has no layer K-FAC preconditions"
            )
        largest = largest_dense_side(side for layer in profile.layers for side in layer.shape.dims)
        cost = self._cost_model(config, device, largest)
        problems = cost.problems()
        if problems:
            return self._fallback(cost, problems)
        method = config.inverse_method
        profile = replace(
            profile, decomposition={**profile.decomposition, method: cost.decomposition}
        )
        link = LinkModel.from_allreduce_fit(cost.collective, world_size)
        cluster = SimulatedCluster(
            world_size,
            link,
            backend=str(dist.get_backend()),
            ddp_bucket_cap_mb=self.ddp_bucket_cap_mb,
        )
        comm_dtype = None if config.comm_dtype is None else str(config.comm_dtype).split(".")[-1]
        template = SimulatedRun(
            "dkfac",
            factor_update_steps=config.factor_update_steps_at(0),
            inv_update_steps=config.inv_update_steps_at(0),
            inverse_method=method,
            comm_dtype=comm_dtype,
            **self._gradient_sync(),
        )
        options = candidates(
            template, world_size, strategies=self.strategies, bucket_caps_mb=self.bucket_caps_mb
        )
        ranked = rank_candidates(profile, cluster, options)
        # Rank 0's answer for everyone: float noise can never split the ranks' choices.
        index = torch.tensor([options.index(ranked[0].candidate)], device=device)
        comm.broadcast([index], 0, phase="auto").wait()
        best = options[int(index.item())]
        report = _report(ranked, best, profile, link)
        logger.info("%s", report["reason"])
        run = best.run
        given = {"grad_worker_fraction": run.grad_worker_fraction, "cost_model": cost}
        chosen = resolve_options(run.strategy, **option_keywords(run.strategy, **given))
        return StrategyChoice(chosen, best.bucket_cap_mb, report)

    def _gradient_sync(self) -> dict[str, Any]:
        """How the simulated runs average their gradients (:class:`SimulatedRun`'s fields)."""
        cap = self.dear_bucket_cap_mb
        if cap is None:
            return {"gradient_sync": "ddp"}
        if cap == "auto":
            low, high = DEFAULT_AUTO_RANGE_MB
            cap = math.sqrt(low * high)
        return {"gradient_sync": "dear", "dear_bucket_cap_mb": float(cap)}

    def _fallback(self, cost: ClusterCostModel, problems: Sequence[str]) -> StrategyChoice:
        """``fallback`` with the first bucket cap, and why nothing was predicted."""
        strategy = self.fallback or self.strategies[0]
        reason = (
            f"strategy=auto chose {strategy} (its fallback) without a prediction: the "
            f"calibration cannot describe this cluster ({'; '.join(problems)})"
        )
        logger.warning("%s", reason)
        report = self._unranked(strategy, reason)
        chosen = resolve_options(strategy, **option_keywords(strategy, cost_model=cost))
        return StrategyChoice(chosen, report["bucket_cap_mb"], report)

    def _unranked(self, strategy: str, reason: str) -> dict[str, Any]:
        """What ``pre.plan()["chosen"]`` shows of a choice made without a ranking.

        One process, or the fallback: the strategy at fraction 1 with the first bucket cap.
        """
        sync = self._gradient_sync()["gradient_sync"]
        label = strategy if sync == "ddp" else f"{strategy} {sync}"  # as candidates' labels say
        return {
            "strategy": strategy,
            "label": label,
            "reason": reason,
            "grad_worker_fraction": 1.0,
            "bucket_cap_mb": self.bucket_caps_mb[0],
            "gradient_sync": sync,
            "ranking": [],
        }

    def _measure(
        self, model: nn.Module, config: KFACConfig, device: torch.device
    ) -> ComputeProfile:
        """Profile a copy of ``model``; the random number generators are left as they were."""
        assert self.example is not None and self.loss_fn is not None
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            # The copy runs strategy="local" on purpose: one worker's compute.
            warnings.filterwarnings("ignore", "strategy='local' in a process group")
            return measure_profile(
                copy.deepcopy(model),
                self.example,
                self.loss_fn,
                device=f"{device.type}, measured by AutoOptions",
                steps=self.measure_steps,
                warmup=1,
                methods=(),
                kfac_options={
                    "inverse_method": config.inverse_method,
                    "factor_dtype": config.factor_dtype,
                    "statistics_precision": config.statistics_precision,
                    "conv_patches": config.conv_patches,
                    "statistics_fraction": config.statistics_fraction,
                    "precondition_precision": config.precondition_precision,
                    "skip_layers": config.skip_layers,
                },
                autocast=self.autocast,
            )

    def _cost_model(
        self, config: KFACConfig, device: torch.device, largest_dim: int
    ) -> ClusterCostModel:
        if isinstance(self.cost_model, ClusterCostModel):
            return self.cost_model
        cache = self.cost_model or CostModelCache()
        return cache.get(config.inverse_method, config.inv_dtype, device, largest_dim=largest_dim)


def agree_on_profile(
    profile: ComputeProfile | None,
    comm: Communicator,
    device: torch.device,
    failure: Exception | None = None,
) -> ComputeProfile:
    """The slowest rank's profile: every time the maximum over ranks, packing the slowest.

    Collective. Every rank first says whether it has a profile (``profile`` is ``None`` where
    measuring raised ``failure``) and of how many layers, so a failure on one rank raises on
    every rank instead of leaving the others waiting.

    Raises:
        RuntimeError: a rank has no profile (this rank's ``failure`` is the cause).
        ValueError: the ranks' profiles have different numbers of layers.
    """
    count = -1 if profile is None else len(profile.layers)
    header = torch.tensor([float(profile is None), count, -count], device=device)
    comm.allreduce([header], phase="auto", maximum=True, exact=True).wait()
    failed, most, fewest = int(header[0]), int(header[1]), -int(header[2])
    if failed:
        where = "this rank" if profile is None else "another rank (see its error)"
        raise RuntimeError(
            f"strategy=AutoOptions(...): profiling the model failed on {where}"
        ) from failure
    assert profile is not None
    if most != fewest:
        raise ValueError(
            f"strategy=AutoOptions(...): the ranks' profiles have {fewest} to {most} layers: "
            "every rank must profile the same model"
        )
    step_fields = ("forward_s", "backward_s", "optimizer_s", "factor_update_s")
    layer_fields = (
        "output_s",
        "output_grad_s",
        "grad_ready_s",
        "a_statistic_s",
        "g_statistic_s",
        "precondition_s",
    )
    values = [getattr(profile, name) for name in step_fields]
    values.append(-profile.pack_bytes_per_s)  # a rate: the slowest is the maximum of minus it
    for layer in profile.layers:
        values += [getattr(layer, name) for name in layer_fields]
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    comm.allreduce([agreed], phase="auto", maximum=True, exact=True).wait()
    out = agreed.tolist()
    steps = dict(zip(step_fields, out[: len(step_fields)], strict=True))
    pack = -out[len(step_fields)]
    rest = out[len(step_fields) + 1 :]
    width = len(layer_fields)
    layers = tuple(
        replace(layer, **dict(zip(layer_fields, rest[k * width : (k + 1) * width], strict=True)))
        for k, layer in enumerate(profile.layers)
    )
    return replace(profile, layers=layers, pack_bytes_per_s=pack, **steps)


def _report(
    ranked: Sequence[RankedCandidate], chosen: Candidate, profile: ComputeProfile, link: LinkModel
) -> dict[str, Any]:
    """What ``pre.plan()["chosen"]`` shows: the ranking, the inputs, a sentence why."""
    best = next(r.iteration_s for r in ranked if r.candidate == chosen)
    others = (r for r in ranked if r.candidate.run.strategy != chosen.run.strategy)
    runner_up = next(others, None)
    reason = f"strategy=auto chose {chosen.label}: {best * 1e3:.1f} ms per iteration predicted"
    if runner_up is not None:
        reason += (
            f"; the best other strategy, {runner_up.candidate.label}, "
            f"{runner_up.iteration_s / best - 1:+.0%}"
        )
    passes = profile.forward_s + profile.backward_s
    reason += (
        f" (link {link.bytes_per_s * 8 / 1e9:.3g} Gbit/s of payload, step latency "
        f"{link.step_latency_s * 1e6:.0f} us; forward and backward {passes:.3f} s)"
    )
    return {
        "strategy": chosen.run.strategy,
        "grad_worker_fraction": chosen.run.grad_worker_fraction,
        "bucket_cap_mb": chosen.bucket_cap_mb,
        "gradient_sync": chosen.run.gradient_sync,
        "label": chosen.label,
        "reason": reason,
        "ranking": [r.as_dict() for r in ranked],
        "link": {"bytes_per_s": link.bytes_per_s, "step_latency_s": link.step_latency_s},
        "profile": {
            "forward_s": profile.forward_s,
            "backward_s": profile.backward_s,
            "layers": len(profile.layers),
            "device": profile.device,
            "autocast": profile.notes.get("autocast"),
        },
    }

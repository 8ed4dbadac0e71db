"""Measure a :class:`~dkfac.sim.profile.ComputeProfile` on this machine (``--profile-here``).

The model runs as a training step would: first plain (forward, loss, backward, optimizer),
then with a single-process K-FAC preconditioner (``strategy="local"``, schedule (1, 1)), whose
hooks compute the factor statistics. Light hooks stamp when each preconditioned layer's
output exists, when its output's gradient has arrived (with K-FAC, after K-FAC's own hooks:
its statistic is complete) and when its weight's gradient has been accumulated (DDP may send
it). A layer's statistic time is how much more K-FAC delays it than the layers before it
(:func:`_increments`). Every time is the median over the measured steps. Decompositions are timed by
:func:`~dkfac.comm.cost_model.calibrate_decomposition`. What one worker runs is measured: use
one intra-op thread (``torch.set_num_threads(1)``) to profile a worker of the emulated cluster.

On a GPU the host runs ahead of the device, so every clock reading first waits for the
device (``torch.cuda.synchronize``): each stamp is when the work before it finished, not when
it was queued. The waits cost the profiled steps some overlap of launches with work, which
the times then include, as a worker without spare host time would see them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dkfac.comm.cost_model import calibrate_decomposition, decomposition_dims
from dkfac.comm.wire import FusionBucket
from dkfac.curvature.factor_side import (
    diagonal_flags,
    largest_dense_side,
    preconditioning_work,
)
from dkfac.preconditioner import KFACPreconditioner
from dkfac.sim.profile import ComputeProfile, LayerProfile

Loss = Callable[[Tensor, Tensor], Tensor]
Clock = Callable[[], float]


def device_clock(device: torch.device) -> Clock:
    """``time.perf_counter`` read after ``device``'s queued work has finished (see the module)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


class _Stamps:
    """Per layer, when its output, its output's gradient and its weight's gradient appeared."""

    def __init__(
        self, modules: Sequence[nn.Module], names: Sequence[str], clock: Clock = time.perf_counter
    ) -> None:
        self.names = list(names)
        self.clock = clock
        self.origin = 0.0
        self.forward: list[float] = []
        self.output_grad: list[float] = []
        self.weight_grad: list[float] = []
        self.begin(0.0)
        self._handles: list[Any] = []
        for index, module in enumerate(modules):
            self._handles.append(module.register_forward_hook(self._forward_hook(index)))
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter):
                stamp = self._stamp(self.weight_grad, index)
                handle = weight.register_post_accumulate_grad_hook(stamp)  # type: ignore[no-untyped-call]
                self._handles.append(handle)

    def _stamp(self, into: list[float], index: int) -> Callable[..., None]:
        def stamp(*_: Any) -> None:
            into[index] = self.clock() - self.origin

        return stamp

    def _forward_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            self.forward[index] = self.clock() - self.origin
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(self._stamp(self.output_grad, index))  # type: ignore[no-untyped-call]

        return hook

    def begin(self, origin: float) -> None:
        """A new step from ``origin``: every stamp unset (NaN) until its hook fires."""
        self.origin = origin
        for stamps in (self.forward, self.output_grad, self.weight_grad):
            stamps[:] = [math.nan] * len(self.names)  # in place: the hooks hold these lists

    def check_complete(self) -> None:
        """Raise ValueError naming the layers a hook did not stamp in this step."""
        stamped = zip(self.forward, self.output_grad, self.weight_grad, strict=True)
        missing = [
            name
            for name, times in zip(self.names, stamped, strict=True)
            if any(math.isnan(t) for t in times)
        ]
        if missing:
            raise ValueError(
                f"layers {missing} did not run forward and backward in the profiled step: "
                "a profile needs every preconditioned layer used in each step"
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _timed_steps(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Loss,
    optimizer: torch.optim.Optimizer,
    stamps: _Stamps,
    steps: int,
    warmup: int,
    pre: KFACPreconditioner | None = None,
    autocast: torch.dtype | None = None,
) -> dict[str, list[Any]]:
    """Run ``warmup + steps`` training steps; per measured step, every time of interest.

    The forward pass and the loss run under ``torch.autocast`` in ``autocast`` (if given),
    as a mixed-precision training loop runs them.
    """
    inputs, targets = batch
    clock = stamps.clock
    device_type = inputs.device.type
    times: dict[str, list[Any]] = {
        key: [] for key in ("forward", "backward", "optimizer", "a", "g", "grad", "step", "phases")
    }
    for step in range(warmup + steps):
        optimizer.zero_grad(set_to_none=True)
        start = clock()
        stamps.begin(start)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(model(inputs), targets)
        forward_end = clock()
        stamps.origin = forward_end
        loss.backward()  # type: ignore[no-untyped-call]
        backward_end = clock()
        step_end = backward_end
        if pre is not None:
            pre.step()
            step_end = clock()
        optimizer.step()
        end = clock()
        if step < warmup:
            continue
        stamps.check_complete()
        times["forward"].append(forward_end - start)
        times["backward"].append(backward_end - forward_end)
        times["step"].append(step_end - backward_end)
        times["optimizer"].append(end - step_end)
        times["a"].append(list(stamps.forward))
        times["g"].append(list(stamps.output_grad))
        times["grad"].append(list(stamps.weight_grad))
        times["phases"].append(pre.timings() if pre is not None else {})
    return times


def _median_columns(rows: list[list[float]]) -> list[float]:
    return [statistics.median(column) for column in zip(*rows, strict=True)]


def _increments(plain: Sequence[float], kfac: Sequence[float], total: float) -> list[float]:
    """Each layer's own statistic time from when its hook finished with and without K-FAC.

    In the order the layers ran, the delay K-FAC adds by a layer (``kfac - plain``) grows by
    that layer's statistic; the growths (negative ones, noise, as zero) are scaled to sum to
    ``total``, the whole pass's added time (zero when K-FAC added none).
    """
    order = sorted(range(len(plain)), key=plain.__getitem__)
    growth = [0.0] * len(plain)
    before = 0.0
    for index in order:
        delay = kfac[index] - plain[index]
        growth[index] = max(0.0, delay - before)
        before = max(before, delay)
    if total <= 0 or sum(growth) <= 0:
        return [0.0] * len(plain)
    return [g * total / sum(growth) for g in growth]


def measure_packing(repeats: int = 5, device: torch.device | None = None) -> float:
    """Payload bytes per second of packing a fused bucket and unpacking it on ``device``.

    The communicator's :class:`~dkfac.comm.wire.FusionBucket` of four symmetric 512 x 512
    float32 factors (their upper triangles travel); ``device`` defaults to the CPU.
    """
    device = device or torch.device("cpu")
    clock = device_clock(device)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(512, 512, generator=generator).to(device) for _ in range(4)]
    times = []
    for _ in range(repeats):
        start = clock()
        bucket = FusionBucket(tensors, [True] * len(tensors), torch.float32)
        bucket.unpack(None)
        times.append(clock() - start)
    return bucket.nbytes / statistics.median(times)


def measure_profile(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    loss_fn: Loss,
    *,
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    methods: Sequence[str] = ("eigen",),
    kfac_options: dict[str, Any] | None = None,
    autocast: torch.dtype | None = None,
) -> ComputeProfile:
    """Time ``model`` training on ``batch`` plain and with K-FAC; the profile of one worker.

    Args:
        model: the model (trained a few steps in place: pass a copy to keep it).
        batch: ``(inputs, targets)`` of one worker's batch.
        loss_fn: ``loss_fn(output, targets)``.
        device: what the profile describes (free text, e.g. ``"cpu, 1 thread"``).
        steps: measured steps of each kind (the median is kept).
        warmup: steps run first and not measured.
        methods: decomposition methods to time.
        kfac_options: other keyword arguments of :class:`~dkfac.KFACPreconditioner`.
        autocast: the dtype of ``torch.autocast`` the forward pass and loss run under, as in
            mixed-precision training (``torch.bfloat16``, ``torch.float16``); ``None``: none.
    """
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"autocast={autocast!r}: expected torch.bfloat16, torch.float16 or None")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    options: dict[str, Any] = {"strategy": "local", "factor_update_steps": 1, "inv_update_steps": 1}
    options.update(kfac_options or {})
    pre = KFACPreconditioner(model, **options)
    names = [layer.name for layer in pre.layers]
    dims = [(layer.block.a_dim, layer.block.g_dim) for layer in pre.layers]
    # The blocks' own modules: a model that is itself one layer has no name to look up.
    layer_modules = [layer.block.module for layer in pre.layers]
    pre.remove()  # the plain run first, without K-FAC's hooks
    on = next(model.parameters()).device
    clock = device_clock(on)
    stamps = _Stamps(layer_modules, names, clock)
    plain = _timed_steps(model, batch, loss_fn, optimizer, stamps, steps, warmup, None, autocast)
    stamps.remove()
    pre = KFACPreconditioner(model, **options)
    # After K-FAC's hooks, so each stamp follows their work.
    stamps = _Stamps(layer_modules, names, clock)
    kfac = _timed_steps(model, batch, loss_fn, optimizer, stamps, steps, warmup, pre, autocast)
    stamps.remove()
    pre.remove()

    precondition = statistics.median(p.get("precondition", 0.0) for p in kfac["phases"])
    decomposing = statistics.median(p.get("inverse_compute", 0.0) for p in kfac["phases"])
    rest = statistics.median(kfac["step"])
    # Preconditioning a layer costs about d_G²·d_A + d_G·d_A² (two products with its bases).
    weights = [preconditioning_work(a, g) for a, g in dims]
    grad_bytes = [
        sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        for module in layer_modules
    ]
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    forward, backward = statistics.median(plain["forward"]), statistics.median(plain["backward"])
    output = [min(t, forward) for t in _median_columns(plain["a"])]
    output_grad = [min(t, backward) for t in _median_columns(plain["g"])]
    grad_ready = [min(t, backward) for t in _median_columns(plain["grad"])]
    a_statistic = _increments(
        output, _median_columns(kfac["a"]), statistics.median(kfac["forward"]) - forward
    )
    g_statistic = _increments(
        output_grad, _median_columns(kfac["g"]), statistics.median(kfac["backward"]) - backward
    )
    layers = tuple(
        LayerProfile(
            name=name,
            a_dim=int(a),
            g_dim=int(g),
            output_s=output[i],
            output_grad_s=output_grad[i],
            grad_ready_s=grad_ready[i],
            a_statistic_s=a_statistic[i],
            g_statistic_s=g_statistic[i],
            precondition_s=precondition * weights[i] / sum(weights),
            grad_bytes=grad_bytes[i],
            **diagonal_flags((a, g)),
        )
        for i, (name, (a, g)) in enumerate(zip(names, dims, strict=True))
    )
    largest = largest_dense_side(side for pair in dims for side in pair)
    decomposition = {
        method: calibrate_decomposition(decomposition_dims(largest), method=method, device=on)
        for method in methods
    }
    return ComputeProfile(
        device=device,
        batch_size=int(batch[0].shape[0]),
        forward_s=forward,
        backward_s=backward,
        optimizer_s=statistics.median(plain["optimizer"]),
        factor_update_s=max(0.0, rest - precondition - decomposing),
        decomposition=decomposition,
        layers=layers,
        other_grad_bytes=all_bytes - sum(grad_bytes),
        pack_bytes_per_s=measure_packing(device=on),
        notes={
            "steps": steps,
            "warmup": warmup,
            "torch_threads": torch.get_num_threads(),
            "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        },
    )

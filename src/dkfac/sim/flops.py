"""A compute profile from FLOP counts and a device's sustained rates: devices that are not here.

``dkfac simulate`` needs per-layer times (:class:`~dkfac.sim.profile.ComputeProfile`). Where
the device cannot be measured (a V100 for the seed papers' clusters), they are derived:

* the plain forward and backward pass take the device's published training throughput
  (``batch / samples_per_s``, one third forward, two thirds backward, as the backward pass
  does twice the forward's multiply-adds), shared among the layers by their multiply-adds;
* a factor statistic is a GEMM, ``2·rows·d²`` FLOPs at the device's GEMM rate, plus reading
  and writing its ``rows × d`` operand (a convolution's unfolded patches) at its memory rate,
  ``rows = kept · positions`` with ``kept`` the examples the statistics are taken from (the
  whole batch, or its share under ``statistics_fraction``);
* preconditioning a layer is ``2·(g²a + g·a²)`` FLOPs with inverses, twice that with
  eigendecompositions (into the eigenbases and back);
* folding the factors, the optimizer and packing are memory-bound copies;
* decompositions follow the device's ``c0 + c3·d³``.

Every rate is an input (:class:`DeviceRates`), stated where it is used; the figures that make a
V100 are in ``benchmarks/seed_reproduction.py`` with their sources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from dkfac.comm.cost_model import CubicCost
from dkfac.curvature.factor_side import (
    diagonal_flags,
    factor_values,
    is_diagonal,
    preconditioning_work,
)
from dkfac.curvature.statistics import kept_examples
from dkfac.sim.profile import ComputeProfile, LayerProfile
from dkfac.strategies.layer_shapes import LayerShape, resnet50_layer_shapes

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class LayerWork:
    """One preconditioned layer and how many output positions each example gives it.

    Attributes:
        shape: its factor sides (``a_dim`` includes a bias column).
        positions: output positions per example (a convolution's output height × width; 1
            for a Linear on one vector; tokens for a sequence).
    """

    shape: LayerShape
    positions: int

    def forward_flops(self, batch_size: int) -> float:
        """Multiply-adds of its forward pass, as FLOPs (``2·rows·a·g``)."""
        return 2.0 * batch_size * self.positions * self.shape.a_dim * self.shape.g_dim


@dataclass(frozen=True)
class DeviceRates:
    """What one device sustains (every figure an input: say where it comes from).

    Attributes:
        name: the device, as the profile names it.
        samples_per_s: plain training throughput of the model at the profile's batch size.
        gemm_flops_per_s: sustained rate of the factor statistics' and preconditioning GEMMs.
        memory_bytes_per_s: sustained copy bandwidth (read + write counted separately).
        eigen: one ``d × d`` eigendecomposition, ``c0 + c3·d³``.
        inverse: one ``d × d`` damped inverse, likewise.
    """

    name: str
    samples_per_s: float
    gemm_flops_per_s: float
    memory_bytes_per_s: float
    eigen: CubicCost
    inverse: CubicCost

    def __post_init__(self) -> None:
        rates = (self.samples_per_s, self.gemm_flops_per_s, self.memory_bytes_per_s)
        if not all(rate > 0 for rate in rates):
            raise ValueError(f"{self.name}: every rate must be positive, got {rates}")


#: The methods the FLOP model has rates for: their preconditioning's products per layer, in
#: units of ``g²a + g·a²`` GEMMs each half (eigen rotates both sides twice).
FLOP_METHODS: Mapping[str, float] = MappingProxyType({"eigen": 4.0, "inverse": 2.0})


def flop_profile(
    work: Sequence[LayerWork],
    rates: DeviceRates,
    batch_size: int,
    *,
    other_grad_bytes: int = 0,
    inverse_method: str = "eigen",
    statistics_fraction: float = 1.0,
) -> ComputeProfile:
    """The profile of one worker at ``batch_size`` on ``rates``' device (see the module).

    Args:
        work: the preconditioned layers, in forward order.
        rates: the device's sustained rates.
        batch_size: one worker's batch.
        other_grad_bytes: gradient bytes of parameters no layer of ``work`` holds.
        inverse_method: ``"eigen"`` or ``"inverse"`` (the preconditioning's products).
            ``"cholesky"`` is refused: its triangular solves run below a product's rate (1.15
            to 2.5 times a product's time on a CPU), which sustained GEMM rates cannot say;
            a measured profile (:func:`~dkfac.sim.profiling.measure_profile`) times them.
        statistics_fraction: the share of each batch the factor statistics are taken from,
            as :class:`~dkfac.KFACPreconditioner`'s (``⌈fraction · batch⌉`` examples; an
            embedding's diagonal ``A`` from all of them). One call per layer and step is
            assumed: micro-batches, layers called several times and sequence-first layers
            round per call and are not modelled.

    Raises:
        ValueError: no layers, a layer without multiply-adds, a fraction outside (0, 1], or a
            method the FLOP model has no rates for.
    """
    if inverse_method not in FLOP_METHODS:
        raise ValueError(
            f"a FLOP profile models inverse_method {' or '.join(map(repr, FLOP_METHODS))}, "
            f"not {inverse_method!r}: its solves' rate is not a product's (measure a profile "
            "on the device instead)"
        )
    if not work or min(w.forward_flops(batch_size) for w in work) <= 0:
        raise ValueError("a FLOP profile needs layers with positive multiply-adds")
    if not 0 < statistics_fraction <= 1:
        raise ValueError(f"statistics_fraction={statistics_fraction!r}: expected (0, 1]")
    kept = kept_examples(batch_size, statistics_fraction)
    products = FLOP_METHODS[inverse_method]
    step_s = batch_size / rates.samples_per_s
    forward_s, backward_s = step_s / 3.0, 2.0 * step_s / 3.0
    flops = [w.forward_flops(batch_size) for w in work]
    share = [f / sum(flops) for f in flops]
    output_s, elapsed = [], 0.0
    for part in share:
        elapsed += part * forward_s
        output_s.append(elapsed)
    output_grad_s, grad_ready_s = [0.0] * len(work), [0.0] * len(work)
    elapsed = 0.0
    for index in reversed(range(len(work))):  # the last layer's gradient arrives first
        output_grad_s[index] = elapsed
        elapsed += share[index] * backward_s
        grad_ready_s[index] = elapsed
    layers = []
    for index, item in enumerate(work):
        a, g = item.shape.a_dim, item.shape.g_dim
        rows = kept * item.positions
        # An embedding's diagonal A (its counts) comes from the whole call, as in the capture.
        a_rows = batch_size * item.positions if is_diagonal(a) else rows
        layers.append(
            LayerProfile(
                name=item.shape.name,
                a_dim=int(a),
                g_dim=int(g),
                output_s=output_s[index],
                output_grad_s=output_grad_s[index],
                grad_ready_s=grad_ready_s[index],
                a_statistic_s=_statistic_s(a_rows, a, rates),
                g_statistic_s=_statistic_s(rows, g, rates),
                precondition_s=products * preconditioning_work(a, g) / rates.gemm_flops_per_s,
                grad_bytes=FLOAT32_BYTES * a * g,
                **diagonal_flags((a, g)),
            )
        )
    parameters = sum(layer.grad_bytes for layer in layers) + other_grad_bytes
    factor_bytes = FLOAT32_BYTES * sum(factor_values(side) for w in work for side in w.shape.dims)
    return ComputeProfile(
        device=f"{rates.name} (from FLOP counts and sustained rates)",
        batch_size=batch_size,
        forward_s=forward_s,
        backward_s=backward_s,
        # SGD with momentum reads weight, gradient and momentum and writes two of them.
        optimizer_s=5 * parameters / rates.memory_bytes_per_s,
        # The running average reads the average and the statistic and writes the average.
        factor_update_s=3 * factor_bytes / rates.memory_bytes_per_s,
        decomposition={"eigen": rates.eigen, "inverse": rates.inverse},
        layers=tuple(layers),
        other_grad_bytes=other_grad_bytes,
        pack_bytes_per_s=rates.memory_bytes_per_s / 2,  # each payload byte read and written
        notes={
            "derived": "dkfac.sim.flops.flop_profile",
            "samples_per_s": rates.samples_per_s,
            # Said only when statistics come from part of the batch (a whole-batch profile's
            # notes, committed ones included, stay as they were).
            **({"statistics_fraction": statistics_fraction} if statistics_fraction < 1 else {}),
        },
    )


def _statistic_s(rows: int, dim: int, rates: DeviceRates) -> float:
    """One factor statistic: the ``rows × dim`` operand read and written, and its Gram GEMM.

    A diagonal factor (an embedding's counts) needs no product.
    """
    copy = 2 * FLOAT32_BYTES * rows * dim / rates.memory_bytes_per_s
    gram = 0.0 if is_diagonal(dim) else 2.0 * rows * dim * dim / rates.gemm_flops_per_s
    return copy + gram


def resnet50_work(num_classes: int = 1000, image_size: int = 224) -> list[LayerWork]:
    """ImageNet ResNet-50's layers with their output positions at ``image_size``.

    The layers are :func:`~dkfac.strategies.layer_shapes.resnet50_layer_shapes`; as in
    torchvision's v1.5, a bottleneck strides in its 3×3 ``conv2``, so a stage's first
    ``conv1`` still sees the previous stage's resolution.
    """
    side = {stage: image_size // 2 ** (stage + 1) for stage in (1, 2, 3, 4)}  # 56 ... 7
    work = []
    for shape in resnet50_layer_shapes(num_classes):
        if shape.name == "conv1":
            out = image_size // 2
        elif shape.name == "fc":
            out = 1
        else:
            stage_name, block, conv = shape.name.split(".", 2)
            stage = int(stage_name.removeprefix("layer"))
            first_conv = block == "0" and conv == "conv1" and stage > 1
            out = side[stage - 1] if first_conv else side[stage]
        work.append(LayerWork(shape, out * out))
    return work

"""Per-factor decomposition placement: owners decompose, results broadcast in fused buckets.

Shared by SPD-KFAC and PAD-KFAC, which place the two factors of a layer independently (a
factor may also be decomposed redundantly by every worker, :data:`EVERY_WORKER`). Every worker
ends with every layer's inverse and preconditions every layer, as in D-KFAC.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dkfac.comm.communicator import Communicator
from dkfac.comm.recorder import StepRecorder
from dkfac.curvature.decomposition import FactorRequest, decompose_factors
from dkfac.curvature.inverse import (
    FACTOR_SIDES,
    FactorDecomposition,
    combine_factors,
    tikhonov_shifts,
    trace_mean,
)
from dkfac.curvature.layer import LayerCurvature
from dkfac.strategies.decomposition_payload import (
    DecompositionPayload,
    share_payloads,
    valid_flags,
)

#: Owner value of a factor decomposed by every worker (nothing broadcast).
EVERY_WORKER = -1

FactorKey = tuple[int, str]  # (layer index, side)


def _trace_means(
    comm: Communicator,
    layers: Sequence[LayerCurvature],
    owners: dict[FactorKey, int],
    dtype: torch.dtype,
    factors_everywhere: bool,
) -> Tensor:
    """``tr(F)/d`` of every factor, ``(L, 2)``; one allreduce when factors live on owners.

    The value is computed by the factor's owner exactly as a single worker would and summed
    with zeros, so every rank's ``π`` is bitwise that of a single worker.
    """
    device = layers[0].block.weight.device
    means = torch.zeros(len(layers), 2, dtype=dtype, device=device)
    for (index, side), owner in owners.items():
        factor = layers[index].factor(side)
        mine = owner == comm.rank or (owner == EVERY_WORKER and comm.rank == 0)
        if factor is not None and (factors_everywhere or mine):
            means[index, FACTOR_SIDES.index(side)] = trace_mean(factor, dtype)
    if not factors_everywhere:
        comm.allreduce([means], phase="inverse_comm").wait()
    return means


def broadcast_sources(
    owners: dict[FactorKey, int], world_size: int
) -> list[tuple[int, list[FactorKey]]]:
    """``(source, factors)`` of every rank that decomposes factors, ascending.

    One fused broadcast each; factors in the order of ``owners`` (the plan's), identical on
    every rank. Factors of :data:`EVERY_WORKER` are not broadcast.
    """
    result = []
    for source in range(world_size):
        owned = [key for key, owner in owners.items() if owner == source]
        if owned:
            result.append((source, owned))
    return result


def update_factor_inverses(
    comm: Communicator,
    recorder: StepRecorder,
    layers: Sequence[LayerCurvature],
    owners: dict[FactorKey, int],
    damping: float,
    method: str,
    dtype: torch.dtype,
    factors_everywhere: bool,
) -> None:
    """Decompose the factors this rank owns, broadcast them, and rebuild every layer's inverse.

    Args:
        comm: the strategy's communicator.
        recorder: phase timing.
        layers: every preconditioned layer, in plan index order.
        owners: per ``(layer index, side)``, the decomposing rank or :data:`EVERY_WORKER`.
        damping: γ (for the Tikhonov shifts of ``"inverse"``).
        method: ``"eigen"`` or ``"inverse"``.
        dtype: dtype of the decompositions.
        factors_everywhere: every rank holds every running factor (SPD); otherwise only the
            owners do (PAD) and the Tikhonov traces are exchanged first.

    A layer keeps its last inverse unless both factors arrived valid; the decision is the
    same on every rank because validity travels with the payload.
    """
    rank = comm.rank
    means = None
    if method == "inverse":
        with recorder.phase("inverse_comm"):
            means = _trace_means(comm, layers, owners, dtype, factors_everywhere)
    requests: list[FactorRequest] = []
    keys: list[FactorKey] = []
    for (index, side), owner in owners.items():
        layer = layers[index]
        if owner not in (rank, EVERY_WORKER) or layer.factor(side) is None:
            continue
        shift = None
        if means is not None:
            shift_a, shift_g = tikhonov_shifts(means[index, 0], means[index, 1], damping)
            shift = shift_a if side == "a" else shift_g
        requests.append(FactorRequest(layer, side, shift))
        keys.append((index, side))
    with recorder.phase("inverse_compute"):
        results = dict(zip(keys, decompose_factors(requests, method, dtype), strict=True))
    parts: dict[FactorKey, FactorDecomposition | None] = {
        key: result for key, result in results.items() if owners[key] == EVERY_WORKER
    }
    sources = broadcast_sources(owners, comm.world_size)
    received = [key for _, owned in sources for key in owned]
    with recorder.phase("inverse_comm"):
        payloads = {
            (i, side): _factor_payload(
                layers[i], side, method, dtype, results.get((i, side)), owners[(i, side)] == rank
            )
            for i, side in received
        }
        per_source = [(source, [payloads[key] for key in owned]) for source, owned in sources]
        share_payloads(comm, per_source)
    valid = valid_flags([payloads[key] for key in received])
    for key, ok in zip(received, valid, strict=True):
        payload = payloads[key]
        parts[key] = FactorDecomposition(payload.named(), payload.flag > 0) if ok else None
    for index, layer in enumerate(layers):
        a, g = parts.get((index, "a")), parts.get((index, "g"))
        if a is not None and g is not None:
            layer.inverse = combine_factors(method, a, g)


def _factor_payload(
    layer: LayerCurvature,
    side: str,
    method: str,
    dtype: torch.dtype,
    result: FactorDecomposition | None,
    send: bool,
) -> DecompositionPayload:
    """One factor's decomposition as its owner sends it, or receive buffers."""
    dim = layer.block.a_dim if side == "a" else layer.block.g_dim
    stored = result.tensors if send and result is not None else None
    return DecompositionPayload.build(
        method, [(side, dim)], stored, dtype, layer.block.weight.device
    )

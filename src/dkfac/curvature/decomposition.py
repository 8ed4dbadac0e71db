"""Decomposing many layers' factors at once: one host read, float64 retry, keep the last good.

Strategies decide which factors a worker decomposes; this module does it for a list of them,
never raising for numerical trouble: failures fall back to the last good decomposition and are
counted per layer (:meth:`~dkfac.curvature.layer.LayerCurvature.health`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
from torch import Tensor

from dkfac.curvature.factor_decomposition import (
    FACTOR_DECOMPOSITIONS,
    CholeskyFactor,
    EigenFactor,
    FactorDecomposition,
    check_inverses_finite,
    decompose_factor,
)
from dkfac.curvature.finite import all_finite, finite_flags
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.tikhonov import tikhonov_shift

logger = logging.getLogger(__name__)


def _host_values(values: Sequence[Tensor]) -> list[list[int]]:
    """Copy small device tensors (booleans, counts) to the host, each flattened.

    One synchronisation per device.
    """
    result: list[list[int]] = [[] for _ in values]
    by_device: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    for index, value in enumerate(values):
        by_device.setdefault(value.device, {}).setdefault(value.dtype, []).append(index)
    for by_dtype in by_device.values():
        # Joined per dtype, then widened: a few launches, not a conversion per value.
        groups = list(by_dtype.values())
        parts = [torch.cat([values[i].reshape(-1) for i in group]) for group in groups]
        read = iter(torch.cat([part.to(torch.int64) for part in parts]).tolist())
        for i in (i for group in groups for i in group):
            result[i] = [int(next(read)) for _ in range(values[i].numel())]
    return result


@dataclass(frozen=True)
class FactorRequest:
    """One factor to decompose: the layer, the side (``"a"``/``"g"``), the Tikhonov shift.

    ``damping`` (shifted methods only, when every worker that decomposes the factor holds both
    factors of the layer) lets a float64 retry recompute the shift from float64 traces
    instead of reusing the one computed in the failed dtype. ``domain``: what the factor may
    be batched with (the strategy's choice: who decomposes it, or a key of its own, for a
    factor whose companions could differ between workers); batched decompositions put a
    factor only with others of its domain, so every worker that decomposes it batches it
    the same way (a batch's results depend on its other members by round-off).
    """

    layer: LayerCurvature
    side: str
    shift: Tensor | None = None
    damping: float | None = None
    domain: Hashable = None

    def in_float64(self) -> FactorRequest:
        """This request for a float64 retry (shift recomputed when the damping is known)."""
        if self.shift is None or self.damping is None:
            return self
        means = self.layer.trace_means(torch.float64)
        return replace(self, shift=tikhonov_shift(self.side, *means, self.damping))


def decompose_factors(
    requests: Sequence[FactorRequest],
    method: str,
    dtype: torch.dtype,
    *,
    batch_up_to: int = 0,
) -> list[FactorDecomposition | None]:
    """Decompose the running factors of ``requests``; never raises for numerical trouble.

    A factor that is not finite is not used (``None``). A decomposition that fails in
    ``dtype`` (``torch.linalg.LinAlgError``, a failed Cholesky, a non-finite result) is retried
    in float64; if that fails too the result is ``None``. Every other error (out of memory, a
    CUDA error, a bug) propagates. Each kind of trouble is counted per layer
    (:meth:`LayerCurvature.health`) and reported while it persists
    (:meth:`LayerCurvature.report`). Every factor is decomposed before anything is read back,
    so the finiteness of the factors, the dropped-batch counts and the success of every
    decomposition reach the host in one synchronisation for all requests together (plus one
    per float64 retry, on the failure path only). ``batch_up_to`` (0: none) decomposes
    factors up to that wide of equal size and domain together (:func:`_first_attempts`):
    on a GPU one ``eigh`` wait,
    or a few Cholesky launches, per batch instead of per factor. A batch's results differ
    from one-at-a-time ones by round-off and, on the CPU, depend on the batch's other
    matrices (memory alignment): workers that decompose a factor redundantly must give it
    the same domain.
    """
    if not requests:
        return []
    # Each factor's dropped-batch counts (one per fold since the last read) are read with the
    # rest and summed on the host: summing them on the device took two launches per factor.
    dropped = [request.layer.take_nonfinite_flags(request.side) for request in requests]
    flag_tensors = list({id(bad): bad for flags in dropped for bad, _ in flags}.values())
    results = _first_attempts(requests, method, dtype, batch_up_to)
    attempted = {index: result for index, result in enumerate(results) if result is not None}
    checks = finite_factors(requests)
    values = [*checks, *flag_tensors, *(result.ok for result in attempted.values())]
    host = _host_values(values)
    read_flags = len(checks) + len(flag_tensors)
    finite = [ok for read in host[: len(checks)] for ok in read]
    flags_read = dict(zip(map(id, flag_tensors), host[len(checks) : read_flags], strict=True))
    ok = {index: read[0] for index, read in zip(attempted, host[read_flags:], strict=True)}
    # Trouble is counted per factor and reported once per layer and kind for this call.
    trouble: dict[tuple[int, str], int] = {}

    def tally(layer: LayerCurvature, kind: str, times: int = 1) -> None:
        key = (id(layer), kind)
        trouble[key] = trouble.get(key, 0) + times

    for index, (request, factor_ok, drops) in enumerate(
        zip(requests, finite, dropped, strict=True)
    ):
        if drops:
            times = sum(flags_read[id(bad)][entry] for bad, entry in drops)
            tally(request.layer, "nonfinite_batches", times)
        if not factor_ok:
            tally(request.layer, "nonfinite_factors")
            results[index] = None
    for index, request in enumerate(requests):
        if not finite[index] or ok.get(index, False):
            continue
        retry = (
            None
            if dtype == torch.float64
            else _try_decompose(request.in_float64(), method, torch.float64)
        )
        if retry is not None and bool(retry.ok):
            tally(request.layer, "retried_in_float64")
            results[index] = retry
        else:
            tally(request.layer, "failed_decompositions")
            results[index] = None
    layers = {id(request.layer): request.layer for request in requests}
    for (key, kind), times in trouble.items():
        if times:
            layer = layers[key]
            layer.report(kind, _TROUBLE_MESSAGES[kind].format(name=layer.name, dtype=dtype), times)
    return results


_TROUBLE_MESSAGES: Mapping[str, str] = MappingProxyType(
    {
        "nonfinite_batches": "K-FAC layer {name!r}: a batch factor had NaN/Inf values and was not "
        "used (the running average kept its last value)",
        "nonfinite_factors": "K-FAC layer {name!r}: factors are not finite; keeping the last good "
        "decomposition (or the plain gradient before the first one)",
        "retried_in_float64": "K-FAC layer {name!r}: decomposition failed in {dtype}; recomputed "
        "in float64",
        "failed_decompositions": "K-FAC layer {name!r}: decomposition failed (also in float64); "
        "keeping the last good decomposition (or the plain gradient before the first one)",
    }
)


def finite_factors(requests: Sequence[FactorRequest]) -> list[Tensor]:
    """Device booleans: is each request's running factor finite, in order.

    Checked together: one tensor of them all when the factors share a device.
    """
    factors = [request.layer.factors[request.side].value() for request in requests]
    if len({factor.device for factor in factors}) != 1:
        return [all_finite(factor) for factor in factors]
    return [finite_flags(factors)]


#: Bytes of one batched eigendecomposition's stacked input at most (its output is as big).
BATCH_BYTES = 256 * 2**20


def _factor(request: FactorRequest) -> Tensor:
    factor = request.layer.factor(request.side)
    assert factor is not None
    return factor


def _first_attempts(
    requests: Sequence[FactorRequest], method: str, dtype: torch.dtype, batch_up_to: int
) -> list[FactorDecomposition | None]:
    """Each request's decomposition in ``dtype`` (``None``: the solver raised).

    Dense factors of one size up to ``batch_up_to``, device and domain go through one batched
    call per at most :data:`BATCH_BYTES` of input; a batch whose solver raises is redone one
    factor at a time, so only the factor that fails is ``None``.
    """
    results: list[FactorDecomposition | None] = [None] * len(requests)
    groups: dict[tuple[int, torch.device, Hashable], list[int]] = {}
    for index, request in enumerate(requests):
        factor = _factor(request)
        key = (factor.shape[0], factor.device, request.domain)
        if factor.dim() == 2 and 1 < factor.shape[0] <= batch_up_to:
            groups.setdefault(key, []).append(index)
        else:
            results[index] = _try_decompose(request, method, dtype, check_finite=False)
    # The inverses decomposed one at a time are checked together.
    check_inverses_finite([result for result in results if isinstance(result, CholeskyFactor)])
    for (dim, _, _), members in groups.items():
        per_call = max(1, BATCH_BYTES // (dim * dim * dtype.itemsize))
        chunks = [members[start : start + per_call] for start in range(0, len(members), per_call)]
        for chunk in chunks:
            solved: Sequence[FactorDecomposition | None]
            try:
                solved = _decompose_batch([requests[i] for i in chunk], method, dtype)
            except torch.linalg.LinAlgError:  # type: ignore[attr-defined]  # public, untyped
                solved = [_try_decompose(requests[i], method, dtype) for i in chunk]
            for index, result in zip(chunk, solved, strict=True):
                results[index] = result
    return results


def _decompose_batch(
    requests: Sequence[FactorRequest], method: str, dtype: torch.dtype
) -> Sequence[FactorDecomposition]:
    """Equal-size dense factors decomposed by one batched call of ``method``'s solver."""
    factors, sides = [_factor(r) for r in requests], [r.side for r in requests]
    if method == "eigen":
        return EigenFactor.compute_many(factors, sides, dtype)
    shifts = [r.shift for r in requests]
    assert all(shift is not None for shift in shifts), "shifted methods' requests carry one"
    dense = FACTOR_DECOMPOSITIONS[method][0]
    assert issubclass(dense, CholeskyFactor)
    return dense.compute_many(factors, sides, dtype, [s for s in shifts if s is not None])


def _try_decompose(
    request: FactorRequest, method: str, dtype: torch.dtype, *, check_finite: bool = True
) -> FactorDecomposition | None:
    factor = _factor(request)
    try:
        return decompose_factor(
            factor, request.side, method, dtype, request.shift, check_finite=check_finite
        )
    # Only the algorithm's own failure is retried; out of memory, CUDA errors and bugs propagate.
    except torch.linalg.LinAlgError as error:  # type: ignore[attr-defined]  # public, untyped
        logger.debug(
            "decomposition of %s/%s in %s failed: %s",
            request.layer.name,
            request.side,
            dtype,
            error,
        )
        return None

"""The shape of ``KFACPreconditioner.plan()``: a typed report of where everything goes.

Plain data (dicts, lists, numbers, strings), so it prints, compares and serialises as JSON;
typed, so a reader (and mypy) knows every key. Keys that only some strategies report are
optional.
"""

from __future__ import annotations

from typing import Any, TypedDict


class _FactorRowKeys(TypedDict):
    layer: str
    factor: str
    dim: int
    diagonal: bool
    reduced_to: int | str
    decomposed_by: int | str


class FactorRow(_FactorRowKeys, total=False):
    """One factor: its layer, ``"A"``/``"G"``, dim, where it is reduced, who decomposes it.

    ``diagonal``: the factor is held as its diagonal (a ``dim``-vector; an embedding's ``A``).

    ``reduced_to`` and ``decomposed_by`` are a rank, ``"all"``, or ``"none (owner's shard
    only)"`` (DP-KFAC). SPD/PAD add the bytes it sends, its fusion bucket, its predicted
    decomposition time and (after profiling) its measured ready time.
    """

    wire_bytes: int
    bucket: int
    predicted_decomposition_s: float
    measured_ready_s: float | None


class BucketRow(TypedDict):
    """One fused factor collective of SPD/PAD, in launch order."""

    factors: list[str]
    collective: str
    destination: int | str
    wire_bytes: int
    predicted_s: float
    predicted_start_s: float | None


class ShareReport(TypedDict):
    """What PAD-KFAC's owners broadcast, and the predicted bytes per step behind the choice.

    ``requested`` is the ``share`` option (``"decompositions"``, ``"gradients"`` or
    ``"auto"``), ``mode`` what is sent; decompositions count once per ``inv_update_steps``
    (the schedule's value at construction), preconditioned gradients every step.
    """

    requested: str
    mode: str
    inv_update_steps: int
    decomposition_bytes_per_step: float
    gradient_bytes_per_step: int


class _PlanReportKeys(TypedDict):
    strategy: str
    factors: list[FactorRow]
    buckets: list[BucketRow]


class PlanReport(_PlanReportKeys, total=False):
    """``pre.plan()``: the strategy, one row per factor, the fused buckets (SPD/PAD).

    ``"local"`` places nothing (empty lists). KAISA adds ``grad_workers``; SPD/PAD add the
    cost model behind their placement, its problems (when it could not be used), how the
    fusion was planned (``"size"`` or ``"alpha-beta (profiled)"``) and the predicted
    decomposition seconds per rank; PAD adds what its owners share (:class:`ShareReport`).
    A strategy chosen at construction adds ``chosen`` (the ranking and why).
    """

    grad_workers: int
    cost_model: dict[str, Any]
    cost_model_problems: list[str]
    fusion: str
    predicted_decomposition_load_s: list[float]
    share: ShareReport
    chosen: dict[str, Any]

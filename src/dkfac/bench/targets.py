"""The targets ``dkfac bench`` checks its measurements against, read from a file when asked.

The package holds no reference timing and no threshold: :func:`load_targets` reads them from a
JSON file (the repository's is ``benchmarks/targets.json``) into a frozen, validated
:class:`BenchTargets`. Three targets: one configuration's overhead over SGD against a limit
derived from a reference measurement (:class:`OverheadTarget`), strategies faster than a
baseline per factor-update iteration (:class:`PipelinedTarget`) and the dry run's DP-KFAC vs
D-KFAC ratios (:class:`DryRunTarget`). They are evaluated, and the verdicts rendered, in
:mod:`dkfac.bench.verdicts` and :mod:`dkfac.bench.dry_run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dkfac.bench.configs import (
    MODELS,
    STRATEGY_CHOICES,
    configurations,
    kfac_configuration,
    schedule_problem,
)

#: The per-iteration times a pipelined target may compare (a column of the summary rows).
PIPELINED_METRICS: tuple[str, ...] = ("median_s",)
#: The line printed in place of the verdicts when no targets file was given.
NO_TARGETS_LINE = (
    "no targets given: measurements only (pass --targets FILE to check them, e.g. "
    "benchmarks/targets.json)"
)


def _invalid(key: str, value: object, problem: str) -> ValueError:
    return ValueError(f"{key} = {value!r}: {problem}")


def _at_least(key: str, value: float, minimum: float) -> None:
    if not value >= minimum:
        raise _invalid(key, value, f"must be >= {minimum:g}")


def _known_row(key: str, name: str, nprocs: int, schedule: tuple[int, int]) -> None:
    """Refuse ``name`` unless the bench has a K-FAC row ``{name}_{f}_{i}`` at ``nprocs``."""
    suffix = f"_{schedule[0]}_{schedule[1]}"
    rows = configurations(nprocs, STRATEGY_CHOICES, (schedule,))
    names = [row.key.removesuffix(suffix) for row in rows if row.kfac]
    if name not in names:
        raise _invalid(key, name, f"no K-FAC row at P={nprocs}; choose from {', '.join(names)}")


class _Section:
    """The keys of one section of a targets file, each read with its JSON type.

    Raises ``ValueError("key ...")`` for a missing key, a key the section does not have, or a
    value of the wrong type.
    """

    def __init__(self, data: Mapping[str, Any], cls: type[Any]) -> None:
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = [key for key in data if key not in names]
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown key (known: {', '.join(names)})")
        self._data = data

    def _get(self, key: str) -> Any:
        if key not in self._data:
            raise ValueError(f"{key}: missing key")
        return self._data[key]

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise _invalid(key, value, "expected a string")
        return value

    def integer(self, key: str) -> int:
        value = self._get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(key, value, "expected an integer")
        return value

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid(key, value, "expected a number")
        if not math.isfinite(value):
            raise _invalid(key, value, "expected a finite number")
        return float(value)

    def integers(self, key: str) -> tuple[int, ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise _invalid(key, value, "expected a list of integers")
        return tuple(value)

    def texts(self, key: str) -> tuple[str, ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _invalid(key, value, "expected a list of strings")
        return tuple(value)

    def fields_of(self, cls: type[Any]) -> dict[str, Any]:
        """Every field of dataclass ``cls``, read with the reader its annotation names.

        A field with a default may be missing (the default applies).
        """
        readers = {
            "str": self.text,
            "int": self.integer,
            "float": self.number,
            "tuple[int, ...]": self.integers,
            "tuple[str, ...]": self.texts,
        }
        return {
            field.name: readers[str(field.type)](field.name)
            for field in dataclasses.fields(cls)
            if field.name in self._data or field.default is dataclasses.MISSING
        }


@dataclass(frozen=True)
class Reference:
    """The reference measurement the overhead target was derived from.

    Attributes:
        library: The library measured, with its version.
        setting: Model, batch, world size, backend and threads of the measurement.
        sgd_s_per_iter: Seconds per iteration of DDP + SGD.
        kfac_1_1_s_per_iter: Seconds per iteration of K-FAC at schedule (1,1).
        overhead_s: ``kfac_1_1_s_per_iter - sgd_s_per_iter``.
        line: The line printed above the overhead verdict.
    """

    library: str
    setting: str
    sgd_s_per_iter: float
    kfac_1_1_s_per_iter: float
    overhead_s: float
    line: str

    def __post_init__(self) -> None:
        for key in ("sgd_s_per_iter", "kfac_1_1_s_per_iter", "overhead_s"):
            _at_least(key, getattr(self, key), 0.0)
        difference = self.kfac_1_1_s_per_iter - self.sgd_s_per_iter
        if not math.isclose(self.overhead_s, difference, abs_tol=5e-4):
            raise _invalid(
                "overhead_s", self.overhead_s, f"expected kfac_1_1 - sgd = {difference:.3f}"
            )


@dataclass(frozen=True)
class OverheadTarget:
    """One configuration's overhead over SGD (same model and P) must stay under a limit.

    Attributes:
        model: A model of :data:`dkfac.bench.configs.MODELS`.
        nprocs: The world size.
        config: The key of a K-FAC row measured at ``nprocs``, e.g. ``dkfac_1_1``,
            ``kaisa_1of2_1_1`` or ``dkfac_dear_1_1``
            (:func:`~dkfac.bench.configs.kfac_configuration`).
        max_overhead_s: The largest overhead in seconds per iteration that meets the target.
    """

    model: str
    nprocs: int
    config: str
    max_overhead_s: float

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise _invalid("model", self.model, f"unknown model; choose from {', '.join(MODELS)}")
        _at_least("nprocs", self.nprocs, 1)
        try:  # the rows' own keys: a name split on "_" would miss kaisa_1of2_, _dear_
            kfac_configuration(self.config, self.nprocs)
        except ValueError as error:
            raise _invalid("config", self.config, str(error)) from None
        _at_least("max_overhead_s", self.max_overhead_s, 0.0)


@dataclass(frozen=True)
class PipelinedTarget:
    """Strategies at least ``min_speedup`` faster than a baseline at one P and schedule.

    Attributes:
        nprocs: The world size compared.
        schedule: ``(factor_update_steps, inv_update_steps)`` compared.
        baseline: The row compared against, named as its key without the schedule: a
            strategy (``"dkfac"``), KAISA at a fraction (``"kaisa_1of2"``) or a strategy with
            DeAR (``"spd_dear"``); its key at the schedule must be one of the bench's
            (:func:`~dkfac.bench.configs.kfac_configuration`).
        strategies: The rows that must be faster, named as ``baseline``.
        metric: The per-iteration time compared (one of :data:`PIPELINED_METRICS`).
        min_speedup: The smallest ``baseline / strategy - 1`` that meets the target.
        description: Free text: where the target comes from (never evaluated or reported).
    """

    nprocs: int
    schedule: tuple[int, ...]
    baseline: str
    strategies: tuple[str, ...]
    metric: str
    min_speedup: float
    description: str = ""

    def __post_init__(self) -> None:
        _at_least("nprocs", self.nprocs, 1)
        problem = "needs two steps" if len(self.schedule) != 2 else schedule_problem(*self.schedule)
        if problem is not None:
            raise _invalid("schedule", list(self.schedule), problem)
        schedule = (self.schedule[0], self.schedule[1])
        _known_row("baseline", self.baseline, self.nprocs, schedule)
        if not self.strategies:
            raise _invalid("strategies", [], "needs at least one strategy")
        for name in self.strategies:
            _known_row("strategies", name, self.nprocs, schedule)
        if self.baseline in self.strategies or len(set(self.strategies)) < len(self.strategies):
            raise _invalid(
                "strategies", list(self.strategies), "each once, and not the baseline itself"
            )
        if self.metric not in PIPELINED_METRICS:
            raise _invalid("metric", self.metric, f"choose from {', '.join(PIPELINED_METRICS)}")
        _at_least("min_speedup", self.min_speedup, 0.0)

    def as_verdict(self) -> dict[str, Any]:
        """The fields a verdict carries, JSON-ready (the description stays out)."""
        fields = dataclasses.asdict(self)
        del fields["description"]
        return fields | {"schedule": list(self.schedule), "strategies": list(self.strategies)}


@dataclass(frozen=True)
class DryRunTarget:
    """How many times less DP-KFAC must send and hold than D-KFAC (a dry run's target).

    Attributes:
        source: Where the figures come from, e.g. ``"DP-KFAC paper, 64 GPUs"``.
        nprocs: The world size the figures are for.
        communication: Least ratio of bytes sent per worker (dkfac / dp, max over workers).
        memory: Least ratio of factor + decomposition memory per worker (max over workers).
    """

    source: str
    nprocs: int
    communication: float
    memory: float

    def __post_init__(self) -> None:
        _at_least("nprocs", self.nprocs, 2)
        _at_least("communication", self.communication, 0.0)
        _at_least("memory", self.memory, 0.0)


@dataclass(frozen=True)
class BenchTargets:
    """Everything a targets file holds, and the file it was read from.

    Attributes:
        reference: The reference measurement (printed with the overhead verdict).
        overhead_target: One configuration's overhead over SGD.
        pipelined_target: Strategies against a baseline per factor-update iteration.
        dry_run_target: DP-KFAC against D-KFAC in a dry run.
        source_file: The file read, as given (recorded in the reports).
    """

    reference: Reference
    overhead_target: OverheadTarget
    pipelined_target: PipelinedTarget
    dry_run_target: DryRunTarget
    source_file: str = ""


def load_targets(path: str | Path) -> BenchTargets:
    """Read and validate a targets file (JSON; the layout of ``benchmarks/targets.json``).

    Args:
        path: The file.

    Returns:
        The targets, with ``source_file`` the path as given.

    Raises:
        ValueError: The file cannot be read, is not JSON, lacks a section or a key, has a key
            it should not, or a value of the wrong type or out of range (a negative threshold,
            an unknown strategy or model). One message naming the file and the key.
    """
    where = f"targets file {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"{where}: cannot be read ({error.strerror or error})") from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    sections: dict[str, type[Any]] = {
        "reference": Reference,
        "overhead_target": OverheadTarget,
        "pipelined_target": PipelinedTarget,
        "dry_run_target": DryRunTarget,
    }
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with {', '.join(sections)}")
    for key in data:
        if key not in sections:
            raise ValueError(f"{where}: {key}: unknown key (known: {', '.join(sections)})")
    read: dict[str, Any] = {}
    for key, section in sections.items():
        if key not in data:
            raise ValueError(f"{where}: {key}: missing key")
        if not isinstance(data[key], dict):
            raise ValueError(f"{where}: {key} = {data[key]!r}: expected a JSON object")
        try:
            read[key] = section(**_Section(data[key], section).fields_of(section))
        except ValueError as error:
            raise ValueError(f"{where}: {key}.{error}") from None
    return BenchTargets(**read, source_file=str(path))

"""Typed results of the client: plain dataclasses built from the API's JSON.

Fields the service adds later land in `extra`, so an older client keeps working against a
newer service. Lists of results (`TrialList`, `MetricSeries`, `StudyList`) are lists with a
`to_pandas()` that needs the optional `pandas` extra.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Importance",
    "LrCurvePoint",
    "LrGroup",
    "LrSensitivity",
    "MetricPoint",
    "MetricSeries",
    "Plot",
    "StabilityBoundary",
    "StabilityGroup",
    "Study",
    "StudyList",
    "Summary",
    "Trial",
    "TrialList",
]

D = TypeVar("D")


def _time(v: Any) -> datetime | None:
    return None if v is None else datetime.fromisoformat(str(v))


# In the API's JSON an infinity is the string "inf" ("-inf"): a trial's float columns, or a
# summary number such as `max_attn_logit_ever` after an overflow (docs/api.md). The client
# hands them back as floats.
_INFINITIES = {"inf": math.inf, "-inf": -math.inf}
_TRIAL_FLOATS = (
    "value",
    "final_val_loss",
    "min_norm_entropy",
    "final_rank_ratio",
    "qk_eig_var",
    "duration_s",
)


def _number(v: Any) -> Any:
    """ "inf"/"-inf" as the float; anything else as it is."""
    return _INFINITIES.get(v, v) if isinstance(v, str) else v


def _trial_numbers(data: dict[str, Any]) -> dict[str, Any]:
    """A trial's JSON with its infinities as floats: its float columns, `values` and the
    top-level numbers of its summary."""
    out = {k: (_number(v) if k in _TRIAL_FLOATS else v) for k, v in data.items()}
    if isinstance(out.get("values"), list):
        out["values"] = [_number(v) for v in out["values"]]
    if isinstance(out.get("summary"), dict):
        out["summary"] = {k: _number(v) for k, v in out["summary"].items()}
    return out


def _build(cls: type[D], data: dict[str, Any], times: tuple[str, ...] = ()) -> D:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    known = {k: (_time(v) if k in times else v) for k, v in data.items() if k in names}
    if "extra" in names:
        known["extra"] = {k: v for k, v in data.items() if k not in names}
    return cls(**known)


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("to_pandas() needs pandas: pip install 'qkscope[pandas]'") from None
    return pandas


@dataclass(frozen=True)
class Study:
    """A study as stored: its definition (`spec`), status and Ray job."""

    id: int
    name: str
    status: str
    n_trials: int
    ray_job_id: str | None = None
    job_attempts: int = 0
    # Its runner jobs' deaths: of the study or the cluster (bounded by the server's
    # QKSCOPE_MAX_JOB_ATTEMPTS), and relaunches after the database was away (weather).
    job_failures: int = 0
    weather_relaunches: int = 0
    optuna_study_name: str = ""
    error: str | None = None
    # Why its trials are not starting (no node has the resources, Ray does not answer).
    waiting_reason: str | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Study:
        return _build(cls, data, ("created_at", "started_at", "finished_at"))

    @property
    def done(self) -> bool:
        return self.status in ("COMPLETED", "FAILED", "CANCELLED")

    @property
    def search_space(self) -> dict[str, Any]:
        return dict(self.spec.get("search_space", {}))


@dataclass(frozen=True)
class Trial:
    """One trial: parameters, objective value(s) and the attention-health summary numbers."""

    id: int
    study_id: int
    number: int
    state: str
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    attempts: int = 1
    node: str | None = None
    value: float | None = None
    values: list[float | None] | None = None
    feasible: bool | None = None
    last_step: int = 0
    final_val_loss: float | None = None
    min_norm_entropy: float | None = None
    final_rank_ratio: float | None = None
    qk_eig_var: float | None = None
    plateau_steps: int | None = None
    entropy_collapse: bool | None = None
    rank_collapse: bool | None = None
    trapped: bool | None = None
    penalty_version: int | None = None
    error: str | None = None
    # Why a PRUNED trial stopped: a constraint it could no longer meet, or the pruner.
    stop_reason: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_s: float | None = None
    summary: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        return _build(cls, _trial_numbers(data), ("started_at", "finished_at"))

    def flat(self) -> dict[str, Any]:
        """One flat row: the columns, `params.<path>` per parameter, then `extra`."""
        row = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("params", "summary", "extra")
        }
        row.update({f"params.{k}": v for k, v in self.params.items()})
        row.update(self.extra)
        return row


@dataclass(frozen=True)
class Summary:
    """A study's progress: counts by state, collapse rates, best value and ETA."""

    study_id: int
    status: str
    n_trials: int
    trials_by_state: dict[str, int]
    finished: int
    progress: float
    entropy_collapse_rate: float | None = None
    rank_collapse_rate: float | None = None
    trapped_rate: float | None = None
    best_value: float | None = None
    best_trial_id: int | None = None
    best_params: dict[str, Any] | None = None
    eta_s: float | None = None
    waiting_reason: str | None = None  # why nothing is starting, when something is stuck
    updated_at: datetime | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        return _build(cls, data, ("updated_at",))

    @property
    def done(self) -> bool:
        return self.status in ("COMPLETED", "FAILED", "CANCELLED")

    @property
    def running(self) -> int:
        return int(self.trials_by_state.get("RUNNING", 0))


@dataclass(frozen=True)
class MetricPoint:
    """One stored number: metric `name` at `step` (`layer`/`head` None where not per-layer)."""

    name: str
    step: int
    value: float | None
    layer: int | None = None
    head: int | None = None


@dataclass(frozen=True)
class Importance:
    """Parameter importances of one study for one `target` (objective or summary metric),
    largest first; they sum to 1 (fANOVA) or are PED-ANOVA's unnormalised scores."""

    study_id: int
    target: str
    evaluator: str
    n_trials: int
    importances: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Importance:
        return _build(cls, data)

    def to_pandas(self) -> pd.DataFrame:
        return _pandas().DataFrame(
            {"param": list(self.importances), "importance": list(self.importances.values())}
        )


@dataclass(frozen=True)
class LrCurvePoint:
    """The final loss `l(eta)` over seeds at one learning rate (diverged trials as their l_0),
    and the median and range of `min(l, l_0)` per seed (`clipped_*`: what the sensitivity
    uses) with how many seeds ended above their l_0."""

    lr: float
    n: int  # seeds with a final loss here
    diverged: int  # of them, how many diverged
    median: float | None = None
    q25: float | None = None
    q75: float | None = None
    min: float | None = None
    max: float | None = None
    above_l0: int = 0
    clipped_median: float | None = None
    clipped_min: float | None = None
    clipped_max: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LrGroup:
    """One group of an LR-sensitivity answer: its parameter values, the sensitivity (mean
    over the seeds with a complete grid) with its t interval, `l_0` and the curve."""

    params: dict[str, Any]
    n_seeds: int
    sensitivity: float | None
    ci_low: float | None
    ci_high: float | None
    l0: float | None
    curve: list[LrCurvePoint]
    seeds: list[dict[str, Any]] = field(default_factory=list)  # per seed: l0, l_star, losses
    left_out: list[dict[str, Any]] = field(default_factory=list)  # seed, reason, missing_lrs
    repeated: int = 0
    l_star: float | None = None  # mean over the sensitivity's seeds of their best loss
    unigram_floor: float | None = None  # the data's unigram cross-entropy (METRICS.md 9)
    note: str | None = None  # set when l* is not below the floor, or why there is none
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LrGroup:
        g = _build(cls, data)
        curve = [_build(LrCurvePoint, p) for p in data.get("curve", [])]
        return dataclasses.replace(g, curve=curve)

    @property
    def label(self) -> str:
        """`model.qk_norm=layernorm` (`all` when the study has no other parameter)."""
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "all"


@dataclass(frozen=True)
class LrSensitivity:
    """Learning-rate sensitivity of a study per group (METRICS.md section 9)."""

    study_id: int
    group_by: list[str]
    grid: list[float]
    log_spaced: bool
    confidence: float
    groups: list[LrGroup]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LrSensitivity:
        out = _build(cls, data)
        return dataclasses.replace(out, groups=[LrGroup.from_json(g) for g in data["groups"]])

    def to_pandas(self) -> pd.DataFrame:
        """One row per group: its parameters, sensitivity, interval, l_0 and seeds used."""
        rows = [
            {
                **g.params,
                "sensitivity": g.sensitivity,
                "ci_low": g.ci_low,
                "ci_high": g.ci_high,
                "l0": g.l0,
                "n_seeds": g.n_seeds,
                "left_out": len(g.left_out),
            }
            for g in self.groups
        ]
        return _pandas().DataFrame(rows)


@dataclass(frozen=True)
class StabilityGroup:
    """One group of a stability-boundary answer (METRICS.md section 11): per width and seed
    `eta_max` and `eta_opt` (`points`, dicts as the API gives them), the fits of each
    against width (`eta_max_fit`, `eta_opt_fit`: `b` and the prediction at the target width
    with their t intervals) and the held-out check (`holdout`, None below three widths)."""

    params: dict[str, Any]
    widths: list[float]
    points: list[dict[str, Any]]
    eta_max_fit: dict[str, Any]
    eta_opt_fit: dict[str, Any]
    holdout: dict[str, Any] | None = None
    repeated: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """`model.qk_norm=layernorm` (`all` when the study has no other parameter)."""
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "all"


@dataclass(frozen=True)
class StabilityBoundary:
    """The stability boundary across widths of a study, per group (METRICS.md section 11)."""

    study_id: int
    width: str
    group_by: list[str]
    target_width: float
    tau: float
    instability_constraints: list[str]
    confidence: float
    groups: list[StabilityGroup]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StabilityBoundary:
        out = _build(cls, data)
        groups = [_build(StabilityGroup, g) for g in data["groups"]]
        return dataclasses.replace(out, groups=groups)

    def to_pandas(self) -> pd.DataFrame:
        """One row per group, width and seed: eta_max, eta_opt, the bracket and why a value
        is undefined."""
        keys = ("width", "seed", "eta_max", "eta_opt", "eta_s", "eta_u", "ratio",
                "bisection_steps", "reason")  # fmt: skip
        rows = [{**g.params, **{k: p.get(k) for k in keys}} for g in self.groups for p in g.points]
        return _pandas().DataFrame(rows)


class StudyList(list[Study]):
    """Studies of one page; `total` counts every match."""

    def __init__(self, items: list[Study], total: int) -> None:
        super().__init__(items)
        self.total = total

    def to_pandas(self) -> pd.DataFrame:
        rows = [{k: v for k, v in dataclasses.asdict(s).items() if k != "extra"} for s in self]
        return _pandas().DataFrame(rows)


class TrialList(list[Trial]):
    """Trials (one page or all of them); `total` counts every match on the server."""

    def __init__(self, items: list[Trial], total: int | None = None) -> None:
        super().__init__(items)
        self.total = len(items) if total is None else total

    def to_pandas(self) -> pd.DataFrame:
        """One row per trial, `params.<path>` columns, indexed by trial number."""
        df = _pandas().DataFrame([t.flat() for t in self])
        return df.set_index("number") if len(df) else df


class MetricSeries(list[MetricPoint]):
    """Metric rows of one trial, ordered by (name, layer, head, step)."""

    def to_pandas(self) -> pd.DataFrame:
        return _pandas().DataFrame(
            [dataclasses.asdict(p) for p in self],
            columns=["name", "layer", "head", "step", "value"],
        )

    def values_of(
        self, name: str, layer: int | None = None, head: int | None = None
    ) -> list[tuple[int, float | None]]:
        """(step, value) pairs of one series."""
        return [
            (p.step, p.value)
            for p in self
            if p.name == name and p.layer == layer and p.head == head
        ]


@dataclass(frozen=True)
class Plot:
    """A PNG from the plots route; Jupyter shows it inline (`_repr_png_`)."""

    png: bytes
    study_id: int
    kind: str

    def _repr_png_(self) -> bytes:
        return self.png

    def save(self, path: str) -> str:
        with open(path, "wb") as f:
            f.write(self.png)
        return path

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) from the PNG header."""
        return int.from_bytes(self.png[16:20], "big"), int.from_bytes(self.png[20:24], "big")

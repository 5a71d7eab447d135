"""Parameter importance of a study: which search-space parameters drive an objective or any
stored summary metric (`min_norm_entropy`, `final_rank_ratio`, `qk_eig_var`, ...).

qkscope's own trial table is the source, not Optuna's storage: the COMPLETE trials' params and
the chosen number are copied into an in-memory Optuna study (one distribution per search-space
parameter, from the spec), and Optuna's evaluators rank the parameters on it, fANOVA
(random-forest functional ANOVA, Hutter et al. 2014; needs scikit-learn) by default, PED-ANOVA
(Watanabe et al. 2023) when asked. So any metric qkscope stores works as a target, and studies
whose Optuna storage is elsewhere (or gone) still answer.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Text, cast, func, null, select
from sqlalchemy.orm import Session

from service.errors import InvalidField
from service.store import SUMMARY_COLUMNS, Study, Trial, TrialState, json_number
from workers.metric_names import NUMERIC_SUMMARIES

__all__ = [
    "EVALUATORS",
    "ImportanceCache",
    "MIN_TRIALS",
    "ImportanceError",
    "TooFewTrials",
    "importance",
    "targets",
]

Evaluator = Literal["fanova", "ped_anova"]
EVALUATORS: tuple[str, ...] = ("fanova", "ped_anova")
MIN_TRIALS = 5  # finished trials with a value for the target, before any ranking is offered


ImportanceError = InvalidField  # a bad query parameter, named (a 422: service/errors.py)


class TooFewTrials(ImportanceError):
    """Fewer than MIN_TRIALS finished trials carry the target yet."""

    def __init__(self, target: str, have: int) -> None:
        super().__init__(
            "target",
            f"importance needs at least {MIN_TRIALS} COMPLETE trials with a value for "
            f"{target}; this study has {have}",
        )
        self.need, self.have = MIN_TRIALS, have


@dataclass(frozen=True)
class Result:
    target: str
    evaluator: str
    direction: str
    n_trials: int
    importances: dict[str, float]  # largest first

    def as_json(self, study_id: int) -> dict[str, Any]:
        return {
            "study_id": study_id,
            "target": self.target,
            "evaluator": self.evaluator,
            "direction": self.direction,
            "n_trials": self.n_trials,
            "importances": self.importances,
        }


def targets(study: Study) -> list[str]:
    """Names a target may take: `value`, the objectives' metrics, every summary metric."""
    objectives = [o["metric"] for o in study.spec.get("objectives", [])]
    return list(dict.fromkeys(["value", *objectives, *NUMERIC_SUMMARIES]))


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _distributions(study: Study) -> dict[str, Any]:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out: dict[str, Any] = {}
    for name, p in study.spec.get("search_space", {}).items():
        if p["type"] == "float":
            out[name] = FloatDistribution(p["low"], p["high"], log=bool(p.get("log")))
        elif p["type"] == "int":
            log = bool(p.get("log"))
            step = None if log else int(p.get("step", 1))
            out[name] = IntDistribution(p["low"], p["high"], log=log, step=step or 1)
        elif p["type"] == "categorical":
            out[name] = CategoricalDistribution(p["choices"])
    return out  # fixed parameters do not vary: nothing to rank


def _inside(dist: Any, v: Any) -> bool:
    """`v` is a value of `dist` (trials stored before a search-space edit may not be)."""
    try:
        return v is not None and bool(dist._contains(dist.to_internal_repr(v)))
    except (ValueError, TypeError):
        return False


def _direction(study: Study, target: str, direction: str | None) -> str:
    if direction is not None:
        return direction
    objectives = study.spec.get("objectives", [{}])
    if target == "value":
        return str(objectives[0].get("direction", "minimize"))
    for o in objectives:
        if o.get("metric") == target:
            return str(o.get("direction", "minimize"))
    return "minimize"


def _points(
    session: Session, study: Study, target: str, dists: dict[str, Any]
) -> list[tuple[dict[str, Any], float]]:
    """(params, target value) of each COMPLETE trial by number that has a value for `target`
    and whose parameters all lie in today's search space.

    Only the params and the target are read, the target from its own column or extracted
    from the summary by the database: never a whole summary (at 10,000 evaluations each is
    about 251 KiB, and loading 1,000 of them held hundreds of MiB for one number a trial)."""
    own: Any = null()  # the target's own column, where it has one
    from_summary: Any = null()  # else its number in the summary, as JSON text
    if target == "value":
        own = Trial.value
    else:
        if target in SUMMARY_COLUMNS:
            own = getattr(Trial, target)
        from_summary = cast(Trial.summary[target], Text)
    rows = session.execute(
        select(Trial.params, own, from_summary)
        .where(Trial.study_id == study.id, Trial.state == TrialState.COMPLETE)
        .order_by(Trial.number)
    )
    points = []
    for params_all, value, text in rows:
        y = _finite(value)
        if y is None and text is not None and text != "null":
            y = _finite(json_number(json.loads(text)))
        params = {k: (params_all or {}).get(k) for k in dists}
        if y is not None and all(_inside(dists[k], v) for k, v in params.items()):
            points.append((params, y))
    return points


def importance(
    session: Session,
    study: Study,
    target: str | None = None,
    evaluator: str = "fanova",
    direction: str | None = None,
) -> Result:
    """Rank the study's search-space parameters for `target` (default: the first objective's
    metric). Raises ImportanceError naming `target`/`evaluator`/`direction`, TooFewTrials."""
    import optuna

    objectives = study.spec.get("objectives", [{}])
    target = target or str(objectives[0].get("metric", "value"))
    if target not in targets(study):
        raise ImportanceError(
            "target", f"unknown target {target!r}; one of {', '.join(targets(study))}"
        )
    if evaluator not in EVALUATORS:
        raise ImportanceError("evaluator", f"one of {', '.join(EVALUATORS)}")
    if direction not in (None, "minimize", "maximize"):
        raise ImportanceError("direction", "minimize or maximize")
    dists = _distributions(study)
    if not dists:
        raise ImportanceError("target", "the study's search space has no parameter to rank")
    points = _points(session, study, target, dists)
    if len(points) < MIN_TRIALS:
        raise TooFewTrials(target, len(points))
    direction = _direction(study, target, direction)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    maximize = direction == "maximize"
    mem = optuna.create_study(  # in memory, never stored
        direction=optuna.study.StudyDirection.MAXIMIZE
        if maximize
        else optuna.study.StudyDirection.MINIMIZE
    )
    mem.add_trials(
        optuna.trial.create_trial(params=params, distributions=dists, value=y)
        for params, y in points
    )
    ev: Any = (
        optuna.importance.FanovaImportanceEvaluator(seed=0)
        if evaluator == "fanova"
        else optuna.importance.PedAnovaImportanceEvaluator()
    )
    ranked = optuna.importance.get_param_importances(mem, evaluator=ev, params=list(dists))
    return Result(
        target=target,
        evaluator=evaluator,
        direction=direction,
        n_trials=len(points),
        importances={k: float(v) for k, v in ranked.items()},
    )


class ImportanceCache:
    """The last ranking per (study, target, evaluator, direction), reused until another trial
    of the study completes: a ranking depends only on the COMPLETE trials, and fANOVA takes
    seconds on a large study (about 2 s of PED-ANOVA at 8,000 trials, 30 s of fANOVA at
    1,600), which every load of the web UI's study page used to pay again. The first request
    after a trial completes recomputes it. Bounded (least recently used entries go)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.hits = self.misses = 0
        self._items: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Result]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _mark(session: Session, study_id: int) -> tuple[Any, ...]:
        """What changes when a trial of the study completes (one indexed aggregate)."""
        row = session.execute(
            select(func.count(), func.max(Trial.id)).where(
                Trial.study_id == study_id, Trial.state == TrialState.COMPLETE
            )
        ).one()
        return tuple(row)

    def get(
        self,
        session: Session,
        study: Study,
        target: str | None = None,
        evaluator: str = "fanova",
        direction: str | None = None,
    ) -> Result:
        key = (study.id, target, evaluator, direction)
        mark = self._mark(session, study.id)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] == mark:
                self._items.move_to_end(key)
                self.hits += 1
                return hit[1]
        result = importance(session, study, target, evaluator, direction)
        with self._lock:
            self.misses += 1
            self._items[key] = (mark, result)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return result

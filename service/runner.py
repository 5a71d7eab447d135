"""The Ray Job entrypoint of one study: `python -m service.runner <study_id>`.

Drives Optuna with ask/tell against RDBStorage in the study's own database,
keeps `parallelism` trials in flight as Ray tasks named `study-<id>/trial-<n>`,
persists every report in one transaction per batch (a crash leaves whole
batches or nothing; replays are no-ops thanks to the metric primary key),
answers pruning questions, tells Optuna each result, and marks the study
COMPLETED, FAILED or CANCELLED.

A rerun of the same study (after the job or the cluster died) picks up where
the database says it stopped: trials that were running are relaunched with
the same parameters and resume from their checkpoints.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import ray
from optuna.trial import TrialState as OptunaState
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings, get_settings
from service.db.ingest import insert_metrics
from service.db.models import NO_INDEX, Study, StudyStatus, Trial, TrialState, utcnow
from service.db.session import make_engine, make_sessionmaker, normalize_url, session_scope
from service.spec import StudySpec, apply_params
from service.studies import make_pruner, make_sampler, optuna_study_name
from workers import metrics as M
from workers.remote import Report, TrialInbox, run_trial_task

__all__ = ["intermediate_value", "main", "run_study"]

log = logging.getLogger("qkscope.runner")
_trial_task = ray.remote(run_trial_task)
POLL_S = 0.25
TERMINAL = {StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED}


def intermediate_value(
    metric: str, points: list[tuple[str, int | None, int | None, float]]
) -> float | None:
    """The per-evaluation counterpart of a summary metric, for Optuna's pruners."""

    def values(name: str) -> list[tuple[int | None, float]]:
        return [(layer, v) for n, layer, _h, v in points if n == name]

    if metric in ("final_val_loss", "best_val_loss"):
        vals = values("val_loss")
        return vals[0][1] if vals else None
    if metric == "final_train_loss":
        vals = values("train_loss")
        return vals[0][1] if vals else None
    if metric in ("min_norm_entropy", "min_norm_entropy_ever"):
        vals = values("attn_entropy_norm")
        return min(v for _, v in vals) if vals else None
    if metric == "final_rank_ratio":
        vals = values("rank_ratio")
        return max(vals, key=lambda lv: lv[0] or 0)[1] if vals else None
    if metric in ("qk_eig_var", "qk_eig_mean"):
        vals = values(metric)
        return sum(v for _, v in vals) / len(vals) if vals else None
    return None


@dataclass
class _Running:
    trial: optuna.Trial
    row_id: int
    number: int
    started: float
    last_step: int = 0
    reported: set[int] = field(default_factory=set)


class StudyRunner:
    """One study's control loop. All database and Optuna access happens on this thread."""

    def __init__(self, study_id: int, settings: Settings, engine: Engine) -> None:
        self.study_id, self.settings = study_id, settings
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        with session_scope(self.sessions) as s:
            row = s.get(Study, study_id)
            if row is None:
                raise LookupError(f"study {study_id} not found")
            self.spec = StudySpec.model_validate(row.spec)
            self.status = StudyStatus(row.status)
        self.storage = optuna.storages.RDBStorage(normalize_url(settings.resolved_database_url()))
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=optuna_study_name(study_id),
            directions=self.spec.directions(),  # type: ignore[arg-type]
            sampler=make_sampler(self.spec),
            pruner=make_pruner(self.spec),
            load_if_exists=True,
        )
        self.running: dict[Any, _Running] = {}
        self.by_number: dict[int, _Running] = {}

    # ---- Optuna glue -------------------------------------------------------------------------

    def _trial_config(self, params: dict[str, Any], number: int) -> dict[str, Any]:
        config = apply_params(self.spec.base, params)
        task = config.task
        if task.data_dir and not Path(task.data_dir).is_absolute() and self.settings.data_dir:
            task = task.model_copy(
                update={"data_dir": str(Path(self.settings.data_dir) / task.data_dir)}
            )
        ckpt_dir = (
            Path(self.settings.resolved_checkpoint_dir())
            / f"study-{self.study_id}"
            / f"trial-{number}"
        )
        config = config.model_copy(
            update={
                "task": task,
                "checkpoint": config.checkpoint.model_copy(update={"dir": str(ckpt_dir)}),
            }
        )
        return config.model_dump(mode="json", by_alias=True)

    def _suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for path, p in self.spec.search_space.items():
            if p.type == "fixed":
                params[path] = p.value
            elif p.type == "categorical":
                params[path] = trial.suggest_categorical(path, p.choices)
            elif p.type == "float":
                params[path] = trial.suggest_float(path, p.low, p.high, log=p.log)
            else:
                params[path] = trial.suggest_int(path, p.low, p.high, log=p.log, step=p.step)
        return params

    # ---- launching -------------------------------------------------------------------------

    def _launch(self, inbox: Any, trial: optuna.Trial, params: dict[str, Any], row_id: int) -> None:
        number = trial.number
        config = self._trial_config(params, number)
        res = self.spec.resources
        task = _trial_task.options(  # type: ignore[attr-defined]
            name=f"study-{self.study_id}/trial-{number}",
            num_cpus=res.cpus,
            num_gpus=res.gpus,
            max_retries=self.spec.max_retries,
            retry_exceptions=False,
        )
        ref = task.remote(config, number, inbox)
        entry = _Running(trial=trial, row_id=row_id, number=number, started=time.monotonic())
        self.running[ref] = entry
        self.by_number[number] = entry

    def _ask_and_launch(self, inbox: Any) -> None:
        trial = self.study.ask()
        params = self._suggest(trial)
        seed = int(params.get("seed", self.spec.base.seed))
        with session_scope(self.sessions) as s:
            row = Trial(study_id=self.study_id, number=trial.number, params=params, seed=seed)
            s.add(row)
            s.flush()
            row_id = row.id
        self._launch(inbox, trial, params, row_id)

    def _resume_orphans(self, inbox: Any) -> None:
        """Trials left RUNNING by a dead runner: relaunch them (they resume from checkpoint)."""
        orphans = self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
        for ft in orphans:
            with session_scope(self.sessions) as s:
                row = s.scalars(
                    select(Trial).where(Trial.study_id == self.study_id, Trial.number == ft.number)
                ).one_or_none()
                if row is None:  # asked but never recorded: give Optuna its answer
                    self.study.tell(ft.number, state=OptunaState.FAIL)
                    continue
                row.state, row.attempts = TrialState.RUNNING, row.attempts + 1
                params, row_id = dict(row.params), row.id
            trial = optuna.Trial(self.study, ft._trial_id)
            self._launch(inbox, trial, params, row_id)
            log.info("relaunched trial %d (attempt after runner restart)", ft.number)

    # ---- reports ------------------------------------------------------------------------------

    def _persist_reports(self, reports: list[Report], inbox: Any) -> None:
        """One transaction for a batch of reports; primary-key conflicts (replays) are skipped."""
        if not reports:
            return
        rows: list[dict[str, Any]] = []
        last_steps: dict[int, int] = {}
        for number, step, points in reports:
            entry = self.by_number.get(number)
            if entry is None:
                continue
            for name, layer, head, value in points:
                rows.append(
                    {
                        "trial_id": entry.row_id,
                        "name": name,
                        "step": step,
                        "layer": NO_INDEX if layer is None else layer,
                        "head": NO_INDEX if head is None else head,
                        "value": value if math.isfinite(value) else None,
                    }
                )
            last_steps[entry.row_id] = max(step, last_steps.get(entry.row_id, 0))
        with session_scope(self.sessions) as s:
            insert_metrics(s, rows)
            for row_id, step in last_steps.items():
                s.execute(update(Trial).where(Trial.id == row_id).values(last_step=step))
        self._prune_decisions(reports, inbox)

    def _prune_decisions(self, reports: list[Report], inbox: Any) -> None:
        if self.spec.pruner.kind == "none":
            return
        metric = self.spec.objectives[0].metric
        for number, step, points in reports:
            entry = self.by_number.get(number)
            value = intermediate_value(metric, points)
            if entry is None or value is None or not math.isfinite(value) or step in entry.reported:
                continue
            entry.reported.add(step)
            entry.trial.report(value, step)
            if entry.trial.should_prune():
                inbox.prune.remote(number)

    # ---- results ------------------------------------------------------------------------------

    def _study_best(self, metric: str) -> float | None:
        with session_scope(self.sessions) as s:
            vals = s.scalars(
                select(Trial.summary).where(
                    Trial.study_id == self.study_id, Trial.state == TrialState.COMPLETE
                )
            ).all()
        best = [v[metric] for v in vals if v and v.get(metric) is not None]
        return min(best) if best else None

    def _finish(self, ref: Any, entry: _Running) -> None:
        try:
            result = ray.get(ref)
        except (ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError) as e:
            self._fail(entry, f"{type(e).__name__}: {e}")
            return
        except Exception as e:
            self._fail(entry, f"{type(e).__name__}: {str(e)[-2000:]}")
            return
        summary: dict[str, Any] = result["summary"]
        status = summary["status"]
        steps = int(self.spec.base.steps)
        if summary.get("eval_steps") and not summary.get("trapped"):
            ref_loss = self._study_best("final_val_loss")
            last = summary["eval_steps"][-1]
            final = summary.get("final_val_loss")
            summary["trapped"] = bool(
                final is not None
                and M.is_trapped(
                    [tuple(p) for p in summary.get("plateaus", [])],
                    last,
                    final,
                    ref_loss,
                    float(self.spec.base.trapped_rel_gap),
                )
            )
        constraints = [c.violation(summary, steps) for c in self.spec.constraints] or [0.0]
        values: list[float] = []
        for obj in self.spec.objectives:
            v = summary.get(obj.metric)
            worst = math.inf if obj.direction == "minimize" else -math.inf
            values.append(worst if v is None or status == "diverged" else float(v))
        for i, (c, v) in enumerate(zip(self.spec.constraints, constraints, strict=False)):
            entry.trial.set_constraint(f"{i}:{c.metric}{c.op}", v)
        entry.trial.set_user_attr("qkscope_status", status)
        state = {
            "completed": TrialState.COMPLETE,
            "pruned": TrialState.PRUNED,
            "diverged": TrialState.DIVERGED,
        }[status]
        with session_scope(self.sessions) as s:
            row = s.get(Trial, entry.row_id)
            assert row is not None
            row.state = state
            row.summary = summary
            row.node = result.get("node")
            row.values = [v if math.isfinite(v) else None for v in values]
            row.value = row.values[0]
            row.feasible = all(c <= 0 for c in constraints)
            for col in (
                "final_val_loss",
                "min_norm_entropy",
                "final_rank_ratio",
                "qk_eig_var",
                "plateau_steps",
                "entropy_collapse",
                "rank_collapse",
                "trapped",
            ):
                setattr(row, col, summary.get(col))
            row.last_step = int(summary.get("steps_done", row.last_step))
            row.finished_at = utcnow()
            row.duration_s = time.monotonic() - entry.started
        if state == TrialState.PRUNED:
            self.study.tell(entry.trial, state=OptunaState.PRUNED)
        else:
            self.study.tell(entry.trial, values)

    def _fail(self, entry: _Running, reason: str) -> None:
        with session_scope(self.sessions) as s:
            row = s.get(Trial, entry.row_id)
            assert row is not None
            row.state, row.error, row.finished_at = TrialState.FAILED, reason, utcnow()
            row.duration_s = time.monotonic() - entry.started
        self.study.tell(entry.trial, state=OptunaState.FAIL, skip_if_finished=True)
        log.warning("trial %d failed: %s", entry.number, reason)

    # ---- the loop -----------------------------------------------------------------------------

    def _set_status(self, status: StudyStatus, error: str | None = None) -> None:
        with session_scope(self.sessions) as s:
            row = s.get(Study, self.study_id)
            assert row is not None
            if StudyStatus(row.status) in TERMINAL and status != StudyStatus.RUNNING:
                return
            row.status = status
            if status == StudyStatus.RUNNING and row.started_at is None:
                row.started_at = utcnow()
            if status in TERMINAL:
                row.finished_at = utcnow()
            if error:
                row.error = error

    def _cancelled(self) -> bool:
        with session_scope(self.sessions) as s:
            return (
                s.scalar(select(Study.status).where(Study.id == self.study_id))
                == StudyStatus.CANCELLED
            )

    def _cancel_all(self) -> None:
        for ref, entry in list(self.running.items()):
            ray.cancel(ref, force=True)
            with session_scope(self.sessions) as s:
                row = s.get(Trial, entry.row_id)
                if row is not None and row.state == TrialState.RUNNING:
                    row.state, row.finished_at, row.error = (
                        TrialState.CANCELLED,
                        utcnow(),
                        "study cancelled",
                    )
            self.study.tell(entry.trial, state=OptunaState.FAIL, skip_if_finished=True)
        self.running.clear()

    def run(self) -> StudyStatus:
        if self.status in TERMINAL:
            return self.status
        self._set_status(StudyStatus.RUNNING)
        inbox = TrialInbox.remote()  # type: ignore[attr-defined]
        self._resume_orphans(inbox)
        t0 = time.monotonic()
        timeout = self.spec.budget.timeout_s
        while True:
            if self._cancelled():
                self._cancel_all()
                return StudyStatus.CANCELLED
            asked = len(self.study.get_trials(deepcopy=False))
            out_of_time = timeout is not None and time.monotonic() - t0 > timeout
            while (
                len(self.running) < self.spec.parallelism
                and asked < self.spec.budget.n_trials
                and not out_of_time
            ):
                self._ask_and_launch(inbox)
                asked += 1
            if not self.running:
                break
            ready, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=POLL_S)
            self._persist_reports(ray.get(inbox.drain.remote()), inbox)
            for ref in ready:
                self._finish(ref, self.running.pop(ref))
        self._set_status(StudyStatus.COMPLETED)
        return StudyStatus.COMPLETED


def run_study(study_id: int, settings: Settings | None = None) -> StudyStatus:
    """Run (or resume) one study to its end; the study row records the outcome."""
    settings = settings or get_settings()
    engine = make_engine(settings.resolved_database_url())
    runner = None
    try:
        runner = StudyRunner(study_id, settings, engine)
        return runner.run()
    except BaseException as e:
        if runner is not None and not isinstance(e, KeyboardInterrupt):
            runner._set_status(StudyStatus.FAILED, "".join(traceback.format_exception(e))[-4000:])
        raise
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m service.runner STUDY_ID", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(log_to_driver=False)
    status = run_study(int(args[0]))
    print(f"study {args[0]}: {status}")
    return 0 if status != StudyStatus.FAILED else 1


if __name__ == "__main__":
    raise SystemExit(main())

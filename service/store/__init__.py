"""The row store: qkscope's own tables (prefix `qk_`, beside Optuna's) and the only code that
writes them.

Contract (tests/service/store/test_contract.py runs it on SQLite and PostgreSQL):

- **One writer.** Every INSERT, UPDATE and DELETE of `qk_study`, `qk_trial` and `qk_metric`
  is a method of `StudyRows` or `TrialRows`. The read side gets sessions from
  `make_reader`, which refuse any write.
- **Whole transactions.** Each method is one transaction: it commits as a whole or not at
  all. The runner's methods retry after a dropped connection or a locked database
  (`with_retry`, through `Rows._tx`: service/store/rows.py), so each is safe to repeat.
- **Ends are conditional.** A study's terminal status is never left (`set_status` only
  matches a live row). A trial ends once: an ending only matches a QUEUED or RUNNING row,
  so whoever ends it first (a result, a failure, a cancel) wins, and the late writer only
  recounts the metric rows stored.
- **Replays are no-ops.** A metric row that is already stored is skipped (its primary key);
  `last_step` never goes backwards; a retried insert of a queued trial returns the row the
  lost try committed.
- **Launches are claimed.** A runner-job attempt is claimed against the attempts the caller
  saw, and its job id is recorded in the same transaction, before the job is submitted.
  Attempt numbers only go up: none is handed out twice.
- **Standbys are claimed once.** A POST turns at most one standby row (a reserved id whose
  runner job waits, service/store/standbys.py) into its study, and only a row still in
  STANDBY whose runner's heartbeat is fresh; a standby row is never LIVE and is deleted only
  while still a standby.
- **Runners are fenced.** A store made with a runner's `Fence` (its study and job attempt)
  checks, in the same transaction as each write, that the attempt is still the study's
  current one; if not, the write changes nothing and raises `Superseded`
  (service/store/fence.py).

The package is the store's one face: every other package imports what it needs from
`service.store`, never from its modules (pyproject.toml's import-linter contract "the store
shows one face"). Each public method of `StudyRows` and `TrialRows` says, as Optuna's
storages/_base.py does, what it returns, what it raises (`DatabaseUnavailable` after the
outage window, `Superseded` when fenced) and which rows it may change.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from service.store.fence import Fence, Superseded
from service.store.ingest import insert_metrics
from service.store.models import (
    CURRENT_PENALTY_VERSION,
    NO_INDEX,
    OPEN_TRIAL_STATES,
    SUMMARY_COLUMNS,
    Base,
    Metric,
    Study,
    StudyStatus,
    Trial,
    TrialState,
    utcnow,
)
from service.store.nonfinite import (
    INF,
    NEG_INF,
    SummaryJSON,
    decode_numbers,
    json_number,
    jsonable,
)
from service.store.optuna import (
    Outcome,
    constraint_values,
    objective_values,
    optuna_storage,
    optuna_study_name,
    stored_outcome,
    tell_outcome,
)
from service.store.session import (
    EXIT_DATABASE_AWAY,
    DatabaseUnavailable,
    ReadOnlyError,
    database_away,
    make_engine,
    make_reader,
    make_sessionmaker,
    normalize_url,
    outage_window,
    ping,
    session_scope,
    with_retry,
)
from service.store.standbys import (
    HEARTBEAT_S,
    STANDBY,
    StandbyRow,
    StandbyRows,
    Waiting,
)
from service.store.standbys import (
    STALE_S as STANDBY_STALE_S,
)
from service.store.studies import TERMINAL, Charge, StudyRows
from service.store.trials import MetricRow, ResultRow, StartRow, TrialRows

__all__ = [
    "EXIT_DATABASE_AWAY",
    "INF",
    "NEG_INF",
    "SummaryJSON",
    "decode_numbers",
    "json_number",
    "jsonable",
    "Charge",
    "CURRENT_PENALTY_VERSION",
    "NO_INDEX",
    "OPEN_TRIAL_STATES",
    "HEARTBEAT_S",
    "STANDBY",
    "STANDBY_STALE_S",
    "SUMMARY_COLUMNS",
    "TERMINAL",
    "Base",
    "DatabaseUnavailable",
    "Fence",
    "Metric",
    "MetricRow",
    "Outcome",
    "ReadOnlyError",
    "ResultRow",
    "StartRow",
    "Store",
    "StandbyRow",
    "StandbyRows",
    "Study",
    "StudyRows",
    "StudyStatus",
    "Superseded",
    "Trial",
    "TrialRows",
    "TrialState",
    "Waiting",
    "constraint_values",
    "database_away",
    "insert_metrics",
    "make_engine",
    "make_reader",
    "make_sessionmaker",
    "normalize_url",
    "objective_values",
    "optuna_storage",
    "optuna_study_name",
    "outage_window",
    "ping",
    "session_scope",
    "stored_outcome",
    "tell_outcome",
    "upgrade_schema",
    "utcnow",
    "with_retry",
]


class Store:
    """The writers of one database, for one process; with a `fence`, a study runner's
    (every write it makes holds only while its attempt is the study's current one)."""

    def __init__(self, sessions: sessionmaker[Session], fence: Fence | None = None) -> None:
        self.sessions = sessions
        self.fence = fence
        self.studies = StudyRows(sessions, fence)
        self.trials = TrialRows(sessions, fence)
        self.standbys = StandbyRows(sessions)

    def reader(self) -> sessionmaker[Session]:
        """Read-only sessions on this store's database (`make_reader`) for a reader outside
        the store, e.g. the runner's width ladder reading the stability boundary."""
        return make_reader(self.sessions.kw["bind"])


def upgrade_schema(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to the schema `revision` (Alembic; our tables only);
    safe to run on every start (service/store/migrate.py, imported here only when called,
    so that a study runner never loads Alembic)."""
    from service.store.migrate import upgrade

    upgrade(url, revision)

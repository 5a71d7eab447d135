"""The one place qkscope reads its settings from (environment, prefix QKSCOPE_)."""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from service.spec.limits import Limits

__all__ = ["Settings", "get_settings"]

HOME = Path(".qkscope")


class Settings(BaseSettings):
    """Service, runner and CLI settings.

    The defaults are the embedded setup: an SQLite file under `.qkscope/`
    and a local Ray head started by `qkscope serve`.
    """

    model_config = SettingsConfigDict(env_prefix="QKSCOPE_", extra="ignore")

    database_url: str = ""  # empty: sqlite file under home
    # A file holding the database URL (operator-provided, e.g. a mounted secret); wins over
    # database_url. The runner jobs get only this path, never the URL (it may hold a password).
    database_url_file: str = ""
    # How study runner jobs find the database: "file" (the API writes its URL to a 0600 file
    # in home and passes the path; one machine or a shared home) or "node" (the Ray nodes have
    # QKSCOPE_DATABASE_URL / QKSCOPE_DATABASE_URL_FILE in their own environment: compose).
    runner_db_source: Literal["file", "node"] = "file"
    ray_address: str = ""  # dashboard URL, e.g. http://127.0.0.1:8265; empty: local head
    api_tokens: SecretStr = SecretStr("")  # comma-separated bearer tokens
    data_dir: str = ""  # root for relative task.data_dir paths in study specs
    home: Path = HOME
    checkpoint_dir: str = ""  # shared storage for trial checkpoints; empty: home/checkpoints
    api_url: str = "http://127.0.0.1:8000"  # where the CLI finds the API (QKSCOPE_API_URL)
    reconcile_interval_s: float = Field(10.0, gt=0.0)
    # Standby runners kept while no study runs: a runner job started ahead for the next POST,
    # with Optuna's storage, its inbox and `standby_workers` worker processes warm, so the
    # study's first step comes within about a second (service/control/standby.py). 0: none,
    # every study starts its own job cold (5 to 8 s before its first step on 2 cores).
    standby: int = Field(1, ge=0, le=8)
    standby_workers: int = Field(2, ge=1, le=64)
    # How often `qkscope serve` checks that its embedded Ray head still runs (and restarts it).
    head_check_interval_s: float = Field(5.0, gt=0.0)
    # Refuse studies whose resources no alive Ray node has (turn off for autoscaling clusters,
    # whose nodes appear later; the runner then shows a waiting reason instead).
    check_resources: bool = True
    # Runner jobs per study that may die of the study or the cluster before it is marked
    # FAILED. A runner that exits because the database was away (exit 75) is not one of
    # them: weather has its own, much larger bound, and its relaunch waits a while after
    # the exit (`weather_relaunch_delay_s`) and for the API's database to answer.
    max_job_attempts: int = Field(5, ge=1)
    max_weather_relaunches: int = Field(1000, ge=0)
    weather_relaunch_delay_s: float = Field(30.0, ge=0.0)
    # How long a study runner waits for a database that went away (refused or dropped
    # connections) before it exits leaving the study RUNNING for the reconciler; a restart
    # or failover of PostgreSQL must fit in it. Never a reason to fail a study.
    db_outage_s: float = Field(600.0, gt=0.0)
    max_body_bytes: int = Field(256 * 1024, gt=0)
    max_trials: int = Field(10_000, ge=1)
    max_steps: int = Field(1_000_000, ge=1)
    max_params: int = Field(200_000_000, ge=1)  # model size limit per trial
    # The memory one worker may need at the largest point of a study's search space (its
    # parameters, activations, logits, metrics probe and validation set, times the members
    # a CPU worker fuses; a GPU worker fits its slots to its memory itself): more is a 422
    # at POST naming the field. service/spec/space.py `check_memory` estimates it (errs high).
    max_trial_memory_bytes: int = Field(16 * 2**30, ge=2**20)
    # What one accepted study may cost the head, a worker or the database (service/spec/limits.py;
    # each is a 422 at POST naming the field and the limit, docs/operations.md).
    # Points of the grid sampler's grid: Optuna builds them all as a list in the runner.
    max_grid_points: int = Field(100_000, ge=1)
    # Evaluations one trial runs (steps / eval_every): inbox messages, Optuna intermediate
    # values and metric rows.
    max_evals_per_trial: int = Field(10_000, ge=1)
    # Metric rows one trial, and one study, may write (evaluations x the registry's series
    # per layer and head), at the largest point of the search space.
    max_metric_rows_per_trial: int = Field(2_000_000, ge=1)
    max_metric_rows_per_study: int = Field(200_000_000, ge=1)
    # Checkpoint bytes one trial writes over its life (each checkpoint replaces the last).
    max_checkpoint_bytes_per_trial: int = Field(256 * 2**30, ge=2**20)
    # Bytes Optuna stores for a study's parameters (each trial's row of each searched field
    # holds the field's distribution as JSON, every categorical choice included).
    max_param_bytes_per_study: int = Field(256 * 2**20, ge=2**20)
    # Characters of any one string of a definition (the description has its own 10,000).
    max_string_chars: int = Field(1024, ge=16)
    # Live studies (PENDING or RUNNING) at once: each costs the Ray head memory while it runs
    # (its runner, the job supervisor and the inbox, about 410 MB measured); a POST past the
    # cap is a 429 with Retry-After (service/api/admission.py).
    max_live_studies: int = Field(16, ge=1)
    # The head memory live studies may take, and what one takes there (0: no memory bound);
    # the live cap is then also head_memory_bytes // head_bytes_per_study.
    head_memory_bytes: int = Field(0, ge=0)
    head_bytes_per_study: int = Field(512 * 2**20, ge=2**20)
    # How long a client may take to send one request, headers and body, from its first byte
    # (the connection's start, for the first): slower ones get a 408 and are closed before any
    # route runs (service/http_guard.py; `qkscope serve`).
    read_timeout_s: float = Field(20.0, gt=0.0)
    # Messages the runner's inbox buffers before a worker's next message waits for room
    # (workers/inbox.py): a slow runner slows its workers, never loses or piles up messages.
    inbox_max_messages: int = Field(1000, ge=1)

    def limits(self) -> Limits:
        """The definition limits of service/spec/limits.py, from these settings."""
        from service.spec.limits import Limits

        return Limits(
            grid_points=self.max_grid_points,
            evals_per_trial=self.max_evals_per_trial,
            metric_rows_per_trial=self.max_metric_rows_per_trial,
            metric_rows_per_study=self.max_metric_rows_per_study,
            checkpoint_bytes_per_trial=self.max_checkpoint_bytes_per_trial,
            param_bytes_per_study=self.max_param_bytes_per_study,
            string_chars=self.max_string_chars,
        )

    def resolved_database_url(self) -> str:
        """The database URL (file, else setting); the embedded default is an absolute SQLite
        path."""
        if self.database_url_file:
            return Path(self.database_url_file).read_text().strip()
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'qkscope.db').resolve()}"

    def runner_database_url_file(self) -> str | None:
        """The file a runner job reads the database URL from (None: the node's environment).

        With runner_db_source "file" and no operator file, the URL is written to
        `home/runner-database-url`, readable by this user only.
        """
        if self.database_url_file:
            return str(Path(self.database_url_file).resolve())
        if self.runner_db_source == "node":
            return None
        path = (self.home / "runner-database-url").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary name of its own per call (0600 from the start): POSTs write it from
        # several threads at once, and each rename must find its own file.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.resolved_database_url())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return str(path)

    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint_dir or str((self.home / "checkpoints").resolve())

    def token_list(self) -> list[str]:
        raw = self.api_tokens.get_secret_value()
        return [t.strip() for t in raw.split(",") if t.strip()]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

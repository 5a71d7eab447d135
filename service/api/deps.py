"""Typed dependencies: settings, one database session per request, auth, the study of a path."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Path, Request, status
from sqlalchemy.orm import Session, defer, sessionmaker

from service.api.errors import ApiError
from service.config import Settings
from service.control.ray_cluster import JobLauncher
from service.store import STANDBY, Store, Study, Trial, session_scope

__all__ = [
    "MAX_ID",
    "LauncherDep",
    "SessionDep",
    "SettingsDep",
    "StoreDep",
    "StudyDep",
    "StudyId",
    "TrialDep",
    "TrialId",
    "load_study",
    "require_token",
    "token_digest",
]

MAX_ID = 2**31 - 1  # PostgreSQL integer
StudyId = Annotated[int, Path(ge=1, le=MAX_ID)]


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """One read-only session per request (only the store writes rows)."""
    factory: sessionmaker[Session] = request.app.state.sessions
    with session_scope(factory) as session:
        yield session


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_launcher(request: Request) -> JobLauncher | None:
    launcher: JobLauncher | None = request.app.state.launcher()
    return launcher


def require_token(request: Request) -> None:
    """Bearer-token check; a no-op when no tokens are configured."""
    digests: list[bytes] = request.app.state.token_digests
    if not digests:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    given = token_digest(token.strip())
    if not any(hmac.compare_digest(given, d) for d in digests):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"}
        )


_Row = TypeVar("_Row", Study, Trial)


def _row_or_404(session: Session, model: type[_Row], row_id: int) -> _Row:
    """The row `row_id` of `model`, or the API's 404 naming it."""
    row = session.get(model, row_id)
    if row is None or (isinstance(row, Study) and row.status == STANDBY):  # a reserved id
        what = "study" if model is Study else "trial"
        raise ApiError(404, "not_found", f"{what} {row_id} does not exist")
    return row


def load_study(session: Session, study_id: int) -> Study:
    """The study `study_id`, or the API's 404."""
    return _row_or_404(session, Study, study_id)


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]  # read-only: writes go through StoreDep
StoreDep = Annotated[Store, Depends(get_store)]
LauncherDep = Annotated[JobLauncher | None, Depends(get_launcher)]


def get_study(session: SessionDep, study_id: StudyId) -> Study:
    return load_study(session, study_id)


# The study of the route's `{study_id}`, read with the request's session, or a 404 (before
# the route's other parameters are checked: a missing study is the first thing to fix).
StudyDep = Annotated[Study, Depends(get_study)]

TrialId = Annotated[int, Path(ge=1, le=MAX_ID)]


def get_trial(session: SessionDep, trial_id: TrialId) -> Trial:
    """The trial row without its summary (deferred: a long trial's summary is hundreds of
    KiB; /v1/trials/{id} loads it bounded, service/read/summaries.py)."""
    trial = session.get(Trial, trial_id, options=[defer(Trial.summary)])
    if trial is None:
        raise ApiError(404, "not_found", f"trial {trial_id} does not exist")
    return trial


# The trial of the route's `{trial_id}`, or a 404, as StudyDep for a study.
TrialDep = Annotated[Trial, Depends(get_trial)]

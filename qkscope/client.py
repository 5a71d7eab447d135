"""`Client`: the qkscope REST API from Python (notebooks, scripts, the `qkscope` CLI).

Light on purpose: httpx, and tqdm only for progress bars (YAML files are sent as they are,
the server parses them); no torch, Ray or server stack. Every call raises `ApiError` for a
4xx/5xx and `ConnectError` when the service cannot be reached.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import httpx

from qkscope.errors import ApiError, ConnectError
from qkscope.models import (
    Importance,
    LrSensitivity,
    MetricPoint,
    MetricSeries,
    Plot,
    StabilityBoundary,
    Study,
    StudyList,
    Summary,
    Trial,
    TrialList,
)
from qkscope.progress import make_progress

__all__ = ["DEFAULT_URL", "Client"]

DEFAULT_URL = "http://127.0.0.1:8000"
PAGE = 1000  # the trials route's largest page
METRIC_PAGE = 50_000  # metric rows asked for a call (the route answers at most 100,000)


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    r.read()
    try:
        body = r.json()
    except ValueError:
        raise ApiError(r.status_code, r.text[:300] or r.reason_phrase) from None
    if not isinstance(body, dict):
        raise ApiError(r.status_code, str(body)[:300])
    if "message" in body:
        raise ApiError(
            r.status_code, str(body["message"]), str(body.get("error", "error")), body.get("errors")
        )
    raise ApiError(r.status_code, str(body.get("detail", body))[:300])


def _listed(v: str | Iterable[str] | None) -> list[str] | None:
    if v is None:
        return None
    return [v] if isinstance(v, str) else list(v)


class Client:
    """A connection to one qkscope service.

    `url` defaults to QKSCOPE_API_URL (else http://127.0.0.1:8000) and `token` to
    QKSCOPE_API_TOKEN, the same variables the `qkscope` CLI reads. Use it as a context
    manager, or call `close()`.
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 30.0
    ) -> None:
        self.url = (url or os.environ.get("QKSCOPE_API_URL") or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get("QKSCOPE_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # --- transport ------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ConnectError(self.url, type(e).__name__) from None
        _raise_for(r)
        return r

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._request(method, path, **kw).json()

    def health(self) -> dict[str, Any]:
        """GET /healthz (no token needed)."""
        return dict(self._json("GET", "/healthz"))

    # --- studies --------------------------------------------------------------------------

    def submit(
        self,
        definition: Mapping[str, Any] | str | os.PathLike[str] | Any,
        idempotency_key: str | None = None,
    ) -> Study:
        """Submit a study definition: a dict, a path to a YAML/JSON file, or a StudySpec
        (anything with `model_dump`). Returns the stored study (201, or 200 for a repeated
        `idempotency_key`)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        if isinstance(definition, str | os.PathLike):
            path = Path(definition)
            try:
                content = path.read_bytes()
            except OSError as e:
                raise FileNotFoundError(f"cannot read {path}: {e.strerror}") from None
            ctype = "application/json" if path.suffix == ".json" else "application/yaml"
        else:
            if hasattr(definition, "model_dump"):
                definition = definition.model_dump(mode="json")
            content = json.dumps(definition).encode()
            ctype = "application/json"
        headers["content-type"] = ctype
        return Study.from_json(self._json("POST", "/v1/studies", content=content, headers=headers))

    def study(self, study_id: int) -> Study:
        return Study.from_json(self._json("GET", f"/v1/studies/{study_id}"))

    def studies(self, status: str | None = None, limit: int = 50, offset: int = 0) -> StudyList:
        """Studies, newest first; `status` filters (PENDING, RUNNING, COMPLETED, ...)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status:
            params["status"] = status
        page = self._json("GET", "/v1/studies", params=params)
        return StudyList([Study.from_json(s) for s in page["items"]], int(page["total"]))

    def summary(self, study_id: int) -> Summary:
        return Summary.from_json(self._json("GET", f"/v1/studies/{study_id}/summary"))

    def cancel(self, study_id: int) -> Study:
        """Stop the study's Ray job and its running trials; finished studies stay as they are."""
        return Study.from_json(self._json("POST", f"/v1/studies/{study_id}/cancel"))

    def wait(
        self,
        study_id: int,
        progress: bool | str = True,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        file: TextIO | None = None,
    ) -> Summary:
        """Block until the study is COMPLETED, FAILED or CANCELLED; returns its last summary.

        `progress`: True picks a notebook bar in Jupyter, a tqdm bar on a terminal, and
        plain lines (one per change) otherwise; "bar" / "lines" force one; False is silent.
        `timeout_s` raises TimeoutError when the study is still running then.
        """
        shown = make_progress(study_id, progress, file or sys.stderr)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                s = self.summary(study_id)
                shown.update(s)
                if s.done:
                    return s
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"study {study_id} still {s.status} after {timeout_s}s")
                time.sleep(poll_s)
        finally:
            shown.close()

    # --- trials ---------------------------------------------------------------------------

    def trials(
        self,
        study_id: int,
        state: str | Iterable[str] | None = None,
        where: str | Iterable[str] | None = None,
        sort: str = "number",
        limit: int | None = None,
        offset: int = 0,
    ) -> TrialList:
        """A study's trials. `state="COMPLETE"` (or several), `where="min_norm_entropy>=0.1"`
        or `where=["params.regularizer.lambda<0.1", ...]`, `sort="-final_val_loss"`.
        `limit=None` reads every page."""
        params: dict[str, Any] = {"sort": sort}
        if (states := _listed(state)) is not None:
            params["state"] = [s.upper() for s in states]
        if (filters := _listed(where)) is not None:
            params["where"] = filters
        items: list[Trial] = []
        total = 0
        while True:
            want = PAGE if limit is None else min(PAGE, limit - len(items))
            page = self._json(
                "GET",
                f"/v1/studies/{study_id}/trials",
                params={**params, "limit": want, "offset": offset + len(items)},
            )
            total = int(page["total"])
            items += [Trial.from_json(t) for t in page["items"]]
            full = limit is not None and len(items) >= limit
            if full or not page["items"] or offset + len(items) >= total:
                return TrialList(items, total)

    def trial(self, trial_id: int) -> Trial:
        """One trial by its id, with its full `summary`."""
        return Trial.from_json(self._json("GET", f"/v1/trials/{trial_id}"))

    def metrics(
        self,
        trial: int | Trial,
        name: str | Iterable[str] | None = None,
        layer: int | None = None,
        head: int | None = None,
        step_min: int | None = None,
        step_max: int | None = None,
    ) -> MetricSeries:
        """A trial's per-step metric rows (`name="val_loss"`, `name=["attn_entropy_norm"]`),
        all of them: the route answers a page at a time (`METRIC_PAGE` rows), and the pages
        are fetched in turn, following the `X-Next-Cursor` header."""
        trial_id = trial.id if isinstance(trial, Trial) else int(trial)
        params: dict[str, Any] = {
            "name": _listed(name),
            "layer": layer,
            "head": head,
            "step_min": step_min,
            "step_max": step_max,
            "limit": METRIC_PAGE,
        }
        params = {k: v for k, v in params.items() if v is not None}
        points = MetricSeries()
        cursor: str | None = None
        while True:
            r = self._request(
                "GET",
                f"/v1/trials/{trial_id}/metrics",
                params={**params, **({"cursor": cursor} if cursor else {})},
            )
            points.extend(
                MetricPoint(
                    name=m["name"],
                    step=m["step"],
                    value=m["value"],
                    layer=m["layer"],
                    head=m["head"],
                )
                for m in r.json()
            )
            cursor = r.headers.get("x-next-cursor")
            if not cursor:
                return points

    def best(self, study_id: int, feasible_only: bool = True) -> TrialList:
        """The best COMPLETE trial (one objective) or the Pareto front (several)."""
        rows = self._json(
            "GET",
            f"/v1/studies/{study_id}/best",
            params={"feasible_only": str(feasible_only).lower()},
        )
        return TrialList([Trial.from_json(t) for t in rows])

    pareto = best  # the same route: with several objectives, /best is the Pareto front

    def importance(
        self, study_id: int, target: str | None = None, evaluator: str = "fanova"
    ) -> Importance:
        """Which parameters matter for `target` (an objective name or a summary metric such
        as `min_norm_entropy`; default the first objective): fANOVA or PED-ANOVA."""
        params = {"evaluator": evaluator, **({"target": target} if target else {})}
        return Importance.from_json(
            self._json("GET", f"/v1/studies/{study_id}/importance", params=params)
        )

    def lr_sensitivity(
        self, study_id: int, group_by: str | Iterable[str] | None = None
    ) -> LrSensitivity:
        """Learning-rate sensitivity (METRICS.md section 9) per group of `group_by` values
        (one parameter or several; default every searched parameter but optim.lr and seed):
        the sensitivity with its t interval, `l_0` and the curve `l(eta)` over seeds."""
        params = {"group_by": _listed(group_by)} if group_by else {}
        return LrSensitivity.from_json(
            self._json("GET", f"/v1/studies/{study_id}/lr-sensitivity", params=params)
        )

    def stability_boundary(
        self,
        study_id: int,
        width: str | None = None,
        group_by: str | Iterable[str] | None = None,
        target_width: float | None = None,
        tau: float | None = None,
    ) -> StabilityBoundary:
        """The stability boundary across widths (METRICS.md section 11) per group: per width
        and seed `eta_max` and `eta_opt`, their power-law fits in width (`b` and the
        prediction at `target_width`, with t intervals) and the held-out check. `width`: the
        width parameter (default `model.d_model` / `model.hf.config.hidden_size`); `tau`:
        the loss rule (default the study's, else 0.5)."""
        params: dict[str, Any] = {}
        if width:
            params["width"] = width
        if group_by:
            params["group_by"] = _listed(group_by)
        if target_width is not None:
            params["target_width"] = target_width
        if tau is not None:
            params["tau"] = tau
        return StabilityBoundary.from_json(
            self._json("GET", f"/v1/studies/{study_id}/stability-boundary", params=params)
        )

    # --- plots and export -----------------------------------------------------------------

    def plot(self, study_id: int, kind: str, **options: Any) -> Plot:
        """A plot as a PNG (`metric`, `scatter`, `phase`, `pareto`, `history`, `importance`);
        options are the route's query parameters (`metric=`, `x=`, `y=`, `width=`, ...)."""
        query = {k: v for k, v in options.items() if v is not None}
        query["format"] = "png"
        r = self._request("GET", f"/v1/studies/{study_id}/plots/{kind}", params=query)
        return Plot(png=r.content, study_id=study_id, kind=kind)

    def plot_data(self, study_id: int, kind: str, **options: Any) -> dict[str, Any]:
        """The data behind a plot, as JSON."""
        query = {k: v for k, v in options.items() if v is not None}
        query["format"] = "json"
        return dict(self._json("GET", f"/v1/studies/{study_id}/plots/{kind}", params=query))

    def export(
        self,
        study_id: int,
        path: str | os.PathLike[str] | None = None,
        format: str = "csv",
        metrics: bool = False,
        table: str | None = None,
    ) -> Path:
        """Stream the study's trials (`table="metrics"`: metric rows; `metrics=True`: a zip of
        both) as CSV or Parquet into `path` (default: the name the server suggests)."""
        params: dict[str, Any] = {"format": format, "metrics": str(metrics).lower()}
        if table:
            params["table"] = table
        try:
            with self._http.stream("GET", f"/v1/studies/{study_id}/export", params=params) as r:
                _raise_for(r)
                disposition = r.headers.get("content-disposition", "")
                suggested = Path(disposition.partition('filename="')[2].rstrip('"')).name
                out = Path(path or suggested or f"study-{study_id}.{format}")
                with open(out, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
        except httpx.TransportError as e:
            raise ConnectError(self.url, type(e).__name__) from None
        return out

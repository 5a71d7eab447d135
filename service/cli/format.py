"""What `qkscope` prints: a study's trials as a table, the LR-sensitivity tables, and how a
wait shows its progress."""

from __future__ import annotations

import sys
from typing import Any

from qkscope import Client, LrSensitivity, StabilityBoundary, Trial

__all__ = [
    "COLUMNS",
    "lr_sensitivity_table",
    "progress_style",
    "results_table",
    "stability_boundary_table",
]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# Column title -> Trial attribute, in the order the table shows them.
COLUMNS = (
    ("#", "number"),
    ("state", "state"),
    ("value", "value"),
    ("val_loss", "final_val_loss"),
    ("min_H_norm", "min_norm_entropy"),
    ("rank_ratio", "final_rank_ratio"),
    ("qk_var", "qk_eig_var"),
    ("plateau", "plateau_steps"),
    ("E-coll", "entropy_collapse"),
    ("R-coll", "rank_collapse"),
    ("trapped", "trapped"),
    ("pen_v", "penalty_version"),
)


def results_table(qk: Client, study_id: int, limit: int = 50, sort: str = "value") -> str:
    """The study's trials as a text table, with its status line and collapse rates."""
    study = qk.study(study_id)
    trials = qk.trials(study_id, sort=sort, limit=limit)
    summary = qk.summary(study_id)
    params = list(study.search_space)
    cols = [c for c, _ in COLUMNS] + params

    def row(t: Trial) -> list[str]:
        return [_fmt(getattr(t, a)) for _, a in COLUMNS] + [_fmt(t.params.get(p)) for p in params]

    cells = [row(t) for t in trials]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [
        f"study {study_id} '{study.name}': {study.status}, "
        f"{summary.finished}/{study.n_trials} trials, best value {_fmt(summary.best_value)}",
        line,
        "-" * len(line),
    ]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    out += [f"trial {t.number} stopped: {t.stop_reason}" for t in trials if t.stop_reason]
    out.append(
        f"entropy-collapse rate {_fmt(summary.entropy_collapse_rate)}, "
        f"rank-collapse rate {_fmt(summary.rank_collapse_rate)}, "
        f"trapped rate {_fmt(summary.trapped_rate)}"
    )
    return "\n".join(out)


def progress_style() -> bool | str:
    """A bar only when both stdout and stderr are terminals; plain lines on change otherwise."""
    return True if sys.stdout.isatty() and sys.stderr.isatty() else "lines"


def _table(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header row, with a rule below it."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def lr_sensitivity_table(res: LrSensitivity) -> str:
    """Per group: the sensitivity with its interval, l_0 and the seeds used; then the curve
    l(eta) (median over seeds, diverged trials as their l_0; `d` marks diverged seeds)."""
    pct = f"{100 * res.confidence:g} %"
    out = [
        f"study {res.study_id}: LR sensitivity (METRICS.md 9) by "
        f"{', '.join(res.group_by) or 'nothing (one group)'}, grid of {len(res.grid)} "
        f"learning rates {_fmt(res.grid[0])} .. {_fmt(res.grid[-1])}"
        + ("" if res.log_spaced else " (NOT equally spaced in log lr)"),
        "",
    ]
    if not res.groups:
        return "\n".join([*out, "no finished trials yet"])
    rows = [["group", "sensitivity", f"{pct} interval", "l_0", "l*", "unigram floor", "seeds",
             "left out"]]  # fmt: skip
    for g in res.groups:
        interval = "-" if g.ci_low is None else f"[{_fmt(g.ci_low)}, {_fmt(g.ci_high)}]"
        rows.append(
            [g.label, _fmt(g.sensitivity), interval, _fmt(g.l0), _fmt(g.l_star),
             _fmt(g.unigram_floor), str(g.n_seeds), str(len(g.left_out))]
        )  # fmt: skip
    out += _table(rows)
    out += [f"{g.label}: {g.note}" for g in res.groups if g.note]
    out += ["", "final validation loss l(eta), median over seeds (n seeds, d diverged):"]
    curve = [["lr", *(g.label for g in res.groups)]]
    for i, eta in enumerate(res.grid):
        cells = [_fmt(eta)]
        for g in res.groups:
            p = g.curve[i]
            div = f" {p.diverged}d" if p.diverged else ""
            cells.append("-" if p.median is None else f"{_fmt(p.median)} (n={p.n}{div})")
        curve.append(cells)
    out += _table(curve)
    for g in res.groups:
        out += [f"{g.label}: seed {o['seed']} left out: {o['reason']}" for o in g.left_out]
    return "\n".join(out)


def _iv(lo: Any, hi: Any) -> str:
    return "-" if lo is None or hi is None else f"[{_fmt(lo)}, {_fmt(hi)}]"


def stability_boundary_table(res: StabilityBoundary) -> str:
    """Per group: the fits of eta_max and eta_opt (b and the prediction at the target width
    with their intervals) and the held-out ratio; then eta_max and eta_opt per width and
    seed (`-` undefined, the reason listed below)."""
    pct = f"{100 * res.confidence:g} %"
    out = [
        f"study {res.study_id}: stability boundary (METRICS.md 11) over {res.width}, by "
        f"{', '.join(res.group_by) or 'nothing (one group)'}, tau {res.tau:g}, target width "
        f"{res.target_width:g}",
        "",
    ]
    if not res.groups:
        return "\n".join([*out, "no finished trials yet"])
    rows = [["group", "value", "b", f"{pct} interval", f"at {res.target_width:g}",
             f"{pct} interval", "seeds"]]  # fmt: skip
    for g in res.groups:
        for name, f in (("eta_max", g.eta_max_fit), ("eta_opt", g.eta_opt_fit)):
            rows.append(
                [g.label, name, _fmt(f.get("b")), _iv(f.get("b_low"), f.get("b_high")),
                 _fmt(f.get("prediction")),
                 _iv(f.get("prediction_low"), f.get("prediction_high")), str(f.get("n_seeds"))]
            )  # fmt: skip
    out += _table(rows)
    out += ["", "held-out check (refit without the largest width; predicted / measured):"]
    hrows = [["group", "width", "ratio", f"{pct} interval", "seeds"]]
    for g in res.groups:
        h = g.holdout
        if h is None:
            hrows.append([g.label, "-", "- (fewer than 3 widths)", "-", "0"])
            continue
        ratio_iv = _iv(h.get("ratio_low"), h.get("ratio_high"))
        hrows.append(
            [g.label, _fmt(h.get("width")), _fmt(h.get("ratio")), ratio_iv, str(h.get("n_seeds"))]
        )
    out += _table(hrows)
    out += ["", "per width and seed:"]
    prow = [["group", "width", "seed", "eta_max", "eta_opt", "ratio", "bisect"]]
    notes = []
    for g in res.groups:
        for p in g.points:
            prow.append(
                [g.label, _fmt(p["width"]), str(p["seed"]), _fmt(p["eta_max"]),
                 _fmt(p["eta_opt"]), _fmt(p["ratio"]), str(p["bisection_steps"])]
            )  # fmt: skip
            if p.get("reason"):
                notes.append(f"{g.label}: width {_fmt(p['width'])} seed {p['seed']}: {p['reason']}")
    out += _table(prow)
    return "\n".join([*out, *notes])

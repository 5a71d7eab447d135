"""scripts/instability_table.py's arithmetic on synthetic records (docs/reproductions.md 7.1):
LR sensitivity, the stable-range width, Spearman's rho, the paired tests, Holm and the
pre-registered verdicts, each against an independent computation by hand or by scipy; and
the seven arm definitions differ only in their arm's fields."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import instability_table as it  # noqa: E402

GRID = [1e-3, 1e-2, 1e-1, 1.0]


def _row(seed: int, lr: float, loss: float | None, l0: float, logit: float | None, logz: float,
         state: str = "COMPLETE") -> dict[str, Any]:  # fmt: skip
    return {
        "state": state,
        "status": "diverged" if state == "DIVERGED" else "completed",
        "params.seed": str(seed),
        "params.optim.lr": repr(lr),
        "final_val_loss": "" if loss is None else repr(loss),
        "init_val_loss": repr(l0),
        "max_attn_logit_ever": "" if logit is None else repr(logit),
        "max_abs_output_log_z_ever": repr(logz),
    }


def test_one_seed_by_hand() -> None:
    # l0 6; losses 5, 4, 4.05, diverged -> 6; l* 4
    rows = [
        _row(1, 1e-3, 5.0, 6.0, 2.0, 0.5),
        _row(1, 1e-2, 4.0, 6.0, 3.0, 0.4),
        _row(1, 1e-1, 4.05, 6.0, 8.0, 1.0),
        _row(1, 1.0, None, 6.0, None, 2.0, state="DIVERGED"),
    ]
    st = it.arm_stats(it.arm_of(rows), GRID)[1]
    assert st.l0 == 6.0 and st.l_star == 4.0
    assert st.losses == [5.0, 4.0, 4.05, 6.0]
    assert st.sensitivity == pytest.approx((1.0 + 0.0 + 0.05 + 2.0) / 4)
    assert st.width == 2  # 4.0 and 4.05 within 0.1; the diverged point never counts
    assert st.top_excess == pytest.approx(2.0)
    # the missing logit of the diverged trial ranks highest: ranks 1, 2, 3, 4 -> rho 1
    assert st.rho["max_attn_logit_ever"] == pytest.approx(1.0)
    assert st.rho["max_abs_output_log_z_ever"] == pytest.approx(
        stats.spearmanr([1, 2, 3, 4], [0.5, 0.4, 1.0, 2.0]).statistic
    )


def test_spearman_matches_scipy_with_ties() -> None:
    x = [math.log(v) for v in [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]]
    y = [3.0, 1.0, 1.0, 7.0, 2.0, 9.0]
    assert it.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
    assert it.spearman(x, [1.0] * 6) == 0.0


def test_an_incomplete_seed_is_left_out() -> None:
    rows = [_row(2, lr, 4.0, 6.0, 1.0, 0.1) for lr in GRID[:3]]
    rows.append(_row(2, 1.0, None, 6.0, 1.0, 0.1, state="FAILED"))
    assert it.arm_stats(it.arm_of(rows), GRID) == {}


def _arm(shift: float, logit_top: float) -> list[dict[str, Any]]:
    rows = []
    for k, seed in enumerate([100, 101, 102, 103, 104]):
        noise = 0.01 * k
        losses = [5.0 + noise, 4.0 + noise, 4.2 + shift + noise, 5.5 + shift - 0.1 * k]
        logits = [2.0, 3.0, 5.0 + k, logit_top * (1 + 0.1 * k)]
        for lr, loss, lg in zip(GRID, losses, logits, strict=True):
            rows.append(_row(seed, lr, loss, 6.0, lg, 0.1 * lg))
    return rows


def test_paired_tests_holm_and_verdicts_by_hand() -> None:
    none = it.arm_stats(it.arm_of(_arm(0.5, 40.0)), GRID)
    qk = it.arm_stats(it.arm_of(_arm(0.0, 10.0)), GRID)
    ct = it.claim_test(none, qk, "max_attn_logit_ever")
    # sensitivity per seed of none: (1 + 0 + 0.7 + (2.0 - 0.11 k)) / 4; of qk: (1 + 0 + 0.2 +
    # (1.5 - 0.11 k)) / 4 (l* = 4 + 0.01 k): difference -0.25 for every seed
    assert ct.sensitivity.interval.centre == pytest.approx(-0.25)
    assert ct.sensitivity.interval.hi == pytest.approx(-0.25)
    assert ct.sensitivity.p == 0.0
    # log ratio at lr 1: log(10 / 40) for every seed
    assert ct.log_ratio.interval.centre == pytest.approx(math.log(0.25))
    # rho in none: logits increase with lr in every seed
    assert ct.rho.centre == pytest.approx(1.0)
    # excess at the top in none: 5.5 + 0.5 - 0.1 k (no noise there) - l* (= 4 + 0.01 k)
    excess = [5.5 + 0.5 - 0.1 * k - (4.0 + 0.01 * k) for k in range(5)]
    assert ct.excess.centre == pytest.approx(sum(excess) / 5)
    assert ct.excess.lo > it.TOP_EXCESS
    assert ct.verdict == "reproduced"


def test_verdict_rules() -> None:
    iv = it.Interval
    up, down, around = iv(1.0, 0.5, 1.5, 5), iv(-1.0, -1.5, -0.5, 5), iv(0.0, -1.0, 1.0, 5)
    big = iv(2.0, 1.0, 3.0, 5)

    def pr(i: it.Interval) -> it.Paired:
        return it.Paired(i, 0.01, 5)

    assert it.verdict_a_b(up, big, pr(down), pr(down)) == "reproduced"
    assert it.verdict_a_b(up, big, pr(up), pr(down)) == "not reproduced"
    assert it.verdict_a_b(up, big, pr(down), pr(up)) == "not reproduced"
    assert it.verdict_a_b(around, big, pr(around), pr(around)) == (
        "the instability does not show at this scale"
    )
    assert it.verdict_a_b(up, up, pr(down), pr(down)) == (  # excess 0.5..1.5: not above 0.5
        "the instability does not show at this scale"
    )
    assert it.verdict_a_b(up, big, pr(around), pr(down)) == "inconclusive"
    assert it.table_verdict(pr(down), 0.01) == "reproduced"
    assert it.table_verdict(pr(up), 0.01) == "not reproduced"
    assert it.table_verdict(pr(down), 0.2) == "inconclusive"


def test_report_reads_an_export_directory(tmp_path: Path) -> None:
    """The whole report from CSVs laid out as scripts/repro_via_service.py writes them,
    including Holm over the arms (by hand: p sorted, multiplied by 6, 5, ...)."""
    arms = {"none": _arm(0.5, 40.0), "qk-layernorm": _arm(0.0, 10.0), "zloss": _arm(0.5, 40.0)}
    with (tmp_path / "studies.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["study_id", "name"])
        for i, (arm, rows) in enumerate(arms.items(), start=1):
            name = f"instability-lr-grid-{arm}"
            w.writerow([i, name])
            with (tmp_path / f"study-{i}-{name}.trials.csv").open("w", newline="") as g:
                dw = csv.DictWriter(g, fieldnames=list(rows[0]))
                dw.writeheader()
                dw.writerows(rows)
    text = it.report(tmp_path)
    assert "| none | 1 | 5 |" in text
    assert "qk-layernorm: reproduced" in text
    assert "zloss: inconclusive" in text  # identical to none: difference 0, p 1
    assert it.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


ARM_FIELDS = {
    "instability_lr_grid_qk_layernorm.yaml": {("model", "qk_norm"): "layernorm"},
    "instability_lr_grid_qk_sigma.yaml": {("model", "qk_norm"): "sigma_reparam"},
    "instability_lr_grid_sigma_all.yaml": {("model", "sigma_reparam"): "all"},
    "instability_lr_grid_locater.yaml": {
        ("regularizer", "kind"): "locater",
        ("regularizer", "lambda"): 1.0,
        ("regularizer", "target_mean"): 0.1,
    },
    "instability_lr_grid_spectral.yaml": {
        ("regularizer", "kind"): "spectral_variance",
        ("regularizer", "lambda"): 1.0,
    },
    "instability_lr_grid_zloss.yaml": {("z_loss_coef",): 0.0001},
}


@pytest.mark.parametrize("name", sorted(ARM_FIELDS))
def test_arms_differ_from_none_only_in_their_own_fields(name: str) -> None:
    """docs/reproductions.md 7.1: the seven studies differ only in the arm's fields (and their
    name and description)."""
    defs = ROOT / "study_defs"
    none = yaml.safe_load((defs / "instability_lr_grid.yaml").read_text())
    arm = yaml.safe_load((defs / name).read_text())
    for key in ("name", "description"):
        none.pop(key), arm.pop(key)
    for path, value in ARM_FIELDS[name].items():
        node = arm["base"]
        for k in path[:-1]:
            node = node[k]
        assert node[path[-1]] == value
        ref = none["base"]
        for k in path[:-1]:
            ref = ref[k]
        node[path[-1]] = ref[path[-1]]
    assert arm == none
    assert none["search_space"]["seed"]["grid"] == [100, 101, 102, 103, 104]
    lrs = none["search_space"]["optim.lr"]["grid"]
    assert len(lrs) == 7 and lrs[0] == 1e-4 and lrs[-1] == 1.0
    steps = [math.log10(b / a) for a, b in zip(lrs, lrs[1:], strict=False)]
    assert all(abs(s - 2 / 3) < 1e-5 for s in steps)


def test_the_high_lr_addendum_counts_a_trial_that_ends_above_its_untrained_loss(
    tmp_path: Path,
) -> None:
    """scripts/instability_high_lr.py (7.8): a trial 'gives way' when it diverged or ended
    above its own l_0; a trial that trained, however badly, below l_0 does not."""
    import instability_high_lr as hl

    def row(state: str, final: str, init: str = "6.2") -> dict[str, str]:
        return {"state": state, "final_val_loss": final, "init_val_loss": init}

    assert hl.gave_way(row("COMPLETE", "10.9"))
    assert hl.gave_way(row("DIVERGED", "3.0"))
    assert hl.gave_way(row("COMPLETE", "nan")) and hl.gave_way(row("COMPLETE", ""))
    assert not hl.gave_way(row("COMPLETE", "6.1"))
    path = tmp_path / "study-1-x.trials.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(
            f,
            ["state", "final_val_loss", "init_val_loss", "params.optim.lr",
             "max_attn_logit_ever", "max_abs_output_log_z_ever"],
        )  # fmt: skip
        w.writeheader()
        for seed, final in enumerate(["3.5", "7.0", "8.0"]):
            w.writerow({"state": "COMPLETE", "final_val_loss": final, "init_val_loss": "6.2",
                        "params.optim.lr": "2.0", "max_attn_logit_ever": str(10.0 ** seed),
                        "max_abs_output_log_z_ever": "5"})  # fmt: skip
    lines = hl.table(path)
    assert lines[-1] == "| 2 | 2 of 3 | 7.000 | 10 | 5 |"

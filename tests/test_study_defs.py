"""Every shipped study definition is a valid StudySpec within the default limits, every
reproduction runs at least three seeds per setting, and each reproduction trains at reduced
size on the CPU through the real trial code."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from service.config import Settings
from service.spec import StudySpec, apply_params, check_limits, parse_spec
from workers.trial import TrialConfig, run_trial

DEFS = sorted((Path(__file__).resolve().parents[1] / "study_defs").glob("*.yaml"))


@pytest.mark.parametrize("path", DEFS, ids=[p.name for p in DEFS])
def test_study_definition_is_valid(path: Path) -> None:
    spec = parse_spec(path.read_bytes(), "application/yaml")
    s = Settings()
    assert (
        check_limits(
            spec,
            max_trials=s.max_trials,
            max_steps=s.max_steps,
            max_params=s.max_params,
            max_memory=s.max_trial_memory_bytes,
            limits=s.limits(),
        )
        == []
    )
    assert spec.description, "each study definition documents its experiment"


def test_both_kinds_of_study_ship() -> None:
    names = {p.name for p in DEFS}
    assert {"quickstart.yaml", "gpu_locater_lm.yaml"} <= names


@pytest.mark.parametrize("path", DEFS, ids=[p.name for p in DEFS])
def test_grid_studies_run_their_whole_grid_once(path: Path) -> None:
    """A grid study's budget is its grid: fewer trials leave points out, more repeat them."""
    spec = parse_spec(path.read_bytes(), "application/yaml")
    if spec.sampler.kind != "grid":
        pytest.skip("not a grid study")
    size = 1
    for p in spec.search_space.values():
        if p.type == "categorical":
            size *= len(p.choices)
        elif p.type in ("float", "int"):
            assert p.grid is not None
            size *= len(p.grid)
    if spec.stability is None or spec.stability.bisect_factor is None:
        assert spec.budget.n_trials == size
        return
    # a width ladder: the grid, then at most the bisection trials a grid bracket needs to
    # reach the factor, for each cell (width x seed x the other searched values)
    lr = spec.search_space["optim.lr"]
    assert lr.type == "float" and lr.grid is not None
    grid = sorted(lr.grid)
    widest = max(b / a for a, b in zip(grid, grid[1:], strict=False))
    steps = math.ceil(math.log2(math.log(widest) / math.log(spec.stability.bisect_factor)))
    assert spec.budget.n_trials == size + (size // len(grid)) * steps


def _spec(name: str) -> StudySpec:
    return parse_spec((DEFS[0].parent / name).read_bytes(), "application/yaml")


REPRO = [p for p in DEFS if p.name.startswith("repro_") or p.name.startswith("gpu_")]
SEEDED = [p for p in REPRO if _spec(p.name).sampler.kind == "grid"]
DATA_ROOT = Path(os.environ.get("QKSCOPE_DATA_DIR", "/work/shared/data"))


@pytest.fixture
def one_thread() -> Any:
    """One torch thread, as under Ray: tiny models on a shared CPU run faster and steadier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("path", SEEDED, ids=[p.name for p in SEEDED])
def test_every_reproduction_runs_three_seeds_per_setting(path: Path) -> None:
    """The grid includes a `seed` axis of >= 3 distinct seeds, so each setting has 3 seeds."""
    spec = _spec(path.name)
    seed = spec.search_space.get("seed")
    assert seed is not None and seed.type == "int" and seed.grid is not None
    assert len(set(seed.grid)) >= 3


def test_gpu_scale_definitions_for_both_papers() -> None:
    bao, dong = _spec("gpu_bao_wikitext2.yaml"), _spec("gpu_dong_depth.yaml")
    for spec in (bao, dong):
        assert spec.base.device == "cuda" and spec.resources.gpus > 0
    assert bao.base.task.kind == "lm" and bao.base.regularizer.kind == "locater"
    depth = dong.search_space["model.n_layers"]
    assert depth.type == "int" and depth.grid is not None and max(depth.grid) >= 24
    assert dong.base.model.d_model >= 256
    block = dong.search_space["model.block"]
    assert block.type == "categorical"
    assert set(block.choices) == {"pure", "attn_mlp", "attn_mlp_skip", "attn_skip", "full"}
    assert dong.base.dtype == "float32"  # collapsed ratios (~1e-7) are below bf16's resolution
    assert bao.fuse == "auto" and bao.slots > 1  # the Bao model: next test


# valid.txt, word-level with <eos> per line: the token count the GPU Bao study's epochs use
VALID_TOKENS = 213_886 + 3_760


def test_gpu_bao_is_the_papers_model_and_its_pre_registered_design() -> None:
    """Issue 35: fairseq's 1-layer 1-head width-128 Post-LN LM with sqrt(D) embeddings and
    feed-forward 128; five arms (none, variance only, LocAteR-style t = 0 / 0.01 / 0.02 at one
    lambda), 10 seeds, 10-15 epochs of valid.txt, evaluated on test.txt, best_val_loss."""
    bao = _spec("gpu_bao_wikitext2.yaml")
    m = bao.base.model
    assert (m.n_layers, m.n_heads, m.d_model, m.d_ff) == (1, 1, 128, 128)
    assert m.norm == "post" and m.embed_scale == "sqrt_d" and m.dropout == 0.0
    task = bao.base.task
    assert (task.train_split, task.valid_split) == ("valid", "test")
    epochs = bao.base.steps * bao.base.batch_size * task.seq_len / VALID_TOKENS
    assert 10 <= epochs <= 15, epochs
    kinds = bao.search_space["regularizer.kind"]
    assert kinds.type == "categorical"
    assert set(kinds.choices) == {"none", "spectral_variance", "locater"}
    target = bao.search_space["regularizer.target_mean"]
    assert target.type == "float" and target.grid == [0.0, 0.01, 0.02]
    assert "regularizer.lambda" not in bao.search_space and bao.base.regularizer.lam > 0
    seeds = bao.search_space["seed"]
    assert seeds.type == "int" and seeds.grid is not None and len(set(seeds.grid)) == 10
    assert [o.metric for o in bao.objectives] == ["best_val_loss"]
    text = (DEFS[0].parent / "gpu_bao_wikitext2.yaml").read_text()
    assert "PRE-REGISTRATION" in text and "Holm" in text


def test_gpu_bao_smoke_every_arm_on_cpu(one_thread: None) -> None:
    """The CPU smoke of the GPU Bao study: every arm at the definition's own model (width 128,
    Post-LN, sqrt(D) embeddings), a few steps on a small vocabulary, on the CPU."""
    spec = _spec("gpu_bao_wikitext2.yaml")
    if not (DATA_ROOT / "wikitext-2" / "valid.txt").is_file():
        pytest.skip("WikiText-2 not available (set QKSCOPE_DATA_DIR)")
    for kind in ("none", "spectral_variance", "locater"):
        params = {"regularizer.kind": kind, "regularizer.target_mean": 0.02, "seed": 300}
        config = _reduced(apply_params(spec.base, params))
        data = config.model_dump(by_alias=True)
        data["model"] = spec.base.model.model_dump()  # the full-size model, not the tiny one
        data["steps"] = 3
        summary = run_trial(TrialConfig.model_validate(data))
        assert summary.status == "completed", kind
        assert summary.best_val_loss is not None and math.isfinite(summary.best_val_loss)
        assert summary.qk_eig_var is not None


def test_dong_rate_definitions_probe_where_the_theorem_applies() -> None:
    """docs/metrics.md section 8: 24 layers in one model, float64, with and without the mask,
    QK init 0.02 / 0.2 / 1, 10 seeds, at init and after training; the floor study is zero-step."""
    rate = _spec("repro_dong_rate.yaml")
    assert rate.base.model.n_layers == 24 and rate.base.dtype == "float64"
    assert rate.base.model.block == "pure" and rate.base.eval_at_init and rate.base.steps > 0
    causal = rate.search_space["model.causal"]
    assert causal.type == "categorical" and set(causal.choices) == {True, False}
    qk = rate.search_space["model.qk_init_std"]
    assert qk.type == "float" and qk.grid == [0.02, 0.2, 1.0]
    seed = rate.search_space["seed"]
    assert seed.type == "int" and seed.grid is not None and len(set(seed.grid)) == 10
    mlp = _spec("repro_dong_rate_mlp.yaml")
    assert mlp.base.model.block == "attn_mlp"
    norm = mlp.search_space["model.norm"]
    assert norm.type == "categorical" and "none" in norm.choices
    floor = _spec("repro_dong_floor.yaml")
    assert floor.base.steps == 0 and floor.base.eval_at_init


def test_dong_growth_definitions_are_the_pre_registered_ones() -> None:
    """docs/reproductions.md 6.1: fresh seeds 10-29 (no earlier definition uses them), float64,
    24-layer pure attention with and without the mask, at init and after training; Pre-LN at
    QK 0.2, and the theorem's network (no LayerNorm, token_scale init) at QK 0.2 and 0.5."""
    pre, san = _spec("repro_dong_growth.yaml"), _spec("repro_dong_growth_theorem.yaml")
    fresh = set(range(10, 30))
    for spec in (pre, san):
        m = spec.base.model
        assert m.n_layers == 24 and m.block == "pure" and m.n_heads == 1
        assert spec.base.dtype == "float64" and spec.base.eval_at_init and spec.base.steps == 100
        causal = spec.search_space["model.causal"]
        assert causal.type == "categorical" and set(causal.choices) == {True, False}
        seed = spec.search_space["seed"]
        assert seed.type == "int" and seed.grid is not None and set(seed.grid) == fresh
    assert pre.base.model.norm == "pre" and pre.base.model.qk_init_std == 0.2
    assert san.base.model.norm == "none" and san.base.model.init_scheme == "token_scale"
    qk = san.search_space["model.qk_init_std"]
    assert qk.type == "float" and qk.grid == [0.2, 0.5]
    for path in DEFS:
        if path.name.startswith("repro_dong_growth"):
            continue
        seed = _spec(path.name).search_space.get("seed")
        if seed is not None and seed.type == "int" and seed.grid is not None:
            assert not fresh & {int(v) for v in seed.grid}, path.name


def _variety(spec: StudySpec, every_choice: bool) -> list[dict[str, Any]]:
    """Grid points to train: numbers at their largest grid value (depth capped at 3) and,
    with `every_choice`, each choice of the first categorical parameter once."""
    fixed: dict[str, Any] = {}
    cats: list[tuple[str, list[Any]]] = []
    for name, p in spec.search_space.items():
        if name == "seed":
            continue
        if p.type == "categorical":
            cats.append((name, list(p.choices)))
        elif p.type in ("float", "int"):
            values = p.grid if p.grid is not None else [p.high]
            fixed[name] = max(values) if name != "model.n_layers" else min(max(values), 3)
    if not cats or not every_choice:
        return [{**fixed, **{n: c[-1] for n, c in cats}}]
    name, choices = cats[0]
    return [{**fixed, **{n: c[0] for n, c in cats[1:]}, name: c} for c in choices]


def _reduced(config: TrialConfig) -> TrialConfig:
    """Same architecture switches and task kind, CPU-sized: a few steps of a tiny model."""
    task = config.task.model_copy(
        update={
            "seq_len": min(config.task.seq_len, 16),
            "vocab_cap": min(config.task.vocab_cap, 200),
            "max_train_tokens": 20_000 if config.task.kind == "lm" else None,
            "n_valid": min(config.task.n_valid, 16),
        }
    )
    if task.data_dir and not Path(task.data_dir).is_absolute():
        task = task.model_copy(update={"data_dir": str(DATA_ROOT / task.data_dir)})
    heads = min(config.model.n_heads, 2)
    model = config.model.model_copy(
        update={
            "n_layers": min(config.model.n_layers, 3),
            "n_heads": heads,
            "d_model": 16,
            "d_ff": 32,
            "d_ff_ratio": None,  # the shapes are fixed here: no width rule
            "head_dim": None,
        }
    )
    data = config.model_dump(by_alias=True)
    data.update(
        task=task.model_dump(),
        model=model.model_dump(),
        steps=2,
        eval_every=1,
        eval_batches=1,
        batch_size=4,
        probe_batch_size=2,
        device="cpu",
        dtype="float32",
    )
    data["optim"]["warmup_steps"] = min(config.optim.warmup_steps, 2)
    return TrialConfig.model_validate(data)


@pytest.mark.parametrize("path", REPRO, ids=[p.name for p in REPRO])
def test_reproduction_trains_at_reduced_size_on_cpu(path: Path, one_thread: None) -> None:
    """Each CPU reproduction trains every variant of its first categorical switch (one point
    for the GPU definitions) through `run_trial`, a few steps of a tiny model on the CPU."""
    spec = _spec(path.name)
    if spec.base.task.kind == "lm" and not (DATA_ROOT / "wikitext-2" / "valid.txt").is_file():
        pytest.skip("WikiText-2 not available (set QKSCOPE_DATA_DIR)")
    for params in _variety(spec, every_choice=path.name.startswith("repro_")):
        config = _reduced(apply_params(spec.base, params))
        summary = run_trial(config)
        assert summary.status in ("completed", "diverged"), (path.name, params)
        assert summary.steps_done >= 1 and summary.eval_steps, (path.name, params)
        if summary.status == "completed":
            assert summary.final_val_loss is not None and math.isfinite(summary.final_val_loss)
            assert summary.final_rank_ratio is not None
        if spec.base.eval_at_init:
            assert summary.init_rank_ratio is not None


def test_reproduction_studies_ship() -> None:
    """docs/reproductions.md reports these; the rank-collapse one measures at initialisation."""
    names = {p.name for p in DEFS}
    repro = {
        "repro_rank_collapse.yaml",
        "repro_localization.yaml",
        "repro_localization_long.yaml",
        "repro_localization_seeds.yaml",
        "repro_stable_search.yaml",
        "repro_rank_collapse_variants.yaml",
        "repro_localization_v2.yaml",
        "repro_entropy_collapse.yaml",
        "gpu_bao_wikitext2.yaml",
        "gpu_dong_depth.yaml",
        "repro_bao_target_mean.yaml",
        "repro_dong_mlp_scale.yaml",
    }
    assert repro <= names
    by_name = {p.name: parse_spec(p.read_bytes(), "application/yaml") for p in DEFS}
    rank = by_name["repro_rank_collapse.yaml"]
    assert rank.base.eval_at_init
    assert {"model.skip", "model.mlp", "model.n_layers"} <= set(rank.search_space)
    assert by_name["repro_stable_search.yaml"].constraints
    zhai = by_name["repro_entropy_collapse.yaml"]
    assert zhai.base.optim.warmup_steps == 0 and zhai.base.optim.schedule == "constant"
    assert {"optim.lr", "model.qk_norm", "regularizer.lambda"} <= set(zhai.search_space)


def test_issue_20_reruns_test_what_they_claim_to() -> None:
    """The non-zero-mean Bao rerun and the Dong MLP-scale rerun (issue 20)."""
    bao = _spec("repro_bao_target_mean.yaml")
    # one full-width head: the v2 minimum holds qk_eig_mean itself at the target
    assert bao.base.model.n_heads == 1 and bao.base.regularizer.kind == "locater"
    target = bao.search_space["regularizer.target_mean"]
    assert target.type == "float" and target.grid is not None and max(target.grid) > 0
    assert 0.0 in target.grid  # the shrinkage-only baseline at the same lambda and seed
    dong = _spec("repro_dong_mlp_scale.yaml")
    scale = dong.search_space["model.mlp_init_std"]
    assert scale.type == "float" and scale.grid is not None
    # from the GPT default to beyond 1/sqrt(d_model), where the MLP is far from the identity
    assert min(scale.grid) == 0.02 and max(scale.grid) > dong.base.model.d_model**-0.5
    block = dong.search_space["model.block"]
    assert block.type == "categorical" and "pure" in block.choices
    assert dong.base.eval_at_init and dong.base.model.norm == "post"
    for spec in (bao, dong):
        # every swept field but the architecture is per-member, so they fuse where it pays:
        # auto gives them 1 slot on CPU (each step keeps two cores busy) and 8 on a GPU
        assert spec.fuse == "auto" and spec.slots == 1
        on_gpu = spec.model_copy(
            update={"resources": spec.resources.model_copy(update={"gpus": 1.0})}
        )
        assert on_gpu.slots == 8


LADDER_ARMS = {
    "none": {},
    "qk_layernorm": {"model": {"qk_norm": "layernorm"}},
    "zloss": {"z_loss_coef": 0.0001},
}


def _without_name(definition: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in definition.items() if k not in ("name", "description")}


def _arm_of(control: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """The control's definition (without name and description) with an arm's base fields
    set: `over` maps a base key to a value, or to a dict merged into that section."""
    want = _without_name(control)
    want["base"] = {**want["base"], "model": {**want["base"]["model"]}}
    for k, v in over.items():
        if isinstance(v, dict):
            want["base"][k] = {**want["base"][k], **v}
        else:
            want["base"][k] = v
    return want


def test_stability_boundary_arms_differ_only_in_the_arm() -> None:
    """The three CPU ladders of reproductions.md section 8: widths 32..256 with the width rule,
    3 seeds, a grid reaching lr 10, and nothing but the arm's field (and name) differs."""
    import yaml

    raw = {a: yaml.safe_load((DEFS[0].parent / f"stability_boundary_{a}.yaml").read_text())
           for a in LADDER_ARMS}  # fmt: skip
    for arm, over in LADDER_ARMS.items():
        spec = _spec(f"stability_boundary_{arm}.yaml")
        assert spec.search_space["model.d_model"].grid == [32, 64, 128, 256]
        assert spec.base.model.d_ff_ratio and spec.base.model.head_dim == 32
        assert spec.base.eval_at_init and spec.base.steps >= 1000
        assert spec.stability is not None and spec.stability.bisect_factor == pytest.approx(
            math.sqrt(2)
        )
        assert _without_name(raw[arm]) == _arm_of(raw["none"], over), arm
    gpu = _spec("gpu_stability_boundary.yaml")
    assert gpu.base.device == "cuda" and max(gpu.search_space["model.d_model"].grid) >= 1024
    assert gpu.stability is not None and gpu.base.model.head_dim == 64


def test_instability_v5_arms_differ_only_in_the_arm() -> None:
    """Science v5 (reproductions.md section 9): 1,000 steps with a cosine to 1e-5, a grid to
    lr 10, fresh seeds 500-504, and nothing but the arm's field (and name) differs."""
    import yaml

    arms = {
        "none": {},
        "qk_layernorm": {"model": {"qk_norm": "layernorm"}},
        "zloss": {"z_loss_coef": 0.0001},
        "sigma_all": {"model": {"sigma_reparam": "all"}},
    }
    raw = {a: yaml.safe_load((DEFS[0].parent / f"instability_v5_{a}.yaml").read_text())
           for a in arms}  # fmt: skip
    for arm, over in arms.items():
        spec = _spec(f"instability_v5_{arm}.yaml")
        assert spec.base.steps == 1000 and spec.base.optim.warmup_steps == 100
        assert spec.base.optim.min_lr == pytest.approx(1e-5) and spec.base.eval_at_init
        assert spec.search_space["optim.lr"].grid[-1] == 10.0
        assert spec.search_space["seed"].grid == [500, 501, 502, 503, 504]
        assert _without_name(raw[arm]) == _arm_of(raw["none"], over), arm


def test_bao_fairseq_rerun_differs_only_in_the_init() -> None:
    """reproductions.md 5.6: section 5.5's four studies with fairseq's q, k, v init, nothing
    else changed (seeds, steps, arms, rules)."""
    import yaml

    for f in ("trainability", "trainability_controls", "nonzero_mean", "nonzero_mean_controls"):
        own = yaml.safe_load((DEFS[0].parent / f"repro_bao_own_{f}.yaml").read_text())
        fair = yaml.safe_load((DEFS[0].parent / f"repro_bao_fairseq_{f}.yaml").read_text())
        assert fair.pop("name") == own.pop("name").replace("-own-", "-fairseq-")
        assert fair["base"]["model"].pop("qkv_init") == "fairseq"
        assert fair == own, f

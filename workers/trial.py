"""One trial: train a small transformer with an eigenspectrum regularizer and probe it.

`run_trial(config, reporter)` is what a Ray worker runs. Every `eval_every`
steps it measures validation loss and, on a fixed probe batch, every metric of
docs/metrics.md per layer and head; hands them to the reporter (which may
answer "stop": that is how pruning works); and writes a checkpoint that a
rerun of the same config resumes from with the same result. A NaN/inf loss
ends the trial as `diverged`, with the metrics measured so far.

With `eval_at_init` the untrained model is measured too, once, as step 0 (the
"at initialisation" curves of Dong et al. 2021): reported like any evaluation,
kept in the checkpoint so a resumed trial never re-reports it, and summarised
in the `init_*` fields only, so every other summary field means the same with
or without it (an evaluation uses no randomness, so training is unchanged).

Run one from a shell: `python -m workers.trial CONFIG.yaml`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from workers import metrics as M
from workers.config import (
    CheckpointConfig,
    MetricPoint,
    OptimConfig,
    RegularizerConfig,
    TrialConfig,
    TrialStatus,
    TrialSummary,
)
from workers.model import GPT
from workers.regularizers import model_penalty
from workers.tasks import Task, build_task

NAN_CHECK_EVERY = 64
"""Steps between host reads of the on-device divergence flag (also read at every evaluation)."""

__all__ = [
    "CheckpointConfig",
    "MetricPoint",
    "NullReporter",
    "OptimConfig",
    "RegularizerConfig",
    "Reporter",
    "TrialConfig",
    "TrialSummary",
    "run_trial",
]


class Reporter(Protocol):
    """Receives each evaluation; returning True asks the trial to stop (pruning)."""

    def report(self, step: int, metrics: list[MetricPoint]) -> bool: ...


class NullReporter:
    def report(self, step: int, metrics: list[MetricPoint]) -> bool:
        return False


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def resolve_device(config: TrialConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available on this node")
    return torch.device(config.device)


def _autocast(config: TrialConfig, device: torch.device) -> AbstractContextManager[Any]:
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _lr_lambda(config: TrialConfig) -> Callable[[int], float]:
    warmup, total, schedule = config.optim.warmup_steps, config.steps, config.optim.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _optimizer(config: TrialConfig, model: GPT) -> torch.optim.Optimizer:
    """AdamW (fused kernel on CUDA, foreach on CPU) or SGD, from the trial's settings."""
    o = config.optim
    cuda = next(model.parameters()).device.type == "cuda"
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, weight_decay=o.weight_decay, foreach=not cuda or None
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.beta1, o.beta2),
        fused=True if cuda else None,
        foreach=None if cuda else True,
    )


def _penalty(model: GPT, reg: RegularizerConfig) -> Tensor:
    return model_penalty(model.qk_weights(), reg.kind, reg.target_mean)


def build_model(config: TrialConfig, task: Task) -> GPT:
    """The trial's model, initialised from the trial seed."""
    torch.manual_seed(config.seed)
    return GPT(config.model, vocab_size=task.vocab_size, seq_len=task.seq_len)


@torch.no_grad()
def probe_metrics(model: GPT, probe_x: Tensor) -> list[MetricPoint]:
    """Every docs/metrics.md quantity per layer (1..L; 0 = embeddings for rank) and head."""
    was_training = model.training
    model.eval()
    out = model.probe(probe_x)
    points: list[MetricPoint] = []
    for layer, attn in enumerate(out.attn, start=1):
        ent = M.attention_entropy(attn).tolist()
        norm_ent = M.normalized_attention_entropy(attn, causal=True).tolist()
        for h, (e, ne) in enumerate(zip(ent, norm_ent, strict=True)):
            points.append(MetricPoint("attn_entropy", e, layer, h))
            points.append(MetricPoint("attn_entropy_norm", ne, layer, h))
    for layer, hidden in enumerate(out.hidden):
        ratio = M.rank_collapse_ratio(hidden.float()).mean().item()
        points.append(MetricPoint("rank_ratio", ratio, layer))
    for layer, (w_q, w_k) in enumerate(model.qk_weights(), start=1):
        mean, var = M.qk_eigen_stats_factored(w_q.float(), w_k.float())
        for h, (m, v) in enumerate(zip(mean.tolist(), var.tolist(), strict=True)):
            points.append(MetricPoint("qk_eig_mean", m, layer, h))
            points.append(MetricPoint("qk_eig_var", v, layer, h))
    model.train(was_training)
    return points


@torch.no_grad()
def _val_loss(
    model: GPT, batches: list[tuple[Tensor, Tensor]], ctx: Any, dev: torch.device
) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with ctx:
            _, loss = model(x.to(dev), y.to(dev))
        assert loss is not None
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


def _init_points(
    model: GPT,
    val_batches: list[tuple[Tensor, Tensor]],
    ctx: Any,
    dev: torch.device,
    reg: RegularizerConfig,
    probe_x: Tensor,
) -> list[MetricPoint]:
    """The step-0 evaluation: validation loss, penalty and probe metrics; no train loss."""
    points = [MetricPoint("val_loss", _val_loss(model, val_batches, ctx, dev))]
    if reg.kind != "none" and reg.lam != 0.0:
        with torch.no_grad(), ctx:
            points.append(MetricPoint("reg_penalty", float(_penalty(model, reg))))
    return points + probe_metrics(model, probe_x)


@dataclass
class _History:
    """The per-evaluation numbers the summary is made from (kept in the checkpoint).

    `steps` .. `last_points` cover training evaluations only; `init_points` is the
    step-0 evaluation (None when `eval_at_init` is off or it has not run yet; a plain
    class default, so checkpoints written before the field existed still load).
    """

    steps: list[int]
    val_losses: list[float]
    train_losses: list[float]
    min_norm_entropies: list[float]
    last_points: list[MetricPoint]
    init_points: list[MetricPoint] | None = None

    @classmethod
    def empty(cls) -> _History:
        return cls([], [], [], [], [])


def _checkpoint_path(config: TrialConfig) -> Path | None:
    return Path(config.checkpoint.dir) / "checkpoint.pt" if config.checkpoint.dir else None


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic write: a crash mid-save leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


@dataclass(frozen=True)
class _PointStats:
    """The summary's reductions of one evaluation's metric points."""

    val_loss: float | None
    min_norm_entropy: float | None  # smallest over layers and heads
    rank_ratio: float | None  # last layer
    qk_eig_var: float | None  # mean over layers and heads
    qk_eig_mean: float | None


def _point_stats(points: list[MetricPoint]) -> _PointStats:
    by_name: dict[str, list[MetricPoint]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p)

    def mean_of(name: str) -> float | None:
        vals = [p.value for p in by_name.get(name, [])]
        return _finite(sum(vals) / len(vals)) if vals else None

    val = by_name.get("val_loss", [])
    norm_ent = [p.value for p in by_name.get("attn_entropy_norm", [])]
    ranks = sorted(by_name.get("rank_ratio", []), key=lambda p: p.layer or 0)
    return _PointStats(
        val_loss=_finite(val[0].value) if val else None,
        min_norm_entropy=_finite(min(norm_ent)) if norm_ent else None,
        rank_ratio=_finite(ranks[-1].value) if ranks else None,
        qk_eig_var=mean_of("qk_eig_var"),
        qk_eig_mean=mean_of("qk_eig_mean"),
    )


def _summarize(
    config: TrialConfig,
    task: Task,
    hist: _History,
    status: TrialStatus,
    steps_done: int,
    diverged_at: int | None,
    elapsed: float,
    device: torch.device,
) -> TrialSummary:
    s = TrialSummary(status=status, steps_done=steps_done, diverged_at_step=diverged_at)
    s.wall_time_s = elapsed
    s.tokens_per_s = steps_done * config.batch_size * task.seq_len / max(elapsed, 1e-9)
    s.device = str(device)
    s.eval_steps = list(hist.steps)
    s.val_losses = [_finite(v) for v in hist.val_losses]
    if hist.init_points is not None:
        init = _point_stats(hist.init_points)
        s.init_val_loss, s.init_min_norm_entropy = init.val_loss, init.min_norm_entropy
        s.init_rank_ratio, s.init_qk_eig_var = init.rank_ratio, init.qk_eig_var
    if not hist.steps:
        return s
    finite_vals = [v for v in hist.val_losses if math.isfinite(v)]
    s.final_train_loss = _finite(hist.train_losses[-1])
    s.final_val_loss = _finite(hist.val_losses[-1])
    s.best_val_loss = min(finite_vals) if finite_vals else None
    last = _point_stats(hist.last_points)
    s.min_norm_entropy = last.min_norm_entropy
    if any(p.name == "attn_entropy_norm" for p in hist.last_points):
        s.min_norm_entropy_ever = _finite(min(hist.min_norm_entropies))
    s.final_rank_ratio = last.rank_ratio
    s.qk_eig_var, s.qk_eig_mean = last.qk_eig_var, last.qk_eig_mean
    s.entropy_collapse = (
        s.min_norm_entropy is not None and s.min_norm_entropy < config.entropy_collapse_threshold
    )
    s.rank_collapse = (
        s.final_rank_ratio is not None and s.final_rank_ratio < config.rank_collapse_threshold
    )
    if len(finite_vals) == len(hist.val_losses):
        s.plateaus = M.detect_plateaus(
            hist.steps, hist.val_losses, config.plateau_window, config.plateau_rel_tol
        )
        stats = M.plateau_stats(s.plateaus, hist.steps[-1])
        s.plateau_count = stats["plateau_count"]
        s.plateau_steps = stats["plateau_steps"]
        s.longest_plateau = stats["longest_plateau"]
        s.trapped = M.is_trapped(
            s.plateaus,
            hist.steps[-1],
            hist.val_losses[-1],
            task.known_optimum,
            config.trapped_rel_gap,
        )
    return s


def run_trial(
    config: TrialConfig,
    reporter: Reporter | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> TrialSummary:
    """Train, probe every `eval_every` steps, report, checkpoint; return the summary.

    With `config.eval_at_init`, the untrained model is evaluated and reported first, as
    step 0 (no train loss or gradient norm exists yet); never again after a resume.
    """
    reporter = reporter or NullReporter()
    device = resolve_device(config)
    ctx = _autocast(config, device)
    task = build_task(config.task, config.seed)
    model = build_model(config, task).to(device)
    optimizer = _optimizer(config, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    data_gen = torch.Generator().manual_seed(config.seed)
    probe_x, _ = task.train_batch(
        config.probe_batch_size, torch.Generator().manual_seed(config.seed + 7919)
    )
    probe_x = probe_x.to(device)
    val_batches = task.valid_batches(config.batch_size)[: config.eval_batches]
    reg = config.regularizer
    hist, start_step, n_evals = _History.empty(), 0, 0

    ckpt = _checkpoint_path(config)
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data_gen.set_state(state["data_gen"])
        torch.set_rng_state(state["torch_rng"])
        hist, start_step, n_evals = state["history"], state["step"], state["n_evals"]

    def save_checkpoint() -> None:
        assert ckpt is not None
        _save_checkpoint(
            ckpt,
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "data_gen": data_gen.get_state(),
                "torch_rng": torch.get_rng_state(),
                "history": hist,
                "step": step,
                "n_evals": n_evals,
            },
        )

    model.train()
    status: TrialStatus = "completed"
    diverged_at: int | None = None
    step = start_step
    t0 = time.perf_counter()
    if config.eval_at_init and start_step == 0 and hist.init_points is None:
        # The untrained model, as step 0. Evaluation draws no randomness (eval mode, fixed
        # batches), so the training that follows is exactly the run without it.
        points = _init_points(model, val_batches, ctx, device, reg, probe_x)
        points.insert(1, MetricPoint("lr", float(scheduler.get_last_lr()[0])))
        hist.init_points = points
        stop = reporter.report(0, points)
        if not math.isfinite(points[0].value):
            status, diverged_at = "diverged", 0
        else:
            if ckpt is not None:  # a resume from here must not report step 0 again
                save_checkpoint()
            if stop:
                status = "pruned"
    # The step loop never waits for the device: losses and the gradient norm stay tensors
    # until an evaluation needs them, and a non-finite loss is folded into `first_bad` (the
    # first bad step, 0 = none) on the device, read every NAN_CHECK_EVERY steps and before
    # each evaluation. The trial then ends as diverged at exactly that step, as if it had
    # stopped there (steps trained past it on NaN are discarded: nothing is evaluated,
    # reported or checkpointed after a bad step).
    train_forward: Callable[..., tuple[Tensor, Tensor | None]] = (
        torch.compile(model) if config.compile else model  # type: ignore[assignment]
    )
    pin = device.type == "cuda"
    first_bad = torch.zeros((), dtype=torch.int64, device=device)
    clip = config.optim.grad_clip if config.optim.grad_clip is not None else float("inf")
    while status == "completed" and step < config.steps:
        x, y = task.train_batch(config.batch_size, data_gen)
        if pin:  # pinned + async copy: the next batch is drawn while the device computes
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ctx:
            _, loss = train_forward(x, y)
            assert loss is not None
            penalty = _penalty(model, reg) if reg.kind != "none" and reg.lam != 0.0 else None
        total = loss if penalty is None else loss + reg.lam * penalty.float()
        bad = ~(torch.isfinite(loss.detach()) & torch.isfinite(total.detach()))
        first_bad = torch.where(bad & (first_bad == 0), step + 1, first_bad)
        optimizer.zero_grad(set_to_none=True)
        total.backward()  # type: ignore[no-untyped-call]
        grad_norm_t = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        step += 1
        if progress is not None:
            progress(step)
        at_eval = step % config.eval_every == 0 or step == config.steps
        if at_eval or step % NAN_CHECK_EVERY == 0:
            bad_step = int(first_bad)
            if bad_step:
                status, diverged_at, step = "diverged", bad_step, bad_step - 1
                break
        if not at_eval:
            continue

        train_loss, grad_norm = float(loss.detach()), float(grad_norm_t)
        val = _val_loss(model, val_batches, ctx, device)
        points = [
            MetricPoint("train_loss", train_loss),
            MetricPoint("val_loss", val),
            MetricPoint("grad_norm", grad_norm),
            MetricPoint("lr", float(scheduler.get_last_lr()[0])),
        ]
        if penalty is not None:
            points.append(MetricPoint("reg_penalty", float(penalty.detach())))
        points += probe_metrics(model, probe_x)
        hist.steps.append(step)
        hist.val_losses.append(val)
        hist.train_losses.append(train_loss)
        hist.min_norm_entropies.append(
            min((p.value for p in points if p.name == "attn_entropy_norm"), default=math.nan)
        )
        hist.last_points = points
        n_evals += 1
        stop = reporter.report(step, points)
        if not math.isfinite(val):
            status, diverged_at = "diverged", step
            break
        if ckpt is not None and n_evals % config.checkpoint.every_evals == 0:
            save_checkpoint()
        if stop:
            status = "pruned"
            break

    elapsed = time.perf_counter() - t0
    return _summarize(
        config, task, hist, status, step - start_step, diverged_at, elapsed, device
    ).model_copy(update={"steps_done": step})


def load_config(path: str | Path) -> TrialConfig:
    """A TrialConfig from a YAML or JSON file."""
    import yaml

    return TrialConfig.model_validate(yaml.safe_load(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.trial CONFIG.yaml`: one trial with a progress bar, summary as JSON."""
    from tqdm import tqdm

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.trial CONFIG.yaml", file=sys.stderr)
        return 2
    config = load_config(args[0])
    with tqdm(total=config.steps, unit="step", file=sys.stderr) as bar:
        summary = run_trial(config, progress=lambda s: bar.update(s - bar.n))
    print(json.dumps(summary.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

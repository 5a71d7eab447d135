"""`model.init_scheme: token_scale` (workers/config_sections.py): the init of Dong et al.'s own network.

Dong et al.'s theorem is about pure self-attention with no LayerNorm. At GPT init (std 0.02
everywhere) such a network shrinks its tokens by ~0.013 a layer, so from the second layer on
every logit is ~0 and attention is uniform: the rank collapses in one step for a reason that
has nothing to do with the theorem's rate. `token_scale` rescales the same draws so that the
embedding has unit-variance entries and W_O W_V keeps a token's norm in expectation. Checked
here: the default is untouched, only the named weights change and by exactly the factor, the
token scale is kept through depth (against GPT init, which loses it), and a fused member
equals the same trial run alone.
"""

from __future__ import annotations

import math

import torch

from tests.workers.helpers import Recorder, assert_same_evaluations, tiny
from workers.fused import fusion_key, group_by_key, run_trial_group
from workers.model import GPT, Block, ModelConfig
from workers.trial import run_trial

VOCAB, SEQ, D = 24, 12, 32


def _model(seed: int = 0, **kw: object) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig.model_validate(
        {"n_layers": 8, "n_heads": 1, "d_model": D, "d_ff": 64, "block": "pure", "norm": "none"}
        | kw
    )
    return GPT(cfg, vocab_size=VOCAB, seq_len=SEQ).double()


def test_the_default_is_gpt_and_token_scale_rescales_only_embeddings_values_and_outputs() -> None:
    gpt, scaled = _model(seed=3), _model(seed=3, init_scheme="token_scale")
    assert gpt.cfg.init_scheme == "gpt"
    a, b = gpt.state_dict(), scaled.state_dict()
    assert a.keys() == b.keys()
    factors = {"tok_emb": math.sqrt(0.5) / 0.02, "pos_emb": math.sqrt(0.5) / 0.02}
    factors |= {"v_proj": 1 / (math.sqrt(D) * 0.02), "out_proj": 1 / (math.sqrt(D) * 0.02)}
    changed = 0
    for name, t in a.items():
        f = next((v for k, v in factors.items() if k in name), None)
        if name == "head.weight":  # tied to the token embedding
            f = factors["tok_emb"]
        if f is None:
            assert torch.equal(b[name], t), name  # QK, norms: the same draws, untouched
        else:
            torch.testing.assert_close(b[name], t * f, rtol=1e-6, atol=0.0)  # float32 draws
            changed += 1
    assert changed == 2 + 1 + 2 * 8  # embeddings, the tied head, v and out of 8 layers
    assert scaled.head.weight is scaled.tok_emb.weight


def test_token_scale_gives_unit_entries_and_keeps_the_scale_through_depth() -> None:
    """Mean token norm after each of 8 pure-attention layers without LayerNorm, relative to
    the embedding's. GPT init loses it (about 0.013 a layer: below 1e-10 after 8 layers).
    token_scale keeps it: the first layers average the tokens towards their mean (the rank
    collapse itself: the mean of 12 random tokens has about 1/sqrt(12) of a token's norm),
    and from then on each layer keeps the norm within a factor 1.5 of the layer before."""
    idx = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    for scheme in ("gpt", "token_scale"):
        model = _model(seed=1, init_scheme=scheme, qk_init_std=0.2, causal=False)
        hidden = model.probe(idx).hidden
        norms = [h.norm(dim=-1).mean().item() for h in hidden]
        rel = [n / norms[0] for n in norms]
        if scheme == "gpt":
            assert rel[-1] < 1e-10, rel
        else:
            entries = hidden[0].flatten()
            assert 0.8 < entries.std().item() < 1.2  # unit-variance entries
            steps = [b / a for a, b in zip(norms[2:], norms[3:], strict=False)]
            assert all(1 / 1.5 < f < 1.5 for f in steps), rel
            assert rel[-1] > 0.1, rel


def test_token_scale_members_share_a_fused_group_and_match_alone() -> None:
    """An init scale only: a token_scale member and a GPT-init member fuse, each equal to the
    same trial run alone (float64, pure attention without LayerNorm, bidirectional)."""
    model = {"block": "pure", "norm": "none", "causal": False, "qk_init_std": 0.2}
    configs = [
        tiny(seed=0, dtype="float64", model=model),
        tiny(seed=1, dtype="float64", model={**model, "init_scheme": "token_scale"}),
    ]
    assert fusion_key(configs[0]) == fusion_key(configs[1])
    assert group_by_key(configs, max_size=2) == [[0, 1]]
    alone = [Recorder(), Recorder()]
    singles = [run_trial(c, r) for c, r in zip(configs, alone, strict=True)]
    fused = [Recorder(), Recorder()]
    run_trial_group(configs, fused)
    for a, f in zip(alone, fused, strict=True):
        assert_same_evaluations(a, f)
    assert singles[0].final_val_loss != singles[1].final_val_loss


def test_block_layers_are_rescaled_in_every_block() -> None:
    model = _model(seed=0, init_scheme="token_scale")
    for block in model.blocks:
        assert isinstance(block, Block)
        std = block.attn.v_proj.weight.std().item()
        assert abs(std - 1 / math.sqrt(D)) < 0.3 / math.sqrt(D)

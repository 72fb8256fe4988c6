"""eyas <-> speculators, with speculators' own classes on CPU (the real peer, DESIGN 8).

Forward logits are compared in fp32 with atol 1e-5 (the two implementations order the same
float ops differently: fused vs split RMSNorm, sdpa masks), and the draft argmax must agree.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from eyas.core.drafter import Eagle3Drafter, causal_attend
from eyas.formats import checkpoint as ck
from eyas.formats import engines as E

spec = pytest.importorskip("speculators.models.eagle3")
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402

from test_formats import AUX, N_DRAFT, make_drafter  # noqa: E402

ATOL = 1e-5
T = 12


def features(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    return aux, ids, torch.arange(T)[None]


def speculators_logits(model, aux, ids, pos) -> torch.Tensor:
    """Step-0 logits from speculators' own forward (captured at its lm_head)."""
    got = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos, ttt_steps=1)
    finally:
        h.remove()
    return got[0]


def eyas_logits(drafter: Eagle3Drafter, aux, ids, pos) -> torch.Tensor:
    with torch.no_grad():
        return drafter.logits(drafter.layer(drafter.fuse(aux), ids, pos, causal_attend))


def load_speculators(path: Path):
    cfg = Eagle3SpeculatorConfig.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention is GPU-oriented
    return Eagle3DraftModel.from_pretrained(path, config=cfg).eval()


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"fc_norm": True}])
def test_speculators_loads_eyas_export_with_equal_logits(flags, tiny_target, tmp_path):
    d = make_drafter(tiny_target, **flags)
    if flags.get("fc_norm"):
        with torch.no_grad():
            for n in d.fc_norm:
                n.weight.normal_(1.0, 0.2)
    ck.save_checkpoint(tmp_path / "ey", d, {})
    out = tmp_path / "sp"
    out.mkdir()
    E.export_checkpoint(tmp_path / "ey", "speculators", out, target=tiny_target)
    model = load_speculators(out)
    assert model.config.eagle_aux_hidden_state_layer_ids == AUX
    assert torch.equal(model.d2t, d.d2t) and torch.equal(model.t2d, d.t2d)
    assert torch.equal(model.lm_head.weight, d.lm_head.weight)  # the trained head, not the verifier's rows
    drafter, _ = ck.load_checkpoint(tmp_path / "ey", E.target_embedding(tiny_target)[0])
    aux, ids, pos = features(d.cfg)
    a, b = speculators_logits(model, aux, ids, pos), eyas_logits(drafter, aux, ids, pos)
    assert a.shape == b.shape == (1, T, N_DRAFT)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def train_speculators_drafter(target: Path, out: Path, norm_before_residual: bool) -> Eagle3DraftModel:
    """Build, train 3 steps and save a tiny drafter with speculators' own classes (CPU recipe)."""
    from transformers import AutoConfig

    vcfg = AutoConfig.from_pretrained(target)
    layer_cfg = copy.deepcopy(vcfg)
    layer_cfg.num_hidden_layers = 1  # one EAGLE-3 layer (it builds one per verifier layer otherwise)
    V = vcfg.vocab_size
    chosen = torch.arange(1, V, 4)[:N_DRAFT]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(N_DRAFT)
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target), draft_vocab_size=N_DRAFT,
        norm_before_residual=norm_before_residual, ttt_steps=2, target_layer_ids=AUX, draft_attn_impl="sdpa")
    loss_cfg = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        aux = torch.randn(1, T, 3 * vcfg.hidden_size, generator=g)
        last = torch.randn(1, T, vcfg.hidden_size, generator=g)
        ids = torch.randint(0, V, (1, T), generator=g)
        _, loss, _ = model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids),
                           loss_mask=torch.ones_like(ids), verifier_last_hidden_states=last, ttt_steps=2,
                           loss_config=loss_cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_trained_drafter_imports_with_equal_logits(nbr, tiny_target, tmp_path, eyas_cli):
    model = train_speculators_drafter(tiny_target, tmp_path / "spec", nbr)
    assert E.detect_layout(tmp_path / "spec") == "speculators"
    code, _, err = eyas_cli("convert", tmp_path / "spec", "--to", "eyas", "--out", tmp_path / "ey")
    assert code == 0, err
    drafter, _ = ck.load_checkpoint(tmp_path / "ey", E.target_embedding(tiny_target)[0])
    assert drafter.cfg.aux_layer_ids == AUX and drafter.cfg.norm_before_residual is nbr
    aux, ids, pos = features(drafter.cfg)
    a, b = speculators_logits(model, aux, ids, pos), eyas_logits(drafter, aux, ids, pos)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    # What each engine would make of the speculators directory itself
    assert E.static_check(tmp_path / "spec", "speculators", expected=drafter.cfg, target=tiny_target) == []
    assert E.static_check(tmp_path / "spec", "vllm", expected=drafter.cfg, target=tiny_target) == []
    code, _, err = eyas_cli("convert", tmp_path / "spec", "--to", "sglang", "--out", tmp_path / "sg")
    assert (code == 1 and "norm_before_residual" in err) if nbr else code == 0


def test_speculators_sharded_save_reads_like_one_file(tiny_target, tmp_path, eyas_cli):
    """speculators' own `save_pretrained(max_shard_size=...)` writes Hugging Face shards and an
    index; eyas imports them to the same logits as the peer's model, and doctor reads them."""
    model = train_speculators_drafter(tiny_target, tmp_path / "one", False)
    model.save_pretrained(tmp_path / "sh", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sh").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sh" / "model.safetensors.index.json").is_file(), shards
    code, _, err = eyas_cli("convert", tmp_path / "sh", "--to", "eyas", "--out", tmp_path / "ey")
    assert code == 0, err
    drafter, _ = ck.load_checkpoint(tmp_path / "ey", E.target_embedding(tiny_target)[0])
    aux, ids, pos = features(drafter.cfg)
    torch.testing.assert_close(speculators_logits(model, aux, ids, pos), eyas_logits(drafter, aux, ids, pos),
                               atol=ATOL, rtol=0)
    code, out, err = eyas_cli("doctor", tmp_path / "sh", "--target", tiny_target, "--json")
    assert code in (0, 1), err
    assert json.loads(out)["layout"] == "speculators"
    code, out, err = eyas_cli("vocab", "compare", tmp_path / "sh", tmp_path / "one", "--json")
    assert code == 0 and json.loads(out)["identical"], err

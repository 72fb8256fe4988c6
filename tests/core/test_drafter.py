"""The drafter model and the eyas checkpoint format."""

import json

import pytest
import torch

from eyas import targets
from eyas.core.drafter import DrafterConfig, Eagle3Drafter, causal_attend
from eyas.errors import EyasError
from eyas.formats.checkpoint import load_checkpoint, read_tensors, save_checkpoint

ENGINE_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


def make(tiny_target, **kw):
    tcfg = targets.load_config(tiny_target)
    cfg = DrafterConfig.from_target(tcfg, 64, [1, 2, 3], **kw)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.d2t.copy_(torch.arange(64) * 2 - torch.arange(64))  # target ids 0, 2, 4, ...
    d.t2d[torch.arange(64) * 2] = True
    return d


def test_engine_names_and_shapes(tiny_target):
    d = make(tiny_target)
    sd = d.trainable_state_dict()
    assert set(sd) == ENGINE_KEYS
    H = d.cfg.hidden_size
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["lm_head.weight"].shape == (64, H)
    assert d.draft_to_target(torch.tensor([0, 1, 63])).tolist() == [0, 2, 126]


def test_random_embedding_and_narrow_features_refused(tiny_target):
    d = make(tiny_target)
    H = d.cfg.hidden_size
    with pytest.raises(RuntimeError, match="embedding is still random"):
        d.layer(torch.zeros(1, 2, H), torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], causal_attend)
    with pytest.raises(ValueError, match="fc expects"):  # the engines' silent fc bypass, refused here
        d.fuse(torch.zeros(1, 2, H))


def test_rope_matches_transformers(tiny_target):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    d = make(tiny_target)
    pos = torch.arange(7)[None]
    x = torch.zeros(1, 7, 8)
    cos_ref, sin_ref = model.model.rotary_emb(x, pos)
    cos, sin = d.rope_cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref)
    torch.testing.assert_close(sin, sin_ref)


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "fc_norm": True},
                                   {"norm_before_fc": True, "norm_output": True}])
def test_checkpoint_round_trip_same_logits(tiny_target, tmp_path, flags):
    model, _ = targets.load(tiny_target)
    emb = model.get_input_embeddings().weight
    d = make(tiny_target, **flags)
    d.load_target_embedding(emb)
    aux = torch.randn(1, 5, 3 * d.cfg.target_hidden_size)
    ids = torch.randint(0, 200, (1, 5))
    pos = torch.arange(5)[None]
    want = d.logits(d.layer(d.fuse(aux), ids, pos, causal_attend))
    save_checkpoint(tmp_path / "ck", d, {"note": "test"})
    d2, meta = load_checkpoint(tmp_path / "ck", target_embedding=emb)
    assert meta == {"note": "test"}
    torch.testing.assert_close(d2.logits(d2.layer(d2.fuse(aux), ids, pos, causal_attend)), want, rtol=0, atol=0)
    assert "embed_tokens.weight" not in read_tensors(tmp_path / "ck" / "model.safetensors")


def test_aux_gain_folds_into_fc_exactly(tiny_target, tmp_path):
    """A drafter training on aux * gain saves fc.weight * gain: the checkpoint (gain 1, the
    layout engines serve) computes bit for bit what the training drafter computed, in fp32
    and under bf16 autocast; set_aux_gain(keep_function=True) changes nothing either."""
    from eyas.core.drafter import aux_gain_from_rms

    model, _ = targets.load(tiny_target)
    emb = model.get_input_embeddings().weight
    d = make(tiny_target)
    d.load_target_embedding(emb)
    n = 3 * d.cfg.target_hidden_size
    scale = torch.ones(n)
    scale[5], scale[70], scale[150] = 1700.0, 0.3, 40.0  # SmolLM2-like outlier channels
    aux = torch.randn(2, 6, n) * scale
    ids, pos = torch.randint(0, 200, (2, 6)), torch.arange(6)[None].expand(2, 6)
    gain = aux_gain_from_rms(aux.pow(2).mean((0, 1)).sqrt())
    assert set(torch.log2(gain).tolist()) <= set(float(k) for k in range(-20, 20))  # powers of two
    assert gain[5] == 2.0 ** -11 and gain[70] == 2.0 ** 2
    d.set_aux_gain(gain, keep_function=False)
    assert d.gained and not torch.equal(d.trainable_state_dict()["fc.weight"], d.fc.weight)

    def out(m):
        return m.logits(m.layer(m.fuse(aux), ids, pos, causal_attend))

    want = out(d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want16 = out(d)
    save_checkpoint(tmp_path / "ck", d, {})
    d2, _ = load_checkpoint(tmp_path / "ck", target_embedding=emb)
    assert not d2.gained
    torch.testing.assert_close(out(d2), want, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(out(d2), want16, rtol=0, atol=0)
    d2.set_aux_gain(gain, keep_function=True)  # --init-from: same function, Adam in gained coordinates
    torch.testing.assert_close(out(d2), want, rtol=0, atol=0)
    torch.testing.assert_close(d2.fc.weight, d.fc.weight, rtol=0, atol=0)


def test_aux_gain_does_not_amplify_dead_channels():
    from eyas.core.drafter import aux_gain_from_rms

    rms = torch.tensor([4.0, 4.0, 4.0, 0.0, 1e-9, 1700.0])
    g = aux_gain_from_rms(rms)
    assert g[:3].tolist() == [0.25] * 3 and g[5] == 2.0 ** -11
    assert g[3] == g[4] == 16.0  # median/64 = 1/16: quiet channels get at most that gain


def test_checkpoint_bad_inputs(tiny_target, tmp_path):
    d = make(tiny_target)
    save_checkpoint(tmp_path / "ck", d, {})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["draft_vocab_size"] = 65
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match="has shape .* config.json implies"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text("{")
    with pytest.raises(EyasError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(EyasError, match="not a readable safetensors"):
        read_tensors(tmp_path / "ck" / "model.safetensors")


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
     "original_max_position_embeddings": 256, "attention_factor": 1.3},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3],
     "long_factor": [2.0, 3.0, 4.0, 5.0], "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
])
def test_rope_matches_the_targets_own(rope):
    """The drafter's RoPE table (inv_freq and attention scaling) is the one transformers builds for
    the target config: yarn's attention factor and betas and longrope's factors are carried over."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    tcfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, intermediate_size=64, vocab_size=50,
                       max_position_embeddings=1024, rope_parameters=dict(rope))
    ref = LlamaRotaryEmbedding(tcfg)
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, 10, [1, 2, 3]))
    torch.testing.assert_close(d.inv_freq, ref.inv_freq)
    assert d.attention_scaling == pytest.approx(ref.attention_scaling)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "gemma", "qwen3"])
def test_drafter_trains_and_serves_on_each_family(kind, tiny_targets, other_target):
    """The drafter sized from each family's config (Qwen2 biases, Mistral, Gemma's head_dim and
    activation, Qwen3's q/k norms in the target) trains with the TTT loss on the target's own
    greedy text and is then accepted when served, with output identical to plain decoding."""
    from tiny import train_tiny_drafter

    from eyas import runtime

    tdir = tiny_targets[kind] if kind in tiny_targets else other_target(kind)
    d, ids = train_tiny_drafter(tdir, steps=60)
    model, _ = targets.load(tdir)
    loaded = runtime.LoadedDrafter(d.eval(), list(d.cfg.aux_layer_ids), True, "strict",
                                   torch.arange(d.cfg.draft_vocab_size) + d.d2t, "eyas", [])
    tr, dr = runtime.runners(model, loaded, runtime.Timer("cpu"))
    accepted, steps = 0, 0
    for row in ids[:4]:
        s = runtime.DecodeSettings(method="chain", k=3, max_new_tokens=20)
        res = runtime.generate(tr, dr, row[:5], s)
        plain = runtime.generate(tr, None, row[:5], runtime.DecodeSettings(method="plain", max_new_tokens=20))
        assert res.tokens == plain.tokens, kind
        accepted, steps = accepted + sum(res.accepted), steps + res.steps
    assert accepted / steps > 0.5, (kind, accepted, steps)

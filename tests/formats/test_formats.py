"""Engine layouts (eyas.formats.engines) and `eyas export` / `eyas convert`.

SGLang and vLLM cannot be installed here, so the tests pin the exact keys, shapes and config
fields their loaders read, as checked in:
- SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
- vLLM vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190,
  vllm/transformers_utils/configs/speculators/algos.py @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.core import vocab as cv
from eyas.core.drafter import DrafterConfig, Eagle3Drafter, causal_attend
from eyas.errors import EyasError
from eyas.formats import checkpoint as ck
from eyas.formats import engines as E

N_DRAFT = 64
AUX = [1, 2, 3]  # HF index on the 4-layer tiny target


def make_drafter(target: Path, aux=AUX, seed: int = 0, **overrides) -> Eagle3Drafter:
    """A random drafter for `target` with non-trivial norms and a valid draft vocabulary."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target)
    cfg = DrafterConfig.from_target(tcfg, N_DRAFT, aux, **overrides)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    ids = torch.arange(0, tcfg.vocab_size, 3)[:N_DRAFT]
    with torch.no_grad():
        d.d2t.copy_(cv.d2t_from_ids(ids))
        d.t2d.copy_(cv.t2d_from_ids(ids, tcfg.vocab_size))
        for name, p in d.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return d


def logits_of(cfg: DrafterConfig, state: dict, target: Path, seed: int = 1) -> torch.Tensor:
    """Step-0 logits of a drafter built from (cfg, state) on fixed random features."""
    emb, _ = E.target_embedding(target)
    d = Eagle3Drafter(cfg)
    d.load_state_dict(state, strict=False)
    d.load_target_embedding(emb)
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 9, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        return d.logits(d.layer(d.fuse(aux), ids, pos, causal_attend))


@pytest.fixture(scope="module")
def eyas_ckpt(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "drafter"
    ck.save_checkpoint(out, make_drafter(tiny_target), {"note": "test"})
    return out


def export(src: Path, fmt: str, out: Path, target=None) -> Path:
    out.mkdir(parents=True)
    E.export_checkpoint(src, fmt, out, target=target)
    return out


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("fmt", E.ENGINES)
def test_eyas_to_engine_to_eyas_is_exact(fmt, eyas_ckpt, tiny_target, tmp_path):
    cfg0, st0, _ = E.import_checkpoint(eyas_ckpt)
    out = export(eyas_ckpt, fmt, tmp_path / fmt, target=tiny_target)
    assert E.detect_layout(out) == fmt
    cfg1, st1, meta = E.import_checkpoint(out)
    assert cfg1 == cfg0  # sizes, rope, flags, and aux ids in HF index form
    assert cfg1.aux_layer_ids == AUX
    assert sorted(st1) == sorted(st0)
    for k in st0:
        assert st1[k].dtype == st0[k].dtype and torch.equal(st1[k], st0[k]), k
    assert torch.equal(logits_of(cfg1, st1, tiny_target), logits_of(cfg0, st0, tiny_target))
    assert E.static_check(out, fmt, expected=cfg0, target=tiny_target) == []


@pytest.mark.parametrize("fmt", E.ENGINES)
def test_engine_to_eyas_to_engine_keeps_every_field(fmt, eyas_ckpt, tiny_target, tmp_path):
    a = export(eyas_ckpt, fmt, tmp_path / "a", target=tiny_target)
    cfg, st, _ = E.import_checkpoint(a)
    (tmp_path / "e").mkdir()
    E.write_layout(cfg, st, "eyas", tmp_path / "e")
    cfg2, st2, _ = E.import_checkpoint(tmp_path / "e")
    (tmp_path / "b").mkdir()
    E.write_layout(cfg2, st2, fmt, tmp_path / "b", target=tiny_target)
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, tmp_path / "b"))
    assert ca == cb
    wa, wb = (E.read_dir(d)[1] for d in (a, tmp_path / "b"))
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bf16_checkpoint_keeps_dtype(tiny_target, tmp_path):
    ck.save_checkpoint(tmp_path / "bf", make_drafter(tiny_target), {}, dtype=torch.bfloat16)
    out = export(tmp_path / "bf", "sglang", tmp_path / "sg")
    w = load_file(out / "model.safetensors")
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# ------------------------------------------------------------------ what each engine's loader reads


LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "hidden_norm.weight", "post_attention_layernorm.weight"]


def test_sglang_export_has_exactly_what_llama_eagle3_reads(eyas_ckpt, tmp_path):
    out = export(eyas_ckpt, "sglang", tmp_path / "sg")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]  # its EntryClass
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False  # tied -> lm_head = embedding
    assert c["draft_vocab_size"] == N_DRAFT and c["vocab_size"] == 259 and c["hidden_size"] == 64
    assert "target_hidden_size" not in c  # only where it differs
    # SGLang convention: HF index minus one; llama.py set_eagle3_layers_to_capture adds one back
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert c["rope_theta"] == 10000.0 and c["rms_norm_eps"] == 1e-6 and c["head_dim"] == 16
    w = load_file(out / "model.safetensors")
    assert sorted(w) == sorted([f"midlayer.{k}" for k in LAYER] + ["fc.weight", "norm.weight", "lm_head.weight",
                                                                    "d2t", "t2d"])
    assert w["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # qkv input 2 * hidden
    assert w["fc.weight"].shape == (64, 3 * 64)  # fc: hidden_size_in * 3
    assert w["lm_head.weight"].shape == (N_DRAFT, 64)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    hot = w["d2t"] + torch.arange(N_DRAFT)  # SGLang: hot_token_id = d2t + arange
    assert torch.equal(hot, torch.nonzero(w["t2d"]).flatten())


def test_vllm_export_has_exactly_what_eagle3_llama_reads(eyas_ckpt, tmp_path):
    out = export(eyas_ckpt, "vllm", tmp_path / "vl")
    c = json.loads((out / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == AUX  # top-level, HF index, used as given
    assert c["norm_before_residual"] is False  # explicit (its speculators path defaults to True)
    assert "eagle_config" not in c and c["draft_vocab_size"] == N_DRAFT and c["num_hidden_layers"] == 1
    w = load_file(out / "model.safetensors")
    # midlayer. -> layers.0.; d2t -> draft_id_to_target_id; t2d skipped; anything else is a KeyError
    assert sorted(w) == sorted([f"midlayer.{k}" for k in LAYER] + ["fc.weight", "norm.weight", "lm_head.weight",
                                                                    "d2t", "t2d"])


def test_embedding_included_when_hidden_sizes_differ(tiny_target, tmp_path):
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(tiny_target)
    d = make_drafter(tiny_target, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16)
    assert d.cfg.target_hidden_size == 64 and d.cfg.hidden_size == 32
    ck.save_checkpoint(tmp_path / "small", d, {})
    (tmp_path / "x").mkdir()
    with pytest.raises(EyasError, match="needs --target"):
        E.export_checkpoint(tmp_path / "small", "vllm", tmp_path / "x")
    # A 32-wide drafter cannot use the 64-wide target embedding: eyas refuses the mismatch.
    with pytest.raises(EyasError, match="embedding"):
        E.export_checkpoint(tmp_path / "small", "vllm", tmp_path / "x", target=tiny_target)
    assert tcfg.hidden_size == 64


def test_embedding_written_from_target(tiny_target, tmp_path):
    d = make_drafter(tiny_target)
    cfg = replace_cfg(d.cfg, target_hidden_size=96)
    st = {k: v for k, v in d.trainable_state_dict().items()}
    st["fc.weight"] = torch.randn(64, 3 * 96)
    (tmp_path / "v").mkdir()
    E.write_layout(cfg, st, "vllm", tmp_path / "v", target=tiny_target)
    c = json.loads((tmp_path / "v" / "config.json").read_text())
    w = load_file(tmp_path / "v" / "model.safetensors")
    emb, _ = E.target_embedding(tiny_target)
    assert c["target_hidden_size"] == 96 and torch.equal(w["embed_tokens.weight"], emb)
    # 96 is not this target's hidden size: the only problem static_check finds
    problems = E.static_check(tmp_path / "v", "vllm", expected=cfg, target=tiny_target)
    assert len(problems) == 1 and "target_hidden_size is 96" in problems[0], problems


def replace_cfg(cfg: DrafterConfig, **kw) -> DrafterConfig:
    return DrafterConfig.from_dict({**cfg.to_dict(), **kw})


# ------------------------------------------------------------------ engine readings


def test_layers0_file_in_sglang_runs_random_weights(eyas_ckpt, tmp_path):
    """Seed failure 1: `layers.0.*` read by SGLang is dropped silently and the layer stays random."""
    out = export(eyas_ckpt, "sglang", tmp_path / "sg")
    w = load_file(out / "model.safetensors")
    save_file({(k.replace("midlayer.", "layers.0.")): v for k, v in w.items()}, str(out / "model.safetensors"))
    r = E.engine_reading(out, "sglang")
    assert set(r.missing) == {f"midlayer.{k}" for k in LAYER}
    assert set(r.skipped) == {f"layers.0.{k}" for k in LAYER}
    r = E.engine_reading(out, "vllm")  # vLLM maps layers.0.* natively
    assert r.missing == [] and r.errors == []


def test_aux_id_conventions(eyas_ckpt, tiny_target, tmp_path):
    sg = export(eyas_ckpt, "sglang", tmp_path / "sg")
    assert E.engine_reading(sg, "sglang").aux_layer_ids_hf == AUX
    # first SGLang id is 0, not 1: newer SGLang would use [0, 1, 2] as given
    assert any("newer SGLang" in n and "[0, 1, 2]" in n for n in E.engine_reading(sg, "sglang").notes)
    # vLLM 0.32 (gpu_model_runner._get_eagle3_aux_layers_from_config) reads eagle_config's ids as given
    # when the top-level field is absent: SGLang's stored HF-index-minus-one ids, one layer off
    r = E.engine_reading(sg, "vllm", tiny_target)
    off = [i - 1 for i in AUX]
    assert r.aux_layer_ids_hf == off and r.aux_source == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert any(str(off) in p for p in E.static_check(sg, "vllm", target=tiny_target))


def test_default_aux_layers_agree_across_sglang_versions(tiny_target, tmp_path):
    d = make_drafter(tiny_target, aux=[2, 2, 1])  # the default for L=4, first SGLang id 1
    ck.save_checkpoint(tmp_path / "d", d, {})
    sg = export(tmp_path / "d", "sglang", tmp_path / "sg")
    r = E.engine_reading(sg, "sglang")
    assert r.aux_layer_ids_hf == [2, 2, 1] and not any("newer SGLang" in n for n in r.notes)


def test_use_aux_false_and_vllm_speculators_default(eyas_ckpt, tmp_path):
    sg = export(eyas_ckpt, "sglang", tmp_path / "sg")
    c = json.loads((sg / "config.json").read_text())
    c["eagle_config"]["use_aux_hidden_state"] = False
    (sg / "config.json").write_text(json.dumps(c))
    assert E.engine_reading(sg, "sglang").use_aux is False
    assert any("use_aux_hidden_state" in p for p in E.static_check(sg, "sglang"))


def test_vllm_reads_speculators_config_without_flag_as_norm_before_residual(eyas_ckpt, tiny_target, tmp_path):
    sp = export(eyas_ckpt, "speculators", tmp_path / "sp", target=tiny_target)
    c = json.loads((sp / "config.json").read_text())
    del c["norm_before_residual"]
    (sp / "config.json").write_text(json.dumps(c))
    r = E.engine_reading(sp, "vllm")
    assert r.config.norm_before_residual is True
    assert any("norm_before_residual" in p for p in E.static_check(sp, "vllm"))


def test_engine_reading_of_absolute_d2t_is_flagged(eyas_ckpt, tmp_path):
    sg = export(eyas_ckpt, "sglang", tmp_path / "sg")
    w = load_file(sg / "model.safetensors")
    w["d2t"] = w["d2t"] + torch.arange(N_DRAFT)  # absolute ids instead of offsets
    save_file(w, str(sg / "model.safetensors"))
    r = E.engine_reading(sg, "sglang")
    assert r.d2t_as_offsets and any("offsets" in n for n in r.notes)


# ------------------------------------------------------------------ CLI


def test_cli_export_picks_best_then_final(eyas_cli, eyas_ckpt, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eyas_ckpt, run / "final")
    code, out, _ = eyas_cli("export", run, "--to", "sglang", "--out", tmp_path / "o1", "--json")
    assert code == 0 and "final/" in json.loads(out)["picked"]
    shutil.copytree(eyas_ckpt, run / "best")
    code, out, _ = eyas_cli("export", run, "--to", "sglang", "--out", tmp_path / "o2", "--json")
    s = json.loads(out)
    assert code == 0 and "best/" in s["picked"] and s["problems"] == [] and s["aux_layer_ids_hf"] == AUX
    code, _, err = eyas_cli("export", run, "--to", "sglang", "--out", tmp_path / "o2")
    assert code == 2 and "--force" in err


def test_cli_convert_chain(eyas_cli, eyas_ckpt, tiny_target, tmp_path):
    code, _, err = eyas_cli("convert", eyas_ckpt, "--to", "speculators", "--out", tmp_path / "sp",
                            "--target", tiny_target)
    assert code == 0, err
    code, _, err = eyas_cli("convert", tmp_path / "sp", "--to", "eagle", "--out", tmp_path / "eg")
    assert code == 0, err
    assert (tmp_path / "eg" / "pytorch_model.bin").is_file()
    code, out, err = eyas_cli("convert", tmp_path / "eg", "--to", "eyas", "--out", tmp_path / "back", "--json")
    assert code == 0, err
    assert json.loads(out)["from"] == "eagle"
    d, _ = ck.load_checkpoint(tmp_path / "back")
    d0, _ = ck.load_checkpoint(eyas_ckpt)
    assert d.cfg == d0.cfg
    assert all(torch.equal(v, d0.trainable_state_dict()[k]) for k, v in d.trainable_state_dict().items())


@pytest.mark.parametrize("kind", ["falcon", "gpt_neox"])
def test_targets_with_other_names_train_and_convert(kind, other_target, eyas_cli, tmp_path, monkeypatch):
    """Falcon names its MLP width `ffn_hidden_size`, and Falcon and GPT-NeoX their embeddings
    `word_embeddings` / `embed_in`: train sizes the drafter from the first (it stopped with an
    AttributeError), convert finds the second (it exited 2 blaming the target)."""
    from transformers import AutoModelForCausalLM

    target = other_target(kind)
    monkeypatch.setenv("EYAS_NO_PROGRESS", "1")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"explain step {i}"},
                                                      {"role": "assistant", "content": f"the answer is {i} plus two"}]})
                             + "\n" for i in range(6)))
    for argv in (("data", "prepare", "--target", target, "--input", chats, "--out", tmp_path / "data"),
                 ("vocab", "build", "--data", tmp_path / "data", "--size", "40", "--out", tmp_path / "v.safetensors"),
                 ("capture", "--target", target, "--data", tmp_path / "data", "--out", tmp_path / "cap", "--dtype", "fp32"),
                 ("train", "--target", target, "--capture", tmp_path / "cap", "--vocab", tmp_path / "v.safetensors",
                  "--max-steps", "2", "--dtype", "fp32", "--out", tmp_path / "run"),
                 ("convert", tmp_path / "run" / "final", "--to", "speculators", "--out", tmp_path / "sp",
                  "--target", target)):
        code, _, err = eyas_cli(*argv)
        assert code == 0, (argv[:2], err)
    want = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight
    assert torch.equal(load_file(tmp_path / "sp" / "model.safetensors")["embed_tokens.weight"], want)
    run = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert run["intermediate_size"] == (256 if kind == "falcon" else 128)  # ffn_hidden_size = 4 x hidden
    code, out, err = eyas_cli("target", "info", target, "--json")  # the same names, read the same way
    info = json.loads(out)
    assert code == 0 and info["intermediate_size"] == run["intermediate_size"]
    assert info["num_key_value_heads"] == run["num_key_value_heads"] == (2 if kind == "falcon" else 4)


def test_outputs_are_readable_by_other_users(eyas_cli, tiny_target, tmp_path):
    """An engine often serves as another user (a container): what eyas writes gets the modes
    the umask gives new files. safetensors writes 0600 and mkdtemp 0700 (they came out so)."""
    import os
    import stat

    from eyas.formats import capture as fcap
    from eyas.formats import vocab as fv

    old = os.umask(0o022)
    try:
        d = make_drafter(tiny_target)
        ck.save_checkpoint(tmp_path / "ck", d, {})
        code, _, err = eyas_cli("export", tmp_path / "ck", "--to", "sglang", "--out", tmp_path / "sg")
        assert code == 0, err
        fv.save_vocab(tmp_path / "v.safetensors", fv.VocabMap(d.d2t, d.t2d))
        (tmp_path / "cap").mkdir()
        fcap.write_shard(tmp_path / "cap", 0, {"x": torch.zeros(2)}, {})
    finally:
        os.umask(old)
    made = [tmp_path / "ck", tmp_path / "sg", tmp_path / "v.safetensors", *(tmp_path / "ck").iterdir(),
            *(tmp_path / "sg").iterdir(), *(tmp_path / "cap").iterdir()]
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made}
    assert modes == {p.name: "0o755" if p.is_dir() else "0o644" for p in made}, modes


def test_a_run_directory_where_a_checkpoint_belongs_names_its_checkpoints(eyas_cli, eyas_ckpt, tiny_target, tmp_path):
    run = tmp_path / "run"
    for name in ("best", "final"):
        shutil.copytree(eyas_ckpt, run / name)
    for argv in (("convert", run, "--to", "sglang", "--out", tmp_path / "x"), ("doctor", run),
                 ("vocab", "compare", run, eyas_ckpt)):
        code, _, err = eyas_cli(*argv)
        assert code == 2 and f"{run} is a training run: pass {run / 'best'} or {run / 'final'}" in err, (argv, err)


def test_cli_refuses_flag_the_engine_ignores(eyas_cli, tiny_target, tmp_path):
    ck.save_checkpoint(tmp_path / "nbr", make_drafter(tiny_target, norm_before_residual=True), {})
    code, _, err = eyas_cli("export", tmp_path / "nbr", "--to", "sglang", "--out", tmp_path / "o")
    assert code == 1 and "norm_before_residual" in err and not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o.tmp*"))
    code, _, _ = eyas_cli("export", tmp_path / "nbr", "--to", "vllm", "--out", tmp_path / "v")
    assert code == 0  # vLLM implements it
    code, out, _ = eyas_cli("export", tmp_path / "nbr", "--to", "sglang", "--out", tmp_path / "o", "--force")
    assert code == 0 and "warning" in out and (tmp_path / "o" / "config.json").is_file()


# ------------------------------------------------------------------ bad input: exit 2, nothing written


def _sglang_copy(eyas_ckpt, tmp_path) -> Path:
    return export(eyas_ckpt, "sglang", tmp_path / "src")


def _assert_refused(eyas_cli, src, tmp_path, *needles):
    code, _, err = eyas_cli("convert", src, "--to", "eyas", "--out", tmp_path / "out")
    assert code == 2, err
    for n in needles:
        assert n in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_unknown_layout(eyas_cli, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "x" / "model.safetensors"))
    _assert_refused(eyas_cli, tmp_path / "x", tmp_path, "unknown drafter layout")


def test_missing_key(eyas_cli, eyas_ckpt, tmp_path):
    src = _sglang_copy(eyas_ckpt, tmp_path)
    w = load_file(src / "model.safetensors")
    del w["midlayer.hidden_norm.weight"]
    save_file(w, str(src / "model.safetensors"))
    _assert_refused(eyas_cli, src, tmp_path, "midlayer.hidden_norm.weight", "missing")


def test_shape_mismatch(eyas_cli, eyas_ckpt, tmp_path):
    src = _sglang_copy(eyas_ckpt, tmp_path)
    w = load_file(src / "model.safetensors")
    w["norm.weight"] = torch.ones(63)
    save_file(w, str(src / "model.safetensors"))
    _assert_refused(eyas_cli, src, tmp_path, "norm.weight", "(63,)")


def test_config_contradicts_weights(eyas_cli, eyas_ckpt, tmp_path):
    src = _sglang_copy(eyas_ckpt, tmp_path)
    c = json.loads((src / "config.json").read_text())
    c["draft_vocab_size"] = 32
    (src / "config.json").write_text(json.dumps(c))
    _assert_refused(eyas_cli, src, tmp_path, "lm_head.weight", "draft_vocab_size=32")


def test_missing_config_field(eyas_cli, eyas_ckpt, tmp_path):
    src = _sglang_copy(eyas_ckpt, tmp_path)
    c = json.loads((src / "config.json").read_text())
    del c["intermediate_size"]
    (src / "config.json").write_text(json.dumps(c))
    _assert_refused(eyas_cli, src, tmp_path, "intermediate_size")


def test_bad_vocab_map(eyas_cli, eyas_ckpt, tmp_path):
    src = _sglang_copy(eyas_ckpt, tmp_path)
    w = load_file(src / "model.safetensors")
    w["d2t"] = w["d2t"] + torch.arange(N_DRAFT)  # absolute ids stored as if offsets
    save_file(w, str(src / "model.safetensors"))
    _assert_refused(eyas_cli, src, tmp_path, "d2t", "offsets")


def test_eyas_checkpoint_with_absolute_d2t_is_refused_on_load(eyas_ckpt, tmp_path):
    """bench, train --init-from and doctor read eyas checkpoints through load_checkpoint: a
    d2t holding absolute ids must stop there, not draft wrong tokens or crash on an index."""
    src = tmp_path / "abs"
    shutil.copytree(eyas_ckpt, src)
    w = load_file(src / "model.safetensors")
    w["d2t"] = w["d2t"] + torch.arange(N_DRAFT)
    save_file(w, str(src / "model.safetensors"))
    with pytest.raises(EyasError, match="model.safetensors: d2t holds absolute target ids"):
        ck.load_checkpoint(src)
    assert any("offsets" in p for p in E.static_check(src, "eyas"))
    assert E.static_check(eyas_ckpt, "eyas") == []


def test_export_refuses_final_norm_aux_id(eyas_cli, tiny_target, tmp_path):
    """A drafter trained on HF index L (the final-norm output) cannot be served by SGLang or vLLM."""
    ck.save_checkpoint(tmp_path / "late", make_drafter(tiny_target, aux=[1, 2, 4]), {})
    for fmt in ("sglang", "vllm"):
        code, _, err = eyas_cli("convert", tmp_path / "late", "--to", fmt, "--target", tiny_target,
                                "--out", tmp_path / fmt)
        assert code == 1 and "final-norm output" in err, err
        assert not (tmp_path / fmt).exists()


def test_export_refuses_non_finite_weights_and_another_target(eyas_cli, tiny_target, tmp_path):
    import tiny

    d = make_drafter(tiny_target)
    with torch.no_grad():
        d.fc.weight[0, 0] = float("nan")
    ck.save_checkpoint(tmp_path / "nan", d, {})
    code, _, err = eyas_cli("convert", tmp_path / "nan", "--to", "vllm", "--out", tmp_path / "o1")
    assert code == 1 and "non-finite" in err and "fc.weight" in err, err
    other = tiny.build_target(tmp_path / "t300", tokenizer=tiny.build_tokenizer(300))
    ck.save_checkpoint(tmp_path / "ok", make_drafter(tiny_target), {})
    code, _, err = eyas_cli("convert", tmp_path / "ok", "--to", "sglang", "--target", other, "--out", tmp_path / "o2")
    assert code == 1 and "trained for another target" in err, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_export_and_remap_refuse_a_target_of_the_same_sizes_it_was_not_trained_for(eyas_cli, tiny_targets, tmp_path):
    """The Qwen2 tiny target has the Llama one's sizes; only the fingerprint in eyas.json tells them apart."""
    from eyas import targets

    llama, qwen = tiny_targets["llama"], tiny_targets["qwen2"]
    ck.save_checkpoint(tmp_path / "d", make_drafter(llama), {"target_fingerprint": targets.fingerprint(llama)})
    code, _, err = eyas_cli("export", tmp_path / "d", "--to", "vllm", "--target", qwen, "--out", tmp_path / "o")
    assert code == 1 and "trained for target fingerprint" in err and not (tmp_path / "o").exists(), err
    assert eyas_cli("export", tmp_path / "d", "--to", "vllm", "--target", llama, "--out", tmp_path / "o")[0] == 0
    vm = cv.d2t_from_ids(torch.arange(0, 40)), cv.t2d_from_ids(torch.arange(0, 40), targets.load_config(llama).vocab_size)
    from eyas.formats.vocab import VocabMap, save_vocab

    save_vocab(tmp_path / "v.safetensors", VocabMap(*vm, {}))
    code, _, err = eyas_cli("vocab", "remap", "--drafter", tmp_path / "d", "--to", tmp_path / "v.safetensors",
                            "--target", qwen, "--out", tmp_path / "r")
    assert code == 2 and "another target's lm_head" in err and not (tmp_path / "r").exists(), err


class _Evil:
    """A pickle whose loading would create a file (it must never run)."""

    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_malicious_pickle_never_runs(eyas_cli, eyas_ckpt, tmp_path):
    src = export(eyas_ckpt, "eagle", tmp_path / "src")
    marker = tmp_path / "PWNED"
    _Evil.marker = marker
    sd = torch.load(src / "pytorch_model.bin", weights_only=True)
    sd["evil"] = _Evil()
    torch.save(sd, src / "pytorch_model.bin")  # a real torch zip checkpoint carrying the payload
    _assert_refused(eyas_cli, src, tmp_path, "pytorch_model.bin")
    assert not marker.exists()
    code, _, _ = eyas_cli("export", src, "--to", "vllm", "--out", tmp_path / "o")
    assert code == 2 and not marker.exists()


def test_unknown_engine_and_format(eyas_ckpt, tmp_path):
    with pytest.raises(EyasError, match="unknown engine"):
        E.engine_reading(eyas_ckpt, "tensorrt")
    (tmp_path / "o").mkdir()
    cfg, st, _ = E.import_checkpoint(eyas_ckpt)
    with pytest.raises(EyasError, match="unknown format"):
        E.write_layout(cfg, st, "onnx", tmp_path / "o")


def test_eagle_without_ids_needs_target(eyas_ckpt, tiny_target, tmp_path):
    src = export(eyas_ckpt, "eagle", tmp_path / "eg")
    c = json.loads((src / "config.json").read_text())
    del c["eagle_config"]
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(EyasError, match="--target"):
        E.import_checkpoint(src)
    cfg, _, meta = E.import_checkpoint(src, target=tiny_target)
    assert cfg.aux_layer_ids == [2, 2, 1] and "default" in meta["aux_layer_ids_source"]


@pytest.mark.slow
def test_builtin_target_exports_load_clean(builtin_target, tmp_path):
    """SmolLM2 (30 layers): default aux [2, 15, 27] -> SGLang [1, 14, 26], read back identically by
    both SGLang versions; every engine's static check passes with the real target."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(builtin_target)
    cfg = DrafterConfig.from_target(tcfg, 1024, [2, 15, 27])
    d = Eagle3Drafter(cfg)
    ids = torch.arange(0, tcfg.vocab_size, 7)[:1024]
    with torch.no_grad():
        d.d2t.copy_(cv.d2t_from_ids(ids))
        d.t2d.copy_(cv.t2d_from_ids(ids, tcfg.vocab_size))
    ck.save_checkpoint(tmp_path / "ey", d, {})
    for fmt in E.ENGINES:
        out = export(tmp_path / "ey", fmt, tmp_path / fmt, target=builtin_target)
        assert E.static_check(out, fmt, expected=cfg, target=builtin_target) == [], fmt
        r = E.engine_reading(out, fmt, builtin_target)
        assert r.aux_layer_ids_hf == [2, 15, 27] and not any("newer SGLang" in n for n in r.notes)
    c = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


# ------------------------------------------------------------------ peer flags in vLLM
# vLLM 0.32 llama_eagle3.py: norm_before_fc from eagle_config.norm_before_fc, else top-level (an
# `input_norm` RMSNorm over cat(aux); `input_norm.*` dropped at load while it is off); fc_norm and
# norm_output top-level (`fc_norm.{i}` per aux chunk; the next step's input is norm(h)); defaults
# false. speculators configs: algos.update_eagle3 copies all three (default false). Served and
# compared with eyas's chain in tests/serve/test_serve_vllm.py.

@pytest.mark.parametrize("flags", [{"norm_before_fc": True, "norm_output": True},
                                   {"fc_norm": True, "norm_before_residual": True}, {"norm_output": True}])
def test_vllm_export_carries_the_flags_vllm_reads(eyas_cli, tiny_target, tmp_path, flags):
    src = tmp_path / "src"
    ck.save_checkpoint(src, make_drafter(tiny_target, **flags), {})
    code, _, err = eyas_cli("export", src, "--to", "vllm", "--out", tmp_path / "vl")
    assert code == 0, err
    c = json.loads((tmp_path / "vl" / "config.json").read_text())
    for k in E.FLAGS:  # top level, where llama_eagle3.py reads them; absent means false
        assert bool(c.get(k, False)) is bool(flags.get(k, False)), k
    w = load_file(tmp_path / "vl" / "model.safetensors")
    assert ("input_norm.weight" in w) is bool(flags.get("norm_before_fc"))  # -> model.input_norm.weight
    assert sorted(k for k in w if k.startswith("fc_norm.")) == (
        [f"fc_norm.{i}.weight" for i in range(3)] if flags.get("fc_norm") else [])
    r = E.engine_reading(tmp_path / "vl", "vllm")
    assert not r.errors and not r.missing and not r.skipped
    assert all(getattr(r.config, k) is bool(flags.get(k, False)) for k in E.FLAGS)
    assert E.static_check(tmp_path / "vl", "vllm") == []
    # vLLM reads the same drafter from a speculators export
    code, _, err = eyas_cli("export", src, "--to", "speculators", "--out", tmp_path / "sp", "--target", tiny_target)
    assert code == 0, err
    r = E.engine_reading(tmp_path / "sp", "vllm")
    assert all(getattr(r.config, k) is bool(flags.get(k, False)) for k in E.FLAGS) and not r.errors
    # SGLang implements none of them: refused, naming the flag and the engines that do implement it
    code, out, err = eyas_cli("export", src, "--to", "sglang", "--out", tmp_path / "sg")
    on = next(k for k in ("norm_before_fc", "fc_norm", "norm_output") if flags.get(k))
    assert code == 1 and on in err and "vllm or speculators" in err and not (tmp_path / "sg").exists()


def test_vllm_reads_norm_before_fc_from_eagle_config_first(tiny_target, tmp_path):
    src = tmp_path / "src"
    ck.save_checkpoint(src, make_drafter(tiny_target, norm_before_fc=True), {})
    vl = export(src, "vllm", tmp_path / "vl")
    c = json.loads((vl / "config.json").read_text())
    c["eagle_config"] = {"norm_before_fc": False}  # llama_eagle3.py: eagle_config's value wins
    (vl / "config.json").write_text(json.dumps(c))
    r = E.engine_reading(vl, "vllm")
    assert r.config.norm_before_fc is False and r.skipped == ["input_norm.weight"] and not r.errors
    problems = E.static_check(vl, "vllm")
    assert any("norm_before_fc=False" in p for p in problems)
    assert any("silently ignores file key input_norm.weight" in p for p in problems)


def test_vllm_drops_input_norm_but_refuses_fc_norm_without_their_flags(tiny_target, tmp_path):
    for flag, key, outcome in (("norm_before_fc", "input_norm.weight", "skipped"),
                               ("fc_norm", "fc_norm.0.weight", "errors")):
        src = tmp_path / flag
        ck.save_checkpoint(src, make_drafter(tiny_target, **{flag: True}), {})
        vl = export(src, "vllm", tmp_path / f"vl-{flag}")
        c = json.loads((vl / "config.json").read_text())
        del c[flag]  # vLLM then builds no such norm
        (vl / "config.json").write_text(json.dumps(c))
        r = E.engine_reading(vl, "vllm")
        assert getattr(r.config, flag) is False
        if outcome == "skipped":  # llama_eagle3.py load_weights maps input_norm. to None
            assert key in r.skipped and not r.errors
        else:  # no module named fc_norm: vLLM's loader raises at start
            assert any(key in e for e in r.errors)
        assert any(f"{flag}=False" in p for p in E.static_check(vl, "vllm")), flag


def test_hidden_act_other_than_silu_is_refused_everywhere(eyas_ckpt, tiny_target, tmp_path):
    """vLLM's and SGLang's LlamaMLP build SiLU only and raise for another activation; eyas computes
    SiLU too, so a config saying gelu is refused on import and reported as an engine refusal."""
    out = export(eyas_ckpt, "vllm", tmp_path / "v")
    c = json.loads((out / "config.json").read_text())
    c["hidden_act"] = "gelu"
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(EyasError, match="hidden_act='gelu'"):
        E.import_checkpoint(out, target=tiny_target)
    assert any("hidden_act='gelu'" in p for p in E.static_check(out, "vllm", target=tiny_target))
    own = tmp_path / "own"
    shutil.copytree(eyas_ckpt, own)
    c = json.loads((own / "config.json").read_text())
    c["hidden_act"] = "gelu"
    (own / "config.json").write_text(json.dumps(c))
    with pytest.raises(EyasError, match="hidden_act='gelu'"):
        ck.read_config(own)

import json

import pytest
import torch

from eyas import targets
from eyas.errors import EyasError
from conftest import KINDS


@pytest.mark.parametrize("kind", KINDS)
def test_info_and_aux_capture_match_output_hidden_states(tiny_targets, kind):
    path = tiny_targets[kind]
    d = targets.info(path)
    assert d["num_layers"] == 4 and d["chat_template"] is True
    assert d["default_aux_layers"] == [2, 2, 1]
    model, tok = targets.load(path)
    ids = torch.tensor([tok.encode("the model is fast and the data is slow")])
    ref = model(ids, output_hidden_states=True)
    layer_ids = [0, 1, 3, 4]
    with targets.capture_aux(model, layer_ids) as cap:
        logits = model(ids).logits
    want = torch.cat([ref.hidden_states[i] for i in layer_ids], dim=-1)
    torch.testing.assert_close(cap.aux(), want)
    torch.testing.assert_close(cap.last, ref.hidden_states[-1])  # post final norm
    torch.testing.assert_close(model.lm_head(cap.last), logits)


def test_wrapped_model_layers_are_found(tiny_target):
    model, _ = targets.load(tiny_target)

    class Wrapper(torch.nn.Module):  # a multimodal-style wrapper: language model under an attribute
        def __init__(self, lm):
            super().__init__()
            self.language_model = lm

    stack = targets.find_decoder_stack(Wrapper(model))
    assert stack.path == "language_model.model.layers"
    with pytest.raises(EyasError, match="tried model.layers"):
        targets.find_decoder_stack(torch.nn.Linear(2, 2))


def test_bad_targets_exit_2(eyas_cli, tmp_path):
    code, _, err = eyas_cli("target", "info", "some-org/some-model")
    assert code == 2 and "never downloads" in err and "Traceback" not in err
    code, _, err = eyas_cli("target", "fetch", str(tmp_path / "missing"))
    assert code == 2 and "no such directory" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    code, _, err = eyas_cli("target", "info", str(tmp_path / "bad"))
    assert code == 2 and "not valid JSON" in err


def test_fetch_local_prints_path(eyas_cli, tiny_target):
    code, out, _ = eyas_cli("target", "fetch", str(tiny_target), "--json")
    assert code == 0 and json.loads(out)["path"] == str(tiny_target.resolve())


@pytest.mark.slow
def test_builtin_target_fetch_and_info(eyas_cli, builtin_target):
    code, out, _ = eyas_cli("target", "info", "smollm2-135m", "--json")
    d = json.loads(out)
    assert code == 0
    assert (d["num_layers"], d["hidden_size"], d["vocab_size"]) == (30, 576, 49152)
    assert d["default_aux_layers"] == [2, 15, 27] and d["chat_template"]


def test_dtype_auto_is_bf16_only_where_bf16_is_native(monkeypatch):
    """`--dtype auto`: bf16 with AMX or AVX512-BF16, fp32 on a plain AVX2 CPU; each stage resolves its
    own config with its rule (tests/stages/test_auto_dtype.py runs the stages), so run records hold
    the concrete dtype."""
    from eyas.stages.bench import BenchConfig
    from eyas.stages.capture import CaptureConfig
    from eyas.stages.common import resolve_dtype

    for amx, avx512_bf16, want in ((False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert targets.fast_dtype("cpu") == want
        assert targets.decode_dtype("cpu") == ("bf16" if amx else "fp32")  # bf16 decoding only with AMX
    # the last capability set above: AVX512-BF16 without AMX
    assert resolve_dtype(CaptureConfig(dtype="auto"), targets.fast_dtype).dtype == "bf16"
    assert resolve_dtype(BenchConfig(dtype="auto"), targets.decode_dtype).dtype == "fp32"  # decoding: no AMX
    assert resolve_dtype(BenchConfig(dtype="bf16"), targets.decode_dtype).dtype == "bf16"  # a given dtype stays


def test_fingerprint_ignores_the_writer_but_not_the_model(tiny_target, tmp_path, eyas_cli):
    """One model saved by two library versions (config's transformers_version, tokenizer.json's
    layout) keeps its fingerprint; another vocabulary or config does not. Data prepared under the
    old id (raw bytes, before 2026-11-30) is still accepted."""
    import shutil

    copy = tmp_path / "resaved"
    shutil.copytree(tiny_target, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["transformers_version"] = "0.0.1"
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    tok["normalizer"] = {"type": "Sequence", "normalizers": []}  # as transformers 5.17 wrote SmolLM2's
    tok["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, tok["decoder"]]}
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert targets.fingerprint(copy) == targets.fingerprint(tiny_target)
    assert targets._fingerprint_v0(copy) != targets._fingerprint_v0(tiny_target)  # the old id broke here
    assert targets.same_target(copy, targets._fingerprint_v0(copy))
    before = targets.fingerprint(copy)  # the id is kept per directory, until a file changes
    (copy / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert targets.fingerprint(copy) != before
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    assert targets.fingerprint(copy) == before

    orig_cfg = json.loads((tiny_target / "config.json").read_text())
    orig_tok = json.loads((tiny_target / "tokenizer.json").read_text())

    def changed(i, cfg=orig_cfg, tok=orig_tok):  # a copy of the target with one thing changed
        d = tmp_path / f"other{i}"
        shutil.copytree(tiny_target, d)
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "tokenizer.json").write_text(json.dumps(tok))
        return d

    def edited(f):
        t = json.loads(json.dumps(orig_tok))
        f(t)
        return t

    def rename_token(t):
        vocab = t["model"]["vocab"]
        word = next(k for k, v in vocab.items() if v > 100)
        vocab[word + "x"] = vocab.pop(word)

    variants = [
        changed(0, cfg={**orig_cfg, "rms_norm_eps": 1e-5}),
        changed(1, tok=edited(rename_token)),
        changed(2, tok=edited(lambda t: t["model"]["merges"].append(["Ġ", "t"]))),
        changed(3, tok=edited(lambda t: t["added_tokens"][0].update(content="<|renamed|>"))),
    ]
    assert targets.fingerprint(changed(4)) == targets.fingerprint(tiny_target)  # the copy itself: same id
    for other in variants:
        assert not targets.same_target(other, targets.fingerprint(tiny_target)), other.name
    other = variants[0]

    # data prepared with one copy, vocabulary built against the other: accepted
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"Tom has {i} apples. How many?", "answer": f"{i}."}) + "\n"
                               for i in range(12)))
    code, _, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", prompts, "--out", tmp_path / "d")
    assert code == 0, err
    code, _, err = eyas_cli("vocab", "build", "--data", tmp_path / "d", "--size", "32", "--target", copy,
                            "--out", tmp_path / "v.safetensors")
    assert code == 0, err
    code, _, err = eyas_cli("vocab", "build", "--data", tmp_path / "d", "--size", "32", "--target", other,
                            "--out", tmp_path / "w.safetensors")
    assert code == 2 and "is not the target" in err


@pytest.mark.parametrize("text", ['{"model": ', "[1, 2]", '{"added_tokens": [{"id": 1}]}'])
def test_malformed_tokenizer_json_exits_2(tiny_target, tmp_path, cli, text):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_target, bad)
    (bad / "tokenizer.json").write_text(text)
    code, out, err = cli("target", "info", bad)
    assert code == 2 and "tokenizer.json" in err and len(err.strip().splitlines()) == 1, err


def test_devices_other_than_cpu_and_cuda_exit_2(cli, tmp_path):
    code, _, err = cli("quickstart", "--device", "meta", "--out", tmp_path / "q")
    assert code == 2 and "cpu or cuda" in err and not (tmp_path / "q").exists()


def test_cuda_devices_keep_sdpa_off_cudnn(monkeypatch):
    """cuDNN attention builds a plan per new key length, i.e. per decoding step: every stage's
    `--device cuda` goes through parse_device, which turns that backend off."""
    import torch

    from eyas import targets

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert targets.parse_device("cpu").type == "cpu" and torch.backends.cuda.cudnn_sdp_enabled()
        assert targets.parse_device("cuda:1") == torch.device("cuda:1")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_aux_layer_choices_that_cannot_serve_are_named(caplog):
    """The default [2, L//2, L-3] outside a shallow target names --layers as the fix; other
    than three ids warns that SGLang and vLLM cannot load the drafter (fc is built for 3)."""
    assert targets.parse_layers("auto", 32) == [2, 16, 29]
    with pytest.raises(EyasError, match=r"are \[2, 1, -1\] for this 2-layer target.*pass --layers"):
        targets.parse_layers("auto", 2)
    with caplog.at_level("WARNING"):
        assert targets.parse_layers("1,2", 4) == [1, 2]
    assert "exports to the speculators layout only" in caplog.text

"""Regeneration and capture through vLLM (`--engine vllm`) against eyas's own loops, on the real
SmolLM2 target in fp32: answers token-identical (or the share identical, with the first
divergence, above a stated floor), captured features equal within a stated tolerance, resume.

Each test starts vLLM once (eager: no compilation), in a child process, on a handful of short
prompts; on the 2-core CI box a start takes 35-55 s.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eyas.formats import data as fdata
from eyas.formats.capture import CaptureReader

pytestmark = pytest.mark.slow
EAGER = ["--vllm-args", '{"enforce_eager": true}']
NEW_TOKENS = "64"
# Share of answers that must be token-identical to eyas's greedy loop in fp32. Both engines take the argmax of
# fp32 logits, but their kernels sum in different orders; where the top two logits of a step lie within
# rounding, the answers part there. Measured: 8 of 8 identical.
ANSWERS_IDENTICAL = 0.75
# fp32 capture tolerance, per layer: max abs error relative to the layer's largest magnitude (SmolLM2's
# mid layers carry activations near 2.5e4), and the lowest per-token cosine. Measured: 1.6e-7 and 0.9999996.
REL_ERR, MIN_COS, ARGMAX_AGREE = 1e-5, 0.99999, 0.99

CONVS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is 17 times 23? Show your steps."}],
    [{"role": "user", "content": "Name three rivers in Europe."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [{"role": "user", "content": "Give me a haiku about autumn."},
     {"role": "assistant", "content": "(dataset answer, replaced by the target's)"},
     {"role": "user", "content": "Now one about winter."}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy?"}],
]


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    return f


def _prepare(eyas_cli, target, prompts, out, *extra):
    code, stdout, err = eyas_cli("data", "prepare", "--target", target, "--input", prompts, "--out", out,
                                 "--regenerate", "--max-new-tokens", NEW_TOKENS, "--dtype", "fp32",
                                 "--eval-fraction", "0", "--json", *extra)
    assert code == 0, err
    return json.loads(stdout)


def _answers(out) -> dict[str, list[list[int]]]:
    """Per sample id, the token ids of each assistant turn (loss-masked runs of the sample)."""
    got = {}
    for s in fdata.read_samples(out, "train"):
        runs, cur = [], []
        for t, m in zip(s.input_ids, s.loss_mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        got[s.id] = runs + ([cur] if cur else [])
    return got


def test_regeneration_matches_eyas(vllm_ready, builtin_target, prompts, tmp_path, eyas_cli, monkeypatch):
    monkeypatch.setenv("EYAS_NO_PROGRESS", "1")
    _prepare(eyas_cli, builtin_target, prompts, tmp_path / "eyas")
    got = _prepare(eyas_cli, builtin_target, prompts, tmp_path / "vllm", "--engine", "vllm", "--batch-size", "4",
                   *EAGER)
    assert got["regeneration"]["engine"] == "vllm" and got["regeneration"]["batches_generated"] == 2
    a, b = _answers(tmp_path / "eyas"), _answers(tmp_path / "vllm")
    assert a.keys() == b.keys() and len(a) == len(CONVS)
    turns = [(k, i, x, y) for k in a for i, (x, y) in enumerate(zip(a[k], b[k]))]
    assert len(turns) == 8 and all(len(a[k]) == len(b[k]) for k in a)  # both turns of the two-turn chats
    same = [x == y for _, _, x, y in turns]
    first = next(((k, i, next(j for j, (p, q) in enumerate(zip(x, y)) if p != q) if x[:len(y)] != y[:len(x)]
                   else min(len(x), len(y))) for (k, i, x, y), s in zip(turns, same) if not s), None)
    share = sum(same) / len(same)
    print(f"answers token-identical: {sum(same)}/{len(same)}; first divergence (id, turn, token): {first}")
    assert share >= ANSWERS_IDENTICAL, f"{share:.2f} of answers identical; first divergence (id, turn, token) {first}"
    # same files, same masks: the manifests agree on everything but the generation record
    ma, mb = fdata.read_manifest(tmp_path / "eyas"), fdata.read_manifest(tmp_path / "vllm")
    for key in ("target_fingerprint", "tokenizer_fingerprint", "chat_template_sha256", "regenerated", "max_len"):
        assert ma[key] == mb[key]


def test_regeneration_resumes_finished_chunks(vllm_ready, builtin_target, prompts, tmp_path, monkeypatch):
    """A killed run (chunk 0 finished, chunk 1 torn mid-line) is resumed: chunk 0 is reused as written,
    only chunk 1 is generated; a rerun of a finished run starts no engine."""
    from eyas import targets
    from eyas.formats import prompts as fprompts
    from eyas.formats.work import WorkFile
    from eyas.runtime.regenerate import GenSettings
    from eyas.serve import vllm_generate
    from eyas.serve.vllm_jobs import EngineArgs

    monkeypatch.setenv("EYAS_NO_PROGRESS", "1")
    convs = fprompts.load_prompt_files([prompts])
    settings = GenSettings(max_new_tokens=16, batch_size=4)
    engine = EngineArgs("fp32", extra={"enforce_eager": True})
    fp = targets.fingerprint(builtin_target)
    tok = fdata_tokenizer(builtin_target)
    stop = fdata.end_of_turn_ids(tok)
    work = tmp_path / "work"
    kept = [["kept from the killed run"] * sum(t["role"] == "user" for t in c.turns) for c in convs[:4]]
    wf = WorkFile(work, vllm_generate._key(fp, engine, settings, convs))
    wf.append({"batch": 0, "ids": [c.id for c in convs[:4]], "answers": kept, "cut": 0})
    with open(wf.path, "a") as f:
        f.write('{"batch": 1, "ids": ["torn')
    out, st = vllm_generate.regenerate(builtin_target, convs, settings, work, fp, stop, engine, progress=False)
    assert (st.batches_reused, st.batches_done) == (1, 1)
    assert [t["content"] for t in out[0].turns if t["role"] == "assistant"] == kept[0]
    assert all(len([t for t in c.turns if t["role"] == "assistant"]) == 2 for c in out[4:])
    again, st2 = vllm_generate.regenerate(builtin_target, convs, settings, work, fp, stop, engine, progress=False)
    assert (st2.batches_reused, st2.batches_done) == (2, 0) and again == out


def fdata_tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def test_capture_matches_eyas(vllm_ready, builtin_target, prompts, tmp_path, eyas_cli, monkeypatch):
    monkeypatch.setenv("EYAS_NO_PROGRESS", "1")
    data, answered = tmp_path / "data", tmp_path / "answered.jsonl"
    answer = {"role": "assistant", "content": "A dataset answer of a few words, long enough to supervise "
              "several tokens: 17 x 23 = 391, the Danube, the Rhine and the Seine."}
    answered.write_text("".join(json.dumps({"messages": c + [answer]}) + "\n" for c in CONVS))
    code, _, err = eyas_cli("data", "prepare", "--target", builtin_target, "--input", answered, "--out", data,
                            "--eval-fraction", "0")
    assert code == 0, err
    common = ["capture", "--target", builtin_target, "--data", data, "--dtype", "fp32", "--shard-mb", "0.3",
              "--layers", "27,2,30"]  # out of order, and 30 = the final-norm output (vLLM: pre-norm + eyas's norm)
    assert eyas_cli(*common, "--out", tmp_path / "eyas")[0] == 0
    code, _, err = eyas_cli(*common, "--out", tmp_path / "vllm", "--engine", "vllm", *EAGER)
    assert code == 0, err
    a, b = CaptureReader(tmp_path / "eyas"), CaptureReader(tmp_path / "vllm", verify=True)
    assert b.manifest["layer_ids"] == [27, 2, 30] and b.manifest["engine"] == "vllm" and len(b.manifest["shards"]) > 1
    b.validate(data)
    H, worst, agree, total = a.hidden_size, {}, 0, 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        parts = [(f"aux{j}", x["aux"][:, k * H:(k + 1) * H], y["aux"][:, k * H:(k + 1) * H])
                 for k, j in enumerate(a.layer_ids)] + [("last", x["last"], y["last"])]
        for name, p, q in parts:
            err_rel = ((p - q).abs().max() / p.abs().max()).item()
            cos = F.cosine_similarity(p, q, dim=-1).min().item()
            w = worst.setdefault(name, [0.0, 1.0])
            worst[name] = [max(w[0], err_rel), min(w[1], cos)]
        sup = x["argmax"] >= 0
        assert torch.equal(sup, y["argmax"] >= 0)
        agree += int((x["argmax"][sup] == y["argmax"][sup]).sum())
        total += int(sup.sum())
    bad = {k: v for k, v in worst.items() if v[0] > REL_ERR or v[1] < MIN_COS}
    assert not bad, f"per layer (max relative abs error, min cosine) beyond {REL_ERR}, {MIN_COS}: {worst}"
    assert agree / total >= ARGMAX_AGREE, f"argmax agreement {agree}/{total}"


@pytest.mark.parametrize("extra,needle", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size only applies to --engine vllm"),
    (["--engine", "vllm", "--vllm-args", "{oops"], "--vllm-args"),
    (["--engine", "vllm", "--vllm-args", '{"dtype": "float16"}'], "eyas sets itself"),
    (["--engine", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size 0"),
])
def test_engine_flags_are_checked(builtin_target, prompts, tmp_path, cli, extra, needle):
    """Flag errors are exit 2 with one line, before any engine starts (needs no vLLM)."""
    out = tmp_path / "o"
    code, _, err = cli("data", "prepare", "--target", builtin_target, "--input", prompts, "--out", out,
                       "--regenerate", *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("extra,needle", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size only applies to --engine vllm"),
    (["--engine", "vllm", "--vllm-args", "[1]"], "must be a JSON object"),
])
def test_capture_engine_flags_are_checked(builtin_target, tmp_path, cli, extra, needle):
    out = tmp_path / "o"
    code, _, err = cli("capture", "--target", builtin_target, "--data", tmp_path / "nodata", "--out", out, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not out.exists()

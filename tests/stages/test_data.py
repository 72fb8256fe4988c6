"""`eyas data prepare`: loss masks, the prepared format, regeneration + resume, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import PROMPTS

from eyas.cpu import prepack
from eyas.errors import EyasError
from eyas.formats.data import end_of_turn_ids, read_manifest, read_samples, render_masked, split_of

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "The answer is 5.\nBecause two plus three equals five."},
    {"role": "user", "content": "And times?"},
    {"role": "assistant", "content": " six, with a leading space"},
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _masked_text(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


def _expected(tok, messages):
    eot = tok.convert_ids_to_tokens(end_of_turn_ids(tok)[0])
    return "".join(m["content"] + eot for m in messages if m["role"] == "assistant")


def _check_mask(tok, messages):
    ids, mask = render_masked(tok, messages)
    assert len(ids) == len(mask)
    assert _masked_text(tok, ids, mask) == _expected(tok, messages)
    full = tok.apply_chat_template(messages, tokenize=True)
    full = full if isinstance(full, list) else full["input_ids"]
    assert ids == full  # piecewise tokenization equals the template's own here
    return ids, mask


@pytest.mark.parametrize("messages", [CONV, CONV[1:], CONV[1:3]])
def test_mask_is_assistant_text_tiny(tiny_tokenizer, messages):
    _check_mask(tiny_tokenizer, messages)


@pytest.fixture(scope="module")
def real_tokenizer(builtin_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_target)


@pytest.mark.parametrize("messages", [CONV, CONV[1:], CONV[1:3]])
def test_mask_is_assistant_text_smollm2(real_tokenizer, messages):
    ids, mask = _check_mask(real_tokenizer, messages)
    if messages[0]["role"] != "system":  # SmolLM2's template injects its default system prompt
        text = real_tokenizer.decode(ids)
        assert "You are a helpful AI assistant named SmolLM" in text
        assert "SmolLM" not in _masked_text(real_tokenizer, ids, mask)


def test_split_is_deterministic():
    ids = [f"src:{i}" for i in range(2000)]
    ev = [i for i in ids if split_of(i, 0.1) == "eval"]
    assert ev == [i for i in ids if split_of(i, 0.1) == "eval"]
    assert 140 < len(ev) < 260
    assert all(split_of(i, 0.0) == "train" for i in ids)


# ---------------------------------------------------------------- whole command, tiny target



@pytest.fixture
def qa_file(tmp_path):
    f = tmp_path / "gsm_small.jsonl"
    recs = [{"question": f"Tom has {i} apples and buys {i + 2}. How many?", "answer": f"He has {2 * i + 2}.\n#### {2 * i + 2}"}
            for i in range(30)]
    recs.append({"question": "A question without an answer?"})  # no answer
    recs.append({"question": "tom has 1 apples and buys 3 how many", "answer": "dup"})  # duplicate
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return f


def test_prepare_tiny(tiny_target, qa_file, tmp_path, eyas_cli, tiny_tokenizer):
    out = tmp_path / "prep"
    code, stdout, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out,
                                 "--eval-fraction", "0.2", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    m = read_manifest(out)
    assert m["format"] == "eyas.prepared" and m["version"] == 1 and not m["regenerated"]
    train, ev = read_samples(out, "train"), read_samples(out, "eval")
    assert len(train) + len(ev) == 30 == summary["counts"]["train"] + summary["counts"]["eval"]
    assert len(ev) > 0 and all(split_of(s.id, 0.2) == "eval" for s in ev)
    assert summary["dropped"]["duplicates"] == 1 and summary["dropped"]["no_answer"] == 1
    assert summary["sources"]["gsm_small"]["samples"] == 30
    assert summary["supervised_tokens"] == sum(sum(s.loss_mask) for s in train + ev)
    for s in train + ev:
        assert s.category == "math" and s.messages[-1]["role"] == "assistant"
        assert _masked_text(tiny_tokenizer, s.input_ids, s.loss_mask) == _expected(tiny_tokenizer, s.messages)
    assert set(m) >= {"target_fingerprint", "tokenizer_fingerprint", "chat_template_sha256", "sources", "provenance"}
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "manifest.json", "train.jsonl"]
    assert not list(tmp_path.glob(".prep*")) and not (tmp_path / "prep.partial").exists()


def test_limit_and_max_len(tiny_target, qa_file, tmp_path, eyas_cli):
    out = tmp_path / "p"
    code, stdout, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out,
                                 "--limit", "5", "--max-len", "70", "--eval-fraction", "0", "--json")
    assert code == 0, err
    train = read_samples(out, "train")
    assert [s.id for s in train] == [f"gsm_small:{i}" for i in range(5)]
    assert max(len(s.input_ids) for s in train) == 70 and all(sum(s.loss_mask) for s in train)
    code, _, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out,
                            "--max-len", "3", "--force")
    assert code == 2 and "no trainable samples" in err  # every answer truncated away
    assert len(read_samples(out, "train")) == 5  # the earlier output is untouched


def test_exclude_holds_out_bench_prompts(tiny_target, qa_file, tmp_path, eyas_cli):
    """--exclude drops conversations whose first user turn is a held-out prompt (case and punctuation
    ignored), whatever file or schema it came in; --limit counts after it."""
    held = tmp_path / "bench.jsonl"
    held.write_text(json.dumps({"turns": ["TOM has 3 apples and buys 5 -- how many?", "and then?"]}) + "\n"
                    + json.dumps("Tom has 7 apples and buys 9. How many?") + "\n")
    out = tmp_path / "p"
    code, stdout, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out,
                                 "--exclude", held, "--eval-fraction", "0", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["dropped"]["excluded"] == 2
    texts = [s.messages[0]["content"] for s in read_samples(out, "train")]
    assert len(texts) == 28 and not any(t.startswith(("Tom has 3 ", "Tom has 7 ")) for t in texts)
    code, _, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", tmp_path / "q",
                            "--exclude", qa_file)
    assert code == 2 and "nothing left" in err and not (tmp_path / "q").exists()
    code, _, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", tmp_path / "q",
                            "--exclude", tmp_path / "missing.jsonl")
    assert code == 2 and "--exclude" in err and "missing.jsonl" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "q").exists()


def _regen(eyas_cli, target, inputs, out, *extra):
    return eyas_cli("data", "prepare", "--target", target, "--input", *inputs, "--out", out, "--regenerate",
                    "--max-new-tokens", "8", "--batch-size", "3", "--eval-fraction", "0.25", *extra)


def test_regenerate_resume_is_byte_identical(tiny_target, tmp_path, eyas_cli, monkeypatch, tiny_tokenizer):
    import eyas.runtime.regenerate as regen

    mt = PROMPTS / "FastChat__mt_bench__question.jsonl"
    inputs = [str(mt), "builtin"]
    ref = tmp_path / "ref"
    code, _, err = _regen(eyas_cli, tiny_target, inputs, ref, "--limit", "10", "--temperature", "0.8")
    assert code == 0, err

    calls = {"n": 0}
    real = regen.answer_turns

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed during the second batch
        return real(*a, **k)

    monkeypatch.setattr(regen, "answer_turns", flaky)
    out = tmp_path / "run"
    code, _, err = _regen(eyas_cli, tiny_target, inputs, out, "--limit", "10", "--temperature", "0.8")
    assert code == 130 and not out.exists()
    work = tmp_path / "run.partial" / "batches.jsonl"
    assert len(work.read_text().splitlines()) == 1
    monkeypatch.setattr(regen, "answer_turns", real)
    code, stdout, err = _regen(eyas_cli, tiny_target, inputs, out, "--limit", "10", "--temperature", "0.8", "--json")
    assert code == 0, err
    assert json.loads(stdout)["regeneration"]["batches_reused"] == 1
    for name in ("train.jsonl", "eval.jsonl"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    assert not (tmp_path / "run.partial").exists()

    samples = read_samples(out, "train") + read_samples(out, "eval")
    assert read_manifest(out)["regenerated"] is True and len(samples) == 10
    for s in samples:
        assert _masked_text(tiny_tokenizer, s.input_ids, s.loss_mask) == _expected(tiny_tokenizer, s.messages)
    two_turn = [s for s in samples if s.source.startswith("FastChat")]
    assert two_turn and all([m["role"] for m in s.messages] == ["user", "assistant"] * 2 for s in two_turn)


def test_resumed_regeneration_counts_the_turns_cut_in_reused_batches(tiny_target, tmp_path, eyas_cli, monkeypatch):
    """`turns_cut_for_context` describes the data, so a resumed run reports the cuts made in the
    batches it reused too (it used to count only its own batches)."""
    import eyas.runtime.regenerate as regen

    mt = str(PROMPTS / "FastChat__mt_bench__question.jsonl")
    flags = ("--limit", "6", "--max-new-tokens", "250", "--batch-size", "2", "--json")  # 2nd turns overflow 512
    code, stdout, err = _regen(eyas_cli, tiny_target, [mt], tmp_path / "ref", *flags)
    assert code == 0, err
    ref = json.loads(stdout)["regeneration"]
    want, batches = ref["turns_cut_for_context"], ref["batches_generated"]
    assert want > 0 and batches >= 2

    real, calls = regen.answer_turns, {"n": 0}

    def killed_in_last(*a, **k):
        calls["n"] += 1
        if calls["n"] == batches:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(regen, "answer_turns", killed_in_last)
    assert _regen(eyas_cli, tiny_target, [mt], tmp_path / "run", *flags)[0] == 130
    done = [json.loads(line) for line in (tmp_path / "run.partial" / "batches.jsonl").read_text().splitlines()]
    assert len(done) == batches - 1 and sum(r["cut"] for r in done) > 0  # cuts inside the batches to reuse
    monkeypatch.setattr(regen, "answer_turns", real)
    code, stdout, err = _regen(eyas_cli, tiny_target, [mt], tmp_path / "run", *flags)
    assert code == 0, err
    info = json.loads(stdout)["regeneration"]
    assert info["batches_reused"] == batches - 1 and info["turns_cut_for_context"] == want
    assert read_manifest(tmp_path / "run")["generation"]["turns_cut_for_context"] == want


def test_regenerate_greedy_is_deterministic_and_stale_work_ignored(tiny_target, tmp_path, eyas_cli):
    inputs = ["builtin"]
    a, b = tmp_path / "a", tmp_path / "b"
    (tmp_path / "b.partial").mkdir()
    (tmp_path / "b.partial" / "state.json").write_text('{"key": "other settings"}')
    (tmp_path / "b.partial" / "batches.jsonl").write_text('{"batch": 0, "ids": [], "answers": []}\n')
    assert _regen(eyas_cli, tiny_target, inputs, a, "--limit", "4")[0] == 0
    assert _regen(eyas_cli, tiny_target, inputs, b, "--limit", "4")[0] == 0
    assert (a / "train.jsonl").read_bytes() == (b / "train.jsonl").read_bytes()


def test_self_prompts_are_written_by_the_target_answered_and_resumable(tiny_target, tmp_path, eyas_cli,
                                                                       monkeypatch, tiny_tokenizer):
    """--self-prompts: the target samples N distinct user prompts from its template's opening of
    a user turn, answers them like any other prompt, and a run killed while writing them
    resumes to the same bytes."""
    import eyas.runtime.regenerate as regen

    args = ("--limit", "2", "--self-prompts", "6", "--seed", "3", "--batch-size", "16")
    ref = tmp_path / "ref"
    code, stdout, err = _regen(eyas_cli, tiny_target, ["builtin"], ref, *args, "--json")
    assert code == 0, err
    info = json.loads(stdout)["regeneration"]["self_prompts"]
    assert info["asked"] == info["written"] == 6 and info["batches_generated"] >= 2
    samples = read_samples(ref, "train") + read_samples(ref, "eval")
    mine = [s for s in samples if s.source == "self"]
    assert len(mine) == 6 and len(samples) == 8
    firsts = [s.messages[0]["content"] for s in mine]
    assert len(set(firsts)) == 6 and all(len(f.split()) >= 3 for f in firsts)
    for s in mine:
        assert s.category == "chat" and [m["role"] for m in s.messages] == ["user", "assistant"]
        assert _masked_text(tiny_tokenizer, s.input_ids, s.loss_mask) == _expected(tiny_tokenizer, s.messages)
    src = {x["name"]: x for x in read_manifest(ref)["sources"]}
    assert src["self"]["kept"] == 6

    opening = tiny_tokenizer.decode(regen.user_turn_opening(tiny_tokenizer))
    empty_turn = tiny_tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    assert empty_turn.startswith(opening) and len(opening) < len(empty_turn)

    calls = {"n": 0}
    real = regen.decode_batch

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed while writing the second batch of prompts
        return real(*a, **k)

    monkeypatch.setattr(regen, "decode_batch", flaky)
    out = tmp_path / "run"
    assert _regen(eyas_cli, tiny_target, ["builtin"], out, *args)[0] == 130 and not out.exists()
    assert len((tmp_path / "run.self.partial" / "batches.jsonl").read_text().splitlines()) == 1
    monkeypatch.setattr(regen, "decode_batch", real)
    code, stdout, err = _regen(eyas_cli, tiny_target, ["builtin"], out, *args, "--json")
    assert code == 0, err
    assert json.loads(stdout)["regeneration"]["self_prompts"]["batches_reused"] == 1
    for name in ("train.jsonl", "eval.jsonl"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    assert not (tmp_path / "run.self.partial").exists() and not (tmp_path / "run.partial").exists()


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def no_template_target(tiny_target, tmp_path_factory):
    d = tmp_path_factory.mktemp("notemplate") / "t"
    shutil.copytree(tiny_target, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


BAD = [
    (["--max-len", "0"], "--max-len"),
    (["--max-len", "-5"], "--max-len"),
    (["--eval-fraction", "1"], "--eval-fraction"),
    (["--eval-fraction", "-0.1"], "--eval-fraction"),
    (["--limit", "0"], "--limit"),
    (["--max-new-tokens", "8"], "--max-new-tokens only applies to --regenerate"),
    (["--batch-size", "2"], "--batch-size only applies"),
    (["--temperature", "0.5"], "--temperature only applies"),
    (["--regenerate", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--regenerate", "--batch-size", "0"], "--batch-size"),
    (["--regenerate", "--temperature", "-1"], "--temperature"),
    (["--dtype", "fp8"], "--dtype"),
    (["--device", "tpu:x"], "--device"),
    (["--max-len", "abc"], "--max-len"),
    (["--self-prompts", "5"], "--self-prompts only applies to --regenerate"),
    (["--regenerate", "--self-prompts", "-1"], "--self-prompts"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see `eyas data prepare --help`)"),
]


@pytest.mark.parametrize("extra,needle", BAD)
def test_bad_flags(tiny_target, qa_file, tmp_path, cli, extra, needle):
    out = tmp_path / "o"
    code, stdout, err = cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out, *extra)
    assert code == 2 and needle in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_no_prompts_at_all(tiny_target, tmp_path, cli):
    code, _, err = cli("data", "prepare", "--target", tiny_target, "--out", tmp_path / "o", "--regenerate")
    assert code == 2 and "--self-prompts" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def _bad_input(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("name,text,needle", [
    ("missing.jsonl", None, "no such file"),
    ("unknown.jsonl", '{"foo": 1}\n', "unknown schema"),
    ("empty.jsonl", "", "empty"),
    ("corrupt.json", '[{"prompt": "x"', "corrupt JSON"),
    ("prompts_only.jsonl", '"just a prompt"\n', "--regenerate"),
    ("table.csv", "a,b\n", "unknown file type"),
])
def test_bad_inputs(tiny_target, tmp_path, eyas_cli, name, text, needle):
    f = tmp_path / name if text is None else _bad_input(tmp_path, name, text)
    out = tmp_path / "o"
    code, _, err = eyas_cli("data", "prepare", "--target", tiny_target, "--input", f, "--out", out)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert f"error: --input {f}: " in err, err
    if needle in ("no such file", "unknown file type"):  # a mistyped keyword: the message lists them
        assert "`builtin-public`" in err
    assert not out.exists()


def test_bad_target_and_out(tiny_target, no_template_target, qa_file, tmp_path, cli):
    out = tmp_path / "o"
    for target, needle in [(no_template_target, "no chat template"), (tmp_path / "nope", "no such directory")]:
        code, _, err = cli("data", "prepare", "--target", target, "--input", qa_file, "--out", out)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, _, err = cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out)
    assert code == 2 and "--force" in err and (out / "keep.txt").exists()
    code, _, err = cli("data", "prepare", "--target", tiny_target, "--input", "--out", out)
    assert code == 2


def test_read_corrupt_prepared(tiny_target, qa_file, tmp_path, eyas_cli):
    out = tmp_path / "p"
    assert eyas_cli("data", "prepare", "--target", tiny_target, "--input", qa_file, "--out", out)[0] == 0
    lines = (out / "train.jsonl").read_text().splitlines()
    (out / "train.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(EyasError, match="manifest.json says"):
        read_samples(out)
    (out / "train.jsonl").write_text(lines[0][:-10] + "\n")
    with pytest.raises(EyasError, match="line 1"):
        read_samples(out)
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(EyasError, match="version"):
        read_manifest(out)
    (out / "manifest.json").write_text("{")
    with pytest.raises(EyasError, match="corrupt JSON"):
        read_manifest(out)
    with pytest.raises(EyasError, match="missing"):
        read_manifest(tmp_path)


# ---------------------------------------------------------------- the real target


@pytest.mark.slow
def test_regenerate_gsm8k_on_smollm2(builtin_target, real_tokenizer, tmp_path, eyas_cli):
    out = tmp_path / "gsm"
    code, stdout, err = eyas_cli("data", "prepare", "--target", builtin_target, "--input",
                                 PROMPTS / "grade-school-math__train.jsonl", "--out", out, "--limit", "20",
                                 "--regenerate", "--max-new-tokens", "32", "--batch-size", "20", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    m = read_manifest(out)
    assert m["regenerated"] and m["counts"]["train"] + m["counts"]["eval"] == 20
    assert m["tokenizer_fingerprint"] and m["chat_template_sha256"]
    samples = read_samples(out, "train") + read_samples(out, "eval")
    gen = summary["regeneration"]
    assert gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0
    assert (gen["prepacked_linears"] > 0) == prepack.supported(torch.float32, "cpu")
    raw = [json.loads(l)["answer"] for l in (PROMPTS / "grade-school-math__train.jsonl").open().readlines()[:20]]
    for s in samples:
        assert s.category == "math" and [m["role"] for m in s.messages] == ["user", "assistant"]
        assert s.messages[1]["content"] not in raw  # the target's own answer, not the dataset's
        assert _masked_text(real_tokenizer, s.input_ids, s.loss_mask) == _expected(real_tokenizer, s.messages)
        assert 0 < sum(s.loss_mask) <= 33


def test_template_error_is_counted(tiny_target, tmp_path, eyas_cli):
    d = tmp_path / "strict"
    shutil.copytree(tiny_target, d)
    tmpl = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + tmpl)
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CONV, CONV[1:3])))
    code, stdout, err = eyas_cli("data", "prepare", "--target", d, "--input", f, "--out", tmp_path / "o", "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["dropped"]["template_error"] == 1 and s["counts"]["train"] + s["counts"]["eval"] == 1


def test_builtin_public_pool_is_packaged_and_disjoint_from_the_bench_sets():
    """`--input builtin-public` reads the shipped file through the normal loader; it holds the
    counts PUBLIC_PROMPTS.md states and none of the bench prompts (MT-bench, MBPP)."""
    from collections import Counter

    from eyas.formats.builtin_prompts import PUBLIC
    from eyas.formats.prompts import first_turn_key, load_prompt_files
    from eyas.stages.data import _load_inputs

    convs, stats = _load_inputs(["builtin-public", "builtin"])
    public = [c for c in convs if c.source == "public_prompts"]
    assert len(public) == 2474 and stats["public_prompts"].malformed == 0
    assert set(Counter(c.category for c in public)) >= {"code", "math", "chat", "roleplay"}
    notice = (PUBLIC.parent / "PUBLIC_PROMPTS.md").read_text()
    rows = [r for r in (line.split("|") for line in notice.splitlines()) if len(r) > 3 and r[3].strip().isdigit()]
    assert sum(int(r[3]) for r in rows) == 2474
    keys = {first_turn_key(c) for c in public}
    for name in ("FastChat__mt_bench__question.jsonl", "DeepSeek-Coder__mbpp.jsonl"):
        if (PROMPTS / name).is_file():
            assert not keys & {first_turn_key(c) for c in load_prompt_files([PROMPTS / name])}, name

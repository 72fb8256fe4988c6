"""Bad-input suite (issue 8.1): for every command, malformed inputs derived from copies of
healthy artifacts. Each must exit 2 with one line naming the file or flag, print no
traceback, leave inputs byte-identical and leave no output behind (see harness.run_case)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.robustness.harness import Case, copy_artifact, run_case

GARBAGE = bytes(range(256)) * 7 + b"\x00\xff\xfe"


# ---------------------------------------------------------------- mutations (each on a copy)


def _cp(env: dict, key: str, scratch: Path, name: str | None = None) -> Path:
    env[key] = copy_artifact(env[key], scratch, name or Path(env[key]).name)
    return env[key]


def cp(key: str, edit=None, sub: str | None = None):
    """Copy env[key] into scratch and apply `edit(path)` to it (or to its file `sub`)."""

    def mutate(env, scratch):
        p = _cp(env, key, scratch)
        if edit is not None:
            edit(p / sub if sub else p)
        return env

    return mutate


def write(data):
    return lambda p: p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)


def truncate(frac: float = 0.5):
    return lambda p: p.write_bytes(p.read_bytes()[: int(p.stat().st_size * frac)])


def delete(p: Path) -> None:
    p.unlink()


def json_edit(fn):
    def edit(p: Path) -> None:
        obj = json.loads(p.read_text())
        res = fn(obj)
        p.write_text(json.dumps(obj if res is None else res))

    return edit


def jset(**kv):
    def fn(o):
        o.update(kv)

    return json_edit(fn)


def jdel(*keys):
    def fn(o):
        for k in keys:
            o.pop(k)

    return json_edit(fn)


def jrename(old: str, new: str):
    def fn(o):
        o[new] = o.pop(old)

    return json_edit(fn)


def jreplace(value):
    return lambda p: p.write_text(json.dumps(value))


def st_header(p: Path) -> None:
    """Corrupt a safetensors header: claim a header length far beyond the file."""
    b = bytearray(p.read_bytes())
    b[:8] = struct.pack("<Q", 1 << 40)
    p.write_bytes(bytes(b))


def st_json(p: Path) -> None:
    """Keep the length, garble the JSON header."""
    b = bytearray(p.read_bytes())
    n = struct.unpack("<Q", bytes(b[:8]))[0]
    b[8:8 + n] = b"{" * n
    p.write_bytes(bytes(b))


def st_edit(fn):
    """Rewrite a safetensors file after `fn(tensors) -> tensors`, keeping its metadata."""

    def edit(p: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata()
        t = load_file(p)
        save_file({k: v.contiguous() for k, v in fn(t).items()}, str(p), metadata=meta)

    return edit


def st_set(key: str, make):
    def fn(t):
        t[key] = make(t[key])
        return t

    return st_edit(fn)


def st_drop(key: str):
    def fn(t):
        t.pop(key)
        return t

    return st_edit(fn)


def shard0(p: Path) -> Path:
    return p / "shard-00000.safetensors"


def cap_shard(edit):
    return lambda env, scratch: (edit(shard0(_cp(env, "cap", scratch))), env)[1]


def prep_line(fn):
    """Edit the first sample line of a copy of the prepared train.jsonl."""

    def edit(p: Path) -> None:
        lines = p.read_text().splitlines()
        lines[0] = fn(lines[0])
        p.write_text("\n".join(lines) + "\n")

    return edit


def sample_set(**kv):
    return prep_line(lambda ln: json.dumps({**json.loads(ln), **kv}))


def make_file(name: str, data):
    def mutate(env, scratch):
        p = scratch / name
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
        env["file"] = p
        return env

    return mutate


def plant_out(env, scratch):
    """--out that already holds something (then it is an input that must not change)."""
    env["out"].mkdir()
    (env["out"] / "keep.txt").write_text("precious")
    return env


def big_vocab(env, scratch):
    """A valid vocab file for a target with 1000 ids (bigger than the tiny target's)."""
    from eyas.core import vocab as cv
    from eyas.formats.vocab import VocabMap, save_vocab

    ids = torch.arange(0, 1000, 10)
    p = scratch / "big.safetensors"
    save_vocab(p, VocabMap(cv.d2t_from_ids(ids), cv.t2d_from_ids(ids, 1000), {}))
    env["vocab"] = p
    return env


def absolute_d2t(env, scratch):
    p = _cp(env, "vocab", scratch)
    st_set("d2t", lambda d: d + torch.arange(d.numel()))(p)
    return env


# ---------------------------------------------------------------- argv builders


def prepare(*extra, target="target"):
    return lambda e: ["data", "prepare", "--target", e[target], "--input", e.get("file", e["qa"]), "--out", e["out"],
                      *extra]


def vbuild(*extra):
    return lambda e: ["vocab", "build", "--data", e["prep"], "--out", e["out"], "--size", "32", *extra]


def vcompare(a="vocab", b="vocab_small"):
    return lambda e: ["vocab", "compare", e[a], e[b]]


def vremap(*extra):
    return lambda e: ["vocab", "remap", "--drafter", e["ckpt"], "--to", e["vocab_small"], "--target", e["target"],
                      "--out", e["out"], *extra]


def capture(*extra, target="target"):
    return lambda e: ["capture", "--target", e[target], "--data", e["prep"], "--out", e["out"], "--dtype", "fp32",
                      "--batch-tokens", "400", *extra]


def train(*extra, target="target"):
    return lambda e: ["train", "--target", e[target], "--capture", e["cap"], "--vocab", e["vocab"], "--out", e["out"],
                      "--ttt", "2", "--max-steps", "1", "--dtype", "fp32", "--batch-tokens", "256", *extra]


def wider_drafter(env, scratch):
    """A well-formed drafter of the same vocabulary, one and a half times as wide as the target."""
    from dataclasses import replace

    from eyas.core.drafter import Eagle3Drafter
    from eyas.formats.checkpoint import load_checkpoint, save_checkpoint

    d, meta = load_checkpoint(Path(env["ckpt"]))
    wide = Eagle3Drafter(replace(d.cfg, hidden_size=96, target_hidden_size=96, head_dim=96 // d.cfg.num_attention_heads))
    with torch.no_grad():
        wide.d2t.copy_(d.d2t)
        wide.t2d.copy_(d.t2d)
    save_checkpoint(scratch / "wide", wide, meta)
    return {**env, "ckpt": scratch / "wide"}


def train_init(*extra):
    return lambda e: train("--init-from", e["ckpt"], *extra)(e)


def export(*extra, src="ckpt"):
    return lambda e: ["export", e[src], "--to", "vllm", "--out", e["out"], *extra]


def convert(*extra, src="sglang"):
    return lambda e: ["convert", e[src], "--to", "eyas", "--out", e["out"], *extra]


def doctor(*extra, src="ckpt"):
    return lambda e: ["doctor", e[src], *extra]


def use(key: str, mutate):
    """Run `mutate` and point env[key] at its result (env['file'])."""

    def m(env, scratch):
        env = mutate(env, scratch)
        env[key] = env["file"]
        return env

    return m


# ---------------------------------------------------------------- the table

CASES = [
    # ---- data prepare: prompt files, flags, targets
    Case("prepare-input-missing", prepare(), lambda e, s: {**e, "file": s / "nope.jsonl"}, ("nope.jsonl",)),
    Case("prepare-input-empty", prepare(), make_file("empty.jsonl", ""), ("empty.jsonl",)),
    Case("prepare-input-garbage", prepare(), make_file("garbage.jsonl", GARBAGE), ("garbage.jsonl",)),
    Case("prepare-input-truncated-json", prepare(), make_file("cut.json", json.dumps([{"question": "q", "answer": "a"}] * 3)[:30]),
         ("cut.json",)),
    Case("prepare-input-wrong-type", prepare(), make_file("num.json", "42"), ("num.json",)),
    Case("prepare-input-fields-renamed", prepare(),
         make_file("renamed.jsonl", "".join(json.dumps({"questionz": f"q{i}", "answerz": "a"}) + "\n" for i in range(4))),
         ("renamed.jsonl", "no trainable", "--input")),
    Case("prepare-input-gzip-garbage", prepare(), make_file("bad.jsonl.gz", GARBAGE), ("bad.jsonl.gz",)),
    Case("prepare-max-len-negative", prepare("--max-len", "-5"), None, ("--max-len",)),
    Case("prepare-eval-fraction-out-of-range", prepare("--eval-fraction", "1.5"), None, ("--eval-fraction",)),
    Case("prepare-limit-negative", prepare("--limit", "-1"), None, ("--limit",)),
    Case("prepare-max-new-tokens-zero", prepare("--regenerate", "--max-new-tokens", "0"), None, ("--max-new-tokens",)),
    Case("prepare-batch-size-zero", prepare("--regenerate", "--batch-size", "0"), None, ("--batch-size",)),
    Case("prepare-temperature-negative", prepare("--regenerate", "--temperature", "-1"), None, ("--temperature",)),
    Case("prepare-dtype-unknown", prepare("--dtype", "fp8"), None, ("--dtype", "fp8")),
    Case("prepare-device-unknown", prepare("--device", "tpu"), None, ("--device", "tpu")),
    Case("prepare-target-no-chat-template", prepare(target="notmpl"), None, ("chat template", "chat_template")),
    Case("prepare-target-missing", lambda e: prepare()({**e, "target": e["scratch"] / "no-target"}), None, ("no-target",)),
    Case("prepare-target-config-garbage", prepare(), cp("target", write(GARBAGE), "config.json"), ("config.json",)),
    Case("prepare-target-weights-missing", prepare("--regenerate"), cp("target", delete, "model.safetensors"),
         ("safetensors", "weights", "model")),
    Case("prepare-target-weights-truncated", prepare(), cp("target", truncate(0.5), "model.safetensors"),
         ("model.safetensors",)),
    Case("prepare-out-not-empty", prepare(), plant_out, ("--out", "out"), out_preexists=True),
    # ---- vocab build: prepared data
    Case("vbuild-data-missing", lambda e: vbuild()({**e, "prep": e["scratch"] / "nodata"}), None, ("nodata",)),
    Case("vbuild-manifest-missing", vbuild(), cp("prep", delete, "manifest.json"), ("manifest.json",)),
    Case("vbuild-manifest-garbage", vbuild(), cp("prep", write(GARBAGE), "manifest.json"), ("manifest.json",)),
    Case("vbuild-manifest-wrong-type", vbuild(), cp("prep", jreplace([1, 2]), "manifest.json"), ("manifest.json",)),
    Case("vbuild-manifest-field-missing", vbuild(), cp("prep", jdel("counts"), "manifest.json"), ("manifest.json",)),
    Case("vbuild-manifest-field-renamed", vbuild(), cp("prep", jrename("format", "fmt"), "manifest.json"),
         ("manifest.json",)),
    Case("vbuild-manifest-count-wrong-type", vbuild(), cp("prep", jset(counts={"train": "9", "eval": 3}),
                                                           "manifest.json"), ("manifest.json",)),
    Case("vbuild-samples-truncated", vbuild(), cp("prep", truncate(0.5), "train.jsonl"), ("train.jsonl",)),
    Case("vbuild-samples-garbage", vbuild(), cp("prep", write(GARBAGE), "train.jsonl"), ("train.jsonl",)),
    Case("vbuild-samples-missing", vbuild(), cp("prep", delete, "train.jsonl"), ("train.jsonl",)),
    Case("vbuild-sample-ids-wrong-type", vbuild(), cp("prep", sample_set(input_ids="1 2 3"), "train.jsonl"),
         ("train.jsonl",)),
    Case("vbuild-sample-mask-length", vbuild(), cp("prep", sample_set(loss_mask=[1]), "train.jsonl"), ("train.jsonl",)),
    Case("vbuild-sample-field-missing", vbuild(),
         cp("prep", prep_line(lambda ln: json.dumps({k: v for k, v in json.loads(ln).items() if k != "loss_mask"})),
            "train.jsonl"), ("train.jsonl",)),
    Case("vbuild-sample-id-beyond-vocab", vbuild(), cp("prep", sample_set(input_ids=[10**6] * 5, loss_mask=[1] * 5),
                                                         "train.jsonl"), ("train.jsonl", "token id", "prepare")),
    Case("vbuild-size-zero", lambda e: vbuild()(e)[:-2] + ["--size", "0"], None, ("--size", "size")),
    Case("vbuild-size-negative", lambda e: vbuild()(e)[:-2] + ["--size", "-3"], None, ("--size", "size")),
    Case("vbuild-size-bigger-than-target", lambda e: vbuild()(e)[:-2] + ["--size", "100000"], None, ("--size", "size")),
    Case("vbuild-target-mismatch", vbuild("--target", "T2"), None, ("fingerprint", "--target")),
    Case("vbuild-out-exists", vbuild(), lambda e, s: (e["out"].write_text("x"), e)[1], ("--out", "out"),
         out_preexists=True),
    # ---- vocab compare / remap: vocab files and checkpoints
    Case("vcompare-missing", vcompare(), lambda e, s: {**e, "vocab": s / "none.safetensors"}, ("none.safetensors",)),
    Case("vcompare-garbage", vcompare(), cp("vocab", write(GARBAGE)), ("vocab.safetensors",)),
    Case("vcompare-truncated", vcompare(), cp("vocab", truncate(0.6)), ("vocab.safetensors",)),
    Case("vcompare-header-corrupt", vcompare(), cp("vocab", st_header), ("vocab.safetensors",)),
    Case("vcompare-header-json-garbled", vcompare(), cp("vocab", st_json), ("vocab.safetensors",)),
    Case("vcompare-d2t-float", vcompare(), cp("vocab", st_set("d2t", lambda d: d.float())), ("vocab.safetensors",)),
    Case("vcompare-t2d-wrong-shape", vcompare(), cp("vocab", st_set("t2d", lambda t: t[:10])), ("vocab.safetensors",)),
    Case("vcompare-d2t-missing", vcompare(), cp("vocab", st_drop("d2t")), ("vocab.safetensors",)),
    Case("vcompare-d2t-absolute", vcompare(), absolute_d2t, ("vocab.safetensors",)),
    Case("vcompare-ckpt-no-weights", vcompare("ckpt", "vocab"), cp("ckpt", delete, "model.safetensors"), ("final",)),
    Case("vcompare-ckpt-header-corrupt", vcompare("ckpt", "vocab"), cp("ckpt", st_header, "model.safetensors"),
         ("model.safetensors",)),
    Case("vremap-drafter-missing", vremap(), lambda e, s: {**e, "ckpt": s / "gone"}, ("gone",)),
    Case("vremap-to-other-target", lambda e: vremap()({**e, "vocab_small": e["vocab"]}), big_vocab, ("big.safetensors", "--to")),
    Case("vremap-drafter-d2t-wrong-dtype", vremap(), cp("ckpt", st_set("d2t", lambda d: d.float()), "model.safetensors"),
         ("model.safetensors", "d2t")),
    Case("vremap-drafter-lmhead-shape", vremap(), cp("ckpt", st_set("lm_head.weight", lambda w: w[:5]),
                                                     "model.safetensors"), ("model.safetensors", "lm_head")),
    # ---- capture: data, flags, targets
    Case("capture-data-missing", lambda e: capture()({**e, "prep": e["scratch"] / "nodata"}), None, ("nodata",)),
    Case("capture-manifest-garbage", capture(), cp("prep", write(GARBAGE), "manifest.json"), ("manifest.json",)),
    Case("capture-samples-truncated", capture(), cp("prep", truncate(0.5), "train.jsonl"), ("train.jsonl",)),
    Case("capture-sample-id-beyond-vocab", capture(), cp("prep", sample_set(input_ids=[10**6] * 5, loss_mask=[1] * 5),
                                                          "train.jsonl"), ("train.jsonl", "vocab", "token")),
    Case("capture-data-other-target", capture(target="target2"), None, ("fingerprint", "--target", "manifest.json")),
    Case("capture-out-not-on-a-disk", lambda e: capture()({**e, "out": Path("/proc/eyas-out")}), None, ("/proc",)),
    Case("capture-layers-out-of-range", capture("--layers", "1,2,99"), None, ("--layers",)),
    Case("capture-layers-negative", capture("--layers", "-1,2,3"), None, ("--layers",)),
    Case("capture-layers-not-ints", capture("--layers", "a,b,c"), None, ("--layers",)),
    Case("capture-batch-tokens-zero", capture("--batch-tokens", "0"), None, ("--batch-tokens",)),
    Case("capture-shard-mb-negative", capture("--shard-mb", "-1"), None, ("--shard-mb",)),
    Case("capture-num-shards-zero", capture("--num-shards", "0"), None, ("--num-shards",)),
    Case("capture-shard-index-out-of-range", capture("--shard-index", "3", "--num-shards", "2"), None,
         ("--shard-index",)),
    Case("capture-target-config-missing", capture(), cp("target", delete, "config.json"), ("config.json",)),
    Case("capture-merge-part-missing", lambda e: ["capture", "merge", e["scratch"] / "p0", "--out", e["out"]], None,
         ("p0",)),
    Case("capture-merge-manifest-garbage", lambda e: ["capture", "merge", e["cap"], "--out", e["out"]],
         cp("cap", write(GARBAGE), "manifest.json"), ("manifest.json",)),
    Case("capture-import-source-missing", lambda e: ["capture", "import", e["scratch"] / "feats", "--from", "specforge",
                                                     "--target", e["target"], "--out", e["out"]], None, ("feats",)),
    Case("capture-import-source-empty", lambda e: ["capture", "import", e["scratch"] / "feats", "--from", "speculators",
                                                   "--target", e["target"], "--out", e["out"]],
         lambda e, s: ((s / "feats").mkdir(), e)[1], ("feats",)),
    # ---- train: flags
    Case("train-ttt-zero", train("--ttt", "0"), None, ("--ttt",)),
    Case("train-batch-tokens-negative", train("--batch-tokens", "-1"), None, ("--batch-tokens",)),
    Case("train-lr-zero", train("--lr", "0"), None, ("--lr",)),
    Case("train-max-len-one", train("--max-len", "1"), None, ("--max-len",)),
    Case("train-warmup-out-of-range", train("--warmup-ratio", "2"), None, ("--warmup-ratio",)),
    Case("train-max-steps-negative", train("--max-steps", "-4"), None, ("--max-steps",)),
    Case("train-epochs-zero", train("--epochs", "0"), None, ("--epochs 3",)),  # the example names the same flag
    Case("train-lr-inf", train("--lr", "inf"), None, ("--lr",)),
    Case("train-grad-clip-negative", train("--grad-clip", "-1"), None, ("--grad-clip",)),
    Case("train-weight-decay-nan", train("--weight-decay", "nan"), None, ("--weight-decay",)),
    Case("train-muon-with-fsdp", train("--fsdp"), None, ("--optimizer adamw",)),
    Case("train-vocab-is-a-directory", lambda e: train()({**e, "vocab": e["prep"]}), None, ("is a directory",)),
    Case("train-out-is-the-capture", train("--force"), lambda e, s: (_cp(e, "cap", s), {**e, "out": e["cap"]})[1], ("--capture",),
         out_preexists=True),
    # --force on an --out that is the target: the target must survive (it is loaded before the write)
    *[Case(f"{name}-out-is-the-target", argv, lambda e, s: (_cp(e, "target", s), {**e, "out": e["target"]})[1],
           ("--target",), out_preexists=True)
      for name, argv in (("train", train("--force")), ("capture", capture("--force")),
                         ("prepare", prepare("--force")),
                         ("export", lambda e: export("--target", e["target"], "--force")(e)),
                         ("vbuild", lambda e: vbuild("--target", e["target"], "--force")(
                             {**e, "out": Path(e["target"]) / "config.json"})))],
    Case("train-online-without-data", lambda e: ["train", "--target", e["target"], "--online", "--vocab", e["vocab"],
                                                 "--out", e["out"]], None, ("--data",)),
    Case("train-init-from-another-tokenizer", train_init(),
         cp("ckpt", json_edit(lambda o: o.update(tokenizer_fingerprint="0123456789abcdef")), "eyas.json"),
         ("tokenizer",)),
    Case("train-init-from-another-hidden-size", train_init(), wider_drafter, ("hidden 96",)),
    Case("train-remap-without-init", train("--remap"), None, ("--remap", "--init-from")),
    Case("train-out-holds-run", train(), lambda e, s: (copy_artifact(e["run"], s, "out"), e)[1], ("--out",),
         out_preexists=True),
    # ---- train: captures
    Case("train-capture-missing", lambda e: train()({**e, "cap": e["scratch"] / "nocap"}), None, ("nocap",)),
    Case("train-capture-manifest-garbage", train(), cp("cap", write(GARBAGE), "manifest.json"), ("manifest.json",)),
    Case("train-capture-manifest-wrong-type", train(), cp("cap", jreplace("cap"), "manifest.json"), ("manifest.json",)),
    Case("train-capture-manifest-field-missing", train(), cp("cap", jdel("layer_ids"), "manifest.json"),
         ("manifest.json",)),
    Case("train-capture-manifest-field-renamed", train(), cp("cap", jrename("hidden_size", "hidden"), "manifest.json"),
         ("manifest.json",)),
    Case("train-capture-manifest-hidden-negative", train(), cp("cap", jset(hidden_size=-64), "manifest.json"),
         ("manifest.json", "hidden")),
    Case("train-capture-shard-path-escapes", train(),
         cp("cap", json_edit(lambda m: m["shards"][0].update(file="../../shard-00000.safetensors")), "manifest.json"),
         ("manifest.json", "leaves")),
    Case("train-capture-shard-path-absolute", train(),
         cp("cap", json_edit(lambda m: m["shards"][0].update(file="/etc/passwd")), "manifest.json"),
         ("manifest.json", "leaves")),
    Case("train-capture-other-target", train(target="target2"), None, ("fingerprint", "manifest.json")),
    Case("train-capture-shard-header-corrupt", train(), cap_shard(st_header), ("shard-00000",)),
    Case("train-capture-shard-truncated", train(), cap_shard(truncate(0.5)), ("shard-00000",)),
    Case("train-capture-shard-garbage", train(), cap_shard(write(GARBAGE)), ("shard-00000",)),
    Case("train-capture-shard-missing", train(), cap_shard(delete), ("shard-00000",)),
    # ---- train: vocab and init checkpoints
    Case("train-vocab-missing", lambda e: train()({**e, "vocab": e["scratch"] / "novocab.safetensors"}), None,
         ("novocab.safetensors",)),
    Case("train-vocab-garbage", train(), cp("vocab", write(GARBAGE)), ("vocab.safetensors",)),
    Case("train-vocab-header-corrupt", train(), cp("vocab", st_header), ("vocab.safetensors",)),
    Case("train-vocab-bigger-than-target", train(), big_vocab, ("big.safetensors",)),
    Case("train-init-missing", lambda e: train_init()({**e, "ckpt": e["scratch"] / "noinit"}), None, ("noinit",)),
    Case("train-init-config-wrong-type", train_init(), cp("ckpt", jreplace([1]), "config.json"), ("config.json",)),
    Case("train-init-config-field-renamed", train_init(), cp("ckpt", jrename("hidden_size", "hiddenSize"),
                                                             "config.json"), ("config.json",)),
    Case("train-init-weights-wrong-shape", train_init(), cp("ckpt", st_set("fc.weight", lambda w: w[:, :10]),
                                                            "model.safetensors"), ("fc.weight", "model.safetensors")),
    Case("train-init-vocab-mismatch", lambda e: train_init()({**e, "vocab": e["vocab_small"]}), None, ("--remap",)),
    Case("train-init-bin-pickle-garbage", train_init(),
         lambda e, s: (delete(_cp(e, "ckpt", s) / "model.safetensors"), (e["ckpt"] / "pytorch_model.bin").write_bytes(GARBAGE),
                       e)[2], ("pytorch_model.bin", "model.safetensors")),
    # ---- export / convert
    Case("export-src-missing", lambda e: export()({**e, "ckpt": e["scratch"] / "noexp"}), None, ("noexp",)),
    Case("export-weights-header-corrupt", export(), cp("ckpt", st_header, "model.safetensors"), ("model.safetensors",)),
    Case("export-weights-truncated", export(), cp("ckpt", truncate(0.5), "model.safetensors"), ("model.safetensors",)),
    Case("export-config-missing", export(), cp("ckpt", delete, "config.json"), ("config.json", "final")),
    Case("export-config-garbage", export(), cp("ckpt", write(GARBAGE), "config.json"), ("config.json", "final")),
    Case("export-config-field-renamed", export(), cp("ckpt", jrename("draft_vocab_size", "n_draft"), "config.json"),
         ("config.json",)),
    Case("export-config-negative-size", export(), cp("ckpt", jset(hidden_size=-64), "config.json"), ("config.json",)),
    Case("export-d2t-wrong-shape", export(), cp("ckpt", st_set("d2t", lambda d: d[:5]), "model.safetensors"),
         ("d2t", "model.safetensors")),
    Case("export-out-inside-a-file", lambda e: export()({**e, "out": e["scratch"] / "f" / "sub"}),
         lambda e, s: ((s / "f").write_text("x"), e)[1], ("f: ", "not inside a file")),
    Case("export-target-missing", export("--target", "/nonexistent/tgt"), None, ("/nonexistent/tgt",)),
    Case("convert-src-missing", lambda e: convert()({**e, "sglang": e["scratch"] / "noconv"}), None, ("noconv",)),
    Case("convert-src-garbage", convert(), cp("sglang", write(GARBAGE), "model.safetensors"), ("model.safetensors",)),
    Case("convert-src-config-wrong-type", convert(), cp("sglang", jreplace("x"), "config.json"), ("config.json",)),
    Case("convert-src-weights-wrong-shape", convert(), cp("sglang", st_set("fc.weight", lambda w: w[:, :7]),
                                                          "model.safetensors"), ("fc.weight",)),
    # ---- doctor (bad usage / unreadable inputs)
    Case("doctor-ckpt-missing", lambda e: doctor()({**e, "ckpt": e["scratch"] / "nodoc"}), None, ("nodoc",)),
    Case("doctor-target-missing", doctor("--target", "/nonexistent/tgt"), None, ("/nonexistent/tgt",)),
    Case("doctor-device-unknown", lambda e: doctor("--target", e["target"], "--device", "tpu")(e), None,
         ("--device", "tpu")),
    Case("doctor-data-garbage", lambda e: doctor("--target", e["target"], "--data", e["prep"])(e),
         cp("prep", write(GARBAGE), "manifest.json"), ("manifest.json",)),
    Case("doctor-prompts-missing", lambda e: doctor("--target", e["target"], "--prompts", e["scratch"] / "p.jsonl")(e),
         None, ("p.jsonl",)),
    Case("doctor-weights-garbage", doctor(), cp("ckpt", write(GARBAGE), "model.safetensors"), ("model.safetensors",)),
    # ---- target
    Case("target-info-missing", lambda e: ["target", "info", e["scratch"] / "notarget"], None, ("notarget",)),
    Case("target-info-layers-negative", lambda e: ["target", "info", e["target"]],
         cp("target", jset(num_hidden_layers=-1), "config.json"), ("num_hidden_layers",)),
    Case("target-info-config-wrong-type", lambda e: ["target", "info", e["target"]], cp("target", jreplace([]), "config.json"),
         ("config.json",)),
]


XFAIL: dict[str, str] = {}  # case id -> reason, for known failures (none now)


def _param(c: Case):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[c.id])] if c.id in XFAIL else []
    return pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case, healthy, tmp_path, cli, monkeypatch):
    env = dict(healthy)
    env["T2"] = str(healthy["target2"])
    line = run_case(Case(case.id, _with_t2(case.argv), case.mutate, case.expect, case.code, case.out_preexists),
                    env, tmp_path / "scratch", cli)
    assert len(line) < 2000


def _with_t2(argv):
    return lambda e: [e["T2"] if a == "T2" else a for a in argv(e)]


def test_case_count():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)

"""Capture throughput on the real SmolLM2 target vs a plain forward of the same batches,
and bytes on disk per token: eyas shards vs the speculators offline layout.

Usage: EYAS_HOME=... python bench/bench_capture.py [--samples 100] [--dtype bf16] [--batch-tokens 4096]
Builds a prepared directory from GSM8K questions + answers rendered with the target's chat
template (assistant tokens supervised), then times `capture()` end to end (forward, copies,
shard writes, sha256) and a plain decoder-stack forward (no hooks, no logits) and a
full `model(..., output_hidden_states=True)` forward over the same length-sorted batches.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eyas import targets
from eyas.formats import capture as fcap
from eyas.core.batching import plan_capture_batches
from eyas.stages import capture as scap

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "grade-school-math__train.jsonl"


def make_prepared(out: Path, path: Path, tok, n: int) -> Path:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, r in enumerate(rows):
        msgs = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p_ids, ids = tok(prompt, add_special_tokens=False)["input_ids"], tok(full, add_special_tokens=False)["input_ids"]
        lines.append(json.dumps({"id": f"gsm8k-{k}", "source": "gsm8k", "category": "math", "messages": msgs,
                                 "input_ids": ids, "loss_mask": [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))}))
    n_eval = max(1, n // 10)
    (out / "train.jsonl").write_text("\n".join(lines[:-n_eval]) + "\n")
    (out / "eval.jsonl").write_text("\n".join(lines[-n_eval:]) + "\n")
    (out / "manifest.json").write_text(json.dumps({
        "format": "eyas.prepared", "version": 1, "target": str(path), "target_fingerprint": targets.fingerprint(path),
        "tokenizer_fingerprint": targets.tokenizer_fingerprint(tok), "chat_template_sha256": "", "max_len": 2048,
        "regenerated": False, "counts": {"train": n - n_eval, "eval": n_eval}, "sources": ["gsm8k"], "provenance": {}}))
    return out


def plain_forward(model, records, batch_tokens: int, full: bool) -> float:
    """Seconds for a forward over the same batches capture uses (no hooks)."""
    lengths = [len(r.input_ids) for r in records]
    stack = targets.find_decoder_stack(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in plan_capture_batches(list(range(len(records))), lengths, batch_tokens):
            T = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, : lengths[i]] = torch.tensor(records[i].input_ids)
                mask[b, : lengths[i]] = 1
            if full:
                model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            else:
                stack.base(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - t0


def du(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    path = targets.resolve("smollm2-135m")
    model, tok = targets.load(path, dtype=a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_prepared(tmp / "data", path, tok, a.samples)
        _, records = fcap.read_prepared(data)
        tokens = sum(len(r.input_ids) for r in records)
        plain_forward(model, records[:8], a.batch_tokens, False)  # warm-up
        common = {"target": str(path), "target_fingerprint": targets.fingerprint(path), "data": str(data),
                  "data_fingerprint": fcap.data_fingerprint(data), "layer_ids": targets.default_aux_layers(30),
                  "hidden_size": 576, "num_layers": 30, "dtype": a.dtype, "last_state": fcap.LAST_STATE,
                  "shard_mb": 512}
        res = {"samples": len(records), "tokens": tokens, "dtype": a.dtype, "batch_tokens": a.batch_tokens,
               "threads": torch.get_num_threads()}
        for rep in range(a.repeats):
            t_plain = plain_forward(model, records, a.batch_tokens, False)
            t_full = plain_forward(model, records, a.batch_tokens, True)
            out = tmp / f"cap{rep}"
            cfg = scap.CaptureConfig(str(path), data, out, dtype=a.dtype, batch_tokens=a.batch_tokens,
                                     format="eyas")
            t0 = time.perf_counter()
            scap.capture_records(model, records, common, cfg)
            t_cap = time.perf_counter() - t0
            res[f"run{rep}"] = r = {"plain_base_tok_s": tokens / t_plain, "full_hidden_states_tok_s": tokens / t_full,
                                "capture_tok_s": tokens / t_cap, "capture_vs_plain": t_plain / t_cap,
                                "capture_vs_full": t_full / t_cap}
            print(json.dumps(r), flush=True)
        spec = scap.CaptureConfig(str(path), data, tmp / "spec", dtype=a.dtype, batch_tokens=a.batch_tokens,
                                  format="speculators")
        t0 = time.perf_counter()
        scap.capture_records(model, records, common, spec)
        res["capture_with_speculators_layout_tok_s"] = tokens / (time.perf_counter() - t0)
        eyas_bytes = sum(f.stat().st_size for f in (tmp / "cap0").glob("shard-*.safetensors"))
        spec_bytes = du(tmp / "spec" / "speculators")
        res["bytes_per_token"] = {"eyas_shards": eyas_bytes / tokens, "speculators_layout": spec_bytes / tokens,
                                  "eyas_manifest_bytes": (tmp / "cap0" / "manifest.json").stat().st_size}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

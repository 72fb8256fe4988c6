"""CUDA checks on a real target, for a session that has a GPU (bench/device_run.sh runs it).

Identity: eyas chain and tree greedy decoding in fp32 on the device give exactly the tokens of
the target's own `generate()` on that device (an independent reference), for every prompt,
with a trained drafter (--drafter) or a random one with an 8k draft vocabulary.
Forward cost: one target forward appending T tokens to a KV cache of --context tokens, per
dtype, median of --repeats (CUDA-synchronised), and as a ratio to the 1-token forward: the
number that decides how many tokens a verification may carry on that device.
Decode (--decode STEPS): plain decoding and batched regeneration in bf16 with torch's cuDNN
attention allowed and disallowed (eyas disallows it on CUDA: `targets.avoid_cudnn_attention`).
Optimizer (--optim STEPS): the cost of one optimizer step, AdamW (fused) against Muon, on the
drafter eyas trains for this target (8k draft vocabulary), with random gradients, per dtype.

    python bench/gpu_check.py --device cuda --prompts mt.jsonl mbpp.jsonl --limit 10
    python bench/gpu_check.py --device cuda --target DIR --prompts mt.jsonl --profile 32
    python bench/gpu_check.py --device cuda --target DIR --prompts mt.jsonl --decode 64
    python bench/gpu_check.py --device cuda --optim 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eyas import runtime, targets
from eyas.config import build
from eyas.core.drafter import DrafterConfig, Eagle3Drafter
from eyas.stages import bench


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_drafter(cfg) -> Eagle3Drafter:
    """The target's drafter with an 8k (or smaller) draft vocabulary, random weights of seed 0."""
    torch.manual_seed(0)
    n = min(8192, cfg.vocab_size)
    return Eagle3Drafter(DrafterConfig.from_target(cfg, n, targets.default_aux_layers(cfg.num_hidden_layers)))


def drafter_for(model, path: str | None) -> runtime.LoadedDrafter:
    if path:
        return runtime.load_drafter(Path(path), model, "eyas", model.dtype)
    d = random_drafter(model.config)
    d.load_target_embedding(model.get_input_embeddings().weight.float().cpu())
    d = d.to(model.device, model.dtype).eval()
    ids = torch.arange(d.cfg.draft_vocab_size, device=model.device) + d.d2t
    return runtime.LoadedDrafter(d, list(d.cfg.aux_layer_ids), True, "strict", ids, "eyas", [])


def identity(tdir: Path, device: torch.device, drafter: str | None, prompts: list[dict], new_tokens: int,
             k: int, tree: str) -> dict:
    model, tok = targets.load(tdir, dtype="fp32", device=str(device))
    tr, dr = runtime.runners(model, drafter_for(model, drafter), runtime.Timer(device))
    eos = bench.eos_ids(model, tok)
    same = {"chain": 0, "tree": 0}
    accepted = {"chain": [], "tree": []}
    with torch.inference_mode():
        for p in prompts:
            ids = p["ids"].to(device)
            ref = model.generate(ids[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=list(eos),
                                 pad_token_id=eos[0])[0, ids.shape[0]:].tolist()
            for m in same:
                s = runtime.DecodeSettings(method=m, k=k, tree=bench.parse_tree(tree), max_new_tokens=new_tokens,
                                           eos_ids=tuple(eos))
                res = runtime.generate(tr, dr, p["ids"], s)
                same[m] += res.tokens == ref
                accepted[m] += res.accepted
                if res.tokens != ref:
                    print(f"MISMATCH {m} prompt {p['id']}: first difference at "
                          f"{next((i for i, (a, b) in enumerate(zip(res.tokens, ref)) if a != b), min(len(ref), len(res.tokens)))}")
    return {m: {"identical": same[m], "prompts": len(prompts),
                "acceptance_length": 1 + sum(accepted[m]) / max(1, len(accepted[m]))} for m in same}


def forward_cost(tdir: Path, device: torch.device, dtype: str, sizes: list[int], context: int,
                 repeats: int) -> dict[int, float]:
    model, _ = targets.load(tdir, dtype=dtype, device=str(device))
    tr, _ = runtime.runners(model, None, runtime.Timer(device))
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (context,))
    ms: dict[int, list[float]] = {T: [] for T in sizes}
    with torch.inference_mode():
        for _ in range(repeats):
            for T in sizes:  # sizes interleaved, so clock drift hits them alike
                tr.reset(context + T + 1)
                tr.forward(prompt, torch.arange(context), features=False)
                toks = torch.randint(0, V, (T,))
                sync(device)
                t0 = time.perf_counter()
                tr.forward(toks, context + torch.arange(T))
                sync(device)
                ms[T].append((time.perf_counter() - t0) * 1000)
    return {T: statistics.median(v) for T, v in ms.items()}


def profile_plain(tdir: Path, device: torch.device, dtype: str, prompt: torch.Tensor, steps: int) -> None:
    """Top operators of `steps` plain decoding forwards (torch.profiler), to find where a dtype
    loses time: the tiny target's bf16 decoding on an H200 ran 13x slower than fp32."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = targets.load(tdir, dtype=dtype, device=str(device))
    tr, _ = runtime.runners(model, None, runtime.Timer(device))
    s = runtime.DecodeSettings(method="plain", max_new_tokens=steps, eos_ids=())
    with torch.inference_mode():
        runtime.generate(tr, None, prompt, s)  # warm-up
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            res = runtime.generate(tr, None, prompt, s)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- {dtype}: {len(res.tokens)} tokens in {res.wall_s * 1000:.0f} ms")
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))


def decode_speed(tdir: Path, device: torch.device, prompts: list[dict], steps: int) -> dict:
    """Tokens/s of plain decoding (first prompt) and of `runtime.batched.decode_batch` (up to 32
    prompts) in bf16, cuDNN attention on and off. Each setting first warms up on shapes the timed
    run never meets (cuDNN keeps a plan per shape, so a repeated shape would hide its cost)."""
    from eyas.runtime.batched import decode_batch

    model, _ = targets.load(tdir, dtype="bf16", device=str(device))
    tr, _ = runtime.runners(model, None, runtime.Timer(device))
    prompt = prompts[0]["ids"]
    batch = [p["ids"].tolist() for p in prompts[:32]]
    out = {}
    with torch.inference_mode():
        for cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            runtime.generate(tr, None, prompt[:5], runtime.DecodeSettings(method="plain", max_new_tokens=4, eos_ids=()))
            decode_batch(model, [b[:5] for b in batch[:2]], 4, [])
            sync(device)
            t0 = time.perf_counter()
            res = runtime.generate(tr, None, prompt, runtime.DecodeSettings(method="plain", max_new_tokens=steps,
                                                                            eos_ids=()))
            sync(device)
            plain = len(res.tokens) / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            rows = decode_batch(model, batch, steps, [])
            sync(device)
            regen = sum(map(len, rows)) / (time.perf_counter() - t0)
            key = "cudnn_on" if cudnn else "cudnn_off"
            out[key] = {"plain_tok_s": round(plain, 1), "regen_tok_s": round(regen, 1), "regen_rows": len(batch)}
            print(f"bf16 {key}: plain {plain:.1f} tok/s, regeneration of {len(batch)} rows {regen:.1f} tok/s")
    targets.avoid_cudnn_attention()
    return out


def optimizer_cost(tdir: Path, device: torch.device, steps: int) -> dict:
    """Median ms of one optimizer step (after 5 warm-up steps) for each optimizer and training dtype."""
    from transformers import AutoConfig

    from eyas.core.optim import make_optimizer

    cfg = AutoConfig.from_pretrained(tdir)
    out = {}
    for dtype in ("bf16", "fp32"):
        for name in ("adamw", "muon"):
            d = random_drafter(cfg).to(device)
            opt = make_optimizer(d, name, 1e-4, dtype=dtype)
            params = [p for p in d.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            times = []
            for i in range(steps + 5):
                sync(device)
                t0 = time.perf_counter()
                opt.step()
                sync(device)
                if i >= 5:
                    times.append((time.perf_counter() - t0) * 1000)
            key = f"{dtype}_{name}"
            out[key] = round(statistics.median(times), 2)
            print(f"optimizer step, {key}: {out[key]:.2f} ms (median of {steps}; "
                  f"{sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=targets.DEFAULT_TARGET)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", default=None, help="checkpoint directory (default: a random 8k-vocab drafter)")
    ap.add_argument("--prompts", nargs="+", default=["builtin-eval"], help="prompt files, or builtin-eval with --data")
    ap.add_argument("--data", default=None, help="prepared data directory (for --prompts builtin-eval)")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tree", default="4,5,16")
    ap.add_argument("--sizes", default="1,2,4,8,16,24,32,64", help="forward sizes T ('' to skip)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="only profile STEPS plain decoding forwards in fp32 and bf16 (top operators)")
    ap.add_argument("--decode", type=int, default=0, metavar="STEPS",
                    help="only time STEPS steps of bf16 plain decoding and regeneration, cuDNN attention on and off")
    ap.add_argument("--optim", type=int, default=0, metavar="STEPS",
                    help="only time STEPS optimizer steps of the target's drafter, AdamW against Muon")
    a = ap.parse_args()
    device = targets.parse_device(a.device)
    tdir = targets.resolve(a.target)
    if a.optim:
        print(json.dumps(optimizer_cost(tdir, device, a.optim)))
        return
    _, tok = targets.load(tdir)
    prompts = bench.load_prompts(build(bench.BenchConfig, prompts=a.prompts, data=a.data, limit=a.limit), tok)
    if a.profile:
        for dtype in ("fp32", "bf16"):
            profile_plain(tdir, device, dtype, prompts[0]["ids"], a.profile)
        return
    if a.decode:
        print(json.dumps(decode_speed(tdir, device, prompts, a.decode)))
        return
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    t0 = time.perf_counter()
    result["identity_fp32"] = identity(tdir, device, a.drafter, prompts, a.max_new_tokens, a.k, a.tree)
    result["identity_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result["identity_fp32"]))
    sizes = [int(x) for x in a.sizes.split(",") if x]
    if sizes:
        result["forward_ms"] = {}
        for dtype in ("fp32", "bf16"):
            ms = forward_cost(tdir, device, dtype, sizes, a.context, a.repeats)
            result["forward_ms"][dtype] = ms
            print(f"{dtype}: " + "  ".join(f"T={T} {v:.2f} ms ({v / ms[sizes[0]]:.2f}x)" for T, v in ms.items()))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

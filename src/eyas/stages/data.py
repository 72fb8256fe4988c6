"""`eyas data prepare`: prompt files -> tokenized conversations with assistant-only loss
masks (optionally with answers written by the target), split into train/eval.

Orchestration only: file loading lives in `eyas.formats.prompts`, rendering and the
on-disk format in `eyas.formats.data`, generation in `eyas.runtime.regenerate`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from eyas import targets
from eyas.config import arg, command
from eyas.errors import EyasError
from eyas.formats import data as fdata
from eyas.formats import prompts as fprompts
from eyas.formats.prompt_records import Conversation
from eyas.stages.common import (TARGET_RUNNERS, atomic_dir, emit, provenance, refuse_out_over_inputs,
                               refuse_symlink_out, resolve_dtype)

log = logging.getLogger(__name__)
# prompts per regeneration batch on a CPU (`--batch-size` default). A decoding step's small matrix
# products cost nearly as much for 64 rows as for 128, so wider batches write more tokens per second
# (measured with `bench/bench_regenerate.py`: docs/cpu-performance.md).
REGEN_BATCH = 128
# The engine `--regenerate` uses unless told: eyas's own loop. It needs no engine start, which vLLM pays
# on every command; vLLM only overtakes it on large jobs (docs/scale.md, "What it costs").
DEFAULT_ENGINE = "eyas"

EPILOG = """\
input schemas (auto-detected per record; .json arrays, .jsonl, .txt, each optionally .gz;
tables: .parquet, .arrow, a datasets save_to_disk directory):
  schema    detected by                      user turn(s)                          answer (assistant)
  string    bare JSON string / .txt chunk    the string                            -
  openai    messages [{role, content}]       user messages (system kept)           assistant messages
  sharegpt  conversations [{from, value}]    from human/user (system kept)         from gpt/assistant/chatgpt
  mtbench   turns [str, ...]                 each turn, in order                   reference (one per turn)
  alpaca    instruction (+ input)            instruction + blank line + input      output or response
  selfinst  instruction + instances          instruction + instances[0].input      instances[0].output
  gsm8k     question                         question                              answer
  svamp     Body + Question                  Body + " " + Question                 - (Answer is a number)
  mbpp      text (+ test_list)               text + "Your code should pass..."     code
  prompt    prompt (HumanEval, arena-hard)   prompt                                completion or response
  builtin   --input builtin                  ~1,150 generated prompts (code, math, explanation, writing, qa,
                                             two-turn chat); prompt-only, use with --regenerate
  public    --input builtin-public           2,474 real public prompts shipped with eyas (MIT / Apache-2.0:
                                             GPTeacher, GSM8K, SVAMP, arena-hard, Open-Assistant,
                                             self-instruct; see eyas/data/PUBLIC_PROMPTS.md); --regenerate
  self      --self-prompts N (--regenerate)  N first-turn prompts the target writes itself (category chat)

Records without an answer are dropped unless --regenerate (then the target writes every
assistant turn, turn by turn). Duplicates (lowercased letters+digits of the user turns) are
dropped across files; malformed JSONL lines are repaired when harmless (raw control
characters, invalid \\ escapes, one record split over two lines) or skipped, and counted.
Category per record: the record's category/subcategory when it names a known one, else
from the file name (math, code, summarization, qa), else chat. The loss mask covers
assistant content and its end-of-turn token only. --regenerate work is kept in OUT.partial/
and reused by a rerun of the same command after an interruption.
"""


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """`eyas data prepare`: one field per flag."""

    target: str = arg("built-in name or local HF directory", targets.DEFAULT_TARGET)
    input: list[str] = arg("prompt files (.json/.jsonl/.txt, optionally .gz; .parquet/.arrow or a `datasets` "
                           "directory), `builtin` and/or `builtin-public` (prompts shipped with eyas)", [],
                           metavar="FILE")
    self_prompts: int = arg("with --regenerate: the target also writes N first-turn prompts itself (Magpie), "
                            "then answers them (default 0)", 0, metavar="N")
    out: Path = arg("output directory")
    max_len: int = arg("truncate samples to N tokens", 2048)
    exclude: list[str] = arg("held-out prompt files (e.g. your bench set): drop every conversation whose first "
                             "user turn matches one of theirs", [], metavar="FILE")
    limit: int | None = arg("keep the first N conversations after de-dup and --exclude", None)
    eval_fraction: float = arg("share of ids hashed into eval", 0.05)
    regenerate: bool = arg("let the target write all assistant turns", False)
    max_new_tokens: int | None = arg("per answer, with --regenerate (default 256)", None)
    batch_size: int | None = arg(f"prompts per batch, with --regenerate (default {REGEN_BATCH}; rows leave the "
                                 "batch as they finish)", None)
    temperature: float | None = arg("0 = greedy (default), with --regenerate", None)
    seed: int = arg("sampling seed (default 0)", 0)
    device: str = arg("cpu, cuda, cuda:N or auto", "cpu")
    dtype: str = arg("fp32, bf16, fp16 or auto (bf16 where the machine runs it natively, else fp32)", "fp32")
    force: bool = arg("replace an existing --out", False)
    engine: str = arg("with --regenerate: who runs the target: eyas (its own batched loop, this process) or vllm "
                      "(tensor / pipeline parallel, continuous batching; docs/scale.md)", DEFAULT_ENGINE,
                      choices=TARGET_RUNNERS)
    tensor_parallel_size: int = arg("with --engine vllm: vLLM's tensor_parallel_size", 1)
    pipeline_parallel_size: int = arg("with --engine vllm: vLLM's pipeline_parallel_size", 1)
    vllm_args: str | None = arg("with --engine vllm: other vllm.LLM keywords as a JSON object", None,
                                metavar="JSON")
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare training data", description="Prepare training data.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    command(dsub, "prepare", PrepareConfig, run_prepare, help="prompts/chats -> tokenized samples with loss masks",
            description="Render prompt files with the target's chat template into tokenized samples with "
            "assistant-only loss masks; optionally let the target write the answers (--regenerate).",
            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)


# ---------------------------------------------------------------- checks


def check(args: PrepareConfig) -> tuple[PrepareConfig, object]:
    """Exit 2 on flag values that cannot work; returns the config with the --regenerate defaults filled in
    and vLLM's engine settings (with --engine vllm, else None)."""
    if not args.input and not args.self_prompts:
        raise EyasError("no prompts: pass --input FILE... (or `builtin`, `builtin-public`) and/or "
                        "--self-prompts N with --regenerate")
    if args.self_prompts < 0:
        raise EyasError(f"--self-prompts {args.self_prompts}: must be >= 0, e.g. 2000")
    if args.self_prompts and not args.regenerate:
        raise EyasError("--self-prompts only applies to --regenerate (the target answers the prompts it "
                        "writes); add --regenerate")
    if args.max_len <= 0:
        raise EyasError(f"--max-len {args.max_len}: must be a positive number of tokens, e.g. 2048")
    if args.limit is not None and args.limit <= 0:
        raise EyasError(f"--limit {args.limit}: must be positive; leave it out to keep everything")
    if not 0 <= args.eval_fraction < 1:
        raise EyasError(f"--eval-fraction {args.eval_fraction}: must lie in [0, 1), e.g. 0.05")
    gen_flags = {"--max-new-tokens": args.max_new_tokens, "--batch-size": args.batch_size,
                 "--temperature": args.temperature}
    if not args.regenerate:
        given = [k for k, v in gen_flags.items() if v is not None]
        if given:
            raise EyasError(f"{given[0]} only applies to --regenerate; add --regenerate or drop {given[0]}")
    args = replace(args, max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
                   batch_size=REGEN_BATCH if args.batch_size is None else args.batch_size,
                   temperature=0.0 if args.temperature is None else args.temperature)
    if args.max_new_tokens <= 0:
        raise EyasError(f"--max-new-tokens {args.max_new_tokens}: must be positive, e.g. 256")
    if args.batch_size <= 0:
        raise EyasError(f"--batch-size {args.batch_size}: must be positive, e.g. {REGEN_BATCH} (the default)")
    if not 0 <= args.temperature < math.inf:
        raise EyasError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)")
    targets.parse_dtype(args.dtype)
    targets.parse_device(args.device)
    engine_args = _check_engine_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise EyasError(f"--out {out} is a file; prepared data is a directory: choose another path")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise EyasError(f"--out {out} exists and is not empty; pass --force to replace it or choose another path")
    refuse_out_over_inputs(out, {"--input": args.input, "--exclude": args.exclude,
                                 "--target": targets.local_dir(args.target)})
    refuse_symlink_out(out)
    return args, engine_args


def _check_engine_args(args: PrepareConfig):
    vllm_flags = {"--tensor-parallel-size": args.tensor_parallel_size != 1,
                  "--pipeline-parallel-size": args.pipeline_parallel_size != 1, "--vllm-args": args.vllm_args}
    if args.engine != "vllm":
        given = [k for k, v in vllm_flags.items() if v]
        if given:
            raise EyasError(f"{given[0]} only applies to --engine vllm; add --engine vllm or drop {given[0]}")
        return None
    from eyas.serve import vllm_engine
    from eyas.serve.vllm_jobs import parse_engine_args

    if not args.regenerate:
        raise EyasError("--engine vllm only applies to --regenerate (without it no model runs); add --regenerate")
    if args.self_prompts:
        raise EyasError(f"--self-prompts {args.self_prompts}: the target writes prompts with --engine eyas only; "
                        "drop --self-prompts or use --engine eyas")
    if args.device != "cpu":
        raise EyasError(f"--device {args.device}: with --engine vllm, vLLM picks its devices (CUDA GPUs, else the "
                        "CPU); drop --device")
    engine_args = parse_engine_args(args.dtype, args.tensor_parallel_size, args.pipeline_parallel_size,
                                    args.vllm_args)
    vllm_engine.require()
    return engine_args


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        raise EyasError(f"--target {path}: cannot load its tokenizer ({str(e).splitlines()[0]}); "
                        "save the tokenizer beside the model") from e
    _check_template(tok, path)
    return tok


def _check_template(tok, path: Path) -> None:
    if not getattr(tok, "chat_template", None):
        raise EyasError(f"--target {path}: the tokenizer has no chat template; use an instruct/chat model or "
                        "add `chat_template` to its tokenizer_config.json (or chat_template.jinja)")


# ---------------------------------------------------------------- stages


def _load_inputs(inputs: list[str]) -> tuple[list[Conversation], dict]:
    from eyas.formats.builtin_prompts import PUBLIC, SOURCE, builtin_prompts

    files = [PUBLIC if x == "builtin-public" else Path(x) for x in inputs if x != "builtin"]
    convs, stats = fprompts.load_prompt_files_with_stats(files, keywords=("builtin", "builtin-public"))
    if "builtin" in inputs:
        fprompts.add_conversations(convs, builtin_prompts(), stats, SOURCE)
    if inputs and not convs:
        raise EyasError(f"--input {' '.join(inputs)}: no prompts found; pass files with prompts, `builtin` "
                        "or `builtin-public`")
    return convs, stats


def _trim(conv: Conversation) -> Conversation | None:
    """Drop trailing turns after the last answer; None when nothing is answered."""
    last = max((i for i, t in enumerate(conv.turns) if t["role"] == "assistant"), default=-1)
    if last < 0:
        return None
    return Conversation(conv.id, conv.source, conv.category, conv.turns[: last + 1])


def _prompt_len(tok, conv: Conversation) -> int:
    first = []
    for t in conv.turns:
        first.append(t)
        if t["role"] == "user":
            break
    text = tok.apply_chat_template([t for t in first if t["role"] != "assistant"], tokenize=False,
                                   add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _regenerate(args: PrepareConfig, path: Path, convs: list[Conversation], stats: dict, held: set[str],
                drops: Counter, engine_args=None) -> tuple[list[Conversation], dict]:
    from eyas.runtime.regenerate import GenSettings, regenerate

    if args.engine == "vllm":
        return _regenerate_vllm(args, path, convs, drops, engine_args)

    model, tok = targets.load(path, dtype=args.dtype, device=args.device)
    packed = targets.prepack_for_decoding(model)  # fp32 CPU: faster batched decoding, same answers
    _check_template(tok, path)
    self_info = None
    if args.self_prompts:
        convs, self_info = _self_prompts(args, path, model, tok, convs, stats, held)
    room = min(args.max_len, targets.max_positions(model.config) - args.max_new_tokens)
    keep = []
    for c in convs:
        if _prompt_len(tok, c) >= room:
            drops["too_long"] += 1
        else:
            keep.append(c)
    if not keep:
        raise EyasError(f"--max-len {args.max_len}: every prompt is longer than the room left for an answer; "
                        "raise --max-len or lower --max-new-tokens")
    settings = GenSettings(args.max_new_tokens, args.batch_size, args.temperature, args.seed)
    stop = fdata.end_of_turn_ids(tok)
    out, st = regenerate(model, tok, keep, settings, _work_dir(args.out), targets.fingerprint(path), stop,
                         progress=os.environ.get("EYAS_NO_PROGRESS") != "1")
    info = {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
            "temperature": args.temperature, "seed": args.seed, "dtype": args.dtype, "device": args.device,
            "new_tokens": st.new_tokens, "seconds": round(st.seconds, 2),
            "tokens_per_s": round(st.tokens_per_s, 2), "batches_generated": st.batches_done,
            "batches_reused": st.batches_reused, "turns_cut_for_context": st.cut_turns,
            "self_prompts": self_info, "prepacked_linears": packed}
    return out, info


def _fitting(tok, convs: list[Conversation], room: int, max_len: int, drops: Counter) -> list[Conversation]:
    keep = [c for c in convs if _prompt_len(tok, c) < room]
    drops["too_long"] += len(convs) - len(keep)
    if not keep:
        raise EyasError(f"--max-len {max_len}: every prompt is longer than the room left for an answer; "
                        "raise --max-len or lower --max-new-tokens")
    return keep


def _regenerate_vllm(args: PrepareConfig, path: Path, convs: list[Conversation], drops: Counter,
                     engine_args) -> tuple[list[Conversation], dict]:
    """`--regenerate --engine vllm`: the same settings and work file through `serve.vllm_generate`;
    the target is never loaded here (it may need several GPUs)."""
    from eyas.runtime.regenerate import GenSettings
    from eyas.serve import vllm_generate

    tok = _load_tokenizer(path)
    room = min(args.max_len, targets.max_positions(targets.load_config(path)) - args.max_new_tokens)
    keep = _fitting(tok, convs, room, args.max_len, drops)
    settings = GenSettings(args.max_new_tokens, args.batch_size, args.temperature, args.seed)
    out, st = vllm_generate.regenerate(path, keep, settings, _work_dir(args.out), targets.fingerprint(path),
                                       fdata.end_of_turn_ids(tok), engine_args,
                                       progress=os.environ.get("EYAS_NO_PROGRESS") != "1")
    e = engine_args
    info = {"engine": "vllm", "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
            "temperature": args.temperature, "seed": args.seed, "dtype": e.dtype,
            "tensor_parallel_size": e.tensor_parallel_size, "pipeline_parallel_size": e.pipeline_parallel_size,
            "vllm_args": e.extra, "new_tokens": st.new_tokens, "seconds": round(st.seconds, 2),
            "tokens_per_s": round(st.tokens_per_s, 2), "batches_generated": st.batches_done,
            "batches_reused": st.batches_reused, "turns_cut_for_context": st.cut_turns, "self_prompts": None}
    return out, info


def _self_prompts(args, path: Path, model, tok, convs: list[Conversation], stats: dict,
                  held: set[str]) -> tuple[list[Conversation], dict]:
    """Add `--self-prompts` prompts written by the target (distinct from the loaded ones and
    from --exclude's) to `convs`, as source `self`."""
    from eyas.runtime.regenerate import SELF_SETTINGS, SELF_SOURCE, write_prompts

    settings = replace(SELF_SETTINGS, batch_size=args.batch_size, seed=args.seed)
    taken = {fprompts.dedup_key(c) for c in convs} | held
    new, st = write_prompts(model, tok, args.self_prompts, settings, _work_dir(args.out, "self"),
                            targets.fingerprint(path), fdata.end_of_turn_ids(tok), taken,
                            progress=os.environ.get("EYAS_NO_PROGRESS") != "1")
    if len(new) < args.self_prompts:
        log.warning("--self-prompts %d: the target wrote only %d distinct usable prompts", args.self_prompts, len(new))
    convs = list(convs)
    fprompts.add_conversations(convs, new, stats, SELF_SOURCE)
    return convs, {"asked": args.self_prompts, "written": len(new), "temperature": settings.temperature,
                   "max_new_tokens": settings.max_new_tokens, "new_tokens": st.new_tokens,
                   "seconds": round(st.seconds, 2), "batches_generated": st.batches_done,
                   "batches_reused": st.batches_reused}


def _work_dir(out: Path, part: str = "") -> Path:
    out = Path(out)
    return out.with_name(out.name + (f".{part}" if part else "") + ".partial")


def _render(tok, convs: list[Conversation], max_len: int, drops: Counter) -> list[fdata.Sample]:
    from jinja2 import TemplateError

    samples = []
    for c in convs:
        try:
            ids, mask = fdata.render_masked(tok, c.turns)
        except fdata.TemplateMismatch as e:
            log.debug("%s: %s", c.id, e)
            drops["template_mismatch"] += 1
            continue
        except TemplateError as e:  # e.g. a template that insists on alternating roles
            log.debug("%s: %s", c.id, e)
            drops["template_error"] += 1
            continue
        ids, mask = ids[:max_len], mask[:max_len]
        if not any(mask):
            drops["truncated_away"] += 1
            continue
        samples.append(fdata.Sample(c.id, c.source, c.category, c.turns, ids, mask))
    return samples


def run_prepare(args: PrepareConfig) -> int:
    args, engine_args = check(resolve_dtype(args, targets.fast_dtype))  # auto: bf16 where native, else fp32
    path = targets.resolve(args.target)
    tok = _load_tokenizer(path)
    convs, stats = _load_inputs(args.input)
    n_loaded = len(convs)
    drops: Counter = Counter()
    held: set[str] = set()
    if args.exclude:
        held = {fprompts.first_turn_key(c)
                for c in fprompts.load_prompt_files([Path(x) for x in args.exclude], dedup=False, flag="--exclude")}
        kept = [c for c in convs if fprompts.first_turn_key(c) not in held]
        drops["excluded"] = len(convs) - len(kept)
        convs = kept
        if not convs and not args.self_prompts:
            raise EyasError(f"--exclude {' '.join(args.exclude)}: it holds every prompt of --input; nothing left")
    if args.limit is not None:
        convs = convs[: args.limit]
    gen_info = None
    if args.regenerate:
        convs, gen_info = _regenerate(args, path, convs, stats, held, drops, engine_args)
    trimmed = []
    for c in convs:
        t = _trim(c)
        if t is None:
            drops["no_answer"] += 1
        else:
            trimmed.append(t)
    samples = _render(tok, trimmed, args.max_len, drops)
    if not samples:
        hint = ("they have no assistant answers; pass --regenerate to let the target write them"
                if drops["no_answer"] else
                f"every sample lost its answer to --max-len {args.max_len}: raise it" if drops["truncated_away"]
                else "see the dropped counts with --json")
        what = f"--input {' '.join(args.input)}" if args.input else f"--self-prompts {args.self_prompts}"
        raise EyasError(f"{what}: no trainable samples ({dict(drops)}); {hint}")
    splits: dict[str, list] = {"train": [], "eval": []}
    for s in samples:
        splits[fdata.split_of(s.id, args.eval_fraction)].append(s)
    summary = _summary(args, path, stats, n_loaded, splits, drops, gen_info)
    manifest = _manifest(args, path, tok, stats, splits, summary, gen_info)
    with atomic_dir(args.out, force=args.force) as tmp:
        fdata.write_prepared(tmp, manifest, splits)
    shutil.rmtree(_work_dir(args.out), ignore_errors=True)
    shutil.rmtree(_work_dir(args.out, "self"), ignore_errors=True)
    emit(args, summary, _human(summary))
    return 0


def _summary(args, path, stats, n_loaded, splits, drops, gen_info) -> dict:
    per_source: dict[str, dict] = {name: st.as_dict() for name, st in stats.items()}
    per_cat: dict[str, int] = defaultdict(int)
    for split in splits.values():
        for s in split:
            per_source[s.source]["samples"] = per_source[s.source].get("samples", 0) + 1
            per_cat[s.category] += 1
    everything = splits["train"] + splits["eval"]
    return {
        "out": str(args.out), "target": str(path), "regenerated": args.regenerate,
        "prompts_loaded": n_loaded, "limit": args.limit,
        "counts": {"train": len(splits["train"]), "eval": len(splits["eval"])},
        "categories": dict(sorted(per_cat.items())),
        "malformed": sum(st.malformed for st in stats.values()),
        "repaired_lines": sum(st.repaired for st in stats.values()),
        "dropped": {"duplicates": sum(st.duplicates for st in stats.values()),
                    "no_prompt": sum(st.no_prompt for st in stats.values()), **dict(drops)},
        "tokens": sum(len(s.input_ids) for s in everything),
        "supervised_tokens": sum(s.supervised for s in everything),
        "sources": per_source, "regeneration": gen_info,
    }


def _manifest(args, path, tok, stats, splits, summary, gen_info) -> dict:
    return {
        "target": str(path), "target_fingerprint": targets.fingerprint(path),
        "tokenizer_fingerprint": targets.tokenizer_fingerprint(tok),
        "chat_template_sha256": fdata.chat_template_sha256(tok), "max_len": args.max_len,
        "regenerated": bool(args.regenerate), "eval_fraction": args.eval_fraction,
        "counts": {**summary["counts"], "tokens": summary["tokens"],
                   "supervised_tokens": summary["supervised_tokens"]},
        "categories": summary["categories"],
        "sources": [{"name": name, **st.as_dict(), "samples": summary["sources"][name].get("samples", 0)}
                    for name, st in stats.items()],
        "dropped": summary["dropped"], "generation": gen_info, "provenance": provenance(args),
    }


def _human(s: dict) -> str:
    lines = [f"wrote {s['out']}: {s['counts']['train']} train + {s['counts']['eval']} eval samples, "
             f"{s['tokens']} tokens ({s['supervised_tokens']} supervised)"]
    dropped = {k: v for k, v in s["dropped"].items() if v}
    if dropped:
        lines.append("dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
        if dropped.get("no_answer"):
            lines.append("  (no_answer: prompt-only records; pass --regenerate to let the target answer them)")
    if s["malformed"]:
        lines.append(f"malformed records skipped: {s['malformed']}")
    if s["regeneration"]:
        g = s["regeneration"]
        lines.append(f"regenerated: {g['new_tokens']} new tokens in {g['seconds']} s ({g['tokens_per_s']} tok/s, "
                     f"batch {g['batch_size']}), {g['batches_reused']} batches reused")
    lines.append("per category: " + ", ".join(f"{k} {v}" for k, v in s["categories"].items()))
    return "\n".join(lines)

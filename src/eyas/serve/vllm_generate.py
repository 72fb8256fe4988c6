"""Regeneration through vLLM (`eyas data prepare --regenerate --engine vllm`): the target, served
by vLLM with its tensor / pipeline parallelism and continuous batching, writes every assistant
turn; the answers land in the same work file, in the same form, as eyas's own loop
(`eyas.runtime.regenerate`), so the rest of `data prepare` cannot tell the engines apart.

Work is cut into chunks of `--batch-size` conversations in input order (vLLM needs no batching
by length: it pads nothing). A chunk is handed to vLLM turn by turn (every conversation's first
user turn in one `generate` call, then the second turns with the target's first answers in
their history, ...) and appended to the work file when all its turns are answered; a rerun
reuses finished chunks. Prompts are rendered and answers decoded by eyas with the target's
tokenizer exactly as `eyas.runtime.regenerate` does, and vLLM stops only at eyas's end-of-turn ids
(`ignore_eos`: the generation config's extra EOS ids do not apply), so both engines answer the
same prompts under the same rules. Sampling (`--temperature` > 0) seeds each request from
(seed, conversation id, turn): a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from eyas.formats.prompts import Conversation
from eyas.formats.work import WorkFile
from eyas.runtime.regenerate import (GenSettings, GenStats, answer_turns, prompt_ids, prompt_turns, with_answers,
                                     work_key)
from eyas.serve import vllm_jobs
from eyas.serve.vllm_jobs import EngineArgs

log = logging.getLogger(__name__)
ENGINE_KEY = "vllm"  # joins the work key: answers of the two engines are not interchangeable


def regenerate(target: Path, convs: list[Conversation], settings: GenSettings, work_dir: Path,
               fingerprint: str, stop_ids: list[int], engine: EngineArgs,
               progress: bool = True) -> tuple[list[Conversation], GenStats]:
    """Conversations whose assistant turns vLLM wrote (input order) and stats; resumable."""
    key = _key(fingerprint, engine, settings, convs)
    WorkFile(work_dir, key)  # clears stale work before the job appends to it
    job = {"target": str(target), "convs": [_conv_json(c) for c in convs], "settings": asdict(settings),
           "work_dir": str(work_dir), "key": key, "stop_ids": stop_ids, "progress": progress,
           "engine": vllm_jobs.engine_to_job(engine)}
    got = vllm_jobs.run_child(__name__, job, Path(work_dir) / "vllm-job.json")
    work = WorkFile(work_dir, key)
    out: list[Conversation] = []
    for b, chunk in enumerate(_chunks(len(convs), settings.batch_size)):
        rec = work.done.get(b)
        if rec is None or rec["ids"] != [convs[i].id for i in chunk]:
            raise AssertionError(f"vLLM job finished without chunk {b} in {work.path}")
        out += [with_answers(convs[i], ans) for i, ans in zip(chunk, rec["answers"])]
    stats = GenStats(**got["stats"])
    return out, stats


def _key(fingerprint: str, engine: EngineArgs, settings: GenSettings, convs: list[Conversation]) -> str:
    # Parallel sizes stay out: a run resumed on another GPU count may reuse what is done.
    return work_key(f"{fingerprint}|{ENGINE_KEY}|{engine.dtype}", settings, convs)


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(a, min(a + size, n))) for a in range(0, n, size)]


def _conv_json(c: Conversation) -> dict:
    return {"id": c.id, "source": c.source, "category": c.category, "turns": c.turns}


# ---------------------------------------------------------------- the child process


def _job(job: dict) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from eyas import targets

    target = Path(job["target"])
    settings = GenSettings(**job["settings"])
    convs = [Conversation(**c) for c in job["convs"]]
    work = WorkFile(Path(job["work_dir"]), job["key"])
    chunks = _chunks(len(convs), settings.batch_size)
    todo = [b for b, chunk in enumerate(chunks) if work.done.get(b, {}).get("ids") != [convs[i].id for i in chunk]]
    stats = GenStats(batches_reused=len(chunks) - len(todo))
    stats.cut_turns = sum(work.done[b].get("cut", 0) for b in range(len(chunks)) if b not in todo)
    if not todo:
        return {"stats": asdict(stats)}
    tok = AutoTokenizer.from_pretrained(target)
    limit = targets.max_positions(targets.load_config(target))
    budget = [settings.max_new_tokens * sum(t["role"] == "user" for i in chunks[b] for t in prompt_turns(convs[i]))
              for b in todo]
    llm = vllm_jobs.make_llm(target, vllm_jobs.engine_from_job(job), seed=settings.seed)
    bar = tqdm(total=sum(budget), desc="regenerate (vLLM)", unit="tok", unit_scale=True,
               disable=not job["progress"], dynamic_ncols=True)
    try:
        for b, cap in zip(todo, budget):
            start, cut_before = bar.n, stats.cut_turns
            t0 = time.perf_counter()
            answers = _answer_chunk(llm, tok, [convs[i] for i in chunks[b]], settings, job["stop_ids"], limit,
                                    stats, bar)
            stats.seconds += time.perf_counter() - t0
            stats.batches_done += 1
            work.append({"batch": b, "ids": [convs[i].id for i in chunks[b]], "answers": answers,
                         "cut": stats.cut_turns - cut_before})
            bar.update(start + cap - bar.n)  # answers that stopped early: the chunk's whole budget is spent
            bar.set_postfix(chunk=f"{b + 1}/{len(chunks)}", tok_s=f"{stats.tokens_per_s:.1f}")
    finally:
        bar.close()
    return {"stats": asdict(stats)}


def _answer_chunk(llm, tok, convs: list[Conversation], settings: GenSettings, stop_ids: list[int], limit: int,
                  stats: GenStats, bar) -> list[list[str]]:
    """Answer every user turn of `convs` by eyas's rules (`runtime.regenerate.answer_turns`), one
    vLLM `generate` call per turn round."""
    def generate(fits: list[int], histories: list[list[dict]], turn: int) -> tuple[list[str], int]:
        rows = _generate(llm, [prompt_ids(tok, h) for h in histories],
                         [_seed(settings, convs[i].id, turn) for i in fits], settings, stop_ids)
        n = sum(len(r) for r in rows)
        bar.update(n)
        return [tok.decode([t for t in row if t not in stop_ids], skip_special_tokens=True) for row in rows], n

    return answer_turns(tok, convs, settings, limit, stats, generate)


def _generate(llm, prompts: list[list[int]], seeds: list[int], settings: GenSettings,
              stop_ids: list[int]) -> list[list[int]]:
    """vLLM's answer token ids per prompt, up to and including the first stop id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                             seed=s if settings.temperature > 0 else None, stop_token_ids=stop_ids,
                             ignore_eos=True, detokenize=False) for s in seeds]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        row = list(o.outputs[0].token_ids)
        cut = next((k for k, t in enumerate(row) if t in stop_ids), None)
        rows.append(row if cut is None else row[:cut + 1])
    return rows


def _seed(settings: GenSettings, conv_id: str, turn: int) -> int:
    h = hashlib.sha256(f"{settings.seed}|{conv_id}|{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm_jobs.child_main(_job)

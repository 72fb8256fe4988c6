"""Regeneration: the target writes the assistant turns itself (EAGLE-3 trains the drafter
on the target's own distribution, not on the dataset's answers).

Batched decoding (`runtime.batched.decode_batch`: one preallocated KV cache, left padding, prompts
of similar length batched together, finished rows leaving the batch); greedy unless a temperature
is given. Multi-turn conversations are answered turn by turn, each turn seeing the target's
earlier answers. Resumable: every finished batch is appended (and fsynced) to
`<work_dir>/batches.jsonl` (`formats.work.WorkFile`); a rerun with the same target, prompts and
settings reuses them and generates the rest. Each batch seeds its own sampler, so a resumed run
writes exactly what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.core.batching import plan_generation_batches
from eyas.errors import EyasError
from eyas.formats.prompt_records import Conversation
from eyas.formats.prompts import dedup_key
from eyas.formats.work import WORK_VERSION, WorkFile
from eyas.runtime.batched import decode_batch


@dataclass(frozen=True)
class GenSettings:
    """Generation settings; all of them (and the prompts) key the resumable work file."""

    max_new_tokens: int = 256
    batch_size: int = 8
    temperature: float = 0.0
    seed: int = 0


@dataclass
class GenStats:
    new_tokens: int = 0
    seconds: float = 0.0
    batches_done: int = 0
    batches_reused: int = 0
    cut_turns: int = 0  # later turns left out because prompt + answer would not fit the context

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def prompt_turns(conv: Conversation) -> list[dict]:
    """The conversation without its assistant turns (the target writes those)."""
    return [t for t in conv.turns if t["role"] != "assistant"]


def work_key(fingerprint: str, settings: GenSettings, convs: list[Conversation]) -> str:
    h = hashlib.sha256(json.dumps([WORK_VERSION, fingerprint, asdict(settings)]).encode())
    for c in convs:
        h.update(json.dumps([c.id, prompt_turns(c)], ensure_ascii=False).encode())
    return h.hexdigest()


def seed_batch(settings: GenSettings, b: int) -> None:
    """Seed torch's global RNG for batch b alone, so a resumed run samples what an
    uninterrupted one would."""
    torch.manual_seed(settings.seed * 1_000_003 + b)


def prompt_ids(tokenizer, history: list[dict]) -> list[int]:
    """Token ids the target is prompted with for the next assistant turn of `history`."""
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_batch(model, tokenizer, histories: list[list[dict]], settings: GenSettings,
                   stop_ids: list[int], tick: Callable[[int], None] | None = None) -> tuple[list[str], int]:
    """One generation step for a batch of conversations ending in a user turn.

    Returns the decoded answers (up to the first stop token) and the number of new tokens.
    """
    prompts = [prompt_ids(tokenizer, h) for h in histories]
    rows = decode_batch(model, prompts, settings.max_new_tokens, stop_ids, settings.temperature, tick)
    answers = [tokenizer.decode([t for t in row if t not in stop_ids], skip_special_tokens=True) for row in rows]
    return answers, sum(len(row) for row in rows)


def answer_turns(tokenizer, convs: list[Conversation], settings: GenSettings, limit: int, stats: GenStats,
                 generate: Callable[[list[int], list[list[dict]], int], tuple[list[str], int]]) -> list[list[str]]:
    """Answer every user turn of `convs`, turn by turn, the same for every engine: each round hands
    the conversations that still have a user turn, and whose prompt + answer fit the target's
    `limit` positions, to `generate(indices, histories, round) -> (answers, new tokens)`; a turn that
    does not fit is cut together with the rest of its conversation."""
    histories: list[list[dict]] = [[] for _ in convs]
    pending = [prompt_turns(c) for c in convs]
    answers: list[list[str]] = [[] for _ in convs]
    for turn in itertools.count():
        fits = []
        for i, turns in enumerate(pending):
            while turns and turns[0]["role"] != "user":
                histories[i].append(turns.pop(0))
            if not turns:
                continue
            histories[i].append(turns.pop(0))
            if too_long(tokenizer, histories[i], settings.max_new_tokens, limit):
                stats.cut_turns += 1  # keep the turns answered so far
                histories[i].pop()
                pending[i] = []
            else:
                fits.append(i)
        if not fits:
            return answers
        texts, n = generate(fits, [histories[i] for i in fits], turn)
        stats.new_tokens += n
        for i, text in zip(fits, texts):
            answers[i].append(text)
            histories[i].append({"role": "assistant", "content": text})
    return answers


def too_long(tokenizer, history: list[dict], max_new_tokens: int, limit: int) -> bool:
    """Whether prompt + answer would exceed the target's positions (characters bound tokens
    from above for the tokenizers we know, so the cheap test comes first)."""
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    if len(text) + max_new_tokens <= limit:
        return False
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + max_new_tokens > limit


def opening_tokens(tokenizer, conv: Conversation) -> int:
    """Prompt tokens of a conversation's first generation step (its turns up to the first user turn)."""
    turns = prompt_turns(conv)
    first = next((k for k, t in enumerate(turns) if t["role"] == "user"), None)
    if first is None:
        return 0
    return len(prompt_ids(tokenizer, turns[:first + 1]))


def regenerate(model, tokenizer, convs: list[Conversation], settings: GenSettings, work_dir: Path,
               fingerprint: str, stop_ids: list[int], progress: bool = True) -> tuple[list[Conversation], GenStats]:
    """Conversations whose assistant turns the target wrote, in input order, and stats."""
    from tqdm.auto import tqdm

    work = WorkFile(work_dir, work_key(fingerprint, settings, convs))
    stats = GenStats()
    from eyas import targets

    limit = targets.max_positions(model.config)
    # Batches of similar prompt length: a left-padded batch pays for its longest prompt in every
    # row. Answers go back to input order below.
    batches = plan_generation_batches([opening_tokens(tokenizer, c) for c in convs], settings.batch_size)
    n_batches = len(batches)
    # Progress in answer tokens against the budget (max_new_tokens per user turn): each step ticks
    # the tokens it wrote, each finished batch tops the bar up to its whole budget (answers that
    # stopped early), so the bar moves every step and ends full. Batch count in the postfix.
    budget = [settings.max_new_tokens * sum(t["role"] == "user" for i in batches[b] for t in prompt_turns(convs[i]))
              for b in range(n_batches)]
    upto = list(itertools.accumulate(budget))  # the bar's position once batch b is done
    bar = tqdm(total=upto[-1] if upto else 0, desc="regenerate", unit="tok", unit_scale=True, disable=not progress,
               dynamic_ncols=True)
    try:
        for b in range(n_batches):
            batch = [convs[i] for i in batches[b]]
            if b in work.done and work.done[b]["ids"] == [c.id for c in batch]:
                stats.batches_reused += 1
                stats.cut_turns += work.done[b].get("cut", 0)  # a property of the data, not of this run
                bar.update(upto[b] - bar.n)
                continue
            seed_batch(settings, b)
            t0 = time.perf_counter()
            cut_before = stats.cut_turns
            def tick(n: int, b: int = b) -> None:
                bar.update(min(n, upto[b] - bar.n))

            answers = answer_turns(tokenizer, batch, settings, limit, stats,
                                   lambda _, hs, __: generate_batch(model, tokenizer, hs, settings, stop_ids, tick))
            stats.seconds += time.perf_counter() - t0
            stats.batches_done += 1
            work.append({"batch": b, "ids": [c.id for c in batch], "answers": answers,
                         "cut": stats.cut_turns - cut_before})
            bar.set_postfix(batch=f"{b + 1}/{n_batches}", tok_s=f"{stats.tokens_per_s:.1f}")
            bar.update(upto[b] - bar.n)
    finally:
        bar.close()
    out: list[Conversation | None] = [None] * len(convs)
    for b in range(n_batches):
        for i, ans in zip(batches[b], work.done[b]["answers"]):
            out[i] = with_answers(convs[i], ans)
    return out, stats


SELF_SOURCE = "self"
SELF_SETTINGS = GenSettings(max_new_tokens=128, batch_size=64, temperature=0.9)


def user_turn_opening(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the text of a first user message begins
    (with the template's default system prompt, if it has one)."""
    mark = "\x00eyas-user\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if mark not in text:
        raise EyasError("the target's chat template does not show the user's message verbatim; "
                        "--self-prompts cannot find where a user turn starts")
    return tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]


def write_prompts(model, tokenizer, n: int, settings: GenSettings, work_dir: Path, fingerprint: str,
                  stop_ids: list[int], taken: set[str], progress: bool = True) -> tuple[list[Conversation], GenStats]:
    """`n` first-turn prompts the target writes itself, the Magpie recipe (Xu et al., 2024):
    sample from the chat template's opening of a user turn, so the prompts follow the target's
    own idea of a user, in its chat style. A sample counts when it ends with an end-of-turn
    token within `settings.max_new_tokens`, has at least 3 words and is new (de-dup key not in
    `taken` nor among earlier samples). Batch b is seeded by `seed_batch` and appended to
    `work_dir`'s work file, so a rerun reuses it and writes the same prompts.
    Fewer than `n` come back only if 4x the needed batches could not find them."""
    from tqdm.auto import tqdm

    opening = user_turn_opening(tokenizer)
    key = hashlib.sha256(json.dumps([WORK_VERSION, "self", fingerprint, asdict(settings), n, opening]).encode())
    work = WorkFile(work_dir, key.hexdigest())
    stats, seen, out = GenStats(), set(taken), []
    B = settings.batch_size
    max_batches = 4 * -(-n // B) + 4
    bar = tqdm(total=n, desc="write prompts", unit="prompt", disable=not progress, dynamic_ncols=True)
    try:
        for b in range(max_batches):
            if len(out) >= n:
                break
            if b in work.done:
                texts = work.done[b]["texts"]
                stats.batches_reused += 1
            else:
                seed_batch(settings, b)
                t0 = time.perf_counter()
                rows = decode_batch(model, [opening] * B, settings.max_new_tokens, stop_ids, settings.temperature)
                stats.seconds += time.perf_counter() - t0
                stats.new_tokens += sum(len(r) for r in rows)
                stats.batches_done += 1
                texts = [tokenizer.decode(r[:-1], skip_special_tokens=True).strip() if r and r[-1] in stop_ids
                         else None for r in rows]
                work.append({"batch": b, "texts": texts})
            for text in texts:
                if not text or len(text.split()) < 3 or len(out) >= n:
                    continue
                conv = Conversation(f"{SELF_SOURCE}:{len(out)}", SELF_SOURCE, "chat",
                                    [{"role": "user", "content": text}])
                key = dedup_key(conv)
                if key not in seen:
                    seen.add(key)
                    out.append(conv)
                    bar.update(1)
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}")
    finally:
        bar.close()
    return out, stats


def with_answers(conv: Conversation, answers: list[str]) -> Conversation:
    """Interleave the target's answers after the user turns they answer (unanswered turns dropped)."""
    turns, k = [], 0
    for t in prompt_turns(conv):
        if t["role"] == "user":
            if k >= len(answers):
                break
            turns += [t, {"role": "assistant", "content": answers[k]}]
            k += 1
        else:
            turns.append(t)
    return Conversation(id=conv.id, source=conv.source, category=conv.category, turns=turns)

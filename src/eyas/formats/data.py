"""Prepared data (`eyas data prepare` output): chat rendering with assistant-only loss
masks, and the on-disk format (write, read, validate).

Directory layout: `manifest.json`, `train.jsonl`, `eval.jsonl`. Each JSONL line is
`{"id", "source", "category", "messages", "input_ids", "loss_mask"}` where `messages` is
the whole conversation (assistant turns included) and `loss_mask[t] == 1` marks the
tokens of assistant content and the end-of-turn token that closes it (never the role
header, never the template's text between turns).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from eyas.errors import EyasError

FORMAT = "eyas.prepared"
VERSION = 1
SPLITS = ("train", "eval")
MANIFEST_KEYS = {"format": str, "version": int, "target": str, "target_fingerprint": str,
                 "tokenizer_fingerprint": str, "chat_template_sha256": str, "max_len": int,
                 "regenerated": bool, "counts": dict, "sources": list, "provenance": dict}
SAMPLE_KEYS = ("id", "source", "category", "messages", "input_ids", "loss_mask")


@dataclass
class Sample:
    """One tokenized conversation."""

    id: str
    source: str
    category: str
    messages: list[dict]
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def supervised(self) -> int:
        return sum(self.loss_mask)


# ---------------------------------------------------------------- rendering + masks


class TemplateMismatch(Exception):
    """A chat template rendered a conversation in a way the mask cannot follow."""


def chat_template_sha256(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()


def special_ids(tokenizer) -> set[int]:
    """Ids of special tokens (end-of-turn markers are among them in every chat template we know)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _template(tokenizer, messages: list[dict], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def render_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_assistant_content) pieces.

    The start of each assistant turn is found by rendering the prefix before it with the
    generation prompt (which must be a prefix of the full rendering: this is what the target
    sees at inference), so default system prompts and role headers stay unsupervised.
    """
    full = _template(tokenizer, messages, gen=False)
    segments, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _template(tokenizer, messages[:i], gen=True)
        if not full.startswith(prefix) or len(prefix) < pos:
            raise TemplateMismatch(f"the rendering up to assistant turn {i} is not a prefix of the full rendering")
        start = len(prefix)
        content = m["content"]
        if not full.startswith(content, start):
            content = content.strip()  # some templates trim message content
            if not full.startswith(content, start):
                raise TemplateMismatch(f"assistant turn {i} content does not follow its header verbatim")
        segments += [(full[pos:start], False), (content, True)]
        pos = start + len(content)
    segments.append((full[pos:], False))
    return segments


def render_masked(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation rendered with the tokenizer's chat template.

    Each piece is tokenized on its own, as at inference where the target's answer tokens
    follow the tokenized generation prompt. The token right after an assistant piece is
    supervised too when it is a special token (the end-of-turn marker, e.g. `<|im_end|>`).
    """
    specials = special_ids(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    after_assistant = False
    for text, supervised in render_segments(tokenizer, messages):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        m = [int(supervised)] * len(piece)
        if after_assistant and piece and piece[0] in specials:
            m[0] = 1
        ids += piece
        mask += m
        after_assistant = supervised
    return ids, mask


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the template's end-of-turn token and EOS."""
    ids, mask = render_masked(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    masked = [t for t, m in zip(ids, mask) if m]
    out = [masked[-1]] if masked and masked[-1] in special_ids(tokenizer) else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in out:
        out.append(tokenizer.eos_token_id)
    return out


def split_of(sample_id: str, eval_fraction: float) -> str:
    """Deterministic split by hashed id: `eval` iff hash/2**64 < eval_fraction."""
    h = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")
    return "eval" if h / 2**64 < eval_fraction else "train"


# ---------------------------------------------------------------- writing


def write_prepared(out: Path, manifest: dict, samples: dict[str, list[Sample]]) -> None:
    """Write `train.jsonl`, `eval.jsonl` and `manifest.json` into `out` (a fresh directory)."""
    out = Path(out)
    for split in SPLITS:
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for s in samples.get(split, []):
                f.write(json.dumps(asdict(s), ensure_ascii=False, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    _check_manifest(manifest, out / "manifest.json")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n")


# ---------------------------------------------------------------- reading


def _check_manifest(m, path: Path) -> None:
    fix = "re-run `eyas data prepare` to rebuild it"
    if not isinstance(m, dict):
        raise EyasError(f"{path}: not a JSON object; {fix}")
    if m.get("format") != FORMAT:
        raise EyasError(f"{path}: format {m.get('format')!r} is not {FORMAT!r}; pass a directory made by "
                        "`eyas data prepare`")
    if m.get("version") != VERSION:
        raise EyasError(f"{path}: version {m.get('version')!r} is not supported (expected {VERSION}); {fix}")
    for key, typ in MANIFEST_KEYS.items():
        if not isinstance(m.get(key), typ) or (typ is int and isinstance(m.get(key), bool)):
            raise EyasError(f"{path}: field {key!r} missing or not {typ.__name__}; {fix}")
    for split in SPLITS:
        if not isinstance(m["counts"].get(split), int):
            raise EyasError(f"{path}: counts.{split} missing; {fix}")


def read_manifest(dir: Path) -> dict:
    """Load and validate `manifest.json` of a prepared-data directory."""
    path = Path(dir) / "manifest.json"
    if not path.is_file():
        raise EyasError(f"{path}: missing; pass a directory made by `eyas data prepare`")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{path}: corrupt JSON ({e}); re-run `eyas data prepare`") from e
    _check_manifest(m, path)
    return m


def _parse_sample(line: str, path: Path, lineno: int) -> Sample:
    where = f"{path} line {lineno}"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise EyasError(f"{where}: corrupt JSON ({e.msg}); re-run `eyas data prepare`") from e
    if not isinstance(d, dict) or any(k not in d for k in SAMPLE_KEYS):
        raise EyasError(f"{where}: expected keys {', '.join(SAMPLE_KEYS)}; re-run `eyas data prepare`")
    ids, mask = d["input_ids"], d["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or not ids:
        raise EyasError(f"{where}: input_ids and loss_mask must be non-empty lists of equal length; "
                        "re-run `eyas data prepare`")
    if any(type(t) is not int or t < 0 for t in ids) or any(m not in (0, 1) or type(m) is not int for m in mask):
        raise EyasError(f"{where}: input_ids must be non-negative ints and loss_mask 0/1; re-run `eyas data prepare`")
    return Sample(**{k: d[k] for k in SAMPLE_KEYS})


def read_samples(dir: Path, split: str = "train") -> list[Sample]:
    """All samples of one split, validated against the manifest's count."""
    if split not in SPLITS:
        raise EyasError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    manifest = read_manifest(dir)
    path = Path(dir) / f"{split}.jsonl"
    if not path.is_file():
        raise EyasError(f"{path}: missing; re-run `eyas data prepare`")
    samples = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    samples.append(_parse_sample(line, path, lineno))
    except UnicodeDecodeError as e:
        raise EyasError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); the file is corrupt, "
                        "re-run `eyas data prepare`") from e
    if len(samples) != manifest["counts"][split]:
        raise EyasError(f"{path}: {len(samples)} samples but manifest.json says {manifest['counts'][split]}; "
                        "the directory is incomplete, re-run `eyas data prepare`")
    return samples

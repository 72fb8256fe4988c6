"""Loading a drafter checkpoint for decoding, as eyas runs it or as a serving engine would load
and feed it (`--engine sglang|vllm`: `formats.engines.engine_reading` says what that engine reads)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas import targets
from eyas.core.drafter import Eagle3Drafter
from eyas.errors import EyasError
from eyas.formats.engines import EYAS, RUNTIME_ENGINES

log = logging.getLogger(__name__)

ENGINES = RUNTIME_ENGINES


@dataclass
class LoadedDrafter:
    drafter: Eagle3Drafter
    aux_ids: list[int]
    use_aux: bool
    fuse: str
    target_ids: torch.Tensor
    engine: str
    notes: list[str]
    missing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def load_drafter(ckpt: Path, target_model, engine: str = "eyas", dtype: torch.dtype = torch.float32,
                 seed: int = 0, target_dir: Path | None = None) -> LoadedDrafter:
    """The drafter as eyas runs it (`engine="eyas"`), or as SGLang / vLLM would load and feed it."""
    from eyas.formats.checkpoint import load_checkpoint

    emb = target_model.get_input_embeddings().weight
    dev = emb.device
    if not Path(ckpt).is_dir():
        raise EyasError(f"drafter {ckpt} is not a checkpoint directory; pass the directory that holds "
                        "config.json and model.safetensors (e.g. RUN/final)")
    if engine == EYAS:
        d, _ = load_checkpoint(Path(ckpt))
        _check_compat(d, target_model, ckpt)  # before the embedding: a wrong target names itself
        d.load_target_embedding(emb.float())
        d = d.to(dev, dtype).eval()
        ids = torch.arange(d.cfg.draft_vocab_size, device=dev) + d.d2t
        return LoadedDrafter(d, list(d.cfg.aux_layer_ids), True, "strict", ids, engine, [])
    if engine not in ENGINES:
        raise EyasError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    try:
        from eyas.formats.engines import engine_reading
    except ImportError as e:
        raise EyasError(f"--engine {engine}: engine emulation needs eyas.formats.engines ({e})") from e
    reading = engine_reading(Path(ckpt), engine, target_dir)
    if getattr(reading, "errors", None):
        raise EyasError(f"--engine {engine}: the engine would refuse to start with {ckpt}: "
                        + "; ".join(reading.errors))
    return drafter_from_reading(reading, target_model, dtype, seed)


def drafter_from_reading(reading, target_model, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedDrafter:
    """Build what an engine would run from an `EngineReading`: keys it finds are loaded, the
    missing ones keep a (seeded) random init, d2t is read as that engine reads it, aux
    states are captured at the engine's layer ids or not at all."""
    emb = target_model.get_input_embeddings().weight
    cfg, (V, H) = reading.config, emb.shape
    for what, mine, theirs in (("vocab_size", cfg.vocab_size, V), ("target_hidden_size", cfg.target_hidden_size, H)):
        if mine != theirs:  # the engine would not load it beside this target either
            raise EyasError(f"--engine {reading.engine}: the drafter's {what} is {mine}, the target's {theirs}; "
                            "pass the drafter trained for this target")
    n_aux, fc_in = len(reading.aux_layer_ids_hf or []), len(cfg.aux_layer_ids) * cfg.target_hidden_size
    if reading.use_aux and n_aux * H != fc_in:  # the engine's first draft step would fail on fc
        raise EyasError(f"--engine {reading.engine}: it captures {n_aux} aux layers x {H}, fc takes {fc_in}; "
                        "pass the drafter trained for this target")
    torch.manual_seed(seed)
    d = Eagle3Drafter(reading.config)
    own = d.state_dict()
    state = {k: v for k, v in reading.state.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    misfit = sorted(k for k in reading.state if k in own and k not in state)
    d.load_state_dict(state, strict=False)
    d.load_target_embedding(emb.float())
    d = d.to(emb.device, dtype).eval()
    N, V = reading.config.draft_vocab_size, emb.shape[0]
    raw = d.d2t
    ids = raw if not reading.d2t_as_offsets else torch.arange(N, device=raw.device) + raw
    ids = ids.clamp(0, V - 1)  # an engine would index out of range here; keep the emulation running
    use_aux = bool(reading.use_aux)
    aux = list(reading.aux_layer_ids_hf or []) if use_aux else []
    notes = list(reading.notes)
    if misfit:
        notes.append(f"keys whose shape does not fit the engine's config stay random: {misfit[:6]}")
    if not use_aux:
        notes.append(f"{reading.engine} captures no aux states: the drafter gets the {emb.shape[1]}-wide final "
                     "state, `hidden.shape[-1] != embeds.shape[-1]` is false and fc is skipped")
    return LoadedDrafter(d, aux, use_aux, "engine", ids, reading.engine, notes,
                         list(reading.missing), list(reading.skipped))


def _check_compat(d: Eagle3Drafter, model, ckpt) -> None:
    tcfg = targets.text_config(model.config)
    V, H = model.get_input_embeddings().weight.shape
    if d.cfg.vocab_size != V:
        raise EyasError(f"drafter {ckpt}: vocab_size {d.cfg.vocab_size} != target's {V}; "
                        "pass the drafter trained for this target")
    if d.cfg.target_hidden_size != H:
        raise EyasError(f"drafter {ckpt}: target_hidden_size {d.cfg.target_hidden_size} != target's {H}; "
                        "pass the drafter trained for this target")
    L = tcfg.num_hidden_layers
    bad = [i for i in d.cfg.aux_layer_ids if not 0 <= i <= L]
    if bad:
        raise EyasError(f"drafter {ckpt}: aux layer ids {bad} do not exist in a {L}-layer target")

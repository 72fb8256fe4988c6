"""The static check of an export: the problems in an engine's reading of a directory that make
it load the drafter broken (what `eyas export` refuses to write, and what `bench --serve`
checks before serving)."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.core.drafter import DrafterConfig
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats.engines.reading import EngineReading, engine_reading, num_layers, target_config
from eyas.formats.engines.spec import EYAS, spec

SHARED_FIELDS = ("rms_norm_eps", "rope_parameters", "max_position_embeddings")  # copied from the target
SIZE_FIELDS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "draft_vocab_size")


def max_aux_id(engine: str, layers: int) -> int:
    """The largest HF-index aux id `engine` captures from a target of `layers` layers (spec.py:
    vLLM captures 0..L, its id L being the last layer's output before the final norm; SGLang
    captures the input of layer i for id i, 0..L-1)."""
    return spec(engine).aux.max_id(layers)


def config_differences(r: EngineReading, want: DrafterConfig) -> list[tuple[str, object, object]]:
    """(field, what the engine reads, what the drafter was trained with) for every config field
    the engine builds the drafter from that differs: sizes, the fields shared with the target,
    and the peer flags this engine implements."""
    fields = (*SIZE_FIELDS, *SHARED_FIELDS, *spec(r.engine).flags)
    return [(f, getattr(r.config, f), getattr(want, f)) for f in fields if getattr(r.config, f) != getattr(want, f)]


def _compare_config(r: EngineReading, want: DrafterConfig, resolved: bool) -> list[str]:
    e = r.engine
    out = [f"{e} reads {f}={got!r} but the drafter has {w!r}" for f, got, w in config_differences(r, want)]
    if r.aux_layer_ids_hf is None:
        if not resolved:
            out.append(f"{e} would capture its default aux layers [2, L//2, L-3], but the drafter was "
                       f"trained on {want.aux_layer_ids}: write the ids into config.json")
    elif list(r.aux_layer_ids_hf) != list(want.aux_layer_ids):
        out.append(f"{e} would capture HF layers {r.aux_layer_ids_hf} but the drafter was trained on "
                   f"{want.aux_layer_ids} (off-by-one convention?)")
    return out


def _late_ids(engine: str, ids: list[int], layers: int) -> list[str]:
    late = [i for i in ids if i >= layers]
    if not late:
        return []
    top = max_aux_id(engine, layers)
    before = f"; its id {layers} is the last layer's output before the final norm" if top == layers else ""
    return [f"aux ids {late}: HF index {layers} is the final-norm output, which {engine} never captures "
            f"({engine} captures ids 0..{top}{before}), so fc would not get the states it was trained on; "
            "train on ids below it"]


def static_check(out_dir: Path, engine: str, expected: DrafterConfig | None = None,
                 target: Path | None = None) -> list[str]:
    """Problems that make `engine` load `out_dir` broken (empty list: it would load as intended).
    `expected` defaults to the drafter config recorded in the directory's eyas.json."""
    out_dir = Path(out_dir)
    if engine == EYAS:
        try:
            ckpt_io.load_checkpoint(out_dir)
        except EyasError as e:
            return [str(e)]
        return []
    if expected is None and (out_dir / "eyas.json").is_file():
        rec = ckpt_io.read_json(out_dir / "eyas.json").get("drafter_config")
        expected = DrafterConfig.from_dict(rec) if rec else None
    tdir = Path(target) if target is not None else None
    tc = target_config(tdir)
    layers = num_layers(tc)
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
    if layers is not None:
        problems += _late_ids(engine, ids, layers)
    if expected is not None:
        problems += _compare_config(r, expected, layers is not None)
    return problems


def reading_summary(r: EngineReading) -> dict:
    """A JSON-able view of an EngineReading (for --json and doctor)."""
    return {"engine": r.engine, "config": r.config.to_dict(), "keys": sorted(r.state), "missing": r.missing,
            "skipped": r.skipped, "aux_layer_ids_hf": r.aux_layer_ids_hf, "use_aux": r.use_aux,
            "d2t_as_offsets": r.d2t_as_offsets, "notes": r.notes, "errors": r.errors}

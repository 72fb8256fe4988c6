"""`eyas export` and `eyas convert`: write a drafter in a serving engine's layout, or move
a drafter between layouts, and refuse (exit 1, nothing written) one that the chosen engine
would load broken. Orchestration only; the formats live in eyas.formats.engines."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from eyas import targets
from eyas.config import arg, command
from eyas.errors import EyasError, FindingsError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats import engines
from eyas.stages.common import atomic_dir, emit, provenance, refuse_out_over_inputs

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """`eyas export`: an eyas checkpoint (or a training run) to an engine layout."""

    run: str = arg("eyas checkpoint directory, or a training run directory with best/ or final/", positional=True)
    to: str = arg("output format", choices=engines.ENGINES)
    out: Path = arg("output directory (must be new or empty unless --force)")
    target: str | None = arg("target directory or built-in name: adds embed_tokens.weight where the format needs "
                             "it, resolves default aux layers, and is the speculators verifier path", None)
    force: bool = arg("replace --out and write even when static checks fail", False)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class ConvertConfig:
    """`eyas convert`: a drafter from any layout to another."""

    src: str = arg("drafter directory (eyas, SGLang/SpecForge/EAGLE midlayer.*, speculators, vLLM)", positional=True)
    layout: str | None = arg("input layout (default: detected)", None, flag="--from", choices=engines.LAYOUTS)
    to: str = arg("output format", choices=engines.LAYOUTS)
    out: Path = arg("output directory (must be new or empty unless --force)")
    target: str | None = arg("target directory or built-in name: adds embed_tokens.weight where the format needs "
                             "it, resolves default aux layers, and is the speculators verifier path", None)
    max_positions: int | None = arg("write max_position_embeddings N (vLLM drafts nothing past the drafter's "
                                    "field; with default RoPE nothing else reads it)", None)
    force: bool = arg("replace --out and write even when static checks fail", False)
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    command(sub, "export", ExportConfig, run_export, help="write an eyas drafter for SGLang, vLLM, speculators or "
            "SpecForge/EAGLE", description="Export an eyas checkpoint (or a training run directory: its best/, "
            "else final/) to an engine layout, then check it the way that engine would load it; a checkpoint that "
            "would load broken is refused (exit 1, nothing written) unless --force.")
    command(sub, "convert", ConvertConfig, run_convert, help="convert a drafter between eyas, SGLang, vLLM, "
            "speculators, EAGLE layouts", description="Read a drafter in any supported layout (detected, or "
            "--from) strictly and write it as --to FORMAT, then run the static checks for that format.")


def pick_checkpoint(run: Path) -> tuple[Path, str]:
    """An eyas checkpoint directory for RUN (`formats.checkpoint.resolve_drafter`), which must be in
    eyas's layout (other layouts: `eyas convert`)."""
    ckpt, picked = ckpt_io.resolve_drafter(run)
    if not ckpt_io.is_eyas_checkpoint(ckpt):
        raise EyasError(f"{ckpt} is not an eyas checkpoint (layout {engines.detect_layout(ckpt)}); "
                        "use `eyas convert` for other layouts")
    return ckpt, picked


def run_export(args: ExportConfig) -> int:
    ckpt, picked = pick_checkpoint(args.run)
    return _write(args, ckpt, "eyas", args.to, picked)


def run_convert(args: ConvertConfig) -> int:
    layout = args.layout or engines.detect_layout(Path(args.src))
    return _write(args, Path(args.src), layout, args.to, f"layout {layout}")


def _write(args, src: Path, layout: str, fmt: str, picked: str) -> int:
    summary = write_export(src, layout, fmt, Path(args.out), target=args.target, force=args.force, args=args,
                           max_positions=getattr(args, "max_positions", None))
    summary["picked"] = picked
    human = [f"wrote {summary['out']} ({fmt}) from {src} ({picked}); aux layers (HF index) "
             f"{summary['aux_layer_ids_hf']}"]
    human += [f"  warning: {p}" for p in summary["problems"]] + [f"  note: {n}" for n in summary["notes"]]
    if fmt in SERVED_BY_VLLM:
        line = vllm_line(Path(summary["out"]), args.target)
        summary["vllm"] = {"speculative_config": line.speculative_config, "python": line.python, "cli": line.cli,
                           "rule": line.rule}
        human += ["serve it in vLLM (" + line.rule + "):", f"  {line.python}", f"  {line.cli}"]
    emit(args, summary, "\n".join(human))
    return 0


SERVED_BY_VLLM = ("vllm", "speculators")  # layouts vLLM's eagle3 method loads as they are


def vllm_line(drafter_dir: Path, target):
    """The vLLM invocation for an exported drafter, with the default k (nothing measured yet)."""
    from eyas.serve import vllm_engine

    tdir = targets.resolve(str(target)) if target else None
    return vllm_engine.deployment_line(tdir or "TARGET", Path(drafter_dir).resolve())


def write_export(src: Path, layout: str, fmt: str, out: Path, *, target=None, force: bool = False,
                 args=None, max_positions: int | None = None) -> dict:
    """Write `src` (in `layout`) to `out` as `fmt`, then check it as that engine would load it;
    refuses (FindingsError, nothing written) a drafter the engine would load broken unless `force`.
    `max_positions` replaces the drafter's max_position_embeddings. Returns the summary `eyas export
    --json` prints."""
    tdir = targets.resolve(str(target)) if target else None
    cfg, state, imported = engines.import_checkpoint(src, layout, target=tdir)
    if max_positions is not None:
        rope = cfg.rope_parameters.get("rope_type", "default")
        if max_positions < 1 or rope != "default":
            raise EyasError(f"--max-positions {max_positions}: " + ("must be positive" if max_positions < 1 else
                            f"the drafter's RoPE ({rope}) reads max_position_embeddings, so changing it changes "
                            "the function it was trained as; serve with --max-model-len at most its value instead"))
        cfg = replace(cfg, max_position_embeddings=max_positions)
    meta = {"source": str(src), "source_layout": layout, "aux_layer_ids_source": imported.get("aux_layer_ids_source"),
            **({"trained": imported["eyas"]} if "eyas" in imported else {}), "provenance": provenance(args)}
    refuse_out_over_inputs(out, {"source": src, "--target": targets.local_dir(target)})
    with atomic_dir(out, force=force) as tmp:
        notes = engines.write_layout(cfg, state, fmt, tmp, target=tdir, meta=meta)
        notes += [imported["note"]] if imported.get("note") else []
        problems = engines.static_check(tmp, fmt, expected=cfg, target=tdir)
        other = targets.trained_for_other(src, tdir) if tdir else None
        problems += [f"{other}: pass the drafter's own --target"] if other else []
        if fmt != engines.EYAS:
            notes += engines.engine_reading(tmp, fmt, tdir).notes
        if problems and not force:
            raise FindingsError(f"refused to write {out} for {fmt}: " + "; ".join(problems)
                                + " (fix the drafter, or pass --force to write it anyway)")
    return {"source": str(src), "from": layout, "to": fmt, "out": str(out),
            "aux_layer_ids_hf": list(cfg.aux_layer_ids), "problems": problems, "notes": notes}

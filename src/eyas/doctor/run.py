"""Wiring of the doctor's checks into one report (no argument parsing, no printing)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from eyas.doctor import dynamic, head_check, positions, static, vocab_check, with_target
from eyas.doctor.findings import INFO, Report, make
from eyas.doctor.reading import detect_layout, engine_views, read_raw
from eyas.formats import engines
from eyas.formats.engines import SERVING

log = logging.getLogger(__name__)
ALL_ENGINES = SERVING  # one list of engines, owned by eyas.formats.engines


@dataclass
class DoctorOptions:
    ckpt: Path
    target: str | None = None
    engines: tuple[str, ...] = ALL_ENGINES
    explicit_engine: bool = False
    data: Path | None = None
    against: Path | None = None
    prompts: list[Path] | None = None
    num_prompts: int = 8
    new_tokens: int = 32
    steps: int = 5
    decode: bool = True  # also decode for real through eyas.runtime (cross-check)
    device: str = "cpu"  # where the target runs (the drafter's teacher-forced checks stay on the CPU)
    max_model_len: int | None = None  # the context served (None: the target's max_position_embeddings)


def diagnose(opt: DoctorOptions) -> Report:
    raw = read_raw(opt.ckpt)
    layout, why = detect_layout(raw)
    rep = Report(str(opt.ckpt), layout)
    rep.add(make("EYAS-LAYOUT", f"layout {layout}; weights {raw.weights_file.name}; {len(raw.tensors)} tensors",
                 evidence={"layout": layout, "weights": str(raw.weights_file)}))
    if layout == "unknown":
        rep.add(make("EYAS-LAYOUT-UNKNOWN", why, evidence={"keys": sorted(raw.tensors)[:10]},
                     cause="no engine finds an EAGLE-3 decoder layer under names it maps (every engine refuses "
                     "it or runs the layer random).", fix="pass an EAGLE-3 drafter checkpoint directory, or rename "
                     "the layer to midlayer.* (eyas convert)"))
        return rep
    views, failed = engine_views(raw, list(opt.engines))
    # With `--engine all`, problems under engines that do not serve this layout as it is are warnings
    # (it is converted before it is served there); naming an engine with `--engine` makes them errors.
    strict = set(opt.engines) if opt.explicit_engine else set(engines.native_engines(layout))
    rep.measurements["engines"] = {e: _view_summary(r) for e, r in views.items()}
    rep.extend(static.check_finite(raw))
    rep.extend(static.check_shapes(raw, layout))
    rep.extend(static.check_vocab_maps(raw, list(opt.engines)))
    rep.findings = head_check.reconcile(rep.findings, head_check.check_recorded(raw), raw.path)
    rep.extend(static.check_init(raw, layout))
    rep.extend(static.check_dtypes(raw))
    if layout == engines.EYAS:
        rep.add(make("EYAS-LAYOUT", "eyas layout: engines read it after `eyas export --to ENGINE`; engine key and "
                     "aux-id checks apply to the export", severity=INFO))
    else:
        fs = static.check_keys(raw, views) + static.check_engine_errors(views, failed) + \
            static.check_aux(raw, layout, views) + static.check_shared_fields(raw, views)
        rep.extend(_soften(fs, strict, layout))
    if layout != engines.EYAS:  # an eyas checkpoint is checked after export, where the engine reads it
        target_max = None
        if opt.target:
            from eyas import targets

            target_max = targets.max_positions(targets.load_config(targets.resolve(opt.target)))
        served, where = positions.served_length(raw, opt.max_model_len, target_max)
        rep.extend(_soften(positions.check(raw, views, served, where, layout), strict, layout))
    if opt.against:
        rep.extend(vocab_check.against(raw, opt.against))
    if opt.data:
        fs, meas = vocab_check.against_data(raw, opt.data)
        rep.extend(fs)
        rep.measurements["vocab_vs_data"] = meas
    if opt.target:
        _with_target(rep, raw, layout, views, opt, strict)
    return rep


def _with_target(rep: Report, raw, layout: str, views, opt: DoctorOptions, strict: set[str]) -> None:
    from eyas import targets

    tdir = targets.resolve(opt.target)
    tf = with_target.target_facts(tdir)
    rep.measurements["target"] = {"path": str(tdir), **tf}
    rep.extend(with_target.check_sizes(raw, layout, tf))
    if not rep.has("EYAS-VOCAB-SIZE"):
        from eyas.formats.target_weights import target_head

        files = [opt.against] if opt.against and Path(opt.against).is_file() else []
        rep.findings = head_check.reconcile(rep.findings, head_check.check_head(raw, target_head(tdir), files),
                                            raw.path)
    engine_views = views if layout != engines.EYAS else {}
    rep.extend(_soften(with_target.check_aux_against_target(rep, raw, layout, engine_views, tf),
                       strict, layout))
    if layout == engines.EYAS:
        rep.extend(with_target.check_arch(tf["architecture"], list(opt.engines)))
    sizes_ok = not rep.has("EYAS-VOCAB-SIZE")
    need_model = "embed_tokens.weight" in raw.canonical() or opt.prompts or opt.data
    if not need_model:
        return
    model, tok = targets.load(tdir, "fp32", opt.device)
    emb = with_target.check_embedding(raw, model.get_input_embeddings().weight.detach())
    if "embed_tokens.weight" in raw.canonical() and not emb:  # equal to the target's: not random
        rep.findings = [f for f in rep.findings if f.id != "EYAS-EMBED-RANDOM"]
    rep.extend(emb)
    if not (opt.prompts or opt.data):
        return
    if not sizes_ok:
        rep.measurements["dynamic"] = "skipped: the checkpoint does not fit this target (EYAS-VOCAB-SIZE)"
        return
    if opt.prompts:
        prompts = dynamic.prompt_ids_from_files(tok, opt.prompts, opt.num_prompts)
    else:
        prompts = dynamic.prompt_ids_from_data(opt.data, opt.num_prompts)
    fs, meas = dynamic.run_dynamic(raw, layout, views, model, tok, prompts, opt.new_tokens, opt.steps)
    rep.extend(_soften(fs, strict, layout))
    maps = [f for f in rep.errors if f.id in ("EYAS-D2T-WRONG-IDS", "EYAS-HEAD-VOCAB-MISMATCH", "EYAS-VOCAB-CHANGED")]
    for f in rep.findings:  # low acceptance explained by the maps: their fix, not retraining
        if f.id == "EYAS-ACCEPTANCE-LOW" and maps:
            f.cause, f.fix = f"the vocabulary maps are not the head's ({maps[0].id}).", maps[0].fix
    if meas and opt.decode:
        meas["decode"] = dynamic.decode_acceptance(opt.ckpt, model, tdir, layout, list(opt.engines), prompts,
                                                   opt.new_tokens, opt.steps)
    rep.measurements["dynamic"] = meas


def _soften(fs: list, strict: set[str], layout: str) -> list:
    """Engine findings for engines that do not serve this layout as is become warnings."""
    for f in fs:
        if f.engine and f.engine.endswith("(2026+)") and f.severity == "error":
            f.severity = "warning"  # only under newer SGLang versions (see EYAS-AUX-VERSION-DEPENDENT)
            f.message = "(newer SGLang only) " + f.message
        elif f.engine and f.engine not in strict and f.severity == "error":
            f.severity = "warning"
            f.message = f"(not a {layout}-layout engine; convert first) " + f.message
    return fs


def _view_summary(r) -> dict:
    return {"missing": list(r.missing), "skipped": list(r.skipped), "aux_layer_ids_hf": r.aux_layer_ids_hf,
            "aux_alt_hf": r.aux_alt_hf, "use_aux": r.use_aux, "notes": list(r.notes), "errors": list(r.errors)}

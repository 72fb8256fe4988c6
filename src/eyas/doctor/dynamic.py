"""Dynamic checks: run the target and the drafter on a few prompts and measure, per path
(the eyas reference reading and each engine's reading), step-0 accuracy, the conditional
acceptance of each chain step and the chain acceptance length; then locate the cause of a
gap by re-running the engine's path with one thing changed (aux ids -1/+1, fc applied or
bypassed, d2t read as absolute ids, the weights under eyas's names) and naming the variant
that restores acceptance. Also predicts chain/tree acceptance and recommends engine flags.

Acceptance is measured on the target's own greedy continuation, teacher-forced: at index t
step i consumes x[t+1+i] and must produce the target's argmax at position t+1+i (exactly
what greedy verification accepts when steps < i were accepted); see core/ttt.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from eyas.core.drafter import DrafterConfig, Eagle3Drafter, mlp_width
from eyas.core.ttt import TTTAttention, shift_left, step_inputs
from eyas.doctor.findings import INFO, WARNING, Finding, make
from eyas.doctor.reading import EngineReading, RawCheckpoint, intended_aux_ids
from eyas.doctor.static import _dims, cfg_get
from eyas.formats.engines import EYAS

log = logging.getLogger(__name__)
TOPK = (1, 2, 4, 8)
DRAFT_COST = 0.05  # one drafter step / one target verification (CPU and GPU measurements: 0.03-0.1)
VERIFY_TOKEN_COST = 0.004  # extra verification cost per draft token in the tree


@dataclass
class Path_:
    """One way of running the checkpoint: which weights, which aux ids, fc, d2t reading."""

    name: str
    state: dict[str, torch.Tensor]
    aux_ids: list[int] | None  # HF indices; None: no aux capture (H-wide last state, fc skipped)
    d2t_absolute: bool = False
    embed: torch.Tensor | None = None  # a shipped embedding the engine would use instead of the target's
    notes: list[str] = field(default_factory=list)


@dataclass
class Sequence:
    ids: torch.Tensor  # (1, T)
    labels: torch.Tensor  # (1, T) target argmax at each position
    valid: torch.Tensor  # (1, T) bool: position p's label is a generated token
    states: dict[int, torch.Tensor]  # HF index -> (1, T, H)
    last: torch.Tensor  # (1, T, H) final-norm output


# ---------------------------------------------------------------- inputs


@torch.no_grad()
def build_sequences(model, tok, prompts: list[list[int]], new_tokens: int) -> list[Sequence]:
    """Greedy continuations of each prompt by the target, with every hidden state captured, on the
    target's device; the sequences come back on the CPU, where the drafter is measured."""
    from eyas.targets import capture_aux, find_decoder_stack

    L = len(find_decoder_stack(model).layers)
    out = []
    for p in prompts:
        x = torch.tensor([p], dtype=torch.long, device=model.device)
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        with capture_aux(model, list(range(L + 1))) as cap:
            logits = model(gen).logits  # (1, T, V)
        T = gen.shape[1]
        valid = torch.zeros(1, T, dtype=torch.bool)
        valid[0, len(p) - 1:T - 1] = True  # label of p = x[p+1], a generated token
        out.append(Sequence(gen.cpu(), logits.argmax(-1).cpu(), valid, {i: s.cpu() for i, s in cap.states.items()},
                            cap.last.cpu()))
    return out


def prompt_ids_from_files(tok, files, limit: int, max_prompt: int = 256) -> list[list[int]]:
    from eyas.formats.prompts import load_prompt_files

    convs = load_prompt_files(list(files), flag="--prompts")[:limit]
    out = []
    for c in convs:
        users = [t for t in c.turns if t["role"] in ("user", "system")]
        first = [users[0]] if users else c.turns[:1]
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tok(first[0]["content"])["input_ids"]
        out.append(list(ids)[-max_prompt:])
    return out


def prompt_ids_from_data(data_dir, limit: int, max_prompt: int = 256) -> list[list[int]]:
    from eyas.formats.data import read_samples

    try:
        samples = read_samples(data_dir, "eval") or read_samples(data_dir, "train")
    except Exception:  # noqa: BLE001 - an empty eval split falls back to train
        samples = read_samples(data_dir, "train")
    out = []
    for s in samples[:limit]:
        first = next((i for i, m in enumerate(s.loss_mask) if m), len(s.input_ids))
        if first > 1:
            out.append(list(s.input_ids[:first])[-max_prompt:])
    return out


# ---------------------------------------------------------------- building a drafter for a path


def drafter_config(raw: RawCheckpoint, tcfg, n_aux: int) -> DrafterConfig:
    """The drafter's architecture from its weights (sizes) and config (heads, RoPE, flags)."""
    t, c = raw.canonical(), raw.config
    d = _dims(t)
    nh = int(cfg_get(c, "num_attention_heads") or tcfg.num_attention_heads)
    hd = d["q_out"] // nh if d["q_out"] else tcfg.hidden_size // nh
    over = dict(hidden_size=d["H"], num_attention_heads=nh, head_dim=hd,
                num_key_value_heads=(d["k_out"] // hd) if d["k_out"] else nh,
                intermediate_size=d["inter"] or mlp_width(tcfg),
                target_hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size)
    for k in ("rms_norm_eps", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        v = cfg_get(c, k)
        if v is not None:
            over[k] = v
    theta = cfg_get(c, "rope_theta")
    rp = cfg_get(c, "rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_type", "default") == "default":
        over["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rp.get("rope_theta", 10000.0))}
    elif theta is not None:
        over["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    N = d["lm_rows"] or int(cfg_get(c, "draft_vocab_size") or tcfg.vocab_size)
    return DrafterConfig.from_target(tcfg, N, [0] * n_aux, **over)


def build_drafter(cfg: DrafterConfig, path: Path_, target_embed: torch.Tensor) -> tuple[Eagle3Drafter, list[str]]:
    torch.manual_seed(0)  # what the engine leaves random is random, reproducibly
    d = Eagle3Drafter(cfg)
    own = d.state_dict()
    skipped = []
    load = {}
    for k, v in path.state.items():
        if k in own and tuple(own[k].shape) == tuple(v.shape):
            load[k] = v.to(own[k].dtype)
        elif k in own:
            skipped.append(k)
    if "d2t" not in path.state:
        load["d2t"] = torch.zeros_like(own["d2t"])
    d.load_state_dict(load, strict=False)
    own = path.embed is not None and tuple(path.embed.shape) == tuple(target_embed.shape)
    emb = path.embed if own else target_embed
    d.load_target_embedding(emb.float())
    d.eval()
    return d, skipped


# ---------------------------------------------------------------- measuring one path


@torch.no_grad()
def measure(drafter: Eagle3Drafter, path: Path_, seqs: list[Sequence], steps: int) -> dict:
    """Per-step accuracy, conditional top-k acceptance, chain acceptance length."""
    N = drafter.cfg.draft_vocab_size
    V = drafter.cfg.vocab_size
    d2t = drafter.d2t.long()
    tgt_ids = d2t.clone() if path.d2t_absolute else torch.arange(N) + d2t
    tgt_ids = tgt_ids.clamp(0, V - 1)
    kmax = min(max(TOPK), N)
    hit = torch.zeros(steps, len(TOPK))
    alive = torch.zeros(steps, len(TOPK))
    acc, n0 = torch.zeros(steps), torch.zeros(steps)
    runs = []  # per sequence: the top-1 chain's tokens per verification at each start position
    fc_in = drafter.fc.in_features
    for s in seqs:
        if path.aux_ids is None:
            h = s.last  # the engine passes the H-wide state and skips fc when widths agree
            if h.shape[-1] == fc_in:
                h = drafter.fuse(h)
            elif h.shape[-1] != drafter.cfg.hidden_size:
                return {"error": "state width matches neither fc nor hidden"}
        else:
            if any(i not in s.states for i in path.aux_ids):
                return {"error": f"aux ids {path.aux_ids} do not exist in the target"}
            aux = torch.cat([s.states[i] for i in path.aux_ids], dim=-1)
            if aux.shape[-1] != fc_in:
                return {"error": f"aux width {aux.shape[-1]} != fc input {fc_in}"}
            h = drafter.fuse(aux)
        attend = TTTAttention()
        chains = [s.valid[0].clone() for _ in TOPK]
        start = s.valid[0].clone()  # (T,) positions a chain starts at
        run = torch.ones(s.valid.shape[1])  # (T,) tokens the top-1 chain starting here yields
        for i in range(steps):
            inp, pos = step_inputs(s.ids, i)
            out = drafter.layer(h, inp, pos, attend)  # (1, T, H)
            logits, h = drafter.head(out)  # h: the next step's input state
            top = tgt_ids[logits[0].float().topk(kmax, dim=-1).indices]  # (T, kmax)
            lab = shift_left(s.labels, 1 + i, pad=-1)[0]
            ok = shift_left(s.valid.long(), 1 + i, pad=0)[0].bool()
            right1 = top[:, 0] == lab
            acc[i] += (right1 & ok).sum()
            n0[i] += ok.sum()
            for j, k in enumerate(TOPK):
                rk = (top[:, :min(k, kmax)] == lab[:, None]).any(-1)
                chains[j] = chains[j] & ok
                alive[i, j] += chains[j].sum()
                chains[j] = chains[j] & rk
                hit[i, j] += chains[j].sum()
            run += chains[0].float()
        runs.append(run[start])
    cond = (hit / alive.clamp(min=1))  # (steps, len(TOPK)) conditional acceptance
    res = {"step0_acc": float(acc[0] / n0[0].clamp(min=1)), "acc": (acc / n0.clamp(min=1)).tolist(),
           "positions": int(n0[0]), "cond_accept": {str(k): cond[:, j].tolist() for j, k in enumerate(TOPK)}}
    res["accept_len"] = accept_length(cond[:, 0].tolist())
    res["runs"] = torch.cat(runs) if runs else torch.zeros(0)
    return res


# A variant (or an engine's reading) differs from the path it is compared with when the paired
# difference of tokens per verification over the same start positions is both decisive and
# significant: mean > DECISIVE tokens, mean > gap_threshold, and mean > Z standard errors
# (se = std(diff) / sqrt(positions)). Below that it is noise for the positions counted: a weak
# drafter's 1.02 against 1.08 on 128 positions is not evidence.
DECISIVE, Z = 0.1, 3.0


def paired(better: dict, worse: dict) -> dict:
    """{'diff', 'se', 'positions', 'significant'} of `better` over `worse` (two measure() results)."""
    a, b = better.get("runs"), worse.get("runs")
    if a is None or b is None or a.numel() != b.numel() or a.numel() < 2:
        return {"diff": 0.0, "se": float("inf"), "positions": 0, "significant": False}
    d = (a - b).float()
    diff, se = float(d.mean()), float(d.std() / d.numel() ** 0.5)
    return {"diff": diff, "se": se, "positions": int(d.numel()),
            "significant": diff > max(DECISIVE, Z * se, gap_threshold(float(a.mean())))}


def inconclusive(who: str, label: str, base_al: float, al: float, test: dict) -> Finding:
    return make("EYAS-INCONCLUSIVE", f"dynamic: {who} accepts {base_al:.2f}, with {label} {al:.2f}: inconclusive "
                f"(difference {test['diff']:.2f} +- {test['se']:.2f} over {test['positions']} positions); pass more "
                "prompts", evidence={k: round(v, 3) if isinstance(v, float) else v for k, v in test.items()})


def accept_length(cond: list[float], depth: int | None = None) -> float:
    """1 + sum_k prod_{i<=k} cond_i: expected tokens per verification (bonus token included)."""
    al, prod = 1.0, 1.0
    for c in cond[:depth]:
        prod *= c
        al += prod
    return al


# ---------------------------------------------------------------- paths and variants


def reference_path(raw: RawCheckpoint, layout: str, default_ids: list[int]) -> Path_:
    ids, _ = intended_aux_ids(raw, layout)
    return Path_("eyas reference", dict(raw.canonical()), ids or default_ids)


def engine_path(raw: RawCheckpoint, r: EngineReading, default_ids: list[int]) -> Path_:
    state = {k: v for k, v in r.state.items() if k != "t2d"}
    return Path_(r.engine, state, (r.aux_layer_ids_hf or default_ids) if r.use_aux else None,
                 embed=r.state.get("embed_tokens.weight"))


def variants(p: Path_, raw: RawCheckpoint, intended: list[int], L: int) -> list[tuple[str, str, Path_]]:
    """(finding id it would point to, label, path) for each single change of `p`."""
    out = []
    ids = p.aux_ids or intended
    for delta in (-1, 1):
        shifted = [i + delta for i in ids]
        if all(0 <= i <= L for i in shifted):
            out.append(("EYAS-AUX-OFF-BY-ONE", f"aux ids {delta:+d} ({shifted})", replace(p, aux_ids=shifted)))
    if p.aux_ids is not None and p.aux_ids != intended and len(intended) == len(p.aux_ids):
        out.append(("EYAS-AUX-CONVENTION", f"aux ids as trained ({intended})", replace(p, aux_ids=list(intended))))
    if p.aux_ids is None:
        out.append(("EYAS-FC-BYPASS", f"fc applied on aux ids {intended}", replace(p, aux_ids=intended)))
    else:
        out.append(("EYAS-FC-BYPASS", "fc bypassed (H-wide last state)", replace(p, aux_ids=None)))
    d2t, t2d = p.state.get("d2t"), raw.canonical().get("t2d")
    if t2d is not None and d2t is not None and int(t2d.bool().sum()) == d2t.numel():
        ids = torch.nonzero(t2d.bool()).flatten()
        if not torch.equal(ids, torch.arange(d2t.numel()) + d2t.long()):  # the other map: read with t2d
            out.append(("EYAS-D2T-WRONG-IDS", "d2t rebuilt from t2d",
                        replace(p, state={**p.state, "d2t": ids - torch.arange(ids.numel())})))
    if d2t is not None and bool((d2t >= 0).all()):
        out.append(("EYAS-D2T-ABSOLUTE", "d2t read as absolute ids", replace(p, d2t_absolute=not p.d2t_absolute)))
    canon = raw.canonical()
    if set(canon) - set(p.state) - {"t2d", "embed_tokens.weight"}:
        out.append(("EYAS-KEYS-SKIPPED", "all file weights loaded under eyas names", replace(p, state=dict(canon))))
    if p.embed is not None:
        out.append(("EYAS-EMBED-RANDOM", "target's embedding instead of the shipped one", replace(p, embed=None)))
    return out


def gap_threshold(ref_al: float) -> float:
    return 0.05 + 0.15 * max(ref_al - 1.0, 0.0)


def run_path(cfg_base: DrafterConfig, p: Path_, seqs, steps: int, target_embed) -> dict:
    n_aux = len(p.aux_ids) if p.aux_ids else len(cfg_base.aux_layer_ids)
    cfg = replace(cfg_base, aux_layer_ids=list(p.aux_ids or [0] * n_aux))
    if p.aux_ids is not None and len(p.aux_ids) != len(cfg_base.aux_layer_ids):
        cfg = replace(cfg_base, aux_layer_ids=list(p.aux_ids),
                      target_hidden_size=cfg_base.target_hidden_size * len(cfg_base.aux_layer_ids) // len(p.aux_ids))
    drafter, skipped = build_drafter(cfg, p, target_embed)
    res = measure(drafter, p, seqs, steps)
    if skipped:
        res["shape_skipped"] = skipped
    return res


def locate(name: str, base: dict, p: Path_, raw, intended, L, cfg_base, seqs, steps, target_embed,
           ref_al: float | None) -> tuple[list[Finding], list[dict]]:
    """Try each single change of path `p`; name the one that restores acceptance."""
    tried, best = [], None
    base_al = base.get("accept_len", 1.0)
    for fid, label, v in variants(p, raw, intended, L):
        r = run_path(cfg_base, v, seqs, steps, target_embed)
        row = {"variant": label, "accept_len": r.get("accept_len"), "step0_acc": r.get("step0_acc"),
               "error": r.get("error")}
        tried.append(row)
        if r.get("accept_len") is not None and (best is None or r["accept_len"] > best[2]["accept_len"]):
            best = (fid, label, r, v)
    goal = ref_al if ref_al is not None else base_al
    if best is None or best[2]["accept_len"] - base_al <= gap_threshold(max(goal, best[2]["accept_len"])):
        return [], tried
    fid, label, r, v = best
    eng = None if name == "eyas reference" else name
    who = "this checkpoint as eyas reads it" if eng is None else f"{name}'s reading"
    test = paired(r, base)
    if not test["significant"]:
        return [inconclusive(who, label, base_al, r["accept_len"], test)], tried
    f = make(fid, f"dynamic: {who} accepts {base_al:.2f} tokens/step; with {label} it accepts "
             f"{r['accept_len']:.2f}", engine=eng,
             evidence={"accept_len": round(base_al, 3), "restored_accept_len": round(r["accept_len"], 3),
                       "step0_acc": round(base.get("step0_acc", 0.0), 3),
                       "restored_step0_acc": round(r["step0_acc"], 3),
                       "variant": label, "diff": round(test["diff"], 3), "se": round(test["se"], 3),
                       "positions": test["positions"]},
             cause=CAUSES[fid], fix=FIXES[fid].format(ckpt=raw.path, engine=eng or "sglang"),
             command=(["vocab", "repair", "--drafter", str(raw.path), "--maps-from", REPAIR_FROM[fid], "--out", "OUT"]
                      if fid in REPAIR_FROM else None))
    if eng is None and (v.aux_ids is None or any(i >= L for i in v.aux_ids)):
        # The reference reads the checkpoint as its author meant it. A variant that feeds the drafter the
        # target's last state (fc bypassed, or aux id L) and beats it is no proof of a fault: an undertrained
        # drafter whose head starts from the target's rows predicts better from that state than from its own
        # fc (seen on 1-10-step drafters).
        f.severity = WARNING
        f.cause = ("either the checkpoint misdescribes how it was trained (" + CAUSES[fid].rstrip(".") + "), or the "
                   "drafter is undertrained and the changed path happens to predict better; train longer and rerun")
    return [f], tried


CAUSES = {
    "EYAS-AUX-OFF-BY-ONE": "the aux hidden states are taken one layer off from the ones the drafter was trained on "
                           "(ids written in another engine's convention).",
    "EYAS-FC-BYPASS": "the drafter receives the wrong kind of state: fc must fuse the three aux states "
                      "(when the target returns only its last state the engine skips fc without a word).",
    "EYAS-D2T-ABSOLUTE": "d2t is read in the wrong convention (offsets vs absolute target ids).",
    "EYAS-D2T-WRONG-IDS": "d2t gives other target ids than the head was trained for; t2d holds the right ones "
                          "(engines read d2t alone).",
    "EYAS-KEYS-SKIPPED": "the engine skips weights stored under names it does not know and runs them random.",
    "EYAS-EMBED-RANDOM": "the shipped embedding is not the target's and replaces it.",
    "EYAS-AUX-CONVENTION": "the engine captures other layers than the drafter was trained on (ids missing from, or "
                           "written in another convention in, the fields this engine reads).",
}
REPAIR_FROM = {"EYAS-D2T-WRONG-IDS": "t2d", "EYAS-D2T-ABSOLUTE": "d2t-absolute"}  # eyas vocab repair --maps-from
FIXES = {
    "EYAS-AUX-OFF-BY-ONE": "eyas convert {ckpt} --to {engine} --out OUT (re-export with aux ids in {engine}'s "
                           "convention)",
    "EYAS-FC-BYPASS": "enable aux capture: eagle_config.use_aux_hidden_state=true and a target architecture "
                      "with EAGLE-3 capture in {engine}",
    "EYAS-D2T-ABSOLUTE": "store d2t = ids - arange(N): eyas vocab repair --drafter {ckpt} --maps-from d2t-absolute "
                         "--out OUT",
    "EYAS-D2T-WRONG-IDS": "eyas vocab repair --drafter {ckpt} --maps-from t2d --out OUT",
    "EYAS-KEYS-SKIPPED": "eyas convert {ckpt} --to {engine} --out OUT",
    "EYAS-EMBED-RANDOM": "drop embed_tokens.weight or replace it with the target's (eyas convert)",
    "EYAS-AUX-CONVENTION": "eyas convert {ckpt} --to {engine} --out OUT (writes the ids where {engine} reads them)",
}


# ---------------------------------------------------------------- predictions and flags


def predict(res: dict, steps: int) -> dict:
    """Acceptance length for chains of depth 1..steps and full top-k trees (upper bounds)."""
    out = {"chain": {str(s): round(accept_length(res["cond_accept"]["1"], s), 3) for s in range(1, steps + 1)}}
    for k in TOPK[1:]:
        out[f"tree_top{k}"] = {str(s): round(accept_length(res["cond_accept"][str(k)], s), 3)
                               for s in range(1, steps + 1)}
    return out


def recommend(res: dict, steps: int) -> dict:
    """Flags maximising predicted tokens per unit time under a simple cost model:
    time per cycle = 1 + DRAFT_COST*steps*... + VERIFY_TOKEN_COST*draft_tokens."""
    best_chain = max(range(1, steps + 1), key=lambda s: accept_length(res["cond_accept"]["1"], s)
                     / (1 + DRAFT_COST * s + VERIFY_TOKEN_COST * s))
    best = (0.0, 1, 1)
    for k in TOPK:
        for s in range(1, steps + 1):
            tokens = min(k * s + 1, 64)
            speed = accept_length(res["cond_accept"][str(k)], s) / (1 + DRAFT_COST * s + VERIFY_TOKEN_COST * tokens)
            if speed > best[0] + 1e-9:
                best = (speed, k, s)
    _, k, s = best
    ndt = min(k * s + 1, 64)
    return {
        "sglang": f"--speculative-algorithm EAGLE3 --speculative-num-steps {s} --speculative-eagle-topk {k} "
                  f"--speculative-num-draft-tokens {ndt}",
        "vllm": f"--speculative-config '{{\"method\": \"eagle3\", \"num_speculative_tokens\": {best_chain}}}'",
        "chain_depth": best_chain, "tree": {"topk": k, "steps": s, "num_draft_tokens": ndt},
        "cost_model": f"cycle = 1 + {DRAFT_COST}*steps + {VERIFY_TOKEN_COST}*draft_tokens (target step = 1)",
    }


# ---------------------------------------------------------------- real decoding (eyas.runtime)


def decode_acceptance(ckpt, model, tdir, layout: str, engines: list[str], prompts: list[list[int]],
                      new_tokens: int, k: int) -> dict:
    """Acceptance of real greedy chain decoding through `eyas.runtime` (its `--engine`
    emulation), as a cross-check of the teacher-forced measurement. {path: result}."""
    try:
        from eyas import runtime
    except ImportError as e:  # the runtime is optional for the doctor
        return {"error": f"eyas.runtime unavailable ({e})"}
    from eyas.errors import EyasError

    # An eyas checkpoint is served only after export: decode it as eyas runs it.
    names = [EYAS] if layout == EYAS else [e for e in engines if e in runtime.ENGINES and e != EYAS]
    out = {}
    for name in names:
        try:
            loaded = runtime.load_drafter(ckpt, model, name, target_dir=tdir)
            tr, dr = runtime.runners(model, loaded, runtime.Timer(model.device))
            acc = []
            for p in prompts:
                res = runtime.generate(tr, dr, torch.tensor(p), runtime.DecodeSettings(
                    method="chain", k=k, max_new_tokens=new_tokens))
                acc += res.accepted
            out[name] = {"accept_len": 1 + sum(acc) / max(len(acc), 1), "verify_steps": len(acc), "chain": k}
        except (EyasError, RuntimeError, ValueError, KeyError) as e:
            out[name] = {"error": " ".join(str(e).split())[:300]}
    return out


# ---------------------------------------------------------------- driver


def run_dynamic(raw: RawCheckpoint, layout: str, views: dict[str, EngineReading], model, tok,
                prompts: list[list[int]], new_tokens: int = 32, steps: int = 5) -> tuple[list[Finding], dict]:
    from eyas.targets import find_decoder_stack

    tcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    L = len(find_decoder_stack(model).layers)
    default_ids = [2, L // 2, L - 3]
    intended = intended_aux_ids(raw, layout)[0] or default_ids
    target_embed = model.get_input_embeddings().weight.detach().float().cpu()
    seqs = build_sequences(model, tok, prompts, new_tokens)
    if not seqs:
        return [], {}
    d = _dims(raw.canonical())
    n_aux = len(intended)
    if d["fc_in"] and d["fc_in"] % tcfg.hidden_size == 0:
        n_aux = d["fc_in"] // tcfg.hidden_size
    cfg_base = drafter_config(raw, tcfg, n_aux)
    ref = reference_path(raw, layout, default_ids)
    findings, meas = [], {"prompts": len(seqs), "new_tokens": new_tokens, "steps": steps, "paths": {}}
    ref_res = run_path(cfg_base, ref, seqs, steps, target_embed)
    meas["paths"][ref.name] = _summary(ref_res)
    fs, tried = locate(ref.name, ref_res, ref, raw, intended, L, cfg_base, seqs, steps, target_embed, None)
    findings += fs
    meas["paths"][ref.name]["variants"] = tried
    ref_al = ref_res.get("accept_len", 1.0)
    ref_fixed = bool(fs and fs[0].severity == "error" and "restored_accept_len" in fs[0].evidence)
    if ref_fixed:  # the checkpoint itself is inconsistent: the best variant is the reference to compare with
        ref_al = max(ref_al, fs[0].evidence["restored_accept_len"])
    paths = {} if layout == EYAS else {e: engine_path(raw, r, default_ids) for e, r in views.items()}
    for e, r in ({} if layout == EYAS else views).items():
        if getattr(r, "aux_alt_hf", None) and r.use_aux:  # the other SGLang version's reading
            paths[f"{e} (2026+)"] = replace(paths[e], name=f"{e} (2026+)", aux_ids=list(r.aux_alt_hf))
    for e, p in paths.items():
        res = run_path(cfg_base, p, seqs, steps, target_embed)
        meas["paths"][e] = _summary(res)
        al = res.get("accept_len", 1.0)
        if ref_al - al > gap_threshold(ref_al) and not ref_fixed and not paired(ref_res, res)["significant"]:
            findings.append(inconclusive(f"{e}'s reading", "the eyas reference", al, ref_al, paired(ref_res, res)))
        elif ref_al - al > gap_threshold(ref_al):
            fs, tried = locate(e, res, p, raw, intended, L, cfg_base, seqs, steps, target_embed, ref_al)
            meas["paths"][e]["variants"] = tried
            findings += fs or [make("EYAS-ENGINE-DIVERGES", f"dynamic: {e} accepts {al:.2f} tokens/step, the eyas "
                                    f"reference {ref_al:.2f}; no single change restores it", engine=e,
                                    evidence={"accept_len": al, "reference_accept_len": ref_al, "variants": tried},
                                    cause=f"{e}'s reading of the checkpoint differs in more than one way.",
                                    fix=f"eyas convert {raw.path} --to {e} --out OUT")]
    if "cond_accept" in ref_res:
        meas["prediction"] = predict(ref_res, steps)
        meas["recommendation"] = recommend(ref_res, steps)
        findings.append(_acceptance_finding(ref_res, meas))
        rec = meas["recommendation"]
        findings.append(make("EYAS-RECOMMEND", f"SGLang: {rec['sglang']}; vLLM: {rec['vllm']}",
                             evidence=rec, fix=rec["sglang"]))
    return findings, meas


def _summary(res: dict) -> dict:
    keep = ("step0_acc", "accept_len", "acc", "positions", "error", "shape_skipped")
    out = {k: res[k] for k in keep if k in res}
    if "cond_accept" in res:
        out["cond_accept_chain"] = res["cond_accept"]["1"]
    return out


def _acceptance_finding(ref_res: dict, meas: dict) -> Finding:
    rec = meas["recommendation"]
    paths = ", ".join(f"{n}: acc0 {v.get('step0_acc', 0):.2f} AL {v.get('accept_len', 0):.2f}"
                      for n, v in meas["paths"].items() if "error" not in v)
    chance = ref_res["step0_acc"] < 0.05 and ref_res["accept_len"] < 1.1
    f = make("EYAS-ACCEPTANCE-LOW" if chance else "EYAS-ACCEPTANCE",
             f"{paths}; chain depth {rec['chain_depth']} predicts "
             f"{meas['prediction']['chain'][str(rec['chain_depth'])]:.2f}",
             severity=WARNING if chance else INFO, evidence={"paths": meas["paths"], "prediction": meas["prediction"]},
             cause="the drafter rarely agrees with the target even when read as intended (undertrained, or "
                   "trained for another target)." if chance else "",
             fix="retrain (eyas train) on data regenerated by this target" if chance else "")
    return f

"""The drafter's lm_head against its vocabulary maps: which map the head was trained with.

vLLM and SGLang serve by `d2t` alone (t2d is dropped at load), so a `d2t` whose ids are wrong
serves at chance even beside a right `t2d`, and a pair of maps consistent with each other but
built on other data than the head's (the fine-tuning trap) looks healthy to every map check.
Two pieces of evidence decide:

- eyas.json records the fingerprint of the vocabulary a drafter was trained with; maps that no
  longer match it were changed after training (no target needed).
- With the target, the head itself: an eyas head starts from the target's rows of the draft ids
  and peers' frozen heads are copies of them, so the nearest target row of head row i is the
  trained map's id i (core.vocab.head_match). Each candidate reading (d2t as offsets, the ids t2d
  marks, d2t as absolute ids, a vocabulary file at hand) is scored by the share of rows it explains.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.core import vocab as core_vocab
from eyas.doctor.findings import ERROR, INFO, WARNING, Finding, make
from eyas.doctor.reading import RawCheckpoint

MATCH = 0.5  # a reading explains the head when it names the nearest target row of half the sampled rows
FOLLOWS = 0.5  # mean best cosine above which the head's rows are the target's rows (at some ids)
CLOSE = 0.05  # the served reading is right when it explains (nearly) as many rows as the best one
SERVED = "d2t"  # the reading every serving engine uses


def _fingerprint(ids: torch.Tensor, V: int) -> str:
    from eyas.formats.vocab import vocab_fingerprint

    return vocab_fingerprint(core_vocab.d2t_from_ids(torch.sort(ids.long()).values), V)


def readings(raw: RawCheckpoint, V: int, files: list[Path]) -> dict[str, torch.Tensor]:
    """Candidate target ids per draft id: d2t as offsets (served), the ids t2d marks, d2t read as
    absolute ids, and each vocabulary file given."""
    t = raw.canonical()
    n = int(t["lm_head.weight"].shape[0])
    out = {}
    d2t, t2d = t.get("d2t"), t.get("t2d")
    if d2t is None:  # engines read a missing d2t as zeros: draft id i is target id i
        out[SERVED] = torch.arange(n)
    elif d2t.numel() == n and not d2t.dtype.is_floating_point:
        out[SERVED] = core_vocab.target_ids(d2t.long())
        if bool((d2t >= 0).all()) and int(d2t.max()) < V:
            out["d2t read as absolute ids"] = d2t.long()
    if t2d is not None and t2d.numel() == V and int(t2d.bool().sum()) == n:
        out["t2d"] = torch.nonzero(t2d.bool()).flatten()
    for f in files:
        from eyas.formats.vocab import load_any

        vm = load_any(f)
        if vm.draft_size == n:
            out[f"vocabulary {f}"] = vm.target_ids
    return out


def training_vocab(raw: RawCheckpoint) -> tuple[Path | None, str | None]:
    """(the vocabulary file eyas.json says the drafter was trained with, when it exists here; its
    recorded fingerprint)."""
    m = raw.training
    path = Path(m["vocab"]) if isinstance(m.get("vocab"), str) and m["vocab"] else None
    return (path if path is not None and path.is_file() else None), m.get("vocab_fingerprint")


def check_recorded(raw: RawCheckpoint) -> list[Finding]:
    """The maps against the vocabulary fingerprint eyas.json recorded at training (no target)."""
    _, recorded = training_vocab(raw)
    t = raw.canonical()
    if not recorded or "d2t" not in t or "t2d" not in t:
        return []
    V = int(t["t2d"].numel())
    served = _fingerprint(core_vocab.target_ids(t["d2t"].long()), V)
    if served == recorded:
        return []
    marked = _fingerprint(torch.nonzero(t["t2d"].bool()).flatten(), V) if int(t["t2d"].bool().sum()) == \
        t["d2t"].numel() else None
    if marked == recorded:
        return [_wrong_d2t(raw, {"recorded_fingerprint": recorded, "d2t_fingerprint": served,
                                 "t2d_fingerprint": marked}, "eyas.json's record of the training vocabulary")]
    return [make("EYAS-VOCAB-CHANGED", "neither d2t nor t2d is the vocabulary eyas.json recorded at training",
                 evidence={"recorded_fingerprint": recorded, "d2t_fingerprint": served, "t2d_fingerprint": marked},
                 cause="the maps were replaced after training (by hand or by another tool), so lm_head row i may "
                 "now mean another token than the one it was trained for.",
                 fix=_recover_hint(raw))]


def _wrong_d2t(raw: RawCheckpoint, evidence: dict, by: str) -> Finding:
    return make("EYAS-D2T-WRONG-IDS", f"d2t gives other target ids than the head was trained for; t2d is the "
                f"right map (decided by {by})", evidence=evidence,
                cause="vLLM and SGLang read d2t alone (t2d is dropped at load): every draft token maps to a "
                "wrong target token and acceptance falls to chance.",
                fix=f"eyas vocab repair --drafter {raw.path} --maps-from t2d --out OUT (d2t rebuilt from t2d; "
                "the head's rows stay)",
                command=["vocab", "repair", "--drafter", str(raw.path), "--maps-from", "t2d", "--out", "OUT"])


def _recover_hint(raw: RawCheckpoint) -> str:
    path, _ = training_vocab(raw)
    if path is not None:
        return f"eyas vocab repair --drafter {raw.path} --maps-from {path} --out OUT"
    named = raw.training.get("vocab")
    data = (raw.training.get("train_config") or {}).get("data")
    where = f"eyas.json names {named}, which is not here; " if named else ""
    rebuild = f"eyas vocab build --data {data} ..." if data else "eyas vocab build --data DATA --size N"
    return (f"{where}recover the training vocabulary (rebuild it with {rebuild} on the data the drafter was trained "
            f"on, same --size), then eyas vocab repair --drafter {raw.path} --maps-from VOCAB --out OUT")


def check_head(raw: RawCheckpoint, target_head: torch.Tensor, files: list[Path]) -> list[Finding]:
    """Which reading of the maps the head's rows follow (needs the target's output head)."""
    t = raw.canonical()
    head = t.get("lm_head.weight")
    if head is None or head.dim() != 2 or not head.is_floating_point():
        return []
    V = int(target_head.shape[0])
    trained, _ = training_vocab(raw)
    cands = readings(raw, V, [*files, *([trained] if trained and trained not in files else [])])
    if SERVED not in cands:
        return []
    res = core_vocab.head_match(head, target_head, cands)
    agree = res["agree"]
    ev = {f"rows_explained_by_{k.split(' ')[0]}": round(v, 3) for k, v in agree.items()}
    ev.update(rows_sampled=res["rows"], nearest_cos=round(res["nearest_cos"], 3))
    best = max(agree, key=agree.get)  # ties: the served reading (first)
    if agree[best] >= MATCH and agree[SERVED] >= agree[best] - CLOSE:
        return [make("EYAS-HEAD-MATCH", f"the lm_head follows d2t: {agree[SERVED]:.0%} of sampled rows are nearest "
                     "the target's row of their d2t id", evidence={**ev, "agree": agree, "follows": SERVED})]
    if agree[best] >= MATCH:
        if best == "t2d":
            return [_wrong_d2t(raw, {**ev, "agree": agree}, f"the head: {agree['t2d']:.0%} of its rows follow t2d, "
                               f"{agree[SERVED]:.0%} follow d2t")]
        if best.startswith("d2t read as absolute"):
            return [make("EYAS-D2T-ABSOLUTE", f"the lm_head follows d2t read as absolute ids ({agree[best]:.0%} "
                         f"of rows; as offsets {agree[SERVED]:.0%})", evidence={**ev, "agree": agree},
                         cause="d2t stores the target ids themselves; engines add arange(N) to it and draft the "
                         "wrong tokens.", fix=f"eyas vocab repair --drafter {raw.path} --maps-from d2t-absolute "
                         "--out OUT", command=["vocab", "repair", "--drafter", str(raw.path), "--maps-from",
                                               "d2t-absolute", "--out", "OUT"])]
        path = best[len("vocabulary "):]
        return [_foreign(raw, ev, agree, f"{path} explains {agree[best]:.0%} of them",
                         f"eyas vocab repair --drafter {raw.path} --maps-from {path} --out OUT",
                         ["vocab", "repair", "--drafter", str(raw.path), "--maps-from", path, "--out", "OUT"])]
    if res["nearest_cos"] >= FOLLOWS:
        return [_foreign(raw, ev, agree, "no vocabulary at hand explains them", _recover_hint(raw), None)]
    return [make("EYAS-HEAD-MATCH", f"the lm_head's rows do not follow the target's rows (mean best cosine "
                 f"{res['nearest_cos']:.2f}): the head alone cannot tell which map it was trained with; --prompts "
                 "measures it", severity=INFO, evidence={**ev, "agree": agree})]


def _foreign(raw: RawCheckpoint, ev: dict, agree: dict, found: str, fix: str, command) -> Finding:
    return make("EYAS-HEAD-VOCAB-MISMATCH", f"the lm_head was trained for another vocabulary than its maps: "
                f"{agree[SERVED]:.0%} of sampled rows are nearest the target's row of their d2t id; {found}",
                evidence={**ev, "agree": agree},
                cause="row i of the head was trained for another target token than d2t assigns to draft id i "
                "(maps rebuilt on other data), so the engine drafts wrong tokens; moving the head's rows "
                "(eyas vocab remap) would not restore it.", fix=fix, command=command)


# Static map findings that a decisive head or record finding answers (their fixes guess which map is right).
ANSWERED = ("EYAS-T2D-MISMATCH", "EYAS-D2T-ZERO", "EYAS-D2T-MISSING", "EYAS-D2T-ABSOLUTE", "EYAS-VOCAB-CHANGED",
            "EYAS-D2T-WRONG-IDS")


def reconcile(findings: list[Finding], decided: list[Finding], path: Path) -> list[Finding]:
    """`findings` with the static map findings that `decided` (this module's) answers replaced:
    a map found wrong drops the guesses about it; a head that follows d2t makes a disagreeing t2d
    merely stale (engines never read it) with the fix that rebuilds it from d2t. A head whose rows
    follow the target's rows under some map is not at random init, whatever its row statistics
    (a tiny random target's rows look i.i.d. too)."""
    if any(max(f.evidence.get("agree", {0: 0}).values()) >= MATCH for f in decided):
        findings = [f for f in findings if f.id != "EYAS-LMHEAD-UNTRAINED"]
    if any(f.severity == ERROR for f in decided):
        return [f for f in findings if f.id not in ANSWERED] + decided
    if any(f.id == "EYAS-HEAD-MATCH" and f.evidence.get("follows") == SERVED for f in decided):
        for f in findings:
            if f.id == "EYAS-T2D-MISMATCH":
                f.severity = WARNING
                f.message += "; the head follows d2t, so t2d is the stale one"
                f.fix = f"eyas vocab repair --drafter {path} --maps-from d2t --out OUT (t2d rebuilt from d2t)"
                f.command = ["vocab", "repair", "--drafter", str(path), "--maps-from", "d2t", "--out", "OUT"]
        findings = [f for f in findings if f.id not in ("EYAS-VOCAB-CHANGED", "EYAS-D2T-WRONG-IDS")]
    return findings + decided

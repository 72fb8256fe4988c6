"""The checkpoint's draft vocabulary against prepared data (--data) or another vocabulary or
checkpoint (--against): coverage of supervised tokens, same-position agreement (rows of a
trained lm_head are valid only where draft id i means the same target id), and the
estimated loss of acceptance."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.core import vocab as core_vocab
from eyas.doctor.findings import ERROR, INFO, WARNING, Finding, make
from eyas.doctor.reading import RawCheckpoint
from eyas.errors import EyasError


def checkpoint_ids(raw: RawCheckpoint) -> torch.Tensor | None:
    t = raw.canonical()
    if "lm_head.weight" not in t:
        return None
    n = int(t["lm_head.weight"].shape[0])
    d2t = t.get("d2t")
    ids = torch.arange(n) + (d2t.long() if d2t is not None and d2t.numel() == n else 0)
    t2d = t.get("t2d")
    if d2t is not None and t2d is not None and core_vocab.ascending_order(d2t, t2d) is not None:
        return torch.sort(ids).values  # another order: eyas reads it sorted, the rows moved along
    return ids


def _mismatch(raw: RawCheckpoint, cmp: dict, other: str, remap_to: str, extra: dict) -> Finding | None:
    n = cmp["size_a"]
    share = cmp["same_position"] / max(n, 1)
    if cmp["identical"]:
        return make("EYAS-VOCAB-MISMATCH", f"draft vocabulary identical to {other}", severity=INFO,
                    evidence={**cmp, **extra})
    sev = ERROR if share < 0.5 else WARNING
    return make("EYAS-VOCAB-MISMATCH", f"only {cmp['same_position']} of {n} draft positions map to the same target "
                f"id as {other} ({share:.1%}); {cmp['overlap']} ids are shared",
                severity=sev, evidence={**cmp, "same_position_share": share, **extra},
                cause="lm_head row i was trained for a different target token than the one this vocabulary "
                      "assigns to draft id i, so fine-tuning starts from chance-level loss.",
                fix=f"eyas vocab remap --drafter {raw.path} --to {remap_to} --target TARGET --out OUT"
                    + (" (a pure permutation: every row carries over)" if cmp.get("permutation") else ""))


def against(raw: RawCheckpoint, path: Path) -> list[Finding]:
    from eyas.formats.vocab import load_any

    mine = checkpoint_ids(raw)
    if mine is None:
        return []
    other = load_any(Path(path)).target_ids
    cmp = core_vocab.compare_maps(mine, other)
    return [f for f in [_mismatch(raw, cmp, str(path), str(path), {})] if f]


def against_data(raw: RawCheckpoint, data_dir: Path) -> tuple[list[Finding], dict]:
    """Coverage of the data's supervised tokens and agreement with the vocabulary the data implies."""
    from eyas.formats.data import read_samples

    mine = checkpoint_ids(raw)
    if mine is None:
        return [], {}
    samples = read_samples(Path(data_dir), "train")
    V = int(raw.canonical()["t2d"].numel()) if "t2d" in raw.canonical() else \
        int(max(max(s.input_ids) for s in samples if s.input_ids) + 1)
    ids = torch.tensor([i for s in samples for i in s.input_ids], dtype=torch.long)
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.long)
    try:
        counts = core_vocab.count_tokens(ids, mask, V)
    except EyasError as e:
        raise EyasError(f"--data {data_dir}: {e}") from e
    n = min(mine.numel(), V)
    data_ids = core_vocab.select_ids(counts, n)
    cmp = core_vocab.compare_maps(mine, data_ids, counts)
    cov_mine, cov_data = cmp["coverage_a"], cmp["coverage_b"]
    # A draft token outside the checkpoint's vocabulary can never be proposed: acceptance at
    # each step is capped by coverage, so the loss against a vocabulary built from this data
    # is about 1 - coverage_ckpt / coverage_data per step.
    loss = 1 - cov_mine / cov_data if cov_data else 0.0
    meas = {"coverage_checkpoint": cov_mine, "coverage_data_vocab": cov_data,
            "estimated_step_acceptance_loss": loss, **cmp}
    out = [make("EYAS-VOCAB-COVERAGE", f"the draft vocabulary holds {cov_mine:.1%} of the data's supervised "
                f"tokens (a vocabulary built from this data: {cov_data:.1%}); estimated per-step acceptance "
                f"loss {loss:.1%}", severity=WARNING if loss > 0.05 else INFO, evidence=meas,
                cause="tokens outside the draft vocabulary can never be drafted." if loss > 0.05 else "",
                fix=f"eyas vocab build --data {data_dir} --size {n} --out vocab.safetensors; then eyas vocab remap"
                if loss > 0.05 else "")]
    f = _mismatch(raw, cmp, f"the vocabulary built from {data_dir}", "vocab.safetensors",
                  {"note": "build it with: eyas vocab build --data " + str(data_dir)})
    if f is not None and f.severity != INFO:
        out.append(f)
    return out, meas

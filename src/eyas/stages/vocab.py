"""`eyas vocab build | compare | remap | repair`: the draft vocabulary (DESIGN 4), an overlap report
between two vocabularies or drafters, carrying a drafter's lm_head to a new vocabulary, and
replacing a drafter's maps by the ones its head was trained with (its rows unmoved)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas import targets
from eyas.config import arg, command
from eyas.core import vocab as core
from eyas.errors import EyasError
from eyas.formats import capture as fcap
from eyas.formats import checkpoint as ckpt_io
from eyas.formats import vocab as fvocab
from eyas.stages.common import emit, refuse_out_over_inputs, refuse_symlink_out

DEFAULT_SIZE = 32000


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    data: list[Path] = arg("prepared data directory (several: their counts are added)")
    size: int | None = arg(f"draft vocabulary size N (default min({DEFAULT_SIZE}, V))", None)
    out: Path = arg("output file (vocab.safetensors)")
    target: str | None = arg("target (default: the one named in the data manifest)", None)
    force: bool = arg("overwrite --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    a: Path = arg("vocab file or drafter checkpoint directory", positional=True)
    b: Path = arg("vocab file or drafter checkpoint directory", positional=True)
    data: Path | None = arg("prepared data for coverage figures", None)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class RemapConfig:
    drafter: Path = arg("drafter checkpoint directory")
    to: Path = arg("new vocab file")
    target: str = arg("the drafter's target")
    out: Path = arg("output checkpoint directory")
    force: bool = arg("replace a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class RepairConfig:
    drafter: Path = arg("drafter checkpoint directory (any layout)")
    maps_from: str = arg("the maps the head was trained with: t2d (d2t rebuilt from the checkpoint's t2d), d2t "
                         "(t2d rebuilt from d2t), d2t-absolute (d2t holds target ids, not offsets), or a vocab "
                         "file or drafter directory")
    out: Path = arg("output checkpoint directory")
    force: bool = arg("replace a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    p = sub.add_parser("vocab", help="build, compare or remap a draft vocabulary",
                       description="Draft vocabulary = the N most frequent target ids over supervised tokens.")
    vsub = p.add_subparsers(dest="vocab_command", metavar="ACTION", required=True)
    command(vsub, "build", BuildConfig, run_build, help="top-N supervised token ids -> vocab.safetensors (d2t "
            "offsets, t2d)", description="Count loss-masked tokens of the prepared train split; keep the N most "
            "frequent (ties by lower id, padded with the lowest unused ids), sorted ascending.")
    command(vsub, "compare", CompareConfig, run_compare, help="overlap of two vocab files or drafter checkpoints",
            description="A and B: vocab files or drafter checkpoint directories. Reports positions where draft id "
            "i means the same target id, the target-id overlap, the share of B's draft ids that A can serve after "
            "a permutation, and coverage of --data.")
    command(vsub, "remap", RemapConfig, run_remap, help="carry a drafter's lm_head rows to another draft vocabulary",
            description="Rows of tokens in both vocabularies are carried by target id; rows of new tokens start "
            "from the target's lm_head rows when the drafter's hidden size equals the target's, else zero. d2t/t2d "
            "and config draft_vocab_size are replaced. A drafter without lm_head (speculators, scoring with the "
            "verifier's) gets the target's rows for the new vocabulary, which is what it scored with.")
    command(vsub, "repair", RepairConfig, run_repair, help="replace a drafter's d2t/t2d by the maps its head was "
            "trained with, rows unmoved", description="The fix `eyas doctor` prints when a drafter's maps are not "
            "the ones its lm_head was trained with: d2t broken beside a right t2d (--maps-from t2d), a stale t2d "
            "(--maps-from d2t), absolute ids in d2t (--maps-from d2t-absolute), or maps of another vocabulary "
            "(--maps-from VOCAB, the training vocabulary). Only d2t, t2d and draft_vocab_size change.")


# ---------------------------------------------------------------- build


def supervised_counts(records: list, vocab_size: int) -> torch.Tensor:
    """Token counts [V] over loss-masked positions of `records` (one bincount)."""
    if not records:
        return torch.zeros(vocab_size, dtype=torch.long)
    ids = torch.tensor([t for r in records for t in r.input_ids], dtype=torch.long)
    mask = torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.long)
    return core.count_tokens(ids, mask, vocab_size)


def _target_for(data: Path, manifest: dict, spec: str | None) -> Path:
    spec = spec or manifest.get("target")
    if not spec:
        raise EyasError(f"--data {data}: its manifest names no target; pass --target")
    path = targets.resolve(spec)
    want = manifest.get("target_fingerprint")
    if want and not targets.same_target(path, want):
        raise EyasError(f"--target {spec} (fingerprint {targets.fingerprint(path)}) is not the target --data {data} "
                        f"was prepared with (fingerprint {want}); pass that target or re-run `eyas data prepare`")
    return path


def build(data: Path | list[Path], size: int | None, out: Path, target: str | None = None,
          force: bool = False) -> dict:
    """Build and write the draft vocabulary of the train split of `data` (one or more dirs)."""
    if out.is_dir():
        raise EyasError(f"--out {out} is a directory; a vocabulary is one file: pass a file path such as "
                        f"{out}/vocab.safetensors")
    dirs = [Path(d) for d in (data if isinstance(data, (list, tuple)) else [data])]
    refuse_out_over_inputs(out, {"--data": dirs, "--target": targets.local_dir(target)})
    refuse_symlink_out(out)
    if out.exists() and not force:
        raise EyasError(f"--out {out} exists; pass --force to overwrite it")
    if out.exists():
        try:  # --force replaces an earlier vocabulary, never another file (a prepared data file, say)
            fvocab.load_vocab(out)
        except EyasError:
            raise EyasError(f"--out {out} exists and is not a vocabulary file; --force only replaces those: "
                            "choose another --out") from None
    prepared = [(d, *fcap.read_prepared(d)) for d in dirs]
    paths = {_target_for(d, manifest, target) for d, manifest, _ in prepared}
    if len(paths) > 1:
        raise EyasError(f"--data {' '.join(map(str, dirs))} were prepared for different targets; pass data of "
                        "one target")
    V = targets.load_config(paths.pop()).vocab_size
    n = min(DEFAULT_SIZE, V) if size is None else size
    if not 0 < n <= V:
        raise EyasError(f"--size {n} must lie in 1..{V} (the target vocabulary size)")
    counts = sum(supervised_counts([r for r in records if r.split == "train"], V) for _, _, records in prepared)
    d2t, t2d = core.build_from_counts(counts, n)
    cov = core.coverage(core.target_ids(d2t), counts)
    meta = {"tokenizer_fingerprint": prepared[0][1].get("tokenizer_fingerprint", ""),
            "supervised_tokens": int(counts.sum()), "distinct_tokens": int((counts > 0).sum()),
            "coverage": round(cov, 6), "data_split": "train",
            "data": ",".join(str(d.resolve()) for d in dirs)}
    fvocab.save_vocab(out, fvocab.VocabMap(d2t, t2d, meta))
    return {"out": str(out), "draft_size": n, "target_size": V, **{k: meta[k] for k in
            ("supervised_tokens", "distinct_tokens", "coverage")}}


def run_build(args: BuildConfig) -> int:
    s = build(args.data, args.size, args.out, args.target, args.force)
    emit(args, s, f"draft vocabulary {s['draft_size']} of {s['target_size']} ids: covers {s['coverage']:.2%} of "
         f"{s['supervised_tokens']} supervised tokens ({s['distinct_tokens']} distinct) -> {s['out']}")
    return 0


# ---------------------------------------------------------------- compare


def compare(a: Path, b: Path, data: Path | None = None) -> dict:
    va, vb = fvocab.load_any(a), fvocab.load_any(b)
    if va.target_size != vb.target_size:
        raise EyasError(f"{a} maps into {va.target_size} target ids, {b} into {vb.target_size}; they belong to "
                        "different targets and cannot be compared")
    counts = None
    if data is not None:
        _, records = fcap.read_prepared(data)
        try:
            counts = supervised_counts(records, va.target_size)
        except EyasError as e:
            raise EyasError(f"--data {data}: {e}") from e
    return {"a": str(a), "b": str(b), **core.compare_maps(va.target_ids, vb.target_ids, counts)}


def run_compare(args: CompareConfig) -> int:
    s = compare(args.a, args.b, args.data)
    lines = [f"A {s['a']}: {s['size_a']} draft ids", f"B {s['b']}: {s['size_b']} draft ids",
             f"same target id at the same draft position: {s['same_position']} of {min(s['size_a'], s['size_b'])}",
             f"target ids in both: {s['overlap']}",
             f"share of B's draft ids that A can serve after a permutation: {s['b_served_by_a']:.2%}"]
    if "coverage_a" in s:
        lines.append(f"coverage of the data: A {s['coverage_a']:.2%}, B {s['coverage_b']:.2%}")
    if s["identical"]:
        lines.append("the two mappings are identical")
    elif s["permutation"]:
        lines.append("same token set in a different order: lm_head rows must be permuted (eyas vocab remap)")
    emit(args, s, "\n".join(lines))
    return 0


# ---------------------------------------------------------------- remap


def _target_head(path: Path, model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None:
        raise EyasError(f"target {path} has no output embeddings (lm_head); cannot seed new rows")
    return head.weight.detach().float()


def remap(drafter: Path, to: Path, target: str, out: Path, force: bool = False) -> dict:
    """Write `out`: `drafter` with its lm_head carried to the vocabulary in `to`."""
    if out.exists() and any(out.iterdir()) and not force:
        raise EyasError(f"--out {out} exists and is not empty; pass --force or choose another path")
    refuse_out_over_inputs(out, {"--drafter": drafter, "--to": to})
    drafter, _ = ckpt_io.resolve_drafter(drafter)  # a training run stands for its best/ (else final/)
    old = fvocab.read_checkpoint_vocab(drafter, need_head=False)
    path = targets.resolve(target)
    V = targets.load_config(path).vocab_size
    if old["t2d"].numel() != V:
        raise EyasError(f"drafter {drafter} maps into {old['t2d'].numel()} target ids but target {path} has {V}; "
                        "pass the drafter's own target")
    other = targets.trained_for_other(drafter, path)
    if other:
        raise EyasError(f"{other}; new rows would come from another target's lm_head: pass the drafter's own --target")
    new = fvocab.load_vocab(to, target_size=V)
    model, tok = targets.load(path)
    recorded = new.meta.get("tokenizer_fingerprint")
    if recorded and recorded != targets.tokenizer_fingerprint(tok):  # same size is not same tokens
        raise EyasError(f"--to {to} was built from data tokenized by another tokenizer than target {path}'s; "
                        "build the vocabulary on data prepared for this target (eyas vocab build)")
    head = _target_head(path, model)  # (V, H_target)
    w = old.get("lm_head.weight")
    headless = w is None
    if headless:  # it scores with the verifier's head (speculators): its rows are the target's own
        w = head[core.target_ids(old["d2t"])]
    same_h = w.shape[1] == head.shape[1]
    fallback = head[new.target_ids] if same_h else None
    weight, carried = core.remap_rows(w, core.target_ids(old["d2t"]), new.target_ids, fallback)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fvocab.write_remapped_checkpoint(drafter, tmp, {"d2t": new.d2t, "t2d": new.t2d,
                                                    "lm_head.weight": weight.to(w.dtype)}, new)
    ckpt_io.share(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"out": str(out), "rows": new.draft_size, "carried": carried, "new_rows": new.draft_size - carried,
            "new_rows_from": "target lm_head" if same_h else "zeros (drafter hidden size differs from the target's)",
            "head_added": headless}




def run_remap(args: RemapConfig) -> int:
    s = remap(args.drafter, args.to, args.target, args.out, args.force)
    if s["head_added"]:
        msg = (f"the drafter had no lm_head (it scored with the verifier's); wrote the target's {s['rows']} rows "
               f"of the new vocabulary -> {s['out']}")
    else:
        msg = (f"carried {s['carried']} of {s['rows']} lm_head rows by target id; {s['new_rows']} new rows "
               f"from {s['new_rows_from']} -> {s['out']}")
    emit(args, s, msg)
    return 0


# ---------------------------------------------------------------- repair


def _repair_ids(stored: dict, V: int, source: str, where: Path) -> torch.Tensor:
    """Target ids per draft id as `source` gives them (see RepairConfig.maps_from)."""
    n = int(stored["lm_head.weight"].shape[0]) if "lm_head.weight" in stored else int(stored["d2t"].numel())
    if source == "t2d":
        if "t2d" not in stored:
            raise EyasError(f"--maps-from t2d: {where} stores no t2d; pass the training vocabulary file instead")
        ids = torch.nonzero(stored["t2d"].bool()).flatten()
    elif source in ("d2t", "d2t-absolute"):
        if "d2t" not in stored:
            raise EyasError(f"--maps-from {source}: {where} stores no d2t; pass --maps-from t2d or a vocab file")
        ids = stored["d2t"].long() if source == "d2t-absolute" else core.target_ids(stored["d2t"].long())
    else:
        vm = fvocab.load_any(Path(source))
        if vm.target_size != V:
            raise EyasError(f"--maps-from {source}: a vocabulary over {vm.target_size} target ids, the drafter "
                            f"{where} maps into {V}; pass the vocabulary of the drafter's own target")
        ids = vm.target_ids
    if ids.numel() != n:
        raise EyasError(f"--maps-from {source}: {ids.numel()} draft ids, but the drafter {where} has {n} lm_head rows; "
                        "pass the maps of the vocabulary the head was trained with (same size)")
    if int(ids.min()) < 0 or int(ids.max()) >= V or torch.unique(ids).numel() != n:
        raise EyasError(f"--maps-from {source}: the ids are out of range or repeated; they cannot be the head's map")
    return ids


def repair(drafter: Path, source: str, out: Path, force: bool = False) -> dict:
    """Write `out`: `drafter` with d2t and t2d rebuilt from `source`, every other tensor as it was."""
    if out.exists() and any(out.iterdir()) and not force:
        raise EyasError(f"--out {out} exists and is not empty; pass --force or choose another path")
    refuse_out_over_inputs(out, {"--drafter": drafter, **({"--maps-from": Path(source)}
                                                          if source not in ("t2d", "d2t", "d2t-absolute") else {})})
    drafter, _ = ckpt_io.resolve_drafter(drafter)
    stored, V = fvocab.read_maps_as_stored(drafter)
    V = V or (int(stored["t2d"].numel()) if "t2d" in stored else None)
    if V is None:
        raise EyasError(f"{drafter}: neither config.json vocab_size nor a t2d says the target vocabulary size")
    ids = _repair_ids(stored, V, source, drafter)
    d2t = ids - torch.arange(ids.numel())  # offsets, in the head's row order (rows are not moved)
    t2d = core.t2d_from_ids(ids, V)
    before = core.target_ids(stored["d2t"].long()) if "d2t" in stored else torch.arange(ids.numel())
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    vm = fvocab.VocabMap(d2t, t2d, {"source": f"eyas vocab repair --maps-from {source}"})
    fvocab.write_remapped_checkpoint(drafter, tmp, {"d2t": d2t, "t2d": t2d}, vm)
    ckpt_io.share(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"out": str(out), "maps_from": source, "rows": int(ids.numel()),
            "d2t_ids_changed": int((before != ids).sum()) if before.numel() == ids.numel() else int(ids.numel())}


def run_repair(args: RepairConfig) -> int:
    s = repair(args.drafter, args.maps_from, args.out, args.force)
    emit(args, s, f"d2t/t2d rebuilt from {s['maps_from']}: {s['d2t_ids_changed']} of {s['rows']} draft ids now "
                  f"map to another target id; lm_head rows unmoved -> {s['out']}")
    return 0

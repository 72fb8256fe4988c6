"""Disk full (8.3), untrusted files (8.4) and numerical guards (8.6)."""

from __future__ import annotations

import errno
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.robustness.harness import error_lines

SRC = Path(__file__).resolve().parents[2] / "src" / "eyas"


def _run(cli, *argv):
    """The CLI in-process; an exception escaping main() is a traceback (code None)."""
    try:
        return cli(*argv)
    except Exception as e:  # noqa: BLE001 - recorded as a failure by the caller
        return None, "", f"Traceback (escaped): {type(e).__name__}: {e}"


def _enospc_after(monkeypatch, module, name: str, ok_calls: int) -> dict:
    """Patch module.name (a save_file) to succeed `ok_calls` times, then write half a file
    and raise ENOSPC, as a full disk does."""
    real = getattr(module, name)
    calls = {"n": 0}

    def save(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] <= ok_calls:
            return real(tensors, path, *a, **k)
        Path(path).write_bytes(b"\x00" * 64)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(module, name, save)
    return calls


def _one_line_exit2(code, err, needles=("space", "disk", "enospc")):
    assert code == 2 and "Traceback" not in err, (code, err[-1500:])
    lines = error_lines(err)
    assert len(lines) == 1, lines
    assert any(n in lines[0].lower() for n in needles), lines[0]
    return lines[0]


def test_capture_disk_full(healthy, tmp_path, cli, monkeypatch):
    import safetensors.torch as st

    _enospc_after(monkeypatch, st, "save_file", ok_calls=3)
    out = tmp_path / "cap"
    code, _, err = _run(cli, "capture", "--target", healthy["target"], "--data", healthy["prep"], "--out", out,
                        "--dtype", "fp32", "--batch-tokens", "300", "--shard-mb", "0.05")
    for f in out.glob("shard-*.safetensors"):  # every finished shard stays valid
        load_file(f)
    assert len(list(out.glob("shard-*.safetensors"))) == 3
    line = _one_line_exit2(code, err)
    assert str(out) in line


def test_train_disk_full(healthy, tmp_path, cli, monkeypatch):
    from eyas.formats import checkpoint as ck
    from eyas.stages.trainer import checkpoint_steps

    _enospc_after(monkeypatch, ck, "save_file", ok_calls=2)  # step-1 and best, then step-2 fails
    out = tmp_path / "run"
    code, _, err = _run(cli, "train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab",
                        healthy["vocab"], "--out", out, "--ttt", "2", "--max-steps", "3", "--eval-every", "1",
                        "--dtype", "fp32", "--batch-tokens", "256")
    steps = checkpoint_steps(out)
    assert steps == [1]
    ck.load_checkpoint(out / "checkpoints" / "step-1")  # the finished checkpoint stays valid
    line = _one_line_exit2(code, err)
    assert str(out) in line


# ---------------------------------------------------------------- untrusted files


class _Evil:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_pickle(src: Path, dst: Path, marker: Path) -> Path:
    """A copy of checkpoint `src` whose weights are a pickle that creates `marker` on load."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    _Evil.marker = str(marker)
    payload = {k: v for k, v in sd.items()}
    payload["evil"] = _Evil()
    with open(dst / "pytorch_model.bin", "wb") as f:
        pickle.dump(payload, f)
    torch.save(payload, dst / "zip.bin")  # the zip form too, for readers that glob *.bin
    return dst


@pytest.mark.parametrize("command", ["convert", "doctor", "train-init-from", "vocab-compare"])
def test_malicious_pickle_never_runs(command, healthy, tmp_path, cli):
    marker = tmp_path / "PWNED"
    ckpt = _plant_pickle(healthy["sglang"], tmp_path / "evil", marker)
    control = tmp_path / "control"
    _Evil.marker = str(control)
    pickle.loads(pickle.dumps(_Evil()))
    assert control.exists()  # sanity: a plain unpickle of this payload does run code
    argv = {
        "convert": ["convert", ckpt, "--to", "eyas", "--out", tmp_path / "o"],
        "doctor": ["doctor", ckpt],
        "train-init-from": ["train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab",
                            healthy["vocab"], "--init-from", ckpt, "--out", tmp_path / "o", "--max-steps", "1",
                            "--ttt", "2", "--dtype", "fp32"],
        "vocab-compare": ["vocab", "compare", ckpt, healthy["vocab"]],
    }[command]
    code, _, err = _run(cli, *argv)
    assert not marker.exists(), f"{command} executed code from a pickle"
    assert code in (1, 2) and "Traceback" not in err, (code, err[-1500:])
    assert not (tmp_path / "o").exists()


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(SRC.rglob("*.py"))]


def test_no_unsafe_loaders_in_source():
    bad = []
    for p, text in _sources():
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bpickle\.loads?\(", code):
                bad.append(f"{p}:{n}: pickle.load")
            if "torch.load(" in code and "weights_only=True" not in code:
                # allow the argument on a continuation line
                nxt = " ".join(text.splitlines()[n - 1:n + 2])
                if "weights_only=True" not in nxt:
                    bad.append(f"{p}:{n}: torch.load without weights_only=True")
            if "yaml.load(" in code and "SafeLoader" not in code:
                bad.append(f"{p}:{n}: yaml.load without SafeLoader")
            if re.search(r"trust_remote_code\s*=\s*True", code):
                bad.append(f"{p}:{n}: trust_remote_code=True")
            if re.search(r"\b(eval|exec)\(", code) and "def " not in code and ".eval(" not in code:
                bad.append(f"{p}:{n}: eval/exec")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("shard", ["../x.safetensors", "../../etc/passwd", "sub/../../x.safetensors", "/abs.safetensors"])
def test_capture_manifest_escaping_paths_rejected(healthy, tmp_path, shard):
    from eyas.errors import EyasError
    from eyas.formats.capture import CaptureReader

    cap = shutil.copytree(healthy["cap"], tmp_path / "cap")
    m = json.loads((cap / "manifest.json").read_text())
    m["shards"][0]["file"] = shard
    (cap / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EyasError, match="leaves"):
        CaptureReader(cap)


# ---------------------------------------------------------------- numerical guard


def test_nan_loss_stops_training_naming_step_and_batch(healthy, tmp_path, cli, monkeypatch):
    from eyas.core import ttt
    from eyas.stages import trainer as training
    from eyas.formats.checkpoint import load_checkpoint

    real = ttt.TTTModule.forward
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        loss, stats = real(self, *a, **k)
        if self.training and torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 2:  # the second optimizer step
                loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(ttt.TTTModule, "forward", poisoned)
    out = tmp_path / "run"
    code, _, err = _run(cli, "train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab",
                        healthy["vocab"], "--out", out, "--ttt", "2", "--max-steps", "3", "--eval-every", "1",
                        "--dtype", "fp32", "--batch-tokens", "256")
    assert code == 2 and "Traceback" not in err, (code, err[-1500:])
    lines = error_lines(err)
    assert len(lines) == 1 and "step 2" in lines[0] and "batch" in lines[0], lines
    assert "step-1" in lines[0]  # names the last good checkpoint
    assert training.checkpoint_steps(out) == [1]
    load_checkpoint(out / "checkpoints" / "step-1")
    assert not (out / "checkpoints" / "step-2").exists() and not (out / "final").exists()

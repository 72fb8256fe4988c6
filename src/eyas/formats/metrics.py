"""Reading a training run's metrics.jsonl (one JSON record per line: kind train | eval)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(metrics_file: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order."""
    return [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]


def last_eval(run_dir: Path) -> dict | None:
    """The last eval record of a training run's metrics.jsonl, or None when there is none."""
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        return None
    ev = [r for r in read_metrics(f) if r.get("kind") == "eval" and "acc_0" in r]
    return ev[-1] if ev else None

"""The resumable work file of regeneration (`<work_dir>/batches.jsonl`): every finished batch is
one JSON line, appended and fsynced, under a `state.json` that holds the key of the prompts and
settings it belongs to; a directory keyed for other work is started over. Written and reused by
`eyas.runtime.regenerate` and `eyas.serve.vllm_generate`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
WORK_VERSION = 3  # 3: each batch record carries its `cut` count


class WorkFile:
    """Finished batches, one JSON line each, appended and fsynced; stale or torn lines dropped."""

    def __init__(self, work_dir: Path, key: str):
        self.dir = Path(work_dir)
        self.path = self.dir / "batches.jsonl"
        state = self.dir / "state.json"
        if self.dir.exists():
            try:
                same = json.loads(state.read_text()).get("key") == key
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:
                log.warning("%s holds work for other prompts or settings; starting over", self.dir)
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not state.is_file():
            state.write_text(json.dumps({"key": key}) + "\n")
        self.done: dict[int, dict] = {}
        good = []
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn last line of a killed run
                self.done[rec["batch"]] = rec
                good.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(g + "\n" for g in good), encoding="utf-8")
        os.replace(tmp, self.path)

    def append(self, rec: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[rec["batch"]] = rec

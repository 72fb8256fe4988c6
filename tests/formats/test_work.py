"""The resumable work file of regeneration (`formats.work.WorkFile`)."""

from __future__ import annotations

import json

from eyas.formats.work import WorkFile


def test_workfile_drops_torn_line(tmp_path):
    wf = WorkFile(tmp_path / "w", "k1")
    wf.append({"batch": 0, "ids": ["a"], "answers": [["x"]]})
    with open(wf.path, "a") as f:
        f.write('{"batch": 1, "ids": ["b"], "ans')  # killed mid-write
    again = WorkFile(tmp_path / "w", "k1")
    assert list(again.done) == [0]
    again.append({"batch": 1, "ids": ["b"], "answers": [["y"]]})
    assert [json.loads(l)["batch"] for l in again.path.read_text().splitlines()] == [0, 1]
    assert WorkFile(tmp_path / "w", "other-key").done == {}  # other settings: start over

"""`eyas.serve.vllm_serve.serve_series` without an engine: how a child's end is turned into one
outcome per job (refused, failed, served), the child restarted for the jobs after a dead one,
and vLLM's root cause read from its log. The real engine runs in tests/serve/test_serve_vllm.py
and tests/doctor/test_doctor_vllm.py."""

from __future__ import annotations

import pytest

from eyas.errors import EyasError
from eyas.serve import vllm_serve as vs


def _job(name: str) -> vs.ServeJob:
    return vs.ServeJob(target="/t", prompts=[[1, 2]], max_new_tokens=4, name=name)


def _fake_children(monkeypatch, script):
    """Replace the child with `script`: one (outcomes, exit code, log) per start, in turn."""
    calls = []

    def run_child(jobs, workdir, on_request, timeout_s):
        calls.append([j.name for j in jobs])
        return script[len(calls) - 1]
    monkeypatch.setattr(vs, "_run_child", run_child)
    return calls


def test_a_dead_child_is_charged_to_its_job_and_restarted_for_the_rest(monkeypatch, tmp_path):
    m = vs.MARK
    served = vs.Outcome("a", vs.SERVES, {"levels": [{"acceptance_length": 2.5}]})
    log1 = (f"{m}job a\nINFO fine\n{m}started a\n{m}job b\n"
            "(EngineCore pid=7) ERROR 01-01 00:00:00 [core.py:1] ValueError: no module named 'decoder'\n")
    log2 = (f"{m}job c\n{m}started c\n"
            "(Worker pid=9) ERROR 01-01 00:00:00 [w.py:2] IndexError: index 49976 out of bounds\n")
    log3 = f"{m}job d\n{m}started d\n"
    calls = _fake_children(monkeypatch, [([served], -9, log1), ([], -9, log2),
                                          ([vs.Outcome("d", vs.FAILS, error="RuntimeError: see root cause above")],
                                           0, log3)])
    out = vs.serve_series([_job(n) for n in "abcd"], tmp_path)
    assert calls == [["a", "b", "c", "d"], ["c", "d"], ["d"]]
    assert [o.outcome for o in out] == [vs.SERVES, vs.REFUSES, vs.FAILS, vs.FAILS]
    assert out[0].acceptance_length == 2.5 and out[1].acceptance_length is None
    assert out[1].error == "engine process died: ValueError: no module named 'decoder'"  # died before it started
    assert out[2].error == "engine process died: IndexError: index 49976 out of bounds"  # died while serving
    assert out[3].error == "RuntimeError: see root cause above"  # nothing more specific in its log
    assert (tmp_path / "b.log").read_text().startswith("(EngineCore pid=7) ERROR")


def test_a_child_that_dies_before_its_first_job_is_an_error(monkeypatch, tmp_path):
    _fake_children(monkeypatch, [([], 1, "ModuleNotFoundError: No module named 'vllm'\n")])
    with pytest.raises(EyasError, match="before it began a"):
        vs.serve_series([_job("a"), _job("b")], tmp_path)


def test_serve_raises_naming_the_root_cause(monkeypatch, tmp_path):
    log = f"{vs.MARK}job a\nERROR 01-01 00:00:00 [x.py:1] Exception: stack trace above\nValueError: bad fc\n"
    _fake_children(monkeypatch, [([vs.Outcome("a", vs.REFUSES, error="RuntimeError: Engine core initialization "
                                              "failed. See root cause above.")], 0, log)])
    with pytest.raises(EyasError, match=r"failed before serving: ValueError: bad fc"):
        vs.serve(_job("a"), tmp_path)


def test_error_line_is_the_innermost_cause():
    try:
        try:
            raise IndexError("index 5 is out of bounds")
        except IndexError as e:
            raise RuntimeError("EngineCore failed") from e
    except RuntimeError as e:
        assert vs.error_line(e) == "IndexError: index 5 is out of bounds"

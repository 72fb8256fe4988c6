"""Raw prompt loaders: every schema on hand-made files, lenient JSONL, de-dup, the real pool."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import PROMPTS

from eyas.formats.builtin_prompts import builtin_prompts
from eyas.errors import EyasError
from eyas.formats.prompts import dedup_key, load_prompt_files, load_prompt_files_with_stats


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _roles(conv):
    return [t["role"] for t in conv.turns]


def test_openai_messages(tmp_path):
    f = _jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]}])
    (c,) = load_prompt_files([f])
    assert _roles(c) == ["system", "user", "assistant", "user"]
    assert c.source == "chat" and c.category == "chat" and c.id == "chat:0" and c.has_answer


def test_sharegpt_conversations(tmp_path):
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q2"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "only system"}]},
    ]))
    convs, stats = load_prompt_files_with_stats([f])
    assert [_roles(c) for c in convs] == [["user", "assistant"], ["user"]]
    assert stats["sg"].no_prompt == 1 and stats["sg"].schemas["sharegpt"] == 3


def test_alpaca_and_gptteacher(tmp_path):
    f = tmp_path / "code_alpaca.json"
    f.write_text(json.dumps([{"instruction": "Sum", "input": "1, 2", "output": "3"},
                             {"instruction": "Say hi", "input": "", "response": "hi"},
                             {"instruction": "No answer"}]))
    a, b, c = load_prompt_files([f])
    assert a.turns == [{"role": "user", "content": "Sum\n\n1, 2"}, {"role": "assistant", "content": "3"}]
    assert b.turns[0]["content"] == "Say hi" and b.turns[1]["content"] == "hi"
    assert not c.has_answer and a.category == "code"


def test_gsm8k_svamp_mbpp_selfinstruct(tmp_path):
    g = _jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "2\n#### 2"}])
    s = tmp_path / "SVAMP.json"
    s.write_text(json.dumps([{"ID": "x", "Body": "Tom has 3 apples.", "Question": "How many?", "Answer": 3.0}]))
    m = _jsonl(tmp_path / "mbpp.jsonl", [{"text": "Write f.", "code": "def f():\r\n\treturn 1", "test_list": ["assert f() == 1"]}])
    si = _jsonl(tmp_path / "seed_tasks.jsonl", [{"instruction": "Do", "instances": [{"input": "X", "output": "Y"}]}])
    gc, sc, mc, sic = load_prompt_files([g, s, m, si])
    assert gc.turns[1]["content"] == "2\n#### 2" and gc.category == "math"
    assert sc.turns == [{"role": "user", "content": "Tom has 3 apples. How many?"}] and sc.category == "math"
    assert "assert f() == 1" in mc.turns[0]["content"] and mc.turns[1]["content"] == "def f():\n\treturn 1"
    assert mc.category == "code"
    assert sic.turns == [{"role": "user", "content": "Do\n\nX"}, {"role": "assistant", "content": "Y"}]


def test_mtbench_turns_and_category(tmp_path):
    f = _jsonl(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "coding", "turns": ["Write code.", "Now faster."]},
        {"question_id": 2, "category": "math", "turns": ["1+1?", "2+2?"], "reference": ["2", "4"]}])
    a, b = load_prompt_files([f])
    assert _roles(a) == ["user", "user"] and a.category == "code"
    assert _roles(b) == ["user", "assistant", "user", "assistant"] and b.category == "math"


def test_prompt_strings_txt_and_gz(tmp_path):
    p = _jsonl(tmp_path / "arena.jsonl", [{"prompt": "Tell a joke", "category": "arena-hard-v0.1"},
                                          {"prompt": "Code it", "completion": "done"}])
    s = tmp_path / "strings.jsonl.gz"
    s.write_bytes(gzip.compress(b'"first prompt"\n"second prompt"\n'))
    t = tmp_path / "book.txt"
    t.write_text("Para one.\n\nPara two.\n\n" + ("x" * 2500))
    convs = load_prompt_files([p, s, t])
    assert [c.turns[0]["content"] for c in convs[:4]] == ["Tell a joke", "Code it", "first prompt", "second prompt"]
    assert convs[1].has_answer and convs[0].category == "chat"
    txt = [c for c in convs if c.source == "book"]
    assert [c.turns[0]["content"] for c in txt] == ["Para one.\n\nPara two.", "x" * 2000, "x" * 500]
    # one prompt per line and no blank line (9,900 characters): cut at line breaks, never over 2,000
    lines = [f"Question {i}: " + "why " * 20 + "?" for i in range(100)]
    words = [f"w{i}" for i in range(900)]
    t.write_text("\n".join(lines) + "\n\n" + " ".join(words))
    chunks = [c.turns[0]["content"] for c in load_prompt_files([t])]
    assert max(map(len, chunks)) <= 2000 and len(chunks) == 8
    assert "\n".join(chunks[:5]).split("\n") == lines and " ".join(chunks[5:]).split() == words


def test_malformed_lines_counted_and_repaired(tmp_path):
    f = tmp_path / "wild.jsonl"
    f.write_text('{"instruction": "good"}\n{"instruction": "bad \\escape"}\n'
                 '{"instruction": "split\nrecord"}\nnot json at all\n')
    convs, stats = load_prompt_files_with_stats([f])
    assert [c.turns[0]["content"] for c in convs] == ["good", "bad \\escape", "split\nrecord"]
    assert stats["wild"].malformed == 1 and stats["wild"].repaired == 2


def test_dedup_across_files(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "Hello, World!"}, {"prompt": "other"}])
    b = _jsonl(tmp_path / "b.jsonl", ["hello world", "new"])
    convs, stats = load_prompt_files_with_stats([a, b])
    assert [c.turns[0]["content"] for c in convs] == ["Hello, World!", "other", "new"]
    assert stats["b"].duplicates == 1
    assert len(load_prompt_files([a, b], dedup=False)) == 4


@pytest.mark.parametrize("content,match", [
    ('{"foo": 1}\n{"bar": 2}\n', "unknown schema"),
    ("", "empty"),
    ('[{"prompt": "x"}, ', "corrupt JSON"),
    ("not json\nstill not\n", "none of its 2 lines"),
])
def test_bad_files(tmp_path, content, match):
    f = tmp_path / ("bad.json" if content.startswith("[") else "bad.jsonl")
    f.write_text(content)
    with pytest.raises(EyasError, match=match) as e:
        load_prompt_files([f])
    assert str(f) in str(e.value)


def test_missing_and_unknown_type(tmp_path):
    with pytest.raises(EyasError, match="no such file"):
        load_prompt_files([tmp_path / "nope.jsonl"])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match="unknown file type"):
        load_prompt_files([tmp_path / "x.csv"])


def test_every_shared_prompt_file_loads():
    files = sorted(PROMPTS.iterdir())
    assert len(files) == 23
    convs, stats = load_prompt_files_with_stats(files, dedup=False)
    for f in files:
        st = next(s for s in stats.values() if s.path == str(f))
        assert st.kept > 0, f
        assert st.malformed == 0, f  # the non-strict InstructionWild lines are repaired
    by_source = {}
    for c in convs:
        by_source.setdefault(c.source, c)
    raw = json.loads((PROMPTS / "SVAMP__SVAMP.json").read_text())[0]
    assert by_source["SVAMP__SVAMP"].turns[0]["content"] == raw["Body"].strip() + " " + raw["Question"].strip()
    assert stats["InstructionWild__user_3"].repaired >= 2
    mt = [c for c in convs if c.source == "FastChat__mt_bench__question"]
    assert len(mt) == 80 and all(len(c.user_turns) == 2 for c in mt)
    assert {c.category for c in convs} >= {"code", "math", "chat", "summarization", "qa"}


def test_builtin_prompts_deterministic_and_varied():
    a, b = builtin_prompts(), builtin_prompts()
    assert [c.turns for c in a] == [c.turns for c in b]
    assert len({dedup_key(c) for c in a}) >= 1000
    cats = {c.category for c in a}
    assert cats >= {"code", "math", "explanation", "writing", "qa", "chat"}
    assert any(len(c.user_turns) == 2 for c in a)
    assert all(not c.has_answer for c in a)


def test_schema_decides_category_in_a_mixed_file(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"text": "Write a function to add two numbers.", "test_list": ["assert add(1, 2) == 3"]}\n'
                 '{"question": "What is 2 + 3?", "answer": "5"}\n'
                 '{"turns": ["Tell me a story."], "category": "writing"}\n')
    cats = [c.category for c in load_prompt_files([f])]
    assert cats == ["code", "math", "writing"]


def test_parquet_reads_as_the_same_records_as_jsonl(tmp_path, eyas_cli):
    """A .parquet of records loads exactly as the JSON Lines file of the same records (the
    JSONL reader is the reference); a file that is not Parquet exits 2 naming it."""
    import pyarrow as pa  # installed by `datasets` (test extras)
    import pyarrow.parquet as pq

    chats = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i}"},
                           {"role": "assistant", "content": f"A{i}"}], "category": "coding" if i % 2 else "math"}
             for i in range(5)]
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": f"S{i}"}, {"from": "gpt", "value": "R"}]}
                for i in range(3)]
    mixed = [{"instruction": "Do X", "output": "ok"}, {"instruction": "Do Y", "input": "data", "output": "ok2"},
             {"messages": [{"role": "user", "content": "hey"}]}, {"question": "1+1?", "answer": "2"}]
    for name, recs in (("chat", chats), ("sg", sharegpt), ("mixed", mixed)):
        keys = list(dict.fromkeys(k for r in recs for k in r))  # a file's columns: every record's keys
        pq.write_table(pa.Table.from_pylist(recs, schema=pa.Table.from_pylist(
            [{k: r.get(k) for k in keys} for r in recs]).schema), tmp_path / f"{name}.parquet")
        ref = load_prompt_files([_jsonl(tmp_path / f"{name}.jsonl", recs)])
        got = load_prompt_files([tmp_path / f"{name}.parquet"])
        assert got == ref and len(got) == len(recs) and got[1].category == ref[1].category
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all\n")
    with pytest.raises(EyasError, match="not a readable Parquet file"):
        load_prompt_files([bad])
    pq.write_table(pa.Table.from_pylist([{"messages": []}]).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(EyasError, match="no rows"):
        load_prompt_files([tmp_path / "empty.parquet"])
    code, _, err = eyas_cli("data", "prepare", "--input", bad, "--out", tmp_path / "out")
    assert code == 2 and "bad.parquet" in err and err.count("\n") <= 1 and not (tmp_path / "out").exists()


def test_arrow_and_save_to_disk_read_as_the_same_records(tmp_path):
    """An Arrow file and a `datasets` save_to_disk directory (the peers' own writer) load exactly
    as the JSON Lines file of the same records."""
    import datasets
    import pyarrow as pa

    recs = [{"conversations": [{"from": "human", "value": f"S{i}"}, {"from": "gpt", "value": "R"}], "id": str(i)}
            for i in range(4)] + [{"instruction": "Do X", "output": "ok"}]
    ref = load_prompt_files([_jsonl(tmp_path / "t.jsonl", recs)])
    keys = list(dict.fromkeys(k for r in recs for k in r))  # a table's columns: every record's keys
    full = [{k: r.get(k) for k in keys} for r in recs]
    datasets.Dataset.from_list(full).save_to_disk(str(tmp_path / "t"))
    assert load_prompt_files([tmp_path / "t"]) == ref and len(ref) == len(recs)
    table = pa.Table.from_pylist(full)
    for name, writer in (("t.arrow", pa.ipc.new_stream), ("u.arrow", pa.ipc.new_file)):
        with writer(str(tmp_path / name), table.schema) as w:
            w.write_table(table)
        got = load_prompt_files([tmp_path / name])
        assert [c.turns for c in got] == [c.turns for c in ref] and len(got) == len(ref)
    (tmp_path / "bad.arrow").write_bytes(b"not arrow")
    with pytest.raises(EyasError, match="not a readable Arrow file"):
        load_prompt_files([tmp_path / "bad.arrow"])

"""One prompt record -> the turns and category of a `Conversation`: the record schemas eyas
recognises and the categories it assigns. `eyas.formats.prompts` reads the files.

Schema per record (first match wins; the turns list holds `user`, `assistant` and
`system` turns; "answer" means an assistant turn is taken from the file):

| schema   | detected by                      | user turn(s)                       | answer                      |
|----------|----------------------------------|------------------------------------|-----------------------------|
| string   | a JSON string; a `.txt` chunk    | the string                         | none                        |
| openai   | `messages: [{role, content}]`    | `user` messages (`system` kept)    | `assistant` messages        |
| sharegpt | `conversations: [{from, value}]` | `human`/`user` (`system` kept)     | `gpt`/`assistant`/`chatgpt` |
| mtbench  | `turns: [str, ...]`              | each turn, in order                | `reference` if one per turn |
| alpaca   | `instruction` (+ `input`)        | instruction + `input` (if any)     | `output` or `response`      |
| selfinst | `instruction` + `instances`      | instruction + `instances[0].input` | `instances[0].output`       |
| gsm8k    | `question`                       | question                           | `answer`                    |
| svamp    | `Body` + `Question`              | Body + " " + Question              | none (`Answer` is a number) |
| mbpp     | `text` (+ `test_list`)           | text, then the tests (below)       | `code`                      |
| prompt   | `prompt` (HumanEval, arena-hard) | prompt                             | `completion` or `response`  |

alpaca's and selfinst's instruction and input are joined by a blank line; mbpp's user turn is
`text`, then "Your code should pass these tests:" and the `test_list` lines.

A leading assistant turn (nothing to answer) is dropped, and so is a system turn after the
first turn. Category per record: the record's own `subcategory`/`category` when it names a
known one (MT-bench, arena-hard v2, EAGLE sets), else the schema's (gsm8k, svamp: math; mbpp:
code), else one inferred from the file name (math: gsm/svamp/math; code: code/mbpp/humaneval;
summarization: sum/tldr/cnn/xsum; qa: qa), else `chat`.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMAS = ("string", "openai", "sharegpt", "mtbench", "alpaca", "selfinst", "gsm8k", "svamp", "mbpp", "prompt")
CATEGORIES = ("code", "math", "chat", "summarization", "qa", "writing", "roleplay", "reasoning",
              "extraction", "stem", "humanities", "explanation")
# Record-level category names as the sources spell them -> eyas categories.
CATEGORY_ALIASES = {"coding": "code", "creative_writing": "writing", "summarize": "summarization"}
# Schemas that say what a record is, whatever its file is called.
SCHEMA_CATEGORIES = {"gsm8k": "math", "svamp": "math", "mbpp": "code"}
# File-name keywords -> default category (checked in order).
FILE_CATEGORIES = (
    (("gsm", "grade-school-math", "svamp", "math"), "math"),
    (("code", "mbpp", "humaneval"), "code"),
    (("sum", "tldr", "cnn", "xsum"), "summarization"),
    (("qa",), "qa"),
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


@dataclass
class Conversation:
    """One prompt record: `turns` are {role, content} dicts (system/user/assistant)."""

    id: str
    source: str
    category: str
    turns: list[dict]

    @property
    def has_answer(self) -> bool:
        return any(t["role"] == "assistant" and t["content"].strip() for t in self.turns)

    @property
    def user_turns(self) -> list[str]:
        return [t["content"] for t in self.turns if t["role"] == "user"]


def file_category(source: str) -> str:
    """The category a file's name implies (FILE_CATEGORIES), else `chat`."""
    low = source.lower()
    for words, cat in FILE_CATEGORIES:
        if any(w in low for w in words):
            return cat
    return "chat"


def record_category(rec, default: str) -> str:
    """The record's own `subcategory`/`category` when it names a known one, else `default`."""
    if isinstance(rec, dict):
        for key in ("subcategory", "category"):
            val = rec.get(key)
            if isinstance(val, str):
                val = CATEGORY_ALIASES.get(val.strip().lower(), val.strip().lower())
                if val in CATEGORIES:
                    return val
    return default


def _s(x) -> str:
    return x if isinstance(x, str) else ("" if x is None else str(x))


def _join(a, b, sep: str = "\n\n") -> str:
    a, b = _s(a).strip(), _s(b).strip()
    return f"{a}{sep}{b}" if a and b else a or b


def parse_record(rec) -> tuple[str, list[dict]] | None:
    """(schema, turns) for one record, or None when no schema matches."""
    if isinstance(rec, str):
        return "string", [{"role": "user", "content": rec}]
    if not isinstance(rec, dict):
        return None
    u = lambda c: {"role": "user", "content": _s(c)}  # noqa: E731
    a = lambda c: {"role": "assistant", "content": _s(c)}  # noqa: E731
    if isinstance(rec.get("messages"), list):
        turns = [{"role": _s(m.get("role")), "content": _s(m.get("content"))}
                 for m in rec["messages"] if isinstance(m, dict)]
        return "openai", [t for t in turns if t["role"] in ("system", "user", "assistant")]
    if isinstance(rec.get("conversations"), list):
        turns = [{"role": SHAREGPT_ROLES.get(_s(m.get("from")).lower(), ""), "content": _s(m.get("value"))}
                 for m in rec["conversations"] if isinstance(m, dict)]
        return "sharegpt", [t for t in turns if t["role"]]
    if isinstance(rec.get("turns"), list):
        refs = rec.get("reference")
        refs = refs if isinstance(refs, list) and len(refs) == len(rec["turns"]) else None
        turns = []
        for i, t in enumerate(rec["turns"]):
            turns.append(u(t))
            if refs:
                turns.append(a(refs[i]))
        return "mtbench", turns
    if "instruction" in rec:
        inst = rec.get("instances")
        if isinstance(inst, list) and inst and isinstance(inst[0], dict):
            return "selfinst", [u(_join(rec["instruction"], inst[0].get("input"))), a(inst[0].get("output"))]
        answer = rec.get("output", rec.get("response"))
        return "alpaca", [u(_join(rec["instruction"], rec.get("input")))] + ([a(answer)] if answer else [])
    if "question" in rec:
        return "gsm8k", [u(rec["question"])] + ([a(rec["answer"])] if rec.get("answer") else [])
    if "Body" in rec and "Question" in rec:
        return "svamp", [u(_join(rec["Body"], rec["Question"], " "))]
    if "text" in rec:
        tests = rec.get("test_list")
        prompt = _s(rec["text"])
        if isinstance(tests, list) and tests:
            prompt = prompt.strip() + "\nYour code should pass these tests:\n\n" + "\n".join(map(_s, tests))
        return "mbpp", [u(prompt)] + ([a(rec["code"])] if rec.get("code") else [])
    if "prompt" in rec:
        answer = rec.get("completion", rec.get("response"))
        return "prompt", [u(rec["prompt"])] + ([a(answer)] if answer else [])
    return None


def clean_turns(turns: list[dict]) -> list[dict]:
    """Normalise newlines; drop empty turns and assistant turns that answer nothing."""
    out: list[dict] = []
    for t in turns:
        content = t["content"].replace("\r\n", "\n")
        if not content.strip():
            continue
        if t["role"] == "assistant" and not any(x["role"] == "user" for x in out):
            continue
        if t["role"] == "system" and out:
            continue  # a system turn is meaningful only first
        out.append({"role": t["role"], "content": content})
    return out

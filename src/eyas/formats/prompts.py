"""Raw prompt files -> `Conversation`s: file formats, lenient JSONL, per-file statistics,
de-duplication. Used by `eyas data prepare` and `eyas bench --prompts`.

Files: a JSON array (`.json`), JSON Lines (`.jsonl`), or plain text (`.txt`, split into
chunks at blank lines), each optionally gzip-compressed (`.gz`); or tables, whose rows are read
as JSON records: Parquet (`.parquet`, how datasets on the Hugging Face hub are stored), Arrow
(`.arrow`), or a directory written by `datasets`' `save_to_disk` (needs pyarrow, which
`datasets` installs). A JSON file whose text does not start with `[` is read as JSON Lines.
Malformed JSONL lines are repaired when the damage is benign (raw control characters, invalid
`\\` escapes, one record split over two lines), otherwise counted and skipped; a file with no
usable record is an error.

Each record becomes a `Conversation` through `eyas.formats.prompt_records` (the schema table,
turn cleaning, categories).

De-duplication (across and within files) keys on the user turns, lowercased with
everything but letters and digits removed; the first occurrence is kept.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError
from eyas.formats.prompt_records import (SCHEMA_CATEGORIES, SCHEMAS, Conversation, clean_turns, file_category,
                                         parse_record, record_category)

log = logging.getLogger(__name__)

TXT_CHUNK_CHARS = 2000


@dataclass
class FileStats:
    """What happened to one input file."""

    path: str
    source: str
    records: int = 0
    kept: int = 0
    malformed: int = 0
    repaired: int = 0
    no_prompt: int = 0
    duplicates: int = 0
    schemas: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"path": self.path, "records": self.records, "kept": self.kept, "malformed": self.malformed,
                "repaired": self.repaired, "no_prompt": self.no_prompt, "duplicates": self.duplicates,
                "schemas": dict(self.schemas)}


# ---------------------------------------------------------------- public API


class NotAPromptFile(EyasError):
    """The path does not exist or has no prompt-file suffix (the user may have meant a keyword)."""


def load_prompt_files(paths: list[Path], dedup: bool = True, flag: str = "--input",
                      keywords: tuple[str, ...] = ()) -> list[Conversation]:
    """Load and de-duplicate prompt files (records to turns: `eyas.formats.prompt_records`). Errors
    name the file after `flag`; a missing or non-prompt file also lists the caller's `keywords`."""
    return load_prompt_files_with_stats(paths, dedup, flag, keywords)[0]


def load_prompt_files_with_stats(paths: list[Path], dedup: bool = True, flag: str = "--input",
                                 keywords: tuple[str, ...] = ()) -> tuple[list[Conversation], dict[str, FileStats]]:
    """Like `load_prompt_files`, plus per-source statistics keyed by source name."""
    convs: list[Conversation] = []
    stats: dict[str, FileStats] = {}
    seen: set[str] = set()
    for path in paths:
        source = _unique_source(source_name(Path(path)), stats)
        st = stats[source] = FileStats(path=str(path), source=source)
        try:
            new = load_file(Path(path), source, st)
        except NotAPromptFile as e:
            more = ", or " + " or ".join(f"`{k}`" for k in keywords) if keywords else ""
            raise EyasError(f"{flag} {e}{more}") from None
        except EyasError as e:
            raise EyasError(f"{flag} {e}") from None
        _admit(convs, seen, st, new, dedup)
    return convs, stats


def _admit(convs: list[Conversation], seen: set[str], st: FileStats, new, dedup: bool) -> None:
    """Append `new` conversations to `convs`, dropping (and counting) ones already seen."""
    for conv in new:
        key = dedup_key(conv)
        if dedup and key in seen:
            st.duplicates += 1
            continue
        seen.add(key)
        st.kept += 1
        convs.append(conv)


def add_conversations(convs: list[Conversation], extra: list[Conversation], stats: dict[str, FileStats],
                      source: str, dedup: bool = True) -> None:
    """Append already-built conversations (the built-in set) with the same de-dup rule."""
    seen = {dedup_key(c) for c in convs}
    st = stats[source] = FileStats(path=source, source=source, records=len(extra))
    st.schemas["builtin"] = len(extra)
    _admit(convs, seen, st, extra, dedup)


def source_name(path: Path) -> str:
    """File name without .gz / .json / .jsonl / .txt / .parquet / .arrow."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".txt", ".parquet", ".arrow"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def dedup_key(conv: Conversation) -> str:
    """User turns, lowercased, letters and digits only (SOURCES.md's normalisation)."""
    return "\x1f".join(_normalise(t) for t in conv.user_turns)


def first_turn_key(conv: Conversation) -> str:
    """The first user turn, normalised as `dedup_key` (what `eyas bench` prompts with)."""
    turns = conv.user_turns
    return _normalise(turns[0]) if turns else ""


def _normalise(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", "", text.lower())


# ---------------------------------------------------------------- reading files


def _unique_source(name: str, stats: dict) -> str:
    if name not in stats:
        return name
    i = 2
    while f"{name}#{i}" in stats:
        i += 1
    return f"{name}#{i}"


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise NotAPromptFile(f"{path}: no such file; pass an existing prompt file")
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        return data.decode("utf-8-sig")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise EyasError(f"{path}: cannot decompress ({e}); pass a valid .gz file") from e
    except UnicodeDecodeError as e:
        raise EyasError(f"{path}: not UTF-8 text ({e}); re-encode it as UTF-8") from e


def load_file(path: Path, source: str, st: FileStats) -> list[Conversation]:
    """All conversations in one file, in file order (no de-duplication)."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if path.name.endswith((".parquet", ".arrow")) or (path / "state.json").is_file():
        return _to_conversations(path, source, _table_records(path), st)
    if not name.endswith((".json", ".jsonl", ".txt")):
        raise NotAPromptFile(f"{path}: unknown file type; use .json, .jsonl or .txt (optionally .gz), .parquet, "
                             ".arrow or a `datasets` save_to_disk directory")
    text = _read_text(path)
    if not text.strip():
        raise EyasError(f"{path}: the file is empty; pass a file with prompts")
    if name.endswith(".txt"):
        records = _txt_chunks(text)
    elif text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise EyasError(f"{path}: corrupt JSON ({e.msg} at line {e.lineno}); fix the file "
                            "or convert it to JSON Lines (bad lines are then skipped)") from e
    else:
        records = _jsonl_records(text, st)
        if not records:
            raise EyasError(f"{path}: none of its {st.malformed} lines is valid JSON; "
                            "pass a JSON array or JSON Lines file")
    return _to_conversations(path, source, records, st)


def _table_records(path: Path) -> list[dict]:
    """The rows of a Parquet or Arrow file, or of a `datasets` save_to_disk directory (its
    state.json lists the Arrow files), as dicts (nested lists and structs as lists and dicts).
    A column a row leaves empty is dropped from that row, as the key would be absent in JSON
    Lines (a table's columns are the union of its records' keys, so schema detection sees only
    real ones)."""
    if not path.exists():
        raise NotAPromptFile(f"{path}: no such file; pass an existing prompt file")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise EyasError(f"{path}: reading tables needs pyarrow (pip install pyarrow), "
                        "or convert the file to JSON Lines") from e
    try:
        if path.is_dir():
            files = [path / f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
        else:
            files = [path]
        rows = []
        for f in files:
            if f.suffix == ".parquet":
                table = pq.read_table(f)
            else:  # `datasets` writes the Arrow stream format; other tools the file format
                try:
                    table = pa.ipc.open_stream(f.read_bytes()).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(f.read_bytes()).read_all()
            rows += [{k: v for k, v in r.items() if v is not None} for r in table.to_pylist()]
    except (OSError, ValueError, KeyError, TypeError) as e:  # pyarrow's ArrowInvalid is a ValueError
        what = "save_to_disk directory" if path.is_dir() else f"{path.suffix[1:].capitalize()} file"
        raise EyasError(f"{path}: not a readable {what} ({str(e).splitlines()[0][:200]}); "
                        f"pass a valid {'directory' if path.is_dir() else path.suffix + ' file'}") from e
    if not rows:
        raise EyasError(f"{path}: the table has no rows; pass a file with prompts")
    return rows


def _txt_chunks(text: str) -> list[str]:
    """Paragraphs (blank-line separated) packed into chunks of up to TXT_CHUNK_CHARS; a longer
    paragraph is cut at line breaks, a longer line at spaces (a longer word anywhere)."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if p.strip()]
    return _pack([q for p in paras for q in _fit(p, ("\n", " "))], "\n\n")


def _fit(text: str, seps: tuple[str, ...]) -> list[str]:
    """`text` in pieces of up to TXT_CHUNK_CHARS, cut at the first of `seps` that suffices."""
    if len(text) <= TXT_CHUNK_CHARS:
        return [text]
    if not seps:
        return [text[i:i + TXT_CHUNK_CHARS] for i in range(0, len(text), TXT_CHUNK_CHARS)]
    return _pack([q for part in text.split(seps[0]) if part for q in _fit(part, seps[1:])], seps[0])


def _pack(pieces: list[str], sep: str) -> list[str]:
    """Consecutive pieces joined by `sep` into chunks of up to TXT_CHUNK_CHARS."""
    chunks, cur = [], ""
    for p in pieces:
        if cur and len(cur) + len(sep) + len(p) > TXT_CHUNK_CHARS:
            chunks.append(cur)
            cur = ""
        cur = f"{cur}{sep}{p}" if cur else p
    if cur:
        chunks.append(cur)
    return chunks


_BAD_ESCAPE = re.compile(r'\\(?!["\\/bfnrtu])')


def _parse_lenient(line: str):
    """Strict JSON, else JSON with raw control characters and stray backslashes allowed."""
    try:
        return json.loads(line), False
    except json.JSONDecodeError:
        pass
    return json.loads(_BAD_ESCAPE.sub(r"\\\\", line), strict=False), True


def _jsonl_records(text: str, st: FileStats) -> list:
    lines = text.splitlines()
    records, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line:
            continue
        try:
            rec, repaired = _parse_lenient(line)
        except json.JSONDecodeError:
            # One record split across two lines by a raw newline (InstructionWild user_3).
            if i < len(lines):
                try:
                    rec, _ = _parse_lenient(line + "\n" + lines[i].strip())
                    i += 1
                    st.repaired += 1
                    records.append(rec)
                    continue
                except json.JSONDecodeError:
                    pass
            st.malformed += 1
            log.debug("%s: line %d is not valid JSON; skipped", st.path, i)
            continue
        st.repaired += int(repaired)
        records.append(rec)
    return records


def _to_conversations(path: Path, source: str, records, st: FileStats) -> list[Conversation]:
    if isinstance(records, dict):
        records = [records]
    if not isinstance(records, list):
        raise EyasError(f"{path}: expected a JSON array of records; got {type(records).__name__}")
    default_cat = file_category(source)
    out, unknown_keys = [], Counter()
    for i, rec in enumerate(records):
        st.records += 1
        parsed = parse_record(rec)
        if parsed is None:
            st.malformed += 1
            unknown_keys.update(sorted(rec)[:6] if isinstance(rec, dict) else [type(rec).__name__])
            continue
        schema, turns = parsed
        st.schemas[schema] += 1
        turns = clean_turns(turns)
        if not any(t["role"] == "user" and t["content"].strip() for t in turns):
            st.no_prompt += 1
            continue
        out.append(Conversation(id=f"{source}:{i}", source=source,
                                category=record_category(rec, SCHEMA_CATEGORIES.get(schema, default_cat)),
                                turns=turns))
    if not st.schemas and not unknown_keys:
        raise EyasError(f"{path}: holds no records; pass a file with prompts")
    if not st.schemas:
        keys = ", ".join(k for k, _ in unknown_keys.most_common(8)) or "none"
        raise EyasError(f"{path}: unknown schema (keys: {keys}); supported: {', '.join(SCHEMAS)} "
                        "(see `eyas data prepare --help`)")
    if not out:
        raise EyasError(f"{path}: no record has a user prompt; pass a file with prompts")
    return out

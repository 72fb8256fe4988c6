"""Per-stage configs as the CLI's source: a stage declares one frozen dataclass whose fields
(type, default, one-line doc) are its flags, as litgpt does.

- `arg(doc, default, ...)` declares a field and how it appears on the command line.
- `add_arguments(parser, cls)` adds a config class's flags to an argparse parser;
  `command(sub, name, cls, run)` adds a whole subcommand that calls `run(config)`.
- `from_namespace(cls, ns)` builds the config from parsed arguments; `build(cls, **values)` from
  Python (the quickstart calls stages this way, without argv).
- `to_json(cfg)` is what provenance records; `to_argv(words, cfg)` the command line that parses
  back to `cfg` (what the quickstart prints for each stage it calls).

Rules kept here so no stage repeats them: a `bool` field is a `--flag` (store_true); a
`list[...]` field takes one or more values (and, when its default is None, the flag repeated adds
more); `Path` fields are converted; fields with `positional=True` are positional; fields sharing a
`group` are mutually exclusive.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, field
from pathlib import Path

REQUIRED = MISSING  # the default of a field the user must give


def arg(doc: str, default=REQUIRED, *, flag: str | None = None, positional: bool = False,
        choices: tuple | None = None, metavar: str | None = None, group: str | None = None,
        group_required: bool = False, cli: bool = True):
    """A config field. `doc` is its one-line --help; `flag` overrides `--field-name`; `cli=False`
    keeps a field out of the command line (set from Python only); `group` names a mutually
    exclusive group, which its first field may make required (`group_required`)."""
    meta = {"doc": doc, "flag": flag, "positional": positional, "choices": choices, "metavar": metavar,
            "group": group, "group_required": group_required, "cli": cli}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _unwrap(tp):
    """(base type, is_list, is_optional) of a field annotation."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    if typing.get_origin(tp) in (list, tuple):
        return typing.get_args(tp)[0], True, optional
    return tp, False, optional


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _help(f: dataclasses.Field) -> str:
    doc = f.metadata["doc"]
    if f.default is not MISSING and f.default is not None and f.default is not False and "default" not in doc:
        return f"{doc} (default {f.default})"
    return doc


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """Add one flag (or positional) per CLI field of the config class `cls`."""
    hints, groups = _hints(cls), {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        base, many, _ = _unwrap(hints[f.name])
        kw: dict = {"help": _help(f)}
        if base is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = base
            if many:  # several values after one flag; a flag without a list default may also repeat
                kw["nargs"] = "+"
                if f.default is None:
                    kw["action"] = "extend"
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
            if f.metadata.get("metavar"):
                kw["metavar"] = f.metadata["metavar"]
        required = f.default is MISSING and f.default_factory is MISSING
        if f.default is not MISSING and base is not bool:
            kw["default"] = f.default
        target = parser
        if f.metadata.get("group"):
            name = f.metadata["group"]
            if name not in groups:
                groups[name] = parser.add_mutually_exclusive_group(required=f.metadata["group_required"])
            target = groups[name]
        if f.metadata.get("positional"):
            target.add_argument(f.name, **kw)
        else:
            if not f.metadata.get("group") and base is not bool:
                kw["required"] = required
            target.add_argument(flag_name(f), dest=f.name, **kw)


def from_namespace(cls, ns: argparse.Namespace):
    """The config of `cls` from parsed arguments (fields absent from `ns` keep their defaults)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return build(cls, **values)


def build(cls, **values):
    """The config of `cls` from Python values; absent fields keep their defaults, `None` given for
    a field with a default (argparse's unset) keeps the default too, paths become `Path`."""
    hints, kw = _hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        base, many, optional = _unwrap(hints[f.name])
        if v is None and not optional and (f.default is not MISSING or f.default_factory is not MISSING):
            continue
        if base is Path and v is not None:
            v = [Path(x) for x in v] if many else Path(v)
        kw[f.name] = v
    return cls(**kw)


def to_json(cfg) -> dict:
    """The config as JSON-ready values (paths as strings)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def to_argv(words: tuple[str, ...] | list[str], cfg) -> list[str]:
    """`eyas` arguments (after the subcommand `words`) that parse back to `cfg`: positionals, then
    each flag whose value differs from its default. Fields kept off the command line (`cli=False`)
    cannot be expressed and are left out."""
    argv, flags = list(words), []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if not f.metadata.get("cli", True) or (has_default and v == _default(f)):
            continue
        values = [str(x) for x in v] if isinstance(v, (list, tuple)) else [] if v is True else [str(v)]
        if f.metadata.get("positional"):
            argv += values
        else:
            flags += [flag_name(f), *values]
    return argv + flags


def command(sub, name: str, cls, run, help: str, description: str | None = None, **parser_kw):
    """Add subcommand `name` to the subparsers `sub`: flags from `cls`, and `run(config)` as its
    action (the stage function, which Python callers use directly)."""
    p = sub.add_parser(name, help=help, description=description or help, **parser_kw)
    add_arguments(p, cls)
    p.set_defaults(func=lambda args: run(from_namespace(cls, args)))
    return p

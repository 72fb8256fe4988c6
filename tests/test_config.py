"""eyas.config: a config dataclass is the CLI's source (flags, defaults, help), and the same
config is built from Python."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from eyas import config
from eyas.config import arg


@dataclass(frozen=True, kw_only=True)
class Demo:
    source: Path = arg("a positional path", positional=True)
    out: Path = arg("required flag")
    files: list[Path] | None = arg("one or more files", None, group="src", group_required=True)
    online: bool = arg("the other member of the group", False, group="src")
    steps: int = arg("a number", 7)
    rate: float | None = arg("optional, minutes", None, metavar="MIN")
    mode: str = arg("a choice", "a", choices=("a", "b"))
    flag_name: str = arg("renamed flag", "x", flag="--renamed")
    hidden: int = arg("not on the command line", 3, cli=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    config.add_arguments(p, Demo)
    return p


def test_flags_defaults_and_types_come_from_the_fields():
    ns = parser().parse_args(["src", "--out", "o", "--files", "f1", "f2", "--rate", "1.5", "--renamed", "y"])
    cfg = config.from_namespace(Demo, ns)
    assert cfg == Demo(source=Path("src"), out=Path("o"), files=[Path("f1"), Path("f2")], rate=1.5, flag_name="y")
    assert cfg.steps == 7 and cfg.mode == "a" and cfg.hidden == 3 and cfg.online is False
    assert config.to_json(cfg)["files"] == ["f1", "f2"] and config.to_json(cfg)["source"] == "src"


def test_help_lists_each_field_once_with_its_default():
    text = parser().format_help()
    assert "a number (default 7)" in text and "--renamed" in text and "MIN" in text
    assert "--hidden" not in text and "--flag-name" not in text


@pytest.mark.parametrize("argv", [
    ["src", "--files", "f"],  # --out is required
    ["src", "--out", "o"],  # one of the group is required
    ["src", "--out", "o", "--files", "f", "--online"],  # the group's members exclude each other
    ["src", "--out", "o", "--online", "--mode", "c"],  # not a choice
    ["src", "--out", "o", "--online", "--steps", "x"],  # not an int
])
def test_bad_command_lines_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2


def test_build_from_python_keeps_defaults_and_converts_paths():
    cfg = config.build(Demo, source="s", out="o", online=True, rate=None, steps=None)
    assert cfg.source == Path("s") and cfg.out == Path("o") and cfg.steps == 7 and cfg.rate is None
    with pytest.raises(TypeError):
        config.build(Demo, source="s")  # a required field left out


def test_every_stage_declares_its_flags_in_a_config(cli):
    """`eyas train --help` is generated from stages.train.TrainConfig: each CLI field is a flag."""
    import dataclasses

    from eyas.stages.train import TrainConfig

    code, out, _ = cli("train", "--help")
    assert code == 0
    for f in dataclasses.fields(TrainConfig):
        if f.metadata.get("cli", True):
            assert config.flag_name(f) in out, f.name


def test_to_argv_parses_back_to_the_same_config():
    """`to_argv` writes positionals first, then only the flags whose values differ from their
    defaults; parsing that command line gives the config back (a field off the CLI is left out)."""
    cfg = Demo(source=Path("s"), out=Path("o"), files=[Path("a"), Path("b")], steps=9, rate=0.25, mode="b",
               flag_name="z")
    argv = config.to_argv(("run",), cfg)
    assert argv == ["run", "s", "--out", "o", "--files", "a", "b", "--steps", "9", "--rate", "0.25", "--mode", "b",
                    "--renamed", "z"]
    assert config.from_namespace(Demo, parser().parse_args(argv[1:])) == cfg
    flagged = Demo(source=Path("s"), out=Path("o"), online=True, hidden=5)
    argv = config.to_argv((), flagged)
    assert argv == ["s", "--out", "o", "--online"]  # a bool is its bare flag; `hidden` cannot be written
    assert config.from_namespace(Demo, parser().parse_args(argv)) == Demo(source=Path("s"), out=Path("o"), online=True)


def test_a_list_flag_without_a_list_default_may_repeat():
    ns = parser().parse_args(["s", "--out", "o", "--files", "a", "--files", "b", "c"])
    assert config.from_namespace(Demo, ns).files == [Path("a"), Path("b"), Path("c")]

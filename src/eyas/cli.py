"""The `eyas` command: the only place that parses argv.

Each stage module under `eyas.stages` exposes `register(subparsers)`, which adds its
subcommand and sets `func(args) -> int`. Errors derived from EyasError become one line on
stderr and their exit code (2 bad input, 1 findings); nothing else is caught.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys

from eyas import __version__
from eyas.cpu import hostmem
from eyas.errors import EyasError

STAGES = ("target", "data", "vocab", "capture", "train", "export", "bench", "doctor", "quickstart")


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line and exit code 2 (its own default)."""

    def error(self, message: str) -> None:  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="eyas", description=__doc__.splitlines()[0].replace("The `eyas` command: ", "")
                     or "eyas", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.description = ("eyas trains, converts, verifies and runs EAGLE-3 drafters for Hugging Face "
                          "decoder-only LMs. Every stage reads and writes plain directories.")
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in STAGES:  # a stage module that fails to import is an error, never a missing subcommand
        importlib.import_module(f"eyas.stages.{name}").register(sub)
    return parser


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that the subcommand words in argv select."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if word in action.choices:
                    return _innermost(action.choices[word], argv[argv.index(word) + 1:])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose --help lists the accepted flags
        _innermost(parser, sys.argv[1:] if argv is None else argv).error(
            f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    hostmem.retain_freed_memory()  # freed tensor buffers reused, not faulted in afresh (eyas.cpu.hostmem)
    try:  # each stage resolves its own config (`--dtype auto` included: stages.common.resolve_dtype)
        return int(args.func(args) or 0)
    except EyasError as e:
        msg = " ".join(str(e).split())
        print(f"eyas {args.command}: error: {msg}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            if not e.filename:
                raise
            # a path the command cannot use: --out under a file, a read-only or vanished directory
            where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
            print(f"eyas {args.command}: error: {where}: {e.strerror or e}; check that path (an --out must be a "
                  "directory path you can write, not inside a file)", file=sys.stderr)
            return 2
        print(f"eyas {args.command}: error: no space left on device while writing {e.filename or 'output'}; "
              "free disk space (or choose another --out) and rerun the same command: finished shards and "
              "checkpoints are kept", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

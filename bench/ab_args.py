"""Command-line flags shared by the side-by-side forward/decoding benches (bench_prepack.py,
bench_grouped_attention.py): forward sizes against a KV cache, then decoding of real prompts."""

from __future__ import annotations

import argparse

from eyas import targets


def parser(doc: str, repeats: int, sizes: str, new_tokens: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--target", default=targets.DEFAULT_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="KV cache length before the timed forward")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--sizes", default=sizes, help="tokens per timed forward, comma-separated ('' to skip)")
    ap.add_argument("--drafter", help="drafter checkpoint: also compare decoding")
    ap.add_argument("--prompts", nargs="*", default=[])
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=new_tokens)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tree", default="4,5,16")
    return ap

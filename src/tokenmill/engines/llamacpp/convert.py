"""``tokenmill convert MODEL --to TYPE [--out PATH]``: a user's GGUF file in a weight
type llama.cpp's CPU kernels take, with what it costs in quality.

It converts with llama.cpp's own quantizer (:func:`.weights.convert`), then prints each
file's type, size and kernel path on this CPU, and both files' perplexity on the text
shipped with tokenmill (:mod:`.perplexity`). A deployment's ``weights`` key does the
same conversion at start-up, cached; this is for a file to keep, inspect or share.

Importing this module loads no llama.cpp: the command does, when it runs.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from tokenmill.config import WEIGHT_TYPES

__all__ = ["default_out", "register"]


def default_out(model: Path, target: str) -> Path:
    """``model``'s name with its type suffix replaced (``x.Q4_1.gguf`` -> ``x.Q8_0.gguf``),
    or the type added, beside it."""
    stem = re.sub(r"\.(?:[QqFf]\d+(?:_[0-9A-Za-z]+)*|BF16|bf16|IQ\w+)$", "", model.stem)
    return model.with_name(f"{stem}.{target.upper()}.gguf")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a GGUF model to a weight type llama.cpp's CPU kernels take, and "
        "print both files' perplexity",
    )
    p.add_argument("model", type=Path, help="the GGUF file to convert")
    p.add_argument("--to", required=True, choices=WEIGHT_TYPES, help="the weight type")
    p.add_argument("--out", type=Path, help="where to write it (default: beside MODEL)")
    p.set_defaults(func=_convert)


def _mb(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


def _convert(args: argparse.Namespace) -> int:
    model: Path = args.model
    out: Path = args.out or default_out(model, args.to)
    if not model.is_file():
        print(f"tokenmill convert: file not found: {model}", file=sys.stderr)
        return 2
    if out.exists():
        print(f"tokenmill convert: {out} exists: remove it, or name another --out", file=sys.stderr)
        return 2
    from tokenmill.engines.llamacpp.gguf import GgufError, read_header
    from tokenmill.engines.llamacpp.perplexity import perplexity
    from tokenmill.engines.llamacpp.weights import convert, cpu_features, kernels_of
    from tokenmill.errors import EngineError

    try:
        source = read_header(model)
    except GgufError as e:
        print(f"tokenmill convert: {model} is not a GGUF model file: {e}", file=sys.stderr)
        return 2
    cpu = cpu_features()
    tmp = out.with_name(out.name + ".tmp")
    started = time.monotonic()
    try:
        convert(model, tmp, args.to)
        tmp.replace(out)
        took = time.monotonic() - started
        made = read_header(out)
        before, after = perplexity(model), perplexity(out)
    except (EngineError, GgufError, OSError) as e:
        tmp.unlink(missing_ok=True)
        print(f"tokenmill convert: {e}", file=sys.stderr)
        return 1
    rows = [(model, source, before), (out, made, after)]
    print(f"{model}: {source.main_type()}, {_mb(model)}, {kernels_of(source, cpu)[0]} on this CPU")
    print(
        f"{out}: {made.main_type()}, {_mb(out)}, {kernels_of(made, cpu)[0]} on this CPU "
        f"(converted in {took:.1f} s)"
    )
    print(f"perplexity on tokenmill's fixed text ({before.tokens} tokens; lower is better):")
    width = max(len(h.main_type()) for _, h, _ in rows)
    for path, header, ppl in rows:
        change = ""
        if path == out:
            change = f"  ({(ppl.value / before.value - 1) * 100:+.1f} %)"
        print(f"  {header.main_type():<{width}}  {ppl.value:8.3f}  {path.name}{change}")
    print(f"serve it: tokenmill serve --model {out}")
    return 0

"""Which weights a replica serves: the model file as given, or one converted from it.

The embedded SmolLM2 ships as Q4_1, a type that no fast matrix kernel of llama.cpp's
CPU backend takes (:mod:`.kernels`): each row of a step's batch is multiplied on its
own. Q8_0 made from it reads prompts ~1.9x faster and runs 16 streams ~1.5x faster at
+0.2 % perplexity (issue 47), so a deployment's ``weights`` key may name a type to
serve instead, and the embedded model's default is ``"q8_0"``.

A conversion is llama.cpp's own quantizer (``llama_model_quantize``, requantizing
allowed), run once and cached in ``weights_dir`` (``<data_dir>/weights``), never
downloaded. An entry is ``<stem>-<key>.<type>.gguf`` beside a ``.json`` manifest: the
source's path and key (a SHA-256 of its size, first and last 16 MiB: the header and
tensor table, and the weights at both ends, without reading gigabytes at every start),
the converted file's size and key. A cached file is served only when it is a whole
GGUF file (magic, header, tensor data within the file) that matches its manifest, and
the manifest names this source: anything else (truncated, overwritten, made from
another file) is refused with a log line and made again. A changed source has another
key, so it is converted again and the old entry for that path is deleted.

Replicas that start at once take an ``flock`` on the entry's ``.lock`` file: one
converts, into a temporary file renamed into place with its manifest, and the others
then find it made. A replica that reads the old file while it is replaced keeps
reading the file it opened (a rename never changes an open file).

This module imports ``llama_cpp``; it is loaded lazily, never by ``import tokenmill``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll

from tokenmill.config import WEIGHT_TYPES, WeightsSetting
from tokenmill.engines.llamacpp.gguf import GgufError, GgufHeader, read_header
from tokenmill.engines.llamacpp.kernels import CpuFeatures, KernelPath, kernel_mix
from tokenmill.engines.llamacpp.threads import available_cpus, extra_buffers_work
from tokenmill.engines.llamacpp.vocab import init_backend
from tokenmill.errors import EngineError

__all__ = [
    "FTYPES",
    "ServedWeights",
    "convert",
    "cpu_features",
    "file_key",
    "kernels_of",
    "served_weights",
]

log = logging.getLogger("tokenmill.engines.llamacpp")

# llama.cpp's llama_ftype for each type the ``weights`` key may name.
FTYPES: dict[str, int] = {
    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
}
assert set(FTYPES) == set(WEIGHT_TYPES)
# The embedded model's default: Q8_0 keeps its quality (+0.2 % perplexity) and takes
# tinyBLAS on x86 (a repacked kernel on Arm); Q4_0 is faster still but +19 %.
EMBEDDED_DEFAULT: WeightsSetting = "q8_0"
# How much of each end of a file its key reads (see the module docstring).
KEY_SPAN = 16 << 20
MANIFEST_FORMAT = 1

_warned: set[Path] = set()  # files whose slow kernel path was logged (once a process)


def file_key(path: Path) -> str:
    """A SHA-256 of ``path``'s size and its first and last ``KEY_SPAN`` bytes."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(KEY_SPAN))
        if size > KEY_SPAN:
            f.seek(max(KEY_SPAN, size - KEY_SPAN))
            digest.update(f.read(KEY_SPAN))
    return digest.hexdigest()


def cpu_features() -> CpuFeatures:
    """What this llama.cpp was built for, and whether it repacks weights here."""
    init_backend()
    info = ll.llama_print_system_info().decode(errors="replace")
    return CpuFeatures.parse(info, extra_buffers=extra_buffers_work())


def kernels_of(header: GgufHeader, cpu: CpuFeatures) -> tuple[KernelPath, dict[str, float]]:
    """The kernel path most of a model's weights take, and each path's share."""
    matrices = [(t.type_name, t.dims[1], t.elements) for t in header.tensors if len(t.dims) >= 2]
    mix = kernel_mix(matrices, cpu)
    total = sum(mix.values()) or 1
    main: KernelPath = mix.most_common(1)[0][0] if mix else "row-by-row"
    return main, {path: round(n / total, 3) for path, n in mix.most_common()}


# -- converting ------------------------------------------------------------------------


def convert(source: Path, out: Path, target: str, *, threads: int | None = None) -> None:
    """Write ``source`` converted to ``target`` ("q8_0", ...) at ``out`` with llama.cpp's
    quantizer; an EngineError if it fails (``out`` is then removed)."""
    init_backend()
    params = ll.llama_model_quantize_default_params()
    params.ftype = FTYPES[target]
    params.allow_requantize = True  # the source is quantized already
    params.nthread = threads or available_cpus()
    rc = ll.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        out.unlink(missing_ok=True)
        raise EngineError(
            f"llama.cpp could not convert {source} to {target} (code {rc}): is there room "
            f"in {out.parent}?"
        )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _refusal(entry: Path, manifest: Path, source_key: str, target: str) -> str | None:
    """Why the cached ``entry`` may not be served (None: it may)."""
    try:
        recorded: dict[str, Any] = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"its manifest is unreadable ({e})"
    if not isinstance(recorded, dict) or recorded.get("format") != MANIFEST_FORMAT:
        return "its manifest is not this version's"
    if recorded.get("source_key") != source_key or recorded.get("type") != target:
        return f"it was made from another file ({recorded.get('source')}) or type"
    try:
        size = entry.stat().st_size
        read_header(entry)
    except (OSError, GgufError) as e:
        return f"it is not a whole GGUF file ({e})"
    if size != recorded.get("bytes") or file_key(entry) != recorded.get("key"):
        return "it is not the file its manifest describes"
    return None


def cached_conversion(source: Path, target: str, directory: Path) -> tuple[Path, bool]:
    """``source`` converted to ``target`` in the cache ``directory``: (its path, whether
    this call made it). See the module docstring."""
    source_key = file_key(source)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", source.stem)
    name = f"{stem}-{source_key[:16]}.{target}"
    entry, manifest = directory / f"{name}.gguf", directory / f"{name}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EngineError(f"weights_dir {directory}: {e}") from e
    with _locked(directory / f"{name}.lock"):
        if entry.exists() or manifest.exists():
            why = _refusal(entry, manifest, source_key, target)
            if why is None:
                return entry, False
            log.warning("refused cached weights %s: %s; converting again", entry, why)
        for orphan in directory.glob(f"{name}.gguf.*.tmp"):  # a conversion that died
            orphan.unlink(missing_ok=True)
        tmp = directory / f"{name}.gguf.{os.getpid()}.tmp"
        convert(source, tmp, target)
        record = {
            "format": MANIFEST_FORMAT,
            "source": str(source),
            "source_key": source_key,
            "type": target,
            "bytes": tmp.stat().st_size,
            "key": file_key(tmp),
            "llama_cpp_python": ll.__version__,
        }
        tmp_manifest = directory / f"{name}.json.{os.getpid()}.tmp"
        tmp_manifest.write_text(json.dumps(record, indent=1))
        os.replace(tmp, entry)
        os.replace(tmp_manifest, manifest)
    _drop_stale(directory, source, target, keep=manifest)
    return entry, True


def _drop_stale(directory: Path, source: Path, target: str, keep: Path) -> None:
    """Entries made from an earlier content of ``source``: never served again."""
    for other in directory.glob(f"*.{target}.json"):
        if other == keep:
            continue
        try:
            if json.loads(other.read_text()).get("source") != str(source):
                continue
        except (OSError, ValueError, AttributeError):
            continue
        log.info("deleting %s: made from an earlier %s", other.with_suffix(".gguf"), source)
        other.with_suffix(".gguf").unlink(missing_ok=True)
        other.unlink(missing_ok=True)


# -- what a replica serves ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedWeights:
    """The file a replica loads, where it came from and why, and its kernel path."""

    source: Path
    source_type: str  # the main type of the source's weights: "Q4_1"
    served: Path
    served_type: str
    setting: str  # the weights key as it applies: "as-is", "q8_0", ...
    why: str
    made: bool  # converted by this start (else as given, or from the cache)
    kernel: KernelPath  # the path most of the served weights take on this CPU
    kernels: dict[str, float]  # each path's share of the served weights

    def describe(self) -> dict[str, str]:
        """For the replica's health (``GET /v1/deployments/{id}``)."""
        return {
            "setting": self.setting,
            "source": str(self.source),
            "source_type": self.source_type,
            "served": str(self.served),
            "type": self.served_type,
            "kernel": self.kernel,
            "why": self.why,
        }


def served_weights(
    source: Path, setting: WeightsSetting | None, directory: Path, *, embedded: bool
) -> ServedWeights:
    """What to serve for ``source`` under the ``weights`` key ``setting`` (None: the
    default, ``EMBEDDED_DEFAULT`` for the embedded model, else "as-is"), converting into
    ``directory`` when needed; logged, with a warning (once a process and file) when
    most weights take the row-by-row path."""
    if not source.is_file():
        raise EngineError(f"model file not found: {source}")
    try:
        header = read_header(source)
    except GgufError as e:
        raise EngineError(f"{source} is not a GGUF model file: {e}") from e
    cpu = cpu_features()
    source_type = header.main_type()
    source_kernel, _ = kernels_of(header, cpu)
    chosen: WeightsSetting = setting or (EMBEDDED_DEFAULT if embedded else "as-is")
    origin = "the embedded model's default" if setting is None and embedded else "configured"
    if setting is None and not embedded:
        origin = "the default for a model file"
    served, made = source, False
    if chosen == "as-is":
        why = f'weights = "as-is" ({origin}): the file as given'
    elif header.file_type == FTYPES[chosen]:
        why = f'weights = "{chosen}" ({origin}): the file is {source_type} already'
    else:
        served, made = cached_conversion(source, chosen, directory)
        header = read_header(served)
        why = (
            f'weights = "{chosen}" ({origin}): {source_type} converted to '
            f"{header.main_type()} ({'made now' if made else 'cached'}); {source_type} "
            f"takes the {source_kernel} kernels on this CPU"
        )
    kernel, kernels = kernels_of(header, cpu)
    result = ServedWeights(
        source, source_type, served, header.main_type(), chosen, why, made, kernel, kernels
    )
    log.info(
        "serving %s (%s, %s kernels on this CPU): %s",
        served,
        result.served_type,
        kernel,
        why,
    )
    if kernel == "row-by-row" and served not in _warned:
        _warned.add(served)
        log.warning(
            "%s is %s: llama.cpp multiplies its weights row by row on this CPU, so prompts "
            'and many streams run slower than they could; set weights = "q8_0" on the '
            "deployment, or convert the file: tokenmill convert %s --to q8_0",
            served.name,
            result.served_type,
            served,
        )
    return result

"""A GGUF file's header read without llama.cpp: its metadata and tensor table.

What tokenmill needs to know of a model file before (or without) loading it: that it
is a whole GGUF file at all (magic, version, a tensor table whose data fits in the
file), llama.cpp's ``general.file_type`` and the type and shape of every tensor, from
which :mod:`.kernels` tells which matrix kernel its weights take. The format is
llama.cpp's ``gguf.cpp``: a little-endian header, key/value metadata, tensor infos,
then the tensor data at ``general.alignment``.

Pure: it reads bytes and imports no llama.cpp.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

__all__ = ["GGML_TYPES", "GgufError", "GgufHeader", "TensorInfo", "read_header"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# A header past these bounds is not one llama.cpp wrote: refuse it before reading on.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_STRING = 1 << 26
MAX_DIMS = 4

# ggml_type ids (ggml.h) -> (name, elements a block, bytes a block) for the types a
# GGUF file's weights come in; a type missing here still reads, its size unknown.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}

# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file is not a whole GGUF file (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml's ne: dims[0] is a row's length, dims[1] the rows
    type_id: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.type_id)
        return known[0] if known else f"type{self.type_id}"

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        known = GGML_TYPES.get(self.type_id)
        if known is None:
            return None
        _, block, size = known
        return self.elements // block * size


@dataclass(frozen=True, slots=True)
class GgufHeader:
    version: int
    # Scalar and string metadata (arrays, such as the vocabulary, are skipped).
    metadata: dict[str, object]
    tensors: list[TensorInfo]
    data_start: int  # where the tensor data begins in the file
    file_bytes: int
    # Where the last tensor ends (None when a tensor's type has no known size).
    data_end: int | None = field(default=None)

    @property
    def file_type(self) -> int | None:
        """llama.cpp's ``llama_ftype`` of the file (``general.file_type``)."""
        v = self.metadata.get("general.file_type")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def weight_elements(self) -> Counter[str]:
        """Elements of the matrices (tensors of two or more dimensions) by type name:
        what the matrix kernels read; norms and biases are vectors and cost nothing."""
        mix: Counter[str] = Counter()
        for t in self.tensors:
            if len(t.dims) >= 2:
                mix[t.type_name] += t.elements
        return mix

    def main_type(self) -> str:
        """The type most of the matrices' elements have ("Q4_1", "Q8_0", ...)."""
        mix = self.weight_elements()
        if not mix:
            raise GgufError("the file holds no weight matrix")
        return mix.most_common(1)[0][0]


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GgufError("truncated: the header ends before its tensor table")
        return data

    def scalar(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def u32(self) -> int:
        return int(self.scalar("I"))

    def u64(self) -> int:
        return int(self.scalar("Q"))

    def string(self) -> str:
        n = self.u64()
        if n > MAX_STRING:
            raise GgufError(f"a string of {n} bytes: not a GGUF header")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALARS:  # skipped whole: a vocabulary's scores, token types
                skip = struct.calcsize(_SCALARS[item]) * count
                if self.f.tell() + skip > self.size:
                    raise GgufError("truncated: an array runs past the end of the file")
                self.f.seek(skip, 1)
            elif item == _STRING:
                for _ in range(count):
                    n = self.u64()
                    if n > MAX_STRING:
                        raise GgufError(f"a string of {n} bytes: not a GGUF header")
                    self.f.seek(n, 1)
            else:
                raise GgufError(f"an array of value type {item}: not a GGUF header")
            return None
        raise GgufError(f"value type {vtype}: not a GGUF header")


def read_header(path: Path) -> GgufHeader:
    """``path``'s GGUF header; a :class:`GgufError` if it is not a whole GGUF file
    (wrong magic or version, a header cut short, tensor data past its end)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        r = _Reader(f, size)
        if f.read(4) != MAGIC:
            raise GgufError("not a GGUF file (its first bytes are not 'GGUF')")
        version = r.u32()
        if version not in VERSIONS:
            raise GgufError(f"GGUF version {version}: llama.cpp reads {VERSIONS}")
        n_tensors, n_kv = r.u64(), r.u64()
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise GgufError(f"{n_tensors} tensors and {n_kv} keys: not a GGUF header")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = r.string()
            value = r.value(r.u32())
            if value is not None:
                metadata[key] = value
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.u32()
            if n_dims > MAX_DIMS:
                raise GgufError(f"tensor {name} has {n_dims} dimensions: not a GGUF header")
            dims = tuple(r.u64() for _ in range(n_dims))
            tensors.append(TensorInfo(name, dims, r.u32(), r.u64()))
        align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise GgufError(f"general.alignment = {align!r}: not a GGUF header")
        data_start = -(-f.tell() // align) * align
    ends = [None if t.nbytes is None else t.offset + t.nbytes for t in tensors]
    data_end = None
    if ends and None not in ends:
        data_end = data_start + max(e or 0 for e in ends)
        if data_end > size:
            raise GgufError(f"truncated: its tensors end at byte {data_end}, the file at {size}")
    return GgufHeader(version, metadata, tensors, data_start, size, data_end)

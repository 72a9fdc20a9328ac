"""Which matrix kernel llama.cpp's CPU backend gives a weight type on this CPU.

A step of many rows (a prompt's tokens, many streams, a draft to verify) multiplies
every weight matrix by all of them at once, and how fast depends on the weights' type:

* ``"repacked"``: the weights are rearranged at load into interleaved blocks
  (``ggml/src/ggml-cpu/repack.cpp``, ``ggml_repack_get_optimal_repack_type``) and
  multiplied by a GEMM kernel for that layout: the fastest;
* ``"tinyblas"``: llamafile's tiled GEMM (``ggml/src/ggml-cpu/llamafile/sgemm.cpp``,
  ``llamafile_sgemm``) takes the type as it is stored;
* ``"row-by-row"``: neither does, and ggml's generic path takes one row of the
  batch after another (``vec_dot``): a 512-token prompt costs nearly 512 single
  steps' worth of weight reads. SmolLM2's shipped Q4_1 is here on every CPU.

The rules are llama.cpp's as vendored by llama-cpp-python 0.3.36, over the features
ggml was compiled for (``llama_print_system_info``: a pip build is native, so they are
this CPU's). Repacking also needs llama.cpp's extra weight buffers, which the engine
turns off on AMX CPUs (:func:`~.threads.extra_buffers_work`), and a row count that
divides by the kernel's interleave; its RISC-V kernels depend on the vector length
and are not told apart here (such a CPU reads "tinyblas" or "row-by-row").

Pure: strings in, a name out; no llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

__all__ = ["KERNEL_PATHS", "CpuFeatures", "KernelPath", "kernel_mix", "kernel_path"]

KernelPath = Literal["repacked", "tinyblas", "row-by-row"]
KERNEL_PATHS: tuple[KernelPath, ...] = ("repacked", "tinyblas", "row-by-row")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What ggml was built for (``AVX2``, ``NEON``, ``DOTPROD``, ``LLAMAFILE``,
    ``REPACK``...) and whether the extra (repacked) weight buffers are in use."""

    flags: frozenset[str]
    extra_buffers: bool = True
    sve_bytes: int = 0  # SVE_CNT: the SVE vector length in bytes, 0 without SVE

    @classmethod
    def parse(cls, system_info: str, *, extra_buffers: bool = True) -> CpuFeatures:
        """From ``llama_print_system_info()``'s text: ``CPU : AVX = 1 | AVX2 = 1 | ...``
        (a feature is on when its value is not 0)."""
        flags: set[str] = set()
        sve = 0
        for part in system_info.replace("\n", "|").split("|"):
            name, sep, value = part.partition("=")
            name = name.split(":")[-1].strip()
            value = value.strip()
            if not sep or not name or value in ("", "0"):
                continue
            flags.add(name)
            if name == "SVE_CNT" and value.isdigit():
                sve = int(value)
        return cls(frozenset(flags), extra_buffers, sve)

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def x86_simd(self) -> bool:
        """What sgemm.cpp's ``__AVX__ || __AVX2__ || __AVX512F__`` branches need."""
        return bool(self.flags & {"AVX", "AVX2", "AVX512"})


# repack.cpp: per type, (the features one kernel needs, the row count it interleaves),
# tried in order; the first whose features are all there and whose interleave divides
# the matrix's rows takes it.
_REPACK: dict[str, tuple[tuple[tuple[str, ...], int], ...]] = {
    "Q4_0": (
        (("AVX2",), 8),
        (("SVE", "MATMUL_INT8", "SVE_CNT=32"), 8),
        (("NEON", "MATMUL_INT8"), 4),
        (("NEON", "DOTPROD"), 4),
        (("VXE",), 4),
    ),
    "Q4_K": ((("AVX2",), 8), (("NEON", "MATMUL_INT8"), 8), (("NEON", "DOTPROD"), 8)),
    "Q2_K": ((("AVX512",), 8),),
    "Q5_K": ((("NEON", "MATMUL_INT8"), 8), (("NEON", "DOTPROD"), 8)),
    "Q6_K": ((("NEON", "MATMUL_INT8"), 8), (("NEON", "DOTPROD"), 8)),
    "IQ4_NL": ((("AVX2",), 8), (("NEON", "DOTPROD"), 4)),
    "MXFP4": ((("AVX2",), 8), (("NEON", "DOTPROD"), 4)),
    "Q8_0": ((("NEON", "MATMUL_INT8"), 4), (("NEON", "DOTPROD"), 4)),
}


def _repacked(type_name: str, cpu: CpuFeatures, rows: int | None) -> bool:
    if not (cpu.extra_buffers and cpu.has("REPACK")):
        return False
    for needs, interleave in _REPACK.get(type_name, ()):
        ok = all(cpu.sve_bytes == 32 if n == "SVE_CNT=32" else n in cpu.flags for n in needs)
        if ok and (rows is None or rows % interleave == 0):
            return True
    return False


def _tinyblas(type_name: str, cpu: CpuFeatures) -> bool:
    """sgemm.cpp's ``llamafile_sgemm`` switch on the weights' type (x86 and Arm)."""
    if not cpu.has("LLAMAFILE"):
        return False
    if type_name == "F32":
        return cpu.x86_simd or cpu.has("NEON")
    if type_name == "F16":
        # AVX-512, or AVX with F16C; on Arm the F32 activations are taken as they are.
        return cpu.has("AVX512") or (cpu.x86_simd and cpu.has("F16C")) or cpu.has("NEON")
    if type_name == "BF16":
        return cpu.has("AVX512_BF16") or cpu.has("AVX512") or cpu.has("AVX2")
    if type_name in ("Q8_0", "Q4_0"):
        return cpu.x86_simd or cpu.has("DOTPROD")
    if type_name in ("Q5_0", "IQ4_NL"):
        return cpu.x86_simd
    return False


def kernel_path(type_name: str, cpu: CpuFeatures, rows: int | None = None) -> KernelPath:
    """The kernel a matrix of ``type_name`` ("Q4_1", "Q8_0"...) with ``rows`` rows
    (ggml's ne[1]; None: any) is multiplied by, in a step of more than one row."""
    name = type_name.upper()
    if _repacked(name, cpu, rows):
        return "repacked"
    if _tinyblas(name, cpu):
        return "tinyblas"
    return "row-by-row"


def kernel_mix(matrices: list[tuple[str, int, int]], cpu: CpuFeatures) -> Counter[KernelPath]:
    """Elements of weights each path multiplies: ``matrices`` are (type name, rows,
    elements) of a model's weight matrices."""
    mix: Counter[KernelPath] = Counter()
    for type_name, rows, elements in matrices:
        mix[kernel_path(type_name, cpu, rows)] += elements
    return mix

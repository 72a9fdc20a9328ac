"""The weights a replica serves: the kernel path of a weight type on a CPU (pure), the
GGUF header reader, the conversion cache (real model, real files in temp dirs), the
``tokenmill convert`` command, and what a server says it serves."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from tests.conftest import ServerProcess
from tokenmill.config import LlamaCppDeployment, Settings, UpstreamDeployment
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.convert import default_out
from tokenmill.engines.llamacpp.gguf import GgufError, read_header
from tokenmill.engines.llamacpp.kernels import CpuFeatures, kernel_mix, kernel_path
from tokenmill.engines.llamacpp.weights import cached_conversion, cpu_features, served_weights

AVX2 = CpuFeatures.parse(
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
AVX512_AMX = CpuFeatures.parse(
    "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
    "AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |",
    extra_buffers=False,  # the engine turns them off on AMX (threads.extra_buffers_work)
)
AVX_ONLY = CpuFeatures.parse("CPU : SSE3 = 1 | AVX = 1 | LLAMAFILE = 1 | REPACK = 1 |")
ARM = CpuFeatures.parse(
    "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | MATMUL_INT8 = 1 | DOTPROD = 1 | "
    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
)
BARE = CpuFeatures.parse("CPU : SSE3 = 1 | AVX = 0 | LLAMAFILE = 0 | REPACK = 0 |")


# -- the kernel path (pure) ------------------------------------------------------------


def test_cpu_features_come_from_llamas_system_info() -> None:
    assert {"AVX", "AVX2", "F16C", "LLAMAFILE", "REPACK"} <= AVX2.flags
    assert "AVX" not in BARE.flags  # "= 0" is off
    assert CpuFeatures.parse("CPU : SVE = 1 | SVE_CNT = 32 |").sve_bytes == 32
    assert AVX2.extra_buffers and not AVX512_AMX.extra_buffers


@pytest.mark.parametrize(
    ("type_name", "cpu", "path"),
    [
        # x86 with AVX2: Q4_1 has no kernel for many rows; Q8_0 takes tinyBLAS as stored.
        ("Q4_1", AVX2, "row-by-row"),
        ("Q8_0", AVX2, "tinyblas"),
        ("Q4_0", AVX2, "repacked"),
        ("Q4_K", AVX2, "repacked"),
        ("Q6_K", AVX2, "row-by-row"),
        ("Q5_0", AVX2, "tinyblas"),
        ("Q5_1", AVX2, "row-by-row"),
        ("F16", AVX2, "tinyblas"),
        ("F32", AVX2, "tinyblas"),
        ("IQ4_NL", AVX2, "repacked"),
        # Repacking off (AMX CPUs): Q4_0 falls back on tinyBLAS, Q4_K on nothing.
        ("Q4_0", AVX512_AMX, "tinyblas"),
        ("Q4_K", AVX512_AMX, "row-by-row"),
        ("Q2_K", AVX512_AMX, "row-by-row"),
        ("BF16", AVX512_AMX, "tinyblas"),
        ("Q4_1", AVX512_AMX, "row-by-row"),
        # AVX without AVX2 or F16C: tinyBLAS's quantized kernels, no F16 one, no repack.
        ("Q4_0", AVX_ONLY, "tinyblas"),
        ("Q4_K", AVX_ONLY, "row-by-row"),
        ("F16", AVX_ONLY, "row-by-row"),
        # Arm with dot products and int8 matmul: Q8_0 and Q4_0 repacked, Q5_0 nothing.
        ("Q8_0", ARM, "repacked"),
        ("Q4_0", ARM, "repacked"),
        ("Q6_K", ARM, "repacked"),
        ("Q4_1", ARM, "row-by-row"),
        ("Q5_0", ARM, "row-by-row"),
        ("F16", ARM, "tinyblas"),
        # A build without llamafile or repack: everything row by row.
        ("Q8_0", BARE, "row-by-row"),
        ("Q4_0", BARE, "row-by-row"),
    ],
)
def test_kernel_path_follows_llamacpps_rules(type_name: str, cpu: CpuFeatures, path: str) -> None:
    assert kernel_path(type_name, cpu) == path
    assert kernel_path(type_name.lower(), cpu) == path


def test_a_matrix_whose_rows_do_not_fill_the_interleave_is_not_repacked() -> None:
    assert kernel_path("Q4_0", AVX2, rows=1536) == "repacked"
    assert kernel_path("Q4_0", AVX2, rows=12) == "tinyblas"  # 12 % 8
    assert kernel_path("Q4_K", AVX2, rows=12) == "row-by-row"
    assert kernel_path("Q8_0", ARM, rows=6) == "tinyblas"  # 6 % 4: tinyBLAS on dotprod


def test_kernel_mix_counts_each_paths_elements() -> None:
    mix = kernel_mix([("Q4_K", 576, 100), ("Q6_K", 576, 30), ("Q4_K", 1536, 50)], AVX2)
    assert mix == {"repacked": 150, "row-by-row": 30}


def test_convert_writes_beside_the_model_with_the_type_in_its_name() -> None:
    assert default_out(Path("/m/x.Q4_1.gguf"), "q8_0") == Path("/m/x.Q8_0.gguf")
    assert default_out(Path("/m/x-q4_k_m.gguf"), "f16") == Path("/m/x-q4_k_m.F16.gguf")
    assert default_out(Path("/m/x.Q4_K_M.gguf"), "q4_0") == Path("/m/x.Q4_0.gguf")
    assert default_out(Path("/m/model.gguf"), "q4_k_m") == Path("/m/model.Q4_K_M.gguf")


# -- the configuration -----------------------------------------------------------------


def test_the_weights_key_takes_as_is_or_a_type() -> None:
    assert LlamaCppDeployment(id="a").weights is None  # the engine's default applies
    assert LlamaCppDeployment(id="a", weights="q4_k_m").weights == "q4_k_m"
    with pytest.raises(ValidationError, match="weights"):
        LlamaCppDeployment(id="a", weights="q5_1")  # type: ignore[arg-type]


def test_converted_weights_live_under_the_data_dir(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, deployments=[LlamaCppDeployment(id="a")])
    (section,) = settings.deployments
    placed = settings.with_data_dir(section)
    assert isinstance(placed, LlamaCppDeployment)
    assert placed.weights_dir == tmp_path / "weights"
    own = LlamaCppDeployment(id="b", weights_dir=tmp_path / "mine")
    # Its own weights_dir is kept (the data dir gives it its disk tier's, issue 49).
    mine = settings.with_data_dir(own)
    assert isinstance(mine, LlamaCppDeployment) and mine.weights_dir == tmp_path / "mine"
    upstream = UpstreamDeployment(id="u", url="http://x/v1")
    assert settings.with_data_dir(upstream) is upstream


# -- the GGUF header -------------------------------------------------------------------


def test_the_shipped_model_reads_as_q4_1() -> None:
    header = read_header(embedded_model_path())
    assert header.file_type == 3  # LLAMA_FTYPE_MOSTLY_Q4_1
    assert header.main_type() == "Q4_1"
    assert header.data_end == header.file_bytes  # every tensor's bytes are there


def test_a_cut_or_foreign_file_is_not_a_gguf_file(tmp_path: Path) -> None:
    data = embedded_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GgufError, match="truncated"):
        read_header(cut)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:4096])
    with pytest.raises(GgufError, match="truncated"):
        read_header(short)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:8192])
    with pytest.raises(GgufError, match="not a GGUF file"):
        read_header(other)


# -- the conversion cache (real model, real files) -----------------------------------


def _model_copy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / "model.Q4_1.gguf"
    shutil.copyfile(embedded_model_path(), copy)
    return copy


def test_the_embedded_default_is_converted_once_then_served_from_the_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokenmill.engines.llamacpp")
    first = served_weights(embedded_model_path(), None, tmp_path, embedded=True)
    assert first.setting == "q8_0" and first.made
    assert first.served.parent == tmp_path
    assert first.source_type == "Q4_1" and first.served_type == "Q8_0"
    assert read_header(first.served).file_type == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    stat = first.served.stat()
    again = served_weights(embedded_model_path(), None, tmp_path, embedded=True)
    assert again.served == first.served and not again.made
    assert (again.served.stat().st_ino, again.served.stat().st_mtime_ns) == (
        stat.st_ino,
        stat.st_mtime_ns,
    )
    assert "made now" in first.why and "cached" in again.why
    assert caplog.text.count("serving ") == 2


def test_a_model_file_is_served_as_is_unless_the_key_names_a_type(tmp_path: Path) -> None:
    source = _model_copy(tmp_path / "src")
    as_is = served_weights(source, None, tmp_path / "cache", embedded=False)
    assert as_is.setting == "as-is" and as_is.served == source and not as_is.made
    assert not (tmp_path / "cache").exists()
    # A file already of the type named is served as it is, never converted.
    q8 = served_weights(source, "q8_0", tmp_path / "cache", embedded=False).served
    again = served_weights(q8, "q8_0", tmp_path / "other", embedded=False)
    assert again.served == q8 and not again.made and "already" in again.why


def test_a_changed_source_is_converted_again_and_the_old_entry_dropped(tmp_path: Path) -> None:
    source = _model_copy(tmp_path / "src")
    cache = tmp_path / "cache"
    before = served_weights(source, "q8_0", cache, embedded=False)
    assert before.made
    data = bytearray(source.read_bytes())
    at = data.find(b"Smollm2 135M")
    assert at > 0
    data[at : at + 1] = b"T"  # the model's name in its metadata: another file
    source.write_bytes(bytes(data))
    after = served_weights(source, "q8_0", cache, embedded=False)
    assert after.made and after.served != before.served
    assert not before.served.exists()
    assert sorted(p.suffix for p in cache.iterdir() if p.suffix != ".lock") == [".gguf", ".json"]
    assert json.loads(after.served.with_suffix(".json").read_text())["source"] == str(source)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The embedded model converted once: (the cache directory, its entry)."""
    cache = tmp_path_factory.mktemp("pristine")
    entry, made = cached_conversion(embedded_model_path(), "q8_0", cache)
    assert made
    return cache, entry


def _truncate(entry: Path) -> None:
    with entry.open("r+b") as f:
        f.truncate(entry.stat().st_size // 2)


def _bad_magic(entry: Path) -> None:
    with entry.open("r+b") as f:
        f.write(b"XXXX")


def _another_gguf(entry: Path) -> None:
    # A whole GGUF file, but not the one the manifest records: the Q4_1 source itself.
    entry.unlink()
    shutil.copyfile(embedded_model_path(), entry)


def _another_source(entry: Path) -> None:
    # Made (so its manifest says) from another file: a foreign entry under this name.
    manifest = entry.with_suffix(".json")
    record = json.loads(manifest.read_text())
    record["source"], record["source_key"] = "/elsewhere/model.gguf", "0" * 64
    manifest.write_text(json.dumps(record))


def _no_manifest(entry: Path) -> None:
    entry.with_suffix(".json").unlink()


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_truncate, "not a whole GGUF file"),
        (_bad_magic, "not a whole GGUF file"),
        (_another_gguf, "not the file its manifest describes"),
        (_another_source, "made from another file"),
        (_no_manifest, "manifest is unreadable"),
    ],
)
def test_a_corrupt_or_foreign_cached_file_is_refused_and_made_again(
    pristine: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    spoil: Callable[[Path], None],
    why: str,
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(pristine[0], cache)
    entry = cache / pristine[1].name
    spoil(entry)
    caplog.set_level(logging.WARNING, "tokenmill.engines.llamacpp")
    got = served_weights(embedded_model_path(), "q8_0", cache, embedded=True)
    assert f"refused cached weights {entry}: it" in caplog.text and why in caplog.text
    assert got.made and got.served == entry
    assert entry.read_bytes() == pristine[1].read_bytes()
    manifest = json.loads(entry.with_suffix(".json").read_text())
    assert manifest["source"] == str(embedded_model_path())
    assert not list(cache.glob("*.tmp"))


CONVERT_IN_A_PROCESS = """
import sys
from pathlib import Path
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.weights import served_weights
got = served_weights(embedded_model_path(), "q8_0", Path(sys.argv[1]), embedded=True)
print(got.served, got.made)
"""


def test_replicas_starting_at_once_convert_once(tmp_path: Path) -> None:
    # Each waits on the entry's lock: one converts, the other finds it made, whichever
    # order they come in.
    cmd = [sys.executable, "-c", CONVERT_IN_A_PROCESS, str(tmp_path / "cache")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate()[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0][0] == outs[1][0]
    assert sorted(o[1] for o in outs) == ["False", "True"]
    served = Path(outs[0][0])
    assert read_header(served).main_type() == "Q8_0"
    assert not list(served.parent.glob("*.tmp"))


def test_the_kernel_path_is_reported_and_the_slow_one_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokenmill.engines.llamacpp")
    source = _model_copy(tmp_path / "src")
    cpu = cpu_features()
    got = served_weights(source, "as-is", tmp_path / "cache", embedded=False)
    # Q4_1 has no repacked or tinyBLAS kernel on any CPU (AMX's is off: see threads.py).
    assert got.kernel == kernel_path("Q4_1", cpu) == "row-by-row"
    assert got.describe()["kernel"] == "row-by-row"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert 'weights = "q8_0"' in text and f"tokenmill convert {source} --to q8_0" in text
    served_weights(source, "as-is", tmp_path / "cache", embedded=False)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    converted = served_weights(source, "q8_0", tmp_path / "cache", embedded=False)
    assert converted.kernel == kernel_path("Q8_0", cpu) != "row-by-row"


# -- tokenmill convert -------------------------------------------------------------------


def test_convert_prints_the_perplexity_of_both_files(tmp_path: Path) -> None:
    source = _model_copy(tmp_path)
    cmd = [sys.executable, "-m", "tokenmill", "convert", str(source), "--to", "q8_0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "model.Q8_0.gguf"
    assert read_header(out).main_type() == "Q8_0"
    lines = run.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("perplexity")))
    rows = [line.split() for line in lines[head + 1 : head + 3]]
    assert [r[0] for r in rows] == ["Q4_1", "Q8_0"]
    assert [r[2] for r in rows] == ["model.Q4_1.gguf", "model.Q8_0.gguf"]
    before, after = float(rows[0][1]), float(rows[1][1])
    assert 1 < before < 100 and 1 < after < 100
    assert rows[1][3].startswith("(") and rows[1][4] == "%)"
    # Never over a file that is there.
    again = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "exists" in again.stderr


# -- what a server says it serves ------------------------------------------------------


def _weights(srv: ServerProcess, deployment: str) -> dict[str, str]:
    body = httpx.get(f"{srv.base_url}/deployments/{deployment}", timeout=60).json()
    (replica,) = body["replicas"]
    weights: dict[str, str] = replica["weights"]
    return weights


def test_the_deployment_view_shows_what_is_served_and_why(
    tmp_path: Path, start_server: Callable[..., ServerProcess]
) -> None:
    cpu = cpu_features()
    srv = start_server()
    got = _weights(srv, "smollm2")
    assert got["setting"] == "q8_0" and got["type"] == "Q8_0" and got["source_type"] == "Q4_1"
    assert got["source"] == str(embedded_model_path())
    assert Path(got["served"]).parent == srv.data_dir / "weights"
    assert got["kernel"] == kernel_path("Q8_0", cpu)
    assert "the embedded model's default" in got["why"]
    assert f"serving {got['served']}" in srv.log()

    source = _model_copy(tmp_path / "src")
    own = start_server(args=["--model", str(source), "--name", "own"])
    got = _weights(own, "own")
    assert got["setting"] == "as-is" and got["served"] == str(source)
    assert got["type"] == "Q4_1" and got["kernel"] == "row-by-row"
    assert "tokenmill convert" in own.log() and 'weights = "q8_0"' in own.log()

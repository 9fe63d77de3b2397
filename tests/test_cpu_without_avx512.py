"""The suite's CPU paths as a machine without AVX-512 runs them, on whatever machine runs the suite (and
the kernels' sources as an ARM machine compiles them).

CI's machines have had AVX-512 so far, and a CPU with AVX2 alone (AMD Zen 1-3, many cloud VMs) takes
other paths: oneDNN refuses bf16 there, ATen runs its AVX2 kernels, and the native kernels compile
without their AVX-512 code. Three switches make such a machine of this one, for one child process:
`ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN, and torch's own bf16 check, which reads it), `ATEN_CPU_CAPABILITY=avx2`
(ATen's kernels) and `PDSERVE_KERNEL_MARCH=x86-64-v3` (the native kernels: AVX2 + FMA, no AVX-512). The
child runs the kernel tests and the engine's low-precision tests under them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AVX2_MACHINE = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PDSERVE_KERNEL_MARCH": "x86-64-v3"}
# The engine's bf16 tests (the crash this file first caught) and the tests of the paths whose speed or
# numerics depend on the ISA beyond KERNEL_TESTS: the one-call decode step, oneDNN's tiled attention, the
# recurrent layers' native kernel. The families' torch-only parts (MoE, MLA, RoPE) take no ISA-specific path.
SUITES = ["tests/engine/test_engine_low_precision.py", "tests/models/test_cpu_decode.py",
          "tests/models/test_tiled_attention.py", "tests/models/test_recurrent_kernels.py"]


def _on_avx2_machine(code: str) -> str:
    env = {**os.environ, **AVX2_MACHINE}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 ISA switches")
def test_the_switches_make_a_machine_without_avx512():
    """The premise of the module: under the switches, oneDNN takes no bf16 and the kernels no AVX-512."""
    out = _on_avx2_machine(
        "import torch, ctypes\n"
        "from pdserve.kernels import cpu\n"
        "print(torch.ops.mkldnn._is_mkldnn_bf16_supported(), torch.backends.cpu.get_cpu_capability())\n"
        "print(cpu.kernel_isa())\n")
    assert out.splitlines() == ["False AVX2", "avx2-fma"], out


# The numerics tests of the kernels that have an AVX2 + FMA form (flash prefill, the decode GEMV) and of the
# paged decode attention, which the compiler vectorises for whatever -march it is given.
KERNEL_TESTS = ["tests/models/test_flash_prefill.py", "tests/models/test_skinny_linear.py",
                "tests/models/test_cpu_kernels.py::test_matches_float64_attention",
                "tests/models/test_cpu_kernels.py::test_sliding_window_matches_float64"]


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 ISA switches")
def test_kernel_numerics_without_avx512():
    """The kernel tests against the library built for AVX2 + FMA (x86-64-v3), on every machine: CI's
    has had AVX-512, and without this run the AVX2 forms would go untested there."""
    env = {**os.environ, **AVX2_MACHINE}
    # (not the test that builds the AVX-512 GEMV without its bf16 pairs: an AVX-512 form, and 16 s of compiling)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS,
                           "--deselect", "tests/models/test_skinny_linear.py::test_bf16_products_widened_to_fp32"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 ISA switches")
def test_kernel_and_low_precision_tests_pass_without_avx512():
    """bf16 engines start and are as accurate as transformers' bf16 (before: `pack_for_cpu` raised
    'mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw ...' at
    start), and the ISA-dependent paths' tests pass against the libraries built without AVX-512."""
    env = {**os.environ, **AVX2_MACHINE}
    # Not the bf16 TP2 x PP2 case (four rank processes, and the ranks' paths are the single rank's), nor SmolLM2's
    # bf16 run (10 s here, 13 s in the suite: the tiny bf16 model starts an engine on the same paths, and the main
    # run checks SmolLM2's bf16 accuracy).
    low_precision = "tests/engine/test_engine_low_precision.py::"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES,
                           "--deselect", low_precision + "test_tiny_model_bf16_tp2_pp2_as_accurate_as_transformers",
                           "--deselect", low_precision + "test_smollm2_bf16_as_accurate_as_transformers"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="cross-compiles from x86-64")
def test_the_kernels_compile_for_aarch64(tmp_path):
    """ARM servers build the library from the same sources: every csrc/*.c compiles for aarch64 (the
    plain C forms) with zig's cross C compiler (the ziglang package, in the test extra)."""
    pytest.importorskip("ziglang", reason="no ziglang (pip install ziglang): no cross compiler")
    from pdserve.kernels import cpu

    flags = [f for f in cpu.FLAGS if not f.startswith("-march") and f != "-shared"]
    cc = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu", "-Werror=implicit-function-declaration"]
    builds = [subprocess.Popen([*cc, *flags, "-c", str(src), "-o", str(tmp_path / f"{src.stem}.o")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for src in cpu.SOURCES]
    for src, build in zip(cpu.SOURCES, builds):
        out, _ = build.communicate(timeout=300)
        assert build.returncode == 0, f"{src.name} does not compile for aarch64:\n{out}"
        assert (tmp_path / f"{src.stem}.o").read_bytes()[18] == 183  # e_machine: EM_AARCH64

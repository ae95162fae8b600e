"""The Triton kernels compiled for the boards' GPUs without a GPU (``benchmarks/kernel_compile.py``): Triton's own
compiler and the ptxas its wheel ships, run in a process of their own (Triton must not be interpreted there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_orin_and_hopper_and_fp8_is_refused_on_orin_by_triton(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled now, not read from an earlier run
    done = subprocess.run([sys.executable, "-m", "cabinllm.benchmarks.kernel_compile", "--out", str(tmp_path),
                           "--arch", "87,90", "--shapes", "default", "--kv", "int8,fp8"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "kernel_compile.json").read_text())["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"write_kv_kernel", "decode_split_kernel", "decode_reduce_kernel", "prefill_kernel",
                       "w8_kernel", "g32_kernel", "awq_kernel"}
    reads_fp8 = {"write_kv_kernel", "decode_split_kernel", "prefill_kernel"}
    for r in rows:
        if r["arch"] == 87 and r["kv_mode"] == "fp8" and r["kernel"] in reads_fp8:
            assert not r["compiled"] and "fp8e4nv not supported" in r["error"], r  # why check_kv_mode refuses it
        else:
            assert r["compiled"] and r["within_limits"] and r["spill_bytes"] == 0, r
            assert 0 < r["registers"] <= 255
    assert {r["SPLITS"] for r in rows if r["kernel"] == "decode_split_kernel"} == {2, 16}
    assert "refused on sm_87" in done.stdout and (tmp_path / "kernel_compile.txt").read_text() == done.stdout

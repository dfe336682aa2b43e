"""The GPU build check (bench/gpu/gpu_build_check.py) catches what the interpreter hides.

A kernel that reads a plain module global runs under TRITON_INTERPRET=1 but is rejected by the GPU
compiler (the bug that kept every Triton kernel of this package from building for a GPU). The launch is
recorded by tests/conftest.py exactly as the suite's own launches are; the check, run on that record in a
process without the interpreter, must fail on it and pass once the global is a tl.constexpr.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest

CHECK = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "gpu_build_check.py"

PROBE = '''
import triton
import triton.language as tl

SCALE = {scale}


@triton.jit
def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(x_ptr + offsets, x * SCALE, mask=offsets < n)
'''


def _launch_and_check(tmp_path, module: str, scale: str):
    """Run the probe kernel under the interpreter (recorded by conftest), then the check on that record."""
    if not conftest.LAUNCHES_PATH:
        pytest.skip("launch recording is off (FUSED_IS_TRITON_LAUNCHES is empty)")
    (tmp_path / f"{module}.py").write_text(PROBE.format(scale=scale))
    sys.path.insert(0, str(tmp_path))
    try:
        probe = __import__(module)
        x = torch.ones(7)
        probe.scale_kernel[(1,)](x, 7, BLOCK=8)
        assert torch.equal(x, torch.full((7,), 2.0))  # the interpreter runs it either way
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)
    records = [line for line in conftest._launches if json.loads(line)["module"] == module]
    for line in records:  # keep the probe out of the suite's own record
        del conftest._launches[line]
    assert len(records) == 1, records
    launches = tmp_path / "launches.jsonl"
    launches.write_text(records[0] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(CHECK), "--launches", str(launches), "--no-cuda", "--arch", "90",
                           "--jobs", "1"], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_check_fails_on_a_plain_global(tmp_path):
    result = _launch_and_check(tmp_path, "gpu_build_probe_global", "2.0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Cannot access global variable SCALE" in result.stderr
    assert "3 failed" in result.stdout  # as launched, aligned, aligned with 64-bit integers


@pytest.mark.slow
def test_check_passes_with_a_constexpr_global(tmp_path):
    result = _launch_and_check(tmp_path, "gpu_build_probe_constexpr", "tl.constexpr(2.0)")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert "0 failed" in summary and "spills 0 B" in summary, summary
    # three variants: as launched (n = 7, not divisible by 16), aligned, aligned with 64-bit integers
    assert "3 Triton specializations" in summary, summary

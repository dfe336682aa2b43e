"""`fused_is.triton_kernels` imports in every way the package is run, and availability means importable.

setup.py maps the top-level folder `triton_kernels/` to `fused_is.triton_kernels`; an install (regular or
editable) creates that mapping, a source tree on PYTHONPATH (the GPU suite's fallback) does not, and
fused_is/backends/triton.py registers the package from the folder itself there. Each case runs in a fresh
interpreter so that nothing imported by this test session leaks in.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import sys
{prelude}
import torch
import fused_is
from fused_is import backends
from fused_is.backends import triton as launcher
print("reason:", backends.unavailable_reason("triton", torch.empty(1, 1)))
if backends.unavailable_reason("triton", torch.empty(1, 1)) is None:
    module = launcher.kernels()
    print("module:", module.__name__, module.__file__)
    print("attribute:", fused_is.triton_kernels.policy_loss is module)
    print("top-level triton_kernels imported:", "triton_kernels" in sys.modules)
    logits = torch.randn(3, 50, requires_grad=True)
    out = fused_is.policy_loss(logits, torch.tensor([0, 7, 49]), torch.randn(3), config="ppo", backend="triton")
    out.loss.backward()
    print("finite:", bool(torch.isfinite(logits.grad).all()))
"""

# setuptools' editable finder would map fused_is.triton_kernels itself: take it out to see a bare source tree
NO_EDITABLE = ("sys.meta_path[:] = [f for f in sys.meta_path "
               "if 'editable' not in getattr(f, '__name__', type(f).__name__).lower()]")


def _run(prelude: str, cwd) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)], capture_output=True, text=True,
                            env=env, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_source_tree_without_install(tmp_path):
    out = _run(NO_EDITABLE, tmp_path)
    assert "reason: None" in out
    assert f"module: fused_is.triton_kernels.policy_loss {REPO / 'triton_kernels' / 'policy_loss.py'}" in out
    assert "attribute: True" in out and "finite: True" in out
    assert "top-level triton_kernels imported: False" in out


def test_installed_or_editable(tmp_path):
    out = _run("", tmp_path)
    assert "reason: None" in out and "finite: True" in out
    assert "module: fused_is.triton_kernels.policy_loss" in out


def test_unimportable_kernels_make_triton_unavailable(tmp_path):
    """Availability is decided by importing the kernel module, so a broken triton is a reason, not a crash."""
    out = _run("sys.modules['triton'] = None  # import triton raises ImportError", tmp_path)
    assert "reason: the Triton kernels cannot be imported (ModuleNotFoundError" in out


def test_import_is_light(tmp_path):
    """`import fused_is` imports neither triton, torch._dynamo, vllm, a trainer nor a compiled extension: each is
    imported on first use (the custom op for torch.compile is registered without importing dynamo)."""
    code = ("import sys, torch; import fused_is; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'vllm', 'trl', 'verl', 'openrlhf') "
            "or m.startswith('torch._dynamo') or m.startswith('fused_is_cpu') or m.startswith('fused_is_cuda')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout

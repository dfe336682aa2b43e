"""Package layout: `triton_kernels/` is installed as `fused_is.triton_kernels` (never top level: that
import name belongs to the Triton project's own package, which vLLM probes for)."""

from setuptools import setup

setup(
    packages=["fused_is", "fused_is.backends", "fused_is.triton_kernels"],
    package_dir={"fused_is.triton_kernels": "triton_kernels"},
)

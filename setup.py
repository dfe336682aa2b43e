"""Package layout: `triton_kernels/` is installed as `fused_is.triton_kernels` (never top level: that
import name belongs to the Triton project's own package, which vLLM probes for). `csrc/` ships as package
data (fused_is/csrc) and is compiled after installation by `fused-is build` (fused_is/backends/cpp.py):
setup.py never imports torch, so pip's build isolation cannot break it."""

from setuptools import setup

setup(
    packages=["fused_is", "fused_is.backends", "fused_is.benchmarks", "fused_is.integrations",
              "fused_is.triton_kernels", "fused_is.csrc"],
    package_dir={"fused_is.triton_kernels": "triton_kernels", "fused_is.csrc": "csrc"},
    package_data={"fused_is.csrc": ["*.h", "cpu/*.cpp", "cpu/*.h", "cuda/*.cu", "cuda/*.cuh",
                                    "cuda/*.cpp"]},
)

"""backend="cuda": the csrc/ cuda kernel (loading and launching live in fused_is/backends/cpp.py)."""

from .cpp import make_backend

stats, fused, partial_stats, fused_given = make_backend("cuda")

"""The old name of fused_is/integrations/vllm.py, kept: `fused_is.vllm` is that very module object (not a copy),
so `from fused_is.vllm import X`, `fused_is.vllm.X` and a monkeypatch through either name act on the same module.
Importing this does not import vllm."""

import sys

from .integrations import vllm as _vllm

sys.modules[__name__] = _vllm

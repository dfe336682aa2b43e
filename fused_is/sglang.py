"""The old name of fused_is/integrations/sglang.py, kept: `fused_is.sglang` is that very module object (not a
copy), so `from fused_is.sglang import X`, `fused_is.sglang.X` and a monkeypatch through either name act on the
same module."""

import sys

from .integrations import sglang as _sglang

sys.modules[__name__] = _sglang

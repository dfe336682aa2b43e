"""fused_is.sglang: the fp32 lm_head switch of SGLang's server (SGLang itself not needed)."""

import pytest

from fused_is import sglang


def test_server_args_and_flags():
    assert sglang.server_args() == {"enable_fp32_lm_head": True}
    assert sglang.server_args(False) == {"enable_fp32_lm_head": False}
    assert sglang.launch_flags() == "--enable-fp32-lm-head"
    assert sglang.launch_flags(False) == ""
    with pytest.raises(TypeError, match="fp32_lm_head"):
        sglang.server_args("yes")


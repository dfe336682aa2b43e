"""SGLang as the sampler: its fp32 lm_head switch, mapped (DESIGN.md section 8).

SGLang computes the lm_head in fp32 when its server argument `enable_fp32_lm_head` is set (command line
`--enable-fp32-lm-head`); the learner's twin is `linear_policy_loss(..., logits_dtype=torch.float32)`, or fp32
logits. SGLang itself need not be installed to build the arguments.
"""

from __future__ import annotations

from typing import Dict

SERVER_ARG = "enable_fp32_lm_head"


def server_args(fp32_lm_head: bool = True) -> Dict[str, bool]:
    """Keyword arguments of `sglang.Engine(...)` / `ServerArgs(...)` for the sampler's head: fp32 or not."""
    if not isinstance(fp32_lm_head, bool):
        raise TypeError(f"fp32_lm_head must be a bool; got {fp32_lm_head!r}")
    return {SERVER_ARG: fp32_lm_head}


def launch_flags(fp32_lm_head: bool = True) -> str:
    """The `python -m sglang.launch_server` flags for the same ("" for SGLang's default bf16/fp16 head)."""
    return "--" + SERVER_ARG.replace("_", "-") if server_args(fp32_lm_head)[SERVER_ARG] else ""

"""fused_is: fused RL policy loss with importance-sampling correction for training-inference mismatch.

Public names only; see DESIGN.md section 3. Importing this package never queries a device, compiles
anything or imports vLLM.
"""

from . import custom_op as _custom_op  # noqa: F401  registers torch.ops.fused_is.policy_loss (torch.compile)
from .autograd import FusedPolicyLoss
from .config import PRESETS, LossConfig
from .api import PolicyLossOutput, policy_loss, token_logprobs
from .report import mismatch_report

__version__ = "0.1.0"

_EAGER_ONLY = ("linear_policy_loss", "linear_token_logprobs")  # fused_is/linear.py


def __getattr__(name):
    """fused_is.linear_policy_loss and linear_token_logprobs: the functions of fused_is/linear.py wrapped in
    torch.compiler.disable on first access (under torch.compile they run eagerly, a graph break), so that
    `import fused_is` does not import torch._dynamo."""
    if name in _EAGER_ONLY:
        import torch

        from . import linear

        value = torch.compiler.disable(getattr(linear, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fused_is' has no attribute {name!r}")


__all__ = [
    "FusedPolicyLoss",
    "LossConfig",
    "PRESETS",
    "PolicyLossOutput",
    "linear_policy_loss",
    "linear_token_logprobs",
    "mismatch_report",
    "policy_loss",
    "token_logprobs",
]

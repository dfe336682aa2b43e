"""fused_is: fused RL policy loss with importance-sampling correction for training-inference mismatch.

Public names only; see DESIGN.md section 3. Importing this package never queries a device, compiles
anything or imports vLLM.
"""

from . import custom_op as _custom_op  # noqa: F401  registers torch.ops.fused_is.policy_loss (torch.compile)
from .autograd import FusedPolicyLoss
from .config import PRESETS, LossConfig
from .linear import linear_policy_loss, linear_token_logprobs
from .loss import PolicyLossOutput, policy_loss, token_logprobs
from .report import mismatch_report

__version__ = "0.1.0"

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

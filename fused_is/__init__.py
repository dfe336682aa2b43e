"""fused_is: fused RL policy loss with importance-sampling correction for training-inference mismatch.

Public names only; see DESIGN.md section 3. Importing this package never queries a device, compiles
anything or imports vLLM.
"""

from . import ops as _ops  # noqa: F401  registers the kernel-level ops torch.ops.fused_is.row_stats & co.
from .autograd import FusedPolicyLoss
from .config import PRESETS, LossConfig
from .distill import distill_loss
from .kept import SamplerParams
from .logprobs import logprobs
from .api import PolicyLossOutput, policy_loss, token_logprobs
from .report import mismatch_report

__version__ = "0.1.0"

# name -> the module holding it: wrapped in torch.compiler.disable on first access (they run eagerly under
# torch.compile, a graph break)
_EAGER_ONLY = {"linear_policy_loss": "linear", "linear_token_logprobs": "linear", "linear_logprobs": "linear",
               "linear_distill_loss": "linear_distill"}


def __getattr__(name):
    """fused_is.linear_policy_loss, linear_token_logprobs, linear_logprobs (fused_is/linear.py) and
    linear_distill_loss (fused_is/linear_distill.py), wrapped in torch.compiler.disable on first access (under
    torch.compile they run eagerly, a graph break), so that `import fused_is` does not import torch._dynamo."""
    if name in _EAGER_ONLY:
        import importlib

        import torch

        module = importlib.import_module(f"{__name__}.{_EAGER_ONLY[name]}")
        value = torch.compiler.disable(getattr(module, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fused_is' has no attribute {name!r}")


__all__ = [
    "FusedPolicyLoss",
    "LossConfig",
    "PRESETS",
    "PolicyLossOutput",
    "SamplerParams",
    "distill_loss",
    "linear_distill_loss",
    "linear_policy_loss",
    "linear_logprobs",
    "linear_token_logprobs",
    "logprobs",
    "mismatch_report",
    "policy_loss",
    "token_logprobs",
]

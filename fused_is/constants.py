"""Numerical constants of the loss (DESIGN.md section 2), shared by the config, the policy table, the per-token math
and the Triton kernels (csrc/fused_is_math.h restates the two the C++ kernels need)."""

import math

# log IS weights are clamped to this range before exp (DESIGN.md section 2).
LOG_WEIGHT_CLAMP = 20.0
# the smallest temperature taken (verl clamps its temperature there too): the kernels' finite stand-in for -inf,
# -1e30 log2(e) / tau, stays finite above 5e-9, and 1 / tau fits fp32
MIN_TEMPERATURE = 1e-8
# SAPO's ratio is formed from min(log r, 80): the gate is saturated far below (sigmoid(tau (e^80 - 1)) = 1 with
# gradient 0), and fp32 exp overflows at 88 (then 0 * inf = nan in the gradient)
SAPO_LOG_RATIO_BOUND = 80.0
# TRL's floor of VESPO's log weights
VESPO_LOG_FLOOR = math.log(1e-8)
# LossConfig.kl_weight='sampler': w = exp(lp - samp) is 0 beyond this exponent, where fp32 exp overflows (ln FLT_MAX;
# NeMo-RL's nan_to_num of its fp32 weight)
LN_FLT_MAX = math.log(3.4028234663852886e38)

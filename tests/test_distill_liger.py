"""distill_loss and linear_distill_loss against Liger-Kernel 0.8.5's own JSD losses on the same inputs: `LigerJSD`
(ops/jsd.py, a Triton kernel: here under the CPU interpreter, TRITON_INTERPRET=1 from conftest.py),
`LigerFusedLinearJSD` (ops/fused_linear_jsd.py, the same kernel on chunks of the formed logits) and the chunked-loss
`LigerFusedLinearJSDLoss` (chunked_loss/jsd_loss.py, plain torch, bias included).

Liger's convention, read from those files: generalized JSD with m = beta * teacher + (1 - beta) * student, beta
weighting KL(teacher || m), beta = 0 forward KL(teacher || student), beta = 1 reverse KL: TRL's, our kind="jsd" with
the same beta. Normalisation: the sum of the per-token divergences over the tokens whose label is not ignore_index,
divided by their count: our loss_agg="token-mean" with mask = labels != -100. One temperature divides both models'
logits (LigerJSD takes log-probabilities, so none). Liger computes in fp32: the bounds are fp32's.
"""

import importlib.metadata

import pytest
import torch

import fused_is

from cases import assert_close

pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed (scripts/dev.sh installs 0.8.5)")
assert importlib.metadata.version("liger_kernel") == "0.8.5", "the suite compares with Liger-Kernel 0.8.5"
# Liger's kernels under the interpreter subtract -inf from -inf in the lanes past V (numpy warns; those lanes are
# masked out); its CuTe / cuTile backends fail to import without CUDA and log so (Triton's is used)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

VOCAB, DIM, TEACHER_DIM, ROWS = 72, 12, 20, 13
BETAS = [0.0, 0.3, 1.0]


def inputs(seed):
    """(hidden, weight, teacher_hidden, teacher_weight, labels): fp32, the teacher correlated with the student, two
    labels at ignore_index."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(ROWS, DIM, generator=gen), torch.randn(VOCAB, DIM, generator=gen) * 0.6
    teacher_hidden = torch.cat([hidden, torch.randn(ROWS, TEACHER_DIM - DIM, generator=gen)], dim=1)
    teacher_weight = torch.cat([weight, torch.randn(VOCAB, TEACHER_DIM - DIM, generator=gen) * 0.4], dim=1)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    labels[[2, 9]] = -100
    return hidden, weight, teacher_hidden, teacher_weight, labels


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


@pytest.mark.parametrize("beta", BETAS)
def test_liger_jsd_kernel(beta):
    """LigerJSD on the two models' log-probabilities == distill_loss on their logits: loss and d loss / d logits."""
    from liger_kernel.transformers.jsd import LigerJSD

    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(1)
    logits, teacher_logits = hidden @ weight.t(), teacher_hidden @ teacher_weight.t()
    (ours_z,), (liger_z,) = leaves(logits), leaves(logits)
    ours, _, _ = fused_is.distill_loss(ours_z, teacher_logits, kind="jsd", beta=beta, mask=labels != -100)
    theirs = LigerJSD(beta=beta)(torch.log_softmax(liger_z, dim=-1), torch.log_softmax(teacher_logits, dim=-1), labels)
    (ours * 1.3).backward()
    (theirs * 1.3).backward()
    assert_close("loss", ours, theirs, 2e-6)
    assert_close("grad logits", ours_z.grad, liger_z.grad, 2e-5)


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.3, 2.0), (1.0, 0.7)])
def test_liger_fused_linear_jsd(beta, temperature):
    """LigerFusedLinearJSD (no bias) == linear_distill_loss: loss, d hidden, d weight."""
    from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(2)
    ours_h, ours_w = leaves(hidden, weight)
    liger_h, liger_w = leaves(hidden, weight)
    ours, _, _ = fused_is.linear_distill_loss(ours_h, ours_w, teacher_hidden, teacher_weight, kind="jsd", beta=beta,
                                              temperature=temperature, mask=labels != -100, chunk_size=5)
    theirs = LigerFusedLinearJSD(jsd_beta=beta, temperature=temperature)(liger_h, liger_w, teacher_hidden,
                                                                         teacher_weight, labels)
    ours.backward()
    theirs.backward()
    assert_close("loss", ours, theirs, 2e-6)
    assert_close("grad hidden", ours_h.grad, liger_h.grad, 2e-5)
    assert_close("grad weight", ours_w.grad, liger_w.grad, 2e-5)


@pytest.mark.parametrize("beta", BETAS)
def test_liger_chunked_loss_jsd(beta):
    """The chunked-loss LigerFusedLinearJSDLoss with the hard loss weighted 0 == linear_distill_loss, biases
    included: loss, d hidden, d weight, d bias."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(3)
    gen = torch.Generator().manual_seed(4)
    bias, teacher_bias = torch.randn(VOCAB, generator=gen) * 0.3, torch.randn(VOCAB, generator=gen) * 0.3
    ours_h, ours_w, ours_b = leaves(hidden, weight, bias)
    liger_h, liger_w, liger_b = leaves(hidden, weight, bias)
    ours, _, _ = fused_is.linear_distill_loss(ours_h, ours_w, teacher_hidden, teacher_weight, bias=ours_b,
                                              teacher_bias=teacher_bias, kind="jsd", beta=beta, temperature=1.5,
                                              mask=labels != -100)
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=1.5,
                                      compiled=False, chunk_size=4)
    theirs = loss_fn(liger_h, liger_w, teacher_hidden, teacher_weight, labels, liger_b, teacher_bias)
    ours.backward()
    theirs.backward()
    assert_close("loss", ours, theirs, 2e-6)
    for name, a, b in (("hidden", ours_h, liger_h), ("weight", ours_w, liger_w), ("bias", ours_b, liger_b)):
        assert_close(f"grad {name}", a.grad, b.grad, 2e-5)


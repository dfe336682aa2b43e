"""fused_is.linear_distill_loss against the float64 oracle `distill_reference` on the formed logits
(hidden.double() @ weight.double().T + bias, the teacher's likewise), differentiated by autograd for the gradients of
hidden, weight and bias; masked rows skipped (no head formed, d hidden exactly 0); no [N, V] tensor; the argument
checks.

Shapes on purpose: V = 80 (not a power of two), padded [3, 7] and packed [19] (an empty sequence in cu_seqlens), chunk
size 5 (divides neither N), the teacher wider than the student (D_t = 24, D = 16) and correlated with it (its head
holds the student's plus noise), a mask with a fully masked sequence.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_is
import fused_is.linear as linear
from fused_is.reference import distill_reference

from cases import assert_close, linear_tolerance

VOCAB, DIM, TEACHER_DIM = 80, 16, 24
GRAD_SCALE = 1.7
KIND_BETAS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0)]


def make_heads(layout="padded", dtype=torch.float32, seed=0, bias=True):
    """(student (hidden, weight, bias), teacher (hidden, weight, bias), mask, cu_seqlens): fresh random inputs, the
    teacher's logits the student's plus noise."""
    gen = torch.Generator().manual_seed(seed)
    shape, cu_seqlens = ((3, 7), None) if layout == "padded" else ((19,), torch.tensor([0, 6, 6, 13, 19]))

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=gen, dtype=torch.float64) * scale

    hidden, weight = randn(*shape, DIM), randn(VOCAB, DIM, scale=0.6)
    extra = TEACHER_DIM - DIM
    teacher_hidden = torch.cat([hidden, randn(*shape, extra)], dim=-1)
    teacher_weight = torch.cat([weight, randn(VOCAB, extra, scale=0.4)], dim=-1)
    biases = (randn(VOCAB, scale=0.3), randn(VOCAB, scale=0.3)) if bias else (None, None)
    mask = torch.rand(shape, generator=gen) > 0.25
    if layout == "padded":
        mask[1] = False  # a sequence without an unmasked token
    student = tuple(None if x is None else x.to(dtype) for x in (hidden, weight, biases[0]))
    teacher = tuple(None if x is None else x.to(dtype) for x in (teacher_hidden, teacher_weight, biases[1]))
    return student, teacher, mask, cu_seqlens


def run(student, teacher, **kwargs):
    """(loss, per_token, metrics, grads of (1.7 loss) w.r.t. hidden, weight, bias) on fresh leaves."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in student]
    loss, per_token, metrics = fused_is.linear_distill_loss(leaves[0], leaves[1], teacher[0], teacher[1],
                                                            bias=leaves[2], teacher_bias=teacher[2], **kwargs)
    assert not per_token.requires_grad or kwargs.get("backend") == "reference"  # detached, as documented
    (loss * GRAD_SCALE).backward()
    return loss, per_token, metrics, [None if x is None else x.grad for x in leaves]


def oracle(student, teacher, **kwargs):
    """The same of distill_reference on the float64 logits of both heads."""
    leaves = [None if x is None else x.detach().double().requires_grad_() for x in student]
    logits = leaves[0] @ leaves[1].t() + (0 if leaves[2] is None else leaves[2])
    teacher_logits = teacher[0].double() @ teacher[1].double().t() + (0 if teacher[2] is None else teacher[2].double())
    loss, per_token, metrics = distill_reference(logits, teacher_logits, **kwargs)
    (loss * GRAD_SCALE).backward()
    return loss, per_token, {k: float(v) for k, v in metrics.items()}, [None if x is None else x.grad for x in leaves]


def check(student, teacher, backend="torch", **kwargs):
    """linear_distill_loss vs the oracle: loss, per-token D, metrics, the three gradients (linear.py's tolerances for
    the head's dtype: a bf16 head rounds every logit first)."""
    tol = linear_tolerance(student[0].dtype, backend)
    loss, per_token, metrics, grads = run(student, teacher, backend=backend, **kwargs)
    kwargs.pop("chunk_size", None)
    ref_loss, ref_per_token, ref_metrics, ref_grads = oracle(student, teacher, **kwargs)
    assert loss.dtype == torch.float32 and per_token.shape == student[0].shape[:-1]
    assert_close("loss", loss, ref_loss, tol["loss"])
    assert_close("per_token", per_token, ref_per_token, tol["loss"])
    for key, value in ref_metrics.items():
        assert abs(metrics[key] - value) <= 10 * tol["loss"] * max(1.0, abs(value)), (key, metrics[key], value)
    for name, grad, ref, x in zip(("hidden", "weight", "bias"), grads, ref_grads, student):
        if x is None:
            assert grad is None
            continue
        assert grad.dtype == x.dtype and grad.shape == x.shape, name
        assert_close(f"grad {name}", grad, ref, tol["grad"])
    return grads


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_every_kind_matches_the_oracle(kind, beta, layout, backend):
    student, teacher, mask, cu_seqlens = make_heads(layout, seed=len(kind) + int(10 * beta))
    grads = check(student, teacher, backend, kind=kind, beta=beta, mask=mask, cu_seqlens=cu_seqlens, chunk_size=5)
    assert torch.all(grads[0][~mask] == 0)  # masked rows: d hidden exactly 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind,beta", [("reverse_kl", 0.5), ("jsd", 0.3)])
def test_bf16_heads(kind, beta, backend):
    student, teacher, mask, _ = make_heads("padded", dtype=torch.bfloat16, seed=4)
    check(student, teacher, backend, kind=kind, beta=beta, mask=mask, chunk_size=4)


@pytest.mark.parametrize("options", [
    dict(loss_agg="seq-mean-token-mean", temperature=0.7, teacher_temperature=1.3),
    dict(loss_agg="sum", temperature=1.5),
    dict(top_k=5, add_tail=True),
    dict(top_k=5, add_tail=False),
], ids=["seq-mean-temperatures", "sum", "top_k-tail", "top_k-renormalised"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_options_match_the_oracle(options, layout):
    student, teacher, mask, cu_seqlens = make_heads(layout, seed=9, bias=options.get("loss_agg") != "sum")
    check(student, teacher, "torch", kind="jsd", beta=0.3, mask=mask, cu_seqlens=cu_seqlens, chunk_size=6, **options)


def test_reference_backend_is_distill_loss_of_the_formed_logits():
    student, teacher, mask, _ = make_heads("padded", seed=2)
    loss, per_token, _, grads = run(student, teacher, kind="reverse_kl", mask=mask, backend="reference")
    ref_loss, ref_per_token, _, ref_grads = oracle(student, teacher, kind="reverse_kl", mask=mask)
    assert loss.dtype == torch.float64  # the oracle's dtype, as linear_policy_loss's
    assert_close("loss", loss, ref_loss, 1e-12)
    assert_close("per_token", per_token, ref_per_token, 1e-12)
    assert_close("grad weight", grads[1], ref_grads[1], 1e-6)  # float64 rounded once to the fp32 leaf


class LargestTensor(TorchDispatchMode):
    """The most elements of storage (as fp32) behind any tensor an op returns inside the mode (an expanded stand-in
    of the logits' shape owns one element)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.untyped_storage().nbytes() // 4)
        return out


def test_masked_rows_form_no_logits_and_nothing_is_n_by_v(monkeypatch):
    """The heads are formed for the unmasked rows alone (NaN hidden states of either model at masked rows do not
    matter), d hidden is exactly 0 there, and no op returns a tensor as large as [N, V]."""
    gen = torch.Generator().manual_seed(3)
    n = 96
    hidden, weight = torch.randn(n, DIM, generator=gen), torch.randn(VOCAB, DIM, generator=gen) * 0.5
    teacher_hidden, teacher_weight = torch.randn(n, DIM, generator=gen), torch.randn(VOCAB, DIM, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.4
    hidden[~mask] = torch.nan
    teacher_hidden[~mask] = torch.nan
    formed = []
    original = linear.Head.logits
    monkeypatch.setattr(linear.Head, "logits", lambda self, rows: formed.append(linear.row_count(rows))
                        or original(self, rows))
    leaf = hidden.clone().requires_grad_()
    with LargestTensor() as largest:
        loss, per_token, _ = fused_is.linear_distill_loss(leaf, weight, teacher_hidden, teacher_weight, mask=mask,
                                                          kind="jsd", chunk_size=8)
        loss.backward()
    assert sum(formed) == 2 * int(mask.sum())  # each unmasked row once per model
    assert torch.isfinite(loss) and torch.all(per_token[~mask] == 0)
    assert torch.all(leaf.grad[~mask] == 0) and torch.isfinite(leaf.grad).all()
    assert largest.largest < n * VOCAB // 4, largest.largest  # chunks of 8 x V, the [V, D] weights, [N, D] hidden


def test_no_grad_and_empty_mask():
    student, teacher, mask, _ = make_heads("padded", bias=False)
    with torch.no_grad():
        loss, _, _ = fused_is.linear_distill_loss(student[0], student[1], teacher[0], teacher[1], mask=mask)
    ref_loss, _, _, _ = oracle(student, teacher, mask=mask)
    assert_close("loss", loss, ref_loss, 1e-5)
    leaf = student[0].clone().requires_grad_()
    loss, per_token, metrics = fused_is.linear_distill_loss(leaf, student[1], teacher[0], teacher[1],
                                                            mask=torch.zeros_like(mask))
    loss.backward()
    assert float(loss) == 0 and torch.all(leaf.grad == 0) and metrics == dict(divergence_mean=0.0, divergence_max=0.0)


def _bad(name, change, error, match):
    return pytest.param(change, error, match, id=name)


BAD_INPUTS = [
    _bad("teacher_hidden requires grad", lambda a: a.update(teacher_hidden=a["teacher_hidden"].requires_grad_()),
         ValueError, "teacher_hidden requires grad"),
    _bad("teacher_weight requires grad", lambda a: a.update(teacher_weight=a["teacher_weight"].requires_grad_()),
         ValueError, "teacher_weight requires grad"),
    _bad("teacher_bias requires grad", lambda a: a.update(teacher_bias=torch.zeros(VOCAB, requires_grad=True)),
         ValueError, "teacher_bias requires grad"),
    _bad("vocabularies differ", lambda a: a.update(teacher_weight=a["teacher_weight"][:-1]), ValueError,
         "teacher_weight has a vocabulary of 79"),
    _bad("teacher rows differ", lambda a: a.update(teacher_hidden=a["teacher_hidden"][:, :-1]), ValueError,
         "teacher_hidden must have hidden's leading shape"),
    _bad("teacher dims differ", lambda a: a.update(teacher_weight=a["teacher_weight"][:, :-1]), ValueError,
         r"teacher_weight must be the lm_head's \[V, D\] with D = teacher_hidden"),
    _bad("teacher dtypes differ", lambda a: a.update(teacher_weight=a["teacher_weight"].double()), TypeError,
         "teacher_hidden is torch.float32 but teacher_weight is torch.float64"),
    _bad("teacher bias shape", lambda a: a.update(teacher_bias=torch.zeros(3)), ValueError, "teacher_bias must have"),
    _bad("beta", lambda a: a.update(kind="jsd", beta=1.5), ValueError, r"beta must be in \[0, 1\]"),
    _bad("kind", lambda a: a.update(kind="tvd"), ValueError, "kind must be one of"),
    _bad("mask shape", lambda a: a.update(mask=torch.ones(3, 6, dtype=torch.bool)), ValueError, "mask"),
    _bad("chunk_size", lambda a: a.update(chunk_size=0), ValueError, "chunk_size"),
    _bad("hidden type", lambda a: a.update(hidden=[1.0]), TypeError, "hidden must be a torch.Tensor"),
]


@pytest.mark.parametrize("change,error,match", BAD_INPUTS)
def test_bad_input(change, error, match):
    student, teacher, _, _ = make_heads("padded", bias=False)
    args = dict(hidden=student[0], weight=student[1], teacher_hidden=teacher[0].clone(),
                teacher_weight=teacher[1].clone())
    change(args)
    with pytest.raises(error, match=match):
        fused_is.linear_distill_loss(args.pop("hidden"), args.pop("weight"), args.pop("teacher_hidden"),
                                     args.pop("teacher_weight"), **args)


def test_non_finite_teacher_row_is_named():
    student, teacher, mask, _ = make_heads("padded", bias=False)
    mask[:] = True
    teacher_hidden = teacher[0].clone()
    teacher_hidden[2, 3, 0] = torch.inf  # inf * weights of both signs: NaN and +-inf logits
    with pytest.raises(ValueError, match=r"row 17 of teacher_hidden @ teacher_weight.T \(teacher_hidden\[2, 3\]\)"):
        fused_is.linear_distill_loss(student[0], student[1], teacher_hidden, teacher[1], mask=mask)

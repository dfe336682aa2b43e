"""fused_is.distill_loss (DESIGN.md section 9) against the float64 oracle `fused_is.reference.distill_reference`
(autograd) on fresh random inputs, and against TRL 1.16's own generalized_jsd_loss (GKD's, and IW-OPD's with top_k
and the tail bucket) on the same inputs; the argument checks; what is and is not written into the caller's tensors.

Shapes on purpose: V = 80 (not a power of two), padded [4, 7] with a fully masked sequence, packed [23] with an
empty sequence in cu_seqlens; the teacher correlated with the student (as a distilled pair is) but in another dtype.
The oracle comparisons run on backend="torch" and on backend="triton" (the kernels of triton_kernels/distill.py under
the CPU interpreter, TRITON_INTERPRET=1 from conftest.py) at the package's tolerances per dtype and backend
(fused_is.testing.tolerance: the same but for fp32 logits, which the kernels compute in fp32 and the torch backend in
float64); V = 300 in 128-lane blocks gives the kernels' sweeps several blocks and a tail.
"""

import math
import os
import warnings

import pytest
import torch

import fused_is
from fused_is.reference import distill_reference
from fused_is.validate import output_dtype

from cases import TOLERANCES, assert_close, tolerance

VOCAB = 80
BACKENDS = ["torch", "triton"]
GRAD_SCALE = 1.7  # a non-unit upstream gradient: (loss * 1.7).backward()
KIND_BETAS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0)]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"]


def make_pair(layout="padded", dtype=torch.float32, teacher_dtype=torch.bfloat16, vocab=VOCAB, seed=0):
    """(student logits, teacher logits, mask, cu_seqlens): fresh random inputs, the teacher = student + noise."""
    gen = torch.Generator().manual_seed(seed)
    shape, cu_seqlens = ((4, 7), None) if layout == "padded" else ((23,), torch.tensor([0, 6, 6, 15, 23]))
    student = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 2
    teacher = student + torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 1.5
    mask = torch.rand(shape, generator=gen) > 0.25
    if layout == "padded":
        mask[2] = False  # a sequence without an unmasked token (seq-mean counts skip it)
    return student.to(dtype), teacher.to(teacher_dtype), mask, cu_seqlens


def run(logits, teacher, **kwargs):
    """(loss, per_token, metrics, d (1.7 loss) / d logits) of distill_loss on a fresh leaf."""
    leaf = logits.detach().clone().requires_grad_()
    loss, per_token, metrics = fused_is.distill_loss(leaf, teacher, **kwargs)
    assert not per_token.requires_grad or kwargs.get("backend") == "reference"  # detached, as documented
    (loss * GRAD_SCALE).backward()
    return loss, per_token, metrics, leaf.grad


def oracle(logits, teacher, **kwargs):
    """The same of the float64 oracle on the same values."""
    leaf = logits.detach().double().requires_grad_()
    loss, per_token, metrics = distill_reference(leaf, teacher.double(), **kwargs)
    (loss * GRAD_SCALE).backward()
    return loss, per_token, {k: float(v) for k, v in metrics.items()}, leaf.grad


def check(logits, teacher, tol=None, **kwargs):
    """distill_loss (backend "auto" unless given) at the inputs' dtypes vs the oracle: loss, per-token D, gradient,
    metrics. D >= 0, so the loss is a sum without cancellation: its error is relative to itself. The package's
    tolerance per dtype and backend (fp32 logits: the kernels compute in fp32, the torch backend in float64)."""
    tol = tol or tolerance(logits.dtype, kwargs.get("backend", "torch"))
    loss, per_token, metrics, grad = run(logits, teacher, **kwargs)
    kwargs.pop("backend", None)
    ref_loss, ref_per_token, ref_metrics, ref_grad = oracle(logits, teacher, **kwargs)
    dtype = output_dtype(logits.dtype)
    assert loss.dtype == dtype and per_token.dtype == dtype and per_token.shape == logits.shape[:-1]
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert_close("loss", loss, ref_loss, tol["loss"])
    assert_close("per_token", per_token, ref_per_token, tol["loss"])
    assert_close("grad", grad, ref_grad, tol["grad"])
    assert set(metrics) == set(ref_metrics) == {"divergence_mean", "divergence_max"}
    for key, value in ref_metrics.items():
        assert abs(metrics[key] - value) <= 10 * tol["loss"] * max(1.0, abs(value)), (key, metrics[key], value)
    return loss, per_token, grad


# --- against the float64 oracle ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_every_kind_matches_the_oracle(kind, beta, layout, backend):
    """Each kind (JSD at beta 0, 0.3 and 1: TRL's two special cases and the mixture), both temperatures != 1 and
    different, mask and cu_seqlens; fp32 student, bf16 teacher."""
    logits, teacher, mask, cu_seqlens = make_pair(layout)
    agg = AGGS[(KIND_BETAS.index((kind, beta)) + (layout == "packed")) % 3]  # token-mean and both seq-means
    check(logits, teacher, kind=kind, beta=beta, temperature=0.7, teacher_temperature=1.3, mask=mask,
          cu_seqlens=cu_seqlens, loss_agg=agg, backend=backend)


@pytest.mark.parametrize("dtype,teacher_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_triton_blocks_and_strides(kind, beta, dtype, teacher_dtype, monkeypatch):
    """The kernels' sweeps over several blocks and a tail (V = 300 in 128-lane blocks, maxes that rise from block to
    block, a -inf column in each model), a teacher stored [V, N] (its columns strided) and a student slice of a longer
    buffer; temperatures on both sides."""
    monkeypatch.setenv("FUSED_IS_TRITON_BLOCK", "128")
    vocab = 300
    logits, teacher, mask, cu_seqlens = make_pair("packed", torch.float64, torch.float64, vocab=vocab, seed=22)
    rising = torch.linspace(0, 6, vocab, dtype=torch.float64)
    logits, teacher = logits + rising, teacher + rising.flip(0)
    logits[:, 7] = teacher[:, 7] = -math.inf  # probability 0 in both (finite divergences)
    logits = torch.cat([logits, torch.zeros(23, 4, dtype=torch.float64)], dim=1).to(dtype)[:, :vocab]
    teacher = teacher.t().contiguous().to(teacher_dtype).t()
    assert teacher.stride(-1) != 1 and logits.stride(0) == vocab + 4
    check(logits, teacher, kind=kind, beta=beta, temperature=0.6, teacher_temperature=1.4, mask=mask,
          cu_seqlens=cu_seqlens, backend="triton")


# seq-mean-token-sum-norm divides by the padded length T: padded only (packed is refused, see test_bad_input)
@pytest.mark.parametrize("loss_agg,layout", [(agg, layout) for agg in AGGS for layout in ("padded", "packed")
                                             if (agg, layout) != ("seq-mean-token-sum-norm", "packed")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_loss_agg_matches_the_oracle(loss_agg, layout, backend):
    logits, teacher, mask, cu_seqlens = make_pair(layout, seed=1)
    check(logits, teacher, kind="jsd", beta=0.3, temperature=1.2, mask=mask, cu_seqlens=cu_seqlens, loss_agg=loss_agg,
          backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_beta_special_cases_are_the_kls(backend):
    """TRL's convention: jsd at beta = 0 is forward KL(q || p) exactly, at beta = 1 reverse KL(p || q) (the mixture's
    limits there are 0: the special cases are the KLs themselves)."""
    logits, teacher, mask, _ = make_pair(seed=2)
    for beta, kind in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        jsd = run(logits, teacher, kind="jsd", beta=beta, mask=mask, backend=backend)
        kl = run(logits, teacher, kind=kind, mask=mask, backend=backend)
        assert torch.equal(jsd[0], kl[0]) and torch.equal(jsd[3], kl[3])


# backend="triton" takes neither fp64 students nor fp8 teachers (refused by name: test_triton_refuses_by_name)
DTYPE_PAIRS = [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16),
               (torch.float64, torch.float32), (torch.bfloat16, torch.float8_e4m3fn)]
DTYPE_CASES = [(b, d, t) for b in BACKENDS for d, t in DTYPE_PAIRS
               if b != "triton" or (d != torch.float64 and t.itemsize > 1)]


@pytest.mark.parametrize("backend,dtype,teacher_dtype", DTYPE_CASES)
@pytest.mark.parametrize("kind,beta", [("reverse_kl", 0.5), ("jsd", 0.3)])
def test_logits_dtypes(dtype, teacher_dtype, kind, beta, backend):
    """bf16 / fp16 / fp32 / fp64 students (fp16: the gradient sweep deferred to backward), teachers in another float
    dtype (fp8 too), within the suite's per-dtype tolerances, on the backends that take them."""
    logits, teacher, mask, cu_seqlens = make_pair("packed", dtype, teacher_dtype, seed=3)
    check(logits, teacher, kind=kind, beta=beta, temperature=0.8, mask=mask, cu_seqlens=cu_seqlens, backend=backend)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_and_strided_views(kind, beta, backend, monkeypatch):
    """Several chunks per call (3 rows each; the Triton kernels take the rows whole) over padded views that cannot be
    flattened (logits[:, :-1] of a longer buffer, a teacher stored [T, B, V]): the same as the oracle, and as one
    chunk, bitwise."""
    monkeypatch.setattr(fused_is.distill, "CHUNK_ELEMENTS", 3 * VOCAB * 2)
    logits, teacher, mask, _ = make_pair(seed=4, teacher_dtype=torch.float32)
    longer = torch.cat([logits, torch.randn(4, 1, VOCAB)], dim=1)[:, :-1]
    teacher_t = teacher.transpose(0, 1).contiguous().transpose(0, 1)
    assert not longer.is_contiguous() and not teacher_t.is_contiguous()
    chunked = check(longer, teacher_t, kind=kind, beta=beta, mask=mask, temperature=1.1, backend=backend)
    monkeypatch.setattr(fused_is.distill, "CHUNK_ELEMENTS", 1 << 22)
    whole = run(logits, teacher, kind=kind, beta=beta, mask=mask, temperature=1.1, backend=backend)
    assert torch.equal(chunked[1], whole[1]) and torch.equal(chunked[2], whole[3])


@pytest.mark.parametrize("top_k", [1, 5])
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_top_k_matches_the_oracle(kind, beta, add_tail, top_k):
    """TRL's top-k buckets: the teacher's top-k (forward KL), the student's (reverse), their union (JSD), with and
    without the tail bucket; fp32 logits (no ties among the top values)."""
    logits, teacher, mask, cu_seqlens = make_pair("packed", teacher_dtype=torch.float32, seed=5)
    check(logits, teacher, kind=kind, beta=beta, temperature=0.9, teacher_temperature=1.1, mask=mask,
          cu_seqlens=cu_seqlens, top_k=top_k, add_tail=add_tail)


def test_top_k_of_the_whole_vocabulary_is_the_full_loss():
    """As TRL: top_k >= V is the full-vocabulary loss (no tail bucket)."""
    logits, teacher, mask, _ = make_pair(seed=6)
    full = run(logits, teacher, kind="jsd", beta=0.4, mask=mask)
    every = run(logits, teacher, kind="jsd", beta=0.4, mask=mask, top_k=VOCAB)
    assert torch.equal(full[0], every[0]) and torch.equal(full[3], every[3])


def test_tail_bucket_bound_when_the_support_holds_all_mass():
    """A support holding (nearly) all the mass: the tail's log mass bounded at -1e-7 (TRL's clamp), finite loss, the
    oracle's gradient (no gradient through the bounded tail)."""
    logits, teacher, mask, _ = make_pair(teacher_dtype=torch.float64, seed=7)
    logits[..., :3] += 40.0
    teacher[..., :3] += 40.0
    check(logits, teacher, kind="jsd", beta=0.5, mask=mask, top_k=3)
    check(logits, teacher, kind="reverse_kl", mask=mask, top_k=3)


def test_reference_backend_is_the_oracle():
    logits, teacher, mask, cu_seqlens = make_pair("packed", seed=8)
    kwargs = dict(kind="jsd", beta=0.3, temperature=0.7, mask=mask, cu_seqlens=cu_seqlens, top_k=4)
    loss, per_token, metrics, grad = run(logits, teacher, backend="reference", **kwargs)
    ref_loss, ref_per_token, ref_metrics, ref_grad = oracle(logits, teacher, **kwargs)
    assert loss.dtype == torch.float32 and grad.dtype == logits.dtype
    assert_close("loss", loss, ref_loss, 1e-7)
    assert_close("per_token", per_token, ref_per_token, 1e-7)
    assert_close("grad", grad, ref_grad, 1e-6)
    assert metrics.keys() == ref_metrics.keys()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_may_hold_anything(backend):
    """NaN and +-inf in masked rows of either model: the same loss as with zeros there, gradient exactly 0 there."""
    logits, teacher, mask, _ = make_pair(teacher_dtype=torch.float32, seed=9)
    dirty_logits, dirty_teacher = logits.clone(), teacher.clone()
    dirty_logits[~mask] = float("nan")
    dirty_teacher[~mask] = float("inf")
    dirty_teacher[~mask, 0] = -float("inf")
    for kind, beta in KIND_BETAS:
        dirty = run(dirty_logits, dirty_teacher, kind=kind, beta=beta, mask=mask, backend=backend)
        clean = run(logits, teacher, kind=kind, beta=beta, mask=mask, backend=backend)
        assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[3], clean[3])
        assert torch.equal(dirty[3][~mask], torch.zeros_like(dirty[3][~mask]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_are_probability_zero(backend):
    """-inf in both models at the same columns: probability 0 (0 log 0 = 0), finite loss, zero gradient there."""
    logits, teacher, mask, _ = make_pair(teacher_dtype=torch.float32, seed=10)
    logits[..., 5:9] = -float("inf")
    teacher[..., 5:9] = -float("inf")
    for kind, beta in KIND_BETAS:
        _, _, grad = check(logits, teacher, kind=kind, beta=beta, mask=mask, backend=backend)
        assert torch.equal(grad[..., 5:9], torch.zeros_like(grad[..., 5:9]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mask_is_zero(backend):
    logits, teacher, mask, _ = make_pair(seed=11)
    for agg in AGGS:
        loss, per_token, metrics, grad = run(logits, teacher, kind="jsd", mask=torch.zeros_like(mask), loss_agg=agg,
                                             backend=backend)
        assert float(loss.detach()) == 0.0 and not per_token.any() and not grad.any()
        assert metrics == {"divergence_mean": 0.0, "divergence_max": 0.0}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,teacher_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float32)], ids=str)
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_triton_at_the_qwen_vocabulary(kind, beta, dtype, teacher_dtype, gpu_device, dry_run, monkeypatch):
    """The kernels at the production row (V = 151936: full blocks of the launcher's BLOCK and a tail; the dry run: 331)
    on the GPU against the float64 oracle, separately and in place; backend="auto" takes them for CUDA tensors."""
    vocab = 331 if dry_run else 151936
    logits, teacher, mask, _ = make_pair("padded", dtype, teacher_dtype, vocab=vocab, seed=24)
    logits, teacher, mask = logits.to(gpu_device), teacher.to(gpu_device), mask.to(gpu_device)
    kwargs = dict(kind=kind, beta=beta, temperature=0.9, teacher_temperature=1.2, mask=mask)
    check(logits, teacher, backend="triton", **kwargs)
    leaf = logits.clone().requires_grad_()
    loss, _, _ = fused_is.distill_loss(leaf, teacher, backend="triton", inplace=True, **kwargs)
    (loss * GRAD_SCALE).backward()
    assert leaf.grad.data_ptr() == leaf.data_ptr()
    assert_close("grad", leaf.grad, oracle(logits, teacher, **kwargs)[3], tolerance(dtype, "triton")["grad"])
    launched = []
    real = fused_is.backends.triton.pair_stats
    monkeypatch.setattr(fused_is.backends.triton, "pair_stats", lambda *a: launched.append(a) or real(*a))
    fused_is.distill_loss(logits, teacher, **kwargs)
    assert bool(launched) == logits.is_cuda


# --- what is written where -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_written_into_the_callers_tensors(dtype, backend):
    """inplace=False (fp16: the gradient formed in backward): logits and teacher unchanged after forward and
    backward, bitwise; the teacher gets no gradient."""
    logits, teacher, mask, _ = make_pair(dtype=dtype, seed=12)
    leaf = logits.clone().requires_grad_()
    before, teacher_before = leaf.detach().clone(), teacher.clone()
    loss, _, _ = fused_is.distill_loss(leaf, teacher, kind="reverse_kl", mask=mask, temperature=0.8, backend=backend)
    assert torch.equal(leaf.detach(), before) and torch.equal(teacher, teacher_before)
    (loss * GRAD_SCALE).backward()
    assert torch.equal(leaf.detach(), before) and torch.equal(teacher, teacher_before)
    assert leaf.grad.data_ptr() != leaf.data_ptr() and teacher.grad is None and not teacher.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k,backend", [(0, "torch"), (4, "torch"), (0, "triton")])
@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_inplace_writes_the_gradient_over_the_logits(dtype, top_k, backend, kind):
    """inplace=True: the logits keep their values until backward, which writes the gradient (scaled by grad_output)
    into their storage; the teacher is unchanged."""
    logits, teacher, mask, _ = make_pair(dtype=dtype, teacher_dtype=torch.float32, seed=13)
    kwargs = dict(kind=kind, beta=0.3, mask=mask, temperature=0.9, top_k=top_k)
    leaf = logits.clone().requires_grad_()
    teacher_before = teacher.clone()
    loss, _, _ = fused_is.distill_loss(leaf, teacher, inplace=True, backend=backend, **kwargs)
    assert torch.equal(leaf.detach(), logits)
    (loss * GRAD_SCALE).backward()
    assert leaf.grad.data_ptr() == leaf.data_ptr()
    assert_close("grad", leaf.grad, oracle(logits, teacher, **kwargs)[3], tolerance(dtype, backend)["grad"])
    assert torch.equal(teacher, teacher_before)


def test_inplace_refuses_a_write_before_backward():
    logits, teacher, mask, _ = make_pair(seed=14)
    leaf = logits.clone().requires_grad_()
    loss, _, _ = fused_is.distill_loss(leaf, teacher, mask=mask, inplace=True)
    with torch.no_grad():
        teacher.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_backward_twice_is_refused():
    logits, teacher, mask, _ = make_pair(seed=15)
    leaf = logits.clone().requires_grad_()
    loss, _, _ = fused_is.distill_loss(leaf, teacher, mask=mask)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_no_grad_evaluates_only():
    logits, teacher, mask, _ = make_pair(seed=16)
    leaf = logits.clone().requires_grad_()
    with torch.no_grad():
        loss, per_token, _ = fused_is.distill_loss(leaf, teacher, kind="jsd", mask=mask, inplace=True)
    assert not loss.requires_grad and torch.equal(leaf.detach(), logits)
    assert torch.equal(per_token, run(logits, teacher, kind="jsd", mask=mask)[1])


# --- bad input -----------------------------------------------------------------------------------------------------


def _with(x, index, value):
    """A copy of x with x[index] = value."""
    x = x.clone()
    x[index] = value
    return x


BAD_INPUTS = [
    # (name, change of (logits, teacher, mask, kwargs), exception, match)
    ("vocab", lambda lo, te, ma, kw: (lo, te[..., :-1], ma, kw), ValueError, "teacher_logits have a vocabulary of 79"),
    ("shape", lambda lo, te, ma, kw: (lo, te[:, :-1], ma, kw), ValueError,
     "teacher_logits must have the logits' shape"),
    ("teacher_int", lambda lo, te, ma, kw: (lo, te.long(), ma, kw), TypeError, "teacher_logits must be floating"),
    ("teacher_grad", lambda lo, te, ma, kw: (lo, te.float().requires_grad_(), ma, kw), ValueError,
     "teacher_logits requires grad"),
    ("teacher_nan", lambda lo, te, ma, kw: (lo, _with(te, (0, 1, 3), math.nan), ma, kw), ValueError,
     r"teacher_logits hold NaN at row 1 \(teacher_logits\[0, 1\]\), column 3"),
    ("teacher_inf", lambda lo, te, ma, kw: (lo, _with(te, (1, 0, 7), math.inf), ma, kw), ValueError,
     r"teacher_logits hold \+inf at row 7"),
    ("student_nan", lambda lo, te, ma, kw: (_with(lo, (1, 0, 2), math.nan), te, ma, kw), ValueError,
     r"^logits hold NaN at row 7 \(logits\[1, 0\]\), column 2"),
    ("beta_low", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, beta=-0.1)), ValueError, r"beta must be in \[0, 1\]"),
    ("beta_high", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, beta=1.5)), ValueError, r"beta must be in \[0, 1\]"),
    ("beta_nan", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, beta=math.nan)), ValueError, "beta"),
    ("beta_type", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, beta="0.5")), TypeError, "beta"),
    ("kind", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, kind="kl")), ValueError, "kind must be one of"),
    ("loss_agg", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, loss_agg="mean")), ValueError, "loss_agg"),
    ("backend_fused", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, backend="cuda")), ValueError,
     "backend='cuda' cannot run here: backend 'cuda' needs CUDA tensors"),
    ("backend_name", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, backend="tpu")), ValueError, "backend must be"),
    ("vocab_group", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, vocab_group=object())), ValueError,
     "vocab_group needs an initialised torch.distributed"),
    ("temperature", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, temperature=0.0)), ValueError, "^temperature"),
    ("teacher_temperature", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, teacher_temperature=-1.0)), ValueError,
     "^teacher_temperature"),
    ("top_k_negative", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, top_k=-1)), ValueError, "top_k"),
    ("top_k_type", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, top_k=2.0)), TypeError, "top_k"),
    ("add_tail", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, add_tail=1)), TypeError, "add_tail"),
    ("inplace", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, inplace="forward")), TypeError, "inplace"),
    ("inplace_reference", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, inplace=True, backend="reference")),
     ValueError, "backend='reference' with inplace=True is not supported"),
    ("mask_shape", lambda lo, te, ma, kw: (lo, te, ma[:, :-1], kw), ValueError, "mask must have shape"),
    ("cu_seqlens_padded", lambda lo, te, ma, kw: (lo, te, ma, dict(kw, cu_seqlens=torch.tensor([0, 28]))),
     ValueError, "cu_seqlens must be None"),
    ("cu_seqlens_cover", lambda lo, te, ma, kw: (lo.reshape(28, -1), te.reshape(28, -1), ma.reshape(-1),
                                                 dict(kw, cu_seqlens=torch.tensor([0, 20]))), ValueError,
     "cu_seqlens must start at 0"),
    ("norm_packed", lambda lo, te, ma, kw: (lo.reshape(28, -1), te.reshape(28, -1), ma.reshape(-1),
                                            dict(kw, loss_agg="seq-mean-token-sum-norm")), ValueError,
     "seq-mean-token-sum-norm"),
    ("logits_type", lambda lo, te, ma, kw: (lo.long(), te, ma, kw), TypeError, "logits must be bf16"),
]


@pytest.mark.parametrize("name,change,error,match", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input(name, change, error, match):
    """Each bad input is a TypeError / ValueError naming the argument; nothing is written into the logits (inplace=True:
    the gradient sweep has not run when a NaN teacher is found by the statistics sweep)."""
    logits, teacher, _, _ = make_pair(seed=17)
    mask = torch.ones(logits.shape[:-1], dtype=torch.bool)
    logits, teacher, mask, kwargs = change(logits, teacher, mask, dict(kind="jsd", inplace=True))
    leaf = logits.clone().requires_grad_() if logits.dtype.is_floating_point else logits
    before = leaf.detach().clone()
    with pytest.raises(error, match=match):
        fused_is.distill_loss(leaf, teacher, mask=mask, **kwargs)
    assert torch.equal(leaf.detach().nan_to_num(), before.nan_to_num())  # NaN != NaN


TRITON_BAD_ROWS = [case for case in BAD_INPUTS if case[0] in ("teacher_nan", "teacher_inf", "student_nan")]


@pytest.mark.parametrize("name,change,error,match", TRITON_BAD_ROWS, ids=[case[0] for case in TRITON_BAD_ROWS])
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_bad_rows_found_by_the_triton_statistics(name, change, error, match, kind):
    """NaN and +inf logits at an unmasked row: the statistics kernel's non-finite log-sum-exp names the row, before
    the gradient sweep has written anything (inplace=True: the logits unchanged)."""
    logits, teacher, _, _ = make_pair(seed=17)
    mask = torch.ones(logits.shape[:-1], dtype=torch.bool)
    logits, teacher, mask, kwargs = change(logits, teacher, mask, dict(kind=kind, inplace=True, backend="triton"))
    leaf = logits.clone().requires_grad_()
    before = leaf.detach().clone()
    with pytest.raises(error, match=match):
        fused_is.distill_loss(leaf, teacher, mask=mask, **kwargs)
    assert torch.equal(leaf.detach().nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_at_a_masked_row_is_fine_but_not_at_an_unmasked_one(backend):
    logits, teacher, mask, _ = make_pair(seed=18)
    teacher = teacher.clone()
    teacher[2, 4, 0] = float("nan")  # sequence 2 is fully masked
    fused_is.distill_loss(logits, teacher, mask=mask, backend=backend)
    mask[2, 4] = True
    with pytest.raises(ValueError, match=r"teacher_logits hold NaN at row 18"):
        fused_is.distill_loss(logits, teacher, mask=mask, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_divergence_is_an_error(backend):
    """Forward KL where the student gives probability 0 (-inf) to a token the teacher does not: infinite, refused;
    reverse KL the same with the roles swapped."""
    logits, teacher, mask, _ = make_pair(seed=19)
    logits[0, 0, 3] = -float("inf")
    mask[0, 0] = True
    with pytest.raises(ValueError, match="forward KL is infinite at row 0"):
        fused_is.distill_loss(logits, teacher, mask=mask, backend=backend)
    fused_is.distill_loss(logits, teacher, mask=mask, kind="reverse_kl", backend=backend)  # p log p = 0 there: finite
    fused_is.distill_loss(logits, teacher, mask=mask, kind="jsd", beta=0.5, backend=backend)  # m > 0 where q > 0
    with pytest.raises(ValueError, match="reverse KL is infinite at row 0"):
        fused_is.distill_loss(teacher.float(), logits.bfloat16(), mask=mask, kind="reverse_kl", backend=backend)


def test_triton_refuses_by_name(monkeypatch):
    """backend="triton" without a kernel for the call: top_k (the support's buckets), fp64 students, fp8 teachers,
    each refused by name (backend="auto" runs them on "torch"); "auto" never takes the interpreter for CPU tensors."""
    logits, teacher, mask, _ = make_pair(seed=23)
    for change, match in (((logits, teacher, dict(top_k=4)), r"distill_loss\(top_k=4\) with backend='triton' is not supported yet"),
                          ((logits.double(), teacher, {}), "bf16/fp16/fp32 logits"),
                          ((logits, teacher.to(torch.float8_e4m3fn), {}), "float8_e4m3fn")):
        student, teacher_logits, kwargs = change
        with pytest.raises(ValueError, match=match):
            fused_is.distill_loss(student, teacher_logits, mask=mask, kind="jsd", backend="triton", **kwargs)
        fused_is.distill_loss(student, teacher_logits, mask=mask, kind="jsd", backend="auto", **kwargs)
    launched = []
    real = fused_is.backends.triton.pair_stats
    monkeypatch.setattr(fused_is.backends.triton, "pair_stats", lambda *a: launched.append(a) or real(*a))
    fused_is.distill_loss(logits, teacher, mask=mask)
    assert not launched, "backend='auto' ran the Triton kernels on CPU tensors"
    fused_is.distill_loss(logits, teacher, mask=mask, backend="triton")
    assert launched


# --- TRL 1.16 side by side -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_losses():
    """TRL 1.16's generalized_jsd_loss of GKD (full vocabulary) and of IW-OPD (top_k, add_tail). TRL is in the
    integrations / baselines extras that the test set-up installs (scripts/dev.sh setup): a missing or other TRL
    fails these tests, it does not skip them."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's import warns about the installed vLLM's version
            import trl
            from trl.experimental.gkd.gkd_trainer import GKDTrainer
            from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer
    except ImportError as error:
        pytest.fail(f"TRL 1.16 is needed for the parity tests (pip install -e '.[integrations]'): {error}")
    if trl.__version__ != "1.16.0":
        pytest.fail(f"the parity tests pin TRL 1.16.0 (pyproject's integrations extra); found {trl.__version__}")
    return GKDTrainer.generalized_jsd_loss, IWOPDTrainer.generalized_jsd_loss


def _trl_run(loss_fn, student, teacher, labels, **kwargs):
    leaf = student.detach().clone().requires_grad_()
    loss = loss_fn(leaf, teacher, labels=labels, **kwargs)
    loss.backward()
    return loss, leaf.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction,loss_agg", [("batchmean", "token-mean"), ("sum", "sum")])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_gkd_parity(trl_losses, beta, reduction, loss_agg, dtype):
    """GKD's generalized_jsd_loss(student, teacher, labels with -100 at masked tokens, beta, temperature): the value,
    the per-token divergence (reduction="none") and the student's gradient, TRL computing in float64."""
    gkd, _ = trl_losses
    student, teacher, mask, _ = make_pair(dtype=torch.float64, teacher_dtype=torch.float64, seed=20)
    labels = torch.where(mask, 1, -100)
    ref_loss, ref_grad = _trl_run(gkd, student, teacher, labels, beta=beta, temperature=0.8, reduction=reduction)
    kwargs = dict(kind="jsd", beta=beta, temperature=0.8, mask=mask, loss_agg=loss_agg)
    loss, per_token, _, grad = run(student.to(dtype), teacher, **kwargs)
    tol = TOLERANCES[dtype]
    assert_close("loss", loss, ref_loss, tol["loss"])
    assert_close("grad", grad, ref_grad * GRAD_SCALE, tol["grad"])
    ref_per_token = gkd(student, teacher, labels=labels, beta=beta, temperature=0.8, reduction="none").sum(-1)
    assert_close("per_token", per_token[mask], ref_per_token, tol["loss"])


@pytest.mark.parametrize("top_k,add_tail", [(0, True), (5, True), (5, False), (1, True)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_iw_opd_top_k_parity(trl_losses, beta, top_k, add_tail):
    """IW-OPD's generalized_jsd_loss with top_k (the teacher's, the student's or both tokens by beta) and the tail
    bucket: value and student gradient, float64 both."""
    _, iw_opd = trl_losses
    student, teacher, mask, _ = make_pair(dtype=torch.float64, teacher_dtype=torch.float64, seed=21)
    labels = torch.where(mask, 1, -100)
    ref_loss, ref_grad = _trl_run(iw_opd, student, teacher, labels, beta=beta, temperature=1.3, top_k=top_k,
                                  add_tail=add_tail)
    loss, _, _, grad = run(student, teacher, kind="jsd", beta=beta, temperature=1.3, mask=mask, top_k=top_k,
                           add_tail=add_tail)
    assert_close("loss", loss, ref_loss, 1e-10)
    assert_close("grad", grad, ref_grad * GRAD_SCALE, 1e-10)

"""distill_loss on backend="cpu" (csrc/cpu/distill_cpu.cpp, the C++ counterpart of triton_kernels/distill.py) against
the float64 oracle (fused_is.reference.distill_reference) on fresh random inputs, at the package's tolerances per dtype
and backend (fp32 logits: the kernels' fp32 bound), with test_distill.py's inputs and comparison (`check`).

Shapes on purpose: V = 80 as test_distill.py (padded [4, 7] with a fully masked sequence, packed [23] with an empty
sequence); V = 300 with maxes that rise along the row and -inf columns for the strided views; a row of one finite
column. The CUDA kernel of the same plan (csrc/cuda/distill_cuda.cu) compiles in test_cpp.py and in the GPU build check;
it runs only where a GPU is.
"""

import math

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.backends import abi, cpp

from cases import assert_close, tolerance
from test_distill import KIND_BETAS, check, make_pair, oracle, run

TEACHER_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture(scope="module", autouse=True)
def cpu_extension():
    """The CPU extension, built here if the set-up has not (scripts/dev.sh setup does); a skip only if it cannot be."""
    if backends.unavailable_reason("cpu", torch.empty(1, 1)) is not None:
        try:
            cpp.build("cpu")
        except Exception as err:  # no compiler or headers on this machine
            pytest.skip(f"the CPU extension cannot be built here ({type(err).__name__}: {err})")


@pytest.fixture
def launches(monkeypatch):
    """The calls that reached the CPU kernels: [("stats" | "gradient", call), ...]."""
    seen = []
    for name in ("stats", "gradient"):
        real = getattr(cpp.CppBackend, f"pair_{name}")
        monkeypatch.setattr(cpp.CppBackend, f"pair_{name}", lambda self, *a, _real=real, _name=name:
                            seen.append((_name, a[-2 if _name == "gradient" else -1])) or _real(self, *a))
    return seen


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_every_kind_matches_the_oracle(kind, beta, layout, launches):
    """Each kind (JSD at beta 0.3, and 0 and 1: TRL's special cases, run as the KLs), distinct temperatures, mask and
    cu_seqlens, several loss_aggs; fp32 student, bf16 teacher; both sweeps ran on the CPU kernels."""
    logits, teacher, mask, cu_seqlens = make_pair(layout, seed=30)
    agg = ("token-mean", "seq-mean-token-mean", "sum")[(KIND_BETAS.index((kind, beta)) + (layout == "packed")) % 3]
    check(logits, teacher, kind=kind, beta=beta, temperature=0.7, teacher_temperature=1.3, mask=mask,
          cu_seqlens=cu_seqlens, loss_agg=agg, backend="cpu")
    assert [name for name, _ in launches] == ["stats", "gradient"]
    assert launches[0][1].divergence == fused_is.divergences.of(kind, beta).code


@pytest.mark.parametrize("teacher_dtype", TEACHER_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_dtypes(dtype, teacher_dtype):
    """Every student and teacher dtype the kernels take (fp16: the gradient sweep deferred to backward), a kind each."""
    logits, teacher, mask, cu_seqlens = make_pair("packed", dtype, teacher_dtype, seed=31)
    kind, beta = KIND_BETAS[(TEACHER_DTYPES.index(teacher_dtype) + dtype.itemsize) % len(KIND_BETAS)]
    check(logits, teacher, kind=kind, beta=beta, temperature=0.8, teacher_temperature=0.6, mask=mask,
          cu_seqlens=cu_seqlens, backend="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_inplace_writes_the_same_gradient_over_the_logits(kind, beta, dtype):
    """inplace=True: the gradient is written over the logits' own buffer in backward (the leaf's .grad is that buffer),
    bitwise the new buffer's of inplace=False at grad_output 1 (else it folds grad_output in before the rounding to the
    logits' dtype, where inplace=False scales its rounded buffer), and the oracle's at 1.7."""
    logits, teacher, mask, _ = make_pair(dtype=dtype, teacher_dtype=torch.float32, seed=32)
    kwargs = dict(kind=kind, beta=beta, temperature=1.2, mask=mask, backend="cpu")
    grads = []
    for inplace in (False, True):
        leaf = logits.detach().clone().requires_grad_()
        storage = leaf.data_ptr()
        fused_is.distill_loss(leaf, teacher, inplace=inplace, **kwargs)[0].backward()
        assert (leaf.grad.data_ptr() == storage) == inplace
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    leaf = logits.detach().clone().requires_grad_()
    (fused_is.distill_loss(leaf, teacher, inplace=True, **kwargs)[0] * 1.7).backward()
    assert_close("grad", leaf.grad, oracle(logits, teacher, **{k: v for k, v in kwargs.items() if k != "backend"})[3],
                 tolerance(dtype, "cpu")["grad"])


def _strided(values: torch.Tensor, how: str) -> torch.Tensor:
    """A new leaf holding `values` ([B, T, V]) in a layout the kernels read row by row: "slice" (logits[:, :-1] of a
    longer buffer, rows 16-byte misaligned), "columns" (stored [B, V, T]: column stride T)."""
    if how == "slice":
        longer = torch.cat([values, values[:, :1]], dim=1)
        view = torch.cat([longer, torch.zeros_like(longer[..., :3])], dim=-1)[:, :-1, :-3]
    else:
        view = values.transpose(-1, -2).contiguous().transpose(-1, -2)
    return view.detach().requires_grad_()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("how", ["slice", "columns"])
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_strided_rows(kind, beta, how, inplace):
    """Rows that cannot be viewed as [N, V] (a padded slice) and strided columns, of the student (and, in place, of the
    gradient written over it) and of the teacher (the other layout); V = 300, maxes that rise along the rows (the
    teacher's fall), a -inf column in both models."""
    vocab = 300
    logits, teacher, mask, _ = make_pair(dtype=torch.float64, teacher_dtype=torch.float64, vocab=vocab, seed=33)
    rising = torch.linspace(0, 6, vocab, dtype=torch.float64)
    logits, teacher = (logits + rising).float(), (teacher + rising.flip(0)).bfloat16()
    logits[..., 7] = teacher[..., 7] = -math.inf
    student = _strided(logits, how)
    teacher_view = _strided(teacher, "columns" if how == "slice" else "slice").detach()
    assert not student.is_contiguous() and not teacher_view.is_contiguous()
    kwargs = dict(kind=kind, beta=beta, temperature=0.6, teacher_temperature=1.4, mask=mask)
    loss, per_token, _ = fused_is.distill_loss(student, teacher_view, inplace=inplace, backend="cpu", **kwargs)
    (loss * 1.7).backward()
    ref_loss, ref_per_token, _, ref_grad = oracle(logits, teacher, **kwargs)
    tol = tolerance(torch.float32, "cpu")
    assert_close("loss", loss, ref_loss, tol["loss"])
    assert_close("per_token", per_token, ref_per_token, tol["loss"])
    assert_close("grad", student.grad, ref_grad, tol["grad"])
    assert torch.equal(student.grad[..., 7], torch.zeros_like(student.grad[..., 7]))


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_extreme_logits(kind, beta):
    """Probability 0 and far ranges: -inf columns in both models, a row of one finite column in both (D = 0, zero
    gradient), logits over +-2000 at tau 0.5 (most probabilities underflow to 0), a shift by 3e4 (the kernels subtract
    each row's max first); the oracle's values at fp32 bounds. The gradient's bound grows with the log ratios: a
    column's factor log p - log q - D holds terms of up to |log p - log q| nats (near 1000 here), each rounded to fp32
    (relative 2**-24), so its error is a few of those roundings where p is near 1 (seen: 1.1e-5 of the largest
    gradient on an AVX-512 machine, whose FMA contractions round differently; under 1e-5 on others)."""
    logits, teacher, mask, cu_seqlens = make_pair("packed", torch.float64, torch.float64, seed=34)
    logits[:, 10:14] = teacher[:, 10:14] = -math.inf
    logits[3], teacher[3] = -math.inf, -math.inf
    logits[3, 5], teacher[3, 5] = 2.0, -1.0
    mask[3] = True
    logits[5:9] *= 400.0
    teacher[5:9] *= 300.0
    logits[12:16] += 3e4
    teacher[12:16] -= 3e4
    student, teacher = logits.float(), teacher.float()
    log_p, log_q = (x.double().mul(2.0).log_softmax(-1) for x in (student, teacher))  # tau 0.5
    weighted = (log_p.exp() > 2.0**-24) & log_q.isfinite()  # the columns whose factor reaches the gradient
    log_ratio = torch.where(weighted, log_p - log_q, 0.0).abs().amax()
    tol = dict(tolerance(torch.float32, "cpu"))
    tol["grad"] = max(tol["grad"], 4 * 2.0**-24 * float(log_ratio))
    _, per_token, grad = check(student, teacher, tol, kind=kind, beta=beta, temperature=0.5, mask=mask,
                               cu_seqlens=cu_seqlens, backend="cpu")
    assert abs(float(per_token[3].detach())) < 1e-6 and float(grad[3].abs().max()) < 1e-6
    assert not grad[:, 10:14].any() and not grad[3, :5].any()


def test_bad_rows_are_errors_before_any_write():
    """NaN teacher or +inf student logits at an unmasked row: the statistics kernel's non-finite values name the row
    (distill.py's check) before the gradient kernel has written anything (inplace=True: the logits unchanged); at a
    masked row they are fine. -inf where the teacher has mass: an infinite forward KL (JSD: m > 0 there, finite)."""
    logits, teacher, _, _ = make_pair(seed=35)
    mask = torch.ones(logits.shape[:-1], dtype=torch.bool)
    mask[1, 2] = False
    cases = [(logits, _with(teacher, (1, 2, 4), math.nan), None),
             (logits, _with(teacher, (0, 3, 4), math.nan),
              r"teacher_logits hold NaN at row 3 \(teacher_logits\[0, 3\]\), column 4"),
             (_with(logits, (3, 1, 0), math.inf), teacher, r"^logits hold \+inf at row 22"),
             (_with(logits, (0, 0, 9), -math.inf), teacher, "forward KL is infinite at row 0")]
    for kind in ("forward_kl", "jsd"):
        for student, teacher_logits, match in cases:
            leaf = student.clone().requires_grad_()
            before = leaf.detach().clone()
            call = dict(kind=kind, mask=mask, inplace=True, backend="cpu")
            if match is None or kind == "jsd" and "KL is infinite" in match:
                fused_is.distill_loss(leaf, teacher_logits, **call)[0].backward()
                assert torch.isfinite(leaf.grad).all()
                continue
            with pytest.raises(ValueError, match=match):
                fused_is.distill_loss(leaf, teacher_logits, **call)
            assert torch.equal(leaf.detach().nan_to_num(), before.nan_to_num())


def _with(x, index, value):
    """A copy of x with x[index] = value."""
    x = x.clone()
    x[index] = value
    return x


def test_masked_rows_and_empty_mask():
    """NaN and +-inf in masked rows of either model: the same loss as with zeros there, gradient exactly 0 there;
    nothing unmasked: loss 0, gradient 0."""
    logits, teacher, mask, _ = make_pair(teacher_dtype=torch.float32, seed=36)
    dirty_logits, dirty_teacher = logits.clone(), teacher.clone()
    dirty_logits[~mask] = math.nan
    dirty_teacher[~mask] = math.inf
    for kind, beta in (("reverse_kl", 0.5), ("jsd", 0.3)):
        dirty = run(dirty_logits, dirty_teacher, kind=kind, beta=beta, mask=mask, backend="cpu")
        clean = run(logits, teacher, kind=kind, beta=beta, mask=mask, backend="cpu")
        assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[3], clean[3])
        assert not dirty[3][~mask].any()
    loss, per_token, metrics, grad = run(logits, teacher, mask=torch.zeros_like(mask), backend="cpu")
    assert float(loss.detach()) == 0.0 and not per_token.any() and not grad.any()


def test_auto_and_refusals(launches):
    """backend="auto" on CPU tensors runs the CPU kernels (the CPU kernel's choice of policy_loss), "torch" where they
    cannot run the call; backend="cpu" refuses such calls by name, "cuda" CPU tensors."""
    logits, teacher, mask, _ = make_pair(seed=37)
    fused_is.distill_loss(logits, teacher, mask=mask)
    assert [name for name, _ in launches] == ["stats"]  # no grad wanted: no gradient sweep
    launches.clear()
    cases = (((logits, teacher, dict(top_k=4)), r"distill_loss\(top_k=4\) with backend='cpu' is not supported yet"),
             ((logits.double(), teacher, {}), "bf16/fp16/fp32 logits"),
             ((logits, teacher.to(torch.float8_e4m3fn), {}), "float8_e4m3fn"))
    for (student, teacher_logits, kwargs), match in cases:
        with pytest.raises(ValueError, match=match):
            fused_is.distill_loss(student, teacher_logits, mask=mask, kind="jsd", backend="cpu", **kwargs)
        fused_is.distill_loss(student, teacher_logits, mask=mask, kind="jsd", **kwargs)  # auto: torch
    assert not launches
    with pytest.raises(ValueError, match="backend='cuda' cannot run here: backend 'cuda' needs CUDA tensors"):
        fused_is.distill_loss(logits, teacher, mask=mask, backend="cuda")


def test_the_kernels_share_the_triton_statistics_rows():
    """One contract: the extension reports abi.py's DISTILL_STATS, scalars and divergence codes (checked when it
    loads), which are the Triton kernels' STATS and DIVERGENCES."""
    reported = cpp.extension("cpu").abi()
    assert reported["distill_stats"] == list(abi.DISTILL_STATS)
    assert reported["distill_scalars"] == list(abi.DISTILL_SCALARS)
    assert reported["distill_divergences"] == abi.DISTILL_DIVERGENCES
    if backends.unavailable_reason("triton", torch.empty(1, 1)) is None:
        from fused_is.backends import triton

        assert triton.distill_kernels().STATS == abi.DISTILL_STATS
        assert triton.distill_kernels().DIVERGENCES == abi.DISTILL_DIVERGENCES


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_policy_term_adds_its_gradient_on_the_cpu_kernels(kind, beta, launches):
    """policy_loss(backend="cpu", teacher_logits=) runs its distillation term on the CPU kernels, the gradient added
    into the policy's buffer (accumulate; masked rows untouched): equal to the float64 reference."""
    logits, teacher, mask, _ = make_pair(dtype=torch.bfloat16, seed=35)
    tokens = torch.randint(0, logits.shape[-1], mask.shape, generator=torch.Generator().manual_seed(35))
    advantages = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(36))
    sampler = torch.full(mask.shape, -4.0)
    config = fused_is.LossConfig(policy="ppo", is_level="token", distill_kind=kind, distill_beta=beta,
                                 distill_coef=0.7)
    outs = []
    for backend in ("cpu", "reference"):
        leaf = logits.detach().clone().requires_grad_()
        out = fused_is.policy_loss(leaf, tokens, advantages, sampler_logprobs=sampler, old_logprobs=sampler + 0.1,
                                   mask=mask, config=config, teacher_logits=teacher, backend=backend)
        out.loss.backward()
        outs.append((out, leaf.grad))
    assert [name for name, _ in launches] == ["stats", "gradient"]
    tol = tolerance(torch.bfloat16, "cpu")
    (out, grad), (ref, ref_grad) = outs
    assert_close("loss", out.loss.double(), ref.loss.double(), tol["loss"])
    assert_close("grad", grad.double(), ref_grad.double(), tol["grad"])
    assert abs(out.metrics["distill_mean"] - ref.metrics["distill_mean"]) <= 10 * tol["loss"] * max(
        1.0, abs(ref.metrics["distill_mean"]))

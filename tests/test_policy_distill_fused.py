"""policy_loss(..., teacher_logits=u) on backend="triton" in one kernel (fused_is/plan.py fused_distill_term,
triton_kernels/distill.py _fused_distill_kernel): the policy loss and a forward or reverse KL term, statistics and
gradient in one pass over both rows each, against the float64 reference (loss, gradient, logprobs, entropies, the
metrics with distill_mean); that the fused kernel is what ran (and JSD at 0 < beta < 1 composes); its value errors.
Small rows (V 300, N <= 12): the interpreter runs every row in Python."""

import dataclasses
import inspect
import types

import pytest
import torch

import fused_is
from fused_is import distill, plan
from fused_is.backends import triton as triton_backend

from cases import assert_close, check_against_reference, config_for, count_calls, make_inputs
from test_policy_distill import _Taught

pytestmark = pytest.mark.skipif(fused_is.backends.unavailable_reason("triton") is not None,
                                reason=str(fused_is.backends.unavailable_reason("triton")))

VOCAB = 300  # not a multiple of 16: the masked tail of both sweeps, one block per row


def _taught(layout: str, dtype, teacher_dtype=torch.bfloat16, seed: int = 2, seq_len: int = 4):
    """Inputs (N = 12 rows padded, 6 packed) and a teacher near the student (test_policy_distill._Taught) in
    teacher_dtype."""
    taught = _Taught(make_inputs(layout, dtype=dtype, seed=seed, vocab=VOCAB, seq_len=seq_len))
    taught.teacher = taught.teacher.to(teacher_dtype)
    return taught


def _count(monkeypatch):
    """() -> the calls so far of the fused launcher and of the composed plan's two distillation sweeps, counted from
    now on."""
    fused = count_calls(monkeypatch, triton_backend, ["policy_fused"])
    composed = count_calls(monkeypatch, distill, ["policy_term_call", "gradient_sweep"])
    return lambda: {**fused, **composed}


# kind, beta, the student's dtype, the teacher's, preset, layout: each kind in both student dtypes; the teacher bf16
# beside an fp32 student, fp32 beside a bf16 one; the default preset (PPO) and a TIS one; padded and packed rows
CASES = [
    ("forward_kl", 0.5, torch.float32, torch.bfloat16, "ppo", "padded"),
    ("forward_kl", 0.5, torch.bfloat16, torch.float32, "ppo_tis", "packed"),
    ("reverse_kl", 0.5, torch.float32, torch.bfloat16, "ppo_tis", "packed"),
    ("reverse_kl", 0.5, torch.bfloat16, torch.bfloat16, "ppo", "padded"),
    ("jsd", 0.0, torch.float32, torch.float32, "ppo_tis", "padded"),
    ("jsd", 1.0, torch.bfloat16, torch.bfloat16, "ppo_tis", "packed"),
]


@pytest.mark.parametrize("kind,beta,dtype,teacher_dtype,preset,layout", CASES,
                         ids=[f"{k}{b if k == 'jsd' else ''}-{str(d)[6:]}-{str(t)[6:]}-{p}-{lay}"
                              for k, b, d, t, p, lay in CASES])
def test_fused_against_the_reference(kind, beta, dtype, teacher_dtype, preset, layout, monkeypatch):
    taught = _taught(layout, dtype, teacher_dtype)
    config = config_for(preset, dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01,
                                     loss_agg="seq-mean-token-mean" if layout == "packed" else "token-mean"))
    calls = _count(monkeypatch)
    out, _, ref, _ = check_against_reference(taught, config, "triton")
    assert calls() == {"policy_fused": 1, "policy_term_call": 0, "gradient_sweep": 0}, calls()
    assert out.metrics["distill_mean"] > 0.1 and abs(out.metrics["distill_mean"] - ref.metrics["distill_mean"]) <= (
        1e-5 * ref.metrics["distill_mean"])


@pytest.mark.parametrize("vocab,block,dtype", [(300, "128", torch.bfloat16), (4400, None, torch.bfloat16),
                                               (2400, None, torch.float32)], ids=["blocks", "bf16-half", "fp32-half"])
def test_fused_blocks_and_temperature(vocab, block, dtype, monkeypatch):
    """Rows of several blocks (a tail each): the launcher's block capped at 128 lanes, and aligned rows (V a multiple
    of 16) whose block is the launcher's full one (8192 lanes of a bf16 pair, 4096 with an fp32 row), which the
    kernel's sweeps take half a block a step; at temperature 0.7 (both models')."""
    if block is not None:
        monkeypatch.setenv("FUSED_IS_TRITON_BLOCK", block)
    taught = _Taught(make_inputs("packed", dtype=dtype, seed=5, vocab=vocab, seq_len=4))
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5, temperature=0.7))
    calls = _count(monkeypatch)
    check_against_reference(taught, config, "triton")
    assert calls() == {"policy_fused": 1, "policy_term_call": 0, "gradient_sweep": 0}, calls()
    expected = int(block) if block else 8192 if dtype == torch.bfloat16 else 4096
    assert triton_backend.LAST_LAUNCH["_fused_distill_kernel"]["BLOCK"] == expected


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_fused_inplace_forward(kind, monkeypatch):
    """inplace="forward": the gradient written over the logits in the one kernel (the teacher only read)."""
    taught = _taught("padded", torch.bfloat16)
    before = taught.teacher.clone()
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_coef=0.5))
    calls = _count(monkeypatch)
    check_against_reference(taught, config, "triton", inplace="forward")
    assert calls() == {"policy_fused": 1, "policy_term_call": 0, "gradient_sweep": 0}, calls()
    assert torch.equal(taught.teacher, before)


@pytest.mark.parametrize("inplace", [False, "forward"])
def test_jsd_between_the_end_points_composes(inplace, monkeypatch):
    """JSD at 0 < beta < 1 has no fused kernel: the composed plan (term statistics, the policy's kernel, the term's
    gradient sweep), still against the reference; with inplace="forward" the term's sweep runs on each block of rows
    (backends.DeferredGradient: 3 blocks of 2 rows here) before the block's gradient replaces its logits."""
    monkeypatch.setattr(plan, "ROUNDED_BLOCK_ELEMENTS", 2 * VOCAB)
    taught = _taught("packed", torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="jsd", distill_beta=0.5, distill_coef=0.5))
    calls = _count(monkeypatch)
    check_against_reference(taught, config, "triton", inplace=inplace)
    assert calls() == {"policy_fused": 0, "policy_term_call": 1, "gradient_sweep": 3 if inplace else 1}, calls()


def test_fused_matches_the_composed_plan(monkeypatch):
    """The fused kernel and the composed plan (the same call with the fused path off) agree to fp32 rounding: loss,
    gradient, logprobs and metrics (the two differ in their order of fp32 operations only)."""
    taught = _taught("padded", torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))
    outputs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(plan, "fused_distill_term", lambda *args: None)
        logits = taught.logits.clone().requires_grad_()
        out = fused_is.policy_loss(logits, taught.tokens, taught.advantages, config=config, backend="triton",
                                   **taught.kwargs())
        out.loss.backward()
        outputs.append((out, logits.grad))
    (fused, grad), (composed, composed_grad) = outputs
    assert_close("loss", fused.loss, composed.loss, 1e-6, scale=1.0)
    assert_close("grad", grad, composed_grad, 1e-5)
    assert_close("logprobs", fused.logprobs, composed.logprobs, 1e-6, mask=taught.mask, scale=10.0)
    for key, value in composed.metrics.items():
        assert abs(fused.metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), key


@pytest.mark.slow  # dynamo and AOT autograd on the CPU: about 9 s
def test_compiled_call_composes():
    """Under torch.compile(fullgraph=True) the term keeps the composed plan's kernel-level ops (fused_is/ops.py): the
    compiled call matches the eager one, which ran the fused kernel (seen in the launch record; no monkeypatched
    module here, which dynamo would see as a mutated dict)."""
    torch._dynamo.reset()
    launches = triton_backend.LAST_LAUNCH
    taught = _taught("padded", torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="forward_kl", distill_coef=0.5))

    def fn(logits):
        out = fused_is.policy_loss(logits, taught.tokens, taught.advantages, config=config, backend="triton",
                                   **taught.kwargs())
        return out.loss, out.logprobs, torch.as_tensor(out.metrics["distill_mean"])  # eager: a float

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        launches.pop("_fused_distill_kernel", None)
        logits = taught.logits.clone().requires_grad_()
        loss, logprobs, divergence = run(logits)
        loss.backward()
        results.append((loss, logprobs, divergence, logits.grad))
        assert ("_fused_distill_kernel" in launches) == (run is fn)
    for name, got, want in zip(("loss", "logprobs", "distill_mean", "grad"), results[1], results[0]):
        assert_close(name, got, want, 1e-5, scale=1.0 if got.dim() == 0 else None)


def test_fused_needs_the_one_pass_plan(monkeypatch):
    """A plan with a stats pass (sequence-level IS with old_logprobs=None) composes."""
    taught = _taught("padded", torch.float32)
    config = config_for("seq_tis", dict(distill_kind="forward_kl", distill_coef=0.5))
    calls = _count(monkeypatch)
    check_against_reference(taught, config, "triton", with_old=False)
    assert calls() == {"policy_fused": 0, "policy_term_call": 1, "gradient_sweep": 1}, calls()


@pytest.mark.parametrize("bad,inplace", [("nan", False), ("nan", "forward"), ("inf", False)])
def test_teacher_values_at_unmasked_rows(bad, inplace):
    """NaN or +inf in the teacher's row at an unmasked position: a ValueError naming teacher_logits and the row,
    after the kernel (inplace=False: the logits untouched; inplace="forward": the gradient already written over them,
    as the one-pass plan does for the student's values); at a masked position the teacher is not read."""
    taught = _taught("packed", torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))
    valid = taught.mask.reshape(-1)
    row, masked = int(valid.nonzero()[1, 0]), int((~valid).nonzero()[0, 0])
    teacher = taught.teacher.clone()
    teacher[masked] = float("nan")  # never read
    teacher[row, 7] = float("nan") if bad == "nan" else float("inf")
    logits = taught.logits.clone().requires_grad_()
    work = logits.clone() if inplace else logits
    with pytest.raises(ValueError, match=rf"teacher_logits hold {'NaN' if bad == 'nan' else '[+]inf'} at row {row}"):
        fused_is.policy_loss(work, taught.tokens, taught.advantages, config=config, backend="triton",
                             inplace=inplace, **taught.inputs.kwargs(teacher_logits=teacher))
    assert torch.equal(work.detach(), taught.logits) != bool(inplace)


def test_masked_teacher_rows_are_not_read(monkeypatch):
    """NaN in every masked row of the teacher (and of the student): the same result as finite values there."""
    taught = _taught("padded", torch.bfloat16)
    config = config_for("ppo", dict(distill_kind="forward_kl", distill_coef=0.5))
    valid = taught.mask.reshape(-1)
    results = []
    for poison in (False, True):
        teacher, logits = taught.teacher.clone(), taught.logits.clone()
        if poison:
            teacher.view(-1, VOCAB)[~valid] = float("nan")
            logits.view(-1, VOCAB)[~valid] = float("nan")
        logits.requires_grad_()
        out = fused_is.policy_loss(logits, taught.tokens, taught.advantages, config=config, backend="triton",
                                   **taught.inputs.kwargs(teacher_logits=teacher))
        out.loss.backward()
        results.append((out, logits.grad))
    (clean, clean_grad), (poisoned, poisoned_grad) = results
    assert torch.equal(clean.loss, poisoned.loss) and clean.metrics == poisoned.metrics
    assert torch.equal(clean_grad, poisoned_grad)
    assert not bool(poisoned_grad.view(-1, VOCAB)[~valid].any())


def test_fused_term_with_distill_coef_zero():
    """distill_coef=0: the term adds nothing to the loss or the gradient, and its metric is still reported."""
    taught = _taught("padded", torch.float32)
    plain = config_for("ppo_tis", {})
    with_term = dataclasses.replace(plain, distill_kind="forward_kl", distill_coef=0.0)
    out = check_against_reference(taught, with_term, "triton")[0]
    assert out.metrics["distill_mean"] > 0.1


def test_frames_from_policy_loss_to_the_fused_kernel(monkeypatch):
    """The fused launch is as shallow as the policy's own (test_architecture.py): public function, autograd.Function,
    plan runner, launcher."""
    from test_architecture import MAX_FRAMES, _package_frames

    real = triton_backend.distill_kernels()
    seen = []

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(_package_frames(inspect.stack()))
                return real._fused_distill_kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_backend, "distill_kernels", lambda: types.SimpleNamespace(
        _fused_distill_kernel=Recording(), DIVERGENCES=real.DIVERGENCES))
    taught = _taught("packed", torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="forward_kl", distill_coef=0.5))
    logits = taught.logits.clone().requires_grad_()
    fused_is.policy_loss(logits, taught.tokens, taught.advantages, config=config, backend="triton", **taught.kwargs())
    assert len(seen) == 1 and seen[0][0] == "api.py:policy_loss" and len(seen[0]) <= MAX_FRAMES, seen

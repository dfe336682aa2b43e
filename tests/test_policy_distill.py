"""policy_loss(..., teacher_logits=u) with LossConfig.distill_kind: the policy loss and on-policy distillation in one
aggregation, on every backend against the float64 reference; the reference against the policy loss plus
distill_loss (checked against TRL in test_distill.py); its errors."""

import dataclasses
import math

import pytest
import torch

import fused_is
from fused_is import backends, plan

from cases import (assert_close, check_against_reference, config_for, count_calls, linear_tolerance, make_inputs,
                   run_linear, tolerance)
from fused_is.testing import make_linear_inputs

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)]


class _Taught:
    """Inputs whose kwargs() carry a teacher: the student's logits moved by noise, in bf16 (any float dtype)."""

    def __init__(self, inputs, seed=0):
        device = inputs.logits.device
        g = torch.Generator(device=device).manual_seed(seed)
        self.inputs = inputs
        self.teacher = (inputs.logits.double() + torch.randn(inputs.logits.shape, generator=g, dtype=torch.float64,
                                                            device=device)).to(torch.bfloat16)

    def __getattr__(self, name):
        return getattr(self.inputs, name)

    def kwargs(self, **overrides):
        return dict(self.inputs.kwargs(**overrides), teacher_logits=self.teacher)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_against_the_reference(backend, kind, beta, dtype):
    inputs = make_inputs("packed" if kind == "jsd" else "padded", dtype=dtype, seed=2)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5,
                                        loss_agg="seq-mean-token-mean" if kind == "reverse_kl" else "token-mean"))
    check_against_reference(_Taught(inputs), config, backend)


@pytest.mark.parametrize("kind,beta", KINDS + [("jsd", 0.0), ("jsd", 1.0)], ids=["fwd", "rev", "jsd", "b0", "b1"])
def test_reference_is_the_policy_loss_plus_distill_loss(kind, beta):
    """With a token-mean aggregation the combined loss is policy_loss + coef * distill_loss over the same mask: value
    and gradient (float64, the two oracles)."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=4)
    taught = _Taught(inputs)
    plain = config_for("ppo_tis", {})
    combined = dataclasses.replace(plain, distill_kind=kind, distill_beta=beta, distill_coef=0.3)
    x = inputs.logits.double().requires_grad_()
    out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=combined, backend="reference",
                               **taught.kwargs())
    out.loss.backward()
    y = inputs.logits.double().requires_grad_()
    policy = fused_is.policy_loss(y, inputs.tokens, inputs.advantages, config=plain, backend="reference",
                                  **inputs.kwargs()).loss
    distill, per_token, _ = fused_is.distill_loss(y, taught.teacher, kind=kind, beta=beta, mask=inputs.mask,
                                                  backend="reference")
    (policy + 0.3 * distill).backward()
    assert_close("loss", out.loss, policy + 0.3 * distill, 1e-12, scale=1.0)
    assert_close("grad", x.grad, y.grad, 1e-10)
    mean = per_token.reshape(-1)[inputs.mask.reshape(-1)].mean()
    assert abs(out.metrics["distill_mean"] - float(mean)) < 1e-10


@pytest.mark.parametrize("what,match", [
    ("unread", "read by LossConfig.distill_kind"), ("missing", "needs teacher_logits"),
    ("kind", "distill_kind must be one of"), ("grad", "requires grad"), ("shape", "vocabulary"),
    ("nan", "teacher_logits"), ("beta", r"distill_beta must be in \[0, 1\]"), ("orphan", "without distill_kind"),
])
def test_errors(what, match):
    inputs = make_inputs("packed", dtype=torch.float32, seed=1)
    teacher = inputs.logits.clone()
    config = config_for("ppo_tis", dict(distill_kind="forward_kl"))
    extra = {}
    if what == "unread":
        config = config_for("ppo_tis", {})
    elif what == "missing":
        teacher = None
    elif what == "grad":
        teacher.requires_grad_()
    elif what == "shape":
        teacher = teacher[:, :-1]
    elif what == "nan":
        teacher[int(inputs.mask.nonzero()[0, 0]), 3] = float("nan")
    elif what in ("beta", "orphan", "kind"):
        with pytest.raises(ValueError, match=match):
            config_for("ppo_tis", {"beta": dict(distill_kind="jsd", distill_beta=1.5), "orphan": dict(distill_coef=0.5),
                                   "kind": dict(distill_kind="total_variation")}[what])
        return
    logits = inputs.logits.clone().requires_grad_()
    before = logits.detach().clone()
    with pytest.raises((ValueError, TypeError), match=match):
        fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=config, backend="cpu",
                             **inputs.kwargs(teacher_logits=teacher, **extra))
    assert torch.equal(logits.detach(), before)  # nothing written before the error


# --- in place and fp16: the gradient written block by block (fused_is/backends DeferredGradient) -------------------------

# inplace, kind, beta, dtype, preset, layout: each in-place mode, each kind, fp16 (formed in backward, grad_output
# folded in before its rounding), the one-pass and the two-pass plans, padded rows sliced from a longer buffer
IN_PLACE = [(True, "forward_kl", 0.5, torch.bfloat16, "ppo_tis", "sliced"),
            ("forward", "jsd", 0.3, torch.float32, "seq_tis", "packed"),
            ("backward", "reverse_kl", 0.5, torch.float16, "ppo", "padded"),
            (False, "jsd", 0.3, torch.float16, "gspo", "sliced")]


def _in_place_inputs(layout: str, dtype, seed: int = 6):
    """make_inputs of the layout; "sliced": padded rows that are a view of a longer buffer ([B, T + 1, V][:, :-1],
    the layout of a model's logits before the shift), which the block views keep."""
    inputs = make_inputs("padded" if layout == "sliced" else layout, dtype=dtype, seed=seed, vocab=200)
    if layout == "sliced":
        shape = inputs.logits.shape
        longer = torch.full((shape[0], shape[1] + 1, shape[2]), float("nan"), dtype=dtype)
        longer[:, :-1] = inputs.logits
        inputs = dataclasses.replace(inputs, logits=longer[:, :-1])
    return inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace,kind,beta,dtype,preset,layout", IN_PLACE,
                         ids=[f"{i}-{k}-{str(d)[6:]}-{p}-{lay}" for i, k, _, d, p, lay in IN_PLACE])
def test_in_place_and_fp16(backend, inplace, kind, beta, dtype, preset, layout, monkeypatch):
    """The term's gradient over the logits (or formed in backward for fp16), in blocks of 3 rows that split the
    sequences, against the float64 reference; the teacher is only read."""
    monkeypatch.setattr(plan, "ROUNDED_BLOCK_ELEMENTS", 3 * 200)
    taught = _Taught(_in_place_inputs(layout, dtype))
    before = taught.teacher.clone()
    config = config_for(preset, dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01))
    writes = count_calls(monkeypatch, backends.DeferredGradient, ["write"])
    check_against_reference(taught, config, backend, inplace=inplace)
    assert writes == {"write": int(bool(inplace) or dtype == torch.float16)}, writes
    assert torch.equal(taught.teacher, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["sliced", "contiguous"])
def test_in_place_equals_the_buffer(backend, layout, monkeypatch):
    """fp16 logits: inplace=True (blocks of 3 rows over the logits: within each sequence of a [B, T + 1, V][:, :-1]
    slice, across sequences of contiguous rows) and inplace=False (all rows into a new buffer), both formed in
    backward with grad_output folded in, are the same bits: every row's gradient is its own."""
    monkeypatch.setattr(plan, "ROUNDED_BLOCK_ELEMENTS", 3 * 200)
    taught = _Taught(_in_place_inputs("sliced", torch.float16, seed=8))
    config = config_for("ppo_tis", dict(distill_kind="jsd", distill_beta=0.3, distill_coef=0.5))
    grads = []
    for inplace in (False, True):
        # the logits a model's output: a view of a non-leaf buffer, [:, :-1] of it (sliced) or all of it
        extra = int(layout == "sliced")
        shape = taught.logits.shape
        base = torch.zeros(shape[0], shape[1] + extra, shape[2], dtype=torch.float16, requires_grad=True)
        values = torch.zeros(base.shape, dtype=torch.float16)
        values[:, :shape[1]] = taught.logits
        work = (base + values)[:, :shape[1]]
        assert work.is_contiguous() == (layout == "contiguous")
        out = fused_is.policy_loss(work, taught.tokens, taught.advantages, config=config, backend=backend,
                                   inplace=inplace, **taught.kwargs())
        (out.loss * 1.7).backward()
        grads.append(base.grad)
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("inplace", [True, "forward", False])
def test_a_teacher_made_under_inference_mode(inplace):
    """A teacher's logits made under torch.inference_mode() (no version counter) take every gradient mode, fp16 logits
    (formed in backward) included, with the gradient of the same teacher made normally; distill_loss's too."""
    taught = _Taught(make_inputs("packed", dtype=torch.float16, seed=12))
    with torch.inference_mode():
        frozen = taught.teacher.clone()
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))
    grads = []
    for teacher in (taught.teacher, frozen):
        leaf = taught.logits.clone().requires_grad_()
        out = fused_is.policy_loss(leaf.clone() if inplace else leaf, taught.tokens, taught.advantages,
                                   config=config, backend="torch", inplace=inplace,
                                   **taught.inputs.kwargs(teacher_logits=teacher))
        out.loss.backward()
        loss, _, _ = fused_is.distill_loss(leaf.clone() if inplace else leaf, teacher, mask=taught.mask,
                                           inplace=bool(inplace))
        loss.backward()
        grads.append(leaf.grad)
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("which", ["logits", "teacher_logits"])
def test_a_write_before_backward(which):
    """inplace=True: a write into the logits or the teacher's logits between the call and backward is a RuntimeError
    naming it, not the gradient of other values."""
    taught = _Taught(make_inputs("packed", dtype=torch.float32, seed=3))
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))
    work = taught.logits.clone().requires_grad_().clone()
    out = fused_is.policy_loss(work, taught.tokens, taught.advantages, config=config, backend="cpu", inplace=True,
                               **taught.kwargs())
    with torch.no_grad():
        (work if which == "logits" else taught.teacher).mul_(2.0)
    with pytest.raises(RuntimeError, match="teacher_logits were modified" if which != "logits" else "logits were"):
        out.loss.backward()


# --- linear_policy_loss(..., teacher_hidden=, teacher_weight=): both heads formed chunk by chunk -------------------

def _teacher_head(li, dim=24, seed=7, dtype=torch.float32):
    """A teacher's head of another width D_t whose logits are near the student's: (hidden [.., D_t], weight [V, D_t],
    bias [V]) in `dtype`, masked rows' hidden states NaN (they may hold anything)."""
    g = torch.Generator().manual_seed(seed)
    vocab = li.weight.shape[0]
    hidden = torch.randn(*li.hidden.shape[:-1], dim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64) * 2.0 / dim ** 0.5
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
    hidden[~li.inputs.mask] = float("nan")
    return dict(teacher_hidden=hidden.to(dtype), teacher_weight=weight.to(dtype), teacher_bias=bias.to(dtype))


LINEAR_PLANS = [("ppo_tis", True, "padded"), ("seq_tis", False, "packed")]


# every kind and plan on the cpu and torch backends; Triton (the interpreter, seconds a case here) once per plan
LINEAR_CASES = [(b, k, beta, plan) for b in BACKENDS if b in ("cpu", "torch") for k, beta in KINDS
                for plan in LINEAR_PLANS]
LINEAR_CASES += [("triton", "reverse_kl", 0.5, LINEAR_PLANS[0]), ("triton", "jsd", 0.3, LINEAR_PLANS[1])] * (
    "triton" in BACKENDS)


@pytest.mark.parametrize("backend,kind,beta,plan", LINEAR_CASES,
                         ids=[f"{b}-{k}-{p[0]}" for b, k, _, p in LINEAR_CASES])
def test_linear_against_the_reference(backend, kind, beta, plan):
    """linear_policy_loss with the teacher's head: loss, d hidden, d weight, d bias, logprobs and metrics (distill_mean)
    against the float64 reference on the formed logits of both heads; the one-pass and the two-pass plans."""
    preset, with_old, layout = plan
    li = make_linear_inputs(layout, seed=11)
    config = config_for(preset, dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01))
    teacher = _teacher_head(li)
    out, grads = run_linear(li, config, backend, with_old=with_old, **teacher)
    ref, ref_grads = run_linear(li, config, "reference", with_old=with_old, **teacher)
    tol = linear_tolerance(li.hidden.dtype, backend)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close(f"d {name}", got, want, tol["grad"])
    valid = li.inputs.mask
    assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=valid, scale=10.0)
    assert out.metrics.keys() == ref.metrics.keys()
    for key, value in ref.metrics.items():
        assert abs(out.metrics[key] - value) <= 1e-4 * max(1.0, abs(value)), key
    assert out.metrics["distill_mean"] > 0.1


def test_linear_equals_the_logits_path():
    """The same call on the formed logits of both heads (policy_loss with teacher_logits=) gives the same loss and the
    same gradient (bf16: each head's logits rounded once to its dtype in both)."""
    dtype = torch.bfloat16
    li = make_linear_inputs("packed", dtype=dtype, seed=13)
    teacher = _teacher_head(li, dtype=torch.float32)
    config = config_for("ppo_tis", dict(distill_kind="jsd", distill_beta=0.3, distill_coef=0.5))
    out, grads = run_linear(li, config, "torch", **teacher)
    th = torch.nan_to_num(teacher["teacher_hidden"])
    u = th @ teacher["teacher_weight"].t() + teacher["teacher_bias"]
    leaves = [x.clone().requires_grad_() for x in (li.hidden, li.weight, li.bias)]
    logits = torch.addmm(leaves[2], leaves[0], leaves[1].t())
    logits.retain_grad()
    mine = fused_is.policy_loss(logits, li.inputs.tokens, li.inputs.advantages, config=config, backend="torch",
                                **li.inputs.kwargs(teacher_logits=u))
    (mine.loss * 1.7).backward()  # run_linear's grad_scale
    assert_close("loss", out.loss, mine.loss, 1e-6, scale=1.0)
    assert abs(out.metrics["distill_mean"] - mine.metrics["distill_mean"]) < 1e-6
    for name, got, want in zip(("hidden", "weight", "bias"), grads, (x.grad for x in leaves)):
        assert_close(f"d {name}", got, want, 2e-2)


def test_linear_fp16_head():
    """An fp16 student head (which policy_loss's logits path refuses with the term: its fp16 gradient is deferred to
    backward there) against the float64 reference, within the fp16 head's rounding."""
    li = make_linear_inputs("padded", dtype=torch.float16, seed=23)
    config = config_for("ppo_tis", dict(distill_kind="forward_kl", distill_coef=0.5))
    teacher = _teacher_head(li, dtype=torch.float16)
    out, grads = run_linear(li, config, "cpu", **teacher)
    ref, ref_grads = run_linear(li, config, "reference", **teacher)
    tol = linear_tolerance(torch.float16, "cpu")
    assert_close("loss", out.loss, ref.loss, 2 * tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close(f"d {name}", got, want, tol["grad"])


def test_linear_forms_the_teacher_for_unmasked_rows_alone(monkeypatch):
    """With most rows masked both heads form the unmasked rows alone in the one-pass plan (masked_outputs="zero"), and
    without grad (old-logprob passes) the loss still carries the term."""
    from test_linear import _record_rows, _with_mask

    li = _with_mask(make_linear_inputs("padded", seed=17), "most")
    unmasked = li.inputs.mask.reshape(-1).nonzero().squeeze(1).tolist()
    teacher = _teacher_head(li)
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))
    formed, _ = run_linear(li, config, "cpu", **teacher)
    seen = _record_rows(monkeypatch)
    zero, _ = run_linear(li, config, "cpu", masked_outputs="zero", **teacher)
    assert sorted(sum(seen["formed"], [])) == sorted(unmasked * 2)  # the student's head and the teacher's
    assert torch.equal(zero.loss, formed.loss) and zero.metrics == formed.metrics
    with torch.no_grad():
        again = fused_is.linear_policy_loss(li.hidden, li.weight, li.inputs.tokens, li.inputs.advantages,
                                            bias=li.bias, chunk_size=5, config=config, backend="cpu",
                                            **li.inputs.kwargs(), **teacher)
    assert_close("loss without grad", again.loss, formed.loss, 1e-6, scale=1.0)


@pytest.mark.parametrize("what,match", [
    ("unread", "teacher_hidden= and teacher_weight= are read by LossConfig.distill_kind"),
    ("missing", "needs teacher_hidden= and teacher_weight="), ("alone", "go together"),
    ("grad", "teacher_weight requires grad"), ("vocab", "teacher_weight has a vocabulary of"),
    ("rows", "teacher_hidden must have hidden's leading shape"), ("nan", r"teacher_hidden\[2\]"),
])
def test_linear_errors(what, match):
    li = make_linear_inputs("packed", seed=19)
    teacher = _teacher_head(li)
    config = config_for("ppo_tis", dict(distill_kind="forward_kl"))
    if what == "unread":
        config = config_for("ppo_tis", {})
    elif what == "missing":
        teacher = {}
    elif what == "alone":
        del teacher["teacher_weight"]
    elif what == "grad":
        teacher["teacher_weight"].requires_grad_()
    elif what == "vocab":
        teacher["teacher_weight"] = teacher["teacher_weight"][:-1]
        teacher["teacher_bias"] = None
    elif what == "rows":
        teacher["teacher_hidden"] = teacher["teacher_hidden"][:-1]
    elif what == "nan":
        assert bool(li.inputs.mask.reshape(-1)[2])
        teacher["teacher_hidden"][2, 0] = float("nan")
    with pytest.raises((ValueError, TypeError), match=match):
        run_linear(li, config, "cpu", **teacher)


# --- combinations lifted: each against the float64 reference, on every backend --------------------------------------


def _per_sequence(inputs, seed: int) -> torch.Tensor:
    """float64 [B] temperatures in [0.5, 1.5] for padded inputs."""
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(inputs.logits.shape[0], generator=g, dtype=torch.float64)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("kind,beta", KINDS, ids=[k for k, _ in KINDS])
def test_per_row_temperature_divides_both_models(backend, kind, beta):
    """Per-sequence temperature= with a term: each row's temperature divides both models' logits (the policy's and the
    term's softmax alike); equal to the float64 reference on both logits divided by it, config temperature 1."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=21)
    taught = _Taught(inputs)
    tau = _per_sequence(inputs, 5)
    divisor = tau.reshape(-1, 1, 1)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01))
    leaf = inputs.logits.detach().double().requires_grad_()
    ref = fused_is.policy_loss(leaf / divisor, inputs.tokens, inputs.advantages, config=config, backend="reference",
                               **inputs.kwargs(teacher_logits=taught.teacher.double() / divisor))
    (ref.loss * 1.7).backward()
    x = inputs.logits.detach().clone().requires_grad_()
    out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=config, backend=backend,
                               temperature=tau if backend == "reference" else tau.float(), **taught.kwargs())
    (out.loss * 1.7).backward()
    tol = tolerance(torch.float32, "cpu" if backend == "reference" else backend)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", x.grad, leaf.grad, tol["grad"])
    assert abs(out.metrics["distill_mean"] - ref.metrics["distill_mean"]) <= 1e-5 * max(1, ref.metrics["distill_mean"])


class _TaughtAndCentered(_Taught):
    """A teacher and the sampler's top-K (score centering) in one call's kwargs."""

    def __init__(self, inputs, seed=0):
        from test_centering import sampler_of

        super().__init__(inputs, seed)
        self.samp, self.topk = sampler_of(inputs.logits, inputs.tokens, seed=seed)

    def kwargs(self, **overrides):
        return dict(super().kwargs(**overrides), sampler_logprobs=self.samp, sampler_topk=self.topk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta,inplace,dtype", [("forward_kl", 0.5, False, torch.float32),
                                                     ("jsd", 0.3, True, torch.bfloat16),
                                                     ("reverse_kl", 0.5, "forward", torch.float32),
                                                     ("forward_kl", 0.5, False, torch.float16)],
                         ids=["fwd", "jsd_inplace_bf16", "rev_forward", "fwd_fp16"])
def test_with_score_centering(backend, kind, beta, inplace, dtype):
    """Score centering with a term: the policy's score centered by the sampler's top-K (its K + 1 columns exact), the
    term's gradient added as it is (it is no score-function term); in place and fp16 through the blocks that carry
    both (backends.DeferredGradient)."""
    inputs = make_inputs("padded", dtype=dtype, seed=23)
    config = config_for("ppo_tis", dict(score_centering="proportional", distill_kind=kind, distill_beta=beta,
                                        distill_coef=0.5))
    out = check_against_reference(_TaughtAndCentered(inputs), config, backend, inplace=inplace)[0]
    assert {"distill_mean", "centering_c"} <= set(out.metrics)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta,inplace", [("forward_kl", 0.5, False), ("jsd", 0.3, "forward"),
                                               ("reverse_kl", 0.5, "forward")],
                         ids=["fwd", "jsd_forward", "rev_forward"])
def test_with_head_precision_replay(backend, kind, beta, inplace, monkeypatch):
    """head_dtype replay with a term: the student's logits rounded to the head's dtype before both softmaxes it feeds
    (the policy's and the term's), the teacher's as given; the gradient passes the rounding. Blocks of 3 rows. Against
    the float64 reference (which rounds the same way) and, on the torch backend, bitwise against the same call on
    logits rounded beforehand."""
    monkeypatch.setattr(plan, "ROUNDED_BLOCK_ELEMENTS", 3 * 200)
    inputs = make_inputs("padded", dtype=torch.float32, vocab=200, seed=25)
    taught = _Taught(inputs)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01))
    results = []
    for logits, head in ((inputs.logits, torch.bfloat16), (inputs.logits.to(torch.bfloat16).float(), None)):
        leaf = logits.clone().requires_grad_()
        out = fused_is.policy_loss(leaf * 1 if inplace else leaf, inputs.tokens, inputs.advantages, config=config,
                                   backend=backend, inplace=inplace, head_dtype=head, **taught.kwargs())
        (1.3 * out.loss).backward()
        results.append((out, leaf.grad))
    (out, grad), (rounded, rounded_grad) = results
    if backend == "torch":
        assert torch.equal(out.loss, rounded.loss) and torch.equal(grad, rounded_grad)
    ref_logits = inputs.logits.double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, config=config, backend="reference",
                               head_dtype="bfloat16", **taught.kwargs())
    (1.3 * ref.loss).backward()
    tol = tolerance(torch.float32, backend)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", grad, ref_logits.grad, tol["grad"])
    assert abs(out.metrics["distill_mean"] - ref.metrics["distill_mean"]) <= 1e-5 * max(1, ref.metrics["distill_mean"])
    with torch.no_grad():
        plain = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=config, backend=backend,
                                 **taught.kwargs())
    assert plain.metrics["distill_mean"] != out.metrics["distill_mean"]  # the term reads the rounded logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta,inplace", [("forward_kl", 0.5, False), ("reverse_kl", 0.5, True),
                                               ("jsd", 0.3, False)], ids=["fwd", "rev_inplace", "jsd"])
def test_with_kept_sets(backend, kind, beta, inplace):
    """kept= with a term: both models renormalised over each row's kept set (the teacher's other columns never
    read: NaN there changes nothing), the term's gradient exactly 0 off the set and added to the policy's at the kept
    columns before the one rounding; per-token temperatures too. Against the float64 reference."""
    from test_kept import _kept_sets

    inputs = make_inputs("packed", dtype=torch.float32, vocab=90, seed=27)
    taught = _Taught(inputs)
    kept = _kept_sets(inputs.tokens, 90, 12, seed=28)
    outside = torch.ones(kept.shape[0], 90, dtype=torch.bool).scatter_(1, kept.clamp(min=0), kept < 0)
    outside.scatter_(1, kept.clamp(min=0), False)
    taught.teacher = taught.teacher.masked_fill(outside, float("nan"))  # read by nothing
    tau = 0.6 + torch.rand(kept.shape[0], generator=torch.Generator().manual_seed(29), dtype=torch.float64)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, entropy_coef=0.01))
    ref_logits = inputs.logits.double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, config=config, kept=kept, temperature=tau,
                               backend="reference", **taught.kwargs())
    (1.7 * ref.loss).backward()
    leaf = inputs.logits.clone().requires_grad_()
    out = fused_is.policy_loss(leaf * 1 if inplace else leaf, inputs.tokens, inputs.advantages, config=config,
                               kept=kept, temperature=tau.float(), backend=backend, inplace=inplace, **taught.kwargs())
    (1.7 * out.loss).backward()
    tol = tolerance(torch.float32, backend)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", leaf.grad, ref_logits.grad, tol["grad"])
    assert abs(out.metrics["distill_mean"] - ref.metrics["distill_mean"]) <= 1e-5 * max(1, ref.metrics["distill_mean"])
    assert torch.equal(leaf.grad[outside], torch.zeros(int(outside.sum())))
    assert math.isfinite(out.metrics["distill_mean"]) and out.metrics["distill_mean"] > 0


def test_kept_set_errors_name_a_kept_column():
    """With kept=, only the kept columns are read: NaN elsewhere in the teacher's row is not named; an infinite
    divergence over the kept set, or NaN inside it, is (the row, and the column of its kept set)."""
    from test_kept import _kept_sets

    inputs = make_inputs("packed", dtype=torch.float32, vocab=90, seed=31)
    kept = _kept_sets(inputs.tokens, 90, 12, seed=32)
    row = next(r for r in inputs.mask.nonzero()[:, 0].tolist() if int((kept[r] >= 0).sum()) > 1)
    ids = [i for i in kept[row].tolist() if i >= 0]
    teacher = _Taught(inputs).teacher.clone()
    teacher[row] = torch.where(torch.isin(torch.arange(90), torch.tensor(ids)), teacher[row], float("nan"))
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl"))
    infinite = teacher.clone()  # the teacher gives a kept token probability 0 where the student does not
    infinite[row, ids[0]] = float("-inf")
    with pytest.raises(ValueError, match=f"reverse KL is infinite at row {row}"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=config, kept=kept,
                             backend="torch", **inputs.kwargs(teacher_logits=infinite))
    inside = teacher.clone()
    inside[row, ids[-1]] = float("nan")
    with pytest.raises(ValueError, match=f"teacher_logits hold NaN at row {row}, column {ids[-1]} \\(in its kept set"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=config, kept=kept,
                             backend="torch", **inputs.kwargs(teacher_logits=inside))

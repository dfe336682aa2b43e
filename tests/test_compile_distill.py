"""torch.compile(fullgraph=True) of functions that call fused_is.distill_loss, and policy_loss with its distillation
term: traced around the distillation ops of fused_is/ops.py (distill_stats, distill_checked, distill_gradient,
distill_jsd_given), which run the sweeps of fused_is/distill.py at run time.

Compiled against eager on the same inputs: loss, per-token divergence, metrics and gradient (the same sweeps run in
both, so the tolerances are tight). Every kind on backend="torch" (masks bool and 0/1, padded and packed, top_k),
JSD on the kernel backends this machine runs (cpu when built, triton under the interpreter), no recompilation for new
values of the same shapes, bad rows and bad arguments raised at run time, refusals by name.
"""

import pytest
import torch

import fused_is
from fused_is import backends, distributed

from cases import make_inputs
from test_distill import make_pair

KERNEL_BACKENDS = [b for b in ("cpu", "triton") if backends.unavailable_reason(b, torch.empty(1, 1)) is None]
VOCAB = 90


def _pair(layout: str, seed: int):
    """(student fp32, teacher bf16, mask, cu_seqlens) of test_distill's make_pair: the teacher = student + noise,
    padded with a fully masked sequence, packed with an empty one."""
    return make_pair(layout, torch.float32, torch.bfloat16, VOCAB, seed)


def _loss_fn(**options):
    def fn(logits, teacher, mask, cu_seqlens):
        loss, per_token, metrics = fused_is.distill_loss(logits, teacher, mask=mask, cu_seqlens=cu_seqlens, **options)
        return loss, per_token, metrics["divergence_mean"], metrics["divergence_max"]
    return fn


def _run(fn, logits, *rest):
    leaf = logits.detach().clone().requires_grad_()
    loss, per_token, mean, top = fn(leaf, *rest)
    (loss * 1.7).backward()
    # eager metrics are floats, compiled ones 0-d tensors
    return loss.detach(), per_token, *(torch.tensor(float(m), dtype=torch.float64) for m in (mean, top)), leaf.grad


def _compare(fn, compiled, *inputs):
    """The compiled function's outputs and gradient against the eager function's."""
    eager, got = _run(fn, *inputs), _run(compiled, *inputs)
    for name, a, b in zip(("loss", "per_token", "divergence_mean", "divergence_max", "grad"), got, eager):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)
    assert eager[4].abs().sum() > 0


CASES = [  # (kind, beta, layout, mask dtype, top_k): each kind, both layouts, bool and 0/1 masks, the top-k buckets
    ("forward_kl", 0.5, "padded", torch.bool, 0),
    ("reverse_kl", 0.5, "packed", torch.float32, 0),
    ("jsd", 0.3, "padded", torch.int64, 0),
    ("jsd", 0.3, "packed", torch.bool, 4),
]


@pytest.mark.parametrize("kind,beta,layout,mask_dtype,top_k", CASES,
                         ids=[f"{c[0]}-{c[2]}" + (f"-top{c[4]}" if c[4] else "") for c in CASES])
def test_torch_backend_fullgraph_equals_eager(kind, beta, layout, mask_dtype, top_k):
    torch._dynamo.reset()
    logits, teacher, mask, cu_seqlens = _pair(layout, seed=len(kind) + top_k)
    fn = _loss_fn(kind=kind, beta=beta, temperature=0.8, teacher_temperature=1.3, top_k=top_k, backend="torch",
                  loss_agg="seq-mean-token-mean")
    _compare(fn, torch.compile(fn, fullgraph=True, backend="aot_eager"), logits, teacher, mask.to(mask_dtype),
             cu_seqlens)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_backends_fullgraph_equal_eager(backend):
    """JSD (the kernels' second sweep for D_t and K_t), packed rows, both temperatures."""
    torch._dynamo.reset()
    logits, teacher, mask, cu_seqlens = _pair("packed", seed=3)
    fn = _loss_fn(kind="jsd", beta=0.3, temperature=0.7, teacher_temperature=1.2, backend=backend)
    _compare(fn, torch.compile(fn, fullgraph=True, backend="aot_eager"), logits, teacher, mask, cu_seqlens)


def test_no_recompilation_and_run_time_checks():
    """backend='auto' under inductor: new values of the same shapes reuse the graph; a NaN in either model at an
    unmasked row is the eager ValueError naming that row (the same check, run inside the graph), a mask of other
    values than 0 and 1 the argument's ValueError; a NaN at a masked row is fine."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    fn = _loss_fn(kind="reverse_kl", temperature=0.9)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    logits, teacher, mask, _ = _pair("padded", seed=5)
    mask = mask.float()
    _compare(fn, compiled, logits, teacher, mask, None)
    other, other_teacher, _, _ = _pair("padded", seed=6)
    _compare(fn, compiled, other, other_teacher, mask, None)
    assert counter.frame_count == 1
    row = int(mask.reshape(-1).nonzero()[2, 0])  # flat row; padded position (row // 5, row % 5)
    nan_teacher = teacher.clone()
    nan_teacher.view(-1, VOCAB)[row, 7] = float("nan")
    with pytest.raises(ValueError, match=rf"teacher_logits hold NaN at row {row} \(teacher_logits\[{row // 5}, "
                                         rf"{row % 5}\]\), column 7"):
        compiled(logits.clone().requires_grad_(), nan_teacher, mask, None)
    inf_student = logits.clone()
    inf_student.view(-1, VOCAB)[row, 3] = float("inf")
    with pytest.raises(ValueError, match=rf"logits hold \+inf at row {row} "):
        compiled(inf_student.requires_grad_(), teacher, mask, None)
    masked = int((mask.reshape(-1) == 0).nonzero()[0, 0])
    nan_teacher = teacher.clone()
    nan_teacher.view(-1, VOCAB)[masked, 7] = float("nan")
    compiled(logits.clone().requires_grad_(), nan_teacher, mask, None)
    bad_mask = mask.clone()
    bad_mask[0, 0] = 2.0
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        compiled(logits.clone().requires_grad_(), teacher, bad_mask, None)
    assert counter.frame_count == 1


def test_refused_under_compile():
    logits, teacher, mask, _ = _pair("padded", seed=7)
    for options, match in ((dict(inplace=True), "inplace=True with torch.compile is not supported"),
                           (dict(backend="reference"), "backend='reference' with torch.compile is not supported")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(lambda z: fused_is.distill_loss(z, teacher, **options)[0], fullgraph=True,
                          backend="aot_eager")(logits.clone().requires_grad_())


@pytest.mark.parametrize("backend", ["torch"] + [b for b in KERNEL_BACKENDS if b == "triton"])
def test_vocab_shard_path_fullgraph(backend, monkeypatch):
    """vocab_group's path (the shard's statistics, their merge, JSD's sums given the merged rows: distill_jsd_given)
    traced, in this process: a group of one rank whose collectives are replaced by their result, as
    tests/test_distill_distributed.py's in-process test does; the processes' own run is that module's."""
    monkeypatch.setattr(distributed, "gather_ranks", lambda tensor, group: tensor.unsqueeze(0))
    monkeypatch.setattr(distributed, "check_group", lambda group: group)
    monkeypatch.setattr(distributed, "shard_range", lambda v, group, device, host=True: (0, v))
    torch._dynamo.reset()
    logits, teacher, mask, cu_seqlens = _pair("packed", seed=8)
    fn = _loss_fn(kind="jsd", beta=0.3, temperature=0.8, backend=backend, vocab_group="group")
    _compare(fn, torch.compile(fn, fullgraph=True, backend="aot_eager"), logits, teacher, mask, cu_seqlens)


def test_policy_loss_distillation_term_fullgraph():
    """policy_loss(..., teacher_logits=) with LossConfig.distill_kind: the term's sweeps through the same ops, its
    gradient added to the policy kernel's inside the graph."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=21, vocab=300)
    gen = torch.Generator().manual_seed(9)
    teacher = (inputs.logits + torch.randn(inputs.logits.shape, generator=gen)).to(torch.bfloat16)
    config = fused_is.LossConfig.preset("ppo_tis", distill_kind="jsd", distill_beta=0.3, distill_coef=0.5)
    backend = (KERNEL_BACKENDS + ["torch"])[0]

    def fn(logits, teacher, mask, _):
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, sampler_logprobs=inputs.sampler_logprobs,
                                   old_logprobs=inputs.old_logprobs, mask=mask, config=config, backend=backend,
                                   teacher_logits=teacher)
        return out.loss, out.logprobs, out.metrics["distill_mean"], out.metrics["entropy_mean"]

    _compare(fn, torch.compile(fn, fullgraph=True, backend="aot_eager"), inputs.logits, teacher, inputs.mask, None)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_fullgraph_on_gpu(backend, gpu_device):
    """bf16 logits on the GPU kernels, compiled with inductor (the CPU dry run: aot_eager, the interpreter, where the
    cuda backend skips): forward KL and JSD, each compiled once."""
    probe = torch.empty(1, 1, device=gpu_device)
    reason = backends.unavailable_reason(backend, probe)
    if reason is not None:
        pytest.skip(reason)
    compiler = "inductor" if gpu_device == "cuda" else "aot_eager"
    logits, teacher, mask, cu_seqlens = _pair("packed", seed=10)
    inputs = (logits.to(gpu_device, torch.bfloat16), teacher.to(gpu_device), mask.to(gpu_device),
              cu_seqlens.to(gpu_device))
    for kind in ("forward_kl", "jsd"):
        torch._dynamo.reset()
        fn = _loss_fn(kind=kind, beta=0.3, temperature=0.8, backend=backend)
        eager, got = _run(fn, *inputs), _run(torch.compile(fn, fullgraph=True, backend=compiler), *inputs)
        # the same kernels; inductor's O(N) aggregation may round differently, and a bf16 gradient by one ulp
        for name, a, b in zip(("loss", "per_token", "divergence_mean", "divergence_max", "grad"), got, eager):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if name == "grad" else 1e-5, atol=1e-6,
                                       msg=f"{kind} {name}")

"""Vocabulary-parallel distillation on torch.distributed with the gloo backend, 2 processes on this CPU, uneven shards
(V = 250 as 180 + 70 columns in rank order, both models split alike): fused_is.distill_loss(..., vocab_group=)
and policy_loss(..., teacher_logits=, vocab_group=). Every rank's loss, per-token divergence and metrics equal the
single-process call's on the whole vocabulary and the float64 oracle's (fused_is.reference), and each other's bit for
bit; its gradient equals their gradient's columns of its shard. Every kind (JSD at beta 0, 0.3, 1), every backend
with the sharded plan (torch, cpu, and triton under the interpreter), temperatures on both sides, masks, padded and packed rows, every loss_agg,
inplace=True, bf16 / fp16 logits; rows whose whole shard is -inf; bad rows raised on every rank; refusals by name.

The processes are started once for the module and run every case; a failure in any rank fails the test with that
rank's traceback. test_sharded_path_in_process runs the same path in this process (the collectives of a
one-rank group replaced by their result), so that the Triton launches of the shard path are recorded for the GPU
build check.
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_is
from fused_is import distributed, plan
from fused_is.reference import distill_reference
from fused_is.testing import logprob_scale

from cases import assert_close, config_for, make_inputs, rel_err, tolerance

SIZES = [180, 70]  # the vocabulary shards in rank order: uneven
GRAD_SCALE = 1.7  # a non-unit upstream gradient
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"]
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0)]


def _pair(layout: str, dtype=torch.float32, teacher_dtype=torch.bfloat16, seed: int = 0):
    """(student, teacher, mask, cu_seqlens) over the whole vocabulary: the teacher = student + noise (a distilled
    pair), a fully masked sequence (padded) or an empty one (packed)."""
    gen = torch.Generator().manual_seed(seed)
    shape, cu_seqlens = ((3, 4), None) if layout == "padded" else ((11,), torch.tensor([0, 4, 4, 8, 11]))
    vocab = sum(SIZES)
    student = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 2
    teacher = student + torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 1.5
    mask = torch.rand(shape, generator=gen) > 0.25
    if layout == "padded":
        mask[1] = False
    return student.to(dtype), teacher.to(teacher_dtype), mask, cu_seqlens


def _shard(x: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SIZES[:rank])
    return x[..., start:start + SIZES[rank]]


def _run(logits, teacher, **kwargs):
    """(loss, per_token, metrics, d (1.7 loss) / d logits) of distill_loss on a fresh leaf."""
    leaf = logits.detach().clone().requires_grad_()
    loss, per_token, metrics = fused_is.distill_loss(leaf, teacher, **kwargs)
    (loss * GRAD_SCALE).backward()
    return loss, per_token, metrics, leaf.grad


def _oracle(logits, teacher, **kwargs):
    leaf = logits.detach().double().requires_grad_()
    loss, per_token, metrics = distill_reference(leaf, teacher.double(), **kwargs)
    (loss * GRAD_SCALE).backward()
    return loss, per_token, {k: float(v) for k, v in metrics.items()}, leaf.grad


def _same_on_every_rank(name: str, x: torch.Tensor) -> None:
    x = x.detach().contiguous()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for other in gathered:  # bit for bit
        assert torch.equal(other.view(bits), x.view(bits)), f"{name} differs between ranks"


def _check(rank: int, tag: str, logits, teacher, backend: str, inplace: bool = False, **kwargs):
    """This rank's shard against the single-process call (same backend, within twice the tolerance: each is within
    it of the oracle) and the float64 oracle; the values the same on every rank."""
    tol = tolerance(logits.dtype, backend)
    whole = _run(logits, teacher, backend=backend, **kwargs)
    ref = _oracle(logits, teacher, **kwargs)
    leaf = _shard(logits, rank).clone().requires_grad_()
    loss, per_token, metrics = fused_is.distill_loss(leaf, _shard(teacher, rank), backend=backend, inplace=inplace,
                                                     vocab_group=dist.group.WORLD, **kwargs)
    (loss * GRAD_SCALE).backward()
    if inplace:
        assert leaf.grad.data_ptr() == leaf.data_ptr(), tag  # the gradient written over the shard
    assert loss.dtype == whole[0].dtype and per_token.shape == logits.shape[:-1], tag
    assert leaf.grad.dtype == logits.dtype and leaf.grad.shape == leaf.shape, tag
    for against, factor in ((whole, 2), (ref, 1)):
        assert_close(f"{tag}: loss", loss, against[0], factor * tol["loss"])
        assert_close(f"{tag}: per_token", per_token, against[1], factor * tol["loss"])
        assert_close(f"{tag}: grad", leaf.grad, _shard(against[3], rank), factor * tol["grad"],
                     scale=against[3].abs().max())
        assert set(metrics) == set(against[2]), tag
        for key, value in against[2].items():
            assert abs(metrics[key] - value) <= 10 * factor * tol["loss"] * max(1.0, abs(value)), (tag, key)
    _same_on_every_rank(f"loss ({tag})", loss.reshape(1))
    _same_on_every_rank(f"per_token ({tag})", per_token)
    _same_on_every_rank(f"metrics ({tag})", torch.tensor([metrics[k] for k in sorted(metrics)], dtype=torch.float64))


def _kind_cases(rank: int) -> None:
    """Every kind on backend="torch" (JSD at beta 0 and 1: TRL's special cases, the KLs' paths), the three divergences
    on "triton" and on "cpu" (the C++ kernels on the shard, given the merged statistics); padded and packed in turn,
    every loss_agg in turn, both temperatures set."""
    cases = [("torch", kind, beta) for kind, beta in KINDS] + [("triton", kind, beta) for kind, beta in KINDS[:3]]
    if fused_is.backends.unavailable_reason("cpu") is None:
        cases += [("cpu", kind, beta) for kind, beta in KINDS[:3]]
    for i, (backend, kind, beta) in enumerate(cases):
        agg = AGGS[i % len(AGGS)]
        # seq-mean-token-sum-norm divides by the padded length T: padded only
        layout = "padded" if i % 2 == 0 or agg == "seq-mean-token-sum-norm" else "packed"
        logits, teacher, mask, cu_seqlens = _pair(layout, seed=i)
        _check(rank, f"{backend} {kind} beta={beta} {layout} {agg}", logits, teacher, backend, kind=kind, beta=beta,
               temperature=0.7, teacher_temperature=1.3, mask=mask, cu_seqlens=cu_seqlens, loss_agg=agg)


def _option_cases(rank: int) -> None:
    """inplace=True (the gradient over the shard, in backward), bf16 / fp16 logits, no mask; rows whose last shard is
    all -inf in both models (it adds nothing) and rows where the student's first shard is all -inf while the teacher's
    is not (p = 0 there: the reverse KL is finite); no gradient wanted."""
    logits, teacher, mask, _ = _pair("padded", seed=11)
    for backend, kind in (("torch", "reverse_kl"), ("triton", "jsd"), ("cpu", "forward_kl")):
        _check(rank, f"{backend} {kind} inplace", logits, teacher, backend, inplace=True, kind=kind, mask=mask,
               temperature=0.9)
    for backend, dtype, teacher_dtype in (("torch", torch.bfloat16, torch.float32),
                                          ("triton", torch.float16, torch.bfloat16)):
        low, low_teacher, mask, _ = _pair("padded", dtype, teacher_dtype, seed=12)
        _check(rank, f"{backend} {dtype} jsd", low, low_teacher, backend, kind="jsd", beta=0.7, mask=mask)
    empty, empty_teacher = logits.clone(), teacher.clone()
    empty[0, :3, SIZES[0]:] = empty_teacher[0, :3, SIZES[0]:] = -math.inf  # rows 0-2: nothing in the last shard
    empty[2, :2, :SIZES[0]] = -math.inf  # rows 8, 9: the student has nothing in the first shard, the teacher has
    for backend, kinds in (("torch", ("forward_kl", "jsd")), ("triton", ("jsd",)), ("cpu", ("forward_kl",))):
        _check(rank, f"{backend} reverse_kl empty shard rows", empty, empty_teacher, backend, kind="reverse_kl")
        for kind in kinds:  # infinite at rows 8, 9 (forward KL, JSD at beta 0): the first two sequences
            _check(rank, f"{backend} {kind} empty shard rows", empty[:2], empty_teacher[:2], backend, kind=kind)
    with torch.no_grad():
        loss, _, _ = fused_is.distill_loss(_shard(logits, rank), _shard(teacher, rank), kind="jsd", mask=mask,
                                           vocab_group=dist.group.WORLD)
    # "auto" on sharded CPU tensors is the CPU kernels' sharded plan, as one process's is the CPU kernel's
    whole = fused_is.distill_loss(logits, teacher, kind="jsd", mask=mask, backend="cpu")[0]
    assert abs(loss.item() - whole.item()) <= 2 * tolerance(torch.float32, "cpu")["loss"] * max(1.0, abs(whole.item()))


def _error_cases(rank: int) -> None:
    """Bad rows raise on every rank (no rank left waiting); the rank holding the value names it; refusals."""
    logits, teacher, mask, _ = _pair("padded", seed=13)
    mask[0, 2] = True
    for backend in ("torch", "triton", "cpu"):
        bad = teacher.clone()
        bad[0, 2, SIZES[0] + 7] = math.nan  # row 2, rank 1's column 7
        with pytest.raises(ValueError, match="row 2") as err:
            fused_is.distill_loss(_shard(logits, rank), _shard(bad, rank), mask=mask, backend=backend,
                                  vocab_group=dist.group.WORLD)
        if rank == 1:
            assert f"column 7 of this rank's vocabulary shard (global id {SIZES[0] + 7})" in str(err.value)
        else:
            assert "another rank's shard" in str(err.value)
        infinite = logits.clone()
        infinite[0, 2, SIZES[0]:SIZES[0] + SIZES[1]] = -math.inf  # the teacher has mass where the student has none
        with pytest.raises(ValueError, match="forward KL is infinite at row 2"):
            fused_is.distill_loss(_shard(infinite, rank), _shard(teacher, rank), mask=mask, backend=backend,
                                  vocab_group=dist.group.WORLD)
    garbage = logits.clone()  # NaN at a masked row: ignored
    garbage[1, 3, ::3] = math.nan
    _check(rank, "masked NaN", garbage, teacher, "torch", kind="jsd", mask=mask)
    with pytest.raises(ValueError, match=r"top_k=5\) with vocab_group is not supported"):
        fused_is.distill_loss(_shard(logits, rank), _shard(teacher, rank), top_k=5, vocab_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="backend='reference' with vocab_group is not supported"):
        fused_is.distill_loss(_shard(logits, rank), _shard(teacher, rank), backend="reference",
                              vocab_group=dist.group.WORLD)


BLOCK_ELEMENTS = plan.ROUNDED_BLOCK_ELEMENTS


def _policy_cases(rank: int) -> None:
    """policy_loss with the distillation term (LossConfig.distill_kind, teacher_logits=) on a vocabulary shard of both
    models against the single-process call: loss, logprobs, metrics (distill_mean included) and the shard's gradient.
    The term runs distill_loss's sharded sweeps on the policy's backend (cpu, triton; torch otherwise: the policy's
    own vocabulary-parallel kernels are tests/test_distributed.py's); with inplace=True both gradients are written over the shard in backward,
    block by block (backends.DeferredGradient)."""
    inputs = make_inputs("padded", vocab=sum(SIZES), seed=14)
    gen = torch.Generator().manual_seed(15)
    teacher = (inputs.logits.double() + torch.randn(inputs.logits.shape, generator=gen,
                                                    dtype=torch.float64)).to(torch.bfloat16)
    cases = [("torch", "forward_kl", 0.5, "token-mean", False), ("cpu", "jsd", 0.3, "seq-mean-token-mean", True),
             ("torch", "reverse_kl", 0.5, "seq-mean-token-sum", True), ("triton", "forward_kl", 0.5, "token-mean", False),
             ("cpu", "reverse_kl", 0.5, "token-mean", False)]
    for backend, kind, beta, agg, inplace in cases:
        if fused_is.backends.unavailable_reason(backend, inputs.logits) is not None:
            continue
        tag = f"policy {backend} {kind}"
        config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5, loss_agg=agg,
                                            temperature=0.8))
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=config, backend=backend,
                                   teacher_logits=teacher, **inputs.kwargs())
        (ref.loss * GRAD_SCALE).backward()
        mine = _shard(inputs.logits, rank).clone().requires_grad_()
        plan.ROUNDED_BLOCK_ELEMENTS = 1 if inplace else BLOCK_ELEMENTS  # in place: blocks of one row
        out = fused_is.policy_loss(mine.clone() if inplace else mine, inputs.tokens, inputs.advantages, config=config,
                                   backend=backend, teacher_logits=_shard(teacher, rank), vocab_group=dist.group.WORLD,
                                   inplace=inplace, **inputs.kwargs())
        (out.loss * GRAD_SCALE).backward()
        tol = {k: 2 * v for k, v in tolerance(torch.float32, backend).items()}
        valid = inputs.mask
        assert rel_err(out.loss, ref.loss, max(1.0, abs(ref.loss.item()))) <= tol["loss"], tag
        assert rel_err(out.logprobs[valid], ref.logprobs[valid], logprob_scale(ref.logprobs[valid])) <= tol["logprobs"]
        assert rel_err(mine.grad, _shard(full.grad, rank), full.grad.abs().max()) <= tol["grad"], tag
        assert set(out.metrics) == set(ref.metrics), tag
        for key, value in ref.metrics.items():
            assert abs(out.metrics[key] - value) <= 10 * tol["loss"] * max(1.0, abs(value)) + 1e-9, (tag, key)
        _same_on_every_rank(f"loss ({tag})", out.loss.detach().reshape(1))


def _compile_cases(rank: int) -> None:
    """torch.compile(fullgraph=True) with vocab_group: the shard's sweeps through the distillation ops of
    fused_is/ops.py, the all-gathers traced as functional collectives; loss, metrics and the shard's gradient equal the
    eager call's, and a NaN in one rank's shard is the ValueError naming the row on every rank."""
    import torch._dynamo

    logits, teacher, mask, cu_seqlens = _pair("packed", seed=17)

    def fn(z, u):
        loss, per_token, metrics = fused_is.distill_loss(z, u, kind="jsd", beta=0.3, temperature=0.8, mask=mask,
                                                         cu_seqlens=cu_seqlens, backend="torch",
                                                         vocab_group=dist.group.WORLD)
        return loss, per_token, metrics["divergence_max"]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        leaf = _shard(logits, rank).clone().requires_grad_()
        loss, per_token, top = f(leaf, _shard(teacher, rank))
        (loss * GRAD_SCALE).backward()
        results.append((loss.detach(), per_token, float(top), leaf.grad))
    (loss_e, per_token_e, top_e, grad_e), (loss_c, per_token_c, top_c, grad_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(per_token_c, per_token_e, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-6, atol=1e-8)
    assert abs(top_c - top_e) <= 1e-9 * max(1.0, top_e)
    row = int(mask.nonzero()[0, 0])
    bad = teacher.clone()
    bad[row, SIZES[0] + 7] = math.nan  # rank 1's column 7
    with pytest.raises(ValueError, match=f"row {row}") as err:
        compiled(_shard(logits, rank).clone().requires_grad_(), _shard(bad, rank))
    if rank == 1:
        assert f"column 7 of this rank's vocabulary shard (global id {SIZES[0] + 7})" in str(err.value)
    # policy_loss's distillation term on the shards, compiled
    inputs = make_inputs("padded", vocab=sum(SIZES), seed=18)
    teacher = (inputs.logits + 1.5 * torch.randn(inputs.logits.shape, generator=torch.Generator().manual_seed(19))
               ).to(torch.bfloat16)
    config = config_for("ppo_tis", dict(distill_kind="reverse_kl", distill_coef=0.5))

    def policy(z, u):
        out = fused_is.policy_loss(z, inputs.tokens, inputs.advantages, config=config, backend="torch",
                                   teacher_logits=u, vocab_group=dist.group.WORLD, **inputs.kwargs())
        return out.loss, out.metrics["distill_mean"]

    torch._dynamo.reset()
    results = []
    for f in (policy, torch.compile(policy, fullgraph=True, backend="aot_eager")):
        leaf = _shard(inputs.logits, rank).clone().requires_grad_()
        loss, distill_mean = f(leaf, _shard(teacher, rank))
        (loss * GRAD_SCALE).backward()
        results.append((loss.detach(), float(distill_mean), leaf.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-6, atol=1e-8)
    assert abs(results[1][1] - results[0][1]) <= 1e-9 * max(1.0, results[0][1])


def _nemo_cases(rank: int) -> None:
    """fused_is.integrations.nemo_rl's FusedDistillationLossFn with vocab_group (Megatron's tensor-parallel shards,
    which NeMo-RL hands a LOGIT loss function): every kind, renormalised over the top k and zero_outside_topk,
    against the single-process call on the whole vocabulary (itself checked against NeMo-RL's arithmetic in
    tests/test_integration_nemo_rl.py): the loss on every rank, the shard's gradient. The teacher's ids fall in
    either shard, some rows' all in one, one id repeated."""
    from fused_is.integrations.nemo_rl import FusedDistillationLossFn

    gen = torch.Generator().manual_seed(31)
    batch, seq, vocab, k = 3, 7, sum(SIZES), 6
    logits = (2 * torch.randn(batch, seq + 1, vocab, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    top = (logits[:, :seq].double() + torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)).topk(k)
    ids = top.indices.clone()
    ids[0, 2] = torch.arange(k) + SIZES[0]  # every id in rank 1's shard
    ids[1, 3, 1] = ids[1, 3, 0]
    token_mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    data = dict(input_ids=torch.randint(0, vocab, (batch, seq), generator=gen), teacher_topk_logits=top.values.float(),
                teacher_topk_indices=ids, token_mask=token_mask, sample_mask=torch.tensor([1.0, 1.0, 0.0]))
    for i, (kind, zero) in enumerate([(kind, zero) for kind in ("forward", "reverse", "mixed") for zero in (0, 1)]):
        backend = ("torch", "cpu")[i % 2] if fused_is.backends.unavailable_reason("cpu") is None else "torch"
        loss_fn = FusedDistillationLossFn(dict(kl_type=kind, zero_outside_topk=bool(zero), mixed_kl_weight=0.3),
                                          backend=backend)
        tag = f"nemo {kind} zero_outside_topk={zero} {backend}"
        full = logits.clone().requires_grad_()
        expected, _ = loss_fn(full, data, global_valid_toks=20.0)
        (expected * GRAD_SCALE).backward()
        shard_fn = FusedDistillationLossFn(loss_fn.cfg, backend=backend, vocab_group=dist.group.WORLD)
        mine = _shard(logits, rank).clone().requires_grad_()
        loss, metrics = shard_fn(mine, data, global_valid_toks=20.0)
        (loss * GRAD_SCALE).backward()
        assert abs(float(loss) - float(expected)) <= 1e-5 * max(1.0, abs(float(expected))), (tag, loss, expected)
        assert rel_err(mine.grad, _shard(full.grad, rank), full.grad.abs().max()) <= 1e-2, tag
        assert metrics["loss"] == pytest.approx(float(loss))
        _same_on_every_rank(f"loss ({tag})", loss.detach().reshape(1))


def _worker(rank: int, world: int, port: int):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        _kind_cases(rank)
        _option_cases(rank)
        _error_cases(rank)
        _policy_cases(rank)
        _nemo_cases(rank)
        _compile_cases(rank)
        dist.barrier()  # every rank done with every collective before any tears its process group down
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_distillation_equals_single_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(len(SIZES), port), nprocs=len(SIZES), join=True)


@pytest.mark.parametrize("kind,beta", [("jsd", 0.3), ("forward_kl", 0.5)])
def test_sharded_path_in_process(kind, beta, monkeypatch):
    """The whole shard path of backend="triton" in this process, a group of one rank (its collectives replaced by
    their result): the single-process values, and the shard kernels' launches recorded for the GPU build check. Blocks
    of 128 lanes: several per row and a tail (V = 250)."""
    monkeypatch.setenv("FUSED_IS_TRITON_BLOCK", "128")
    monkeypatch.setattr(distributed, "gather_ranks", lambda tensor, group: tensor.unsqueeze(0))
    monkeypatch.setattr(distributed, "check_group", lambda group: group)
    monkeypatch.setattr(distributed, "shard_range", lambda v, group, device, host=True: (0, v))
    logits, teacher, mask, cu_seqlens = _pair("packed", seed=16)
    kwargs = dict(kind=kind, beta=beta, temperature=0.8, mask=mask, cu_seqlens=cu_seqlens, backend="triton")
    whole = _run(logits, teacher, **kwargs)
    mine = _run(logits, teacher, vocab_group="group", **kwargs)
    tol = tolerance(logits.dtype, "triton")
    assert_close("loss", mine[0], whole[0], tol["loss"])
    assert_close("per_token", mine[1], whole[1], tol["loss"])
    assert_close("grad", mine[3], whole[3], tol["grad"])
    assert mine[2] == pytest.approx(whole[2], rel=tol["loss"])

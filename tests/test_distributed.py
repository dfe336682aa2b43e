"""Vocabulary-parallel policy_loss / token_logprobs (vocab_group=) on torch.distributed with the gloo backend,
2 and 4 processes on this CPU: every rank's loss, logprobs, entropy and metrics equal the single-process run's
on the whole vocabulary (and each other's, bit for bit), and its gradient equals that run's gradient on its
shard; uneven shards, a shard with no sampled token, a shard whose logits are all -inf for some rows.

The processes are started once per world size (torch.multiprocessing spawn) and run every case; a failure in
any rank fails the test with that rank's traceback. Each preset runs on one backend per layout, rotating, so that
every preset meets every backend; 4 ranks repeat the packed layout and every other context-parallel case (the
2-rank run has them all) and add the 2 x 2 grid."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_is
from cases import (OPTION_CASES, PRESET_NAMES, config_for, logprob_scale, make_inputs, make_linear_inputs, rel_err,
                   tolerance)

BACKENDS = [b for b in ("torch", "cpu", "triton") if fused_is.backends.unavailable_reason(b, torch.empty(1, 2)) is None]
SHARDS = {2: [600, 400], 4: [300, 100, 350, 250]}  # uneven, in rank order; V = 1000


def _tol(backend: str) -> dict:
    """Both runs are within tolerance(fp32, backend) of the float64 reference: their difference within twice it."""
    return {k: 2 * v for k, v in tolerance(torch.float32, backend).items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(x: torch.Tensor, rank: int, sizes) -> torch.Tensor:
    start = sum(sizes[:rank])
    return x[..., start:start + sizes[rank]]


def _same_on_every_rank(name: str, x: torch.Tensor) -> None:
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.contiguous())
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for other in gathered:  # bit for bit (NaN at masked positions included)
        assert torch.equal(other.view(bits), x.contiguous().view(bits)), f"{name} differs between ranks"


def _assert_like_single_process(tag, backend, out, ref, grad, expected_grad, full_grad, local_logprobs, valid,
                                whole_valid):
    """A rank's output against the single-process run on the whole rows and sequences: the loss and the metrics
    (the same on every rank), its rows' logprobs (local_logprobs: the reference's at this rank's positions; valid:
    this rank's mask, whole_valid: the whole mask) and its block of the gradient (expected_grad, of full_grad)."""
    TOL = _tol(backend)
    assert rel_err(out.loss, ref.loss, max(1.0, abs(ref.loss.item()))) <= TOL["loss"], (tag, out.loss, ref.loss)
    assert rel_err(out.logprobs[valid], local_logprobs[valid],
                   logprob_scale(ref.logprobs[whole_valid])) <= TOL["logprobs"], tag
    assert rel_err(grad, expected_grad, full_grad.abs().max()) <= TOL["grad"], tag
    assert set(out.metrics) == set(ref.metrics), tag
    for key, value in ref.metrics.items():
        assert abs(out.metrics[key] - value) <= 10 * TOL["loss"] * max(1.0, abs(value)) + 1e-9, (tag, key,
                                                                                               out.metrics[key], value)
    _same_on_every_rank(f"loss ({tag})", out.loss.detach().reshape(1))


def _check_case(rank, sizes, inputs, config, backend, with_old, tag, **extra):
    kwargs = inputs.kwargs(with_old=with_old, **extra)
    full = inputs.logits.clone().requires_grad_()
    ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=config, backend=backend, **kwargs)
    (ref.loss * 1.7).backward()
    shard = _shard(inputs.logits, rank, sizes).clone().requires_grad_()
    out = fused_is.policy_loss(shard, inputs.tokens, inputs.advantages, config=config, backend=backend,
                               vocab_group=dist.group.WORLD, **kwargs)
    (out.loss * 1.7).backward()
    valid = inputs.mask
    scale = max(1.0, abs(ref.loss.item()))
    TOL = _tol(backend)
    assert rel_err(out.loss, ref.loss, scale) <= TOL["loss"], (tag, out.loss.item(), ref.loss.item())
    # logprob errors relative to max(max |lp|, 1), as everywhere (fused_is.testing.logprob_scale)
    assert rel_err(out.logprobs[valid], ref.logprobs[valid], logprob_scale(ref.logprobs[valid])) <= TOL["logprobs"], tag
    assert rel_err(out.entropy[valid], ref.entropy[valid], logprob_scale(ref.entropy[valid])) <= TOL["logprobs"], tag
    expected = _shard(full.grad, rank, sizes)
    assert rel_err(shard.grad, expected, full.grad.abs().max()) <= TOL["grad"], (tag, rel_err(shard.grad, expected))
    assert set(out.metrics) == set(ref.metrics), tag
    for key, value in ref.metrics.items():
        assert abs(out.metrics[key] - value) <= 10 * TOL["loss"] * max(1.0, abs(value)) + 1e-9, (tag, key, out.metrics[key],
                                                                                               value)
    _same_on_every_rank(f"loss ({tag})", out.loss.detach().reshape(1))
    _same_on_every_rank(f"logprobs ({tag})", out.logprobs)


def _worker(rank: int, world: int, port: int, backends):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        sizes = SHARDS[world]
        # 4 ranks: the packed layout alone (the 2-rank run has both; what 4 adds is more, emptier shards)
        for shift, layout in enumerate(("padded", "packed") if world == 2 else ("packed",)):
            inputs = make_inputs(layout, vocab=sum(sizes), seed=5)
            # each (preset, old) on one backend per layout, the next one in the other layout: every preset meets
            # every backend's sharded plan (the Triton interpreter makes the full product minutes long)
            pairs = [(preset, with_old) for preset in PRESET_NAMES for with_old in (True, False)]
            for i, (preset, with_old) in enumerate(pairs):
                backend = backends[(i + shift) % len(backends)]
                _check_case(rank, sizes, inputs, config_for(preset), backend, with_old,
                            f"{backend} {layout} {preset} old={with_old}")
            for name, preset, overrides in OPTION_CASES:
                backend = backends[1] if len(backends) > 1 else backends[0]
                with_old = not name.startswith("gspo")
                _check_case(rank, sizes, inputs, config_for(preset, overrides), backend, with_old,
                            f"{backend} {layout} {name}")
        _hard_cases(rank, sizes, backends)
        _normalizer_cases(rank, world)
        _linear_cases(rank, sizes, backends)
        _sequence_cases(rank, world, backends)
        _packed_sequence_cases(rank, world, backends)
        _temperature_cases(rank, world, sizes, backends)
        if world == 4:
            _grid_cases(rank, backends)
        _compile_cases(rank, world, sizes, backends)
        dist.barrier()  # every rank done with every collective before any tears its process group down
    finally:
        dist.destroy_process_group()


LINEAR_CONFIGS = [("ppo_tis_kl_entropy", "ppo_tis", dict(kl_coef=0.1, entropy_coef=0.01), True),
                  ("seq_mis_no_old", "seq_mis", None, False),  # the two-pass plan
                  ("gspo", "ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03), True)]


def _linear_cases(rank, sizes, backends):
    """linear_policy_loss with the lm_head split by vocabulary rows (weight and bias shards) against the
    single-process run on the whole head: loss, logprobs, entropy, metrics and d hidden on every rank, each
    rank's d weight / d bias equal to that run's rows of its shard; chunks of 5 rows split the sequences."""
    start = sum(sizes[:rank])
    for layout in ("padded", "packed") if len(sizes) == 2 else ("packed",):  # 4 ranks: packed (as the main loop)
        li = make_linear_inputs(layout, vocab=sum(sizes), seed=8)
        for backend in backends:
            for name, preset, overrides, with_old in LINEAR_CONFIGS:
                tag = f"linear {backend} {layout} {name}"
                cfg = config_for(preset, overrides)
                kwargs = li.inputs.kwargs(with_old=with_old)
                leaves = [x.clone().requires_grad_() for x in (li.hidden, li.weight, li.bias)]
                ref = fused_is.linear_policy_loss(leaves[0], leaves[1], li.inputs.tokens, li.inputs.advantages,
                                                  bias=leaves[2], chunk_size=5, config=cfg, backend=backend, **kwargs)
                (ref.loss * 1.7).backward()
                mine = [li.hidden.clone().requires_grad_(),
                        li.weight[start:start + sizes[rank]].clone().requires_grad_(),
                        li.bias[start:start + sizes[rank]].clone().requires_grad_()]
                out = fused_is.linear_policy_loss(mine[0], mine[1], li.inputs.tokens, li.inputs.advantages,
                                                  bias=mine[2], chunk_size=5, config=cfg, backend=backend,
                                                  vocab_group=dist.group.WORLD, **kwargs)
                (out.loss * 1.7).backward()
                TOL = _tol(backend)
                valid = li.inputs.mask
                assert rel_err(out.loss, ref.loss, max(1.0, abs(ref.loss.item()))) <= TOL["loss"], tag
                assert rel_err(out.logprobs[valid], ref.logprobs[valid],
                               logprob_scale(ref.logprobs[valid])) <= TOL["logprobs"], tag
                assert rel_err(out.entropy[valid], ref.entropy[valid],
                               logprob_scale(ref.entropy[valid])) <= TOL["logprobs"], tag
                for what, got, full in (("hidden", mine[0].grad, leaves[0].grad),
                                        ("weight", mine[1].grad, leaves[1].grad[start:start + sizes[rank]]),
                                        ("bias", mine[2].grad, leaves[2].grad[start:start + sizes[rank]])):
                    assert got.dtype == full.dtype and got.shape == full.shape, (tag, what)
                    scale = (leaves[0].grad if what == "hidden" else leaves[1 if what == "weight" else 2].grad)
                    assert rel_err(got, full, scale.abs().max()) <= TOL["grad"], (tag, what, rel_err(got, full))
                assert set(out.metrics) == set(ref.metrics), tag
                for key, value in ref.metrics.items():
                    assert abs(out.metrics[key] - value) <= 10 * TOL["loss"] * max(1.0, abs(value)) + 1e-9, (tag, key)
                _same_on_every_rank(f"loss ({tag})", out.loss.detach().reshape(1))
                _same_on_every_rank(f"d hidden ({tag})", mine[0].grad)
                if name == "seq_mis_no_old":  # masked_outputs="zero": the shard statistics of unmasked rows alone
                    again = [x.detach().clone().requires_grad_() for x in mine]
                    zero = fused_is.linear_policy_loss(again[0], again[1], li.inputs.tokens, li.inputs.advantages,
                                                       bias=again[2], chunk_size=5, config=cfg, backend=backend,
                                                       vocab_group=dist.group.WORLD, masked_outputs="zero", **kwargs)
                    (zero.loss * 1.7).backward()
                    # the chunks' GEMMs hold other rows than with every row formed: equal to rounding, not bitwise
                    torch.testing.assert_close(zero.loss, out.loss, rtol=1e-6, atol=1e-7, msg=tag)
                    assert torch.count_nonzero(zero.logprobs[~valid]) + torch.count_nonzero(zero.entropy[~valid]) == 0
                    torch.testing.assert_close(zero.logprobs[valid], out.logprobs[valid], rtol=1e-6, atol=1e-6,
                                               msg=tag)
                    for got, want in zip(again, mine):
                        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)
            lp, ent = fused_is.linear_token_logprobs(li.hidden, li.weight[start:start + sizes[rank]], li.inputs.tokens,
                                                     bias=li.bias[start:start + sizes[rank]], chunk_size=5,
                                                     mask=li.inputs.mask, backend=backend, temperature=0.8,
                                                     vocab_group=dist.group.WORLD)
            ref_lp, ref_ent = fused_is.linear_token_logprobs(li.hidden, li.weight, li.inputs.tokens, bias=li.bias,
                                                             chunk_size=5, mask=li.inputs.mask, backend=backend,
                                                             temperature=0.8)
            valid = li.inputs.mask
            assert rel_err(lp[valid], ref_lp[valid], logprob_scale(ref_lp[valid])) <= _tol(backend)["logprobs"]
            assert rel_err(ent[valid], ref_ent[valid], logprob_scale(ref_ent[valid])) <= _tol(backend)["logprobs"]


POSITION_SPLITS = {2: [5, 3], 4: [3, 1, 2, 2]}  # uneven slices of T = 8 positions, in rank order


def _sequence_cases(rank, world, backends):
    """Context parallel (sequence_group=): each rank holds a slice of the positions of the same B sequences.
    Loss and metrics equal the single-process run's on the whole sequences on every rank; logprobs, entropy and
    the gradient equal that run's on the rank's slice. Every preset (with and without old_logprobs) and
    option case: sequence IS, GSPO, GMPO, VESPO, rejection, the off-policy mask and every aggregation."""
    cuts = POSITION_SPLITS[world]
    start, stop = sum(cuts[:rank]), sum(cuts[:rank + 1])
    inputs = make_inputs("padded", vocab=300, seed=6)
    cases = [(p, config_for(p), w) for p in PRESET_NAMES for w in (True, False)]
    cases += [(name, config_for(preset, overrides), not name.startswith("gspo"))
              for name, preset, overrides in OPTION_CASES]
    if world > 2:  # every other case (the 2-rank run has them all; 4 ranks add a one-position slice)
        cases = cases[1::2]
    for i, (name, cfg, with_old) in enumerate(cases):
        backend = backends[i % len(backends)]
        tag = f"sequence_group {backend} {name} old={with_old}"
        kwargs = inputs.kwargs(with_old=with_old)
        cut = lambda x: None if x is None else x[:, start:stop]  # noqa: E731
        if cfg.policy in ("clip_cov", "kl_cov"):  # a selection over the whole batch's tokens: refused on every rank
            with pytest.raises(ValueError, match="with sequence_group \\(context parallel\\) is not supported"):
                fused_is.policy_loss(inputs.logits[:, start:stop], cut(inputs.tokens), cut(inputs.advantages),
                                     config=cfg, sequence_group=dist.group.WORLD,
                                     **{k: cut(v) if k != "cu_seqlens" else v for k, v in kwargs.items()})
            continue
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend, **kwargs)
        (ref.loss * 1.7).backward()
        mine = inputs.logits[:, start:stop].clone().requires_grad_()
        out = fused_is.policy_loss(mine, cut(inputs.tokens), cut(inputs.advantages), config=cfg, backend=backend,
                                   sequence_group=dist.group.WORLD,
                                   **{k: cut(v) if k != "cu_seqlens" else v for k, v in kwargs.items()})
        (out.loss * 1.7).backward()
        _assert_like_single_process(tag, backend, out, ref, mine.grad, full.grad[:, start:stop], full.grad,
                                    cut(ref.logprobs), cut(inputs.mask), inputs.mask)
    _distill_term_sequence_cases(inputs, start, stop, backends)


def _distill_term_sequence_cases(inputs, start, stop, backends):
    """policy_loss with a distillation term (teacher_logits=) under sequence_group: D_t is each position's own, its
    weight the call's aggregation weight over the whole sequences, so the loss, distill_mean and the slice's
    gradient equal the single-process run's; in place too (backends.DeferredGradient)."""
    teacher = (inputs.logits + torch.randn(inputs.logits.shape, generator=torch.Generator().manual_seed(9))
               ).to(torch.bfloat16)
    cut = lambda x: None if x is None else x[:, start:stop]  # noqa: E731
    cases = [("ppo_tis", dict(distill_kind="jsd", distill_beta=0.3, loss_agg="seq-mean-token-mean"), False),
             ("gspo", dict(distill_kind="reverse_kl", loss_agg="seq-mean-token-sum-norm"), True)]
    for i, (preset, overrides, inplace) in enumerate(cases):
        backend = backends[i % len(backends)]
        cfg = config_for(preset, dict(overrides, distill_coef=0.5))
        tag = f"sequence_group {backend} {preset} {overrides['distill_kind']} inplace={inplace}"
        kwargs = inputs.kwargs()
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   teacher_logits=teacher, **kwargs)
        (ref.loss * 1.7).backward()
        mine = inputs.logits[:, start:stop].clone().requires_grad_()
        out = fused_is.policy_loss(mine.clone() if inplace else mine, cut(inputs.tokens), cut(inputs.advantages),
                                   config=cfg, backend=backend, sequence_group=dist.group.WORLD, inplace=inplace,
                                   teacher_logits=cut(teacher),
                                   **{k: cut(v) if k != "cu_seqlens" else v for k, v in kwargs.items()})
        (out.loss * 1.7).backward()
        _assert_like_single_process(tag, backend, out, ref, mine.grad, full.grad[:, start:stop], full.grad,
                                    cut(ref.logprobs), cut(inputs.mask), inputs.mask)


def _packed_sequence_cases(rank, world, backends):
    """Context parallel with packed input: rank r holds the r-th part of every sequence's positions (uneven, and
    empty for the short sequences with 4 ranks), packed with a cu_seqlens of one segment per sequence. Loss,
    metrics, logprobs and the gradient of the rank's rows equal the single-process packed run, for every preset
    and the sequence-level option cases."""
    inputs = make_inputs("packed", vocab=300, seed=8)
    cu = inputs.cu_seqlens.tolist()
    weights = POSITION_SPLITS[world]
    edges = [[a + (b - a) * sum(weights[:r]) // sum(weights) for r in range(world + 1)]
             for a, b in zip(cu[:-1], cu[1:])]  # every rank's part of sequence [a, b): uneven, by the position splits
    assert world < 4 or any(e[r] == e[r + 1] for e in edges for r in range(world)), "some rank with an empty segment"
    pieces = [(e[rank], e[rank + 1]) for e in edges]
    rows = torch.cat([torch.arange(p, q) for p, q in pieces])
    local_cu = torch.tensor([0] + [q - p for p, q in pieces]).cumsum(0)
    with pytest.raises(ValueError, match="with packed \\[N_local, V\\] logits needs cu_seqlens"):
        fused_is.policy_loss(inputs.logits[rows], inputs.tokens[rows], inputs.advantages[rows], config="ppo_tis",
                             sampler_logprobs=inputs.sampler_logprobs[rows], mask=inputs.mask[rows],
                             sequence_group=dist.group.WORLD)
    def sequence_level(cfg):  # what reads the segments (the padded cases above cover the token-local ones)
        return (cfg.is_level in ("sequence", "geometric") or cfg.loss_agg != "token-mean" or cfg.sequence_ratio
                or cfg.policy == "vespo" or cfg.off_policy_mask is not None or cfg.entropy_agg is not None
                or any(c[0].startswith("seq_") for c in cfg.rejection))

    cases = [(p, config_for(p), True) for p in PRESET_NAMES]
    cases += [(name, config_for(preset, overrides), not name.startswith("gspo"))
              for name, preset, overrides in OPTION_CASES
              if sequence_level(config_for(preset, overrides)) and overrides.get("policy") not in ("clip_cov", "kl_cov")
              and preset not in ("clip_cov", "kl_cov")]
    for i, (name, cfg, with_old) in enumerate(cases):
        backend = backends[(i + 1) % len(backends)]
        tag = f"packed sequence_group {backend} {name} old={with_old}"
        kwargs = inputs.kwargs(with_old=with_old)
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend, **kwargs)
        (ref.loss * 1.7).backward()
        part = lambda x: None if x is None else x[rows]  # noqa: E731
        mine = inputs.logits[rows].clone().requires_grad_()
        local = {k: part(v) if k != "cu_seqlens" else local_cu for k, v in kwargs.items()}
        out = fused_is.policy_loss(mine, part(inputs.tokens), part(inputs.advantages), config=cfg, backend=backend,
                                   sequence_group=dist.group.WORLD, **local)
        (out.loss * 1.7).backward()
        _assert_like_single_process(tag, backend, out, ref, mine.grad, full.grad[rows], full.grad, part(ref.logprobs),
                                    part(inputs.mask), inputs.mask)


def _temperature_cases(rank, world, sizes, backends):
    """Per-sequence temperatures (policy_loss's temperature=): vocabulary parallel (the shards' statistics are
    combined with each row's own 1 / tau) and context parallel (every rank passes the same [B]), against the
    single-process run with the same temperatures."""
    inputs = make_inputs("padded", vocab=sum(sizes), seed=13)
    tau = torch.tensor([0.6, 1.0, 1.4])
    for backend in backends:
        for cfg, with_old in ((config_for("seq_tis", dict(entropy_coef=0.02)), False), (config_for("ppo_tis"), True)):
            _check_case(rank, sizes, inputs, cfg, backend, with_old, f"{backend} temperature {cfg.is_level}",
                        temperature=tau)
    cuts = POSITION_SPLITS[world]
    start, stop = sum(cuts[:rank]), sum(cuts[:rank + 1])
    inputs = make_inputs("padded", vocab=300, seed=14)
    cfg = config_for("seq_tis", dict(entropy_coef=0.02))
    for backend in backends:
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   temperature=tau, **inputs.kwargs(with_old=False))
        (ref.loss * 1.7).backward()
        mine = inputs.logits[:, start:stop].clone().requires_grad_()
        local = {k: v[:, start:stop] if isinstance(v, torch.Tensor) else v
                 for k, v in inputs.kwargs(with_old=False).items()}
        out = fused_is.policy_loss(mine, inputs.tokens[:, start:stop], inputs.advantages[:, start:stop], config=cfg,
                                   backend=backend, sequence_group=dist.group.WORLD, temperature=tau, **local)
        (out.loss * 1.7).backward()
        _assert_like_single_process(f"sequence_group {backend} temperature", backend, out, ref, mine.grad,
                                    full.grad[:, start:stop], full.grad, ref.logprobs[:, start:stop],
                                    inputs.mask[:, start:stop], inputs.mask)


def _compile_cases(rank, world, sizes, backends):
    """torch.compile(fullgraph=True) of a loss with vocab_group, with sequence_group, and (4 ranks) with both on the
    2 x 2 grid: the groups' collectives traced as functional collectives; loss and gradient equal the eager call's."""
    import torch._dynamo

    inputs = make_inputs("padded", vocab=sum(sizes), seed=16)
    with pytest.raises(ValueError, match="vocab_group and sequence_group are the same group"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, vocab_group=dist.group.WORLD,
                             sequence_group=dist.group.WORLD, **inputs.kwargs())
    cuts = POSITION_SPLITS[world]
    t0, t1 = sum(cuts[:rank]), sum(cuts[:rank + 1])
    v0, v1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
    layouts = [("vocab", (slice(None), slice(v0, v1)), dict(vocab_group=dist.group.WORLD)),
               ("sequence", (slice(t0, t1), slice(None)), dict(sequence_group=dist.group.WORLD))]
    if world == 4:
        groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]  # the same order on every rank
        shard, part = rank % 2, rank // 2
        g0, g1 = sum(GRID_VOCAB[:shard]), sum(GRID_VOCAB[:shard + 1])
        p0, p1 = sum(GRID_POSITIONS[:part]), sum(GRID_POSITIONS[:part + 1])
        layouts.append(("grid", (slice(p0, p1), slice(g0, g1)),
                        dict(vocab_group=groups[part], sequence_group=groups[2 + shard])))
    cfg = config_for("seq_tis", dict(entropy_coef=0.02))
    for name, (positions, columns), groups_kw in layouts:
        if name == "grid":
            inputs = make_inputs("padded", vocab=sum(GRID_VOCAB), seed=16)
        kwargs = {k: v[:, positions] for k, v in inputs.kwargs(with_old=False).items() if isinstance(v, torch.Tensor)}
        tokens, adv = inputs.tokens[:, positions], inputs.advantages[:, positions]
        backend = backends[-1]

        def fn(logits):
            out = fused_is.policy_loss(logits, tokens, adv, config=cfg, backend=backend, **kwargs, **groups_kw)
            return out.loss, out.metrics["entropy_mean"]

        torch._dynamo.reset()
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaf = inputs.logits[:, positions][..., columns].clone().requires_grad_()
            loss, entropy_mean = f(leaf)
            (loss * 1.7).backward()
            results.append((loss.detach(), float(entropy_mean), leaf.grad))
        (loss_e, ent_e, grad_e), (loss_c, ent_c, grad_c) = results
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7, msg=f"compile {name}")
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-7, msg=f"compile {name}")
        assert abs(ent_c - ent_e) <= 1e-6 * max(1.0, abs(ent_e)), name


GRID_VOCAB = [550, 450]  # the two vocabulary shards of a 2 x 2 grid (V = 1000), uneven
GRID_POSITIONS = [5, 3]  # the two position slices of T = 8, uneven


def _grid_cases(rank, backends):
    """vocab_group and sequence_group together on a 2 x 2 grid of the 4 ranks (tensor x context parallel): rank r
    holds vocabulary shard r % 2 of position slice r // 2; its vocab_group is the two ranks of its slice, its
    sequence_group the two ranks of its shard. Loss and metrics equal the single-process run on the whole rows
    and sequences on every rank, the gradient that run's block of the rank's slice and shard, for the presets
    (one-pass and two-pass plans), GSPO, VESPO, the rejection and the per-sequence temperature."""
    groups = {key: dist.new_group(list(ranks)) for key, ranks in
              (("v0", (0, 1)), ("v1", (2, 3)), ("s0", (0, 2)), ("s1", (1, 3)))}  # created in one order on every rank
    shard, part = rank % 2, rank // 2
    vocab_group, sequence_group = groups[f"v{part}"], groups[f"s{shard}"]
    v0, v1 = sum(GRID_VOCAB[:shard]), sum(GRID_VOCAB[:shard + 1])
    t0, t1 = sum(GRID_POSITIONS[:part]), sum(GRID_POSITIONS[:part + 1])
    inputs = make_inputs("padded", vocab=sum(GRID_VOCAB), seed=15)
    cases = [(p, config_for(p), w, {}) for p in PRESET_NAMES for w in (True, False)]
    cases += [(name, config_for(preset, overrides), not name.startswith("gspo"), {})
              for name, preset, overrides in OPTION_CASES
              if name.startswith(("gspo", "vespo", "reject")) or "seq" in name]
    cases.append(("temperature", config_for("seq_tis", dict(entropy_coef=0.02)), False,
                  dict(temperature=torch.tensor([0.6, 1.0, 1.4]))))
    for i, (name, cfg, with_old, extra) in enumerate(cases):
        if cfg.policy in ("clip_cov", "kl_cov"):
            continue
        backend = backends[i % len(backends)]
        tag = f"grid {backend} {name} old={with_old}"
        kwargs = inputs.kwargs(with_old=with_old, **extra)
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend, **kwargs)
        (ref.loss * 1.7).backward()
        cut = lambda x: x[:, t0:t1] if isinstance(x, torch.Tensor) and x.dim() == 2 else x  # noqa: E731
        mine = inputs.logits[:, t0:t1, v0:v1].clone().requires_grad_()
        out = fused_is.policy_loss(mine, cut(inputs.tokens), cut(inputs.advantages), config=cfg, backend=backend,
                                   vocab_group=vocab_group, sequence_group=sequence_group,
                                   **{k: cut(v) for k, v in kwargs.items()})
        (out.loss * 1.7).backward()
        _assert_like_single_process(tag, backend, out, ref, mine.grad, full.grad[:, t0:t1, v0:v1], full.grad,
                                    cut(ref.logprobs), cut(inputs.mask), inputs.mask)


def _hard_cases(rank, sizes, backends):
    """-inf logits that empty a whole shard for some rows; every sampled token in rank 0's shard (the other
    shards own none); token_logprobs; no gradient wanted; a bad row named."""
    inputs = make_inputs("padded", vocab=sum(sizes), seed=9)
    logits = inputs.logits.clone()
    last = sum(sizes[:-1])
    logits[0, :3, last:] = float("-inf")  # the last shard has no probability in these rows
    inputs.logits = logits
    tokens = inputs.tokens.clone()
    tokens[0, :3] = tokens[0, :3] % last
    inputs.tokens = tokens
    for backend in backends:
        _check_case(rank, sizes, inputs, config_for("ppo_tis", dict(entropy_coef=0.01)), backend, True,
                    f"{backend} empty shard rows")
    only_first = make_inputs("padded", vocab=sum(sizes), seed=10)
    only_first.tokens = only_first.tokens % sizes[0]
    for backend in backends:
        _check_case(rank, sizes, only_first, config_for("seq_mis"), backend, False, f"{backend} tokens in shard 0")
        shard = _shard(only_first.logits, rank, sizes)
        lp, entropy = fused_is.token_logprobs(shard, only_first.tokens, 0.8, backend, mask=only_first.mask,
                                              vocab_group=dist.group.WORLD)
        ref_lp, ref_entropy = fused_is.token_logprobs(only_first.logits, only_first.tokens, 0.8, backend,
                                                      mask=only_first.mask)
        valid = only_first.mask
        TOL = _tol(backend)
        assert rel_err(lp[valid], ref_lp[valid], logprob_scale(ref_lp[valid])) <= TOL["logprobs"], backend
        assert rel_err(entropy[valid], ref_entropy[valid], logprob_scale(ref_entropy)) <= TOL["logprobs"], backend
        with torch.no_grad():
            out = fused_is.policy_loss(shard, only_first.tokens, only_first.advantages, backend=backend,
                                       vocab_group=dist.group.WORLD, **only_first.kwargs())
        assert torch.isfinite(out.loss)
    # NaN in rank 1's shard at an unmasked row: every rank raises, rank 1 names the column
    bad = make_inputs("padded", vocab=sum(sizes), seed=11)
    logits = bad.logits.clone()
    logits[1, 2, sizes[0] + 7] = float("nan")
    bad.mask[1, 2] = True
    shard = _shard(logits, rank, sizes)
    with pytest.raises(ValueError, match="row 10") as err:
        fused_is.policy_loss(shard, bad.tokens, bad.advantages, backend=backends[0], vocab_group=dist.group.WORLD,
                             **bad.kwargs())
    if rank == 1:
        assert "column 7 of this rank's vocabulary shard" in str(err.value)
    # NaN in every logit of rank 1's part of an unmasked row: the kernels' max skips NaN, but the row must not
    # pass for an empty (all -inf) shard: every rank raises
    logits = bad.logits.clone()
    logits[0, 4, sizes[0]:sizes[0] + sizes[1]] = float("nan")
    bad.mask[0, 4] = True
    for backend in backends:
        with pytest.raises(ValueError, match="row 4"):
            fused_is.policy_loss(_shard(logits, rank, sizes), bad.tokens, bad.advantages, backend=backend,
                                 vocab_group=dist.group.WORLD, **bad.kwargs())
    # NaN and +inf at a masked row (flat row 1 of make_inputs) in every shard: ignored, as in one process
    dirty = make_inputs("padded", vocab=sum(sizes), seed=12)
    dirty.logits = dirty.logits.clone()
    dirty.logits[0, 1, ::2] = float("nan")
    dirty.logits[0, 1, 1::2] = float("inf")
    for backend in backends:
        _check_case(rank, sizes, dirty, config_for("seq_mis", dict(entropy_coef=0.01)), backend, False,
                    f"{backend} masked garbage")
    # validate="async": nothing read on the host, forward or backward (the collectives read nothing either)
    from test_validate_async import HostReads

    for backend in backends:
        leaf = _shard(dirty.logits, rank, sizes).clone().requires_grad_()
        with HostReads() as reads:
            out = fused_is.policy_loss(leaf, dirty.tokens, dirty.advantages, backend=backend, validate="async",
                                       vocab_group=dist.group.WORLD, **dirty.kwargs())
            out.loss.backward()
            fused_is.token_logprobs(_shard(dirty.logits, rank, sizes), dirty.tokens, 0.9, backend,
                                    mask=dirty.mask, validate="async", vocab_group=dist.group.WORLD)
        assert reads.ops == [], (backend, reads.ops)
    # a rank without a shard: every rank raises (none is left waiting in a collective)
    empty = _shard(dirty.logits, rank, sizes)[..., :0] if rank == len(sizes) - 1 else _shard(dirty.logits, rank, sizes)
    with pytest.raises(ValueError, match="needs a vocabulary shard of size >= 1"):
        fused_is.policy_loss(empty, dirty.tokens, dirty.advantages, backend=backends[0], vocab_group=dist.group.WORLD,
                             **dirty.kwargs())


def _normalizer_cases(rank, world):
    """global_normalizer: each rank holds 4 of the 4 * world sequences, in 2 micro-batches of 2; the ranks'
    micro-batch losses add up (gradients="sum") or average (gradients="mean") to the one-process loss of all
    of them, and each micro-batch's gradient is its rows of the one-process gradient."""
    from fused_is.distributed import global_normalizer

    inputs = make_inputs("padded", batch=4 * world, vocab=300, seed=17)
    inputs.mask[5, :] = False  # an empty sequence: not counted by the seq-mean aggregations
    for cfg in (config_for("ppo_tis"), config_for("seq_tis", dict(loss_agg="seq-mean-token-mean"))):
        full = inputs.logits.clone().requires_grad_()
        ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend="torch",
                                   **inputs.kwargs())
        ref.loss.backward()
        micro = [slice(4 * rank + 2 * k, 4 * rank + 2 * k + 2) for k in range(2)]
        sums = {}
        for gradients in ("sum", "mean"):
            norm = global_normalizer([inputs.mask[rows] for rows in micro], config=cfg, gradients=gradients)
            total = torch.zeros((), dtype=torch.float64)
            for rows in micro:
                leaf = inputs.logits[rows].clone().requires_grad_()
                kw = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in inputs.kwargs().items()}
                out = fused_is.policy_loss(leaf, inputs.tokens[rows], inputs.advantages[rows], config=cfg,
                                           backend="torch", normalizer=norm, **kw)
                out.loss.backward()
                total += out.loss.detach().double()
                if gradients == "sum":
                    assert rel_err(leaf.grad, full.grad[rows], full.grad.abs().max()) <= 1e-6
            dist.all_reduce(total)
            sums[gradients] = float(total)
        assert abs(sums["sum"] - ref.loss.item()) <= 1e-6 * max(1.0, abs(ref.loss.item())), (sums, ref.loss.item())
        assert abs(sums["mean"] / world - ref.loss.item()) <= 1e-6 * max(1.0, abs(ref.loss.item()))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_single_process(world):
    mp.spawn(_worker, args=(world, _free_port(), BACKENDS), nprocs=world, join=True)


def test_vocab_group_errors():
    inputs = make_inputs("padded", vocab=100, seed=1)
    with pytest.raises(ValueError, match="initialised torch.distributed"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, vocab_group=object(), **inputs.kwargs())


def test_sequence_group_errors():
    inputs = make_inputs("padded", vocab=100, seed=2)
    with pytest.raises(ValueError, match="sequence_group needs an initialised torch.distributed"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, sequence_group=object(),
                             **inputs.kwargs())
    with pytest.raises(ValueError, match="backend='reference' with (vocab|sequence)_group is not supported"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, sequence_group=object(),
                             backend="reference", **inputs.kwargs())


def check_shards_in_process(inputs, cfg, backend: str, sizes, monkeypatch, *, with_old: bool = True, tol=None,
                            temperature=None):
    """The vocabulary-parallel path with the collectives replaced by their result, in this process: each
    shard's statistics are collected, then every shard runs with all of them; loss, logprobs and each shard's
    gradient against the single-process run on the whole vocabulary. temperature: per-token temperatures (the
    tokens' shape) passed to every call, or None (the config's)."""
    from fused_is import distributed

    parts = {}
    state = dict(rank=0, collect=True)
    real_partials = distributed.shard_partials

    def partials(*args):  # records each shard's partial statistics in the first round
        ids, packed = real_partials(*args)
        if state["collect"]:
            parts[state["rank"]] = packed.clone()
        return ids, packed

    def gather(tensor, group):  # the all-gather, from every shard's recorded partials in rank order
        if state["collect"]:  # this shard alone: the first round only collects
            return tensor.unsqueeze(0)
        return torch.stack([parts[r] for r in range(len(sizes))])

    monkeypatch.setattr(distributed, "shard_partials", partials)
    monkeypatch.setattr(distributed, "gather_ranks", gather)
    monkeypatch.setattr(distributed, "check_group", lambda group: group)
    monkeypatch.setattr(distributed, "shard_range",
                        lambda v, group, device, host=True: (sum(sizes[:state["rank"]]), sum(sizes)))
    kwargs = inputs.kwargs(with_old=with_old, **({} if temperature is None else dict(temperature=temperature)))
    shards = [_shard(inputs.logits, r, sizes) for r in range(len(sizes))]
    for r, shard in enumerate(shards):  # each shard's own statistics
        state["rank"] = r
        with torch.no_grad():
            fused_is.policy_loss(shard, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                 vocab_group="group", validate="async", **kwargs)
    state["collect"] = False
    full = inputs.logits.clone().requires_grad_()
    ref = fused_is.policy_loss(full, inputs.tokens, inputs.advantages, config=cfg, backend=backend, **kwargs)
    ref.loss.backward()
    tol = tol or _tol(backend)
    valid = inputs.mask
    for r, shard in enumerate(shards):
        state["rank"] = r
        leaf = shard.clone().requires_grad_()
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   vocab_group="group", **kwargs)
        out.loss.backward()
        assert rel_err(out.loss, ref.loss, max(1.0, abs(ref.loss.item()))) <= tol["loss"], r
        assert rel_err(leaf.grad, _shard(full.grad, r, sizes), full.grad.abs().max()) <= tol["grad"], r
        assert rel_err(out.logprobs[valid], ref.logprobs[valid], logprob_scale(ref.logprobs[valid])) <= tol["logprobs"]
        assert rel_err(out.entropy[valid], ref.entropy[valid], logprob_scale(ref.entropy[valid])) <= tol["logprobs"]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_primitives_in_process(backend, layout, monkeypatch):
    """check_shards_in_process on every backend; it also records the Triton launches of the shard kernels for
    the GPU build check (the spawned ranks above do not record theirs)."""
    inputs = make_inputs(layout, vocab=1000, seed=21)
    check_shards_in_process(inputs, config_for("ppo_tis", dict(entropy_coef=0.01, kl_coef=0.05)), backend,
                            [450, 50, 500], monkeypatch)
    check_shards_in_process(inputs, config_for("seq_mis"), backend, [700, 300], monkeypatch, with_old=False)
    # NeMo-RL's KL (its score term; fused_is.integrations.nemo_rl passes vocab_group on for Megatron's shards)
    check_shards_in_process(inputs, config_for("ppo", dict(kl_coef=0.3, kl_weight="score", kl_clamp=0.05)), backend,
                            [600, 400], monkeypatch)


def test_global_normalizer_counts_without_distributed():
    from fused_is.distributed import global_normalizer

    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert global_normalizer(mask) == 3.0
    assert global_normalizer(mask, config=config_for("ppo", dict(loss_agg="seq-mean-token-mean"))) == 2.0
    assert global_normalizer([mask, mask[:1]]) == 5.0
    assert global_normalizer(mask, micro_batches=4) == 12.0
    packed = torch.tensor([1, 0, 0, 0, 1, 1])
    offsets = torch.tensor([0, 2, 4, 6])
    assert global_normalizer(packed, config="seq_tis", cu_seqlens=offsets) == 3.0  # seq_tis: token-mean
    seq_cfg = config_for("seq_tis", dict(loss_agg="seq-mean-token-sum"))
    assert global_normalizer(packed, config=seq_cfg, cu_seqlens=offsets) == 2.0
    assert global_normalizer(torch.zeros(4, dtype=torch.bool)) == 1.0
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        global_normalizer(packed, config=seq_cfg)
    with pytest.raises(ValueError, match="either a list"):
        global_normalizer([mask, mask], micro_batches=2)
    with pytest.raises(ValueError, match="gradients must be"):
        global_normalizer(mask, gradients="avg")
    with pytest.raises(ValueError, match="end at N=6"):
        global_normalizer(packed, config=seq_cfg, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="S \\+ 1 >= 2 offsets"):
        global_normalizer(packed, config=seq_cfg, cu_seqlens=torch.tensor([6]))

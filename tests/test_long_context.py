"""Long context and huge vocabularies (issue 41): N x V beyond 2**31 elements through `policy_loss`, every row live.

test_hard_inputs.py's 2**31 test masks all but six rows (zeros elsewhere); here every one of the 2.16e9 bf16 logits
is a live value and every row counts, so the kernels sweep all of them: rows on both sides of element 2**31 and at
the ends are checked against the float64 reference (lp, H and the gradient row), and the whole loss against a
float64 computation done in chunks. The Triton kernels' 64-bit row offsets are checked in their sm_90 TTIR (the
interpreter computes in 64-bit numpy whatever the source says, so running it would not catch an int32 offset).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_is
from fused_is import backends

from cases import assert_close, config_for, logprob_scale, tolerance

QWEN_VOCAB = 151936
BIG_ROWS = 14208  # 2**31 / V = 14134.2 rows: 14208 x 151936 = 2.159e9 elements, 4.3 GB of bf16
FILL_ROWS = 512  # the logits are FILL_ROWS random rows, scaled anew for every block of FILL_ROWS rows
ENTROPY_COEF = 0.01


def _big_problem():
    """bf16 [BIG_ROWS, V] logits, every row live and different (a block of random rows, each block scaled by its
    own factor: one multiply per element to make, not a random draw), tokens, advantages and sampler logprobs."""
    n, vocab = BIG_ROWS, QWEN_VOCAB
    gen = torch.Generator().manual_seed(41)
    base = 2 * torch.randn(FILL_ROWS, vocab, generator=gen)
    logits = torch.empty(n, vocab, dtype=torch.bfloat16)
    for block, start in enumerate(range(0, n, FILL_ROWS)):
        stop = min(start + FILL_ROWS, n)
        logits[start:stop] = base[:stop - start] * (1 + 0.02 * block)
    del base
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens[[0, n - 1]] = torch.tensor([vocab - 1, 0])  # the last and the first column of a row
    advantages = torch.randn(n, generator=gen)
    # ~ the learner's lp (about -13 here) and off by up to 4 nats: the truncated IS weight is 2 on some rows
    sampler = -(13.0 + 4 * torch.rand(n, generator=gen) - 2)
    return logits, tokens, advantages, sampler


def _float64_totals(logits, tokens, advantages, sampler, chunk_rows=256):
    """lp and H of every row in float64, chunk by chunk (DESIGN.md section 2), and the ppo_tis loss of this call:
    old_logprobs=None makes the ratio 1 (s_t = A_t), W_t = min(exp(clamp(lp_t - samp_t, +-20)), 2), token mean of
    -W_t A_t - ENTROPY_COEF H_t."""
    n = logits.shape[0]
    lp = torch.empty(n, dtype=torch.float64)
    entropy = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, chunk_rows):
        z = logits[start:start + chunk_rows].double()
        lse = torch.logsumexp(z, dim=-1)
        lp[start:start + chunk_rows] = z.gather(1, tokens[start:start + chunk_rows, None]).squeeze(1) - lse
        z.sub_(lse[:, None])  # log p
        entropy[start:start + chunk_rows] = -(z.exp() * z).sum(-1)
        del z
    weight = torch.exp(torch.clamp(lp - sampler.double(), -20, 20)).clamp(max=2.0)
    loss = (-weight * advantages.double() - ENTROPY_COEF * entropy).mean()
    return lp, entropy, loss


@pytest.fixture(scope="module")
def big_reference():
    """(lp, H, loss) of _big_problem in float64 (_float64_totals), computed once for both backends' tests."""
    logits, tokens, advantages, sampler = _big_problem()
    return _float64_totals(logits, tokens, advantages, sampler)


@pytest.mark.slow  # 37 s (cpu) and 72 s (torch) on 2 shared cores, peak RSS 5.2 GiB
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_every_row_live_beyond_2_pow_31_elements(backend, monkeypatch, big_reference):
    """policy_loss(inplace=True) on 14208 x 151936 bf16 logits (2.16e9 elements, 4.3 GB, no second N x V buffer),
    every row unmasked: the rows at the start, on both sides of element 2**31 and at the end against the float64
    reference (lp, H, their gradient rows), lp and H of every row and the loss against float64 in chunks."""
    if backend not in backends.available_backends():
        pytest.skip("the CPU extension is not built here (`fused-is build cpu`)")
    from fused_is.backends import torch_chunked

    monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", 1 << 25)  # 128 MiB chunks: fewer, larger torch ops
    logits, tokens, advantages, sampler = _big_problem()
    n, vocab = logits.shape
    rows = torch.tensor([0, 1, 2**31 // vocab, 2**31 // vocab + 1, n - 2, n - 1])
    assert int(rows[2]) * vocab < 2**31 < int(rows[3]) * vocab and n * vocab > 2**31
    ref_lp, ref_entropy, ref_loss = big_reference
    saved = logits[rows].double()
    cfg = config_for("ppo_tis", dict(entropy_coef=ENTROPY_COEF))

    logits.requires_grad_()
    out = fused_is.policy_loss(logits, tokens, advantages, sampler_logprobs=sampler, config=cfg, backend=backend,
                               inplace=True)
    out.loss.backward()
    assert logits.grad.data_ptr() == logits.data_ptr()  # the gradient is the logits' own buffer
    grad = logits.detach()

    # the sampled rows: float64 reference, the token mean's denominator being the whole batch
    few = saved.requires_grad_()
    ref = fused_is.policy_loss(few, tokens[rows], advantages[rows], sampler_logprobs=sampler[rows].double(),
                               config=cfg, backend="reference", normalizer=n)
    ref.loss.backward()
    tol = tolerance(torch.bfloat16, backend)
    assert_close("grad rows", grad[rows], few.grad, tol["grad"])
    assert_close("logprobs rows", out.logprobs[rows], ref.logprobs, 1e-6, scale=logprob_scale(ref.logprobs))
    assert_close("entropy rows", out.entropy[rows], ref.entropy, 1e-6, scale=logprob_scale(ref.entropy))
    # every row, and the loss: the float64 computation in chunks
    assert_close("logprobs", out.logprobs, ref_lp, 1e-6, scale=logprob_scale(ref_lp))
    assert_close("entropy", out.entropy, ref_entropy, 1e-6, scale=logprob_scale(ref_entropy))
    assert_close("loss", out.loss, ref_loss, tol["loss"], scale=max(1.0, abs(ref_loss.item())))
    assert 0 < out.metrics["is_truncated_frac"] < 1  # both branches of the truncation ran


# --- the Triton kernels' row offsets, in the sm_90 TTIR ------------------------------------------------------------

BUILD_CHECK = Path(__file__).resolve().parents[1] / "bench" / "gpu"
# the TTIR of each recorded launch's production specializations, in a process without the interpreter
TTIR_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gpu_build_check as check
launches = [json.loads(line) for line in open(sys.argv[2])]
out = []
for desc, fn, signature, constexprs, attrs, options in check.specializations(launches, ("aligned", "aligned_i64")):
    out.append(dict(kernel=desc["kernel"], variant=desc["variant"], signature=desc["signature"],
                    ttir=check.ttir(fn, signature, constexprs, attrs, options)))
print(json.dumps(out))
"""
ROW_KERNELS = ("_fused_kernel", "_row_stats_kernel")


def _record_row_kernel_launches(monkeypatch) -> list:
    """The launches (as tests/conftest.py records them) of the Triton row kernels that policy_loss (in place and
    not) and token_logprobs make on small bf16 logits, run here under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    import conftest

    launches = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ in ROW_KERNELS:
            bound = dict(zip(self.arg_names, args), **{k: v for k, v in kwargs.items() if k in self.arg_names})
            options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            record = dict(module=self.fn.__module__, kernel=self.fn.__name__, options=options,
                          args={k: conftest._describe(bound[k]) for k in self.arg_names if k in bound})
            launches[json.dumps(record, sort_keys=True)] = record
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 1000, (8,), generator=gen)
    lp = fused_is.token_logprobs(logits, tokens, backend="triton")[0]
    for inplace in (False, True):
        fused_is.policy_loss(logits.clone().requires_grad_(), tokens, torch.randn(8, generator=gen),
                             sampler_logprobs=lp - 0.1, old_logprobs=lp, backend="triton", inplace=inplace)
    return list(launches.values())


def test_triton_row_offsets_are_int64(monkeypatch, tmp_path):
    """In the sm_90 TTIR of the row kernels as a production launch specializes them (bf16 [N, 151936]-like logits,
    strides that fit in int32, and strides beyond 2**32), the logits pointer and the gradient's move by 64-bit
    offsets only (tt.addptr %logits_ptr, ... : !tt.ptr<bf16>, i64): row * stride_row is formed in int64 even where
    the JIT passes the strides as i32, so row 14135 of a [14208, 151936] tensor is not at a negative offset. An int32 row
    (e.g. `row = first` for `row = tl.cast(first, tl.int64)` in _fused_kernel) makes them i32 and fails here."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records the launches under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)")
    launches = _record_row_kernel_launches(monkeypatch)
    assert {r["kernel"] for r in launches} == set(ROW_KERNELS)
    path = tmp_path / "launches.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", TTIR_SCRIPT, str(BUILD_CHECK), str(path)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    specs = json.loads(result.stdout.splitlines()[-1])
    assert {s["variant"] for s in specs} == {"aligned", "aligned_i64"}
    assert any(s["signature"].get("stride_row") == "i32" for s in specs)  # the case an int32 row would break
    for spec in specs:
        name = f"{spec['kernel']} ({spec['variant']}, stride_row {spec['signature'].get('stride_row')})"
        header = re.search(r"tt\.func public @\w+\((.*?)\) attributes", spec["ttir"], re.S)
        assert header, f"{name}: no kernel signature in its TTIR"
        bf16_args = re.findall(r"(%[\w.]+): !tt\.ptr<bf16>", header.group(1))  # the logits and the gradient
        assert bf16_args, f"{name}: no bf16 pointer argument in its TTIR"
        for arg in bf16_args:
            moves = re.findall(rf"tt\.addptr {arg}, %[\w.#]+ : !tt\.ptr<bf16>, (i\d+)", spec["ttir"])
            assert moves, f"{name}: no scalar tt.addptr on {arg}"
            assert set(moves) == {"i64"}, f"{name}: {arg} moves by {moves}, expected i64 offsets only"

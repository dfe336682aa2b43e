"""What only a GPU can run: the CUDA-side kernel paths, each against the float64 reference (marker `gpu`).

Backends under test: "triton", "cuda" (csrc/cuda, built on first use) and "torch" on a CUDA device. In the
GPU suite's CPU dry run (FUSED_IS_GPU_DRY_RUN=1, tests/conftest.py) the same tests run at tiny shapes on
the CPU backends (triton through the interpreter, "cpu" when built, "torch"), so that their plumbing and
the Triton specializations they launch (recorded for bench/gpu/gpu_build_check.py) run without a GPU; the
`cuda_only` ones stay skipped there. Without CUDA and without the dry run every test is skipped, with the
reason. Each test compares loss, gradient, logprobs and entropy with the float64 reference.

- test_qwen_vocab: V = 151936 (Qwen), the row length the kernels are tuned for (38 Triton blocks per sweep,
  about 19 16-byte vectors per CUDA thread per sweep); four presets covering the one-pass kernel and the
  two-pass plan (seq_mis / geo_mis / mis_ppo_seq without old_logprobs), bf16 and fp32, in place too.
- test_distill_term_qwen: policy_loss with a distillation term (teacher_logits=) at V = 151936: the fused Triton
  kernel of the KLs, separate and inplace="forward", and JSD with inplace=True on every backend (block by block).
- test_vector_path_and_scalar_fallback: the CUDA kernel loads and stores 16 bytes at a time only when every
  row start is 16-byte aligned (data pointer and row stride); Triton specializes on the same alignment.
  V a multiple of 8 (vector path), V odd (rows misaligned: scalar fallback), V odd in the rows of a wider
  aligned buffer (vector path plus its scalar tail), and views whose data pointer is one element past 16
  bytes, big[:, 1:V+1] and flat[1:].view(N, V) (scalar fallback although V is a multiple of 8); bf16
  (8 per vector) and fp32 (4), with and without inplace.
- test_strided_vocab: stride_col != 1 (vocab-major storage): the CUDA kernel's strided loop and Triton's
  gather, reading and (inplace) writing strided, one-pass and two-pass.
- test_fp16_logits: the third storage type (fp16 loads; the gradient rounded to fp16), both plans.
- test_packed_cu_seqlens: packed [N, V] with ragged cu_seqlens (single-token and empty sequences too):
  the two-pass plan (stats kernel, per-sequence reduction, gradient kernel) and the one-pass kernel.
- test_inplace_into_slice_of_bigger_buffer: logits[:, :-1] (and [:, 1:]) of a [B, T+1, V] buffer whose
  extra position is NaN: nothing outside the slice is read (NaN would poison the row) or written (checked
  bit for bit), by the one-pass and by the two-pass kernels; without inplace nothing at all is written.
- test_persistent_grid_rows_in_turn: 2048 rows at V = 32768, far more than the persistent grids' blocks (each
  block runs rows in turn and loads the next row's inputs early), against the reference, and rows bitwise the same
  in a batch of 4 rows and of 128.
- test_cuda_cluster_kernel (cuda_only, compute capability 9.0): FUSED_IS_CUDA_CLUSTER=1, rows split across a
  thread-block cluster of 2 to 8 slices (V from 51208 to 409600), against the reference, separate and in place,
  padded and packed rows; the cases it does not take run the persistent kernel (the extension's launch counts say
  which ran).
- test_logits_on_second_device (cuda_only, 2 GPUs): logits on cuda:1 while cuda:0 is current (device guard).
- test_launches_on_current_stream (cuda_only): logits made and the loss run on a side stream while the
  default stream is busy: every launch must go to torch's current stream, and nothing may sync the device.
- test_more_than_2_pow_31_elements (cuda_only): N x V > 2**31 (int64 row offsets): token_logprobs and the
  in-place fused gradient, checked on rows on both sides of element 2**31.
- test_linear_qwen_head: linear_policy_loss at V = 151936, D = 1024 (GPU; tiny in the dry run), bf16 with the
  bf16 head and the fp32 head, one-pass and two-pass, the default chunking and chunks that split sequences:
  loss, logprobs and the gradients of hidden, weight and bias against the float64 reference.
- test_vocab_shards_qwen: vocab_group's shard kernels at V = 151936 split 4 ways unevenly, in one process
  with the collectives replaced by their result (NCCL cannot run two ranks on one GPU).
- test_async_validation_never_syncs (cuda_only): validate="async" runs forward and backward under
  torch.cuda.set_sync_debug_mode("error"); validate="full" syncs at most 4 times, with equal results.
- test_logprobs_against_reference: fused_is.logprobs at V = 151936 (the statistics sweep, then the
  given-statistics gradient sweep of backward; cuda's kernel path too), with and without inplace.

`fused_is.testing.run` (behind check_against_reference) copies the logits into fresh storage with the same
strides, which loses the storage offset (alignment) and the surrounding buffer, so the layout tests hand
the view itself to it (`logits=`, through `_check_view`) and check the rest of the buffer bit for bit.
"""

import dataclasses
import functools

import pytest
import torch

import fused_is
from fused_is import backends
from cases import (Inputs, assert_close, check_against_reference, check_linear, config_for, logprob_scale, loss_scale,
                   make_inputs, make_linear_inputs, run, tolerance)

pytestmark = pytest.mark.gpu

QWEN_VOCAB = 151936  # = 16 * 9496: rows of bf16/fp16/fp32 are whole 16-byte vectors
# GPU row counts below are multiples of 16 (padded T too) where nothing else decides them: Triton specializes
# on every integer argument's divisibility by 16, so equal classes reuse one JIT compile across the tests.


def _gpu_backends():
    """The backends these tests run: the GPU ones on a CUDA machine, else the CPU dry run's (all but the
    reference). Without CUDA and without the dry run conftest skips every test; the ids still show them."""
    if torch.cuda.is_available():
        probe = torch.empty(1, 1, device="cuda")
        return [b for b in ("triton", "cuda", "torch") if backends.unavailable_reason(b, probe) is None]
    return [b for b in backends.available_backends(torch.empty(1, 1)) if b != "reference"]


GPU_BACKENDS = _gpu_backends()


# --- helpers ------------------------------------------------------------------------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    """x reinterpreted as integers of its element size: bit-for-bit comparison that also holds for NaN."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _check_view(inputs: Inputs, config, backend: str, logits: torch.Tensor, *, inplace, with_old: bool = True):
    """check_against_reference with `logits` (a leaf view holding inputs.logits' values in the layout under
    test) as the tensor handed to policy_loss, so the kernels see that layout, storage offset included.
    With inplace=True the scaled gradient must also be in the viewed storage afterwards."""
    assert torch.equal(logits, inputs.logits)
    out, grad, _, ref_grad = check_against_reference(inputs, config, backend, inplace=inplace, with_old=with_old,
                                                     logits=logits)
    if inplace:
        tol = tolerance(logits.dtype, backend)
        assert_close("gradient left in the logits buffer", logits.detach(), ref_grad, tol["grad"])
    return out, grad


def _nan_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    """A buffer of NaN in like's dtype and device: a kernel that reads it gets NaN into its row."""
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _check_outside_untouched(buffer: torch.Tensor, before: torch.Tensor, inside: torch.Tensor):
    """Every element of buffer outside the view region `inside` (bool, buffer's shape) has its old bits."""
    outside = ~inside
    changed = _bits(buffer)[outside] != _bits(before)[outside]
    assert not bool(changed.any()), f"{int(changed.sum())} elements outside the logits view were overwritten"


@functools.lru_cache(maxsize=None)
def _inputs(layout, batch, seq_len, vocab, dtype, device, seed):
    """make_inputs, built once per argument set and shared by the parametrisations (never modified: the
    tests copy before they change anything). make_inputs draws float64 logits on the host, about a second
    per 40M elements, which would otherwise dominate the GPU run."""
    return make_inputs(layout, batch=batch, seq_len=seq_len, vocab=vocab, dtype=dtype, device=device, seed=seed)


# --- 1. the Qwen vocabulary -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis", "geo_mis", "mis_ppo_seq"])
def test_qwen_vocab(backend, dtype, preset, gpu_device, dry_run):
    # GPU: 4 x 64 rows of the real V. Dry run: V = 331 is odd (a masked tail, misaligned rows) and 8 rows keep
    # the interpreter at a fraction of a second per call.
    batch, seq_len, vocab = (2, 4, 331) if dry_run else (4, 64, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, dtype, gpu_device, 1)
    check_against_reference(inputs, config_for(preset, dict(entropy_coef=0.01)), backend)
    # without old_logprobs the sequence-level presets take the two-pass plan; inplace: gradient into logits
    check_against_reference(inputs, config_for(preset), backend, with_old=False, inplace=True)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kl", ["ratio", "score", "sampler"])
def test_kl_weights_qwen(backend, kl, gpu_device, dry_run):
    """The KL term's weights (LossConfig.kl_weight) at the Qwen vocabulary: TRL's ratio, NeMo-RL's score term
    (with a clamp that binds) and its on-policy approximation ("sampler", both clamps binding), each a branch of
    the kernels' one pass."""
    batch, seq_len, vocab = (2, 4, 331) if dry_run else (4, 64, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, torch.bfloat16, gpu_device, 2)
    overrides = {"ratio": dict(kl_coef=0.1),
                 "score": dict(kl_coef=0.1, kl_clamp=0.03),
                 "sampler": dict(kl_coef=0.1, kl_input_clamp=0.3, kl_clamp=0.03)}[kl]
    overrides["kl_weight"] = kl
    check_against_reference(inputs, config_for("ppo_tis", overrides), backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kind,inplace", [("forward_kl", False), ("reverse_kl", "forward"), ("jsd", True)])
def test_distill_term_qwen(backend, kind, inplace, gpu_device, dry_run):
    """policy_loss with a distillation term at the Qwen vocabulary, a bf16 teacher: Triton's one kernel for the KLs
    (separate and over the logits), and JSD in place on every backend (backends.DeferredGradient's blocks: the policy's
    given sweep, then the distillation gradient kernel adding into the block's buffer)."""
    from test_policy_distill import _Taught

    batch, seq_len, vocab = (2, 4, 331) if dry_run else (4, 64, QWEN_VOCAB)
    taught = _Taught(_inputs("padded", batch, seq_len, vocab, torch.bfloat16, gpu_device, 3), seed=5)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=0.3, distill_coef=0.5, entropy_coef=0.01))
    check_against_reference(taught, config, backend, inplace=inplace)


# --- 2. the CUDA kernel's 16-byte vector path and its scalar fallback -----------------------------------

def _contiguous(x):
    buffer = x.clone()
    return buffer, buffer


def _in_wider_rows(offset):
    """x's values at columns [offset, offset + V) of an [N, W] NaN buffer, W = V rounded up to 16, plus 16
    (rows 16-byte aligned for every dtype)."""

    def make(x):
        n, vocab = x.shape
        buffer = _nan_buffer((n, (vocab + 15) // 16 * 16 + 16), x)
        view = buffer[:, offset:offset + vocab]
        view.copy_(x)
        return buffer, view

    return make


def _flat_offset_by_one(x):
    """x as a contiguous [N, V] view starting one element into a flat buffer: every row is misaligned."""
    buffer = _nan_buffer((x.numel() + 1,), x)
    view = buffer[1:].view(x.shape)
    view.copy_(x)
    return buffer, view


# name -> (V a multiple of 8?, how the [N, V] logits are laid out). For 2-byte dtypes a vector is 8
# elements, for fp32 4, so "multiple of 8" is a whole number of vectors for every dtype.
VECTOR_CASES = {
    "v_multiple_of_8": (True, _contiguous),  # aligned rows: vector loads and stores
    "v_odd": (False, _contiguous),  # row stride V * 2 or 4 bytes: rows misaligned, scalar fallback
    "v_odd_in_aligned_rows": (False, _in_wider_rows(0)),  # rows aligned (stride W): vectors + scalar tail
    "column_offset_1": (True, _in_wider_rows(1)),  # big[:, 1:V+1]: pointer one element off, scalar fallback
    "flat_offset_1": (True, _flat_offset_by_one),  # flat[1:].view(N, V): contiguous but misaligned
}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(VECTOR_CASES))
def test_vector_path_and_scalar_fallback(backend, dtype, case, gpu_device, dry_run):
    multiple_of_8, layout = VECTOR_CASES[case]
    # GPU: the real V (a multiple of 16) or one less (odd); 3 ragged sequences of 19, 16, 13 tokens (48 rows).
    # Dry run: 336 = 16 * 21 or 335, over 10 rows; both above 256, so a Triton block still has a masked tail.
    vocab = (336 if dry_run else QWEN_VOCAB) - (0 if multiple_of_8 else 1)
    batch, seq_len = (3, 6) if dry_run else (3, 19)
    inputs = _inputs("packed", batch, seq_len, vocab, dtype, gpu_device, 20)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))  # one set of constexprs: only the layout varies
    for inplace in (False, True):
        buffer, view = layout(inputs.logits)
        inside = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)  # buffer is contiguous
        inside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        before = buffer.clone()
        rows_aligned = view.data_ptr() % 16 == 0 and view.stride(0) * view.element_size() % 16 == 0
        assert rows_aligned == (case in ("v_multiple_of_8", "v_odd_in_aligned_rows"))
        _check_view(inputs, cfg, backend, view, inplace=inplace)
        if inplace:
            _check_outside_untouched(buffer, before, inside)
        else:
            assert torch.equal(_bits(buffer), _bits(before)), "logits written without inplace=True"


# --- 3. stride_col != 1 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_strided_vocab(backend, layout, gpu_device, dry_run):
    """Vocab-major storage: [N, V] with strides (1, N), [B, T, V] with strides (T V, 1, T). bf16 only: the
    strided loops do not depend on the element type, and each dtype is another set of JIT compiles."""
    # GPU: the real V over 48 packed / 32 padded rows (a column stride of 48 or 16 elements: every load its
    # own sector). Dry run: V = 331 over 10 rows.
    vocab = 331 if dry_run else QWEN_VOCAB
    batch, seq_len = {("packed", True): (3, 6), ("padded", True): (2, 5),
                      ("packed", False): (3, 19), ("padded", False): (2, 16)}[layout, dry_run]
    inputs = _inputs(layout, batch, seq_len, vocab, torch.bfloat16, gpu_device, 30)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    for inplace in (False, True):
        view = inputs.logits.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert view.stride(-1) != 1
        _check_view(inputs, cfg, backend, view, inplace=inplace)
    # the two-pass plan's separate statistics and gradient kernels on the same layout
    view = inputs.logits.transpose(-1, -2).contiguous().transpose(-1, -2)
    _check_view(inputs, config_for("seq_mis"), backend, view, inplace=True, with_old=False)


# --- 4. fp16 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis"])
def test_fp16_logits(backend, preset, gpu_device, dry_run):
    """Both plans at fp16: ppo_tis is one pass either way, seq_mis without old_logprobs is two."""
    # GPU: 2 x 32 rows of the real V. Dry run: V = 331 over 8 rows.
    batch, seq_len, vocab = (2, 4, 331) if dry_run else (2, 32, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, torch.float16, gpu_device, 4)
    check_against_reference(inputs, config_for(preset, dict(entropy_coef=0.01)), backend)
    check_against_reference(inputs, config_for(preset), backend, with_old=False, inplace=True)


# --- 5. packed input with cu_seqlens ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("preset", ["seq_mis", "geo_mis", "mis_ppo_seq"])
def test_packed_cu_seqlens(backend, preset, gpu_device, dry_run):
    # GPU: 5 sequences of 22, 19, 16, 13, 10 tokens (80 rows) of the real V. Dry run: lengths 7, 4, 1, 1
    # (single-token sequences) and V = 331.
    batch, seq_len, vocab = (4, 7, 331) if dry_run else (5, 22, QWEN_VOCAB)
    inputs = _inputs("packed", batch, seq_len, vocab, torch.bfloat16, gpu_device, 5)
    cfg = config_for(preset)
    check_against_reference(inputs, cfg, backend, with_old=False)  # two-pass plan: W needs the whole sequence
    check_against_reference(inputs, cfg, backend)  # one pass: old_logprobs given
    per_seq = config_for(preset, dict(loss_agg="seq-mean-token-mean"))
    check_against_reference(inputs, per_seq, backend, with_old=False, inplace=True)
    # an empty sequence (repeated offset) in the middle: no tokens, no weight, counted in no mean
    cu = inputs.cu_seqlens
    with_empty = dataclasses.replace(inputs, cu_seqlens=torch.cat([cu[:2], cu[1:]]))
    check_against_reference(with_empty, per_seq, backend, with_old=False)


# --- 6. inplace into a slice of a bigger buffer ----------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("drop", ["last", "first"])
@pytest.mark.parametrize("plan", ["one_pass", "two_pass"])
def test_inplace_into_slice_of_bigger_buffer(backend, dtype, drop, plan, gpu_device, dry_run):
    """logits[:, :-1] (drop the last position) or logits[:, 1:] of a [B, T+1, V] buffer: a [B, T, V] view
    that cannot be flattened to [N, V] (row T of each sequence is skipped)."""
    # GPU: 2 x 16 rows of the real V in a [2, 17, V] buffer. Dry run: 2 x 5 rows, V = 331.
    batch, seq_len, vocab = (2, 5, 331) if dry_run else (2, 16, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, dtype, gpu_device, 6)
    cfg, with_old = (config_for("ppo_tis", dict(entropy_coef=0.01)), True) if plan == "one_pass" else \
        (config_for("seq_tis", dict(entropy_coef=0.01)), False)
    buffer = _nan_buffer((batch, seq_len + 1, vocab), inputs.logits)  # the extra position: NaN, never read
    region = slice(0, seq_len) if drop == "last" else slice(1, seq_len + 1)
    view = buffer[:, region]
    view.copy_(inputs.logits)
    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)
    inside[:, region] = True
    before = buffer.clone()
    _check_view(inputs, cfg, backend, view, inplace=False, with_old=with_old)
    assert torch.equal(_bits(buffer), _bits(before)), "logits written without inplace=True"
    view.grad = None
    _check_view(inputs, cfg, backend, view, inplace=True, with_old=with_old)
    _check_outside_untouched(buffer, before, inside)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_inplace_gradient_is_bitwise_the_separate_one(backend, dtype, gpu_device, dry_run):
    """A gradient written over the logits has the bits of the same sweep writing into a buffer of its own, five times
    over, with the sampled tokens in the rows' last columns (the kernel's tail and last full block, where a thread
    other than the target's owner could race it): the one pass (policy_loss inplace="forward" against False) and the
    given-statistics sweep (logprobs inplace=True against False)."""
    batch, seq_len, vocab = (2, 4, 331) if dry_run else (4, 64, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, dtype, gpu_device, 8)
    tokens = (vocab - 1 - torch.arange(batch * seq_len, device=gpu_device) * 37 % 300).reshape(batch, seq_len)
    tokens = torch.where(inputs.mask, tokens, inputs.tokens)
    kwargs = dict(sampler_logprobs=inputs.sampler_logprobs, old_logprobs=inputs.old_logprobs, mask=inputs.mask,
                  config=config_for("ppo_tis", dict(entropy_coef=0.01)), backend=backend)
    upstream = torch.randn(2, batch, seq_len, device=gpu_device)

    def one_pass(inplace):
        leaf = inputs.logits.clone().requires_grad_()
        fused_is.policy_loss(leaf, tokens, inputs.advantages, inplace=inplace, **kwargs).loss.backward()
        return _bits(leaf.grad)

    def given(inplace):
        leaf = inputs.logits.clone().requires_grad_()
        lp, entropy = fused_is.logprobs(leaf * 1.0 if inplace else leaf, tokens, mask=inputs.mask, backend=backend,
                                        inplace=inplace)
        ((lp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        return _bits(leaf.grad)

    want_one, want_given = one_pass(False), given(False)
    for _ in range(5):
        assert torch.equal(one_pass("forward"), want_one)
        assert torch.equal(given(True), want_given)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_persistent_grid_rows_in_turn(backend, gpu_device, dry_run):
    """More rows than the persistent grid has blocks (cuda, triton: a few per SM, each looping over rows, the next
    row's inputs loaded during the current one's sweeps): 2048 rows at V = 32768, about 16 rows a block in turn, ppo_tis
    with per-token temperatures, against the float64 reference; and the first 16 rows give bitwise the same lp, H and
    gradient rows alone (a grid of 16 blocks) as inside the big batch."""
    batch, seq_len, vocab = (2, 12, 331) if dry_run else (16, 128, 32768)
    inputs = _inputs("padded", batch, seq_len, vocab, torch.bfloat16, gpu_device, 12)
    config = config_for("ppo_tis", dict(entropy_coef=0.01))
    check_against_reference(inputs, config, backend)
    temperature = 0.5 + torch.rand(batch, seq_len, device=gpu_device)

    def first_rows(rows):
        leaf = inputs.logits[:, :rows].detach().clone().requires_grad_()
        pick = (slice(None), slice(0, rows))
        out = fused_is.policy_loss(leaf, inputs.tokens[pick], inputs.advantages[pick],
                                   old_logprobs=inputs.old_logprobs[pick],
                                   sampler_logprobs=inputs.sampler_logprobs[pick],
                                   mask=inputs.mask[pick], temperature=temperature[pick], normalizer=7.0,
                                   config=config, backend=backend)
        out.loss.backward()
        return out.logprobs[0, :4], out.entropy[0, :4], leaf.grad[0, :4]

    for want, got in zip(first_rows(4), first_rows(seq_len)):
        assert torch.equal(_bits(want), _bits(got))


@pytest.mark.cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cuda_cluster_kernel(dtype, layout, monkeypatch):
    """FUSED_IS_CUDA_CLUSTER=1 on a Hopper GPU: each row split across a thread-block cluster, its slices kept in shared
    memory: 2 slices (V = 65536 bf16), a short last slice (V = 51208 bf16: 3201 + 3200 vectors), 3 (V = 151936 bf16),
    6 (V = 262144 bf16, V = 151936 fp32), 8 (V = 409600 bf16, V = 204800 fp32), against the float64 reference, with
    the gradient separate and written in place in forward, [B, T, V] and [N, V] rows. Where it does not apply (more
    than 8 slices; V odd: rows not whole vectors) the persistent kernel runs, correctly. The extension's launch
    counts tell which kernel ran."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need compute capability 9.0 or later")
    from fused_is.backends import cpp

    extension = cpp.extension("cuda")
    monkeypatch.setenv("FUSED_IS_CUDA_CLUSTER", "1")
    config = config_for("ppo_tis", dict(entropy_coef=0.01))
    for vocab in (65536, 51208, QWEN_VOCAB, 204800, 262144, 409600, 32001):
        vec = 16 // dtype.itemsize
        ranks = -(-(vocab // vec) // 6400)
        applies = vocab % vec == 0 and 2 <= ranks <= 8
        inputs = _inputs(layout, 2, 16, vocab, dtype, "cuda", 41)
        before = extension.launch_counts()
        check_against_reference(inputs, config, "cuda")
        check_against_reference(inputs, config, "cuda", inplace="forward")
        after = extension.launch_counts()
        ran, other = ("cluster", "persistent") if applies else ("persistent", "cluster")
        assert after[ran] > before[ran] and after[other] == before[other], (vocab, dtype, before, after)


# --- 7. a second device and torch's current stream (real CUDA only) -------------------------------------

@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_logits_on_second_device(backend):
    """Logits on cuda:1 while cuda:0 is current: the launches must go to cuda:1 (device guard) and its stream."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices; this machine has {torch.cuda.device_count()}")
    # 48 packed rows (sequences of 19, 16, 13) of the real V: small, and cu_seqlens for the sequence-level preset
    inputs = _inputs("packed", 3, 19, QWEN_VOCAB, torch.bfloat16, "cuda:1", 7)
    with torch.cuda.device(0):
        check_against_reference(inputs, config_for("ppo_tis", dict(entropy_coef=0.01)), backend)
        check_against_reference(inputs, config_for("seq_mis"), backend, with_old=False, inplace=True)  # two-pass
        tokens = inputs.tokens.clamp(min=0)
        lp, ent = fused_is.token_logprobs(inputs.logits, tokens, backend=backend)
        ref_lp, ref_ent = fused_is.token_logprobs(inputs.logits.double(), tokens, backend="reference")
        assert lp.device == inputs.logits.device and ent.device == inputs.logits.device
        assert_close("token_logprobs", lp, ref_lp, 1e-6, scale=logprob_scale(ref_lp))
        assert_close("token_entropy", ent, ref_ent, 1e-6, scale=logprob_scale(ref_ent))
        torch.cuda.synchronize("cuda:1")  # an asynchronous fault on cuda:1 surfaces here, not in a later test
        torch.cuda.synchronize("cuda:0")
        assert torch.cuda.current_device() == 0


@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_launches_on_current_stream(backend):
    """Logits made on a side stream and the loss (forward and backward) run there while the default stream
    is busy: a launch queued on the default stream instead would not have run when side.synchronize()
    returns (stale results), and a device-wide synchronize would wait out the default stream's sleep."""
    inputs = _inputs("padded", 4, 32, QWEN_VOCAB, torch.bfloat16, "cuda", 8)  # 128 rows of the real V
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    tol = tolerance(torch.bfloat16, backend)
    ref, ref_grad = run(inputs, cfg, "reference", dtype=torch.float64)
    scale = max(abs(ref.loss.item()), loss_scale(inputs, cfg))
    run(inputs, cfg, backend)  # warm-up: JIT compile / extension build outside the window below
    default = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(default)  # the inputs are ready before the default stream goes to sleep
    torch.cuda._sleep(2_000_000_000)  # the default stream spins about a second (2e9 cycles at <= 2 GHz)
    with torch.cuda.stream(side):
        logits = (inputs.logits * 1.0).requires_grad_()  # produced on the side stream
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   **inputs.kwargs())
        out.loss.backward()
    side.synchronize()
    assert not default.query(), "the default stream finished first: something synchronised the whole device"
    with torch.cuda.stream(side):  # compare on the side stream: no need to wait for the default stream
        assert_close("loss", out.loss, ref.loss, tol["loss"], scale=scale)
        assert_close("grad", logits.grad, ref_grad, tol["grad"])
        assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=inputs.mask,
                     scale=logprob_scale(ref.logprobs[inputs.mask]))
        side.synchronize()
    torch.cuda.synchronize()


# --- 8. N x V > 2**31 elements (real CUDA only: 4.3 GB of bf16) -------------------------------------------

@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_more_than_2_pow_31_elements(backend):
    """N x V > 2**31: row offsets must be int64 (bf16, 14208 x 151936 = 2.16e9 elements, 4.3 GB)."""
    n, vocab = 14208, QWEN_VOCAB  # 2**31 / V = 14134.2 rows; 14208 = 16 * 888 (the usual JIT specialization)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(2)
    tokens = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    # the first rows, the first row starting beyond 2**31 elements, and the last rows
    rows = torch.tensor([0, 1, 2**31 // vocab, 2**31 // vocab + 1, n - 2, n - 1], device="cuda")
    assert int(rows[2]) * vocab < 2**31 < int(rows[3]) * vocab

    lp, ent = fused_is.token_logprobs(logits, tokens, backend=backend)
    exact = torch.log_softmax(logits[rows].double(), -1)
    ref_lp, ref_ent = exact.gather(1, tokens[rows, None]).squeeze(1), -(exact.exp() * exact).sum(-1)
    assert_close("token_logprobs", lp[rows], ref_lp, 1e-6, scale=logprob_scale(ref_lp))
    assert_close("token_entropy", ent[rows], ref_ent, 1e-6, scale=logprob_scale(ref_ent))

    # the fused loss with its gradient written into the logits (inplace: no second 4.3 GB buffer)
    old = -(lp + 0.15 * torch.randn(n, device="cuda", generator=gen)).abs()  # logprobs are <= 0
    samp = -(old + 0.5 * torch.randn(n, device="cuda", generator=gen)).abs()
    adv = torch.randn(n, device="cuda", generator=gen)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    saved = logits[rows].clone()
    logits.requires_grad_()
    out = fused_is.policy_loss(logits, tokens, adv, sampler_logprobs=samp, old_logprobs=old, config=cfg,
                               backend=backend, inplace=True)
    out.loss.backward()
    assert logits.grad.data_ptr() == logits.data_ptr()
    # the reference on those rows alone: token-local, so with the whole batch's token count as the
    # normalizer each row's gradient is the full batch's
    few = Inputs(logits=saved, tokens=tokens[rows], advantages=adv[rows], sampler_logprobs=samp[rows],
                 old_logprobs=old[rows], ref_logprobs=None, mask=torch.ones(len(rows), dtype=torch.bool, device="cuda"),
                 cu_seqlens=None)
    ref, ref_grad = run(few, cfg, "reference", dtype=torch.float64, normalizer=float(n))
    tol = tolerance(torch.bfloat16, backend)
    assert_close("grad rows", logits.detach()[rows], ref_grad, tol["grad"])
    assert_close("logprobs rows", out.logprobs[rows], ref.logprobs, tol["logprobs"],
                 scale=logprob_scale(ref.logprobs))
    assert torch.isfinite(out.loss)


# --- 9. fused linear at the Qwen vocabulary ------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=str)
def test_linear_qwen_head(backend, logits_dtype, gpu_device, dry_run):
    # GPU: 2 x 64 rows, D = 1024 (default chunk: all 128 rows at once) and chunks of 48 rows (split sequences).
    # Dry run: 2 x 4 rows, V = 331, D = 24.
    batch, seq_len, dim, vocab = (2, 4, 24, 331) if dry_run else (2, 64, 1024, QWEN_VOCAB)
    li = make_linear_inputs("padded", batch=batch, seq_len=seq_len, dim=dim, vocab=vocab, dtype=torch.bfloat16,
                            device=gpu_device, seed=21)
    chunk = 3 if dry_run else 48
    check_linear(li, config_for("ppo_tis", dict(entropy_coef=0.01)), backend, logits_dtype=logits_dtype,
                 chunk_size=None)
    check_linear(li, config_for("seq_mis"), backend, logits_dtype=logits_dtype, with_old=False, chunk_size=chunk)


# --- 10. vocabulary-parallel shards -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b != "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vocab_shards_qwen(backend, dtype, gpu_device, dry_run, monkeypatch):
    """The shard kernels (statistics of a vocabulary slice, the gradient sweep with the whole row's statistics
    given) at the Qwen vocabulary split 4 ways unevenly, the collectives replaced by their result in this
    process (tests/test_distributed.py runs real gloo ranks on the CPU; NCCL cannot put two ranks on one GPU).
    backend="cuda" has no shard kernels yet."""
    from test_distributed import check_shards_in_process

    batch, seq_len, vocab = (2, 4, 331) if dry_run else (2, 64, QWEN_VOCAB)
    sizes = [100, 31, 150, 50] if dry_run else [40000, 37984, 50000, 23952]
    inputs = _inputs("padded", batch, seq_len, vocab, dtype, gpu_device, 31)
    tol = tolerance(dtype, backend)
    check_shards_in_process(inputs, config_for("ppo_tis", dict(entropy_coef=0.01)), backend, sizes, monkeypatch,
                            tol={k: 2 * v for k, v in tol.items()})
    check_shards_in_process(inputs, config_for("geo_mis"), backend, sizes, monkeypatch, with_old=False,
                            tol={k: 2 * v for k, v in tol.items()})


# --- 11. validate="async": no host sync ---------------------------------------------------------------------

@pytest.mark.cuda_only
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_async_validation_never_syncs(backend):
    """validate="async": no host sync in forward or backward (torch.cuda.set_sync_debug_mode("error") turns
    any into an error), with the same results as validate="full", which syncs at most 4 times (README;
    tests/test_validate_async.py counts the same host reads on the CPU)."""
    import warnings

    inputs = _inputs("padded", 4, 16, 4096, torch.bfloat16, "cuda", 41)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01, kl_coef=0.05))

    def call(validate):
        logits = inputs.logits.clone().requires_grad_()
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   validate=validate, **inputs.kwargs())
        (out.loss * 1.7).backward()
        return out, logits.grad

    call("async")  # warm-up: JIT compiles, extension build, lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, grad = call("async")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            full, full_grad = call("full")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"\n[host syncs] backend={backend}: validate='full' {len(syncs)}, validate='async' 0")
    assert 0 < len(syncs) <= 4, syncs
    assert_close("loss", out.loss, full.loss, 1e-12)
    assert torch.equal(grad, full_grad)
    assert {k: float(v) for k, v in out.metrics.items()} == pytest.approx(full.metrics, rel=1e-12, abs=1e-15)


# --- the differentiable logprobs -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_logprobs_against_reference(backend, inplace, gpu_device, dry_run):
    """fused_is.logprobs at the real V (the stats sweep in forward, the given-statistics gradient sweep in backward,
    cuda's included) against the float64 reference, for random upstream gradients of both outputs."""
    batch, seq_len, vocab = (2, 4, 331) if dry_run else (2, 32, QWEN_VOCAB)
    inputs = _inputs("padded", batch, seq_len, vocab, torch.bfloat16, gpu_device, 9)
    gen = torch.Generator(device=gpu_device).manual_seed(10)
    upstream = [torch.randn(inputs.tokens.shape, generator=gen, device=gpu_device) for _ in range(2)]
    ref_logits = inputs.logits.double().requires_grad_()
    ref = fused_is.logprobs(ref_logits, inputs.tokens, mask=inputs.mask, temperature=0.9, backend="reference")
    (ref[0] * upstream[0] + ref[1] * upstream[1]).sum().backward()
    leaf = inputs.logits.clone().requires_grad_()
    work = leaf * 1 if inplace else leaf
    got = fused_is.logprobs(work, inputs.tokens, mask=inputs.mask, temperature=0.9, backend=backend, inplace=inplace)
    torch.where(inputs.mask, got[0] * upstream[0] + got[1] * upstream[1], 0.0).sum().backward()
    tol = tolerance(torch.bfloat16, backend)
    valid = inputs.mask.bool()
    assert_close("logprobs", got[0], ref[0], tol["logprobs"], mask=valid, scale=20.0)
    assert_close("entropy", got[1], ref[1], tol["logprobs"], mask=valid, scale=10.0)
    assert_close("grad", leaf.grad, ref_logits.grad, tol["grad"])

"""backend="torch": the one-pass plan of DESIGN.md section 4 in chunked eager PyTorch.

Rows are processed in chunks; at most one chunk of upcast logits (two buffers of chunk_rows x V, fp32
for bf16/fp16 logits and float64 for fp32 logits) is alive at a time. Per chunk: max, sum exp and
sum exp * z give lse, lp and H; g and h follow from fused_is/coefficients.py; the gradient of the chunk
is written while the chunk is still at hand.
Per-row scalars (lse, lp, H, g, h) are float64, so the only fp32 rounding is in the row reductions.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from ..validate import Temperature, temperature_rows
from . import abi

# fp32 elements per chunk buffer: 4M elements = 16 MiB, about 27 rows at V = 151936. Three such
# buffers stay far below the 0.3x-of-logits memory budget at N = 2048 while each torch op still
# works on megabytes, so per-op overhead is negligible.
CHUNK_ELEMENTS = 1 << 22
NEG = -1.0e30  # floor of the shifted logits: -inf logits get probability and gradient exactly 0


def flat_rows(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x as an [N, V] view, or None when its strides allow none (a padded slice such as logits[:, :-1])."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def row_chunks(step: int, *tensors: torch.Tensor) -> Iterator[Tuple]:
    """(rows of the N flattened rows, each tensor's [rows, V] view) covering every row in order, at most `step` rows
    a chunk, without copying: the one chunking of the package (this backend's chunks, the distillation sweeps, the
    plan's blocks). The tensors share one [N, V] or [B, T, V] shape; chunks cross the sequences of padded tensors
    where every one flattens to [N, V], else lie within one sequence (a view of it, whatever the strides)."""
    flat = [flat_rows(x) for x in tensors]
    if all(x is not None for x in flat):
        blocks = [(0, flat)]
    else:
        length = tensors[0].shape[1]
        blocks = [(b * length, [x[b] for x in tensors]) for b in range(tensors[0].shape[0])]
    for first, views in blocks:
        rows = views[0].shape[0]
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            yield (slice(first + start, first + stop),) + tuple(x[start:stop] for x in views)


def _chunks(logits: torch.Tensor, chunk_rows: Optional[int]) -> Iterator[Tuple[slice, torch.Tensor]]:
    # the budget is CHUNK_ELEMENTS fp32 elements: half as many rows when the compute dtype is float64
    per_row = max(1, logits.shape[-1]) * compute_dtype(logits).itemsize // 4
    return row_chunks(chunk_rows or max(1, CHUNK_ELEMENTS // per_row), logits)


def _over_logits(grad: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether grad is the logits' own buffer (inplace); never under torch.compile, which refuses inplace and cannot
    trace data_ptr."""
    if torch.compiler.is_compiling():
        return False
    return grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride()


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16 logits (exact upcast; their own rounding dominates every error), float64 for
    fp32/fp64 logits: this backend is the exact path, and fp32 arithmetic on fp32 logits (z - max and
    exp each round at 6e-8 relative) puts ~2e-7 of error on each lp, which sequence-level IS weights
    (a sum of lp over the sequence) lift past 1e-6 of the gradient."""
    return torch.float32 if logits.dtype in (torch.bfloat16, torch.float16) else torch.float64


def _column(x: Temperature, dtype: torch.dtype) -> Temperature:
    """A per-row factor as a [rows, 1] column of `dtype` to broadcast over a chunk, or the float itself."""
    return x.to(dtype).unsqueeze(1) if isinstance(x, torch.Tensor) else x


def _divide_(z: torch.Tensor, temperature: Temperature) -> None:
    """z /= tau in place, row by row for a per-row temperature; nothing to do at one temperature of 1."""
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        z.div_(_column(temperature, z.dtype))


def _row_stats(chunk: torch.Tensor, tokens: torch.Tensor, temperature: Temperature):
    """Shifted scaled logits zs = z/tau - max, exp(zs), and float64 (log_s, lp, H) for one chunk; temperature
    is a float or the chunk's float64 [rows]."""
    z = chunk.to(compute_dtype(chunk), copy=True)
    # an all -inf row gets max -1e30, not -inf (-inf - -inf = nan): its sums are then 0 and its log sum -inf,
    # which is how fused_is/distributed.py tells an empty vocabulary shard from one holding NaN (NaN stays NaN)
    row_max = z.amax(dim=-1, keepdim=True).clamp(min=NEG)
    # lp's own numerator (z_y - max) / tau in float64: fp32 rounding of z / tau alone would cost
    # ulp(20) ~ 2e-6 of absolute logprob error at tau < 1
    target = (z.gather(1, tokens.unsqueeze(1)) - row_max).squeeze(1).double() / temperature
    z.sub_(row_max)  # shift invariance: the max logit becomes 0
    _divide_(z, temperature)
    # a -inf logit becomes -1e30: e = 0 and e * z = 0 (not 0 * -inf = nan); NaN passes (the row's flag)
    z.clamp_(min=NEG)
    e = torch.exp(z)
    sum_exp = e.sum(dim=-1, dtype=torch.float64)
    # sum_j e_j * zs_j accumulated in float64: an fp32 dot product (bmm) over V = 151936 terms is off by ~1e-5
    # relative in H (tests/test_hard_inputs.py, the 2**31 test, caught it); one temporary chunk buffer
    sum_exp_z = (e * z).sum(dim=-1, dtype=torch.float64)
    log_s = torch.log(sum_exp)
    lp = target - log_s
    entropy = log_s - sum_exp_z / sum_exp
    return z, e, sum_exp, log_s, lp, entropy, row_max.squeeze(1)


def _write_grad(z, e, sum_exp, lp, entropy, tokens, g, h, temperature, out, has_h: bool):
    """out <- dloss/dz = ( g (1[j=y] - p) - h p (log p + H) ) / tau  (DESIGN.md section 4).

    The target column is rewritten from float64 scalars: 1 - p_y = (sum_exp - e_y) / sum_exp, so a
    token with p_y near 1 (common in RL) does not lose its gradient to fp32 cancellation in 1 - p_y.
    """
    dtype = z.dtype
    column = tokens.unsqueeze(1)
    e_target = e.gather(1, column).squeeze(1).double()
    p_target = e_target / sum_exp
    target = (g * (sum_exp - e_target) / sum_exp - h * p_target * (lp + entropy)) / temperature
    p = e.div_(sum_exp.to(dtype).unsqueeze(1))
    g_c = g.to(dtype).unsqueeze(1)
    if has_h:  # h = -a_t * entropy_coef: decided by the config, not by reading h on the host
        # log p_j + H = zs_j - log_s + H, with log_s = log sum_exp
        z.add_((entropy - torch.log(sum_exp)).to(dtype).unsqueeze(1)).mul_(h.to(dtype).unsqueeze(1)).add_(g_c)
        grad = z.mul_(p)
    else:
        grad = p.mul_(g_c)
    grad.mul_(_column(-1.0 / temperature, dtype))
    grad.scatter_(1, column, target.to(dtype).unsqueeze(1))
    grad.masked_fill_(((g == 0) & (h == 0)).unsqueeze(1), 0.0)  # masked rows: zeros whatever they hold
    out.copy_(grad)


def stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature, chunk_rows: Optional[int] = None):
    """(lp [N], H [N]) float64 for flat token ids [N]; never more than one chunk in fp32."""
    n = tokens.numel()
    lp = torch.empty(n, dtype=torch.float64, device=logits.device)
    entropy = torch.empty_like(lp)
    with torch.no_grad():
        for rows, chunk in _chunks(logits, chunk_rows):
            chunk_tau = temperature_rows(temperature, rows)
            _, _, _, _, lp[rows], entropy[rows], _ = _row_stats(chunk, tokens[rows], chunk_tau)
    return lp, entropy


def partial_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature,
                  chunk_rows: Optional[int] = None):
    """(lp, H, row max, log sum) float64 [N] each: a vocabulary shard's statistics (fused_is/distributed.py)."""
    out = torch.empty(4, tokens.numel(), dtype=torch.float64, device=logits.device)
    with torch.no_grad():
        for rows, chunk in _chunks(logits, chunk_rows):
            _, _, _, log_s, out[0, rows], out[1, rows], row_max = _row_stats(chunk, tokens[rows],
                                                                             temperature_rows(temperature, rows))
            out[2, rows], out[3, rows] = row_max.double(), log_s
    return tuple(out.unbind(0))


def fused_given(logits: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs,
                grad: torch.Tensor, chunk_rows: Optional[int] = None) -> None:
    """The gradient sweep of a vocabulary shard: the whole rows' max, log sum, lp and H (stats, float64
    [4, N]) and g, h from args (coef_source given); tokens are shard-local ids, outside [0, V) where another
    shard holds the token (no target column here)."""
    table = {name: args.row_table[i] for i, name in enumerate(abi.ROW_INPUTS)}
    inplace = _over_logits(grad, logits)
    vocab = logits.shape[-1]
    grad_rows = None if inplace else grad.view(-1, vocab)
    with torch.no_grad():
        for rows, chunk in _chunks(logits, chunk_rows):
            row_max, log_s, lp, entropy = (x[rows] for x in stats.unbind(0))
            g, h = table["g"][rows], table["h"][rows]
            # the call's one temperature, or the rows' own ([rows] float64)
            tau = args.temperature if args.temperature is not None else 1.0 / table["inv_tau"][rows]
            z = chunk.to(compute_dtype(chunk), copy=True)
            z.sub_(row_max.to(z.dtype).unsqueeze(1))
            _divide_(z, tau)
            z.clamp_(min=NEG)
            # log p_j = zs_j - log_s with the whole row's log sum; grad_j = -p_j (g + h (log p_j + H)) / tau
            log_p = z.sub_(log_s.to(z.dtype).unsqueeze(1))
            p = torch.exp(log_p)
            grad_chunk = log_p.add_((entropy).to(z.dtype).unsqueeze(1)).mul_(h.to(z.dtype).unsqueeze(1))
            grad_chunk.add_(g.to(z.dtype).unsqueeze(1)).mul_(p).mul_(_column(-1.0 / tau, z.dtype))
            # the target column, where this shard has it, from float64 scalars: 1 - p_y = -expm1(lp)
            local = tokens[rows]
            owned = (local >= 0) & (local < vocab)
            column = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(1)
            target = (g * -torch.expm1(lp) - h * torch.exp(lp) * (lp + entropy)) / tau
            kept = grad_chunk.gather(1, column).squeeze(1)
            grad_chunk.scatter_(1, column, torch.where(owned, target.to(z.dtype), kept).unsqueeze(1))
            grad_chunk.masked_fill_(((g == 0) & (h == 0)).unsqueeze(1), 0.0)
            out = chunk if inplace else grad_rows[rows]
            out.copy_(grad_chunk)


def fused(logits: torch.Tensor, tokens: torch.Tensor, args: abi.KernelArgs, grad: torch.Tensor,
          chunk_rows: Optional[int] = None):
    """(lp [N], H [N]) float64, the gradient written into grad chunk by chunk (grad may be the logits themselves,
    inplace). g and h come from args.coefficients (the call's hook: this backend forms them in Python from each
    chunk's lp), or from the row table when the plan gave them (coef_source given: GSPO, GMPO, DPPO); W from the
    row table when the plan precomputed it."""
    given = args.ints["coef_source"] == abi.ENUMS["coef_source"]["given"]
    hook = args.coefficients
    if hook is None:
        raise ValueError("the torch backend takes the call's temperature and g, h from its coefficients hook: "
                         "KernelArgs.coefficients is None (pack the arguments with abi.pack)")
    n = tokens.numel()
    lp = torch.empty(n, dtype=torch.float64, device=logits.device)
    entropy = torch.empty_like(lp)
    inplace = _over_logits(grad, logits)
    full_weight = None
    if args.ints["weight_source"] == abi.ENUMS["weight_source"]["vector"]:
        full_weight = args.row_table[abi.ROW_INPUTS.index("weight")]
    table = {name: args.row_table[i] for i, name in enumerate(abi.ROW_INPUTS)}
    tau = hook.temperature  # the call's own (a float, or float64 [N]): not 1 / inv_tau, which may round
    grad_rows = None if inplace else grad.view(n, logits.shape[-1])
    with torch.no_grad():
        for rows, chunk in _chunks(logits, chunk_rows):
            chunk_tau = temperature_rows(tau, rows)
            z, e, sum_exp, _, lp[rows], entropy[rows], _ = _row_stats(chunk, tokens[rows], chunk_tau)
            if given:
                g, h = table["g"][rows], table["h"][rows]
            else:
                g, h = hook(lp[rows], rows, full_weight)
            out = chunk if inplace else grad_rows[rows]
            _write_grad(z, e, sum_exp, lp[rows], entropy[rows], tokens[rows], g, h, chunk_tau, out, hook.entropy)
    return lp, entropy

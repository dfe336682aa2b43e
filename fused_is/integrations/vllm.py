"""The sampler side (DESIGN.md section 5): vLLM computes lm_head logits, and so logprobs, in fp32.

The trainer computes logprobs from fp32 logits; vLLM by default projects the last hidden state through the
lm_head in the model dtype (bf16), rounds the logits to bf16, and only then takes an fp32 log-softmax. This
module removes that rounding from the sampler's logprobs:

    from vllm import LLM, SamplingParams
    from fused_is.vllm import sampler_kwargs, sampled_logprobs
    llm = LLM(**sampler_kwargs(model=path, dtype="bfloat16"))     # fp32 head + raw_logprobs
    outs = llm.generate(prompts, SamplingParams(logprobs=0, temperature=1.0))
    batch = sampled_logprobs(outs)                              # padded/packed tensors for policy_loss

On vLLM versions whose ModelConfig has `head_dtype` (0.11 and later), sampler_kwargs sets vLLM's own
`hf_overrides={"head_dtype": "float32"}`. On older versions it sets FUSED_IS_VLLM_FP32_HEAD=1, which the
`vllm.general_plugins` entry point of this package (`register_plugin`) reads in every vLLM process, workers
included, to patch the logits computation (`apply`). Importing fused_is never imports vllm.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

ENV_FP32_HEAD = "FUSED_IS_VLLM_FP32_HEAD"  # "1": the plugin patches the head in each vLLM process
ENV_FORCE_PATCH = "FUSED_IS_VLLM_FORCE_PATCH"  # "1": sampler_kwargs uses the patch even where head_dtype exists
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

logger = logging.getLogger("fused_is.vllm")
_originals: Dict[str, Any] = {}
_state = {"logged": False, "warned_quantized": False}


def has_native_head_dtype() -> bool:
    """True when the installed vLLM's ModelConfig has `head_dtype` (set through hf_overrides)."""
    from vllm.config import ModelConfig

    return hasattr(ModelConfig, "head_dtype")


def _native_path() -> bool:
    """Use vLLM's own head_dtype: it exists and FUSED_IS_VLLM_FORCE_PATCH=1 is not set."""
    return has_native_head_dtype() and os.environ.get(ENV_FORCE_PATCH) != "1"


def _check_logprobs_mode(logprobs_mode: Optional[str]) -> None:
    if logprobs_mode is not None and logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES} or None; got {logprobs_mode!r}")


def sampler_kwargs(fp32_lm_head: bool = True, logprobs_mode: Optional[str] = "raw_logprobs", **llm_kwargs) -> dict:
    """Keyword arguments for `vllm.LLM(...)` that make the sampler's logprobs come from fp32 head logits.

    Args:
        fp32_lm_head: compute the lm_head projection in fp32 (the point of this module).
        logprobs_mode: vLLM's logprobs_mode; "raw_logprobs" (the default) returns the log-softmax of the
            model's logits before any temperature / top-k / top-p processing; None leaves it unset.
        **llm_kwargs: passed through (model=..., dtype=..., hf_overrides=... are merged, not replaced).
    Returns:
        dict of keyword arguments. Where vLLM has `head_dtype`, hf_overrides gains
        {"head_dtype": "float32"} (a callable hf_overrides is wrapped). Otherwise (or with
        FUSED_IS_VLLM_FORCE_PATCH=1) FUSED_IS_VLLM_FP32_HEAD=1 is set in os.environ, so the plugin patches
        the head in every vLLM process started from here, and the patch is applied in this process too.
    """
    _check_logprobs_mode(logprobs_mode)
    kwargs = dict(llm_kwargs)
    if logprobs_mode is not None:
        kwargs["logprobs_mode"] = logprobs_mode
    if not fp32_lm_head:
        return kwargs
    if _native_path():
        overrides = kwargs.get("hf_overrides")
        if overrides is None or isinstance(overrides, dict):
            merged = dict(overrides or {})
            if merged.get("head_dtype", "float32") not in ("float32", torch.float32):
                raise ValueError(f"hf_overrides already sets head_dtype={merged['head_dtype']!r}; "
                                 "remove it or pass fp32_lm_head=False")
            merged["head_dtype"] = "float32"
            kwargs["hf_overrides"] = merged
        elif callable(overrides):
            def with_fp32_head(config, _inner=overrides):
                config = _inner(config)
                config.head_dtype = "float32"
                return config

            kwargs["hf_overrides"] = with_fp32_head
        else:
            raise TypeError(f"hf_overrides must be a dict or a callable; got {type(overrides).__name__}")
        return kwargs
    os.environ[ENV_FP32_HEAD] = "1"
    apply()
    return kwargs


def serve_flags(fp32_lm_head: bool = True, logprobs_mode: Optional[str] = "raw_logprobs") -> str:
    """The `vllm serve` equivalent of sampler_kwargs, as a string to paste after the model name.

    With the patch path (vLLM without head_dtype, or FUSED_IS_VLLM_FORCE_PATCH=1) the string starts with
    the environment assignment, e.g. `FUSED_IS_VLLM_FP32_HEAD=1 vllm serve MODEL --logprobs-mode ...`
    is how to use it.
    """
    _check_logprobs_mode(logprobs_mode)
    parts = [] if logprobs_mode is None else [f"--logprobs-mode {logprobs_mode}"]
    if fp32_lm_head:
        if _native_path():
            parts.insert(0, "--hf-overrides '{\"head_dtype\": \"float32\"}'")
        else:
            return f"{ENV_FP32_HEAD}=1 (in the environment of vllm serve) " + " ".join(parts)
    return " ".join(parts)


# ---- the patch (vLLM versions without head_dtype; also forced for testing) ----

def _is_unquantized(lm_head) -> bool:
    method = getattr(lm_head, "quant_method", None)
    if method is None:
        return True
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        return isinstance(method, (UnquantizedEmbeddingMethod, UnquantizedLinearMethod))
    except ImportError:  # very old layouts: go by name
        return type(method).__name__.startswith("Unquantized")


def _fp32_projection(lm_head, hidden_states: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """hidden.float() @ W.float().T (+ bias): fp32 copies, never a cast of the shared (maybe tied) weight."""
    weight = lm_head.weight
    return torch.nn.functional.linear(hidden_states.float(), weight.float(),
                                      bias.float() if bias is not None else None)


def _warn_quantized(lm_head) -> None:
    if not _state["warned_quantized"]:
        _state["warned_quantized"] = True
        warnings.warn(f"fused_is.vllm: lm_head is quantized ({type(lm_head.quant_method).__name__}); it keeps "
                      "vLLM's own head computation (logits not in fp32)", RuntimeWarning, stacklevel=3)


def _wrap_apply_head(original):
    def _apply_head(self, lm_head, hidden_states, embedding_bias=None, *args, **kwargs):
        if not _is_unquantized(lm_head):
            _warn_quantized(lm_head)
            return original(self, lm_head, hidden_states, embedding_bias, *args, **kwargs)
        return _fp32_projection(lm_head, hidden_states, embedding_bias)

    _apply_head.__wrapped__ = original
    return _apply_head


def _wrap_get_logits(original):
    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
        if not _is_unquantized(lm_head):
            _warn_quantized(lm_head)
            return original(self, hidden_states, lm_head, embedding_bias, *args, **kwargs)
        logits = _fp32_projection(lm_head, hidden_states, embedding_bias)
        if getattr(lm_head, "tp_size", 1) > 1:  # the tensor-parallel gather of the original
            logits = self._gather_logits(logits)
        if logits is not None:  # vocab padding removed, as the original does
            logits = logits[..., : self.org_vocab_size]
        return logits

    _get_logits.__wrapped__ = original
    return _get_logits


def _logits_processor_class():
    from vllm.model_executor.layers import logits_processor

    return logits_processor.LogitsProcessor


def active_path() -> str:
    """"patch:_apply_head", "patch:_get_logits" or "none" (this process)."""
    return _originals.get("path", "none")


def apply() -> str:
    """Patch vLLM's LogitsProcessor so that unquantized heads project in fp32. Idempotent.

    Wraps LogitsProcessor._apply_head where it exists, else _get_logits (followed by the tensor-parallel
    gather and the vocabulary slice, as the original does). Quantized heads keep the original path with a
    one-time warning. Raises RuntimeError when neither method exists: never a silent bf16 fallback.
    Returns the active path.
    """
    cls = _logits_processor_class()
    if "path" in _originals:
        return _originals["path"]
    if "_apply_head" in vars(cls):
        name, wrapper = "_apply_head", _wrap_apply_head
    elif "_get_logits" in vars(cls):
        name, wrapper = "_get_logits", _wrap_get_logits
    else:
        raise RuntimeError("fused_is.vllm: this vLLM's LogitsProcessor has neither _apply_head nor _get_logits; "
                           "the fp32 head patch cannot be applied (refusing to fall back to bf16 logits)")
    _originals["cls"], _originals["name"], _originals["fn"] = cls, name, vars(cls)[name]
    setattr(cls, name, wrapper(vars(cls)[name]))
    _originals["path"] = f"patch:{name}"
    if not _state["logged"]:
        _state["logged"] = True
        logger.warning("fused_is.vllm: fp32 lm_head active in process %d via %s", os.getpid(), _originals["path"])
    return _originals["path"]


def undo() -> None:
    """Restore the original LogitsProcessor method (no-op when not patched)."""
    if "path" not in _originals:
        return
    setattr(_originals["cls"], _originals["name"], _originals["fn"])
    _originals.clear()
    _state["logged"] = False


def register_plugin() -> None:
    """`vllm.general_plugins` entry point: vLLM calls it in every process it starts. Acts only when
    FUSED_IS_VLLM_FP32_HEAD=1, and logs once which path is active."""
    if os.environ.get(ENV_FP32_HEAD) != "1":
        return
    apply()


# ---- sampled logprobs for policy_loss ----

@dataclass
class SampledBatch:
    """Sampled completions as tensors for `fused_is.policy_loss` (one row per completion).

    tokens, logprobs, mask: padded [B, T] (int64, float32, bool; right padding).
    packed_tokens, packed_logprobs: [N] concatenations of the unpadded rows; cu_seqlens: int64 [B + 1].
    prompt_token_ids: list of B prompt id lists (the learner's context for each row).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    packed_tokens: torch.Tensor
    packed_logprobs: torch.Tensor
    cu_seqlens: torch.Tensor
    prompt_token_ids: List[List[int]]


def _sampled_logprob(entry, token_id: int) -> float:
    if entry is None:
        raise ValueError("a completion has no logprobs: generate with SamplingParams(logprobs=0)")
    value = entry[token_id] if token_id in entry else None
    if value is None:
        raise ValueError(f"the logprobs of a position do not contain its sampled token {token_id}")
    return float(getattr(value, "logprob", value))


def sampled_logprobs(request_outputs: Iterable[Any]) -> SampledBatch:
    """Sampled token ids and the sampler's logprobs of them from vLLM RequestOutputs (SamplingParams(logprobs=0)).

    Every completion of every request becomes one row, in order. Returns a SampledBatch (padded tensors plus
    mask, and packed tensors plus cu_seqlens), ready for `policy_loss(sampler_logprobs=...)`.
    """
    rows_tok: List[List[int]] = []
    rows_lp: List[List[float]] = []
    prompts: List[List[int]] = []
    for request in request_outputs:
        for completion in request.outputs:
            ids = list(completion.token_ids)
            lps = completion.logprobs
            if lps is None or len(lps) != len(ids):
                raise ValueError("each completion needs one logprob entry per token: SamplingParams(logprobs=0)")
            rows_tok.append(ids)
            rows_lp.append([_sampled_logprob(lps[i], t) for i, t in enumerate(ids)])
            prompts.append(list(request.prompt_token_ids or []))
    lengths = [len(r) for r in rows_tok]
    b, t = len(rows_tok), max(lengths, default=0)
    tokens = torch.zeros(b, t, dtype=torch.long)
    logprobs = torch.zeros(b, t, dtype=torch.float32)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (ids, lps) in enumerate(zip(rows_tok, rows_lp)):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        mask[i, : len(ids)] = True
    cu = torch.zeros(b + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0) if b else cu[1:]
    return SampledBatch(tokens=tokens, logprobs=logprobs, mask=mask, packed_tokens=tokens[mask],
                        packed_logprobs=logprobs[mask], cu_seqlens=cu, prompt_token_ids=prompts)


def kept_ids(request_outputs: Iterable[Any], *, packed: bool = False, max_kept: int = 1024) -> torch.Tensor:
    """The sampler's kept sets (vLLM's CompletionOutput.sampling_mask: the token ids that survived top-k / top-p /
    min-p at each generated position, returned by an engine started with return_sampling_mask=True, which vLLM
    0.32 implements in its GPU model runner) as the `kept=` tensor of policy_loss, token_logprobs and logprobs,
    in the rows of `sampled_logprobs` (every completion of every request, in order).

    Returns int64 [B, T, K] (padded rows, packed=False) or [N, K] (packed), -1 where a position keeps fewer than
    K = the widest set, or has no token (padding). A set wider than max_kept (an untruncated request reports its
    whole support) is a ValueError naming the request: replay is for truncated sampling; leave kept= off there.
    """
    rows = []
    for request in request_outputs:
        for completion in request.outputs:
            mask = getattr(completion, "sampling_mask", None)
            sets = getattr(mask, "token_ids", None)
            if sets is None:
                raise ValueError("a completion has no sampling mask: start the engine with "
                                 "return_sampling_mask=True")
            if len(sets) != len(completion.token_ids):
                raise ValueError(f"a completion's sampling mask has {len(sets)} positions for "
                                 f"{len(completion.token_ids)} tokens")
            widest = max((len(s) for s in sets), default=0)
            if widest > max_kept:
                raise ValueError(f"request {len(rows)} (completion rows in order) keeps {widest} tokens at a position, "
                                 f"more than max_kept={max_kept}: an untruncated sampler's support; pass kept= only "
                                 "for truncated sampling, or raise max_kept")
            rows.append([list(s) for s in sets])
    width = max((len(s) for row in rows for s in row), default=1)
    length = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), length, width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for t, ids in enumerate(row):
            out[b, t, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    if not packed:
        return out
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return out[valid]


def sampler_topk(request_outputs: Iterable[Any], *, packed: bool = False):
    """The sampler's top-K logprobs of every generated position (SamplingParams(logprobs=K): vLLM returns the K most
    likely tokens of each position and the sampled one when it is not among them) as the `sampler_topk=` pair of
    policy_loss (LossConfig.score_centering), in the rows of `sampled_logprobs` (every completion of every request,
    in order). Every entry a position reports is kept: the sampled token's too (its probability is known exactly).

    Returns (ids, logprobs): int64 and float32 [B, T, K'] (padded rows, packed=False) or [N, K'] (packed), K' the
    most entries of any position (K or K + 1); -1 ids (and -inf logprobs) where a position has fewer, or no token
    (padding). The logprobs are those of the distribution `sampled_logprobs` gives the sampled token (the engine's
    logprobs_mode: with a sampling temperature other than 1, "processed_logprobs" gives the distribution the
    tokens were drawn from, which is what the centering needs; pass LossConfig.temperature to match)."""
    rows = []
    for request in request_outputs:
        for completion in request.outputs:
            entries = completion.logprobs
            if entries is None or len(entries) != len(completion.token_ids):
                raise ValueError("each completion needs one logprobs entry per token: SamplingParams(logprobs=K)")
            row = []
            for entry in entries:
                if entry is None:
                    raise ValueError("a completion position has no logprobs: generate with SamplingParams(logprobs=K)")
                row.append([(int(token), float(getattr(value, "logprob", value))) for token, value in entry.items()])
            rows.append(row)
    width = max((len(position) for row in rows for position in row), default=1)
    length = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), length, width), -1, dtype=torch.long)
    logprobs = torch.full((len(rows), length, width), -math.inf, dtype=torch.float32)
    for b, row in enumerate(rows):
        for t, position in enumerate(row):
            ids[b, t, :len(position)] = torch.tensor([token for token, _ in position], dtype=torch.long)
            logprobs[b, t, :len(position)] = torch.tensor([value for _, value in position], dtype=torch.float32)
    if not packed:
        return ids, logprobs
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return ids[valid], logprobs[valid]

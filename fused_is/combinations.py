"""The option combinations fused_is refuses, declared once (DESIGN.md section 10): each with why, and whether the math
leaves it undefined or it is not built yet. Every such refusal in the package raises `refused(key)` of an entry here,
so its text is this table's; docs/compatibility.md is rendered from it (`render`); tests hold both. Whatever is not
listed composes."""

from __future__ import annotations

import dataclasses
import re
from typing import Dict


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Two options that do not go together: as the user writes them, why, and whether a later version may lift it."""

    first: str
    second: str
    why: str
    final: bool = False  # True: undefined (or meaningless) by the math or the design; False: not built yet

    def text(self, **values) -> str:
        """The error's text; `values` fill the {placeholders} of the options and the reason."""
        state = "not supported" if self.final else "not supported yet"
        return f"{self.first} with {self.second} is {state}: {self.why}".format(**values)


COMPILE = "torch.compile"
REFUSALS: Dict[str, Refusal] = {
    # --- under torch.compile ---------------------------------------------------------------------------------------
    "inplace/compile": Refusal("inplace=True", COMPILE, "the gradient would be written over a graph input; use "
                               "inplace=False or call eagerly", final=True),
    "reference/compile": Refusal("backend='reference'", COMPILE, "the oracle's checks read the host; use a fused "
                                 "backend or call eagerly", final=True),
    "kept/compile": Refusal("kept=", COMPILE, "the kept sets are gathered in eager code; call eagerly"),
    "centering/compile": Refusal("sampler_topk= (score centering)", COMPILE, "its columns are patched in eager code; "
                                 "call eagerly"),
    "vocab_group/compile(logprobs)": Refusal("vocab_group", f"{COMPILE} (token_logprobs, logprobs)",
                                             "the shard statistics run eagerly there; call eagerly"),
    "head_dtype/compile(logprobs)": Refusal("head_dtype", f"{COMPILE} (logprobs)", "its blocks are rounded in eager "
                                            "code; call eagerly"),
    "term_options/compile": Refusal("a distillation term", f"{COMPILE} and per-row temperature= or head_dtype replay",
                                    "the term's kernel-level ops take one temperature and the logits as they are; call "
                                    "policy_loss eagerly"),
    # --- the oracle ------------------------------------------------------------------------------------------------
    "reference/inplace": Refusal("backend='reference'", "inplace=True", "the oracle differentiates by autograd",
                                 final=True),
    "reference/vocab_group": Refusal("backend='reference'", "vocab_group", "the oracle is single-process; use "
                                     "{backends}", final=True),
    "reference/sequence_group": Refusal("backend='reference'", "sequence_group", "the oracle is single-process; use "
                                        "'cpu', 'triton', 'cuda' or 'torch'", final=True),
    # --- vocabulary and context parallel ---------------------------------------------------------------------------
    "cuda/vocab_group": Refusal("backend='cuda'", "vocab_group", "the CUDA kernels have no vocabulary-parallel path; "
                                "use {backends}"),
    "kept/vocab_group": Refusal("kept=", "vocab_group", "each shard holds part of the kept set"),
    "centering/vocab_group": Refusal("LossConfig.score_centering", "vocab_group", "the top-K columns lie in several "
                                     "ranks' shards"),
    "top_k/vocab_group": Refusal("distill_loss(top_k={top_k})", "vocab_group", "its support is the top k of the whole "
                                 "vocabulary, across the shards; use top_k=0 (the full vocabulary) or gather the "
                                 "shards"),
    "whole_batch/sequence_group": Refusal("LossConfig.policy={policy!r}", "sequence_group (context parallel)",
                                          "its token selection is over the whole batch's tokens, which the ranks "
                                          "split", final=True),
    "m2po/sequence_group": Refusal("LossConfig.m2_threshold", "sequence_group (context parallel)", "M2PO ranks the "
                                   "tokens of the whole batch"),
    "term/linear_vocab_group": Refusal("LossConfig.distill_kind", "vocab_group on the fused-linear path", "the "
                                       "teacher's head chunks are not sharded yet"),
    # --- options of the loss ---------------------------------------------------------------------------------------
    "centering/kept": Refusal("LossConfig.score_centering", "kept=", "the kept-set replay already renormalises the "
                              "learner over the sampler's support", final=True),
    "calibrated/loglinear": Refusal("LossConfig.score_centering='calibrated'", "ratio_ref='loglinear'", "the sampled "
                                    "token's weight would be f((p / q)^alpha), whose expectation over the sampler's "
                                    "support is not the one formed here"),
    "m2po/loglinear": Refusal("LossConfig.m2_threshold", "ratio_ref='loglinear'", "the proximal logprob M2PO ranks by "
                              "would depend on the current one: a stats pass first"),
    "kl_ratio/sequence": Refusal("LossConfig.kl_weight='ratio'", "ratio_level='sequence'", "TRL weights the KL by the "
                                 "sequence ratio there"),
    "kl_weight/straight_through": Refusal("LossConfig.kl_weight={weight!r}", "kl_type={kl_type!r}", "the weight adds "
                                          "the estimator's value to its gradient, and a straight-through kl_type's "
                                          "gradient is k2's alone", final=True),
    "kl_input_clamp/straight_through": Refusal("LossConfig.kl_input_clamp", "kl_type={kl_type!r}", "a straight-through "
                                               "gradient is k2's alone, which the clamp would not bind", final=True),
    "term/linear_kept": Refusal("LossConfig.distill_kind", "kept= on the fused-linear path", "the kept columns of the "
                                "teacher's head chunks are not gathered yet"),
    "kept/head_dtype(logprobs)": Refusal("fused_is.logprobs(kept=)", "head_dtype", "the kept logits are not rounded "
                                         "there yet (policy_loss and token_logprobs take both)"),
    # --- the distillation kernels ----------------------------------------------------------------------------------
    "top_k/kernels": Refusal("distill_loss(top_k={top_k})", "backend={backend!r}", "the support's buckets run on "
                             "backend='torch'; use backend='torch' or 'auto', or top_k=0"),
    "kernel_less/kernels": Refusal("kind={kind!r}", "backend={backend!r}", "the divergence table's row has no kernel "
                                   "code: it runs on backend='torch'; use backend='torch' or 'auto'", final=True),
}


def refused(key: str, **values) -> ValueError:
    """The ValueError of the refusal `key` (REFUSALS), its placeholders filled from `values`."""
    return ValueError(REFUSALS[key].text(**values))


def render() -> str:
    """The table of docs/compatibility.md: every refused combination, whether it is final, and why."""
    def shown(text: str) -> str:  # a placeholder reads as <name>
        return re.sub(r"\{(\w+)(![rs])?\}", r"<\1>", text)

    lines = ["| option | with | status | why |", "|---|---|---|---|"]
    for refusal in REFUSALS.values():
        status = "refused (undefined or by design)" if refusal.final else "not yet"
        lines.append(f"| {shown(refusal.first)} | {shown(refusal.second)} | {status} | {shown(refusal.why)} |")
    return "\n".join(lines) + "\n"

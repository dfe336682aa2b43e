"""Runs real vLLM engines on a tiny random model, in a process of its own (vLLM spawns workers, so this
file has a __main__ guard); tests/test_vllm.py starts it and reads the JSON it writes.

    python tests/vllm_support/engine.py build MODELS_DIR          # MODELS_DIR/untied and MODELS_DIR/tied
    python tests/vllm_support/engine.py MODELS_DIR OUT.json SCENARIO [SCENARIO ...]

A scenario is "<model>/<head>-<logprobs_mode>": model in {untied, tied}; head in {default, native, patch}:
default = vLLM's bf16 head, native = sampler_kwargs() on this vLLM (hf_overrides head_dtype), patch =
sampler_kwargs() with FUSED_IS_VLLM_FORCE_PATCH=1 (the plugin patches the head inside vLLM's processes).
VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the caller) runs the engine in this process, which is much
faster here; the patch scenarios run in vLLM's default multi-process engine.
"""

import json
import os
import sys
import time


def build_model(path: str, tie: bool, seed: int = 0) -> None:
    """A tiny random Qwen2 (2 layers, hidden 128, 2 heads of 64, vocab 512) saved with transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=tie, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init, so the softmax is not flat
        model.lm_head.weight.normal_(0.0, 0.5)
        if tie:
            model.model.embed_tokens.weight = model.lm_head.weight
    model.to(torch.bfloat16).save_pretrained(path)


PROMPTS = [[1, 5, 9, 200, 17], [3, 3, 3], [100, 200, 300, 400, 500, 7, 8]]
VOCAB = 512


def run_scenario(model: str, scenario: str) -> dict:
    from vllm import LLM, SamplingParams

    from fused_is.vllm import ENV_FORCE_PATCH, active_path, sampled_logprobs, sampler_kwargs

    model_name, spec = scenario.split("/")
    model = os.path.join(model, model_name)
    head, mode = spec.split("-", 1)
    os.environ.pop(ENV_FORCE_PATCH, None)
    os.environ.pop("FUSED_IS_VLLM_FP32_HEAD", None)
    if head == "patch":
        os.environ[ENV_FORCE_PATCH] = "1"
    # max_num_seqs=1: every head GEMM has one row, so its fp32 accumulation order cannot depend on how the
    # scheduler happened to batch requests (with batching, the same run gave 1-ulp differences run to run).
    # raw_logits scenarios ask for every logit of every position (logprobs = vocab): the tests recover the
    # hidden state from them and check the head's arithmetic
    full = mode == "raw_logits"
    base = dict(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
                max_num_seqs=1, max_num_batched_tokens=128, seed=0, max_logprobs=VOCAB if full else 20)
    kwargs = sampler_kwargs(fp32_lm_head=head != "default", logprobs_mode=mode, **base)
    start = time.time()
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=VOCAB if full else 0, seed=1, n=2,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    batch = sampled_logprobs(outs)
    result = {"scenario": scenario, "tokens": batch.tokens.tolist(), "logprobs": batch.logprobs.tolist(),
              "mask": batch.mask.tolist(), "prompts": batch.prompt_token_ids, "seconds": time.time() - start,
              "hf_overrides": str(kwargs.get("hf_overrides")), "parent_patch": active_path(),
              "env_fp32_head": os.environ.get("FUSED_IS_VLLM_FP32_HEAD")}
    if full:  # [positions, VOCAB] logits of every completion position, in completion order
        rows = []
        for request in outs:
            for completion in request.outputs:
                for entry in completion.logprobs:
                    row = [0.0] * VOCAB
                    for token_id, value in entry.items():
                        row[token_id] = float(value.logprob)
                    rows.append(row)
        result["full_logits"] = rows
    del llm
    import gc

    gc.collect()
    return result


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build_model(os.path.join(sys.argv[2], "untied"), tie=False)
        build_model(os.path.join(sys.argv[2], "tied"), tie=True)
        sys.exit(0)
    model_dir, out_path, *scenarios = sys.argv[1:]
    results = [run_scenario(model_dir, s) for s in scenarios]
    with open(out_path, "w") as f:
        json.dump(results, f)

"""Drop-ins for the trainers' own loss code (`trl`, `trl_distill`, `verl`, `openrlhf`, `areal`, `nemo_rl`) and the
samplers' side (`vllm`, `sglang`; also importable under their old names `fused_is.vllm` and `fused_is.sglang`, the
same module objects).

Each trainer submodule imports its trainer (`areal` only looks AReaL up: its package imports its training stack;
`nemo_rl` needs no NeMo-RL), so import it only where that trainer is installed; `import fused_is` imports none of
them, and this package imports no submodule.
"""

"""Launch configurations of the Triton row kernels (issue #18): $FUSED_IS_TRITON_BLOCK, $FUSED_IS_TRITON_WARPS and
$FUSED_IS_TRITON_PROGRAMS_PER_SM (_fused_kernel's programs per SM in place of the L2 rule).

- the overrides reach the launches of _fused_kernel and _row_stats_kernel, read at each launch, and the results
  stay those of the float64 reference (under the interpreter, at small V, for two configurations other than
  the default); bad values raise a ValueError naming the variable; unset, the launch is the default;
- every configuration bench/gpu_suite.sh times compiles for sm_90 without spills. Run as a script, this file
  compiles given configurations ahead of time the way bench/gpu/gpu_build_check.py does (the headline's launches,
  recorded under the interpreter, at the production variant: V = 151936, 16-byte aligned) and prints registers,
  spills and the rows resident per SM (bench/gpu/gpu_perf_report.py's occupancy rules):

    python tests/test_triton_configs.py [--configs 4096x8@4 8192x16 ...]   # default: the GPU suite's TRITON_CONFIGS
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GPU_TOOLS = ROOT / "bench" / "gpu"  # gpu_build_check.py, gpu_perf_report.py
SUITE = ROOT / "bench" / "gpu_suite.sh"


def parse_config(word: str) -> tuple:
    """'8192x16' -> (8192, 16, None); '8192x16@2' -> (8192, 16, 2): BLOCK, num_warps, programs per SM."""
    shape, _, programs = word.lower().partition("@")
    block, warps = (int(x) for x in shape.split("x"))
    return block, warps, int(programs) if programs else None


def suite_configs() -> list:
    """The TRITON_CONFIGS=(...) of bench/gpu_suite.sh, as (BLOCK, num_warps, programs per SM or None) triples."""
    match = re.search(r"^TRITON_CONFIGS=\(([^)]*)\)", SUITE.read_text(), re.M)
    assert match, "bench/gpu_suite.sh has no TRITON_CONFIGS=(...) line"
    return [parse_config(word) for word in shlex.split(match.group(1))]


# ----------------------------------------------------------------------------------------------------
# ahead-of-time compile per configuration (no pytest needed: run in a process without TRITON_INTERPRET)

RECORD_STEP = r'''
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
import conftest  # installs the Triton launch recorder (TRITON_INTERPRET=1)
import torch
from fused_is.benchmarks import main as bench
from fused_is.backends import triton as launcher
p = bench.make_problem(4, 1024, torch.bfloat16, "cpu")
bench.run_step("triton_inplace", p["logits"].requires_grad_(), p)  # the headline's _fused_kernel
launcher.stats(p["logits"].detach(), p["tokens"], 1.0)  # _row_stats_kernel
conftest.pytest_sessionfinish(None, 0)
'''


def record_launches(path: Path) -> list:
    """The headline's Triton launches (bf16 ppo_tis in place) and a _row_stats_kernel launch, recorded by
    tests/conftest.py's recorder under the interpreter at a tiny size, default configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSED_IS_TRITON_")}
    env.update(TRITON_INTERPRET="1", FUSED_IS_TRITON_LAUNCHES=str(path))
    proc = subprocess.run([sys.executable, "-c", RECORD_STEP.format(tests=str(TESTS), repo=str(ROOT))],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"recording the launches failed: {(proc.stderr or proc.stdout)[-2000:]}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compile_configs(configs, launches, arch: int = 90) -> list:
    """One record per (configuration, kernel): the production ("aligned") specialization compiled for sm_<arch>
    with BLOCK = min(block, next_pow2(151936)), num_warps = warps and _fused_kernel's maxnreg for its programs per
    SM (the override, else the L2 rule); registers and spills from ptxas -v, rows per SM from the occupancy rules."""
    import gpu_build_check
    import gpu_perf_report
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_is.backends import triton as launcher

    ptxas = gpu_perf_report.nvidia_tool("ptxas")
    if ptxas is None:
        raise RuntimeError("ptxas not found (neither Triton's bundled copy nor the CUDA toolkit)")
    gpu = gpu_perf_report.GPU()
    out = []
    saved = {name: os.environ.get(name) for name in (launcher.BLOCK_ENV, launcher.PROGRAMS_ENV)}
    try:
        for block, warps, programs in configs:
            # the production variant's BLOCK is launcher.block_size(151936) and its maxnreg fused_grid's for the
            # production row: the overrides decide them
            os.environ[launcher.BLOCK_ENV] = str(block)
            os.environ[launcher.PROGRAMS_ENV] = str(programs or "")
            varied = [dict(launch, options=dict(launch["options"], num_warps=warps)) for launch in launches
                      if launch["kernel"] in ("_fused_kernel", "_row_stats_kernel")]
            for desc, fn, signature, constexprs, attrs, options in gpu_build_check.specializations(
                    varied, variants=("aligned",), launch_block=False):
                record = dict(config=f"{block}x{warps}" + (f"@{programs}" if programs else ""), kernel=desc["kernel"],
                              arch=f"sm_{arch}", BLOCK=desc["constexprs"].get("BLOCK"), num_warps=options["num_warps"],
                              maxnreg=options.get("maxnreg"))
                try:
                    source = ASTSource(fn, signature, gpu_build_check.for_arch(fn, constexprs, arch), attrs)
                    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(options))
                    ptx = gpu_build_check._ptxas_report(compiled.asm["ptx"], ptxas)
                    smem = 1024 + int(getattr(compiled.metadata, "shared", 0) or 0)  # + the 1 KB the driver reserves
                    occupancy = gpu_perf_report.occupancy(ptx["registers"], 32 * warps, smem, gpu)
                    rows = occupancy["blocks_per_sm"]
                    if desc["kernel"] == "_fused_kernel":  # persistent: the grid's programs per SM at most
                        rows = min(rows, programs or launcher.programs_per_sm(gpu.l2_bytes, gpu.sms, 151936 * 2, warps))
                    record.update(registers=ptx["registers"], spill_bytes=ptx["spill_store_bytes"] +
                                  ptx["spill_load_bytes"], rows_per_sm=rows, limited_by=occupancy["limited_by"])
                except Exception as exc:  # reported per configuration; the check fails at the end
                    record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                out.append(record)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compile Triton launch configurations for sm_90; report "
                                     "registers, spills and rows per SM")
    parser.add_argument("--configs", nargs="+", help="BLOCKxWARPS[@PROGRAMS_PER_SM] (default: bench/gpu_suite.sh's "
                        "TRITON_CONFIGS)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", type=Path, help="write the records here too")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles the kernels for the GPU")
    os.environ.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)
    sys.path[:0] = [str(GPU_TOOLS), str(TESTS), str(ROOT)]
    configs = [parse_config(c) for c in args.configs] if args.configs else suite_configs()
    with tempfile.TemporaryDirectory() as tmp:
        launches = record_launches(Path(tmp) / "launches.jsonl")
    records = compile_configs(configs, launches, args.arch)
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}, V = 151936 (aligned variant)")
    print(f"{'config':<11} {'kernel':<18} {'BLOCK':>6} {'warps':>5} {'maxnreg':>7} {'regs':>5} {'spill B':>7} "
          f"{'rows/SM':>7}")
    for r in records:
        if "error" in r:
            print(f"{r['config']:<11} {r['kernel']:<18} FAILED: {r['error']}")
        else:
            print(f"{r['config']:<11} {r['kernel']:<18} {r['BLOCK']:>6} {r['num_warps']:>5} {r['maxnreg'] or '-':>7} "
                  f"{r['registers']:>5} {r['spill_bytes']:>7} {r['rows_per_sm']:>7}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    bad = [r for r in records if "error" in r or r["spill_bytes"]]
    print(f"{len(records)} compiles, {len(bad)} failed or spilled")
    return 1 if bad or not records else 0


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------------------------------
# tests

import pytest  # noqa: E402
import torch  # noqa: E402

import fused_is  # noqa: E402
from cases import check_against_reference, make_inputs  # noqa: E402
from fused_is.backends import triton as launcher  # noqa: E402

# the launch tests run the kernels on CPU tensors: under the interpreter (tests/conftest.py sets it)
launching = pytest.mark.skipif(launcher.unavailable_reason(torch.empty(1, 2)) is not None,
                               reason=str(launcher.unavailable_reason(torch.empty(1, 2))))


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(launcher.BLOCK_ENV, raising=False)
    monkeypatch.delenv(launcher.WARPS_ENV, raising=False)
    monkeypatch.delenv(launcher.PROGRAMS_ENV, raising=False)
    monkeypatch.delenv(launcher.HINTS_ENV, raising=False)
    return monkeypatch


class _Recording:
    """Stands in for the kernel module: each kernel launch is noted (note(name, kwargs): by default name, BLOCK,
    num_warps), then made."""

    def __init__(self, module, seen: list,
                 note=lambda name, kwargs: (name, kwargs.get("BLOCK"), kwargs.get("num_warps"))):
        self._module, self._seen, self._note = module, seen, note

    def __getattr__(self, name):
        kernel = getattr(self._module, name)
        seen, note = self._seen, self._note

        class Launcher:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def call(*args, **kwargs):
                    seen.append(note(name, kwargs))
                    return launch(*args, **kwargs)

                return call

        return Launcher()


@pytest.fixture
def launches(clean_env):
    seen = []
    recording = _Recording(launcher.kernels(), seen)
    clean_env.setattr(launcher, "kernels", lambda: recording)
    return seen


def test_default_launch_unchanged(clean_env):
    assert launcher.launch_config(151936) == dict(BLOCK=launcher.BLOCK, num_warps=launcher.NUM_WARPS) == \
        dict(BLOCK=16384, num_warps=32)
    assert launcher.launch_config(1000) == dict(BLOCK=1024, num_warps=32)
    clean_env.setenv(launcher.BLOCK_ENV, "")  # empty: unset
    clean_env.setenv(launcher.WARPS_ENV, " ")
    assert launcher.launch_config(151936) == dict(BLOCK=16384, num_warps=32)


def test_rows_triton_cannot_vectorise_launch_smaller_blocks(clean_env, launches):
    """Contiguous rows whose stride is not a multiple of 16 elements (an odd V) or whose data is off a 16-byte
    boundary take UNALIGNED_BLOCK lanes (at 4096 they spill on sm_90), both kernels; aligned rows keep BLOCK."""
    import torch

    assert launcher.rows_aligned(torch.zeros(3, 4096, dtype=torch.bfloat16))
    assert not launcher.rows_aligned(torch.zeros(3, 4099, dtype=torch.bfloat16))
    assert not launcher.rows_aligned(torch.zeros(3 * 4096 + 1, dtype=torch.bfloat16)[1:].view(3, 4096))
    assert launcher.rows_aligned(torch.zeros(2, 5, 4096, dtype=torch.bfloat16)[:, :-1])  # [B, L + 1, V][:, :-1]
    assert launcher.launch_config(4099, aligned=False) == dict(BLOCK=launcher.UNALIGNED_BLOCK, num_warps=32)
    assert launcher.launch_config(151936, aligned=False)["BLOCK"] == 2048
    assert launcher.launch_config(1000, aligned=False)["BLOCK"] == 1024  # a row shorter than the cap
    clean_env.setenv(launcher.BLOCK_ENV, "4096")  # an override still decides
    assert launcher.launch_config(4099, aligned=False)["BLOCK"] == 4096
    clean_env.delenv(launcher.BLOCK_ENV)
    inputs = make_inputs("packed", dtype=torch.bfloat16, seed=3, vocab=4099)
    fused_is.policy_loss(inputs.logits.clone().requires_grad_(), inputs.tokens, inputs.advantages, backend="triton",
                         **inputs.kwargs(with_old=False), config="seq_tis").loss.backward()
    assert {(name, block) for name, block, _ in launches} == {("_row_stats_kernel", 2048), ("_fused_kernel", 2048)}


def test_overrides_are_read_at_each_launch(clean_env):
    """One process times several configurations: nothing is cached."""
    clean_env.setenv(launcher.BLOCK_ENV, "8192")
    clean_env.setenv(launcher.WARPS_ENV, "16")
    assert launcher.launch_config(151936) == dict(BLOCK=8192, num_warps=16)
    assert launcher.launch_config(1000) == dict(BLOCK=1024, num_warps=16)  # a row shorter than the cap
    clean_env.setenv(launcher.BLOCK_ENV, "128")
    clean_env.setenv(launcher.WARPS_ENV, "1")
    assert launcher.launch_config(151936) == dict(BLOCK=128, num_warps=1)
    clean_env.delenv(launcher.BLOCK_ENV)
    assert launcher.launch_config(151936) == dict(BLOCK=16384, num_warps=1)


def test_rocm_caps_the_warps_at_its_workgroup_limit(clean_env, monkeypatch):
    """On a ROCm build of torch a Triton warp is a 64-lane wavefront and a workgroup takes at most 1024 threads: the
    default 32 warps would be 2048 lanes, which no AMD GPU launches. The default is capped at 16 there, an override
    above the cap is refused by name, and the programs per SM count 64 lanes a warp."""
    assert launcher.launch_config(151936)["num_warps"] == 32  # CUDA (and the interpreter): 32 lanes a warp
    threads_cuda = launcher.programs_per_sm(2**30, 1, 1, 16)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert launcher.launch_config(151936)["num_warps"] == 16
    assert launcher.num_warps() * launcher.warp_size() <= 1024
    assert launcher.programs_per_sm(2**30, 1, 1, 16) == threads_cuda // 2
    clean_env.setenv(launcher.WARPS_ENV, "32")
    with pytest.raises(ValueError, match=launcher.WARPS_ENV):
        launcher.num_warps()
    clean_env.setenv(launcher.WARPS_ENV, "8")
    assert launcher.num_warps() == 8


# two configurations other than the default; V = 1000: BLOCK 128 takes 7 full blocks and a masked tail,
# BLOCK 512 one full block and a tail (the default launches 1024, one masked block)
CONFIGS = [(128, 2), (512, 16)]


@launching
@pytest.mark.parametrize("block,warps", CONFIGS, ids=[f"{b}x{w}" for b, w in CONFIGS])
@pytest.mark.parametrize("preset,with_old,kernels", [
    ("ppo_tis", True, {"_fused_kernel"}),                          # token-local: one pass
    ("seq_tis", False, {"_row_stats_kernel", "_fused_kernel"}),    # sequence IS without old: two passes
], ids=["ppo_tis", "seq_tis_two_pass"])
def test_overrides_change_the_launch_and_match_reference(launches, clean_env, block, warps, preset, with_old,
                                                         kernels):
    clean_env.setenv(launcher.BLOCK_ENV, str(block))
    clean_env.setenv(launcher.WARPS_ENV, str(warps))
    inputs = make_inputs("packed", vocab=1000, dtype=torch.float32, seed=block + warps)
    check_against_reference(inputs, preset, "triton", inplace="forward", with_old=with_old)
    assert {name for name, _, _ in launches} == kernels, launches
    assert set(launches) == {(name, block, warps) for name in kernels}, launches
    assert launcher.LAST_LAUNCH["_fused_kernel"]["BLOCK"] == block
    assert launcher.LAST_LAUNCH["_fused_kernel"]["num_warps"] == warps


@launching
def test_default_launch_records(launches):
    inputs = make_inputs("padded", vocab=300, dtype=torch.float32)
    check_against_reference(inputs, "ppo_tis", "triton")
    assert set(launches) == {("_fused_kernel", 512, launcher.NUM_WARPS)}


@launching
@pytest.mark.parametrize("name,value", [
    ("FUSED_IS_TRITON_BLOCK", "100"),     # not a power of two
    ("FUSED_IS_TRITON_BLOCK", "64"),      # below 128
    ("FUSED_IS_TRITON_BLOCK", "32768"),   # above 16384
    ("FUSED_IS_TRITON_BLOCK", "4k"),
    ("FUSED_IS_TRITON_WARPS", "3"),
    ("FUSED_IS_TRITON_WARPS", "64"),
    ("FUSED_IS_TRITON_WARPS", "0"),
    ("FUSED_IS_TRITON_WARPS", "-8"),
    ("FUSED_IS_TRITON_WARPS", "8.0"),
])
def test_bad_values_raise_naming_the_variable(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        launcher.launch_config(151936)
    # and through the public call, when the launcher reads it
    inputs = make_inputs("packed", vocab=200, dtype=torch.float32)
    with pytest.raises(ValueError, match=name):
        check_against_reference(inputs, "ppo_tis", "triton")


def test_programs_per_sm_override(clean_env):
    """$FUSED_IS_TRITON_PROGRAMS_PER_SM replaces the L2 rule's programs per SM in _fused_kernel's grid (and its
    register cap follows); unset or empty, the rule decides."""
    logits = torch.zeros(64, 151936, dtype=torch.bfloat16)
    rule = launcher.programs_per_sm(launcher.INTERPRETER_L2_BYTES, 1, 151936 * 2, 32)
    assert launcher.fused_grid(logits, 64, 32) == (rule, launcher.fused_registers(32, rule))
    clean_env.setenv(launcher.PROGRAMS_ENV, "")
    assert launcher.programs_override(32) is None
    clean_env.setenv(launcher.PROGRAMS_ENV, "2")
    assert launcher.fused_grid(logits, 64, 32) == (2, 32)  # 2 programs x 1 "SM" off a GPU; 2048 threads: 32 registers
    clean_env.setenv(launcher.PROGRAMS_ENV, "4")
    assert launcher.fused_grid(logits, 64, 8) == (4, 64)
    assert launcher.fused_grid(logits, 3, 8)[0] == 3  # at most one program per row


@launching
@pytest.mark.parametrize("value,warps", [("0", 32), ("33", 32), ("two", 32), ("1.5", 32), ("4", 32), ("8", 16)])
def test_bad_programs_per_sm_raise_naming_the_variable(clean_env, value, warps):
    """Out of 1..32, not an integer, or more programs of num_warps than leave each thread 32 registers (4 of 32
    warps: 16): a ValueError naming the variable, at the launch and through the public call."""
    clean_env.setenv(launcher.PROGRAMS_ENV, value)
    clean_env.setenv(launcher.WARPS_ENV, str(warps))
    with pytest.raises(ValueError, match=launcher.PROGRAMS_ENV):
        launcher.programs_override(warps)
    inputs = make_inputs("packed", vocab=200, dtype=torch.float32)
    with pytest.raises(ValueError, match=launcher.PROGRAMS_ENV):
        check_against_reference(inputs, "ppo_tis", "triton", inplace="forward")


@launching
def test_programs_per_sm_override_matches_reference(clean_env):
    """Two programs per SM (under the interpreter: two programs in all, each taking every other row of the
    persistent loop) give the reference's results."""
    clean_env.setenv(launcher.PROGRAMS_ENV, "2")
    clean_env.setenv(launcher.WARPS_ENV, "8")
    inputs = make_inputs("packed", vocab=1000, dtype=torch.float32, seed=5)
    check_against_reference(inputs, "ppo_tis", "triton", inplace="forward")


def test_l2_hints_from_sm90_and_in_the_build_check(clean_env):
    """_fused_kernel's L2 eviction hints are on from compute capability 9 (off the GPU, the interpreter: off);
    $FUSED_IS_TRITON_L2_HINTS 0 / 1 overrides the rule, anything else is refused by name; the build check compiles
    sm_90 with them and sm_80 without, as the launcher would launch there."""
    assert [launcher.l2_hints(major) for major in (None, 7, 8, 9, 10)] == [False, False, False, True, True]
    assert not launcher.l2_hints_on(torch.device("cpu"))
    clean_env.setenv(launcher.HINTS_ENV, "0")
    assert not launcher.l2_hints(9)
    clean_env.setenv(launcher.HINTS_ENV, "1")
    assert launcher.l2_hints(None) and launcher.l2_hints_on(torch.device("cpu"))
    for bad in ("2", "on", "-1"):
        clean_env.setenv(launcher.HINTS_ENV, bad)
        with pytest.raises(ValueError, match=launcher.HINTS_ENV):
            launcher.l2_hints(9)
    clean_env.delenv(launcher.HINTS_ENV)
    sys.path.insert(0, str(GPU_TOOLS))
    import gpu_build_check

    fn = launcher.kernels()._fused_kernel
    key = (fn.arg_names.index("L2_HINTS"),)
    assert gpu_build_check.for_arch(fn, {key: False}, 90)[key] is True
    assert gpu_build_check.for_arch(fn, {key: True}, 80)[key] is False
    stats_kernel = launcher.kernels()._row_stats_kernel
    assert gpu_build_check.for_arch(stats_kernel, {(0,): 1}, 90) == {(0,): 1}  # no such parameter: unchanged


@launching
@pytest.mark.parametrize("inplace", [False, "forward"])
def test_l2_hints_on_give_the_reference(clean_env, inplace):
    """The hinted kernel (forced on under the interpreter, which ignores the policy but runs the same code) launches
    with L2_HINTS and gives the reference's results, in place and with a separate gradient."""
    seen = []
    recording = _Recording(launcher.kernels(), seen, lambda name, kwargs: (name, kwargs.get("L2_HINTS")))
    clean_env.setattr(launcher, "kernels", lambda: recording)
    clean_env.setenv(launcher.HINTS_ENV, "1")
    inputs = make_inputs("packed", vocab=1000, dtype=torch.bfloat16, seed=11)
    check_against_reference(inputs, "ppo_tis", "triton", inplace=inplace)
    assert seen == [("_fused_kernel", True)]


@pytest.mark.slow
def test_suite_configs_compile_for_sm90_without_spills():
    """bench/gpu_suite.sh's TRITON_CONFIGS, each compiled ahead of time for sm_90 (this file as a script)."""
    import triton

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("no ptxas bundled with triton")
    configs = suite_configs()
    assert (launcher.BLOCK, launcher.NUM_WARPS, None) == configs[0]  # the default first: it survives a timeout
    assert len(set(configs)) == len(configs) >= 4
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", launcher.BLOCK_ENV,
                                                            launcher.WARPS_ENV, launcher.PROGRAMS_ENV)}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "configs.json"
        proc = subprocess.run([sys.executable, __file__, "--json", str(report)], capture_output=True, text=True,
                              env=env, cwd=str(ROOT), timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        records = json.loads(report.read_text())
    compiled = {(r["config"], r["kernel"]) for r in records}
    assert compiled == {(f"{b}x{w}" + (f"@{p}" if p else ""), k) for b, w, p in configs
                        for k in ("_fused_kernel", "_row_stats_kernel")}
    assert all(r["spill_bytes"] == 0 for r in records), records
    # the configurations span the rows resident per SM (the L2 rule's one row at V = 151936, and 2 and 4 through the
    # programs-per-SM override: twice and four times the rows in flight) and the threads a row gets
    fused = [r for r in records if r["kernel"] == "_fused_kernel"]
    assert {r["rows_per_sm"] for r in fused} == {1, 2, 4}, records
    assert len({r["num_warps"] for r in fused}) >= 3, records


GPU_IMAGE_PAIR = Path(__file__).resolve().parent.parent / "build" / "triton-3.6.0"
_INTERPRETER_SCRIPT = """
import torch, numpy, triton, fused_is
assert triton.__version__ == "3.6.0" and numpy.__version__ >= "2.4", (triton.__version__, numpy.__version__)
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 300, generator=g, requires_grad=True)
ids, adv = torch.randint(0, 300, (6,), generator=g), torch.randn(6, generator=g)
kw = dict(sampler_logprobs=torch.full((6,), -5.0), config="ppo_tis")
out = fused_is.policy_loss(x, ids, adv, backend="triton", **kw)
ref = fused_is.policy_loss(x, ids, adv, backend="reference", **kw)
assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * max(1.0, abs(float(ref.loss))), (out.loss, ref.loss)
print("interpreted", float(out.loss))
"""


@pytest.mark.slow
def test_the_interpreter_runs_with_the_gpu_images_triton_and_numpy():
    """Triton 3.6 (the GPU image's) interprets _fused_kernel's persistent loop with numpy >= 2.4 (the image's too):
    its interpreter needs fused_is' compatibility patch for that pair (backends/triton.py). scripts/dev.sh setup puts
    the pair in build/triton-3.6.0; CI must have it."""
    if not (GPU_IMAGE_PAIR / "triton" / "__init__.py").exists() or not (GPU_IMAGE_PAIR / "numpy").exists():
        if os.environ.get("CI"):
            pytest.fail(f"{GPU_IMAGE_PAIR} is missing: scripts/dev.sh setup installs triton 3.6.0 and numpy there")
        pytest.skip(f"{GPU_IMAGE_PAIR} is missing: run `bash scripts/dev.sh setup`")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(GPU_IMAGE_PAIR), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreted" in result.stdout

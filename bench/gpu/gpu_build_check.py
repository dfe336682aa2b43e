"""Proof, on a machine without a GPU, that every GPU kernel builds for the GPU.

The CPU interpreter runs Triton kernels as plain Python and accepts code that the GPU compiler rejects
(a non-constexpr global, for one), so passing tests say nothing about the GPU build. This check:

1. Triton: reads the launches that the test suite made under the interpreter (tests/conftest.py records
   each one: kernel, pointer dtypes, 16-byte alignment, integer values, constexprs, num_warps), rebuilds
   the specialization the GPU JIT would build for the same arguments (Triton's own binder, fed stand-in
   tensors), adds the variants a production shape builds (every pointer and integer divisible by 16, since
   test vocabularies are odd and odd sizes make Triton fall back to scalar loads, with the BLOCK the launcher
   picks for V = 151936; and the same with 64-bit integers, as strides of [B, T, V] logits beyond 2**31
   elements are), and compiles each ahead of time
   for sm_90 and sm_80. ptxas -v gives registers and spill bytes; the PTX gives the global load/store
   widths.
2. CUDA: compiles each kernel source of csrc/cuda/ (CUDA_SOURCES: the policy loss's and distillation's) with nvcc
   for sm_90 with -Xptxas -v.

Fails on any compile error or any spill; prints a one-line summary and writes a report next to the launch
record. Run by `scripts/dev.sh test` after pytest:

    python bench/gpu/gpu_build_check.py [--launches build/triton_launches.jsonl ...] [--arch 90 80] [--no-cuda]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # bench/gpu/ -> the repository root
DEFAULT_LAUNCHES = REPO / "build" / "triton_launches.jsonl"
PRODUCTION_L2_BYTES = 60 * 10**6  # an H200 (cudaDeviceProp::l2CacheSize); 132 SMs
PRODUCTION_SMS = 132
PRODUCTION_VOCAB = 151936  # Qwen's padded vocabulary: a multiple of 16

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# qualifiers include the hints' (.L1::evict_last, .L2::cache_hint)
_PTX_GLOBAL = re.compile(r"\b(ld|st)\.global((?:\.[A-Za-z0-9_:]+)*)\.([bfsu])(\d+)\b")


# ----------------------------------------------------------------------------------------------------
# Triton


class _StandInTensor:
    """What Triton's binder reads from a tensor argument: its dtype and the alignment of its address."""

    def __init__(self, dtype, aligned: bool):
        self.dtype = dtype
        self._ptr = 0 if aligned else 2  # 2: a bf16 element's offset, never 16-byte aligned

    def data_ptr(self) -> int:
        return self._ptr


def _argument(name: str, desc: dict, variant: str, constexpr: bool):
    import torch

    if "tensor" in desc:
        return _StandInTensor(getattr(torch, desc["tensor"]), desc["aligned"] or variant != "launched")
    if "int" in desc:
        value = desc["int"]
        if variant == "launched" or constexpr or value == 1:  # 1 is a constexpr in every variant (stride_col of a row)
            return value
        value = (value + 15) // 16 * 16  # a production size or stride: a multiple of 16
        return value + 2**32 if variant == "aligned_i64" else value
    if "float" in desc:
        return desc["float"]
    if "bool" in desc:
        return desc["bool"]
    return None


def _itemsize(dtype_name: str) -> int:
    import torch

    return getattr(torch, dtype_name).itemsize


def _row_element_size(launch: dict) -> int:
    """The element size the launcher sizes BLOCK by: the logits', or for the distillation kernels (a teacher row
    beside the student's) the bytes of one column of both (fused_is/backends/triton.py column_bytes)."""
    logits = _itemsize(launch["args"]["logits_ptr"]["tensor"])
    if "tensor" not in launch["args"].get("teacher_ptr", {}):
        return logits
    from fused_is.backends.triton import column_bytes

    return column_bytes(logits, _itemsize(launch["args"]["teacher_ptr"]["tensor"]))


def _columns_strided(launch: dict) -> bool:
    """Whether a row of the launch (the logits', or the teacher's) has columns that are not contiguous."""
    return any(launch["args"].get(name, {}).get("int", 1) != 1 for name in ("stride_col", "teacher_stride_col"))


def _production_maxnreg(launch: dict, logits: str) -> int:
    """The maxnreg the launcher passes a persistent _fused_kernel launch of the production row (V = PRODUCTION_VOCAB
    of the launch's logits dtype) on the production device (PRODUCTION_L2_BYTES, PRODUCTION_SMS): fused_grid's rule
    for the launch's num_warps ($FUSED_IS_TRITON_PROGRAMS_PER_SM's programs per SM when set, as the launcher reads
    it). A launch recorded at a tiny V had many programs per SM, hence a smaller cap."""
    from fused_is.backends import triton as launcher

    warps = launch["options"].get("num_warps", launcher.NUM_WARPS)
    per_sm = launcher.programs_override(warps) or launcher.programs_per_sm(
        PRODUCTION_L2_BYTES, PRODUCTION_SMS, PRODUCTION_VOCAB * _itemsize(logits), warps)
    return launcher.fused_registers(warps, per_sm)


def _overridden(launch: dict) -> bool:
    """True for a launch whose num_warps is not the launcher's default (FUSED_IS_TRITON_WARPS, the GPU suite's
    launch-config sweep): its production variants keep the BLOCK it launched with, since the default BLOCK at
    other warps is a configuration nobody launches (4096 lanes on 2 warps spills)."""
    from fused_is.backends import triton as launcher

    return launch["options"].get("num_warps", launcher.NUM_WARPS) != launcher.NUM_WARPS


def _jit_function(module: str, kernel: str):
    if module.startswith("fused_is.triton_kernels"):
        from fused_is.backends.triton import kernels

        kernels()  # registers fused_is.triton_kernels when running from a source tree
    return getattr(importlib.import_module(module), kernel)


def specializations(launches: list, variants=("launched", "aligned", "aligned_i64"), launch_block: bool = True) -> list:
    """Unique (description, JITFunction, signature, constexprs, attrs, options) over launches x variants,
    built by Triton's own binder exactly as JITFunction.run builds them on a GPU. launch_block: a launch with
    non-default num_warps (a launch-config override) keeps its own BLOCK in the production variants; False gives
    them the launcher's BLOCK for the production vocabulary (the config sweep's compile sets it by the override)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    out, seen = [], set()
    for launch in launches:
        fn = _jit_function(launch["module"], launch["kernel"])
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        constexpr_names = {p.name for p in fn.params if p.is_constexpr}
        for variant in variants:
            kwargs = {name: _argument(name, desc, variant, name in constexpr_names) for name, desc in launch["args"].items()}
            logits = launch["args"].get("logits_ptr", {}).get("tensor")
            if variant != "launched" and "BLOCK" in launch["args"] and logits:  # the production BLOCK of its dtype
                from fused_is.backends import triton as launcher

                kwargs["BLOCK"] = launcher.block_size(PRODUCTION_VOCAB, element_size=_row_element_size(launch))
            elif variant != "launched" and "BLOCK" in launch["args"]:  # no logits (_scale_kernel): its own BLOCK
                kwargs["BLOCK"] = launch["args"]["BLOCK"]["int"]
            if variant != "launched" and "BLOCK" in launch["args"] and launch_block and _overridden(launch):
                kwargs["BLOCK"] = launch["args"]["BLOCK"]["int"]  # a launch-config override: its own BLOCK
            elif variant != "launched" and _columns_strided(launch):
                from fused_is.backends import triton as launcher  # columns not contiguous: the launcher's cap

                kwargs["BLOCK"] = launcher.block_size(PRODUCTION_VOCAB, contiguous=False)
            if variant != "launched" and "WHOLE_GROUPS" in launch["args"]:
                kwargs["WHOLE_GROUPS"] = PRODUCTION_VOCAB % 16 == 0  # the production row's, not the test's V
            options = dict(launch["options"])
            if variant != "launched" and "maxnreg" in options and logits:
                options["maxnreg"] = _production_maxnreg(launch, logits)  # the production row's grid, not tiny V's
            kwargs.update(options)
            kwargs.setdefault("debug", False)
            bound, spec, packed = binder(**kwargs)
            packed, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, packed)
            key = (launch["module"], launch["kernel"], json.dumps(signature, sort_keys=True), repr(constexprs),
                   repr(sorted(attrs.items())), repr(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            named = {fn.arg_names[path[0]]: value for path, value in constexprs.items()}
            desc = dict(kernel=launch["kernel"], variant=variant, options=options,
                        constexprs={k: v for k, v in named.items() if k.isupper() or k == "BLOCK"},
                        specialized_to_1=sorted(k for k, v in named.items() if not k.isupper() and v == 1),
                        divisible_by_16=sorted(fn.arg_names[p[0]] for p, value in attrs.items() if value),
                        signature={k: v for k, v in signature.items() if v != "constexpr"})
            out.append((desc, fn, signature, constexprs, attrs, options))
    return out


def _ptxas_report(ptx: str, ptxas: str) -> dict:
    """Registers and spill bytes from ptxas -v; global load/store widths (bits -> count) from the PTX."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={target}", str(path), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    text = proc.stdout + proc.stderr
    spills = [(int(a), int(b)) for a, b in _PTXAS_SPILL.findall(text)]
    widths = {"ld": {}, "st": {}}
    for op, mods, _, bits in _PTX_GLOBAL.findall(ptx):
        vec = re.search(r"\.v(\d)", mods)
        total = int(bits) * (int(vec.group(1)) if vec else 1)
        widths[op][total] = widths[op].get(total, 0) + 1
    return dict(target=target, registers=max(int(r) for r in _PTXAS_USED.findall(text)),
                spill_store_bytes=sum(s for s, _ in spills), spill_load_bytes=sum(lo for _, lo in spills),
                global_load_bits=widths["ld"], global_store_bits=widths["st"])


def ttir(fn, signature: dict, constexprs: dict, attrs: dict, options: dict, arch: int = 90) -> str:
    """The TTIR of one specialization (a row of `specializations`) for sm_<arch>: triton.compile's first stages
    alone (the frontend and the TTIR passes), which need no GPU, no ptxas and a fraction of the compile's time."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    src = ASTSource(fn, signature, constexprs, attrs)
    parsed = backend.parse_options(dict(options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(),
                         context)
    stages: dict = {}
    backend.add_stages(stages, parsed, src.language)
    return str(stages["ttir"](module, dict(hash="ttir", target=target, **parsed.__dict__)))


def for_arch(fn, constexprs: dict, arch: int) -> dict:
    """The constexprs of a specialization as the launcher sets them on sm_<arch>: L2_HINTS (a kernel that has it) is
    fused_is.backends.triton.l2_hints of the architecture, whatever the recorded launch (the interpreter's: off)."""
    if "L2_HINTS" not in fn.arg_names:
        return constexprs
    from fused_is.backends import triton as launcher

    out = dict(constexprs)
    out[(fn.arg_names.index("L2_HINTS"),)] = launcher.l2_hints(arch // 10)
    return out


_SPECS: list = []  # set before the worker processes fork: they read it, nothing JIT-compiled is pickled


def _compile_one(args) -> dict:
    index, arch = args
    desc, fn, signature, constexprs, attrs, options = _SPECS[index]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
    record = dict(desc, index=index, arch=f"sm_{arch}")
    constexprs = for_arch(fn, constexprs, arch)
    if "L2_HINTS" in desc["constexprs"]:
        record["constexprs"] = dict(desc["constexprs"], L2_HINTS=constexprs[(fn.arg_names.index("L2_HINTS"),)])
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=dict(options))
        record.update(_ptxas_report(compiled.asm["ptx"], ptxas))
    except Exception as exc:  # reported per specialization; the check fails at the end
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        record["error"] = f"{type(root).__name__}: {root}; in {type(exc).__name__}: {exc}"[:3000]
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def check_triton(launch_files, archs, jobs: int) -> list:
    launches = [json.loads(line) for path in launch_files for line in path.read_text().splitlines() if line.strip()]
    _SPECS[:] = specializations(launches)
    work = [(i, arch) for i in range(len(_SPECS)) for arch in archs]
    # fork: the children inherit the imported kernels and _SPECS (no re-import, no pickling of JIT functions)
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile_one, work))


# ----------------------------------------------------------------------------------------------------
# CUDA


def nvcc_path():
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return str(Path(candidate) / "bin" / "nvcc")
    return None


# the kernel sources of csrc/cuda/ (bindings.cpp is host code)
CUDA_SOURCES = ("policy_loss_cuda.cu", "distill_cuda.cu")


def check_cuda(arch: int = 90) -> list:
    """nvcc -Xptxas -v of each CUDA kernel source: one record per kernel instantiation (registers, spills)."""
    nvcc = nvcc_path()
    if nvcc is None:
        return [dict(kernel=f"csrc/cuda/{source}", arch=f"sm_{arch}", error="nvcc not found")
                for source in CUDA_SOURCES]
    return [record for source in CUDA_SOURCES for record in _check_cuda_source(nvcc, source, arch)]


def _check_cuda_source(nvcc: str, source: str, arch: int) -> list:
    path = f"csrc/cuda/{source}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch=sm_{arch}", "-O3", "--expt-relaxed-constexpr", "-Xptxas", "-v",
               f"-I{REPO / 'csrc'}", "-c", str(REPO / "csrc" / "cuda" / source), "-o", str(Path(tmp) / "kernel.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return [dict(kernel=path, arch=f"sm_{arch}", error=proc.stderr[-3000:])]
    records, current = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        function = re.search(r"Compiling entry function '(\S+)'", line)
        if function:
            current = dict(kernel=_demangle(function.group(1)), source=path, arch=f"sm_{arch}", spill_store_bytes=0,
                           spill_load_bytes=0)
            records.append(current)
        elif current is not None:
            spill = _PTXAS_SPILL.search(line)
            if spill:
                current["spill_store_bytes"] += int(spill.group(1))
                current["spill_load_bytes"] += int(spill.group(2))
            used = _PTXAS_USED.search(line)
            if used:
                current["registers"] = int(used.group(1))
    if not records:
        records.append(dict(kernel=path, arch=f"sm_{arch}", error="ptxas -v reported no kernel"))
    return records


def _demangle(name: str) -> str:
    filt = shutil.which("c++filt")
    if filt is None:
        return name
    return subprocess.run([filt, name], capture_output=True, text=True).stdout.strip() or name


# ----------------------------------------------------------------------------------------------------


def _widths(bits) -> str:
    return "/".join(f"{b}b" for b in sorted({int(b) for b in bits}, reverse=True)) or "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=Path, nargs="+", default=[DEFAULT_LAUNCHES],
                        help="launch records; the first must exist, later ones are read when they do")
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cuda", action="store_true", help="skip the nvcc build of csrc/cuda")
    parser.add_argument("--report", type=Path, help="JSON report (default: next to the launch record)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this check compiles the kernels for the GPU")
    if not args.launches[0].exists():
        parser.error(f"{args.launches[0]} does not exist: run the test suite first (tests/conftest.py records "
                     "the Triton launches it makes)")
    # the GPU JIT honours this escape hatch; a production launch would not have it set
    os.environ.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)
    sys.path.insert(0, str(REPO))  # a source tree without an install still finds fused_is

    start = time.perf_counter()
    triton_records = check_triton([path for path in args.launches if path.exists()], args.arch, args.jobs)
    cuda_records = [] if args.no_cuda else check_cuda()
    report = args.report or args.launches[0].with_name("gpu_build_report.json")
    report.write_text(json.dumps(dict(triton=triton_records, cuda=cuda_records), indent=1))

    failures = [r for r in triton_records + cuda_records
                if "error" in r or r.get("spill_store_bytes", 0) or r.get("spill_load_bytes", 0)]
    groups = {}
    for r in triton_records:
        if "error" not in r:
            groups.setdefault((r["kernel"], r["variant"], r["arch"]), []).append(r)
    print(f"{'kernel':<18} {'variant':<12} {'arch':<6} {'specs':>5} {'regs':>8} {'spill':>5}  "
          f"{'global ld widths':<18} st widths")
    for (kernel, variant, arch), rs in groups.items():
        regs = sorted(r["registers"] for r in rs)
        loads = {b for r in rs for b in r["global_load_bits"]}
        stores = {b for r in rs for b in r["global_store_bits"]}
        print(f"{kernel:<18} {variant:<12} {arch:<6} {len(rs):>5} {f'{regs[0]}-{regs[-1]}':>8} "
              f"{sum(r['spill_store_bytes'] + r['spill_load_bytes'] for r in rs):>5}  {_widths(loads):<18} "
              f"{_widths(stores)}")
    cuda_groups = {}  # a kernel's instantiations (template arguments: dtypes, divergence) on one line
    for r in cuda_records:
        if "error" not in r:
            name = r["kernel"].replace("(anonymous namespace)::", "").split("(")[0].split("<")[0]
            cuda_groups.setdefault((name.replace("void ", ""), r["arch"]), []).append(r)
    for (name, arch), rs in cuda_groups.items():
        regs = sorted(r.get("registers", 0) for r in rs)
        print(f"cuda {name}: {arch}, {len(rs)} instantiations, {regs[0]}-{regs[-1]} registers, "
              f"spill {sum(r['spill_store_bytes'] + r['spill_load_bytes'] for r in rs)} B")
    for r in failures:
        what = r.get("error") or f"spills {r['spill_store_bytes']} B stored, {r['spill_load_bytes']} B loaded"
        print(f"FAILED {r['kernel']} {r.get('variant', '')} {r['arch']}: {what}", file=sys.stderr)
    ok = [r for r in triton_records if "error" not in r]
    n_specs = len({r["index"] for r in triton_records})
    worst = max(ok, key=lambda r: r["registers"], default=None)
    cuda_ok = [r for r in cuda_records if "error" not in r]
    worst_regs = f"{worst['registers']} ({worst['kernel']}, {worst['arch']})" if worst else "-"
    spilled = sum(r.get("spill_store_bytes", 0) + r.get("spill_load_bytes", 0) for r in ok)
    import triton

    summary = (f"gpu build check (triton {triton.__version__}): {n_specs} Triton specializations x {'/'.join(f'sm_{a}' for a in args.arch)} = "
               f"{len(triton_records)} compiles, {len(triton_records) - len(ok)} failed; max registers "
               f"{worst_regs}; spills {spilled} B")
    if not args.no_cuda:
        summary += (f"; CUDA sm_90: {len(cuda_ok)} kernels, max registers "
                    f"{max((r.get('registers', 0) for r in cuda_ok), default='-')}, spills "
                    f"{sum(r['spill_store_bytes'] + r['spill_load_bytes'] for r in cuda_ok)} B")
    summary += f" ({time.perf_counter() - start:.0f} s; report {report})"
    print(summary)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

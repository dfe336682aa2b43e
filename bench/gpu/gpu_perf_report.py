"""Static performance report of the headline case, on a machine without a GPU (issue #18 item 2).

The headline: H200 (or H100: --gpu), N = 16384 rows, V = 151936, bf16 logits, forward + backward of preset ppo_tis
in place (one Triton `_fused_kernel` launch, or one CUDA `fused_rows_kernel<__nv_bfloat16, true>` launch), and the same
problem through Liger-Kernel's `triton_grpo_loss` (its forward and backward kernels, as the bench's liger provider
launches them). For each kernel, compiled ahead of time for sm_90 at the production variant (every pointer and size
divisible by 16, the BLOCK the launcher picks for V = 151936), this report gives:

1. registers, spills, shared memory and threads per block, and the resident blocks (= rows) per SM, by the
   rules of the CUDA occupancy calculator (registers allocated per warp in units of 256, in 4 sub-partitions), or
   the launcher's grid for a persistent kernel (PERSISTENT_KERNELS: programs_per_sm of fused_is/backends/triton.py).
2. the rows in flight against the usable L2, sweep 2's L2 hit rate and the HBM traffic (model below).
3. from the SASS (cuobjdump -sass of the cubin): every innermost loop (a backward `BRA` to an earlier
   address), its instructions along the hot path (model below) by class, and per element (elements per thread
   per iteration from the loop's global loads: their bits / 16 for bf16). A loop with global loads and stores is
   sweep 2, one with loads and no store sweep 1 (a loop that only stores, a masked row's zeros, is neither); per
   sweep the loop that handles the most elements per iteration is the main loop (ties: fewer predicated (masked)
   memory instructions); other loops of the sweep (a masked tail loop, an unrolled copy's remainder) are listed but
   not counted. Liger's forward kernel has a sweep 1 only, its backward a sweep 2 only.
4. the global load/store widths of those loops, and the straight-line code outside them (serial_code).
5. kernel time as a range (low, central, high), launches apart, and a ranking of the providers (Liger's two
   kernels summed), for the case asked for (in place, or --separate-gradient) and the other case beside it.

A prediction, not a measurement (issue #40 item 3). The model (every constant is in GPU and HEADLINE below, with its
source; CLI flags override some):

- L2 (l2_hit, l2_hit_sets, l2_hit_range): a row's element is read in sweep 1 and again in sweep 2, which runs
  backwards. Its LRU stack distance: an element x of the row from its end is re-read after x F (k - h) bytes of
  other lines (F: the bytes of the rows in flight at random phases; k = 2 when the gradient is written over the
  logits, 3 into a buffer of its own, whose writes take lines too). Fully associative, it hits while that is below
  the usable L2 C: h (k - h) = C / F, h = 1 once C >= (k - 1) F (the high hit rate). In an LRU of 16-way sets with
  hashed addresses it is lost once 16 of those lines map to its set (a Poisson count): the central hit rate over
  the usable fraction, the low one over a smaller fraction (l2_usable_fraction_low). The smooth min(1, C / F) of
  random replacement is reported beside them.
- HBM traffic = N x R x (2 - h) reads + N x R writes + N x 96 B of per-row inputs and outputs
  (row table 9 x float64, token int64, lp and H), R = V x 2 bytes. Liger: N x R read by the forward, N x R read and
  written by the backward.
- Each sweep's main loop (_sweep_clocks), per SM, per step (every resident warp runs one iteration; w warps per
  scheduler): busy = w x the iteration's instructions (or MUFU's, 4 lanes per scheduler); bandwidth = the step's HBM
  bytes at the SM's share of the copy bandwidth (L2's for the hits); each load's load-to-use distance (load_use: the
  instructions from the load to the first one reading its register, into the next iteration for a look-ahead) and
  a one-warp simulation of the loop with in-order issue (iteration_clocks) give the round trips a warp waits for.
  Low (full overlap): max(busy, one warp's iteration at one instruction a clock). Central: the scheduler as a server
  shared by its w warps, each alternating its issue and its exposed wait (machine-repairman model, mean value
  analysis: _repairman_clocks). High (partial overlap): the warps in lockstep (one instruction every w clocks, as
  after the barrier that starts a sweep), the round trip at least the step's bandwidth time: issue after a load's
  first use adds to the memory time. The time-weighted bytes in flight per thread (bytes x round trip / iteration
  time) are reported beside the bytes issued.
- Kernel time, each bound = max(traffic / copy bandwidth, sum over the sweeps of steps x clocks per step / clock) +
  the serial term; the low bound with the high hit rate, the high bound with the low one; launches x launch overhead
  apart. Not modelled: the torch ops around the launch.
- Serial (serial_code): the straight-line code a row runs outside the loops (straight_path: the hot-path rule of
  the loops, loops stepped over, taking the branch a masked row's zeros are not on when falling through would miss
  a sweep). One warp's chain (_serial_cost): issued in order with a register scoreboard, each instruction one clock
  after the previous or when its registers are ready; results ready the GPU's per-kind latency later (shuffles,
  shared and local memory, barriers, MUFU, fp64, ALU); a global load's an HBM latency later, so a load read at once
  costs a round trip and one read after a sweep costs nothing; a sweep's main loop not fed by a block loaded
  before it starts with a round trip of its own (HBM for sweep 1, L2 for sweep 2). For a persistent kernel the row
  loop's turn is the per-row cost and the code before it (the prologue) counts once a block. Every warp of every
  resident block runs that code: its issue slots (warps per SM x instructions / 4 schedulers; an overestimate where
  code is guarded for one warp). The serial range: one warp's chain (low), max(chain, all warps' issue) (central:
  full overlap), their sum (high: none). Times the rows
  each resident block runs in turn (ceil(N / (SMs x rows per SM))). Every instruction outside the loops (every
  policy's code) as one chain is reported beside it.
- Hot path of a loop body: from the loop's first instruction, straight on; a conditional branch is taken as not
  taken, an unconditional forward branch as taken, the backward branch ends the iteration. nvcc lays out the
  common case as the fall-through (the online softmax's "no new maximum" path: its first-element and rescale
  paths are branched to); predicated instructions are counted (they issue whether or not they execute).
  The static count (every instruction of the body) is reported beside it as an upper bound.

    python bench/gpu/gpu_perf_report.py [--out-dir build] [--arch 90] [--no-cuda] [--clock-ghz 1.98] ...

Writes build/gpu_perf_report.json, build/gpu_perf_report.md (printed) and the SASS of each kernel under
build/gpu_perf/. Exits non-zero only when a tool fails (record, compile, disassembly), never on a slow
prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent  # bench/gpu/
REPO = HERE.parents[1]
TESTS = REPO / "tests"  # conftest.py there records the Triton launches of the headline step
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpu_build_check  # noqa: E402  (bench/gpu/: compile helpers, production variant, ptxas -v parsing)


@dataclasses.dataclass
class GPU:
    """H200 SXM by default; GPUS holds the other machines a GPU run may get (their differences from it)."""

    name: str = "H200 SXM"
    key: str = "h200"  # GPUS's
    sms: int = 132  # NVIDIA H100/H200 datasheets (GH100 with 132 SMs enabled in the SXM parts)
    regs_per_sm: int = 65536  # CUDA C Programming Guide, compute capability 9.0 table
    reg_alloc_unit: int = 256  # registers allocated per warp in units of 256 (CUDA occupancy calculator)
    sub_partitions: int = 4  # 4 SM sub-partitions (schedulers), each with a quarter of the register file
    threads_per_sm: int = 2048  # compute capability 9.0: 64 warps per SM
    blocks_per_sm: int = 32  # compute capability 9.0
    smem_per_sm: int = 228 * 1024  # compute capability 9.0: 228 KB per SM (227 KB per block + 1 KB reserved)
    smem_alloc_unit: int = 128  # shared memory allocation granularity (CUDA occupancy calculator)
    # L2: H100 SXM's cudaDeviceProp::l2CacheSize is 52428800 (50 MiB); the H200 reports 60 MB (the audit of
    # issue #28). To be read from the device on the first GPU run.
    l2_bytes: int = 60 * 10**6
    # not all of it holds a streamed row: two partitions (a far hit crosses the crossbar), set-associativity,
    # other data; 0.75 is the largest persisting set-aside the CUDA runtime allows (A100: 30 of 40 MB). Assumed.
    l2_usable_fraction: float = 0.75
    # the range of the L2 model (l2_hit_range): the high hit rate is a fully associative LRU over the usable
    # fraction above; the central one an LRU of l2_ways-way sets (hashed addresses: a line is lost once l2_ways of the
    # lines used since map to its set) over the same; the low one the same sets over l2_usable_fraction_low.
    # Hopper's associativity is not published (A100 microbenchmarks point to 16 ways). Assumed.
    l2_ways: int = 16
    l2_usable_fraction_low: float = 0.6
    # L2 hit bandwidth (the second sweep's hits): published H100 microbenchmarks measure 5.5-7 TB/s. Assumed.
    l2_bandwidth: float = 6.0e12
    hbm_peak: float = 4.8e12  # H200 datasheet, bytes/s
    hbm_copy: float = 4.3e12  # achievable device-to-device copy bandwidth (issue #18's figure, ~90% of peak)
    # max SM boost clock of H100/H200 SXM (nvidia-smi max clocks; TechPowerUp: 1980 MHz). Under a tensor
    # load the datasheet's peak TFLOPS imply ~1.83 GHz; a memory-bound kernel stays near the max.
    clock_hz: float = 1.98e9
    issue_per_clock_per_sm: int = 4  # 4 schedulers, 1 warp-instruction per clock each
    mufu_per_clock_per_sm: int = 16  # MUFU.EX2 lanes per SM per clock (CUDA C Programming Guide, cc 9.0 throughputs)
    launch_overhead_s: float = 10e-6  # per kernel launch: launch latency + grid drain, a typical 5-10 us. Assumed.
    # latency of a global load under a streaming load, for Little's law: bandwidth <= bytes in flight / latency.
    # Published H100 microbenchmarks put an idle DRAM access near 500 ns and an L2 hit near 250-300 ns; loaded
    # latency is higher. Assumed, to be replaced by a measurement on the device.
    hbm_latency_s: float = 650e-9
    l2_latency_s: float = 300e-9
    # dependent latencies (SM clocks) of the straight-line code outside the loops, for the serial per-row term:
    # published Hopper microbenchmarks put a warp shuffle and a shared-memory access near 25-30 clocks, MUFU near
    # 15-20, an fp64 add or fma near 8, a barrier at least a shuffle's; other instructions are counted at their issue
    # slot (1 clock: independent of each other). Assumed.
    alu_clocks: int = 4  # a dependent fp32 / integer operation (published Hopper microbenchmarks: 4-6). Assumed.
    shuffle_clocks: int = 24
    shared_clocks: int = 24
    barrier_clocks: int = 24
    mufu_clocks: int = 18
    fp64_clocks: int = 8


# The machines the device tool lends (--gpu; bench/gpu_suite.sh picks the one it runs on): what differs from GPU()'s
# H200. Both are GH100 with 132 SMs at the same clocks. H100 SXM 80 GB: HBM3 at 3.35 TB/s (datasheet); a device copy
# moved about 3.0 TB/s (read + write) and torch reported 50 MB of L2 (52428800 bytes) on the lent machine.
GPUS = {"h200": {},
        "h100": dict(name="H100 SXM 80GB", l2_bytes=50 * 2**20, hbm_peak=3.35e12, hbm_copy=3.0e12)}


@dataclasses.dataclass
class Headline:
    rows: int = 16384
    vocab: int = 151936
    dtype: str = "bf16"
    elem_bytes: int = 2
    row_extra_bytes: int = 96  # row table 9 x float64 + token int64 + lp and H float64
    copy_floor_traffic_reads: int = 1  # the floor: 1 read + 1 write of the logits
    # the headline provider (fused_is.benchmarks HEADLINE, triton_inplace_forward) writes the gradient over the logits
    # it has just read: no L2 footprint of its own. A provider that writes a separate gradient buffer (inplace=False)
    # allocates a new line in L2 for every line it writes (--separate-gradient).
    inplace: bool = True
    # what-if (--eviction-hints): sweep 1's loads evict_last, sweep 2's loads and stores evict_first, as if the L2
    # honoured them (issue #40's cheap kernel step; not in the kernels today, and not verified on a device)
    eviction_hints: bool = False


# ----------------------------------------------------------------------------------------------------
# SASS


@dataclasses.dataclass
class Instr:
    addr: int
    pred: str  # "" or "@P0", "@!P1", ...
    opcode: str  # with modifiers: "LDG.E.128.CONSTANT"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def target(self):
        """Branch target address (BRA, BRA.DIV, BSSY ...), or None."""
        if self.base not in _BRANCHES:
            return None
        found = re.findall(r"0x([0-9a-fA-F]+)", self.operands)
        return int(found[-1], 16) if found else None

    @property
    def conditional(self) -> bool:
        """May fall through: guarded by a predicate (not @PT), a predicate operand, or a divergence branch."""
        if self.pred and self.pred != "@PT":
            return True
        if ".DIV" in self.opcode or ".CONV" in self.opcode:
            return True
        return bool(re.match(r"\s*!?(U?P\d|UPT)\b", self.operands))


_BRANCHES = {"BRA", "JMP", "BRX", "JMX"}
_SASS_LINE = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+([^;]*?)\s*;")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)", re.M)


def parse_sass(text: str) -> dict:
    """cuobjdump -sass text -> {function name: [Instr]} (one entry "" when no Function header is present)."""
    functions, current = {}, None
    for line in text.splitlines():
        header = _FUNCTION.match(line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        match = _SASS_LINE.search(line)
        if not match:
            continue
        if current is None:
            current = functions.setdefault("", [])
        body = match.group(2).strip()
        pred = ""
        if body.startswith("@"):
            pred, _, body = body.partition(" ")
        opcode, _, operands = body.strip().partition(" ")
        current.append(Instr(int(match.group(1), 16), pred, opcode, operands.strip()))
    return functions


def find_loops(instrs: list) -> list:
    """Innermost loops as (start, end) addresses: a backward branch at `end` to `start` (several back edges
    to one start make one loop, ending at the last); a loop containing another is left out."""
    back = {}
    for ins in instrs:
        target = ins.target
        if target is not None and target <= ins.addr:
            back[target] = max(back.get(target, 0), ins.addr)
    loops = sorted(back.items())
    return [(s, e) for s, e in loops
            if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]


def hot_path(instrs: list, start: int, end: int) -> list:
    """One iteration along the fall-through path (see the module docstring)."""
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    k, path, seen = index[start], [], set()
    while k < len(instrs) and instrs[k].addr <= end and instrs[k].addr not in seen:
        ins = instrs[k]
        seen.add(ins.addr)
        path.append(ins)
        if ins.base in _BRANCHES and not ins.conditional:
            target = ins.target
            if target is None or target <= ins.addr or target > end or target not in index:
                break
            k = index[target]
            continue
        if ins.base in ("EXIT", "RET") and not ins.conditional:
            break
        k += 1
    return path


_CLASSES = [  # (class, opcodes); first match wins; MUFU and memory handled apart
    ("fp32", {"FFMA", "FMUL", "FADD", "FMNMX", "FFMA32I", "FMUL32I", "FADD32I", "FSWZADD", "FCHK"}),
    ("pred_select", {"FSETP", "FSEL", "ISETP", "SEL", "PLOP3", "PSETP", "P2R", "R2P", "FSET", "ISET", "VOTE", "VOTEU",
                     "UISETP", "USEL", "UPLOP3"}),
    ("convert", {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "PRMT", "FRND", "UPRMT", "I2F.U64"}),
    ("move", {"MOV", "MOV32I", "CS2R", "S2R", "S2UR", "UMOV", "R2UR", "ULDC", "LDC"}),
    ("integer", {"IADD3", "IMAD", "IMAD.WIDE", "LEA", "SHF", "LOP3", "IABS", "IMNMX", "VIADD", "VIMNMX", "IADD",
                 "IMUL", "ISCADD", "SHL", "SHR", "POPC", "FLO", "BREV", "IDP", "UIADD3", "UIMAD", "ULEA", "USHF",
                 "ULOP3", "UIMNMX", "UFLO", "UPOPC", "HFMA2", "HADD2", "HMUL2"}),
    ("shuffle_shared", {"SHFL", "LDS", "STS", "LDSM", "ATOMS"}),
    ("control", {"BRA", "BSSY", "BSYNC", "WARPSYNC", "EXIT", "RET", "CALL", "BAR", "NOP", "JMP", "BRX", "YIELD",
                 "DEPBAR", "BMOV"}),
]
_GLOBAL_LOADS = {"LDG", "LDGSTS", "LD"}
_GLOBAL_STORES = {"STG", "ST"}


def access_bits(opcode: str) -> int:
    """Bits moved per thread by a global load/store: LDG.E.128 -> 128, .64, .U16/.S16 -> 16, .U8 -> 8, else 32."""
    mods = opcode.split(".")[1:]
    for mod, bits in (("128", 128), ("64", 64), ("U16", 16), ("S16", 16), ("U8", 8), ("S8", 8)):
        if mod in mods:
            return bits
    return 32


def classify(ins: Instr) -> str:
    if ins.base == "MUFU":
        return "mufu_ex2" if ".EX2" in ins.opcode else "mufu_other"
    if ins.base in _GLOBAL_LOADS:
        return "global_load"
    if ins.base in _GLOBAL_STORES:
        return "global_store"
    if ins.base == "IMAD" and ".MOV" in ins.opcode:
        return "move"
    if ins.opcode.startswith("HFMA2.MMA") and "-RZ, RZ" in ins.operands:
        return "move"  # ptxas' idiom for a constant move on the FMA-heavy pipe
    for name, opcodes in _CLASSES:
        if ins.base in opcodes or ins.opcode in opcodes:
            return name
    return "other"


_REGISTER = re.compile(r"\bR(\d+)\b")
_WAIT = re.compile(r"SB0,\s*(0x[0-9a-fA-F]+|\d+)")


def load_bytes_in_flight(path: list) -> int:
    """Bytes per thread that one iteration of a loop keeps in flight from global memory (Little's law):
    software-pipelined loads (LDGSTS into shared memory, waited for by `DEPBAR.LE SB0, k`: k + 1 iterations' copies
    are outstanding at the wait) count k + 1 iterations of them; plain loads (LDG) count those issued before the
    first instruction that reads a register one of them loads (ptxas issues a load just before its use when it
    saves registers: then one load per thread is in flight)."""
    copies = [ins for ins in path if ins.base == "LDGSTS"]
    waits = [int(m.group(1), 0) for ins in path if ins.base == "DEPBAR" for m in [_WAIT.search(ins.operands)] if m]
    if copies and waits:
        return (min(waits) + 1) * sum(access_bits(ins.opcode) for ins in copies) // 8
    pending, total = set(), 0
    for ins in path:
        registers = [int(r) for r in _REGISTER.findall(ins.operands)]
        if ins.base == "LDG":
            bits = access_bits(ins.opcode)
            if registers:
                pending.update(range(registers[0], registers[0] + max(1, bits // 32)))
            total += bits // 8
            continue
        sources = registers if ins.base in _GLOBAL_STORES else registers[1:]
        if pending and pending.intersection(sources):
            break
    return total


def load_use(path: list) -> list:
    """Each global load of one loop iteration (the hot path) with its load-to-use distance: the instructions from
    the load to the first one that reads a register it loads, wrapping into the next iteration (a load whose
    register is first read in the next iteration, a look-ahead, has a distance above the iteration's length). A
    cp.async copy (LDGSTS) waited for by `DEPBAR.LE SB0, k` is used k + 1 iterations later. [dict(position, bytes,
    distance)]."""
    n = len(path)
    waits = [int(m.group(1), 0) for ins in path if ins.base == "DEPBAR" for m in [_WAIT.search(ins.operands)] if m]
    out = []
    for k, ins in enumerate(path):
        if ins.base not in _GLOBAL_LOADS:
            continue
        nbytes = access_bits(ins.opcode) // 8
        if ins.base == "LDGSTS":
            out.append(dict(position=k, bytes=nbytes, distance=(min(waits) + 1) * n if waits else n))
            continue
        pending, distance = set(_destination(ins)), n  # never read within two iterations: used one iteration on
        for step in range(1, 2 * n):
            other = path[(k + step) % n]
            dest = _destination(other)
            sources = _registers(other.operands.split(",", 1)[1] if dest and "," in other.operands else
                                 "" if dest else other.operands)
            if pending.intersection(sources):
                distance = step
                break
            pending.difference_update(dest)  # overwritten before being read: that part is not waited for
            if not pending:
                break
        out.append(dict(position=k, bytes=nbytes, distance=distance))
    return out


def iteration_clocks(n: int, loads: list, latency: float, interval: float, iterations: int = 0) -> float:
    """Steady-state clocks of one loop iteration of one warp: `n` instructions issued in order `interval` clocks
    apart, an instruction that first reads a load's register (its load_use distance after it) waiting until
    `latency` clocks after the load issued. The mean of the second half of the simulated iterations (the first ones
    fill the pipeline of look-ahead loads; at least 2 x the longest look-ahead in iterations + 8)."""
    if n <= 0:
        return 0.0
    longest = max((load["distance"] for load in loads), default=0)
    iterations = max(iterations, 2 * math.ceil(longest / n) + 8)
    issued_at = {}
    for load in loads:
        issued_at.setdefault(load["position"], []).append(load["distance"])
    ready, ends, now = {}, [], -interval
    for i in range(iterations * n):
        now = max(now + interval, ready.pop(i, 0.0))
        for distance in issued_at.get(i % n, ()):
            ready[i + distance] = max(ready.get(i + distance, 0.0), now + latency)
        if i % n == n - 1:
            ends.append(now)
    half = len(ends) // 2
    return (ends[-1] - ends[-1 - half]) / half


def loop_report(instrs: list, start: int, end: int, elem_bits: int) -> dict:
    """Counts of one loop: hot path by class, static size, global access widths, elements per iteration."""
    path = hot_path(instrs, start, end)
    static = [ins for ins in instrs if start <= ins.addr <= end]
    classes = {}
    for ins in path:
        name = classify(ins)
        classes[name] = classes.get(name, 0) + 1
    loads = [access_bits(i.opcode) for i in path if i.base in _GLOBAL_LOADS]
    stores = [access_bits(i.opcode) for i in path if i.base in _GLOBAL_STORES]
    load_elems = sum(loads) // elem_bits
    elements = load_elems or sum(stores) // elem_bits
    sweep = (2 if stores else 1) if loads else None  # a loop that only stores (a masked row's zeros) is neither
    mufu = classes.get("mufu_ex2", 0) + classes.get("mufu_other", 0)
    return dict(
        start=f"0x{start:04x}", end=f"0x{end:04x}", sweep=sweep, instructions=len(path),
        static_instructions=len(static),
        elements_per_thread=elements, classes=dict(sorted(classes.items())),
        global_load_bits=sorted(loads, reverse=True), global_store_bits=sorted(stores, reverse=True),
        masked_memory=sum(1 for i in path if (i.base in _GLOBAL_LOADS | _GLOBAL_STORES) and i.pred),
        instr_per_element=round(len(path) / elements, 3) if elements else None,
        static_instr_per_element=round(len(static) / elements, 3) if elements else None,
        mufu_per_element=round(mufu / elements, 3) if elements else None,
        mufu_ex2_per_element=round(classes.get("mufu_ex2", 0) / elements, 3) if elements else None,
        fp32_per_element=round(classes.get("fp32", 0) / elements, 3) if elements else None,
        load_bytes_in_flight=load_bytes_in_flight(path),
        loads=load_use(path),
        # L2 eviction hints in the opcodes (ld/st.global.L2::cache_hint with an evict_last / evict_first policy)
        load_hints=sorted({m for i in path if i.base in _GLOBAL_LOADS for m in i.opcode.split(".")[1:]
                           if m in ("EL", "EF")}),
        store_hints=sorted({m for i in path if i.base in _GLOBAL_STORES for m in i.opcode.split(".")[1:]
                            if m in ("EL", "EF")}),
    )


def sweeps(instrs: list, elem_bits: int) -> tuple:
    """(loops, {1: main loop of sweep 1, 2: main loop of sweep 2}) with each loop's role."""
    loops = [loop_report(instrs, s, e, elem_bits) for s, e in find_loops(instrs)]
    # the `BRA` to itself after the last EXIT (ptxas' trap for a runaway warp) is no loop of the kernel's
    loops = [lp for lp in loops if set(lp["classes"]) - {"control"}]
    main = {}
    for sweep in (1, 2):
        mine = [lp for lp in loops if lp["sweep"] == sweep and lp["elements_per_thread"]]
        if mine:
            best = max(mine, key=lambda lp: (lp["elements_per_thread"], -lp["masked_memory"], lp["instructions"]))
            main[sweep] = best
    for lp in loops:
        if lp["sweep"] is None:
            lp["role"] = "other loop"
        else:
            counted = main.get(lp["sweep"]) is lp
            lp["role"] = f"sweep {lp['sweep']} " + ("main" if counted else "tail/copy (not counted)")
    return loops, main


# ----------------------------------------------------------------------------------------------------
# model


def occupancy(registers: int, threads: int, smem_bytes: int, gpu: GPU) -> dict:
    """Resident blocks per SM (CUDA occupancy calculator rules) and the limiting resource."""
    warps = math.ceil(threads / 32)
    limits = dict(blocks=gpu.blocks_per_sm, threads=gpu.threads_per_sm // (warps * 32))
    if registers:
        per_warp = math.ceil(registers * 32 / gpu.reg_alloc_unit) * gpu.reg_alloc_unit
        warps_per_sub = (gpu.regs_per_sm // gpu.sub_partitions) // per_warp
        limits["registers"] = (warps_per_sub * gpu.sub_partitions) // warps
    if smem_bytes:
        limits["shared memory"] = gpu.smem_per_sm // (math.ceil(smem_bytes / gpu.smem_alloc_unit) * gpu.smem_alloc_unit)
    blocks = min(limits.values())
    return dict(blocks_per_sm=blocks, limited_by=sorted(k for k, v in limits.items() if v == blocks), limits=limits,
                warps_per_sm=blocks * warps, occupancy=round(blocks * warps * 32 / gpu.threads_per_sm, 3))


def l2_hit(in_flight: float, usable: float, separate_gradient: bool = False, policy: str = "lru",
           hints: bool = False) -> float:
    """Sweep 2's L2 hit rate for rows of `in_flight` bytes in all (rows in flight x row bytes), sweep 2 running
    backwards over each row (its first reads are sweep 1's latest), the gradient written over the logits or, with
    separate_gradient, into new lines.

    "lru": an LRU cache of `usable` bytes with the resident rows at random phases (steady state after the first
    wave). An element d elements before its row's end is re-read 2 d / V sweep-times after its first read; meanwhile
    each other row brings new lines at an average (2 - h) / 2 rows per sweep-time (sweep 1: a row; sweep 2: its
    misses; k = 2), plus 1 / 2 for a separate gradient's writes (k = 3). It hits when (d / V) F (k - h) <= C, so
    h (k - h) = C / F: h = (k - sqrt(k^2 - 4 C / F)) / 2, all hits once C >= (k - 1) F.
    "random": random replacement, min(1, C / footprint) with the footprint F (2 F with a separate gradient): the
    optimistic stand-in the model used before, reported beside it."""
    if in_flight <= 0:
        return 1.0
    ratio = usable / in_flight
    if policy == "random":
        return min(1.0, ratio / (2 if separate_gradient else 1))
    if policy != "lru":
        raise ValueError(f"policy must be 'lru' or 'random'; got {policy!r}")
    if hints:  # only the other rows' first-sweep lines (evict_last) compete: hit while x F <= C
        return min(1.0, ratio)
    k = 3.0 if separate_gradient else 2.0
    if ratio >= k - 1:
        return 1.0
    return (k - math.sqrt(k * k - 4 * ratio)) / 2


def _poisson_cdf(count: int, mean: float) -> float:
    term = total = math.exp(-mean)
    for j in range(1, count + 1):
        term *= mean / j
        total += term
    return min(1.0, total)


def l2_hit_sets(in_flight: float, usable: float, separate_gradient: bool = False, ways: int = 16,
                points: int = 256, hints: bool = False) -> float:
    """Sweep 2's L2 hit rate by stack distance in an LRU of `ways`-way sets with hashed addresses (l2_hit's "lru"
    is its fully associative limit). An element x of its row from the end (0 <= x <= 1) is re-read after a stack
    distance of D(x) = x F (k - h) bytes (l2_hit's derivation: the lines the resident rows bring in meanwhile); it
    survives while fewer than `ways` of those lines map to its set, a Poisson count of mean ways x D / C. h is the
    mean over x, found as a fixed point (D depends on h through sweep 2's misses). hints: the eviction hints of
    issue #40 (sweep 1's loads evict_last, sweep 2's loads and stores evict_first), as if honoured: only the other
    rows' first-sweep lines compete, D(x) = x F."""
    if in_flight <= 0:
        return 1.0
    k = 3.0 if separate_gradient else 2.0
    hit = l2_hit(in_flight, usable, separate_gradient, hints=hints)
    for _ in range(50):
        xs = [(i + 0.5) / points for i in range(points)]
        rate = 1.0 if hints else k - hit
        new = sum(_poisson_cdf(ways - 1, ways * x * in_flight * rate / usable) for x in xs) / points
        if abs(new - hit) < 1e-6:
            break
        hit = 0.5 * (hit + new)
    return hit


def l2_hit_range(in_flight: float, gpu, separate_gradient: bool = False, hints: bool = False) -> tuple:
    """(low, central, high) sweep-2 hit rates (GPU's l2_* constants): high, the fully associative LRU over the usable
    fraction; central, set-associative over the same; low, set-associative over the low usable fraction."""
    usable, usable_low = gpu.l2_bytes * gpu.l2_usable_fraction, gpu.l2_bytes * gpu.l2_usable_fraction_low
    high = l2_hit(in_flight, usable, separate_gradient, "lru", hints)
    central = min(high, l2_hit_sets(in_flight, usable, separate_gradient, gpu.l2_ways, hints=hints))
    low = min(central, l2_hit_sets(in_flight, usable_low, separate_gradient, gpu.l2_ways, hints=hints))
    return low, central, high


_FP64 = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET"}


def _kind(ins: Instr) -> str:
    base = ins.base
    return ("shuffle" if base == "SHFL" else "shared" if base in ("LDS", "STS", "LDSM", "ATOMS") else
            "local" if base in ("LDL", "STL") else "barrier" if base == "BAR" else "mufu" if base == "MUFU" else
            "fp64" if base in _FP64 else "global_load" if base in _GLOBAL_LOADS else "other")


_ANY_REGISTER = re.compile(r"\b(U?R)(\d+)(\.64)?\b")


def _registers(text: str) -> list:
    """The general and uniform registers an operand string names ("R4", "R2.64" = R2 and R3, "UR6"; RZ and URZ
    are not registers)."""
    out = []
    for kind, number, wide in _ANY_REGISTER.findall(text):
        out += [f"{kind}{int(number) + k}" for k in range(2 if wide else 1)]
    return out


def _destination(ins: Instr) -> list:
    """The registers an instruction writes: its first operand when that is a register (not an address in
    brackets), as wide as a load's access (LDG.E.128: 4 registers) or a 64-bit operation."""
    first = ins.operands.split(",")[0].strip()
    if not first or first.startswith("[") or ins.base in _GLOBAL_STORES | {"STS", "STL", "BRA", "BAR"}:
        return []
    regs = _registers(first)
    if not regs:
        return []
    width = max(1, access_bits(ins.opcode) // 32) if ins.base in _GLOBAL_LOADS | {"LDS", "LDL"} else (
        2 if ins.base in _FP64 and not ins.opcode.startswith("DSETP") else len(regs))
    head = re.match(r"(U?R)(\d+)", regs[0])
    return [f"{head.group(1)}{int(head.group(2)) + k}" for k in range(width)]


def _serial_cost(path: list, gpu: GPU) -> dict:
    """The clocks of `path` (instructions, and LoopMark where an innermost loop was stepped over) issued in order
    with a register scoreboard, as one warp runs them: an instruction issues one clock after the previous one, or
    when the registers it reads are ready if later; its result is ready its kind's latency after it issues (GPU's
    per-kind clocks, alu_clocks for the rest), a global load's an HBM latency after. A barrier waits for every
    result but the loads in flight and holds the warp its latency; a DEPBAR waits for the cp.async copies (LDGSTS)
    before it. A loop stepped over waits
    for the registers it reads; a sweep's main loop (LoopMark.main) that reads no register a global load before it
    wrote (no prefetched block) starts with a round trip of its own (its first loads: HBM for sweep 1, L2 for sweep
    2, which reads what sweep 1 just read); after it every load issued before is done (a sweep takes microseconds,
    counted by the memory term).
    load_round_trips: the instructions and sweeps that waited on a global load."""
    hbm, l2 = gpu.hbm_latency_s * gpu.clock_hz, gpu.l2_latency_s * gpu.clock_hz
    kind_clocks = dict(shuffle=gpu.shuffle_clocks, shared=gpu.shared_clocks, local=gpu.shared_clocks,
                       barrier=gpu.barrier_clocks, mufu=gpu.mufu_clocks, fp64=gpu.fp64_clocks,
                       global_load=hbm, other=gpu.alu_clocks)
    counts = dict(shuffle=0, shared=0, local=0, barrier=0, mufu=0, fp64=0, global_load=0, other=0)
    issue, ready, loads, fetched, copies, waits = 0.0, {}, set(), set(), [], 0
    for ins in path:
        if isinstance(ins, LoopMark):
            start = max([issue] + [ready[r] for r in ins.reads if r in ready])
            if any(ready[r] > issue for r in ins.reads & loads):
                waits += 1
            elif ins.main and not ins.reads & fetched:  # not fed by loads issued before it: its own first ones
                start += l2 if ins.stores else hbm
                waits += 1
            issue, ready, loads, fetched, copies = start, {}, set(), set(), []
            continue
        kind = _kind(ins)
        counts[kind] += 1
        dest = _destination(ins)
        sources = _registers(ins.operands.split(",", 1)[1] if dest and "," in ins.operands else
                             "" if dest else ins.operands)
        start = max([issue] + [ready[r] for r in sources if r in ready])
        if any(r in loads and ready[r] > issue for r in sources):
            waits += 1
        if ins.base == "BAR":
            start = max([start] + [t for r, t in ready.items() if r not in loads])
        if ins.base == "DEPBAR" and copies:
            start, copies = max([start] + copies), []
        issue = start + (gpu.barrier_clocks if ins.base == "BAR" else 1)  # the warp waits at a barrier
        done = start + kind_clocks[kind]
        for r in dest:
            ready[r] = done
            loads.discard(r)
            fetched.discard(r)
        if ins.base == "LDGSTS":
            copies.append(start + hbm)
        elif kind == "global_load":
            loads.update(dest)
            fetched.update(dest)
    end = max([issue] + [t for r, t in ready.items() if r not in loads])
    return dict(counts=counts, clocks=round(end), load_round_trips=waits, seconds_per_row=end / gpu.clock_hz)


@dataclasses.dataclass
class LoopMark:
    """An innermost loop on a straight path, stepped over: its address range, the registers its body reads, whether
    it is a sweep's main loop (a straight_path `through` loop) and whether it stores (sweep 2)."""
    start: int
    end: int
    reads: frozenset
    main: bool = False
    stores: bool = False


def straight_path(instrs: list, loops: list, through=frozenset()) -> list:
    """The code a row runs outside the innermost loops, along the same rule as a loop's hot path: from the kernel's
    first instruction, a conditional branch falls through, an unconditional forward branch is taken, an innermost
    loop is stepped over (from its start to the instruction after its back edge; a LoopMark stands for it), an
    unconditional EXIT ends it; a backward branch outside the loops (an outer loop over rows) ends it too.
    `through`: the start addresses of loops the path must step over (the sweeps' main loops): where falling through
    leads to a path without them (a masked row's branch to its zeros), the latest forward conditional branch before
    is taken instead (a depth-first search, fall-through first). Without such a path, the plain rule's path."""
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    ends = {int(lp["start"], 16): int(lp["end"], 16) for lp in loops}
    marks = {}
    for start, end in ends.items():
        body = [i for i in instrs if start <= i.addr <= end]
        after = next((j for j, i in enumerate(instrs) if i.addr > end), None)
        marks[start] = (LoopMark(start, end, frozenset(r for i in body for r in _registers(i.operands)),
                                 main=start in through, stores=any(i.base in _GLOBAL_STORES for i in body)), after)
    budget = [50 * len(instrs) + 1000]

    def walk(k, seen, covered):
        path, added = [], []
        result = None
        while True:
            budget[0] -= 1
            if budget[0] < 0 or k is None or k >= len(instrs) or instrs[k].addr in seen:
                break
            ins = instrs[k]
            seen.add(ins.addr)
            added.append(ins.addr)
            if ins.addr in marks:  # an innermost loop: counted by its own report
                mark, k = marks[ins.addr]
                path.append(mark)
                covered = covered | {ins.addr}
                continue
            path.append(ins)
            if ins.base in ("EXIT", "RET") and not ins.conditional:
                result = path if through <= covered else None
                break
            if ins.base in _BRANCHES and not ins.conditional:
                target = ins.target
                if target is None or target <= ins.addr or target not in index:
                    result = path if through <= covered else None
                    break
                k = index[target]
                continue
            if ins.base in _BRANCHES and through:
                target = ins.target
                rest = walk(k + 1, seen, covered)
                if rest is None and target is not None and target > ins.addr and target in index:
                    rest = walk(index[target], seen, covered)
                result = None if rest is None else path + rest
                break
            k += 1
        if result is None:
            seen.difference_update(added)
        return result

    found = walk(0, set(), frozenset()) if through else None
    if found is None:
        through = frozenset()
        found = walk(0, set(), frozenset())
    return found or []


def serial_code(instrs: list, loops: list, gpu: GPU, through=frozenset()) -> dict:
    """The straight-line code a row runs outside the innermost loops (straight_path through the loops `through`),
    costed by _serial_cost: one dependent chain of its long-latency kinds (shuffles, shared and local memory,
    barriers, MUFU, fp64), one issue slot for each other instruction, and the HBM round trips its loads expose.
    A persistent kernel's path passes the backward branch of its row loop (the last backward branch on the path
    whose target is on it): what comes before that target is the prologue, run once a block (prologue_seconds),
    the rest is a row's turn (seconds_per_row), costed from
    an empty pipeline (what the previous turn prefetched is there). "static" beside it: every instruction outside
    the loops up to the last EXIT (every policy's and error path's code) as one chain, loads waited for at their
    first use, the upper bound."""
    inside = [(int(lp["start"], 16), int(lp["end"], 16)) for lp in loops]
    last_exit = max((ins.addr for ins in instrs if ins.base == "EXIT"), default=None)
    static = [ins for ins in instrs if not any(lo <= ins.addr <= hi for lo, hi in inside)
              and (last_exit is None or ins.addr <= last_exit)]
    path = straight_path(instrs, loops, frozenset(through))
    covered = {item.start for item in path if isinstance(item, LoopMark)}
    prologue = []
    where = {(item.start if isinstance(item, LoopMark) else item.addr): k
             for k, item in reversed(list(enumerate(path)))}
    back = [item for item in path if isinstance(item, Instr) and item.base in _BRANCHES and item.target is not None
            and item.target <= item.addr and item.target in where]
    if back:  # the row loop's back edge (taken when the block has another row; the path falls through to EXIT)
        start = where[back[-1].target]
        prologue, path = path[:start], path[start:]
    out = _serial_cost(path, gpu)
    out["prologue_seconds"] = _serial_cost(prologue, gpu)["seconds_per_row"] if prologue else 0.0
    out["through_sweeps"] = set(through) <= covered
    out["static"] = _serial_cost(static, gpu)
    return out


def _sweep_clocks(loop: dict, hit: float, writes: bool, warps_per_sm: int, gpu: GPU, head: Headline) -> dict:
    """One sweep's main loop on one SM, in clocks per step (every resident warp runs one iteration):
    - busy: the issue slots of the SM's warps (w = warps per scheduler, w x instructions) or MUFU's, if more;
    - bandwidth: the step's bytes at the SM's share of the copy bandwidth (HBM: misses and writes) or of L2's (hits);
    - low (full overlap): a warp issues one instruction a clock and waits only where a load's round trip is longer
      than its load-to-use distance (iteration_clocks); the other warps fill the wait: max(busy, that);
    - central: the scheduler as one server shared by its w warps, each iteration a warp's issue (busy / w clocks)
      then its exposed wait (the low case's wait of a warp alone), the machine-repairman model solved by mean value
      analysis (_repairman_clocks): some of the waits are not filled by other warps' issue;
    - high (partial overlap): the warps in lockstep (one instruction every w clocks, as after the barrier that starts
      a sweep) and the round trip at least the bandwidth time of the step: the issue after the first use is not
      hidden under any warp's loads.
    Also the time-weighted bytes in flight per thread of the central case: each load's bytes x its round trip over
    the iteration's time (Little's law), against the bytes issued (load_bytes_in_flight)."""
    elements = loop.get("elements_per_thread") or 8
    n = loop.get("instructions") or max(1, round(loop["instr_per_element"] * elements))
    loads = loop.get("loads") or [dict(position=0, bytes=loop.get("load_bytes_in_flight") or 16, distance=n)]
    w = warps_per_sm / gpu.sub_partitions
    mufu_lanes = gpu.mufu_per_clock_per_sm / gpu.sub_partitions  # per scheduler
    busy = max(w * n, w * loop.get("mufu_per_element", 0) * elements * 32 / mufu_lanes)
    step_bytes = warps_per_sm * 32 * elements * head.elem_bytes
    hbm_bytes = step_bytes * ((1 - hit) + (1 if writes else 0))
    bandwidth = max(hbm_bytes * gpu.sms / gpu.hbm_copy, step_bytes * hit * gpu.sms / gpu.l2_bandwidth) * gpu.clock_hz
    latency = (hit * gpu.l2_latency_s + (1 - hit) * gpu.hbm_latency_s) * gpu.clock_hz
    alone = iteration_clocks(n, loads, latency, 1.0)  # one warp by itself: its issue and its exposed waits
    low = max(busy, alone)
    central = max(low, _repairman_clocks(max(1, round(w)), busy / w, max(0.0, alone - n)))
    high = max(central, iteration_clocks(n, loads, max(latency, bandwidth), w))
    in_flight = sum(load["bytes"] for load in loads) * latency / central
    return dict(steps=head.rows * head.vocab / (gpu.sms * warps_per_sm * 32 * elements), busy=busy,
                bandwidth=bandwidth, low=low, central=central, high=high, issue_clocks=w * n,
                load_to_use=sorted({load["distance"] for load in loads}), iteration_instructions=n,
                time_weighted_bytes_in_flight=round(in_flight, 1),
                step_bytes=step_bytes, latency_clocks=latency)


def _repairman_clocks(warps: int, service: float, wait: float) -> float:
    """Clocks for each of `warps` warps to run one iteration on one scheduler: a closed system of `warps` customers,
    each needing `service` clocks of the scheduler then `wait` clocks away from it (a load's exposed round trip),
    by exact mean value analysis. Between the asymptotic bounds max(warps x service, service + wait)."""
    queue, response = 0.0, service
    for k in range(1, warps + 1):
        response = service * (1 + queue)
        throughput = k / (response + wait)
        queue = throughput * response
    return warps / throughput


def _kernel_time(out: dict, passes: list, traffic: tuple, blocks_per_sm: int, threads: int, serial: tuple,
                 gpu: GPU, head: Headline) -> dict:
    """Fill `out` with the kernel's range. passes: [(name, main-loop report, (hit low, central, high), writes)];
    traffic: the HBM bytes at the low, central and high hit rate; serial: the straight-line seconds per row in turn
    (low, central, high). Each bound (low, central, high) = max(traffic / copy bandwidth, the sweeps' steps x their
    clocks per step (_sweep_clocks) / SM clock) + the serial seconds x the rows each resident block runs in turn; the
    low bound takes the high hit rate (less traffic, shorter round trips), the high bound the low one."""
    warps = max(1, threads // 32) * blocks_per_sm
    rows_in_turn = math.ceil(head.rows / (gpu.sms * blocks_per_sm))
    bounds, sweeps_out = {}, {}
    for case, hit_index in (("low", 2), ("central", 1), ("high", 0)):
        sweep_s = 0.0
        for name, loop, hits, writes in passes:
            clocks = _sweep_clocks(loop, hits[hit_index], writes, warps, gpu, head)
            sweep_s += clocks["steps"] * clocks[case] / gpu.clock_hz
            if case == "central":
                sweeps_out[name] = clocks
        memory_s = traffic[hit_index] / gpu.hbm_copy
        core = max(memory_s, sweep_s)
        bounds[case] = dict(core_s=core, memory_s=memory_s, sweeps_s=sweep_s,
                            serial_s=serial[("low", "central", "high").index(case)] * rows_in_turn)
    central = bounds["central"]
    elements = head.rows * head.vocab
    per_elem = sum(loop["instr_per_element"] for _, loop, _, _ in passes)
    mufu_elem = sum(loop.get("mufu_per_element", 0) for _, loop, _, _ in passes)
    issue_s = elements * per_elem / 32 / (gpu.sms * gpu.issue_per_clock_per_sm * gpu.clock_hz)
    mufu_s = elements * mufu_elem / (gpu.sms * gpu.mufu_per_clock_per_sm * gpu.clock_hz)
    for name, clocks in sweeps_out.items():
        out[f"{name}_load_to_use"] = clocks["load_to_use"]
        out[f"{name}_time_weighted_bytes_in_flight"] = clocks["time_weighted_bytes_in_flight"]
        out[f"{name}_in_flight_bytes_per_sm"] = clocks["time_weighted_bytes_in_flight"] * threads * blocks_per_sm
        out[f"{name}_latency_tbps"] = round(clocks["step_bytes"] * gpu.sms / (clocks["central"] / gpu.clock_hz)
                                            / 1e12, 2)
        out[f"{name}_issue_use"] = round(clocks["issue_clocks"] / clocks["central"], 3)
        out[f"{name}_clocks_per_step"] = {k: round(clocks[k], 1) for k in ("busy", "bandwidth", "low", "central",
                                                                           "high")}
    bound = ("memory" if central["memory_s"] >= central["sweeps_s"] else
             "issue" if all(c["busy"] >= c["central"] - 1e-9 for c in sweeps_out.values()) else "latency + issue")
    ms = {case: (b["core_s"] + b["serial_s"]) * 1e3 for case, b in bounds.items()}
    out.update(memory_ms=central["core_s"] * 1e3, bandwidth_ms=central["memory_s"] * 1e3,
               latency_bound_ms=central["sweeps_s"] * 1e3, instr_per_element=round(per_elem, 3),
               mufu_per_element=round(mufu_elem, 3), issue_ms=issue_s * 1e3, mufu_ms=mufu_s * 1e3,
               serial_ms=central["serial_s"] * 1e3, serial_ms_range=[bounds["low"]["serial_s"] * 1e3,
                                                                     bounds["high"]["serial_s"] * 1e3],
               rows_per_block_in_turn=rows_in_turn, kernel_ms=ms["central"], kernel_ms_low=ms["low"],
               kernel_ms_high=ms["high"], bound=bound,
               bounds_ms={case: {k: round(v * 1e3, 4) for k, v in b.items()} for case, b in bounds.items()})
    return out


def _serial_range(serial_s) -> tuple:
    """(low, central, high) seconds from a number (one value for all three) or a triple."""
    if isinstance(serial_s, (int, float)):
        return (float(serial_s),) * 3
    return tuple(serial_s)


def predict(blocks_per_sm: int, sweep1: dict, sweep2: dict, launches: int, gpu: GPU, head: Headline,
            threads: int = 0, serial_s=0.0) -> dict:
    """The one-launch, two-sweep kernel of the module docstring; sweep1/sweep2: main-loop reports (None: not found);
    threads per block; serial_s: the straight-line seconds per row (serial_code), one number or (low, central,
    high)."""
    row = head.vocab * head.elem_bytes
    rows_in_flight = min(head.rows, blocks_per_sm * gpu.sms)
    in_flight = rows_in_flight * row
    usable = gpu.l2_bytes * gpu.l2_usable_fraction
    hits = l2_hit_range(in_flight, gpu, not head.inplace, head.eviction_hints)
    hit = hits[1]
    traffic = tuple(head.rows * row * (2.0 - h) + head.rows * row + head.rows * head.row_extra_bytes for h in hits)
    floor_s = 2 * head.rows * row / gpu.hbm_copy
    out = dict(row_bytes=row, rows_in_flight=rows_in_flight, bytes_in_flight=in_flight, l2_usable_bytes=usable,
               sweep2_l2_hit=round(hit, 4), sweep2_l2_hit_range=[round(h, 4) for h in hits],
               sweep2_l2_hit_lru=round(hits[2], 4),
               sweep2_l2_hit_random=round(l2_hit(in_flight, usable, not head.inplace, "random"), 4),
               hbm_read_bytes=traffic[1] - head.rows * row - head.rows * head.row_extra_bytes,
               hbm_write_bytes=head.rows * row, hbm_traffic_bytes=traffic[1],
               hbm_traffic_bytes_range=[traffic[2], traffic[0]],
               memory_ms=traffic[1] / gpu.hbm_copy * 1e3, copy_floor_ms=floor_s * 1e3, launches=launches,
               overhead_ms=launches * gpu.launch_overhead_s * 1e3)
    if not (sweep1 and sweep2):
        out.update(issue_ms=None, mufu_ms=None, kernel_ms=None, bound="unknown (a sweep loop was not found)",
                   total_ms=None, total_ms_low=None, total_ms_high=None, pct_of_copy_bandwidth=None)
        return out
    _kernel_time(out, [("sweep1", sweep1, (0.0,) * 3, False), ("sweep2", sweep2, hits, True)], traffic,
                 blocks_per_sm, threads, _serial_range(serial_s), gpu, head)
    out.update(total_ms=out["kernel_ms"] + out["overhead_ms"], total_ms_low=out["kernel_ms_low"] + out["overhead_ms"],
               total_ms_high=out["kernel_ms_high"] + out["overhead_ms"],
               pct_of_copy_bandwidth=round(100 * floor_s / (out["kernel_ms"] / 1e3), 1))
    return out


def predict_single(blocks_per_sm: int, loop: dict, writes: bool, gpu: GPU, head: Headline, threads: int,
                   serial_s=0.0) -> dict:
    """A one-sweep kernel (Liger's forward: read; its backward: read and write each row once): the same terms."""
    row = head.vocab * head.elem_bytes
    traffic = head.rows * row * (2 if writes else 1) + head.rows * 16
    out = dict(row_bytes=row, rows_in_flight=min(head.rows, blocks_per_sm * gpu.sms), hbm_read_bytes=head.rows * row,
               hbm_write_bytes=head.rows * row if writes else 0, hbm_traffic_bytes=traffic,
               hbm_traffic_bytes_range=[traffic, traffic],
               copy_floor_ms=2 * head.rows * row / gpu.hbm_copy * 1e3, launches=1,
               overhead_ms=gpu.launch_overhead_s * 1e3)
    if not loop:
        out.update(issue_ms=None, mufu_ms=None, kernel_ms=None, bound="unknown (no sweep loop found)", total_ms=None,
                   total_ms_low=None, total_ms_high=None, pct_of_copy_bandwidth=None)
        return out
    _kernel_time(out, [("sweep", loop, (0.0,) * 3, writes)], (traffic,) * 3, blocks_per_sm, threads,
                 _serial_range(serial_s), gpu, head)
    out.update(total_ms=out["kernel_ms"] + out["overhead_ms"], total_ms_low=out["kernel_ms_low"] + out["overhead_ms"],
               total_ms_high=out["kernel_ms_high"] + out["overhead_ms"], pct_of_copy_bandwidth=None)
    return out


def providers(kernels: list, gpu: GPU, head: Headline) -> list:
    """The ranking: one row per provider (a backend's kernel; Liger's forward + backward summed), predicted ms with
    the launches (central, and the range: predicted_ms_low, predicted_ms_high), % of the copy floor, HBM traffic,
    fastest first by the central estimate."""
    floor_ms = 2 * head.rows * head.vocab * head.elem_bytes / gpu.hbm_copy * 1e3
    groups = {}
    for k in kernels:
        groups.setdefault((k["backend"], k["arch"]), []).append(k)
    out = []
    for (backend, arch), ks in groups.items():
        models = [k["model"] for k in ks]
        if any(m.get("total_ms") is None for m in models):
            continue
        total = sum(m["total_ms"] for m in models)
        low = sum(m.get("total_ms_low", m["total_ms"]) for m in models)
        high = sum(m.get("total_ms_high", m["total_ms"]) for m in models)
        out.append(dict(provider=backend, arch=arch, kernels=" + ".join(k["kernel"] for k in ks),
                        predicted_ms=round(total, 3), predicted_ms_low=round(low, 3), predicted_ms_high=round(high, 3),
                        pct_of_copy_floor=round(100 * floor_ms / total, 1),
                        pct_of_copy_floor_range=[round(100 * floor_ms / high, 1), round(100 * floor_ms / low, 1)],
                        hbm_gb=round(sum(m["hbm_traffic_bytes"] for m in models) / 1e9, 2),
                        bounds=" + ".join(m["bound"] for m in models)))
    return sorted(out, key=lambda r: r["predicted_ms"])


# ----------------------------------------------------------------------------------------------------
# tools


def nvidia_tool(name: str):
    """cuobjdump / nvdisasm / ptxas: Triton's bundled copy first, then PATH, then CUDA_HOME."""
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return None


def _run(cmd) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout + proc.stderr


def cubin_sass(cubin: Path) -> tuple:
    """(SASS text, {function: dict(registers, shared, local)}) from cuobjdump."""
    cuobjdump = nvidia_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (neither Triton's bundled copy nor the CUDA toolkit)")
    sass = _run([cuobjdump, "-sass", str(cubin)])
    usage, current = {}, None
    for line in _run([cuobjdump, "-res-usage", str(cubin)]).splitlines():
        fn = re.match(r"\s*Function\s+(\S+?):?\s*$", line)
        if fn:
            current = fn.group(1)
            continue
        reg = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", line)
        if reg and current:
            usage[current] = dict(registers=int(reg.group(1)), shared=int(reg.group(2)), local=int(reg.group(3)))
    return sass, usage


HEADLINE_STEP = r'''
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
import conftest  # installs the Triton launch recorder (TRITON_INTERPRET=1)
import torch
from fused_is.benchmarks import main as bench
p = bench.make_problem(4, 1024, torch.bfloat16, "cpu")
bench.run_step(bench.HEADLINE, p["logits"].requires_grad_(), p)
conftest.pytest_sessionfinish(None, 0)
'''


PERSISTENT_KERNELS = {"_fused_kernel"}  # launched on fused_is.backends.triton.fused_grid() programs


def _record_launches(step: str, path: Path, what: str) -> list:
    """The Triton launches `step` (HEADLINE_STEP or LIGER_STEP) makes at a tiny size under the interpreter, recorded
    by tests/conftest.py's recorder into `path`."""
    env = dict(os.environ, TRITON_INTERPRET="1", FUSED_IS_TRITON_LAUNCHES=str(path))
    proc = subprocess.run([sys.executable, "-c", step.format(tests=str(TESTS), repo=str(REPO))],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"recording {what} failed: {(proc.stderr or proc.stdout)[-2000:]}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_headline_launches(path: Path) -> list:
    """The Triton launches of the headline step (the bench's triton_inplace_forward provider, bf16, ppo_tis); the
    production variant then gives V = 151936's BLOCK and alignment."""
    return _record_launches(HEADLINE_STEP, path, "the headline launches")


LIGER_STEP = HEADLINE_STEP.replace("bench.HEADLINE", '"liger"')


def record_liger_launches(path: Path) -> list:
    """The Triton launches of the bench's liger provider (Liger-Kernel's triton_grpo_loss writing ppo_tis out); its
    kernels take V as a constexpr N, set to the headline's in liger_kernels."""
    return _record_launches(LIGER_STEP, path, "Liger's launches")


def liger_kernels(launches: list, arch: int, sass_dir: Path, head: Headline) -> list:
    """Liger's forward and backward kernels compiled for the headline (N = V = 151936, its own BLOCK_N and warps,
    every tensor 16-byte aligned), one record each, backend "liger"."""
    launches = [dict(launch, args=dict(launch["args"], N={"int": head.vocab})) for launch in launches
                if launch["module"].startswith("liger_kernel")]
    if not launches:
        raise RuntimeError("no Liger kernel was launched by the liger provider")
    out = triton_kernels(launches, arch, sass_dir, head)
    for k in out:
        k["backend"] = "liger"
    return out


def triton_kernels(launches: list, arch: int, sass_dir: Path, head: Headline) -> list:
    """Compile each launched kernel's production ("aligned") specialization; one record per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = nvidia_tool("ptxas")
    out = []
    specs = gpu_build_check.specializations(launches, variants=("aligned",))
    counts = {}
    for launch in launches:
        counts[launch["kernel"]] = counts.get(launch["kernel"], 0) + 1
    for desc, fn, signature, constexprs, attrs, options in specs:
        compiled = triton.compile(ASTSource(fn, signature, gpu_build_check.for_arch(fn, constexprs, arch), attrs),
                                  target=GPUTarget("cuda", arch, 32), options=dict(options))
        name = desc["kernel"]
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass, usage = cubin_sass(cubin)
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"triton{name}_sm{arch}.sass").write_text(sass)
        functions = parse_sass(sass)
        instrs = functions.get(name) or next(iter(functions.values()))
        ptx = gpu_build_check._ptxas_report(compiled.asm["ptx"], ptxas)
        res = usage.get(name) or next(iter(usage.values()), {})
        # dynamic shared memory of the launch on top of the cubin's static (which includes the 1 KB reserved)
        smem = res.get("shared", 0) + int(getattr(compiled.metadata, "shared", 0) or 0)
        out.append(dict(backend="triton", kernel=name, arch=f"sm_{arch}", variant="aligned",
                        persistent=name in PERSISTENT_KERNELS,
                        constexprs=desc["constexprs"], logits=signature.get("logits_ptr"),
                        registers=res.get("registers", ptx["registers"]),
                        spill_bytes=ptx["spill_store_bytes"] + ptx["spill_load_bytes"], local_bytes=res.get("local", 0),
                        smem_per_block=smem, threads_per_block=32 * compiled.metadata.num_warps,
                        launches=counts.get(name, 1), sass=str(sass_dir / f"triton{name}_sm{arch}.sass"),
                        instrs=instrs))
    return out


CUDA_FUSED_THREADS = 768  # csrc/cuda/policy_loss_cuda.cu kFusedThreads: fused_rows_kernel's __launch_bounds__


def cuda_block_threads(vocab: int, elem_bytes: int) -> int:
    """csrc/cuda/device.cuh block_threads(V, 16 / sizeof(S), kFusedThreads) for an aligned row: the power
    of two >= the row's 16-byte vectors, at least 32, capped at 768."""
    work, threads = math.ceil(vocab / (16 // elem_bytes)), 32
    while threads < CUDA_FUSED_THREADS and threads < work:
        threads <<= 1
    return min(threads, CUDA_FUSED_THREADS)


def cuda_blocks_per_sm(l2_bytes: int, sms: int, row_bytes: int, resident: int) -> int:
    """csrc/cuda/device.cuh blocks_per_sm: the rows in flight within 3/4 of the L2, at most the resident
    blocks (the occupancy calculator's), at least 1."""
    return max(1, min((l2_bytes // 4 * 3) // (sms * max(1, row_bytes)), resident))


CUDA_HEADLINE = re.compile(r"fused_rows_kernel<__nv_bfloat16, true>|fused_rows_kernelI13__nv_bfloat16Lb1E")


def cuda_kernels(arch: int, sass_dir: Path, head: Headline, threads=None) -> list:
    """nvcc -cubin of csrc/cuda/policy_loss_cuda.cu; the headline instantiation's record."""
    nvcc = gpu_build_check.nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "policy_loss_cuda.cubin"
        log = _run([nvcc, "-std=c++17", f"-arch=sm_{arch}", "-O3", "--expt-relaxed-constexpr", "-Xptxas", "-v",
                    f"-I{REPO / 'csrc'}", "-cubin", str(REPO / "csrc" / "cuda" / "policy_loss_cuda.cu"),
                    "-o", str(cubin)])
        sass, usage = cubin_sass(cubin)
    sass_dir.mkdir(parents=True, exist_ok=True)
    (sass_dir / f"cuda_sm{arch}.sass").write_text(sass)
    spills, current = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)'", line)
        if entry:
            current = entry.group(1)
        spill = gpu_build_check._PTXAS_SPILL.search(line)
        if spill and current:
            spills[current] = spills.get(current, 0) + int(spill.group(1)) + int(spill.group(2))
    out = []
    for mangled, instrs in parse_sass(sass).items():
        name = gpu_build_check._demangle(mangled)
        if not (CUDA_HEADLINE.search(name) or CUDA_HEADLINE.search(mangled)):
            continue
        res = usage.get(mangled, {})
        out.append(dict(backend="cuda", kernel="fused_rows_kernel<__nv_bfloat16, true>", arch=f"sm_{arch}",
                        variant="aligned", persistent=True, registers=res.get("registers"),
                        spill_bytes=spills.get(mangled, 0),
                        local_bytes=res.get("local", 0), smem_per_block=res.get("shared", 0),
                        threads_per_block=threads or cuda_block_threads(head.vocab, head.elem_bytes), launches=1,
                        sass=str(sass_dir / f"cuda_sm{arch}.sass"), instrs=instrs))
    if not out:
        raise RuntimeError("no fused_rows_kernel<__nv_bfloat16, true> in the cubin")
    return out


def analyse(kernel: dict, gpu: GPU, head: Headline) -> dict:
    """The kernel record with its loops, occupancy, serial code and model. A "liger" record is one of Liger's two
    one-sweep kernels (predict_single); every other is a two-sweep kernel (predict)."""
    instrs = kernel.pop("instrs")
    loops, main = sweeps(instrs, 8 * head.elem_bytes)
    occ = occupancy(kernel["registers"] or 0, kernel["threads_per_block"], kernel["smem_per_block"], gpu)
    serial = serial_code(instrs, loops, gpu, {int(m["start"], 16) for m in main.values() if m})
    kernel.update(occupancy=occ, loops=loops, sweep1=main.get(1), sweep2=main.get(2), serial=serial)
    threads, blocks = kernel["threads_per_block"], occ["blocks_per_sm"]
    if kernel.get("persistent"):  # a grid of a few programs per SM (the launcher's rule), each looping over rows
        from fused_is.backends import triton as launcher

        row = head.vocab * head.elem_bytes
        grid = (cuda_blocks_per_sm(gpu.l2_bytes, gpu.sms, row, blocks) if kernel["backend"] == "cuda" else
                launcher.programs_per_sm(gpu.l2_bytes, gpu.sms, row, threads // 32))
        blocks = min(blocks, grid)
        occ.update(blocks_per_sm=blocks, limited_by=sorted(set(occ["limited_by"]) | {"persistent grid"})
                   if blocks == grid else occ["limited_by"])
    # a block's prologue once over the rows it runs in turn: one warp's dependent chain
    chain = serial["seconds_per_row"] + serial["prologue_seconds"] / math.ceil(head.rows / (gpu.sms * blocks))
    # every warp of every resident block runs the same straight-line code: its issue slots on the SM's schedulers.
    # An overestimate where code is guarded for one warp (a thread-0 epilogue: the path falls through into it), so
    # the low bound is one warp's chain alone (the other warps' issue hidden under its waits), the central
    # max(chain, all warps' issue) (full overlap), the high their sum (none)
    warps = max(1, threads // 32) * blocks
    all_warps = warps * sum(serial["counts"].values()) / gpu.sub_partitions / gpu.clock_hz
    serial_s = (chain, max(chain, all_warps), chain + all_warps)
    serial.update(chain_seconds=chain, all_warps_issue_seconds=all_warps, seconds_range=list(serial_s))
    s1, s2 = main.get(1), main.get(2)
    # the hints are in the kernel (sweep 1 loads evict_last, sweep 2 loads and stores evict_first): the L2 model's
    # hints case, as --eviction-hints asks for every kernel
    hinted = bool(s1 and s2 and s1.get("load_hints") == ["EL"] and s2.get("load_hints") == ["EF"]
                  and s2.get("store_hints") == ["EF"])
    kernel["eviction_hints"] = hinted
    if hinted and not head.eviction_hints:
        head = dataclasses.replace(head, eviction_hints=True)
    if kernel["backend"] == "liger":
        loop = main.get(2) or main.get(1)
        kernel["model"] = predict_single(blocks, loop, bool(main.get(2)), gpu, head, threads, serial_s)
    else:
        kernel["model"] = predict(blocks, main.get(1), main.get(2), kernel["launches"], gpu, head, threads, serial_s)
    return kernel


# ----------------------------------------------------------------------------------------------------
# output


def _f(value, fmt="{:.2f}", none="-"):
    return none if value is None else fmt.format(value)


def _widths(bits) -> str:
    return "/".join(str(b) for b in sorted(set(bits), reverse=True)) or "-"


def _flight(s1, s2, m) -> str:
    """Loads in flight per thread of the sweeps, and per SM (KiB); a one-sweep kernel's in its column."""
    def one(s, key):
        return f"{s['load_bytes_in_flight']} ({m[key] / 1024:.0f})" if s and key in m else "-"
    if "sweep_in_flight_bytes_per_sm" in m:  # a one-sweep kernel (Liger's)
        return " / ".join([one(s1, "sweep_in_flight_bytes_per_sm"), "-"] if s1 else
                          ["-", one(s2, "sweep_in_flight_bytes_per_sm")])
    return f"{one(s1, 'sweep1_in_flight_bytes_per_sm')} / {one(s2, 'sweep2_in_flight_bytes_per_sm')}"


def _latency(m) -> str:
    if "sweep_latency_tbps" in m:
        return _f(m["sweep_latency_tbps"])
    return f"{_f(m.get('sweep1_latency_tbps'))} / {_f(m.get('sweep2_latency_tbps'))}"


def _hits(m) -> str:
    if "sweep2_l2_hit" not in m:
        return "- (one sweep)"
    low, central, high = m.get("sweep2_l2_hit_range", [m["sweep2_l2_hit"]] * 3)
    return f"{low:.2f} / {central:.2f} / {high:.2f} ({m['sweep2_l2_hit_random']:.2f})"


def _use(s1, s2, m) -> str:
    """Load-to-use distances (instructions) and time-weighted bytes in flight per thread, per sweep."""
    def one(key):
        if f"{key}_load_to_use" not in m:
            return "-"
        return (f"{','.join(str(d) for d in m[f'{key}_load_to_use'])}: "
                f"{m[f'{key}_time_weighted_bytes_in_flight']:.0f}")
    if "sweep_load_to_use" in m:
        return one("sweep")
    return f"{one('sweep1')} / {one('sweep2')}"


def _range(row) -> str:
    return f"{row['predicted_ms']:.2f} ({row['predicted_ms_low']:.2f}-{row['predicted_ms_high']:.2f})"


def provider_table(rows: list) -> list:
    lines = ["| provider | kernels | predicted ms, central (low-high), with launches | % of copy floor, central "
             "(range) | HBM GB | bound (central) |", "|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["pct_of_copy_floor_range"]
        lines.append(f"| {r['provider']} {r['arch']} | {r['kernels']} | {_range(r)} | "
                     f"{r['pct_of_copy_floor']:.0f}% ({low:.0f}-{high:.0f}%) | {r['hbm_gb']:.2f} | {r['bounds']} |")
    return lines


def markdown(kernels: list, gpu: GPU, head: Headline, other=None) -> str:
    floor = 2 * head.rows * head.vocab * head.elem_bytes / gpu.hbm_copy * 1e3
    gradient = "in place" if head.inplace else "into a buffer of its own"
    lines = [f"Static prediction: {gpu.name}, N = {head.rows}, V = {head.vocab}, {head.dtype}, ppo_tis forward + "
             f"backward, the gradient written {gradient}"
             + ("; WHAT-IF: our kernels with L2 eviction hints (sweep 1 evict_last, sweep 2 evict_first)"
                if head.eviction_hints else "")
             + "".join(f"; {k['backend']} {k['kernel']} has L2 eviction hints in its SASS (sweep 1 .EL, sweep 2 .EF)"
                       for k in kernels if k.get("eviction_hints"))
             + "; copy floor (1 read + 1 write at "
             f"{gpu.hbm_copy / 1e12:.1f} TB/s) {floor:.2f} ms; SM clock {gpu.clock_hz / 1e9:.2f} GHz, "
             f"usable L2 {gpu.l2_bytes * gpu.l2_usable_fraction / 2**20:.1f} MiB "
             f"({gpu.l2_bytes * gpu.l2_usable_fraction_low / 2**20:.1f} MiB for the low hit rate). A prediction, not "
             "a measurement: a range per kernel, low (full overlap of issue and memory, the high L2 hit rate), central "
             "(mean value analysis of the schedulers, set-associative L2) and high (warps in lockstep, the low hit "
             "rate).", ""] + provider_table(providers(kernels, gpu, head))
    if other:
        other_head, other_kernels = other
        case = "in place" if other_head.inplace else "into a buffer of its own (inplace=False)"
        lines += ["", f"The same kernels with the gradient written {case} (Liger's case does not change):", ""]
        lines += provider_table(providers(other_kernels, gpu, other_head))
    lines += ["",
              "| kernel | regs | spill B | smem/block | threads | rows/SM (limit) | in flight MB | sweep-2 L2 hit, "
              "low / central / high (random) | HBM GB (central) | ld/st bits | loads issued B/thread, sweep 1 / 2 "
              "(time-weighted KiB/SM) | load-to-use instr: time-weighted B/thread, sweep 1 / 2 | TB/s of the sweeps, "
              "1 / 2 | sweep 1 instr/elem (MUFU) | sweep 2 instr/elem (MUFU) | memory ms | issue ms | MUFU ms | "
              "serial ms (per row us, one warp's chain) | predicted ms central (low-high) + launch |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in kernels:
        m, s1, s2, occ = k["model"], k["sweep1"], k["sweep2"], k["occupancy"]
        ld = [b for s in (s1, s2) if s for b in s["global_load_bits"]]
        st = [b for s in (s1, s2) if s for b in s["global_store_bits"]]
        sweep = lambda s: (f"{s['instr_per_element']:.2f} ({s['mufu_per_element']:.2f})"  # noqa: E731
                           if s else "not found")
        lines.append(
            f"| {k['backend']} {k['kernel']} {k['arch']} | {k['registers']} | {k['spill_bytes']} | "
            f"{k['smem_per_block']} | "
            f"{k['threads_per_block']} | {occ['blocks_per_sm']} ({', '.join(occ['limited_by'])}) | "
            f"{_f(m.get('bytes_in_flight', m['rows_in_flight'] * m['row_bytes']) / 1e6, '{:.0f}')} | "
            f"{_hits(m)} | {m['hbm_traffic_bytes'] / 1e9:.2f} | "
            f"{_widths(ld)} / {_widths(st)} | {_flight(s1, s2, m)} | {_use(s1, s2, m)} | {_latency(m)} | "
            f"{sweep(s1)} | {sweep(s2)} | "
            f"{_f(m.get('memory_ms'))} | {_f(m['issue_ms'])} | {_f(m['mufu_ms'])} | {_f(m.get('serial_ms'))} "
            f"({k['serial']['seconds_per_row'] * 1e6:.2f}) | {_f(m['kernel_ms'])} ({_f(m.get('kernel_ms_low'))}-"
            f"{_f(m.get('kernel_ms_high'))}, {m['bound']}) + {m['overhead_ms']:.3f} |")
    lines += ["", "| kernel | loop | role | instr (static) | elems/thread/iter | instr/elem | MUFU.EX2 | fp32 | "
              "integer | move | convert | pred/select | ld / st bits | control / other |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in kernels:
        for lp in k["loops"]:
            c = lp["classes"]
            known = ("mufu_ex2", "fp32", "integer", "move", "convert", "pred_select", "global_load", "global_store")
            other = sum(v for name, v in c.items() if name not in known)
            lines.append(
                f"| {k['backend']} {k['kernel']} | {lp['start']}-{lp['end']} | {lp['role']} | {lp['instructions']} "
                f"({lp['static_instructions']}) | {lp['elements_per_thread']} | {_f(lp['instr_per_element'])} | "
                f"{c.get('mufu_ex2', 0)} | {c.get('fp32', 0)} | {c.get('integer', 0)} | {c.get('move', 0)} | "
                f"{c.get('convert', 0)} | {c.get('pred_select', 0)} | {_widths(lp['global_load_bits'])} / "
                f"{_widths(lp['global_store_bits'])} | {other} |")
    return "\n".join(lines) + "\n"


def machine(key: str, **overrides) -> GPU:
    """GPUS[key] over GPU()'s defaults, then the overrides that are not None (the CLI's flags)."""
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {key!r}")
    values = dict(GPUS[key], **{k: v for k, v in overrides.items() if v is not None})
    return dataclasses.replace(GPU(), key=key, **values)


def main(argv=None) -> int:
    head = Headline()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="the machine modelled (default h200); "
                        "the flags below override its constants")
    parser.add_argument("--l2-bytes", type=int, help="the device's L2 (cudaDeviceProp::l2CacheSize; default: the "
                        "machine's)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "build")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--no-cuda", action="store_true", help="skip the nvcc build of csrc/cuda")
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--no-liger", action="store_true", help="leave Liger-Kernel's kernels out of the ranking")
    parser.add_argument("--separate-gradient", action="store_true", help="model a provider that writes the gradient "
                        "into a buffer of its own (inplace=False): its lines count in the L2 footprint")
    parser.add_argument("--eviction-hints", action="store_true", help="what-if: the kernels' sweep-1 loads "
                        "evict_last and sweep-2 loads and stores evict_first, honoured by the L2")
    parser.add_argument("--launches", type=Path, help="a Triton launch record to use instead of recording the "
                        "headline step (each launched kernel is reported)")
    parser.add_argument("--clock-ghz", type=float)
    parser.add_argument("--l2-usable-fraction", type=float)
    parser.add_argument("--l2-usable-fraction-low", type=float)
    parser.add_argument("--l2-ways", type=int)
    parser.add_argument("--copy-tbps", type=float)
    parser.add_argument("--rows", type=int, default=head.rows)
    parser.add_argument("--cuda-threads", type=int, help="threads per block of the CUDA launch (default: its rule)")
    args = parser.parse_args(argv)
    gpu = machine(args.gpu, clock_hz=args.clock_ghz and args.clock_ghz * 1e9, l2_bytes=args.l2_bytes,
                  hbm_copy=args.copy_tbps and args.copy_tbps * 1e12, l2_usable_fraction=args.l2_usable_fraction,
                  l2_usable_fraction_low=args.l2_usable_fraction_low, l2_ways=args.l2_ways)
    head.rows = args.rows
    head.inplace = not args.separate_gradient
    head.eviction_hints = args.eviction_hints
    os.environ.pop("TRITON_INTERPRET", None)  # this process compiles for the GPU; the record runs in a child
    os.environ.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sass_dir = args.out_dir / "gpu_perf"
    kernels, errors = [], []
    if not args.no_triton:
        try:
            if args.launches:
                launches = [json.loads(line) for line in args.launches.read_text().splitlines() if line.strip()]
            else:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                launches = record_headline_launches(args.out_dir / "gpu_perf_launches.jsonl")
            kernels += triton_kernels(launches, args.arch, sass_dir, head)
        except Exception as exc:  # a tool error: reported, exit 1
            errors.append(f"triton: {type(exc).__name__}: {exc}")
    if not args.no_cuda:
        try:
            kernels += cuda_kernels(args.arch, sass_dir, head, args.cuda_threads)
        except Exception as exc:
            errors.append(f"cuda: {type(exc).__name__}: {exc}")
    if not args.no_liger:
        try:
            import liger_kernel  # noqa: F401  (installed by scripts/dev.sh setup; without it the ranking has no Liger)
        except ImportError:
            print("note: liger_kernel is not installed; the ranking leaves it out", file=sys.stderr)
        else:
            try:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                kernels += liger_kernels(record_liger_launches(args.out_dir / "gpu_perf_liger_launches.jsonl"),
                                         args.arch, sass_dir, head)
            except Exception as exc:
                errors.append(f"liger: {type(exc).__name__}: {exc}")
    # the other case (in place <-> separate gradient) from the same SASS, beside the one asked for
    other_head = dataclasses.replace(head, inplace=not head.inplace)
    others = [analyse(dict(k), gpu, other_head) for k in kernels]
    kernels = [analyse(k, gpu, head) for k in kernels]
    ranking = providers(kernels, gpu, head)
    report = dict(gpu=dataclasses.asdict(gpu), headline=dataclasses.asdict(head), kernels=kernels, providers=ranking,
                  other_case=dict(inplace=other_head.inplace, providers=providers(others, gpu, other_head)),
                  errors=errors)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_perf_report.json").write_text(json.dumps(report, indent=1))
    table = markdown(kernels, gpu, head, (other_head, others)) if kernels else "no kernel analysed\n"
    (args.out_dir / "gpu_perf_report.md").write_text(table)
    print(table, end="")
    for k in kernels:
        for sweep in (1, 2):
            if k[f"sweep{sweep}"] is None and not (k["backend"] == "liger" and k[f"sweep{3 - sweep}"]):
                print(f"warning: {k['backend']} {k['kernel']}: no sweep-{sweep} loop found in the SASS",
                      file=sys.stderr)
    for error in errors:
        print(f"FAILED {error}", file=sys.stderr)
    print(f"gpu perf report: {len(kernels)} kernels, {len(errors)} tool errors; "
          f"{args.out_dir / 'gpu_perf_report.md'}, {args.out_dir / 'gpu_perf_report.json'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""The static performance report (bench/gpu/gpu_perf_report.py): SASS parsing, loop finding, the hot path, the
occupancy and roofline model on small hand-written SASS, and one run on the real kernels (skipped without
the NVIDIA binary tools)."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "gpu_perf_report.py"
if str(REPORT.parent) not in sys.path:
    sys.path.insert(0, str(REPORT.parent))

import gpu_perf_report as perf  # noqa: E402  (bench/gpu/, a script beside gpu_build_check.py)

# cuobjdump -sass layout: address comment, optional guard, opcode, operands, encoding comment on the same line
# and a second encoding line. Sweep 1: 2 x 128-bit loads (16 bf16 per thread) with a branch around a rescale
# block (not the hot path); sweep 2: one 128-bit load and store (8 bf16); a scalar tail loop of sweep 2; the
# trap self-loop after EXIT.
SNIPPET = """
\tcode for sm_90
\t\tFunction : toy_kernel
        /*0000*/                   S2R R0, SR_TID.X ;                        /* 0x0000000000007919 */
                                                                              /* 0x000e220000002100 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;          /* 0x0000000402047981 */
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64+0x10] ;
        /*0030*/                   FSETP.GT.AND P0, PT, R4, R20, PT ;
        /*0040*/              @P0 BRA 0x80 ;
        /*0050*/                   FADD R12, R4, -R20 ;
        /*0060*/                   MUFU.EX2 R13, R12 ;
        /*0070*/                   BRA 0xb0 ;
        /*0080*/                   FADD R12, R20, -R4 ;
        /*0090*/                   MUFU.EX2 R13, R12 ;
        /*00a0*/                   FFMA R21, R21, R13, 1 ;
        /*00b0*/                   PRMT R14, R5, 0x7632, R14 ;
        /*00c0*/                   IADD3 R2, P1, R2, 0x20, RZ ;
        /*00d0*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*00e0*/             @!P1 BRA 0x10 ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0110*/                   FMUL R12, R4, R22 ;
        /*0120*/                   MUFU.EX2 R13, R12 ;
        /*0130*/                   F2FP.BF16.F32.PACK_AB R4, R13, R12 ;
        /*0140*/                   IMAD.MOV.U32 R15, RZ, RZ, R4 ;
        /*0150*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0160*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*0170*/             @!P1 BRA 0x100 ;
        /*0180*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0190*/                   MUFU.EX2 R13, R4 ;
        /*01a0*/             @!P2 STG.E.U16 desc[UR4][R2.64], R13 ;
        /*01b0*/             @!P1 BRA 0x180 ;
        /*01c0*/                   EXIT ;
        /*01d0*/                   BRA 0x1d0;
"""


def _instrs():
    functions = perf.parse_sass(SNIPPET)
    assert list(functions) == ["toy_kernel"]
    return functions["toy_kernel"]


def test_parse_sass_reads_guards_opcodes_and_targets():
    instrs = _instrs()
    assert len(instrs) == 30
    branch = next(i for i in instrs if i.addr == 0x40)
    assert (branch.pred, branch.opcode, branch.target, branch.conditional) == ("@P0", "BRA", 0x80, True)
    jump = next(i for i in instrs if i.addr == 0x70)
    assert (jump.target, jump.conditional) == (0xb0, False)
    assert instrs[2].opcode == "LDG.E.128.CONSTANT"
    assert perf.Instr(0, "", "BRA.DIV", "UR5, 0x7d10").conditional
    assert perf.Instr(0, "@P3", "BRA", "P4, 0x3900").target == 0x3900


def test_access_bits_and_classes():
    opcodes = ("LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E.U16", "STG.E", "LDGSTS.E.BYPASS.128")
    assert [perf.access_bits(op) for op in opcodes] == [128, 64, 16, 32, 128]
    cls = lambda text: perf.classify(perf.parse_sass(f"/*0000*/ {text} ;")[""][0])  # noqa: E731
    assert cls("MUFU.EX2 R1, R2") == "mufu_ex2" and cls("MUFU.RCP R1, R2") == "mufu_other"
    assert cls("FFMA R1, R2, R3, R4") == "fp32" and cls("FMNMX R1, R2, R3, !PT") == "fp32"
    assert cls("IMAD.MOV.U32 R1, RZ, RZ, R2") == "move" and cls("IMAD.WIDE R2, R3, 0x2, R4") == "integer"
    assert cls("HFMA2.MMA R17, -RZ, RZ, 0, 0") == "move"
    assert cls("FSEL R1, R2, R3, P0") == "pred_select" and cls("PRMT R1, R2, 0x7632, R1") == "convert"
    assert cls("STG.E.128 desc[UR4][R2.64], R4") == "global_store"


def test_loops_are_backward_branches_and_the_trap_loop_is_dropped():
    instrs = _instrs()
    assert perf.find_loops(instrs) == [(0x10, 0xe0), (0x100, 0x170), (0x180, 0x1b0), (0x1d0, 0x1d0)]
    loops, main = perf.sweeps(instrs, 16)
    assert [lp["start"] for lp in loops] == ["0x0010", "0x0100", "0x0180"]  # 0x1d0: BRA to itself, dropped
    assert [lp["role"] for lp in loops] == ["sweep 1 main", "sweep 2 main", "sweep 2 tail/copy (not counted)"]
    assert main[1]["start"] == "0x0010" and main[2]["start"] == "0x0100"


def test_nested_loops_keep_the_innermost():
    text = "\n".join(f"/*{a:04x}*/ {op} ;" for a, op in [
        (0x00, "FADD R1, R1, R2"), (0x10, "FADD R1, R1, R2"), (0x20, "@P0 BRA 0x10"), (0x30, "@P1 BRA 0x0")])
    assert perf.find_loops(perf.parse_sass(text)[""]) == [(0x10, 0x20)]


def test_hot_path_falls_through_conditional_branches_and_takes_unconditional_ones():
    instrs = _instrs()
    path = perf.hot_path(instrs, 0x10, 0xe0)
    assert [i.addr for i in path] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0xb0, 0xc0, 0xd0, 0xe0]
    sweep1 = perf.loop_report(instrs, 0x10, 0xe0, 16)
    assert sweep1["instructions"] == 11 and sweep1["static_instructions"] == 14
    assert sweep1["elements_per_thread"] == 16  # 2 x 128 bits of bf16
    assert sweep1["instr_per_element"] == pytest.approx(11 / 16, abs=1e-3)
    assert sweep1["mufu_per_element"] == pytest.approx(1 / 16, abs=1e-3)
    assert sweep1["global_load_bits"] == [128, 128] and sweep1["global_store_bits"] == []
    assert sweep1["classes"] == {"control": 3, "convert": 1, "fp32": 1, "global_load": 2, "integer": 1,
                                 "mufu_ex2": 1, "pred_select": 2}
    sweep2 = perf.loop_report(instrs, 0x100, 0x170, 16)
    assert (sweep2["sweep"], sweep2["elements_per_thread"], sweep2["instructions"]) == (2, 8, 8)
    tail = perf.loop_report(instrs, 0x180, 0x1b0, 16)
    assert (tail["elements_per_thread"], tail["masked_memory"]) == (1, 1)


def test_main_loop_prefers_more_elements_then_unmasked():
    def loop(start, ldg, guard):
        return [perf.Instr(start, guard, ldg, "R4, desc[UR4][R2.64]"),
                perf.Instr(start + 0x10, "", "FADD", "R1, R1, R4"),
                perf.Instr(start + 0x20, "@!P0", "BRA", f"0x{start:x}")]
    instrs = loop(0x0, "LDG.E.128", "@!P1") + loop(0x30, "LDG.E.128", "") + loop(0x60, "LDG.E.64", "")
    loops, main = perf.sweeps(instrs, 16)
    assert main[1]["start"] == "0x0030"  # same elements as 0x0: the unmasked one
    assert sum(lp["role"].endswith("main") for lp in loops) == 1


def test_occupancy_follows_the_calculator():
    gpu = perf.GPU()
    # 64 registers x 1024 threads: the whole register file, one block
    assert perf.occupancy(64, 1024, 1428, gpu)["blocks_per_sm"] == 1
    # 89 registers -> 2848 -> 3072 per warp; 16384 / 3072 = 5 warps per sub-partition, 20 per SM: 2 blocks of 8
    occ = perf.occupancy(89, 256, 1056, gpu)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (2, ["registers"])
    # 32 registers x 256 threads: 8 blocks by threads (2048 / 256) and by registers (16 warps of 1024 per sub)
    assert perf.occupancy(32, 256, 0, gpu)["blocks_per_sm"] == 8
    assert perf.occupancy(16, 32, 0, gpu)["limited_by"] == ["blocks"]
    assert perf.occupancy(16, 128, 100 * 1024, gpu)["limited_by"] == ["shared memory"]


def test_roofline_model():
    gpu, head = perf.GPU(), perf.Headline()
    sweep = dict(instr_per_element=8.0, mufu_per_element=1.0)
    # 132 rows = 40.1 MB in flight vs 45 MB usable (60 MB L2)
    fits = perf.predict(1, sweep, sweep, 1, gpu, head, threads=1024)
    row = 151936 * 2
    assert fits["bytes_in_flight"] == 132 * row
    # fully associative LRU: every second read hits; 16-way sets and a smaller usable L2 lose the rows' ends
    low, central, high = fits["sweep2_l2_hit_range"]
    assert high == 1.0 and low < central < high and fits["sweep2_l2_hit"] == central
    assert fits["hbm_read_bytes"] == pytest.approx(16384 * row * (2 - central), rel=1e-4)
    assert fits["hbm_traffic_bytes_range"][0] == 2 * 16384 * row + 16384 * 96  # the high hit rate: 1 read, 1 write
    assert fits["copy_floor_ms"] == pytest.approx(2 * 16384 * row / 4.3e12 * 1e3)
    assert fits["copy_floor_ms"] == pytest.approx(2.316, abs=1e-3)
    # issue: N V 16 / 32 / (132 x 4 x 1.98e9); MUFU: N V 2 / (132 x 16 x 1.98e9)
    assert fits["issue_ms"] == pytest.approx(16384 * 151936 * 16 / 32 / (132 * 4 * 1.98e9) * 1e3)
    assert fits["mufu_ms"] == pytest.approx(16384 * 151936 * 2 / (132 * 16 * 1.98e9) * 1e3)
    assert fits["kernel_ms_low"] <= fits["kernel_ms"] <= fits["kernel_ms_high"]
    assert fits["kernel_ms_low"] == pytest.approx(fits["copy_floor_ms"] + 16384 * 96 / 4.3e12 * 1e3, rel=1e-3)
    assert fits["pct_of_copy_bandwidth"] == pytest.approx(100 * fits["copy_floor_ms"] / fits["kernel_ms"], abs=0.1)
    assert fits["total_ms"] == pytest.approx(fits["kernel_ms"] + 0.010)
    assert fits["total_ms_high"] == pytest.approx(fits["kernel_ms_high"] + 0.010)
    # 4 rows per SM: 160 MB in flight, C / F = 0.28: h (2 - h) = 0.28 under the fully associative LRU (the high rate)
    spills = perf.predict(4, sweep, sweep, 1, gpu, head, threads=256)
    ratio = gpu.l2_bytes * 0.75 / (4 * 132 * row)
    hit = 1 - math.sqrt(1 - ratio)
    assert spills["sweep2_l2_hit_range"][2] == pytest.approx(hit, abs=1e-4)
    assert spills["sweep2_l2_hit_random"] == pytest.approx(ratio, abs=1e-4)
    assert ratio > hit  # the smooth model was optimistic
    assert spills["memory_ms"] > fits["memory_ms"]
    # issue-bound when the loops are heavy; a sweep not found gives no prediction (and no failure)
    heavy = perf.predict(1, dict(instr_per_element=40.0, mufu_per_element=1.0), sweep, 1, gpu, head, threads=1024)
    assert heavy["bound"] != "memory" and heavy["kernel_ms"] > fits["kernel_ms"]
    assert perf.predict(1, None, sweep, 1, gpu, head)["kernel_ms"] is None


def test_eviction_hints_in_the_sass_and_in_the_l2_model():
    """Sweep 1's loads evict_last (.EL) and sweep 2's loads and stores evict_first (.EF) are read from the SASS and
    mark the kernel; with them only the other rows' first-sweep lines compete for the L2, so the hit rates rise and
    a separate gradient's writes no longer take its lines."""
    text = """
        Function : hinted
        /*0000*/ LDG.E.EL.128 R4, desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R9, R4 ;
        /*0020*/ @!P1 BRA 0x0 ;
        /*0030*/ LDG.E.EF.128 R4, desc[UR4][R2.64] ;
        /*0040*/ FMUL R4, R4, R9 ;
        /*0050*/ STG.E.EF.128 desc[UR4][R2.64], R4 ;
        /*0060*/ @!P1 BRA 0x30 ;
        /*0070*/ EXIT ;
    """
    instrs = perf.parse_sass(text)["hinted"]
    _, main = perf.sweeps(instrs, 16)
    assert (main[1]["load_hints"], main[2]["load_hints"], main[2]["store_hints"]) == (["EL"], ["EF"], ["EF"])
    gpu, row = perf.GPU(), 151936 * 2
    for separate in (False, True):
        plain = perf.l2_hit_range(132 * row, gpu, separate)
        hinted = perf.l2_hit_range(132 * row, gpu, separate, hints=True)
        assert all(h >= p for h, p in zip(hinted, plain)) and list(hinted) == sorted(hinted)
    assert perf.l2_hit_range(132 * row, gpu, True, hints=True) == perf.l2_hit_range(132 * row, gpu, False, hints=True)
    kernel = dict(backend="triton", kernel="hinted", arch="sm_90", registers=64, spill_bytes=0, smem_per_block=0,
                  threads_per_block=1024, launches=1, instrs=instrs)
    perf.analyse(kernel, gpu, perf.Headline(inplace=False))
    assert kernel["eviction_hints"] and kernel["model"]["sweep2_l2_hit"] > 0.9


def test_ranges_are_ordered_and_the_separate_gradient_is_slower():
    """low <= central <= high for every kernel shape, and a separate gradient buffer (its lines take L2) never faster
    than in place, at every bound."""
    gpu = perf.GPU()
    for blocks, threads, ipe, dist in ((1, 1024, 10.0, 40), (1, 768, 14.0, 1), (2, 256, 6.0, 200), (4, 512, 17.0, 6)):
        loop = dict(instr_per_element=ipe, mufu_per_element=1.0, elements_per_thread=16,
                    instructions=int(16 * ipe), loads=[dict(position=0, bytes=32, distance=dist)])
        models = {}
        for inplace in (True, False):
            head = perf.Headline(inplace=inplace)
            m = perf.predict(blocks, loop, loop, 1, gpu, head, threads=threads, serial_s=(1e-6, 1.5e-6, 2e-6))
            assert m["total_ms_low"] <= m["total_ms"] <= m["total_ms_high"], (blocks, inplace, m)
            assert m["sweep2_l2_hit_range"] == sorted(m["sweep2_l2_hit_range"])
            models[inplace] = m
        for key in ("total_ms_low", "total_ms", "total_ms_high"):
            assert models[True][key] <= models[False][key] + 1e-9, key


def test_l2_hit_under_lru():
    """All hits while the rows fit (a separate gradient: while they fit twice over); beyond, h (k - h) = C / F,
    continuous at the edge, below the smooth min(1, C / F); policy names checked."""
    assert perf.l2_hit(40e6, 45e6) == 1.0 and perf.l2_hit(45e6, 45e6) == 1.0
    assert perf.l2_hit(80e6, 45e6) == pytest.approx(1 - math.sqrt(1 - 45 / 80))
    assert perf.l2_hit(45.001e6, 45e6) == pytest.approx(1.0, abs=0.01)  # no cliff at the edge
    assert perf.l2_hit(40e6, 45e6, separate_gradient=True) == pytest.approx((3 - math.sqrt(9 - 4 * 45 / 40)) / 2)
    assert perf.l2_hit(22e6, 45e6, separate_gradient=True) == 1.0
    for f in (50e6, 80e6, 200e6):
        assert perf.l2_hit(f, 45e6) < perf.l2_hit(f, 45e6, policy="random")
    with pytest.raises(ValueError, match="policy"):
        perf.l2_hit(1.0, 1.0, policy="fifo")


def test_serial_term_adds_the_rows_each_block_runs_in_turn():
    """2 us of straight-line code per row at one row per SM: ceil(16384 / 132) = 125 rows in turn, 0.25 ms added
    (at each bound, where the kernel is bound by the copy); a range (low, central, high) adds its own."""
    gpu, head = perf.GPU(), perf.Headline()
    sweep = dict(instr_per_element=8.0, mufu_per_element=1.0)
    base = perf.predict(1, sweep, sweep, 1, gpu, head)
    slow = perf.predict(1, sweep, sweep, 1, gpu, head, serial_s=2e-6)
    assert slow["rows_per_block_in_turn"] == 125
    assert slow["serial_ms"] == pytest.approx(0.25)
    assert slow["kernel_ms"] == pytest.approx(base["kernel_ms"] + 0.25)
    ranged = perf.predict(1, sweep, sweep, 1, gpu, head, serial_s=(1e-6, 2e-6, 3e-6))
    assert ranged["serial_ms_range"] == pytest.approx([0.125, 0.375])
    assert ranged["kernel_ms_high"] == pytest.approx(base["kernel_ms_high"] + 0.375)


def test_serial_code_of_all_warps_in_the_kernel_record():
    """analyse: one warp's chain against the issue slots of every resident warp running the same code; the range
    is the chain alone, max(chain, all warps) (full overlap) and their sum (none)."""
    gpu, head = perf.GPU(), perf.Headline()
    kernel = dict(backend="cuda", kernel="toy", arch="sm_90", registers=40, spill_bytes=0, smem_per_block=1024,
                  threads_per_block=1024, launches=1, instrs=_instrs())
    perf.analyse(kernel, gpu, head)
    serial = kernel["serial"]
    assert serial["all_warps_issue_seconds"] == pytest.approx(32 * 3 / 4 / gpu.clock_hz)  # 3 instructions, 32 warps
    low, central, high = serial["seconds_range"]
    assert low == serial["chain_seconds"] and low <= central <= high
    assert central == max(serial["chain_seconds"], serial["all_warps_issue_seconds"])
    assert high == pytest.approx(serial["chain_seconds"] + serial["all_warps_issue_seconds"])


def test_serial_code_counts_what_is_outside_the_loops():
    gpu = perf.GPU()
    instrs = _instrs()
    loops, _ = perf.sweeps(instrs, 16)
    serial = perf.serial_code(instrs, loops, gpu)
    # outside the three loops and before EXIT: S2R (0x00) and BAR.SYNC (0xf0); the trap after EXIT is left out
    assert serial["counts"]["barrier"] == 1 and serial["counts"]["other"] == 2  # S2R and EXIT
    assert serial["clocks"] == gpu.barrier_clocks + 2
    assert serial["load_round_trips"] == 0
    assert serial["static"]["counts"] == serial["counts"]  # nothing branched around here


def test_straight_path_falls_through_and_takes_forward_branches():
    """A conditional branch falls through, an unconditional forward one is taken: the fp64 multiply reached only by
    the conditional branch is in the static bound, not on the path."""
    text = """
        Function : toy
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/              @P0 BRA 0x40 ;
        /*0020*/                   DADD R2, R2, R4 ;
        /*0030*/                   BRA 0x50 ;
        /*0040*/                   DMUL R2, R2, R4 ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
    """
    instrs = perf.parse_sass(text)["toy"]
    assert [i.opcode for i in perf.straight_path(instrs, [])] == ["S2R", "BRA", "DADD", "BRA", "EXIT"]
    serial = perf.serial_code(instrs, [], perf.GPU())
    assert serial["counts"]["fp64"] == 1 and serial["static"]["counts"]["fp64"] == 2


def test_single_sweep_kernels_and_the_ranking():
    """Liger's forward (a read) and backward (a read and a write) as two one-sweep kernels: three passes of traffic
    in all, ranked against a two-sweep kernel whose rows fit the L2."""
    gpu, head = perf.GPU(), perf.Headline()
    row = 151936 * 2
    loop = dict(instr_per_element=8.0, mufu_per_element=1.0, load_bytes_in_flight=128)
    fwd = perf.predict_single(24, loop, False, gpu, head, threads=32)
    bwd = perf.predict_single(4, loop, True, gpu, head, threads=512)
    assert fwd["hbm_traffic_bytes"] == 16384 * row + 16384 * 16
    assert bwd["hbm_traffic_bytes"] == 2 * 16384 * row + 16384 * 16
    fused = perf.predict(1, loop, loop, 1, gpu, head, threads=1024)
    kernels = [dict(backend="liger", arch="sm_90", kernel="fwd", model=fwd),
               dict(backend="liger", arch="sm_90", kernel="bwd", model=bwd),
               dict(backend="triton", arch="sm_90", kernel="fused", model=fused)]
    ranking = perf.providers(kernels, gpu, head)
    assert [r["provider"] for r in ranking] == ["triton", "liger"]
    assert ranking[1]["predicted_ms"] == pytest.approx(fwd["total_ms"] + bwd["total_ms"], abs=1e-3)
    assert ranking[1]["hbm_gb"] == pytest.approx(3 * 16384 * row / 1e9, abs=0.01)


def test_load_to_use_distance_and_time_weighted_bytes():
    """A load read 2 instructions on waits a round trip each iteration; one read only in the next iteration (a
    look-ahead) overlaps the loop's issue; the time-weighted bytes in flight (bytes x round trip / iteration) grow
    with the distance while the bytes issued stay the same."""
    def ins(op, operands):
        return perf.Instr(0, "", op, operands)
    filler = [ins("FADD", f"R{30 + k}, R{30 + k}, R1") for k in range(40)]
    near = [ins("LDG.E.128", "R20, desc[UR4][R2.64]"), ins("IADD3", "R2, R2, 0x10, RZ"), ins("FADD", "R1, R1, R21")]
    ahead = [ins("FADD", "R1, R1, R21"), ins("IADD3", "R2, R2, 0x10, RZ"), ins("LDG.E.128", "R20, desc[UR4][R2.64]")]
    assert [d["distance"] for d in perf.load_use(near + filler)] == [2]
    assert [d["distance"] for d in perf.load_use(ahead + filler)] == [len(filler) + 1]  # wraps to the next iteration
    assert perf.load_bytes_in_flight(near + filler) == perf.load_bytes_in_flight(filler + near) == 16
    piped = [ins("DEPBAR.LE", "SB0, 0x2"), ins("LDGSTS.E.BYPASS.128", "[R71], desc[UR18][R74.64]")]
    assert perf.load_use(piped)[0]["distance"] == 3 * 2
    # one warp alone: 43 instructions, a 1000-clock round trip: exposed once an iteration when read 2 on; two
    # iterations ahead, two iterations take the round trip; 30 iterations ahead, hidden
    n = 43
    assert perf.iteration_clocks(n, [dict(position=0, bytes=16, distance=2)], 1000, 1) == pytest.approx(1000 + n - 2)
    assert perf.iteration_clocks(n, [dict(position=0, bytes=16, distance=2 * n)], 1000, 1) == pytest.approx(500)
    assert perf.iteration_clocks(n, [dict(position=0, bytes=16, distance=30 * n)], 1000, 1) == pytest.approx(n)
    gpu, head = perf.GPU(), perf.Headline()
    base = dict(instr_per_element=n / 8, mufu_per_element=0.0, elements_per_thread=8, instructions=n)
    use = {d: perf._sweep_clocks(dict(base, loads=[dict(position=0, bytes=16, distance=d)]), 0.0, False, 32, gpu,
                                 head) for d in (2, 40, 2 * n)}
    assert use[2]["time_weighted_bytes_in_flight"] < use[40]["time_weighted_bytes_in_flight"] <= \
        use[2 * n]["time_weighted_bytes_in_flight"]
    for c in use.values():
        assert c["busy"] <= c["low"] <= c["central"] <= c["high"]


def test_repairman_between_its_asymptotic_bounds():
    """Mean value analysis of w warps on one scheduler: w x service when the waits are short, service + wait with
    one warp, and between the bounds max(w S, S + Z) and w S + Z always."""
    assert perf._repairman_clocks(1, 100, 900) == pytest.approx(1000)
    assert perf._repairman_clocks(8, 100, 0) == pytest.approx(800)
    for w, service, wait in ((8, 172, 1200), (6, 459, 1300), (16, 134, 600)):
        t = perf._repairman_clocks(w, service, wait)
        assert max(w * service, service + wait) <= t + 1e-6 and t <= w * service + wait


def test_l2_hit_by_stack_distance_in_sets():
    """Set-associative LRU: below the fully associative LRU (its limit with many ways) and rising with the ways;
    in place 0.6-0.95 at the headline's 132 rows in flight, a separate gradient far less; the range is ordered."""
    gpu = perf.GPU()
    row = 151936 * 2
    usable = gpu.l2_bytes * gpu.l2_usable_fraction
    full = perf.l2_hit(132 * row, usable)
    assert perf.l2_hit_sets(132 * row, usable, ways=4) < perf.l2_hit_sets(132 * row, usable, ways=16) < full
    assert perf.l2_hit_sets(132 * row, usable, ways=512) == pytest.approx(full, abs=0.03)
    low, central, high = perf.l2_hit_range(132 * row, gpu)
    assert 0.6 <= low <= central <= high and central < 0.95
    sep = perf.l2_hit_range(132 * row, gpu, separate_gradient=True)
    assert all(s < i for s, i in zip(sep, (low, central, high)))
    assert perf.l2_hit_sets(0, usable) == 1.0


def test_cuda_block_threads_matches_the_launcher_rule():
    assert perf.cuda_block_threads(151936, 2) == 768  # kFusedThreads caps the power of two (1024)
    assert perf.cuda_block_threads(1000, 2) == 128
    assert perf.cuda_block_threads(16, 4) == 32
    # blocks per SM: the rows within 3/4 of the L2, at most the resident ones, at least 1
    assert perf.cuda_blocks_per_sm(60 * 10**6, 132, 151936 * 2, 1) == 1
    assert perf.cuda_blocks_per_sm(60 * 10**6, 132, 4096 * 2, 8) == 8
    assert perf.cuda_blocks_per_sm(60 * 10**6, 132, 10**9, 4) == 1


def _toy(text):
    return perf.parse_sass("Function : toy\n" + text)["toy"]


def test_serial_chain_waits_for_a_load_at_its_first_use():
    """In-order issue with a scoreboard: a load read at once costs a round trip; one read only after a loop (a
    sweep) is hidden by it; a loop that reads it waits; a cp.async is waited for at the next DEPBAR; independent
    instructions overlap, dependent ones add their latencies."""
    gpu = perf.GPU()
    trip = gpu.hbm_latency_s * gpu.clock_hz
    exposed = _toy("""
        /*0000*/ LDG.E.64 R4, desc[UR4][R2.64] ;
        /*0010*/ DADD R6, R4, R4 ;
        /*0020*/ EXIT ;""")
    serial = perf.serial_code(exposed, [], gpu)
    assert serial["load_round_trips"] == 1
    assert serial["clocks"] == pytest.approx(trip + gpu.fp64_clocks, abs=2)
    hidden = _toy("""
        /*0000*/ LDG.E.64 R4, desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R9, R8 ;
        /*0020*/ @P0 BRA 0x10 ;
        /*0030*/ DADD R6, R4, R4 ;
        /*0040*/ EXIT ;""")
    loops = [dict(start="0x0010", end="0x0020")]
    serial = perf.serial_code(hidden, loops, gpu)
    assert serial["load_round_trips"] == 0 and serial["clocks"] < 20
    waited = _toy("""
        /*0000*/ LDG.E R8, desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R9, R8 ;
        /*0020*/ @P0 BRA 0x10 ;
        /*0030*/ EXIT ;""")
    assert perf.serial_code(waited, loops, gpu)["load_round_trips"] == 1
    copied = _toy("""
        /*0000*/ LDGSTS.E.64 [R0], desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R9, R8 ;
        /*0020*/ DEPBAR.LE SB0, 0x0 ;
        /*0030*/ EXIT ;""")
    serial = perf.serial_code(copied, [], gpu)
    assert serial["clocks"] == pytest.approx(trip + 2, abs=2)
    chain = _toy("""
        /*0000*/ DADD R2, R4, R4 ;
        /*0010*/ DADD R6, R2, R2 ;
        /*0020*/ DADD R8, R10, R10 ;
        /*0030*/ EXIT ;""")
    assert perf.serial_code(chain, [], gpu)["clocks"] == 2 * gpu.fp64_clocks + 1  # the third overlaps the second


def test_a_sweep_not_fed_by_a_prefetch_starts_with_a_round_trip():
    """A main sweep loop whose first loads are its own waits a round trip (HBM for a load-only sweep 1, L2 for a
    sweep 2 that stores); one fed by a block loaded before it (a prefetch) does not wait again."""
    gpu = perf.GPU()
    own = _toy("""
        /*0000*/ FADD R9, R9, R9 ;
        /*0010*/ LDG.E R8, desc[UR4][R2.64] ;
        /*0020*/ FADD R9, R9, R8 ;
        /*0030*/ @P0 BRA 0x10 ;
        /*0040*/ EXIT ;""")
    loops = [dict(start="0x0010", end="0x0030")]
    serial = perf.serial_code(own, loops, gpu, {0x10})
    assert serial["clocks"] == pytest.approx(gpu.hbm_latency_s * gpu.clock_hz + 5, abs=2)
    fed = _toy("""
        /*0000*/ LDG.E R8, desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R9, R8 ;
        /*0020*/ FADD R7, R7, R7 ;
        /*0030*/ LDG.E R8, desc[UR4][R2.64] ;
        /*0040*/ @P0 BRA 0x10 ;
        /*0050*/ EXIT ;""")
    serial = perf.serial_code(fed, [dict(start="0x0010", end="0x0040")], gpu, {0x10})
    assert serial["load_round_trips"] == 1  # the prefetched block's, once
    assert serial["clocks"] < gpu.hbm_latency_s * gpu.clock_hz + 20


def test_straight_path_goes_through_the_sweeps_and_splits_off_the_prologue():
    """Falling through at 0x30 leads to a store-only loop (a masked row's zeros) and the row loop's end without the
    sweep at 0x70: the path takes that branch instead. The row loop's back edge (0xa0 to 0x20) splits off the
    prologue (the load at 0x00 and its wait), counted once a block."""
    gpu = perf.GPU()
    instrs = _toy("""
        /*0000*/ LDG.E R8, desc[UR4][R2.64] ;
        /*0010*/ FADD R9, R8, R8 ;
        /*0020*/ FADD R10, R9, R9 ;
        /*0030*/ @P1 BRA 0x70 ;
        /*0040*/ STG.E desc[UR4][R2.64], RZ ;
        /*0050*/ @P0 BRA 0x40 ;
        /*0060*/ BRA 0xa0 ;
        /*0070*/ LDG.E R11, desc[UR4][R4.64] ;
        /*0080*/ FADD R12, R12, R11 ;
        /*0090*/ @P0 BRA 0x70 ;
        /*00a0*/ @P2 BRA 0x20 ;
        /*00b0*/ EXIT ;""")
    loops = [dict(start="0x0040", end="0x0050"), dict(start="0x0070", end="0x0090")]
    plain = perf.straight_path(instrs, loops)
    assert [m.start for m in plain if isinstance(m, perf.LoopMark)] == [0x40]
    path = perf.straight_path(instrs, loops, frozenset({0x70}))
    assert [m.start for m in path if isinstance(m, perf.LoopMark)] == [0x70]
    serial = perf.serial_code(instrs, loops, gpu, {0x70})
    assert serial["through_sweeps"]
    assert serial["load_round_trips"] == 1  # the turn from 0x20 on waits only for the sweep's own first loads
    assert serial["prologue_seconds"] > gpu.hbm_latency_s  # the first load's round trip, once a block


def test_markdown_of_a_kernel():
    gpu, head = perf.GPU(), perf.Headline()
    kernel = dict(backend="cuda", kernel="toy", arch="sm_90", registers=40, spill_bytes=0, smem_per_block=1024,
                  threads_per_block=256, launches=1, instrs=_instrs())
    perf.analyse(kernel, gpu, head)
    table = perf.markdown([kernel], gpu, head)
    assert "| cuda toy sm_90 | 40 | 0 | 1024 | 256 |" in table
    assert "sweep 1 main" in table and "tail/copy (not counted)" in table
    ranked = perf.providers([kernel], gpu, head)
    assert ranked[0]["predicted_ms_low"] <= ranked[0]["predicted_ms"] <= ranked[0]["predicted_ms_high"]
    assert "A prediction, not a measurement" in table and f"{ranked[0]['predicted_ms']:.2f} (" in table


def test_the_machines_a_gpu_run_may_get():
    """--gpu h100 models the H100 the device tool may lend instead of the H200: its copy rate and L2, the same SMs;
    a memory-bound kernel's time follows the copy rate, and a flag overrides the machine's constant."""
    h200, h100 = perf.machine("h200"), perf.machine("h100")
    assert h200 == dataclasses.replace(perf.GPU(), key="h200")
    assert (h100.sms, h100.clock_hz) == (h200.sms, h200.clock_hz) and h100.hbm_copy < h200.hbm_copy
    assert h100.l2_bytes == 50 * 2**20 and perf.machine("h100", l2_bytes=123, clock_hz=None).l2_bytes == 123
    with pytest.raises(ValueError, match="gpu must be one of"):
        perf.machine("a100")
    head, predicted = perf.Headline(), {}
    for gpu in (h200, h100):
        kernel = dict(backend="cuda", kernel="toy", arch="sm_90", registers=40, spill_bytes=0, smem_per_block=1024,
                      threads_per_block=256, launches=1, instrs=_instrs())
        perf.analyse(kernel, gpu, head)
        predicted[gpu.key] = perf.providers([kernel], gpu, head)[0]["predicted_ms"]
        assert gpu.name in perf.markdown([kernel], gpu, head)
    assert predicted["h100"] > predicted["h200"]


@pytest.mark.skipif(perf.nvidia_tool("cuobjdump") is None, reason="cuobjdump (Triton's bundled NVIDIA tools or the "
                    "CUDA toolkit) is not available")
@pytest.mark.slow
def test_report_on_the_real_kernels(tmp_path):
    """The whole report on today's kernels and Liger's (about 30 s): both sweeps found in each of ours, the one sweep of
    each of Liger's, 128-bit loads and stores, and the ranking."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPORT), "--out-dir", str(tmp_path)]
    if perf.gpu_build_check.nvcc_path() is None:
        cmd.append("--no-cuda")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_perf_report.json").read_text())
    assert not report["errors"]
    assert {k["backend"] for k in report["kernels"]} >= {"triton", "liger"}
    for kernel in report["kernels"]:
        assert kernel["occupancy"]["blocks_per_sm"] >= 1
        if kernel["backend"] == "liger":  # one sweep each: the forward reads, the backward reads and writes
            sweep = kernel["sweep1"] if kernel["kernel"] == "_grpo_loss_fwd_kernel" else kernel["sweep2"]
            assert sweep and 128 in sweep["global_load_bits"], kernel["loops"]
            continue
        assert kernel["sweep1"] and kernel["sweep2"], kernel["loops"]
        assert 128 in kernel["sweep1"]["global_load_bits"] and 128 in kernel["sweep2"]["global_store_bits"]
        assert kernel["sweep1"]["global_store_bits"] == []
        assert kernel["model"]["kernel_ms"] >= kernel["model"]["copy_floor_ms"] * 0.99
    liger = [k for k in report["kernels"] if k["backend"] == "liger"]
    assert sorted(k["kernel"] for k in liger) == ["_grpo_loss_bwd_kernel", "_grpo_loss_fwd_kernel"]
    ranked = {r["provider"]: r for r in report["providers"]}
    assert ranked["liger"]["hbm_gb"] == pytest.approx(3 * 16384 * 151936 * 2 / 1e9, abs=0.01)  # 2 reads, 1 write
    assert "triton" in ranked and ranked["triton"]["predicted_ms"] > 0
    # a range per provider, and the separate-gradient case beside the in-place one, never faster
    other = {r["provider"]: r for r in report["other_case"]["providers"]}
    assert report["other_case"]["inplace"] is False and set(other) == set(ranked)
    for name, row in ranked.items():
        assert row["predicted_ms_low"] <= row["predicted_ms"] <= row["predicted_ms_high"], row
        for key in ("predicted_ms_low", "predicted_ms", "predicted_ms_high"):
            assert row[key] <= other[name][key] + 1e-9, (name, key)
    for kernel in report["kernels"]:
        for key in ("sweep1", "sweep2", "sweep"):
            if f"{key}_load_to_use" in kernel["model"]:
                assert kernel["model"][f"{key}_time_weighted_bytes_in_flight"] > 0
    assert (tmp_path / "gpu_perf_report.md").read_text() in result.stdout

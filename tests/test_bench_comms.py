"""fused_is.benchmarks.comms: the collectives each distributed call issues (issue #16: one O(N) collective of the row
statistics, never O(N x V)), counted in 2 gloo processes at a small N and two vocabulary sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fused_is.benchmarks import comms as bench_comms

N = 64
VOCABS = (16, 48)
CASES = ("vocab ppo_tis (token-local)", "vocab seq_tis old=None (two-pass)", "vocab token_logprobs",
         "vocab linear_policy_loss ppo_tis", "sequence ppo_tis", "global_normalizer (4 micro-batches)")
# torch.distributed names fused_is uses that move no data
NOT_COLLECTIVES = {"is_available", "is_initialized", "get_world_size", "get_rank", "get_backend", "group", "ReduceOp",
                   "ProcessGroup", "init_process_group", "destroy_process_group"}


def test_every_collective_fused_is_calls_is_counted():
    """Every torch.distributed function the package names (dist.<name>) is wrapped by the counter, or moves no
    data: nothing fused_is sends escapes the benchmark."""
    package = Path(bench_comms.__file__).resolve().parents[1]  # fused_is/
    used = set()
    for path in package.rglob("*.py"):
        if path.parent.name != "benchmarks":
            used |= set(re.findall(r"\bdist\.(\w+)", path.read_text()))
    assert used - NOT_COLLECTIVES, "fused_is names no collective: the pattern is stale"
    assert used - NOT_COLLECTIVES <= set(bench_comms.COLLECTIVES), used - NOT_COLLECTIVES - set(bench_comms.COLLECTIVES)


@pytest.fixture(scope="module")
def records():
    return bench_comms.measure(2, N, VOCABS, CASES, backend="auto")


def _by_case(records):
    out = {}
    for r in records:
        out.setdefault(r["case"], []).append(r)
    return out


def test_bytes_do_not_depend_on_vocab(records):
    for case, recs in _by_case(records).items():
        assert [r["vocab_local"] for r in recs] == list(VOCABS), case
        assert all(bench_comms.signature(r) == bench_comms.signature(recs[0]) for r in recs), case


@pytest.mark.parametrize("case", ["vocab ppo_tis (token-local)", "vocab seq_tis old=None (two-pass)",
                                  "vocab token_logprobs"])
def test_vocab_parallel_call(records, case):
    """One collective of the shard sizes (one int64 per rank), then the row statistics in one all-gather of each
    rank's [5, N] float64 partials (merged in rank order on every rank, so every rank gets the same bits whatever
    the collective's algorithm); the two-pass plan adds none (every rank has every lp after it, so the sequence
    reduction is local). Nothing else."""
    for r in _by_case(records)[case]:
        assert bench_comms.signature(r) == [("all_gather", "int64", [[1]], 8),
                                            ("all_gather", "float64", [[5, N]], 5 * N * 8)], case
        assert r["payload_bytes"] == 40 * N + 8


def test_vocab_parallel_linear(records):
    """linear_policy_loss with a weight shard: the shard sizes, the statistics of every chunk's rows in the same
    all-gather as the logits path (once, not per chunk), and one all-reduce of d hidden [N, D] (the hidden
    states are not gathered: every rank has them)."""
    for r in _by_case(records)["vocab linear_policy_loss ppo_tis"]:
        assert bench_comms.signature(r) == [("all_gather", "int64", [[1]], 8),
                                            ("all_gather", "float64", [[5, N]], 5 * N * 8),
                                            ("all_reduce", "float32", [[N, bench_comms.HIDDEN_DIM]],
                                             N * bench_comms.HIDDEN_DIM * 4)]


def test_context_parallel_sends_per_sequence_numbers_only(records):
    """sequence_group: all-reduces of per-sequence sums ([B] float64) and of the batch totals, none of size N or
    V; the loss's and the metrics' totals go in one SUM and one MAX (the token-local preset: the sequence counts,
    then those two)."""
    for r in _by_case(records)["sequence ppo_tis"]:
        assert r["collectives"]
        for c in r["collectives"]:
            assert c["op"] == "all_reduce" and c["dtype"] == "float64", c
            assert c["payload_bytes"] <= bench_comms.SEQUENCES * 8, c
        assert len(r["collectives"]) == 3, [c["shape"] for c in r["collectives"]]


def test_global_normalizer_one_number(records):
    for r in _by_case(records)["global_normalizer (4 micro-batches)"]:
        assert bench_comms.signature(r) == [("all_reduce", "float64", [[]], 8)]


def test_table(records):
    table = bench_comms.format_table(records)
    assert table.count("\n") == len(CASES) + 1 and "| NO |" not in table

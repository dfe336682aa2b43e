"""`fused-is bench --comms` / `python -m fused_is.benchmarks.comms`: what fused_is sends per call on torch.distributed.

Real gloo process groups on this machine (torch.multiprocessing spawn, one process per rank, as
tests/test_distributed.py). In every rank each torch.distributed collective (all_reduce, all_gather,
all_gather_into_tensor, broadcast, ... : COLLECTIVES) is replaced by a counting wrapper that records the
operation, dtype, shape and bytes and then calls the original; fused_is reaches torch.distributed only through
module attributes (`dist.all_gather(...)`, fused_is/distributed.py and fused_is/api.py), so every collective it
issues goes through a wrapper. One uncounted warm-up call, then one counted call (forward and backward) per case.

What is counted, per rank and call:
- collectives: how many, and which;
- payload: the bytes this rank contributes: the tensor of an all_reduce, the input of an all_gather, the
  tensor of a broadcast on its source rank (0 elsewhere), the inputs of the others;
- ring: the bytes this rank sends with a ring algorithm: an all_reduce of B bytes 2 (w - 1) / w B (reduce-scatter
  then all-gather), an all_gather of B bytes per rank (w - 1) B, a broadcast B on the source; the payload for the
  others. (gloo picks its own algorithms; the ring is the usual bandwidth model, and NCCL's for large tensors.)

Cases (N tokens on every rank; V_local = each rank's vocabulary shard, or the whole vocabulary for context
parallel): vocab_group policy_loss with a token-local preset (ppo_tis) and two two-pass ones (seq_tis without
old_logprobs, gspo), token_logprobs, linear_policy_loss and linear_token_logprobs (weight [V_local, D] shards),
sequence_group policy_loss ([B, T_local, V] padded, T_local = N / B), and global_normalizer. Every case runs at
two V_local: the bytes are the same (column `same for every V`), and bytes / N shows which are O(N).
Outputs in --out (default bench/results/local/cpu): comms.json (environment, settings, every rank-0 record) and
comms.md (the whole table and the call sites); the printed table (fewer columns) fits 100.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from .common import ArgumentParser, default_out_dir, environment, fixed_width, positive_int, wrote

# every collective and point-to-point call of torch.distributed that could carry data (wrapped where it exists)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced",
               "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
               "scatter_object_list", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")

DEFAULT_VOCABS = (512, 1024)
SEQUENCES = 16  # B: sequences of the padded cases (T = N / B); context parallel splits each over the group
HIDDEN_DIM = 64  # D of the fused-linear cases (chunk rows max(D, 256) = 256)
CASES = ("vocab ppo_tis (token-local)", "vocab seq_tis old=None (two-pass)", "vocab gspo (two-pass)",
         "vocab token_logprobs", "vocab linear_policy_loss ppo_tis", "vocab linear_token_logprobs",
         "sequence ppo_tis", "sequence seq_tis old=None (two-pass)", "sequence gspo (two-pass)",
         "global_normalizer (1 mask)", "global_normalizer (4 micro-batches)")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


class Counter:
    """Counting wrappers around torch.distributed's collectives; `records` while `active`."""

    def __init__(self):
        self.records: List[dict] = []
        self.active = False
        self._saved: Dict[str, Callable] = {}

    def install(self) -> "Counter":
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None and name not in self._saved:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.active:
                self.records.append(self._record(name, args, kwargs))
            return original(*args, **kwargs)

        return counted

    @staticmethod
    def _record(name: str, args, kwargs) -> dict:
        import torch.distributed as dist

        group = kwargs.get("group")
        world = dist.get_world_size(group)
        if name == "all_gather":  # (tensor_list, tensor)
            data = args[1] if len(args) > 1 else kwargs["tensor"]
        elif name == "all_gather_into_tensor":  # (output_tensor, input_tensor)
            data = args[1] if len(args) > 1 else kwargs["input_tensor"]
        elif name in ("reduce_scatter", "scatter"):  # (output, input_list)
            data = args[1] if len(args) > 1 else kwargs.get("input_list", kwargs.get("scatter_list"))
        elif name == "reduce_scatter_tensor":
            data = args[1] if len(args) > 1 else kwargs["input"]
        elif name in ("all_to_all",):
            data = args[1] if len(args) > 1 else kwargs["input_tensor_list"]
        elif name in ("all_to_all_single",):
            data = args[1] if len(args) > 1 else kwargs["input"]
        else:
            data = args[0] if args else next(iter(kwargs.values()), None)
        tensors = list(_tensors(data))
        sites = _call_sites()
        payload = _nbytes(tensors)
        if name == "broadcast":
            src = args[1] if len(args) > 1 else kwargs.get("src", 0)
            if dist.get_rank() != src:
                payload = 0
        ring = {"all_reduce": 2.0 * (world - 1) / world * payload, "all_gather": float((world - 1) * payload),
                "all_gather_into_tensor": float((world - 1) * payload)}.get(name, float(payload))
        return dict(op=name, dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else None,
                    shape=[list(t.shape) for t in tensors], payload_bytes=payload, ring_bytes=ring,
                    reduce_op=str(kwargs.get("op", "SUM")).split(".")[-1] if name == "all_reduce" else None,
                    sites=sites)

    def count(self, call: Callable[[], object]) -> List[dict]:
        self.records, self.active = [], True
        try:
            call()
        finally:
            self.active = False
        return self.records


KERNEL_PACKAGE = str(Path(__file__).resolve().parents[1])  # fused_is/
_BENCHMARKS = str(Path(__file__).resolve().parent)  # fused_is/benchmarks/


def _call_sites(depth: int = 6) -> List[str]:
    """The fused_is frames that led to the collective, innermost first ("file.py:line function"), the
    benchmarks' own left out."""
    import traceback

    sites = []
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(KERNEL_PACKAGE) and not frame.filename.startswith(_BENCHMARKS):
            sites.append(f"{Path(frame.filename).relative_to(Path(KERNEL_PACKAGE).parent)}:{frame.lineno} {frame.name}")
            if len(sites) == depth:
                break
    return sites


def _case_call(case: str, n: int, vocab_local: int, rank: int, world: int, backend: str) -> Callable[[], object]:
    """The call of `case` on this rank (same tokens and per-token inputs on every rank; each rank's own shard)."""
    import torch.distributed as dist

    import fused_is
    from fused_is.distributed import global_normalizer

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1234)  # the same on every rank
    seqs = SEQUENCES if n % SEQUENCES == 0 else 1
    shape = (seqs, n // seqs) if ("seq_tis" in case or "gspo" in case or case.startswith("sequence")) else (n,)
    vocab = vocab_local if case.startswith("sequence") else vocab_local * world
    tokens = torch.randint(0, vocab, shape, generator=gen)
    advantages = torch.randn(shape, generator=gen)
    sampler = -torch.rand(shape, generator=gen) * 3.0
    old = (sampler + 0.1 * torch.randn(shape, generator=gen)).clamp(max=0.0)
    mask = torch.rand(shape, generator=gen) > 0.1
    local = torch.Generator().manual_seed(99 + rank)  # this rank's shard or slice
    if case.startswith("global_normalizer"):
        masks = [mask] if "1 mask" in case else [torch.rand(shape, generator=gen) > 0.1 for _ in range(4)]
        return lambda: global_normalizer(masks, config="ppo_tis", group=group)
    if "linear" in case:
        hidden = torch.randn(n, HIDDEN_DIM, generator=gen).requires_grad_()  # the same on every rank
        weight = (torch.randn(vocab_local, HIDDEN_DIM, generator=local) / HIDDEN_DIM ** 0.5).requires_grad_()
        if "token_logprobs" in case:
            return lambda: fused_is.linear_token_logprobs(hidden.detach(), weight.detach(), tokens, mask=mask,
                                                          backend=backend, vocab_group=group)

        def linear_step():
            out = fused_is.linear_policy_loss(hidden, weight, tokens, advantages, sampler_logprobs=sampler,
                                              old_logprobs=old, mask=mask, config="ppo_tis", backend=backend,
                                              vocab_group=group)
            out.loss.backward()
            return out

        return linear_step
    if case.startswith("sequence"):  # this rank's positions of every sequence, the whole vocabulary
        logits = (torch.randn(*shape, vocab_local, generator=local) * 2.0).requires_grad_()
        keywords = dict(sequence_group=group)
    else:
        logits = (torch.randn(*shape, vocab_local, generator=local) * 2.0).requires_grad_()
        keywords = dict(vocab_group=group)
    if "token_logprobs" in case:
        return lambda: fused_is.token_logprobs(logits.detach(), tokens, mask=mask, backend=backend, **keywords)
    config = "ppo_tis" if "ppo_tis" in case else "seq_tis" if "seq_tis" in case else "gspo"
    with_old = "old=None" not in case and config != "gspo"

    def step():
        out = fused_is.policy_loss(logits, tokens, advantages, sampler_logprobs=sampler,
                                   old_logprobs=old if with_old else None, mask=mask, config=config,
                                   backend=backend, **keywords)
        out.loss.backward()
        logits.grad = None
        return out

    return step


def _worker(rank: int, world: int, port: int, settings: dict, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = Counter().install()
    try:
        torch.set_num_threads(1)
        records = []
        for case in settings["cases"]:
            for vocab_local in settings["vocabs"]:
                call = _case_call(case, settings["n"], vocab_local, rank, world, settings["backend"])
                call()  # warm-up (uncounted)
                start = time.perf_counter()
                collectives = counter.count(call)
                seconds = time.perf_counter() - start
                records.append(dict(case=case, world=world, n=settings["n"], vocab_local=vocab_local,
                                    collectives=collectives, seconds=seconds))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        dist.barrier()  # every rank done with every collective before any tears its process group down
    finally:
        counter.uninstall()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, n: int, vocabs=DEFAULT_VOCABS, cases=CASES, backend: str = "auto") -> List[dict]:
    """Rank 0's records for each case and V_local, `world` gloo processes; raises if the ranks disagree on what
    they sent (the bytes of every rank are the same in every case here)."""
    import torch.multiprocessing as mp

    settings = dict(n=n, vocabs=list(vocabs), cases=list(cases), backend=backend)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, _free_port(), settings, tmp), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    for r in range(1, world):
        if [signature(x) for x in ranks[r]] != [signature(x) for x in ranks[0]]:
            raise RuntimeError(f"rank {r} issued other collectives than rank 0")
    return [summarize(record) for record in ranks[0]]


def summarize(record: dict) -> dict:
    """A record with its totals: number of collectives, payload and ring bytes (per rank), per token."""
    cs = record["collectives"]
    payload = sum(c["payload_bytes"] for c in cs)
    ring = sum(c["ring_bytes"] for c in cs)
    return dict(record, num_collectives=len(cs), payload_bytes=payload, ring_bytes=ring,
                payload_per_token=payload / record["n"], ring_per_token=ring / record["n"],
                largest_payload_bytes=max((c["payload_bytes"] for c in cs), default=0))


def signature(record: dict) -> list:
    """What was sent, independent of the timing: (op, dtype, shapes, payload) per collective."""
    return [(c["op"], c["dtype"], c["shape"], c["payload_bytes"]) for c in record["collectives"]]


def _shape(c: dict) -> str:
    if not c["shape"]:
        return "-"
    return "x".join(str(d) for d in c["shape"][0]) or "scalar"


def _runs(keys: List[str]) -> List[str]:
    """Consecutive equal keys as one "k x key"."""
    out: List[List] = []
    for key in keys:
        if out and out[-1][0] == key:
            out[-1][1] += 1
        else:
            out.append([key, 1])
    return [key if run == 1 else f"{run} x {key}" for key, run in out]


def _label(c: dict) -> str:
    return f"{c['op']}[{_shape(c)} {c['dtype']}{' ' + c['reduce_op'] if c.get('reduce_op') else ''}]"


def _sites_section(records: List[dict]) -> str:
    """Each case's collectives with the fused_is lines that issue them (the first record of each case)."""
    lines, seen = [], set()
    for r in records:
        if r["case"] not in seen:
            seen.add(r["case"])
            lines.append(f"- {r['case']} (world {r['world']}, N {r['n']}):")
            lines += [f"  - {entry}" for entry in _runs([f"{_label(c)} from " + " <- ".join(c.get("sites", [])[:4])
                                                         for c in r["collectives"]])]
    return "\n".join(lines)


def _ops(record: dict) -> str:
    return ", ".join(_runs([_label(c) for c in record["collectives"]])) or "none"


def format_table(records: List[dict]) -> str:
    """Markdown: one row per (case, world) with the first V_local's numbers and whether every V sent the same."""
    header = ["case", "world", "N", "V_local", "collectives", "payload B/rank", "payload B/N", "ring B/rank",
              "ring B/N", "same for every V", "ms/call", "what"]
    rows = []
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["world"], r["n"]), []).append(r)
    for (case, world, n), recs in groups.items():
        first = recs[0]
        same = all(signature(r) == signature(first) for r in recs)
        rows.append([case, str(world), str(n), ",".join(str(r["vocab_local"]) for r in recs),
                     str(first["num_collectives"]), f"{first['payload_bytes']:,}", f"{first['payload_per_token']:.2f}",
                     f"{first['ring_bytes']:,.0f}", f"{first['ring_per_token']:.2f}", "yes" if same else "NO",
                     "/".join(f"{1e3 * r['seconds']:.0f}" for r in recs), _ops(first)])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


NOTES = """\
Per rank and call (forward and backward; one warm-up call first, not counted). payload: the bytes the rank
contributes (all_reduce: the tensor; all_gather: its input; broadcast: the tensor on the source). ring: the bytes
it sends with a ring algorithm (all_reduce 2(w-1)/w x payload, all_gather (w-1) x payload). B/N: per token of
the call (N tokens on every rank; context parallel: N of the rank's positions, B = 16 sequences). `same for every
V`: the collectives (op, dtype, shapes, bytes) are identical at every V_local in the row. ms/call: wall time of
the counted call on this CPU, per V_local (gloo, one thread per rank; not a performance number). `what`: each
collective as op[shape dtype], repeats as k x."""


def format_console(records: List[dict]) -> str:
    """The printed table: the first columns of format_table's (comms.md has every one, ms/call and the collectives
    included), in at most 100 columns."""
    header = ["case", "world", "N", "collectives", "payload B/N", "ring B/N", "same V"]
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["world"], r["n"]), []).append(r)
    rows = []
    for (case, world, n), recs in groups.items():
        first = recs[0]
        rows.append([case, str(world), str(n), str(first["num_collectives"]), f"{first['payload_per_token']:.2f}",
                     f"{first['ring_per_token']:.2f}",
                     "yes" if all(signature(r) == signature(first) for r in recs) else "NO"])
    return "\n".join(fixed_width(header, rows))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for world in args.world:
        print(f"fused-is bench --comms: {world} gloo ranks, N={args.n}, V_local={args.vocab}", flush=True)
        records += measure(world, args.n, args.vocab, args.cases or CASES, args.backend)
    table = format_table(records)
    env = environment("cpu")
    settings = dict(n=args.n, worlds=args.world, vocabs=args.vocab, sequences=SEQUENCES, hidden_dim=HIDDEN_DIM,
                    backend=args.backend, process_group="gloo")
    (out / "comms.json").write_text(json.dumps(dict(environment=env, settings=settings, results=records), indent=1))
    (out / "comms.md").write_text(f"# Communication per call (fused_is.benchmarks.comms)\n\n{NOTES}\n\n"
                                  f"Settings: {json.dumps(settings)}; git {env.get('git')}\n\n{table}\n\n"
                                  f"## Call sites\n\n{_sites_section(records)}\n")
    print(format_console(records))
    print(wrote([out / "comms.json", out / "comms.md"]))
    failed = [r for r in records if r["num_collectives"] and not math.isfinite(r["payload_per_token"])]
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=positive_int, default=16384, help="tokens per call on every rank (default 16384)")
    parser.add_argument("--world", type=positive_int, nargs="+", default=[2, 4],
                        help="process-group sizes (default 2 4)")
    parser.add_argument("--vocab", type=positive_int, nargs="+", default=list(DEFAULT_VOCABS),
                        help="V_local, each rank's vocabulary shard (default 512 1024): the bytes must not change")
    parser.add_argument("--cases", nargs="+", choices=CASES, help="a subset of the cases")
    parser.add_argument("--backend", default="auto", help="fused_is backend (default auto)")
    parser.add_argument("--out", type=Path, default=default_out_dir("cpu") / "comms",
                        help="output folder (default bench/results/local/cpu/comms, gitignored; the committed "
                        "results: --out bench/results/cpu/comms)")


def run_from_bench(args: argparse.Namespace) -> int:
    """`fused-is bench --comms`: the bench's arguments mapped onto this benchmark's."""
    if args.n and len(args.n) != 1:
        raise SystemExit("fused-is bench --comms takes one --n")
    return run(argparse.Namespace(n=args.n[0] if args.n else 16384, world=args.world or [2, 4],
                                  vocab=args.vocab or list(DEFAULT_VOCABS), cases=None, backend="auto",
                                  out=args.out or default_out_dir("cpu") / "comms"))


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m fused_is.benchmarks.comms", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`fused-is`: bench (the main job: fused_is/benchmarks/), verify and build."""

from __future__ import annotations

import argparse
import sys
import zlib  # a seed per case that is the same in every process (hash() of str is not)


def verify(args: argparse.Namespace) -> int:
    """Every available backend against the float64 reference, every preset; non-zero exit on any failure."""
    import torch

    import fused_is
    from fused_is import backends
    from fused_is.benchmarks.common import DTYPES
    from fused_is.testing import compare_to_reference, make_inputs, tolerance

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [b for b in backends.available_backends(torch.empty(1, device=device)) if b != "reference"]
    header = f"{'backend':8} {'preset':14} {'layout':7} {'dtype':5} {'old':5} {'loss_err':>9} {'grad_err':>9} " \
             f"{'lp_err':>9} {'H_err':>9}  ok"
    print(f"fused-is verify on {device}: backends {names}, vocab {args.vocab}\n{header}")
    failures = 0
    for backend in names:
        for preset in sorted(fused_is.PRESETS):
            for layout in ("padded", "packed"):
                for dname in args.dtypes:
                    for with_old in (True, False):
                        inputs = make_inputs(layout, dtype=DTYPES[dname], vocab=args.vocab, device=device,
                                             seed=zlib.crc32(f"{preset}/{layout}/{dname}".encode()) % 1000)
                        errors, _, _, _ = compare_to_reference(inputs, preset, backend, with_old=with_old)
                        tol = tolerance(DTYPES[dname], backend)
                        ok = all(errors[k] <= tol[k if k in tol else "logprobs"] for k in errors)
                        failures += not ok
                        print(f"{backend:8} {preset:14} {layout:7} {dname:5} {str(with_old):5} "
                              f"{errors['loss']:9.1e} {errors['grad']:9.1e} {errors['logprobs']:9.1e} "
                              f"{errors['entropy']:9.1e}  {'ok' if ok else 'FAIL'}")
    applied = "; ".join(f"{b} {d}: {tolerance(DTYPES[d], b)}" for b in names for d in args.dtypes)
    print(f"\n{'all passed' if not failures else f'{failures} FAILED'} (tolerances applied: {applied})")
    return 1 if failures else 0


def build(args: argparse.Namespace) -> int:
    """Compile the csrc/ extensions (cached; a second call costs nothing)."""
    from fused_is.backends import cpp

    for kind in args.kinds:
        module = cpp.build(kind, verbose=args.verbose)
        print(f"fused-is build {kind}: {module.__file__}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line; every argument error is one line on stderr and exit status 2 (no usage block)."""
    from fused_is.benchmarks import main as bench
    from fused_is.benchmarks.common import DTYPES, ArgumentParser, vocab_size

    out = ArgumentParser(prog="fused-is", description="fused RL policy loss: benchmark and verify")
    sub = out.add_subparsers(dest="command", required=True)
    bench_parser = sub.add_parser("bench", help="time, memory and error of every provider vs eager torch")
    bench.add_arguments(bench_parser)
    verify_parser = sub.add_parser("verify", help="every backend vs the float64 reference, every preset")
    verify_parser.add_argument("--vocab", type=vocab_size, default=1000, help="vocabulary size (>= 2; default 1000)")
    verify_parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    build_parser = sub.add_parser("build", help="compile the csrc/ CPU and/or CUDA extension into the cache")
    build_parser.add_argument("kinds", nargs="*", default=["cpu"], choices=["cpu", "cuda"])
    build_parser.add_argument("--verbose", action="store_true")
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "bench":
        from fused_is.benchmarks import main as bench

        return bench.run(args)
    if args.command == "build":
        return build(args)
    return verify(args)


if __name__ == "__main__":
    sys.exit(main())

"""What a `fused-is bench` command line needs installed beyond torch and fused_is itself: one pip requirement per
line, only those missing here. scripts/dev.sh bench installs what this prints, then runs the bench.

    python -m fused_is.benchmarks.requirements [the arguments of fused-is bench]

The arguments are parsed and checked as the bench parses and checks them, so an unknown provider or `--n 0` exits
non-zero here, before anything is installed. Needed: tqdm (the progress bar); matplotlib unless --no-plot (and
not for --comms or --triton-configs, which plot nothing); Liger-Kernel only when liger is a provider of the run
(named in --providers, or --distill's liger_*; or, with none named, --linear, --distill, a GPU, or
--triton-interpreter on the CPU: where its kernels can run); TRL only when --providers names trl_chunked, or for
--distill's TRL-based providers (eager, compile, eager_linear; all of them when none is named); Triton on the CPU
only for --triton-interpreter or a named triton provider (a GPU's torch brings its own). Never vLLM or a trainer:
`scripts/dev.sh test` installs those.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .common import LIGER_PIN, TRITON_PIN, TRL_PIN, package_version


def _triton_on_cpu(args: argparse.Namespace, device: str) -> bool:
    if device != "cpu" or args.comms or sys.platform != "linux":
        return False
    named = not args.linear and any(p.startswith("triton") for p in args.providers or ())
    return bool(args.triton_interpreter or named)


def _liger_in_run(args: argparse.Namespace, device: str) -> bool:
    if args.comms or args.triton_configs:
        return False
    if args.providers:
        return "liger" in args.providers or (args.distill and any(p.startswith("liger") for p in args.providers))
    return args.linear or args.distill or device == "cuda" or args.triton_interpreter


def needed(args: argparse.Namespace, device: str) -> List[str]:
    """The pip requirements of this run (parsed `fused-is bench` arguments), installed or not."""
    out = ["tqdm"]
    if not (args.no_plot or args.comms or args.triton_configs):
        out.append("matplotlib")
    if _triton_on_cpu(args, device):
        out.append(TRITON_PIN)
    if _liger_in_run(args, device):
        out.append(LIGER_PIN)
    if args.distill:  # TRL's generalized_jsd_loss is the eager baseline
        trl = not args.providers or any(p in ("eager", "compile", "eager_linear") for p in args.providers)
    else:
        trl = args.linear and "trl_chunked" in (args.providers or ())
    if trl:
        out.append(TRL_PIN)
    return out


def missing(requirements: List[str]) -> List[str]:
    """Those of `requirements` (name or name==version) not installed at that version."""
    out = []
    for req in requirements:
        name, _, pinned = req.partition("==")
        have: Optional[str] = package_version(name)
        if have is None or (pinned and have != pinned):
            out.append(req)
    return out


def main(argv=None) -> int:
    import torch

    from . import main as bench

    args = bench.parser(prog="fused-is bench").parse_args(sys.argv[1:] if argv is None else argv)
    bench.check_arguments(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for req in missing(needed(args, device)):
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU's clocks while bench/gpu_suite.sh runs: SM and memory clock, power, temperature and the clock event
(throttle) reasons, one CSV row per sample until SIGTERM, each tagged with the suite's current step (the text of
--step-file at that moment). A memory-bound kernel's time follows the memory clock and a latency-bound one's the SM
clock: the suite's summary (bench/gpu/suite_summary.py) prints them per step beside the measured times.

Sources, the first that answers: NVML through pynvml (nvidia-ml-py, in the GPU image), else `nvidia-smi
--query-gpu` once per sample. --stub (the dry run on a CPU) writes rows of zeros marked "stub", so that the file and
its summary are exercised where no GPU is.

    python bench/gpu/clocks.py --out clocks.csv --step-file PATH [--interval 0.2] [--stub]
"""

from __future__ import annotations

import argparse
import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = ["t_s", "step", "sm_mhz", "mem_mhz", "power_w", "temp_c", "reasons", "source"]
SMI_FIELDS = ["clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"]
REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]  # newer drivers, older ones


class Nvml:
    """One sample through pynvml: (sm MHz, mem MHz, power W, temperature C, reasons as hex)."""

    name = "nvml"

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                        or getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        nv = pynvml
        nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)  # fails here, not in the loop, without clocks

    def sample(self) -> list:
        """The clocks, or an exception; power, temperature and reasons blank where the driver does not give them."""
        nv, h = self.nvml, self.handle

        def optional(fn, *args):
            try:
                return fn(h, *args)
            except Exception:  # NVMLError_NotSupported in some virtual machines
                return None

        power = optional(nv.nvmlDeviceGetPowerUsage)
        reasons = optional(self.reasons) if self.reasons else None
        temp = optional(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        return [nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                round(power / 1000, 1) if power is not None else "", temp if temp is not None else "",
                hex(reasons) if reasons is not None else ""]


class Smi:
    """One sample through `nvidia-smi --query-gpu` (the reasons field under its newer or older name, or none)."""

    name = "nvidia-smi"

    def __init__(self):
        for extra in ([REASON_FIELDS[0]], [REASON_FIELDS[1]], []):
            self.fields = SMI_FIELDS + extra
            try:
                self.sample()
                return
            except (OSError, RuntimeError, subprocess.SubprocessError):
                continue
        raise RuntimeError("nvidia-smi --query-gpu did not answer")

    def sample(self) -> list:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(self.fields)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip() or out.stdout.strip())
        values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        return values + [""] * (len(SMI_FIELDS) + 1 - len(values))


class Stub:
    name = "stub"

    def sample(self) -> list:
        return [0, 0, 0, 0, ""]


def source(stub: bool):
    """The first sampler that answers, and the reasons the others did not."""
    if stub:
        return Stub(), []
    failures = []
    for kind in (Nvml, Smi):
        try:
            return kind(), failures
        except Exception as exc:  # ImportError, NVMLError, FileNotFoundError, ...
            failures.append(f"{kind.name}: {type(exc).__name__}: {exc}")
    return None, failures


_stop = False


def _on_signal(signum, frame):
    global _stop
    _stop = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-file", type=Path, help="a file holding the suite's current step")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--stub", action="store_true", help="no GPU: rows of zeros marked stub")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    sampler, failures = source(args.stub)
    new = not args.out.exists() or args.out.stat().st_size == 0
    with args.out.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        if sampler is None:
            writer.writerow([0, "", "", "", "", "", "", "none: " + "; ".join(failures)])
            print("clocks: no source: " + "; ".join(failures), file=sys.stderr)
            return 0
        start = time.monotonic()
        while not _stop:
            step = ""
            if args.step_file:
                try:
                    step = args.step_file.read_text().strip()
                except OSError:
                    pass
            try:
                values = sampler.sample()
            except Exception as exc:  # one failed sample is noted, not fatal
                values = ["", "", "", "", f"error: {type(exc).__name__}"]
            writer.writerow([f"{time.monotonic() - start:.2f}", step, *values, sampler.name])
            f.flush()
            deadline = time.monotonic() + args.interval
            while not _stop and time.monotonic() < deadline:
                time.sleep(min(0.05, args.interval))
    return 0


if __name__ == "__main__":
    sys.exit(main())

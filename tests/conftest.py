"""Test set-up.

- TRITON_INTERPRET must be set before any Triton kernel module is imported, so the Triton kernels run on
  this CPU-only machine through the interpreter.
- Tests marked `gpu` need a CUDA GPU and are skipped without one, with the reason. Under
  FUSED_IS_GPU_DRY_RUN=1 (bench/gpu_suite.sh --dry-run) they run on the CPU instead, at tiny sizes (the
  `dry_run` fixture), so their plumbing is exercised where CI runs; tests marked `cuda_only`
  (a second device, streams, N x V > 2**31) stay skipped there.
- Every Triton launch under the interpreter is recorded (kernel, argument types, 16-byte alignment,
  constexprs, num_warps) into $FUSED_IS_TRITON_LAUNCHES (default build/triton_launches.jsonl), so that
  bench/gpu/gpu_build_check.py compiles exactly those specializations for sm_90 and sm_80 ahead of time.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

DRY_RUN = os.environ.get("FUSED_IS_GPU_DRY_RUN") == "1"
# empty: record nothing (the GPU suite's dry run, a pytest inside pytest, must not overwrite the outer record)
LAUNCHES_PATH = os.environ.get("FUSED_IS_TRITON_LAUNCHES",
                               str(Path(__file__).resolve().parent.parent / "build" / "triton_launches.jsonl"))
_launches = {}  # canonical JSON of a launch -> None (insertion-ordered set)


def _describe(value):
    """A launch argument as the ahead-of-time check needs it: what Triton's JIT specializes on."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).replace("torch.", ""), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value}
    if value is None:
        return {"none": True}
    raise TypeError(f"unrecorded Triton argument type {type(value).__name__}")


def _install_launch_recorder():
    if os.environ.get("TRITON_INTERPRET") != "1" or not LAUNCHES_PATH:
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = list(self.arg_names)
        bound = dict(zip(names, args))
        options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        bound.update({k: v for k, v in kwargs.items() if k in names})
        record = dict(module=self.fn.__module__, kernel=self.fn.__name__, options=options,
                      args={k: _describe(bound[k]) for k in names if k in bound})
        _launches[json.dumps(record, sort_keys=True)] = None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


_install_launch_recorder()


# pytest-xdist (scripts/dev.sh test runs the suite in one worker per core): each worker writes its launches to
# <path>.<worker>, and the controller, whose session ends after theirs, merges them into the one file. (A worker is
# told by its config: a pytest a test starts inherits the worker's environment variables, not its config.)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # the cores shared between the workers' torch threads
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _worker(config):
    """The xdist worker id of this pytest (None: the controller, a run without xdist, or no pytest at all: a script
    calls pytest_sessionfinish(None, 0) to write what it recorded)."""
    return getattr(config, "workerinput", {}).get("workerid")


def _worker_parts(path: Path) -> list:
    return sorted(path.parent.glob(path.name + ".gw*"))


def pytest_sessionstart(session):
    if LAUNCHES_PATH and not _worker(session.config):  # a stale worker's part must not join this run's record
        for part in _worker_parts(Path(LAUNCHES_PATH)):
            part.unlink()


def pytest_sessionfinish(session, exitstatus):
    if not LAUNCHES_PATH:
        return
    path = Path(LAUNCHES_PATH)
    worker = _worker(getattr(session, "config", None))
    if worker:
        if _launches:
            path.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{path}.{worker}").write_text("".join(line + "\n" for line in _launches))
        return
    for part in _worker_parts(path):
        for line in part.read_text().splitlines():
            _launches[line] = None
        part.unlink()
    if not _launches:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in _launches))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    if DRY_RUN:
        skip = pytest.mark.skip(reason="needs a real CUDA device (skipped in the GPU suite's CPU dry run)")
        for item in items:
            if "cuda_only" in item.keywords:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu_device():
    """The device of the `gpu` tests: "cuda", or "cpu" in the GPU suite's dry run (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def dry_run():
    """True in the GPU suite's CPU dry run: gpu tests shrink their shapes to interpreter size."""
    return not torch.cuda.is_available()

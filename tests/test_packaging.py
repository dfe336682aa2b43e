"""`fused_is.triton_kernels` imports in every way the package is run, and availability means importable.

setup.py maps the top-level folder `triton_kernels/` to `fused_is.triton_kernels`; an install (regular or
editable) creates that mapping, a source tree on PYTHONPATH (the GPU suite's fallback) does not, and
fused_is/backends/triton.py registers the package from the folder itself there. Each case runs in a fresh
interpreter so that nothing imported by this test session leaks in.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import sys
{prelude}
import torch
import fused_is
from fused_is import backends
from fused_is.backends import triton as launcher
print("reason:", backends.unavailable_reason("triton", torch.empty(1, 1)))
if backends.unavailable_reason("triton", torch.empty(1, 1)) is None:
    module = launcher.kernels()
    print("module:", module.__name__, module.__file__)
    print("attribute:", fused_is.triton_kernels.policy_loss is module)
    print("top-level triton_kernels imported:", "triton_kernels" in sys.modules)
    logits = torch.randn(3, 50, requires_grad=True)
    out = fused_is.policy_loss(logits, torch.tensor([0, 7, 49]), torch.randn(3), config="ppo", backend="triton")
    out.loss.backward()
    print("finite:", bool(torch.isfinite(logits.grad).all()))
"""

# setuptools' editable finder would map fused_is.triton_kernels itself: take it out to see a bare source tree
NO_EDITABLE = ("sys.meta_path[:] = [f for f in sys.meta_path "
               "if 'editable' not in getattr(f, '__name__', type(f).__name__).lower()]")


def _run(prelude: str, cwd) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)], capture_output=True, text=True,
                            env=env, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_source_tree_without_install(tmp_path):
    out = _run(NO_EDITABLE, tmp_path)
    assert "reason: None" in out
    assert f"module: fused_is.triton_kernels.policy_loss {REPO / 'triton_kernels' / 'policy_loss.py'}" in out
    assert "attribute: True" in out and "finite: True" in out
    assert "top-level triton_kernels imported: False" in out


@pytest.mark.slow
def test_installed_or_editable(tmp_path):
    out = _run("", tmp_path)
    assert "reason: None" in out and "finite: True" in out
    assert "module: fused_is.triton_kernels.policy_loss" in out


@pytest.mark.slow
def test_unimportable_kernels_make_triton_unavailable(tmp_path):
    """Availability is decided by importing the kernel module, so a broken triton is a reason, not a crash."""
    out = _run("sys.modules['triton'] = None  # import triton raises ImportError", tmp_path)
    assert "reason: the Triton kernels cannot be imported (ModuleNotFoundError" in out


@pytest.mark.slow
def test_import_is_light(tmp_path):
    """`import fused_is` imports neither triton, torch._dynamo, vllm, a trainer nor a compiled extension: each is
    imported on first use (the kernel-level ops for torch.compile are registered without importing dynamo)."""
    code = ("import sys, torch; import fused_is; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('triton', 'vllm', 'trl', 'verl', 'openrlhf', 'areal') "
            "or m.startswith('torch._dynamo') or m.startswith('fused_is_cpu') or m.startswith('fused_is_cuda')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout



SAMPLER_NAMES = """
import sys
{first}
{second}
import fused_is
from fused_is.integrations import sglang, vllm
from fused_is.vllm import sampler_kwargs
print("same:", fused_is.vllm is vllm is sys.modules["fused_is.vllm"], fused_is.sglang is sglang is
      sys.modules["fused_is.sglang"], sampler_kwargs is vllm.sampler_kwargs, vllm.__name__)
fused_is.vllm.ENV_FP32_HEAD = "patched"  # a monkeypatch through the old name is seen through the new one
print("patched:", vllm.ENV_FP32_HEAD == "patched")
print("engines imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")))
"""


@pytest.mark.slow
def test_sampler_modules_keep_their_old_names(tmp_path):
    """fused_is/vllm.py and fused_is/sglang.py live in fused_is/integrations/; the old names give the very same module
    objects whichever is imported first, and importing either imports neither vLLM nor SGLang."""
    old = "import fused_is.vllm, fused_is.sglang"
    new = "import fused_is.integrations.vllm, fused_is.integrations.sglang"
    for first, second in ((old, new), (new, old)):
        result = subprocess.run([sys.executable, "-c", SAMPLER_NAMES.format(first=first, second=second)],
                                capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines() == ["same: True True True fused_is.integrations.vllm", "patched: True",
                                              "engines imported: []"], result.stdout

# ----------------------------------------------------------------------------------------------------
# fused_is/benchmarks/ (the drivers of `fused-is bench`): the library never imports them, and they import each other
# without a cycle. Every import counts, those inside functions included (ast.walk sees every statement).

PACKAGE = REPO / "fused_is"
BENCHMARKS = "fused_is.benchmarks"


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set:
    """Every module `path` imports, as absolute dotted names: `import a.b`, `from a import b` (a and a.b: b may be
    a submodule), relative imports resolved, and __import__ / importlib.import_module of a literal string."""
    import ast

    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            out.add(source)
            out |= {f"{source}.{alias.name}" for alias in node.names}
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            out.add(node.args[0].value)
    return out


def _benchmark_modules() -> dict:
    return {_module_of(path): path for path in sorted((PACKAGE / "benchmarks").glob("*.py"))}


def test_import_scan_counts_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The scanner itself: an import inside a function, a relative one and a string one are all seen."""
    fake = REPO / "fused_is" / "backends" / "_scan_probe.py"  # never written: parsed from the text below
    text = ("def f():\n    from ..benchmarks import main\n\n"
            "def g():\n    import importlib\n    importlib.import_module('fused_is.benchmarks.linear')\n\n"
            "class C:\n    def h(self):\n        from .. import benchmarks\n")
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == fake else original(self, *a, **k))
    found = imported_modules(fake)
    assert {"fused_is.benchmarks", "fused_is.benchmarks.main", "fused_is.benchmarks.linear"} <= found, found


def test_library_never_imports_the_benchmarks():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "benchmarks" or rel == Path("cli.py"):
            continue
        bad = sorted(m for m in imported_modules(path) if m == BENCHMARKS or m.startswith(BENCHMARKS + "."))
        if bad:
            offenders[str(rel)] = bad
    assert not offenders, f"modules of fused_is that import the benchmarks package: {offenders}"


def test_benchmark_drivers_live_in_one_place():
    """No driver left beside the library (the old fused_is/bench*.py), and the CLI reaches them there."""
    assert not sorted(PACKAGE.glob("bench*.py")), sorted(PACKAGE.glob("bench*.py"))
    modules = _benchmark_modules()
    assert {"fused_is.benchmarks.common", "fused_is.benchmarks.main", "fused_is.benchmarks.linear",
            "fused_is.benchmarks.comms"} <= set(modules), sorted(modules)
    assert "fused_is.benchmarks.main" in imported_modules(PACKAGE / "cli.py")


def test_benchmarks_import_each_other_without_a_cycle():
    modules = _benchmark_modules()
    graph = {name: sorted(m for m in imported_modules(path) if m in modules and m != name)
             for name, path in modules.items()}
    assert not graph["fused_is.benchmarks.common"], graph  # the shared helpers import no driver
    assert not graph["fused_is.benchmarks"], graph  # the package's __init__ imports nothing
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for dep in graph[name]:
            visit(dep, trail + [name])
        state[name] = "done"

    for name in graph:
        visit(name, [])


def test_every_subpackage_is_installed():
    """setup.py lists its packages by hand: every folder of fused_is/ with an __init__.py is among them (without
    fused_is.benchmarks an install had no `fused-is bench` or verify; only an editable checkout hid it)."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    packages = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "packages")
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "fused_is").rglob("__init__.py")}
    assert folders and folders <= set(packages), sorted(folders - set(packages))

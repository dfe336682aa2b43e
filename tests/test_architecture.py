"""The shape of the package (docs/architecture.md): few frames from a public function to a kernel launch, no
import cycle, short parameter lists, and per-token outputs that do not depend on the rest of the batch."""

import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

import fused_is
from fused_is import backends

from cases import make_inputs

PACKAGE = Path(fused_is.__file__).resolve().parent
MAX_FRAMES = 4  # public function -> autograd.Function -> plan runner -> backend primitive (which launches)
MAX_PARAMETERS = 12


def _package_frames(stack) -> list:
    """The frames of fused_is/ (not the kernels' own sources) from the outermost public function inwards."""
    frames = [f for f in reversed(stack) if Path(f.filename).resolve().is_relative_to(PACKAGE)]
    return [f"{Path(f.filename).name}:{f.function}" for f in frames]


def _record_cpu_launches(monkeypatch, seen):
    from fused_is.backends import cpp

    real = cpp.extension("cpu")

    class Recording:
        def forward(self, *args):
            seen.append(_package_frames(inspect.stack()))
            return real.forward(*args)

    monkeypatch.setattr(cpp, "extension", lambda kind: Recording())


def _record_triton_launches(monkeypatch, seen):
    from fused_is.backends import triton as launcher

    real = launcher.kernels()

    class Kernel:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(_package_frames(inspect.stack()))
                return self.kernel[grid](*args, **kwargs)
            return launch

    recording = types.SimpleNamespace(_fused_kernel=Kernel(real._fused_kernel),
                                      _row_stats_kernel=Kernel(real._row_stats_kernel))
    monkeypatch.setattr(launcher, "kernels", lambda: recording)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("preset,with_old", [("ppo_tis", True), ("seq_mis", False), ("gspo", True)])
def test_frames_from_policy_loss_to_the_kernel(backend, preset, with_old, monkeypatch):
    """At most 4 frames of the package on the stack when a kernel is launched: one pass, and the two-pass plan
    (whose stats launch is shallower still)."""
    if backends.unavailable_reason(backend) is not None:
        pytest.skip(backends.unavailable_reason(backend))
    seen = []
    (_record_cpu_launches if backend == "cpu" else _record_triton_launches)(monkeypatch, seen)
    inputs = make_inputs("padded", dtype=torch.float32, vocab=64, seed=3)
    logits = inputs.logits.clone().requires_grad_()
    out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=preset, backend=backend,
                               **inputs.kwargs(with_old=with_old))
    out.loss.backward()
    assert seen, "no kernel launch was recorded"
    for frames in seen:
        assert frames[0] == "api.py:policy_loss", frames
        assert len(frames) <= MAX_FRAMES, frames


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_frames_from_linear_policy_loss_to_the_kernel(backend, monkeypatch):
    if backends.unavailable_reason(backend) is not None:
        pytest.skip(backends.unavailable_reason(backend))
    seen = []
    (_record_cpu_launches if backend == "cpu" else _record_triton_launches)(monkeypatch, seen)
    torch.manual_seed(4)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    out = fused_is.linear_policy_loss(hidden, weight, torch.randint(0, 40, (6,)), torch.randn(6), config="ppo",
                                      backend=backend, chunk_size=4)
    out.loss.backward()
    assert seen
    for frames in seen:
        assert frames[0] == "linear.py:linear_policy_loss" and len(frames) <= MAX_FRAMES, frames


def _modules(package: Path = PACKAGE):
    """module name -> (path, parsed source) of every module of the package in the folder `package`."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (path, ast.parse(path.read_text()))
    return out


def _import_graph(package: Path = PACKAGE):
    """module -> the package modules it imports anywhere in its source: inside functions too, and under
    `if TYPE_CHECKING:` too (an annotation-only import still ties the two modules together); importing from one's
    own parent package (`from . import x` of a submodule x) counts as importing x, not the parent."""
    modules = _modules(package)
    graph = {}
    for name, (path, tree) in modules.items():
        package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package_parts[:len(package_parts) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for candidate in [target] + [f"{target}.{alias.name}" for alias in node.names]:
                    edges.add(candidate)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name and not name.startswith(e + ".")}
    return graph


def _import_cycles(graph) -> list:
    """Every cycle a depth-first walk of the import graph closes, as [a, b, ..., a]."""
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_inside_the_package():
    graph = _import_graph()
    assert "fused_is.call" in graph and graph["fused_is.call"], "the import graph was not read"
    cycles = _import_cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_check_sees_a_lazy_import(tmp_path):
    """The check is not vacuous: on a synthetic package it reports a function-level import back into a module
    that imports it at top level, and an annotation-only import under `if TYPE_CHECKING:`, as cycles; and
    nothing in a package without one."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from .api import run\n",
        "api.py": "from . import call\n\n\ndef run():\n    return call.prepare()\n",
        "call.py": "def prepare():\n    from .api import run  # lazy: still a cycle\n    return run\n",
        "coefficients.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .plan import Plan\n",
        "plan.py": "from . import coefficients\n\n\nclass Plan:\n    pass\n",
        "leaf.py": "import math\n",
        "sub/__init__.py": "",
        "sub/user.py": "from .. import leaf\nfrom . import helper\n",
        "sub/helper.py": "from ..leaf import math\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = _import_graph(package)
    assert graph["pkg.call"] == {"pkg.api"} and graph["pkg.sub.user"] == {"pkg.leaf", "pkg.sub.helper"}, graph
    cycles = {frozenset(c) for c in _import_cycles(graph)}
    assert cycles == {frozenset({"pkg.api", "pkg.call"}), frozenset({"pkg.coefficients", "pkg.plan"})}, cycles
    (package / "call.py").write_text("def prepare():\n    return None\n")
    (package / "coefficients.py").write_text("X = 1\n")
    assert _import_cycles(_import_graph(package)) == []


def test_parameter_lists_are_short():
    """No function or method of the package takes more than 12 parameters, except the public functions of
    fused_is.__all__ (their keywords are the API)."""
    public = set(fused_is.__all__)
    long = []
    for name, (path, tree) in _modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            count = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
                     + (a.kwarg is not None))
            if a.args and a.args[0].arg in ("self", "cls", "ctx"):
                count -= 1
            if count > MAX_PARAMETERS and not (node.name in public and name in ("fused_is.api", "fused_is.linear", "fused_is.distill",
                                                                               "fused_is.linear_distill")):
                long.append(f"{name}.{node.name} ({count})")
    assert not long, f"functions with more than {MAX_PARAMETERS} parameters: {long}"


def _invariance_backends():
    return [b for b in ("cpu", "torch", "triton") if backends.unavailable_reason(b) is None]


@pytest.mark.parametrize("backend", _invariance_backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_outputs_are_batch_invariant(backend, dtype):
    """The same rows inside different batches, at other positions, give bitwise the same lp, H and gradient
    rows (a fixed normalizer makes every a_t the same); on the cpu backend with 1 and 2 threads too."""
    torch.manual_seed(11)
    vocab = 300
    rows = torch.randn(5, vocab).to(dtype)
    tokens = torch.randint(0, vocab, (5,))
    adv, old, samp = torch.randn(5), -torch.rand(5) * 3, -torch.rand(5) * 3

    def run(n_before, n_after, threads=None):
        extra = n_before + n_after
        logits = torch.cat([torch.randn(n_before, vocab).to(dtype), rows, torch.randn(n_after, vocab).to(dtype)])
        pick = slice(n_before, n_before + 5)

        def around(x, fill):
            return torch.cat([fill(n_before), x, fill(n_after)]) if extra else x

        leaf = logits.clone().requires_grad_()
        previous = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            out = fused_is.policy_loss(
                leaf, around(tokens, lambda k: torch.randint(0, vocab, (k,))), around(adv, torch.randn),
                old_logprobs=around(old, lambda k: -torch.rand(k)),
                sampler_logprobs=around(samp, lambda k: -torch.rand(k)),
                config="ppo_tis", normalizer=7.0, backend=backend)
            out.loss.backward()
        finally:
            torch.set_num_threads(previous)
        return out.logprobs[pick], out.entropy[pick], leaf.grad[pick]

    base = run(0, 0)
    others = [run(3, 0), run(0, 9), run(17, 2)]
    if backend == "cpu":
        others += [run(6, 5, threads=1), run(6, 5, threads=2)]
    for other in others:
        for want, got, what in zip(base, other, ("logprobs", "entropy", "grad")):
            assert torch.equal(want, got), (backend, what, (want - got).abs().max())


def test_no_line_over_the_configured_limit():
    """The library's and the kernels' sources keep to pyproject.toml's line length."""
    import re

    limit = int(re.search(r"line-length\s*=\s*(\d+)", (PACKAGE.parent / "pyproject.toml").read_text()).group(1))
    long = [f"{path.relative_to(PACKAGE.parent)}:{i}" for folder in (PACKAGE, PACKAGE.parent / "triton_kernels")
            for path in sorted(folder.rglob("*.py")) for i, line in enumerate(path.read_text().splitlines(), 1)
            if len(re.sub(r"\s*# noqa[:\w, ]*$", "", line)) > limit]  # a pragma does not count, as for ruff
    assert limit >= 80 and not long, f"lines over {limit} characters: {long}"


def _spelled_names(node) -> set:
    """The names one node spells as a list: a signature's parameters, a call's keywords and plain-name arguments,
    the names or strings of a tuple, list or set, the string keys of a dict."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
    if isinstance(node, ast.Call):
        return {k.arg for k in node.keywords if k.arg} | {x.id for x in node.args if isinstance(x, ast.Name)}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return ({x.id for x in node.elts if isinstance(x, ast.Name)}
                | {x.value for x in node.elts if isinstance(x, ast.Constant) and isinstance(x.value, str)})
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _is_mirror(node, signature: list) -> bool:
    """Whether node is `dict(a=a, b=b, ...)` over exactly the names of `signature`, in its order."""
    return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict" and not node.args
            and all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in node.keywords)
            and [k.arg for k in node.keywords] == signature)


def test_the_argument_list_is_declared_once():
    """policy_loss's argument list is declared once, by fused_is.call.Arguments (whose fields make the record, its
    checks and FusedPolicyLoss.apply's positional form); besides it only the public signatures of policy_loss and
    linear_policy_loss name the arguments. Nothing else in the package spells 10 or more of them in one signature,
    call, tuple, list or dict. One exception: policy_loss binds its parameters by `dict(name=name, ...)` in its
    signature's order, not by locals() (dynamo of torch 2.11, the GPU image's, cannot trace locals()); that mirror is
    checked against the signature here (a parameter left out would silently take its default)."""
    from fused_is.call import FIELDS

    names, allowed = set(FIELDS), {("fused_is.api", "policy_loss"), ("fused_is.linear", "linear_policy_loss")}
    signature = list(inspect.signature(fused_is.policy_loss).parameters)
    seen, spelled, mirrors, called_locals = set(), [], [], []
    for module, (path, tree) in _modules().items():
        for node in ast.walk(tree):
            count = len(_spelled_names(node) & names)
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "locals" and module == "fused_is.api":
                called_locals.append(where)
            if count >= 10 and (module, getattr(node, "name", None)) in allowed:
                seen.add((module, node.name))
            elif count >= 10 and module == "fused_is.api" and _is_mirror(node, signature):
                mirrors.append(where)
            elif count >= 10:
                spelled.append(f"{where} ({count} argument names)")
    assert seen == allowed, "the scan did not find the public signatures: it reads nothing"
    assert len(mirrors) == 1 and not called_locals, (mirrors, called_locals)
    assert not spelled, f"the argument list spelled again (use fused_is.call.Arguments): {spelled}"
    # the declaration covers the public signature: its parameters are the logits and the fields but compute_grad
    parameters = set(signature)
    assert parameters == {"logits"} | names - {"compute_grad"}, parameters ^ ({"logits"} | names)


def test_every_backend_implements_the_interface():
    """backends.Backend is the one interface of the plan's primitives: each concrete backend offers its four methods
    with the same parameters (cpu and cuda: one class), and the torch backend forms g and h through the call's hook
    (KernelArgs.coefficients), not from a call passed beside the arguments."""
    from fused_is.backends import Backend
    from fused_is.backends.cpp import CppBackend

    for name in ("torch", "triton", "cpu", "cuda"):
        impl = backends.implementation(name)
        assert impl is backends.implementation(name), "one implementation object per backend"
        for method in ("stats", "partial_stats", "fused", "fused_given"):
            want = [p for p in inspect.signature(getattr(Backend, method)).parameters if p != "self"]
            have = list(inspect.signature(getattr(impl, method)).parameters)[:len(want)]
            assert have == want, (name, method, have, want)
    assert type(backends.implementation("cpu")) is type(backends.implementation("cuda")) is CppBackend
    package = Path(fused_is.__file__).parent / "backends"
    assert not (package / "cpu.py").exists() and not (package / "cuda.py").exists()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_reaches(modules) -> list:
    """'path:line name' of every use of another package module's private name: `from .x import _name`, or
    `x._name` where x is an imported package module. A module's own names and dunders are not reaches."""
    found = []
    for name, (path, tree) in modules.items():
        package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        aliases = {}  # local name -> the package module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package_parts[:len(package_parts) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
                    elif target in modules and target != name and _is_private(alias.name):
                        found.append(f"{path.name}:{node.lineno} {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name):
                found.append(f"{path.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """What two modules share is public in the module that owns it (DESIGN.md section 10)."""
    assert not _private_reaches(_modules()), _private_reaches(_modules())


def test_the_reach_scan_sees_a_reach(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("_hidden = 1\nshown = 2\n")
    (package / "sub" / "b.py").write_text("from ..a import _hidden\nfrom .. import a\nfrom .. import a as other\n"
                                          "x = a._hidden + other._hidden + a.shown + a.__name__.__len__()\n")
    (package / "c.py").write_text("_own = 1\nimport os\ny = _own + os._exit.__hash__()\n")
    found = _private_reaches(_modules(package))
    assert sorted(found) == ["b.py:1 pkg.a._hidden", "b.py:4 pkg.a._hidden", "b.py:4 pkg.a._hidden"], found


MAX_TEACHER_FRAMES = 5  # public function -> autograd.Function -> plan runner -> distillation sweep -> launcher
# paths still deeper (issue 51, item 4), which must not grow: the gradient written block by block during the forward
# call (run -> DeferredGradient.write -> a sweep's block writer [-> gradient_sweep]), the whole rows' statistics that
# block-wise writing needs (run -> row_statistics -> shard_partials), and the fused-linear head's term, run from the
# row source's take (run -> HeadRows.take -> [_distill_statistics ->] sweep)
DEEPER_TEACHER_PATHS = {("autograd.py:forward", "__init__.py:write"): 7,
                        ("plan.py:row_statistics", "distributed.py:shard_partials"): 6, ("linear.py:take",): 7}


def _record_cpu_pair_launches(monkeypatch, seen):
    from fused_is.backends import cpp

    real = cpp.extension("cpu")

    class Recording:
        def __getattr__(self, name):
            def launch(*args):
                seen.append(_package_frames(inspect.stack()))
                return getattr(real, name)(*args)
            return launch

    monkeypatch.setattr(cpp, "extension", lambda kind: Recording())


@pytest.mark.skipif(backends.unavailable_reason("cpu") is not None, reason="the CPU extension is not built")
def test_frames_from_the_teacher_paths_to_the_kernel(monkeypatch):
    """distill_loss, linear_distill_loss and policy_loss's distillation term (composed, in place in backward and in
    the forward call) reach the CPU kernels in at most 5 frames of the package, but for the paths listed above, which
    must not grow."""
    seen = []
    _record_cpu_pair_launches(monkeypatch, seen)
    g = torch.Generator().manual_seed(5)
    z, u = torch.randn(2, 5, 40, generator=g).requires_grad_(), torch.randn(2, 5, 40, generator=g)
    tokens, advantages = torch.randint(0, 40, (2, 5), generator=g), torch.randn(2, generator=g)
    for inplace in (False, True):
        fused_is.distill_loss(z * 1 if inplace else z, u, kind="jsd", backend="cpu", inplace=inplace)[0].backward()
    config = fused_is.LossConfig(policy="reinforce", is_level="none", distill_kind="forward_kl")
    for inplace in (False, True, "forward"):
        fused_is.policy_loss(z * 1 if inplace else z, tokens, advantages, config=config, teacher_logits=u,
                             backend="cpu", inplace=inplace).loss.backward()
    hidden, weight = torch.randn(10, 8, generator=g).requires_grad_(), torch.randn(40, 8, generator=g)
    teacher = dict(teacher_hidden=torch.randn(10, 8, generator=g), teacher_weight=torch.randn(40, 8, generator=g))
    fused_is.linear_distill_loss(hidden, weight, *teacher.values(), kind="reverse_kl", backend="cpu")[0].backward()
    fused_is.linear_policy_loss(hidden, weight, tokens.reshape(-1), torch.randn(10, generator=g), config=config,
                                backend="cpu", **teacher).loss.backward()
    assert len(seen) > 10
    for frames in seen:
        limit = max([depth for path, depth in DEEPER_TEACHER_PATHS.items() if set(path) <= set(frames)],
                    default=MAX_TEACHER_FRAMES)
        assert len(frames) <= limit, frames


def test_the_plan_does_not_probe_its_row_source():
    """plan.py reads what fused_is.plan.RowSource declares: no getattr / hasattr / isinstance on a row source."""
    tree = ast.parse((PACKAGE / "plan.py").read_text())
    probes = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) in ("getattr", "hasattr", "isinstance") and node.args
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "source"]
    assert not probes, f"plan.py probes its row source at lines {probes}"
    from fused_is import linear, plan

    for source in (plan.LogitsRows, plan.RoundedRows, linear.HeadRows):
        for name in ("logits", "inplace", "deferred", "whole", "forms_term", "blocks", "gradient_blocks",
                     "skipped_blocks", "take", "gradient", "describe", "close"):
            assert hasattr(source, name) or name in ("logits", "inplace", "deferred"), (source.__name__, name)


def _steps_of(monkeypatch, call_it) -> list:
    """The plan.Steps that policy_loss calls made by call_it() decided."""
    from fused_is import plan

    seen, real = [], plan.decide
    monkeypatch.setattr(plan, "decide", lambda *args: seen.append(real(*args)) or seen[-1])
    call_it()
    return seen


@pytest.mark.parametrize("case,expected", [
    ("ppo_tis", "Steps(kept=False, fused_term=None, term='', statistics='', gradient='fused', centering=False)"),
    ("gspo", "Steps(kept=False, fused_term=None, term='', statistics='pass', gradient='fused', centering=False)"),
    ("no_grad", "Steps(kept=False, fused_term=None, term='', statistics='pass', gradient='', centering=False)"),
    ("inplace", "Steps(kept=False, fused_term=None, term='', statistics='whole_rows', gradient='deferred', "
                "centering=False)"),
    ("term", "Steps(kept=False, fused_term=None, term='composed', statistics='', gradient='fused', centering=False)"),
    ("term_forward", "Steps(kept=False, fused_term=None, term='blocks', statistics='whole_rows', gradient='given', "
                     "centering=False)"),
    ("term_triton", "Steps(kept=False, fused_term='forward_kl', term='', statistics='', gradient='fused', "
                    "centering=False)"),
    ("kept", "Steps(kept=True, fused_term=None, term='', statistics='', gradient='fused', centering=False)"),
])
def test_the_plan_is_decided_before_it_runs(case, expected, monkeypatch):
    """plan.decide returns a plain record of the steps run() takes; each case's record, printed."""
    inputs = make_inputs("padded", dtype=torch.float32, vocab=64, seed=9)
    preset = "gspo" if case == "gspo" else "ppo_tis"
    config = fused_is.LossConfig.preset(preset, **({"distill_kind": "forward_kl"} if "term" in case else {}))
    extra = dict(teacher_logits=inputs.logits + 1.0) if "term" in case else {}
    if case == "kept":
        extra = dict(kept=torch.stack([inputs.tokens, (inputs.tokens + 1) % 64], -1))
    inplace = {"inplace": True, "term_forward": "forward"}.get(case, False)
    backend = "triton" if case == "term_triton" else "cpu" if backends.unavailable_reason("cpu") is None else "torch"
    if backends.unavailable_reason(backend) is not None:
        pytest.skip(backends.unavailable_reason(backend))
    logits = inputs.logits.clone().requires_grad_(case != "no_grad")

    def call():
        work = logits * 1 if inplace else logits
        with torch.set_grad_enabled(case != "no_grad"):
            fused_is.policy_loss(work, inputs.tokens, inputs.advantages, config=config, backend=backend,
                                 inplace=inplace, **inputs.kwargs(), **extra)

    assert [str(steps) for steps in _steps_of(monkeypatch, call)] == [expected]

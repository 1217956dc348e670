"""The import boundaries of docs/how_it_works.md, checked on the source (every import statement, function-level
ones included) and on a fresh interpreter (what importing the front-end really loads)."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = os.path.join(SRC, "pagedserve")


def _modules(src: str = SRC) -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(os.path.join(src, "pagedserve")):
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(d, f), src)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = os.path.join(d, f)
    return mods


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    # The pagedserve modules a file imports anywhere in it, function bodies included ("from pagedserve.x
    # import y" is pagedserve.x.y when that is a module, else pagedserve.x; relative imports resolved).
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pagedserve")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base.startswith("pagedserve"):
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return out


def _graph(src: str = SRC) -> dict[str, set[str]]:
    modules = _modules(src)
    return {m: {i for i in _imports(m, p, modules) if i in modules and i != m} for m, p in modules.items()}


MODULES = _modules()
GRAPH = _graph()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package, forbidden", [
    # The scheduler and the KV cache manager see token ids and configs, nothing that runs a model or serves.
    ("pagedserve.core", ("pagedserve.engine", "pagedserve.worker", "pagedserve.model", "pagedserve.attention",
                         "pagedserve.distributed", "pagedserve.server", "pagedserve.kernels", "pagedserve.sample")),
    # Workers and ranks run plans; they never reach up into the engine or the server, and hold no grammar (the
    # plan carries the step's token bitmask).
    ("pagedserve.worker", ("pagedserve.engine", "pagedserve.server", "pagedserve.structured_output")),
    ("pagedserve.distributed", ("pagedserve.engine", "pagedserve.server", "pagedserve.structured_output")),
    ("pagedserve.sample", ("pagedserve.engine", "pagedserve.server", "pagedserve.structured_output")),
    ("pagedserve.model", ("pagedserve.engine", "pagedserve.server", "pagedserve.worker")),
    ("pagedserve.structured_output", ("pagedserve.engine", "pagedserve.server")),
    # The model runner executes plans and verifies their drafts; proposing the next ones is the worker's
    # (spec_decode/proposer.py: n-gram lookup and the draft model behind one interface).
    ("pagedserve.worker.model_runner", ("pagedserve.spec_decode.proposer", "pagedserve.spec_decode.draft_model",
                                        "pagedserve.spec_decode.ngram_proposer")),
])
def test_no_upward_imports(package: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if _under(m, package)
                 for i in deps if any(_under(i, f) for f in forbidden))
    assert not bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    # Tarjan's strongly connected components: every component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    assert not _cycles(GRAPH)


@pytest.mark.parametrize("planted", [
    "    from pagedserve.engine.core import EngineCore  # noqa\n",     # absolute, inside a function
    "    from ..engine import core  # noqa\n",                          # relative, inside a function
])
def test_a_function_level_cycle_is_found(tmp_path, planted: str) -> None:
    # The check above on a copy of the package with one lazy import planted in core/request.py:
    # core.request -> engine.core -> core.scheduler -> core.request.
    shutil.copytree(PKG, tmp_path / "pagedserve", ignore=shutil.ignore_patterns("csrc", "static", "*.jinja"))
    target = tmp_path / "pagedserve" / "core" / "request.py"
    target.write_text(target.read_text() + f"\n\ndef _planted():\n{planted}")
    cycles = _cycles(_graph(str(tmp_path)))
    assert any({"pagedserve.core.request", "pagedserve.engine.core"} <= set(c) for c in cycles), cycles


def _loaded_by(*modules: str) -> set[str]:
    code = (f"import sys; import {', '.join(modules)}; "
            "print(' '.join(m for m in sys.modules if m in ('torch', 'transformers') or m.startswith('pagedserve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_front_end_loads_no_torch_and_no_engine_core() -> None:
    # The message types and the front-end's two halves: a process that only tokenizes and detokenizes (and the
    # server's request handling) never pays for torch, the loader or the engine core.
    loaded = _loaded_by("pagedserve.messages", "pagedserve.engine.processor", "pagedserve.engine.output_processor",
                        "pagedserve.engine.async_engine", "pagedserve.server.app")
    assert "pagedserve.messages" in loaded and "pagedserve.server.app" in loaded
    assert not loaded & {"torch", "transformers", "pagedserve.engine.core", "pagedserve.model.loader",
                         "pagedserve.worker.executor", "pagedserve.distributed.executor"}


def test_core_loads_no_torch() -> None:
    loaded = _loaded_by("pagedserve.core.scheduler", "pagedserve.core.kv_cache_manager", "pagedserve.messages")
    assert "torch" not in loaded and not any(_under(m, "pagedserve.worker") for m in loaded)


def test_engine_core_stays_small() -> None:
    # Issue 30's target: the engine core keeps the scheduler and talks to an executor; model loading, memory
    # planning, cache allocation and proposing live in the Worker, so the class stays under 250 lines.
    tree = ast.parse(open(MODULES["pagedserve.engine.core"], encoding="utf-8").read())
    [core] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore"]
    assert core.end_lineno - core.lineno + 1 < 250


def test_no_closure_crosses_a_thread() -> None:
    # A request reaches the engine thread as a typed command (messages.py) and the tokenizer thread as a named
    # Processor method, so a reader or a static tool can follow it: nothing handed to those hops is a lambda or
    # a function defined inside another one.
    tree = ast.parse(open(MODULES["pagedserve.engine.async_engine"], encoding="utf-8").read())
    nested = {inner.name for outer in ast.walk(tree) if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef))
              for inner in ast.walk(outer) if inner is not outer and isinstance(inner, ast.FunctionDef)}
    hops = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("_submit", "_call", "_on_engine_thread", "_on_tokenizer_thread")]
    assert len(hops) >= 9
    bad = [ast.unparse(n) for n in hops for a in n.args
           if isinstance(a, ast.Lambda) or isinstance(a, ast.Name) and a.id in nested]
    assert not bad
    # Below the engine thread a step is plain calls (the ranks get (method name, arguments) over a pipe).
    for module in ("pagedserve.engine.core", "pagedserve.worker.executor", "pagedserve.worker.worker",
                   "pagedserve.distributed.executor", "pagedserve.distributed.rank_process"):
        tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)], module

"""The import boundaries of docs/how_it_works.md, checked on the source (every import statement, function-level
ones included) and on a fresh interpreter (what importing the front-end really loads)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = os.path.join(SRC, "pagedserve")


def _modules() -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(d, f), SRC)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = os.path.join(d, f)
    return mods


MODULES = _modules()


def _imports(path: str) -> set[str]:
    # The pagedserve modules a file imports anywhere in it ("from pagedserve.x import y" is pagedserve.x.y when
    # that is a module, else pagedserve.x).
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pagedserve")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pagedserve"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                    for a in node.names}
    return out


GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


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
])
def test_no_upward_imports(package: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if _under(m, package)
                 for i in deps if any(_under(i, f) for f in forbidden))
    assert not bad


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components over every import statement (function-level ones too).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles


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

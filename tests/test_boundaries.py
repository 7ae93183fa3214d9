"""The layering DESIGN.md asks for: the planner never imports the runtime, split ops
never import the runtime, and both meet in ``osdp.contract``. Checked in a fresh
interpreter (importing a module here would see what earlier tests imported)."""
from __future__ import annotations

import subprocess
import sys

import pytest

PLANNER = ["osdp.planner." + m for m in (
    "description", "gpt_desc", "checks", "cluster", "run", "device", "cost_model", "search", "search_problem",
    "batch_sweep", "plan", "planner", "step_sim", "rerank", "inputs", "calibration", "calibration_record", "profile_cache", "uniform_plan",
    "fake_describe", "collective_cost", "llama_desc", "model_desc",
)] + ["osdp.planner.cost_model." + m for m in (
    "settings", "unit_bytes", "units", "replicate", "static", "timing", "prefetch", "options", "problem", "template",
    "tied_templates", "memory", "evaluate",
)]


@pytest.mark.parametrize("modules,forbidden", [
    (PLANNER, "osdp.runtime"),
    # the hardware micro-benchmark (torch collectives and compute) is osdp.profiler's
    (["osdp.planner"] + PLANNER, "osdp.profiler"),
    (["osdp.ops", "osdp.ops.matmul_split", "osdp.ops.split_embedding"], "osdp.runtime"),
    (["osdp.contract"], "osdp.planner"),
    # the scheduling rules both sides call (issue 34): plain data, no torch, neither side
    (["osdp.schedule_rules"], "osdp.planner"),
    (["osdp.schedule_rules"], "osdp.runtime"),
    (["osdp.schedule_rules"], "torch"),
    # Triton (about 80 MiB resident) is imported by the first CUDA slice matmul, not by the
    # planner or the wrapper (issue 34)
    (["osdp", "osdp.planner.planner", "osdp.runtime", "osdp.ops"], "triton"),
])
def test_layering(modules, forbidden):
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"bad = sorted(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden + '.'!r}))\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{modules} import {out.stdout.strip()}"


# ---- imports run one way (issue 34 part 3) ------------------------------------------
# Read from the source (ast), not by importing: a cycle or an import inside a function
# is a fact of the text. The CLI (osdp/cli/) imports its commands' modules on use, to
# keep `osdp --help` fast; everything else imports osdp modules at the top.

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

OSDP_DIR = Path(__file__).resolve().parents[1] / "osdp"

# (module, imported osdp module) pairs allowed inside a function, and why
ALLOWED_INNER_IMPORTS = {
    ("osdp.ops", "osdp.ops.split_conv1d"):
        "optional: the Conv1D split op needs transformers, registered once it is loaded",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(OSDP_DIR.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(name: str, is_package: bool, node, modules: set[str]) -> list[str]:
    """The osdp modules an import statement names (``from a import b``: a.b when that is
    a module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = name.split(".") if is_package else name.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    return found or ([target] if target in modules else [])


def _import_graph():
    """({module: osdp modules it imports at load time}, [(module, line, imported) inside
    a function or class body])."""
    files = {_module_name(p): p for p in OSDP_DIR.rglob("*.py")}
    modules = set(files)
    graph, inner = {}, []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set()
        load_time, type_only = set(), set()
        for stmt in tree.body:  # module level, including under if / try
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                type_only.update(id(n) for n in ast.walk(stmt))  # annotations only: never run
            elif isinstance(stmt, (ast.Import, ast.ImportFrom, ast.If, ast.Try)):
                load_time.update(id(n) for n in ast.walk(stmt))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in type_only:
                continue
            targets = [t for t in _imported(name, is_package, node, modules) if t != name]
            if id(node) in load_time:
                graph[name].update(targets)
            else:
                inner.extend((name, node.lineno, t) for t in targets)
    return graph, inner


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module. A package's ``__init__``
    imported by its own submodules (``from . import _atomic`` in a submodule loads the
    package first, which is already loading) is not a cycle: edges from a submodule to
    an ancestor package are dropped."""
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph, _ = _import_graph()
    assert _cycles(graph) == []


def test_no_imports_inside_functions():
    """An osdp module imported inside a function hides a dependency (often to dodge a
    cycle); outside the CLI each one must be in ALLOWED_INNER_IMPORTS with its reason."""
    _, inner = _import_graph()
    found = {(m, t) for m, _, t in inner if m != "osdp.cli" and not m.startswith("osdp.cli.")}
    unexpected = sorted(f"{m} line {line} imports {t}" for m, line, t in inner
                        if (m, t) in found - set(ALLOWED_INNER_IMPORTS))
    assert unexpected == []
    stale = sorted(set(ALLOWED_INNER_IMPORTS) - found)
    assert stale == [], f"allowed exceptions no longer in the code (remove them from the list): {stale}"

"""The layout rules of issue #24 item 5 and ../shared/DESIGN.md ("Where the layout is heading"), checked
statically: every project module is parsed with `ast`, none is imported, so the test runs in well under a second
and a broken module shows up as a parse error rather than an import side effect.

Project modules: everything under harness/, quantizers/ and strategies/ (subpackages included), plus run.py.

Rules:
1. No import circle among project modules. Edges are the imports that run when a module is imported: the ones
   at module level (inside `try`/`if` too, not under `if TYPE_CHECKING:`), plus the package `__init__` that
   Python runs first for an imported submodule (`import harness.gate.stats` runs `harness/gate/__init__.py`),
   except the importer's own parent packages, which are already initialised by the time it runs.
2. No module over MAX_LINES lines, except the modules in OVERSIZED, which are being split right now.
3. No private name (`_name`) taken across modules: not `from harness.x import _helper`, not `x._helper` on an
   imported project module.
4. An import inside a function only for a library in LAZY_OK (heavy or optional; each entry says why); never a
   project module, never the standard library or a light dependency: those go at the top of the module.

Each rule is one test; its failure message lists every violation as `path:line: what`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "quantizers", "strategies")
SCRIPTS = ("run.py",)
MAX_LINES = 400

# Modules still over MAX_LINES because another helper is splitting them right now (issue #24). This list only
# shrinks: an entry whose module is gone or back under the limit fails test_oversized_allowlist_is_current, so
# it is removed as soon as the split lands. The lead empties it when the redesign is integrated.
OVERSIZED: frozenset[str] = frozenset()  # harness/sweep.py and roofline.py were split (H4)

# Top-level packages a function may import lazily. Each is heavy to import or optional (an extra, a platform
# plugin, a driver that may be absent); a lazy import keeps `run.py --help`, a config error, `python -m
# harness.records.report` and the gate's parent process fast, and lets a machine without the extra still run the rest.
# Everything else (the standard library, numpy, psutil, tqdm, filelock, hydra/omegaconf, tokenizers, project
# modules) imports in well under 0.1 s or is needed on every path: it goes at the top of the module.
LAZY_OK: dict[str, str] = {
    "torch": "1-3 s to import; CLI paths that never touch a model must stay fast",
    "transformers": "imports torch",
    "accelerate": "imports torch",
    "safetensors": "safetensors.torch imports torch; only the model-writing paths need it",
    "torchao": "quant extra; imports torch and compiles kernels lists",
    "bitsandbytes": "quant extra; CUDA-oriented, probes native libraries at import",
    "gptqmodel": "quant extra; imports torch and its own kernels",
    "optimum": "quant extra (optimum-quanto); imports torch",
    "mslk": "optional CUDA-only kernel library (torchao's int4 mslk layouts); absent on CPU machines",
    "zentorch": "optional AMD CPU plugin for torch, normally absent",
    "llama_cpp": "optional engine; loads the native llama.cpp library at import",
    "gguf": "only the llama.cpp engine's export/conversion paths need it (numpy + large tables)",
    "mlflow": "1-3 s to import (SQLAlchemy, alembic); report, gate and dry paths without tracking skip it",
    "matplotlib": "~0.5 s; only the plot paths need it",
    "lm_eval": "tasks extra; imports datasets, evaluate and their dependencies",
    "datasets": "~1 s (pyarrow); only the accuracy paths read datasets",
    "scipy": "heavy submodules; only statistics paths need them",
    "statsmodels": "tasks extra (McNemar); imports scipy and pandas",
    "arch": "optional bootstrap library for the gate (issue #24 item 7); imports scipy, statsmodels, pandas",
    "pynvml": "optional (nvidia-ml-py), only on NVIDIA GPUs for energy",
    "sqlalchemy": "~0.2 s; the config check parses with it only a URI that can hold a password (harness/secret_uri.py)",
    "psycopg": "optional PostgreSQL driver, only for a postgresql:// tracking store",
    "psycopg2": "optional PostgreSQL driver, only for a postgresql:// tracking store",
    "huggingface_hub": "its download stack (httpx, file locks, cache scan) is only needed when fetching a model",
}


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every project module (a package's `__init__.py` is the package)."""
    files: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    for script in SCRIPTS:
        files[Path(script).stem] = ROOT / script
    return files


MODULES = _module_files()
PROJECT_ROOTS = frozenset(name.split(".")[0] for name in MODULES)
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in MODULES.items()}


def _rel(name: str) -> str:
    return MODULES[name].relative_to(ROOT).as_posix()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _ancestors(name: str) -> list[str]:
    """Parent packages of a dotted name, outermost first: a.b.c -> [a, a.b]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(absolute module, imported name or None) for each thing an import statement brings in."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
        return
    source = _absolute(module, node)
    for alias in node.names:
        yield source, alias.name


def _project_modules(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """Project modules an import statement runs: the named ones, a submodule taken with `from pkg import sub`,
    and the parent packages Python initialises first (minus the importer's own, which are already running)."""
    own = set(_ancestors(module))
    hit: set[str] = set()
    for source, name in _targets(module, node):
        for candidate in (f"{source}.{name}" if name else None, source):
            if candidate in MODULES:
                hit.add(candidate)
                hit.update(a for a in _ancestors(candidate) if a in MODULES and a not in own)
                break
    hit.discard(module)
    return hit


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits inside a function (lambdas and nested defs included).
    Imports under `if TYPE_CHECKING:` never run, so they are skipped."""

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from walk(child, nested)

    yield from walk(tree, False)


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}, module-level imports only."""
    graph: dict[str, dict[str, int]] = {name: {} for name in MODULES}
    for name, tree in TREES.items():
        for node, in_function in _imports(tree):
            if not in_function:
                for target in _project_modules(name, node):
                    graph[name].setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, set(c), c[0]) for c in components]


def _one_cycle(graph: dict[str, dict[str, int]], component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in component:
                    continue
                if w == start:
                    path = [v]  # v, its parent, ... back to start
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def _report(title: str, violations: list[str], hint: str) -> str:
    return f"{len(violations)} {title}:\n  " + "\n  ".join(violations) + f"\n{hint}"


def test_no_import_circle():
    graph = _graph()
    violations = []
    for cycle in _cycles(graph):
        steps = [f"{_rel(a)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:], strict=False)]
        violations.append(" -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not violations, _report(
        "import circle(s) among project modules (module-level imports)",
        violations,
        "Fix the direction: move the shared piece into a lower module both can import; do not hide the "
        "import inside a function.",
    )


def test_no_module_over_the_line_limit():
    violations = []
    for name, path in MODULES.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES and _rel(name) not in OVERSIZED:
            violations.append(f"{_rel(name)}: {lines} lines")
    assert not violations, _report(
        f"module(s) over {MAX_LINES} lines", violations, "Split the module by role (see ../shared/DESIGN.md)."
    )


def test_oversized_allowlist_is_current():
    """OVERSIZED only shrinks: an entry whose module was split (or deleted) must leave the list."""
    present = {_rel(name): len(p.read_text(encoding="utf-8").splitlines()) for name, p in MODULES.items()}
    stale = sorted(
        f"{rel}: {'gone' if rel not in present else f'{present[rel]} lines'}"
        for rel in OVERSIZED
        if present.get(rel, 0) <= MAX_LINES
    )
    assert not stale, _report("stale OVERSIZED entr(ies) in tests/test_layout.py", stale, "Remove them.")


def test_no_private_names_across_modules():
    violations = []
    for name, tree in TREES.items():
        where = _rel(name)
        aliases: dict[str, str] = {}  # local name -> project module it is bound to
        for node, _ in _imports(tree):
            for source, imported in _targets(name, node):
                if imported is not None:
                    full = f"{source}.{imported}"
                    if full in MODULES:
                        alias = next(a for a in node.names if a.name == imported)
                        aliases[alias.asname or imported] = full
                    elif source in MODULES and source != name and _is_private(imported):
                        violations.append(f"{where}:{node.lineno}: from {source} import {imported}")
                    continue
                if source in MODULES or any(a in MODULES for a in _ancestors(source)):
                    if any(_is_private(part) for part in source.split(".")[1:]):
                        violations.append(f"{where}:{node.lineno}: import {source}")
                    alias = next(a for a in node.names if a.name == source)
                    if alias.asname:
                        aliases[alias.asname] = source
                    else:  # `import harness.x` binds `harness`
                        root = source.split(".")[0]
                        aliases[root] = root
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            dotted = _dotted(node.value, aliases)
            if dotted in MODULES and dotted != name:
                violations.append(f"{where}:{node.lineno}: {dotted}.{node.attr}")
    assert not violations, _report(
        "private name(s) taken from another module",
        sorted(set(violations)),
        "Make the name public (drop the underscore, document it) in the module that owns it, or move the "
        "code that needs it there.",
    )


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The project module an expression like `x` or `harness.x` names, through the import aliases."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def test_imports_at_the_top():
    violations = []
    for name, tree in TREES.items():
        for node, in_function in _imports(tree):
            if not in_function:
                continue
            tops = {source.split(".")[0] for source, _ in _targets(name, node)}
            shown = f"{_rel(name)}:{node.lineno}: {ast.unparse(node)}"
            if getattr(node, "level", 0) or tops & PROJECT_ROOTS:
                violations.append(f"{shown}  (project module inside a function)")
            elif tops - LAZY_OK.keys():
                violations.append(f"{shown}  (not a heavy optional library)")
    assert not violations, _report(
        "import(s) inside functions",
        sorted(violations, key=_by_file_and_line),
        "Move them to the top of the module. Only the libraries in LAZY_OK (tests/test_layout.py) may be "
        "imported lazily; a project import that would close a circle means the shared piece belongs lower.",
    )


def _by_file_and_line(entry: str) -> tuple[str, int]:
    path, line, _ = entry.split(":", 2)
    return path, int(line)


def test_checker_sees_the_project():
    """Guard against a checker that passes because it parsed nothing."""
    assert {"harness", "harness.analysis.accuracy", "quantizers", "strategies", "run"} <= set(MODULES)
    assert any(_graph()[name] for name in MODULES)


def test_checker_catches_what_it_should():
    """The rules fire on known-bad code, so a pass above means the project is clean, not the checker blind."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse(
        "import os\nif TYPE_CHECKING:\n    import harness.x\ndef f():\n    import torch\n    from harness import y\n"
    )
    found = [(type(n).__name__, n.lineno, inside) for n, inside in _imports(tree)]
    assert found == [("Import", 1, False), ("Import", 5, True), ("ImportFrom", 6, True)]
    # a name taken from the package's __init__ is an edge to it, even from inside the package
    assert _project_modules("strategies.greedy", ast.parse("from strategies import x").body[0]) == {"strategies"}

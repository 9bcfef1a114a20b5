"""The house rules that keep the package readable, checked on its source (no import is executed):

- no import cycle among the package's modules (imports inside functions included);
- no upward arrow: the engines import only their own package and the leaf records below everything
  (``vision``, ``moe``, ``models``); nothing outside ``bench/`` imports ``bench``, and the core imports no task;
- no core file over 400 lines, ``module.py`` at most 330, ``AsyncRLModule.__init__`` at most 15 parameters.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "molt_lightning"
LEAVES = {"vision", "moe", "models"}  # records and loaders the engines and the trainer share


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at any depth of its code but ``if TYPE_CHECKING:`` blocks (relative
    imports resolved): for ``from X import y`` the submodule ``X.y`` when there is one, else ``X``."""
    name, out = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) ==
                   "TYPE_CHECKING" for n in ast.walk(node)}  # imports for annotations only
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def test_no_import_cycle():
    """Strongly connected components of the import graph (Tarjan's algorithm): every one must be a single module."""
    edges, index, low, stack, on_stack, cycles = graph(), {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_upward_arrow():
    wrong = []
    for name, targets in graph().items():
        for target in targets:
            top = target.split(".")[1] if target.count(".") else ""
            if name.startswith("molt_lightning.engines") and not target.startswith("molt_lightning.engines") \
                    and top not in LEAVES:
                wrong.append((name, target))
            if target.startswith("molt_lightning.bench") and not name.startswith("molt_lightning.bench"):
                wrong.append((name, target))
            core = not name.startswith(("molt_lightning.bench", "molt_lightning.tasks", "molt_lightning.models"))
            if core and target.startswith("molt_lightning.tasks"):
                wrong.append((name, target))
    assert not wrong, f"imports that run up a floor: {wrong}"


def test_file_sizes_and_the_modules_arguments():
    from molt_lightning.module import AsyncRLModule

    core = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("bench", "models", "tasks")]
    big = {str(p.relative_to(PACKAGE)): n for p in core if (n := len(p.read_text().splitlines())) > 400}
    assert not big, f"core files over 400 lines: {big}"
    assert len((PACKAGE / "module.py").read_text().splitlines()) <= 330
    import inspect

    assert len(inspect.signature(AsyncRLModule.__init__).parameters) - 1 <= 15  # less self

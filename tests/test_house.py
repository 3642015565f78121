"""The house rules, computed from the source: no import cycle inside ``verl_memopd``, the stages never import the lab
(``verl_memopd.bench``, ``verl_memopd.experiment``), and every MemOPD data key is spelled only in ``fields.py``."""

import ast
from pathlib import Path

import pytest

from verl_memopd import fields

PACKAGE = Path(__file__).resolve().parents[1] / "verl_memopd"
LAB = ("verl_memopd.bench", "verl_memopd.experiment")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The package module an imported name lives in (``a.b.c`` -> ``a.b`` when ``c`` is not a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, top_level_only: bool) -> set[str]:
    """The ``verl_memopd`` modules ``module`` imports: at import time (``top_level_only``: not inside a function) or
    anywhere in its source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                out.update(filter(None, (_resolve(a.name) for a in child.names)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + [base]).strip(".")
                for alias in child.names:
                    target = _resolve(f"{base}.{alias.name}") or _resolve(base)
                    if target:
                        out.add(target)
            visit(child)

    visit(tree)
    out.discard(module)
    return {m for m in out if m.startswith("verl_memopd")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def _parents(module: str) -> set[str]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)


def test_no_import_cycle_inside_the_package():
    graph = {m: _imports(m, top_level_only=False) for m in MODULES}  # a function-level import is a cycle too
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


#: library modules of the stages; command lines (``__main__``) may drive the stages with the lab's tiny models
STAGES = sorted(m for m in MODULES if not m.startswith(LAB) and not m.endswith(".__main__"))


def test_the_stages_are_most_of_the_package():
    assert {"verl_memopd.packing", "verl_memopd.rce", "verl_memopd.trainer.ppo", "verl_memopd.fields"} <= set(STAGES)


@pytest.mark.parametrize("module", STAGES)
def test_stages_never_import_the_lab(module):
    lab = sorted(m for m in _imports(module, top_level_only=False) if m.startswith(LAB))
    assert not lab, f"{module} imports the lab: {lab} (the stages must run without verl_memopd.bench / .experiment)"


def _field_values() -> dict[str, str]:
    values = {}
    for name in fields.__all__:
        value = getattr(fields, name)
        for v in value.values() if isinstance(value, dict) else [value] if isinstance(value, str) else []:
            values[v] = name
    return values


def test_every_data_key_is_spelled_only_in_fields():
    values = _field_values()
    assert len(values) >= 25  # the keys of fields.__all__, each once
    found = []
    for module, path in MODULES.items():
        if module == "verl_memopd.fields":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in values:
                found.append(f"{module}:{node.lineno} {node.value!r} (fields.{values[node.value]})")
    assert not found, "data keys spelled outside verl_memopd/fields.py:\n" + "\n".join(found)


def test_field_values_are_unique():
    names = [n for n in fields.__all__ if isinstance(getattr(fields, n), str)]
    assert len({getattr(fields, n) for n in names}) == len(names)

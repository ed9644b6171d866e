"""The layer rules of docs/design.md, checked on the source: who may import whom, no import cycles,
no re-export hops."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "batchpilot"

# layer -> the layers of ours it may import (top-level modules count as layers: settings, cli)
ALLOWED = {
    "core": {"core"},
    "models": {"core", "models"},
    "runtime": {"core", "models", "runtime"},
    "sim": {"core", "sim", "settings"},
    "server": {"core", "models", "runtime", "server", "settings"},
    "settings": {"core", "settings"},
    "bench": {"core", "models", "runtime", "server", "sim", "bench", "settings"},
    "profile": {"core", "models", "runtime", "server", "sim", "bench", "profile", "settings"},
}


def modname(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, list[tuple[str, list[str]]]]:
    """Each module's imports of ours."""
    return {modname(p): imports(ast.parse(p.read_text(encoding="utf-8")), modname(p), p.name == "__init__.py")
            for p in PKG.rglob("*.py")}


def trees() -> dict[str, ast.Module]:
    return {modname(p): ast.parse(p.read_text(encoding="utf-8")) for p in PKG.rglob("*.py")}


def imports(tree: ast.Module, mod: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """Every ``batchpilot`` import anywhere in ``mod`` (function-level and relative ones too):
    (module, names)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = mod.split(".")[: len(mod.split(".")) + int(is_package) - node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("batchpilot"):
                found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("batchpilot")]
    return found


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "batchpilot"


def test_every_layer_imports_only_the_layers_below_it() -> None:
    bad = []
    for mod, found in sources().items():
        allowed = ALLOWED.get(layer(mod))
        if allowed is None:  # batchpilot/__init__.py and cli.py: the entry points may import anything
            continue
        for target, _ in found:
            if layer(target) not in allowed:
                bad.append(f"{mod} -> {target}")
    assert not bad, "imports against docs/design.md's layer table:\n" + "\n".join(sorted(set(bad)))


def test_nothing_but_the_cli_imports_the_measurement_package() -> None:
    bad = [f"{mod} -> {t}" for mod, found in sources().items() if layer(mod) not in ("profile", "batchpilot")
           for t, _ in found if layer(t) == "profile"]
    assert not bad, bad


def test_no_import_cycles() -> None:
    found_by = sources()
    edges: dict[str, set[str]] = {m: set() for m in found_by}
    for mod, found in found_by.items():
        for target, names in found:
            for t in [f"{target}.{n}" for n in names if f"{target}.{n}" in found_by] or [target]:
                if t in found_by and t != mod:
                    edges[mod].add(t)
    # a package's __init__ re-exporting its children is not a cycle of concepts: leave package nodes out
    packages = {m for m in found_by if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(edges[node] - packages):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, path + [nxt]):
                return True
        state[node] = 2
        return False

    for m in sorted(set(found_by) - packages):
        if state.get(m) is None and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    found_by, by_module = sources(), trees()
    defined: dict[str, set[str]] = {}
    for mod, tree in by_module.items():
        names: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.If, ast.Try)):
                names |= {n.id for n in ast.walk(node)
                          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                names |= {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined[mod] = names
    packages = {m for m in by_module if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    hops = [f"{mod}: {name} via {target}" for mod, found in found_by.items() for target, names in found
            if target in by_module and target not in packages
            for name in names if name not in defined[target] and f"{target}.{name}" not in by_module]
    assert not hops, "\n".join(hops)

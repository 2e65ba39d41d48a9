"""The package graph is one-way (docs/design.md, "Layers and one-way
imports"): every import of the project's own modules, at the top of a file or
inside a function, is parsed and checked against the layer rules, and the
file-level graph has no cycle."""
from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "fullshard"

# Each area and the areas it must never import (directly or lazily). api.py
# (public enums and frozen policies, no logic) and core/ form the bottom layer.
FORBIDDEN = {
    "core": {"fsdp", "construct", "wrap", "checkpoint", "train", "bench", "memory", "amp",
             "activation_checkpointing", "models", "data", "cli", "fullshard", "optim"},
    "models": {"core", "fsdp", "construct", "wrap", "checkpoint", "train", "bench", "memory", "amp",
               "activation_checkpointing", "data", "cli", "fullshard", "optim"},
    "api": {"core", "fsdp", "construct", "wrap", "checkpoint", "train", "bench", "memory", "amp",
            "activation_checkpointing", "models", "data", "cli", "fullshard", "optim"},
    "checkpoint": {"fsdp", "train", "bench", "cli"},
    "memory": {"fsdp", "train", "bench", "cli"},
    "data": {"core", "fsdp", "construct", "checkpoint", "train", "bench", "cli", "optim"},
    # fullshard.optim steps on shards through core's contract (placement.shard_info), never the front doors.
    "optim": {"fsdp", "fsdp2", "wrap", "checkpoint", "train", "bench", "memory", "amp", "activation_checkpointing",
              "models", "data", "cli", "fullshard"},
    "train": {"bench", "cli"},
    "bench": {"cli"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every ``fullshard...`` module ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fullshard":
                continue
            for alias in node.names:  # `from fullshard import faults` imports a module
                sub = f"{target}.{alias.name}"
                out.add(sub if _exists(sub) else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "fullshard")
    out.discard(name)
    return out


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fullshard"


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PKG.rglob("*.py"))}


def test_no_arrow_runs_up():
    bad = []
    for module, targets in _graph().items():
        for target in sorted(targets):
            if _area(target) in FORBIDDEN.get(_area(module), ()):
                bad.append(f"{module} -> {target}")
    assert not bad, "imports against the layer rules of docs/design.md:\n" + "\n".join(bad)


def test_no_module_import_cycle():
    graph = _graph()
    # Package __init__ files re-export their children; an edge into a package
    # stands for its __init__ only.
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, "module import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", ["fullshard.core.flat", "fullshard.core.state", "fullshard.api"])
def test_rules_see_the_files(module):
    """The walk finds the modules the rules are about (a guard against a test that checks nothing)."""
    assert module in _graph()

"""The package graph is one-way (docs/design.md, "Layers and one-way
imports"): every import of the project's own modules, at the top of a file or
inside a function, is parsed and checked against an allowlist per area, and
the file-level graph has no cycle.

An area is a top-level module or subpackage of ``src/fullshard`` (``core``,
``fsdp2``, ``faults``, ...; ``fullshard`` is the package's ``__init__``).
ALLOW names, for every area, the other areas it may import. An area missing
from ALLOW is an error, so a new module is placed in the layering on purpose,
not by default."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "fullshard"

# Each area and the other areas it may import (directly or lazily); its own
# modules are always allowed. Read bottom-up: api.py (public enums and frozen
# policies, no logic), core/ (the engine: torch, api and itself), then what
# builds on the core, the two front doors, and train/ < bench/ < cli.py on top.
# Before widening a set, check the edge against docs/design.md's layering.
ALLOW: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    # Bottom: no project imports, or core's only one.
    "api": set(),
    "core": {"api"},
    # Leaves used across layers: no project imports.
    "digest": set(),                    # file checksums (data cache, checkpoint manifests)
    "faults": set(),                    # test fault injection, hooked in by train/ only
    "models": set(),                    # plain nn.Modules: never the engine
    "data": {"digest"},                 # tokenizer, corpora: never the engine
    "wrap": set(),                      # auto-wrap policies know nothing of units
    "activation_checkpointing": set(),
    # On the core, below the front doors.
    "construct": {"api", "core"},
    "amp": {"core"},
    "memory": {"core", "construct"},
    "optim": {"core"},                  # core's contract (placement.shard_info, names)
    "checkpoint": {"api", "core", "construct", "digest"},  # never train/, bench/, a front door
    "fsdp_settings": {"api", "core"},
    "forward_methods": {"core"},
    "dtensor_specs": {"core"},
    "fsdp2_comm": {"core"},
    "fsdp2_state": {"api", "core"},
    # The two front doors over one engine (fsdp.py mixes in checkpoint/'s state-dict methods).
    "fsdp": {"api", "core", "construct", "wrap", "checkpoint", "forward_methods", "fsdp_settings"},
    "fsdp2": {"api", "core", "construct", "wrap", "dtensor_specs", "fsdp2_comm", "fsdp2_state"},
    # Public names only.
    "fullshard": {"api", "core", "wrap", "fsdp", "fsdp2", "forward_methods", "optim", "memory", "amp",
                  "activation_checkpointing"},
    # Top floors: train/ never imports bench/ or cli; bench/ never cli.
    "pipelining": {"core", "fsdp", "fsdp2"},  # torch.distributed.pipelining stages of our units
    "adapters": {"api", "core", "fsdp", "fsdp2"},  # PEFT adapters of sharded models
    "train": {"fullshard", "api", "core", "construct", "wrap", "checkpoint", "optim", "memory", "amp", "pipelining",
              "adapters", "activation_checkpointing", "models", "data", "faults"},
    "bench": {"fullshard", "core", "wrap", "optim", "models", "train"},
    "cli": {"train", "bench", "checkpoint", "data"},
}.items()}

# Single edges against the documented layering, allowed by name until they are
# fixed; each must still exist (test_exceptions_are_live), so a fixed one is
# removed here too.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports_in(source: str, name: str, is_package: bool) -> set[str]:
    """Every ``fullshard...`` module the source of module ``name`` imports (relative imports resolved)."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
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


def _imports(path: pathlib.Path) -> set[str]:
    return _imports_in(path.read_text(), _module_name(path), path.name == "__init__.py")


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fullshard"


@functools.lru_cache(maxsize=1)
def _parsed() -> tuple:
    return tuple((_module_name(p), frozenset(_imports(p))) for p in sorted(PKG.rglob("*.py")))


def _graph() -> dict[str, set[str]]:
    """module -> the fullshard modules it imports; the source is parsed once per test run."""
    return {name: set(targets) for name, targets in _parsed()}


def violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` (module -> modules it imports) that ALLOW and
    EXCEPTIONS do not permit, and the areas ALLOW does not place."""
    bad = []
    for area in sorted({_area(m) for m in graph} - ALLOW.keys()):
        bad.append(f"area {area!r} is not in ALLOW: place it in the layering of docs/design.md")
    for module, targets in sorted(graph.items()):
        src = _area(module)
        for target in sorted(targets):
            dst = _area(target)
            if dst == src or (module, target) in EXCEPTIONS:
                continue
            if src in ALLOW and dst not in ALLOW[src]:
                bad.append(f"{module} -> {target} ({src} may import only {sorted(ALLOW[src])})")
    return bad


def test_every_import_is_allowed():
    bad = violations(_graph())
    assert not bad, "imports against the layer rules of docs/design.md:\n" + "\n".join(bad)


def test_allowlist_names_only_existing_areas():
    areas = {_area(m) for m in _graph()}
    assert ALLOW.keys() == areas, f"ALLOW has stale areas {sorted(ALLOW.keys() - areas)}"
    assert all(dst in areas for allowed in ALLOW.values() for dst in allowed)


def test_exceptions_are_live():
    """A known exception that no longer exists (fixed) is removed from EXCEPTIONS."""
    graph = _graph()
    stale = [f"{m} -> {t}" for m, t in EXCEPTIONS if t not in graph.get(m, ())]
    assert not stale, "stale EXCEPTIONS:\n" + "\n".join(stale)
    assert all(_area(t) not in ALLOW[_area(m)] for m, t in EXCEPTIONS), "exception already allowed by ALLOW"


# Imports against the layering, added to the real source of one file (in
# memory): the rules must report each. The first four slipped past the old
# denylist; the last ones cover a lazy import, an area ALLOW does not know and
# a top floor reaching up.
MUTATIONS = {
    "core->faults": ("core/state.py", "from .. import faults\n"),
    "api->faults": ("api.py", "def _lazy():\n    from .faults import ENV\n"),
    "checkpoint->fsdp2": ("checkpoint/save_load.py", "from ..fsdp2 import fully_shard\n"),
    "optim->dtensor_specs": ("optim/shards.py", "import fullshard.dtensor_specs\n"),
    "models->core lazy": ("models/gpt.py", "def _lazy():\n    import fullshard.core.flat\n"),
    "train->bench": ("train/loop.py", "from fullshard import bench\n"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_rules_report_an_added_import(case):
    rel, line = MUTATIONS[case]
    path = PKG / rel
    name = _module_name(path)
    graph = _graph()
    assert not violations({name: graph[name]}), "the file is clean before the mutation"
    mutated = _imports_in(path.read_text() + "\n" + line, name, path.name == "__init__.py")
    bad = violations({name: mutated})
    dst = case.split()[0].split("->")[1]
    assert any(b.startswith(f"{name} -> fullshard.{dst}") for b in bad), bad


def test_rules_report_an_unplaced_area():
    bad = violations({"fullshard.newthing": {"fullshard.core.flat"}})
    assert bad and "'newthing' is not in ALLOW" in bad[0]


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

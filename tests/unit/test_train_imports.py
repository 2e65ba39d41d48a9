"""Import rules of the trainer and the benchmarks: the CLI is the top floor (`fullshard.cli` imports
train/ and bench/; nothing imports it); train/ never imports bench/; the project's own modules are
imported at the top of a file, lazily only where start-up speed asks for it (torch.distributed
.checkpoint behind `fullshard.checkpoint`)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fullshard

SRC = Path(fullshard.__file__).parent
LAZY_ALLOWED = ("fullshard.checkpoint",)  # save_load / consolidate: about 0.7 s of every command


def _imports(path: Path):
    """(line, modules named, at the top level?) of each import of the project's own modules in ``path``."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1]).split(".")
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]  # `from fullshard import cli` names fullshard.cli
        else:
            continue
        names = [n for n in names if n.startswith("fullshard.")]
        if names:
            yield node.lineno, names, id(node) in top


def _under(name: str, *packages: str) -> bool:
    """``name`` is one of ``packages`` or inside one (``fullshard.clip_grad_norm_`` is not ``fullshard.cli``)."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_train_and_bench_import_rules():
    problems = []
    for folder in ("train", "bench"):
        for path in sorted((SRC / folder).glob("*.py")):
            for line, names, at_top in _imports(path):
                where = f"{path.relative_to(SRC)}:{line} imports {', '.join(names)}"
                if folder == "train" and any(_under(n, "fullshard.bench", "fullshard.cli") for n in names):
                    problems.append(f"{where}: train/ never imports bench/ or the CLI")
                if any(_under(n, "fullshard.cli") for n in names):
                    problems.append(f"{where}: nothing imports the CLI")
                if not at_top and not all(n.startswith(LAZY_ALLOWED) for n in names):
                    problems.append(f"{where} inside a function: move it to the top of the file")
    assert not problems, "\n".join(problems)


@pytest.mark.heavy
def test_cli_start_up_does_not_import_torch_distributed_checkpoint():
    """The lazy imports above are worth it: `fullshard --help` does not pay for torch.distributed.checkpoint."""
    code = ("import sys, fullshard.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out

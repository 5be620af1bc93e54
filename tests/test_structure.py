"""The code's shape, checked from its source (issue 26): no file in `pipeline/` or `shard_tools/`
over 500 lines, no function over 60 lines and no class over 160, docstrings left out of the counts.
A unit past its limit is split into steps that say what they do, not exempted here."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted([*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("shard_tools/**/*.py")])
LIMITS = {ast.FunctionDef: 60, ast.AsyncFunctionDef: 60, ast.ClassDef: 160}


def _docstring_lines(node: ast.AST) -> set[int]:
    lines: set[int] = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, (*LIMITS, ast.Module)) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _oversized(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    found = [f"{len(text.splitlines())} lines, more than 500"] if len(text.splitlines()) > 500 else []
    for node in ast.walk(ast.parse(text)):
        limit = LIMITS.get(type(node))
        if limit is not None:
            size = len(set(range(node.lineno, node.end_lineno + 1)) - _docstring_lines(node))
            if size > limit:
                found.append(f"{type(node).__name__} {node.name} (line {node.lineno}): {size} lines, more than {limit}")
    return found


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_unit_is_too_long_to_enter(path):
    assert not _oversized(path)


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f'def f():\n    """Docs\n    not counted."""\n{body}\n\n\nclass C:\n    pass\n')
    assert _oversized(tmp_path / "m.py") == ["FunctionDef f (line 1): 62 lines, more than 60"]


# Beyond a kind's two modules and the two registries, what may name a kind: the format's table of
# each kind's members (on-disk names: one owner of the format), the package's public `Sa1bSource`,
# the pip extra called `embeddings`, and a log line's advice.
KIND_NAMED_ALSO = {"pipeline/format/members.py", "pipeline/format/__init__.py", "shard_tools/__init__.py",
                   "shard_tools/arrays.py", "pipeline/storage/local.py"}


def _names_in_code(path: pathlib.Path) -> str:
    """The names and string literals of a module's code, docstrings left out, as one lowercase text."""
    tree = ast.parse(path.read_text())
    docstrings = {id(body[0].value) for node in ast.walk(tree) if isinstance(node, (*LIMITS, ast.Module))
                  and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words += [getattr(node, "module", None) or "", *(alias.name for alias in node.names)]
    return "\n".join(words).lower()


def test_a_kind_lives_in_its_two_modules_and_the_two_registries():
    from pipeline.kinds import KINDS as READING
    from shard_tools.kinds import KINDS as PACKING

    assert set(PACKING) <= set(READING), "every packing kind can be read"
    samples = ROOT / "shard_tools" / "samples"  # (sample data: not the kinds' code)
    texts = {str(p.relative_to(ROOT)): _names_in_code(p) for p in FILES if samples not in p.parents}
    for kind in READING:
        own = {f"pipeline/kinds/{kind}.py", f"shard_tools/{kind}.py", "pipeline/kinds/__init__.py", "shard_tools/kinds.py"}
        knowing = {path for path, text in texts.items() if kind in text}
        assert knowing - own <= KIND_NAMED_ALSO, (kind, sorted(knowing - own - KIND_NAMED_ALSO))


def test_no_unused_or_undefined_names():
    """pyflakes' checks and syntax errors (ruff's F and E9) over the code, tests and benchmarks: an
    unused import or variable is dead code, an undefined name a bug waiting for its line to run."""
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,E9", "--output-format", "concise",
                            "--no-cache", "pipeline", "shard_tools", "tests", "bench", "docker"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr

"""The code's shape, checked from its source (issues 26 and 31): no file in `pipeline/` or `shard_tools/`
over 500 lines, no function over 60 lines and no class over 160, docstrings left out of the counts; no
line over 120 characters; no internal function over 7 parameters; no import cycle among their modules.
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


LINE_LIMIT = 120
PARAMETER_LIMIT = 7


def _long_lines(path: pathlib.Path) -> list[str]:
    return [f"line {number}: {len(line)} characters, more than {LINE_LIMIT}"
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > LINE_LIMIT]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_line_is_too_long_to_read(path):
    assert not _long_lines(path)


def test_the_check_finds_a_long_line(tmp_path):
    (tmp_path / "m.py").write_text(f"x = 1\ny = '{'y' * 120}'\n")
    assert _long_lines(tmp_path / "m.py") == ["line 2: 126 characters, more than 120"]


def _exported(tree: ast.Module) -> set[str]:
    """The names a module lists in `__all__` (a literal list or tuple of strings)."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(target, ast.Name) and target.id == "__all__"
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            return {item.value for item in getattr(node.value, "elts", []) if isinstance(item, ast.Constant)}
    return set()


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    """Positional, keyword-only, *args and **kwargs each count one; a method's self or cls doesn't."""
    args = function.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    return count - (method and not static and bool(args.posonlyargs or args.args))


def _functions(tree: ast.Module):
    """Every function with whether it is public: a module-level function named in `__all__`, or a method
    of a module-level class named in `__all__` whose name is `__init__` or doesn't start with `_`.
    Anything else (a private name, a dunder, a method of an unexported class, a nested function) is
    internal."""
    exported = _exported(tree)
    for parent in ast.walk(tree):
        for inner in ast.iter_child_nodes(parent):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if parent is tree:
                    yield inner, False, inner.name in exported
                else:
                    method = isinstance(parent, ast.ClassDef)
                    exported_class = method and parent in tree.body and parent.name in exported
                    yield inner, method, exported_class and (inner.name == "__init__" or not inner.name.startswith("_"))


def _crowded(path: pathlib.Path) -> list[str]:
    """Internal functions taking more than PARAMETER_LIMIT parameters (see `_functions` for internal)."""
    found = []
    for function, method, public in _functions(ast.parse(path.read_text())):
        count = _parameters(function, method)
        if not public and count > PARAMETER_LIMIT:
            found.append(f"{function.name} (line {function.lineno}): {count} parameters, more than {PARAMETER_LIMIT}")
    return found


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_internal_function_takes_too_many_parameters(path):
    """Internal: any function but a module-level one named in `__all__` and the methods of a module-level
    class named in `__all__` whose name is `__init__` or doesn't start with `_`. Parameters: positional,
    keyword-only, *args and **kwargs count one each, a method's self or cls none. Public functions may
    take more (keyword-only options of a user-facing call); internal ones pass a value instead."""
    assert not _crowded(path)


def test_the_check_finds_a_crowded_internal_function(tmp_path):
    eight, nine = "a, b, c, d, e, f, g, h", "a, b, c, d, e, f, g, h, i"
    (tmp_path / "m.py").write_text(
        f"__all__ = ['f', 'C']\n"
        f"def f({eight}): pass\n"                       # public: may take more
        f"def _g(a, *args, b, **kw): pass\n"            # four
        f"def h({eight}): pass\n"                       # not in __all__: internal
        f"class C:\n"
        f"    def __init__(self, {eight}): pass\n"      # public class's __init__
        f"    def m(self, {eight}): pass\n"
        f"    def _m(self, {eight}): pass\n"
        f"    def __call__(self, {eight}): pass\n"
        f"    @staticmethod\n"
        f"    def s(a, b, c, d, e, f, g): pass\n"
        f"    def n(self, a, b, c, d, e, f, g):\n"
        f"        def inner({eight}): pass\n"
        f"class D:\n"
        f"    def __init__(self, {nine}): pass\n")
    assert _crowded(tmp_path / "m.py") == [
        "h (line 4): 8 parameters, more than 7", "_m (line 8): 8 parameters, more than 7",
        "__call__ (line 9): 8 parameters, more than 7", "__init__ (line 15): 9 parameters, more than 7",
        "inner (line 13): 8 parameters, more than 7"]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                                         or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module):
    """The imports run when the module is imported: its body, with its `if`/`try`/`with` blocks and class
    bodies, but not function bodies and not `if TYPE_CHECKING:` blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                and not _is_type_checking(node):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            pending += [inner for handler in getattr(node, "handlers", []) for inner in handler.body]


def _import_graph(root: pathlib.Path, files: list[pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports at import time (see `_top_level_imports`). `from pkg
    import name` names the submodule pkg.name when that is a module here, else pkg itself; a package
    that Python imports before its submodule is not counted as an edge (that is how packages work)."""
    paths = {_module_name(path, root): path for path in files}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in paths else module
                           for alias in node.names]
            graph[name] |= {target for target in targets if target in paths and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), as a sorted list of its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_import_cycle():
    """Among the modules of `pipeline/` and `shard_tools/`, from the imports run at import time (not those
    inside functions or under `if TYPE_CHECKING:`); a failure names each cycle's modules."""
    graph = _import_graph(ROOT, FILES)
    assert {"pipeline.format.manifest", "pipeline.loader"} <= set(graph), "the graph names the modules"
    assert not _cycles(graph)


def test_the_check_finds_an_import_cycle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("import pkg.b\nA = 1\n")
    (package / "b.py").write_text("from pkg import c\n")
    (package / "c.py").write_text("from . import a\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n")
    (package / "e.py").write_text("import os\ndef f():\n    import pkg.d\n")
    graph = _import_graph(tmp_path, sorted(package.glob("*.py")))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"},
                     "pkg.d": set(), "pkg.e": set()}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


# Beyond a kind's two modules and the two registries, what may name a kind: the format's table of
# each kind's members (on-disk names: one owner of the format), the package's public `Sa1bSource`,
# the pip extra called `embeddings`, and a log line's advice.
KIND_NAMED_ALSO = {"pipeline/format/members.py", "pipeline/format/__init__.py", "shard_tools/__init__.py",
                   "shard_tools/arrays.py", "pipeline/storage/local.py",
                   "shard_tools/link.py"}  # (`shard-pack link` reads the embeddings kind's columns, for any kind's keys)


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

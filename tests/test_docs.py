"""The documentation against the code it describes (issue 39), each check read from the code itself:
README's extras against pyproject, every kind option and loader setting documented and every
documented one real, the make targets, shard-pack's subcommands, StreamLoader's members, the
new-kind checklist and the layout in architecture.md, documented signatures, and install hints
that work without PyPI. Each check returns what is missing, named, and is shown to find a line
taken out of its page (`test_the_checks_find_a_line_taken_out`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import textwrap
import tomllib
import typing
from collections.abc import Callable
from typing import Any

import pytest

from pipeline import LoaderConfig, StreamLoader, make_stream_loader, trl_dataset
from pipeline.errors import ConfigError
from pipeline.kinds import KINDS, Kind
from shard_tools.cli import COMMANDS
from test_quickstart import _section

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
LOADING = (REPO / "docs" / "loading.md").read_text()
ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()
EXTRAS: dict[str, list[str]] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "docker" / "README.md",
         *sorted((REPO / "docs").glob("*.md"))]
CODE = sorted([*REPO.glob("pipeline/**/*.py"), *REPO.glob("shard_tools/**/*.py")])

# Options a kind takes (`Kind.takes`) that the docs leave out, and why.
UNDOCUMENTED = {
    ("vqa", "form"): "pipeline.trl_dataset's own: its batches are TRL's lists of dicts, which validate_first_batch "
                     "refuses",
}
KIND_SECTIONS = {"sa1b": "SA-1B", "vqa": "VQA", "embeddings": "Embeddings",
                 "webdataset": "WebDataset tars indexed in place"}
_SPAN = re.compile(r"`([^`]+)`")


# -- reading the pages --------------------------------------------------------------------------



def _paragraph(text: str, start: str) -> str:
    """The paragraph of `text` that begins with `start` ('' if none)."""
    return next((p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith(start)), "")


def _after(text: str, start: str) -> str:
    """The rest of the paragraph of `text` in which `start` first appears ('' if none)."""
    return next((p.partition(start)[2] for p in re.split(r"\n\s*\n", text) if start in p), "")


def _table(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of every markdown table of `text` whose first header cell is `header`."""
    rows, inside = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("|") else None
        if cells is None:
            inside = False
        elif cells[0] == header:
            inside = True
        elif inside and not set(cells[0]) <= {"-", " "}:
            rows.append(cells)
    return rows


def _top_spans(text: str) -> list[str]:
    """The code spans of `text` outside any parentheses: an option list's names, not its remarks."""
    spans, depth = [], 0
    for piece in re.split(r"(`[^`]+`)", text):
        if piece.startswith("`") and piece.endswith("`") and len(piece) > 1:
            if depth == 0:
                spans.append(piece[1:-1])
        else:
            depth = max(0, depth + piece.count("(") - piece.count(")"))
    return spans


def _names(spans: list[str]) -> list[str]:
    """The identifiers among code spans (`name` or `name=default`)."""
    return [m[1] for s in spans if (m := re.fullmatch(r"([a-z_][a-z0-9_]*)(=.*)?", s))]


def _literal(cell: str) -> Any:
    """A table's default as a value: a Python literal, `N MiB`; `...` for prose it cannot read."""
    text = cell.strip("`")
    if m := re.fullmatch(r"(\d+) ([MG])iB", text):
        return int(m[1]) << (20 if m[2] == "M" else 30)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ...


def _default(field: dataclasses.Field) -> Any:
    return ... if field.default is dataclasses.MISSING else field.default


# -- what the code has --------------------------------------------------------------------------

def _fields(kind: str) -> dict[str, dataclasses.Field]:
    """The fields of a kind's options dataclass."""
    return {f.name: f for f in dataclasses.fields(typing.get_type_hints(KINDS[kind])["options"])}


def _options(kind: str) -> dict[str, dataclasses.Field]:
    """A kind's documented options: the fields of its options dataclass that it takes from the user
    (`Kind.takes`; the others its `of` fills from the manifests or `limits`), but UNDOCUMENTED."""
    return {name: f for name, f in _fields(kind).items()
            if name in KINDS[kind].takes and (kind, name) not in UNDOCUMENTED}


def _public_members(cls: type) -> set[str]:
    """A class's public names: its attributes, and those its `__init__` sets on `self`."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self" and not node.attr.startswith("_"):
            names.add(node.attr)
    return names


def _phony(makefile: str) -> list[str]:
    text = makefile.replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith(".PHONY:"))
    return line.partition(":")[2].split()


def _requirement_name(requirement: str) -> str:
    """A requirement's name with its extras, as pyproject writes it: `dask[distributed]`."""
    return re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?", requirement)[0]


# -- the checks: each returns what is missing or wrong, named ----------------------------------

def extras_problems(readme: str, extras: dict[str, list[str]]) -> list[str]:
    """README's Extras paragraph describes every extra of pyproject with the packages it brings
    (`dev`: its test tools are too many to list; that it holds every extra but `peers` is checked too)."""
    paragraph = _paragraph(readme, "**Extras.**")
    if not paragraph:
        return ["README.md has no paragraph starting **Extras.**"]
    marks = list(re.finditer(r"`([a-z0-9_-]+)`:", paragraph))
    described = {m[1]: paragraph[m.end():nxt.start() if nxt else None]
                 for m, nxt in zip(marks, [*marks[1:], None])}
    problems = [f"README's Extras names `{name}`, which pyproject.toml has not" for name in described
                if name not in extras]
    for extra, requirements in extras.items():
        if extra not in described:
            problems.append(f"README's Extras paragraph lacks the extra `{extra}` (pyproject: {requirements})")
        elif extra != "dev":
            problems += [f"README's Extras: `{extra}` does not name {_requirement_name(r)} (pyproject: {r})"
                         for r in requirements
                         if not re.search(rf"(?<![\w-]){re.escape(_requirement_name(r))}(?![\w-])", described[extra])]
    inside = {x for r in extras.get("dev", []) if r.startswith("shardstream[") for x in r[12:-1].split(",")}
    if "dev" in extras and inside != set(extras) - {"dev", "peers"}:
        problems.append(f"pyproject's dev holds the extras {sorted(inside)}, README says every extra but peers")
    return problems


def kind_option_problems(loading: str, readme: str) -> list[str]:
    """Every option of every kind in its section of loading.md (its Options paragraph or an option
    table) and in README's Kinds table; every option named there real, every table default the code's."""
    problems, kinds_table = [], {row[0].strip("`"): row for row in _table(readme, "kind")}
    for kind, title in KIND_SECTIONS.items():
        options, section = _options(kind), _section(loading, title)
        table = _table(section, "option")
        documented = set(_names(_top_spans(_after(section, "Options:")))) | {r[0].strip("`") for r in table}
        listed = set(_names(_top_spans(kinds_table[kind][-1]))) if kind in kinds_table else set()
        problems += [f"loading.md's {title} section does not document the {kind} option `{name}`"
                     for name in sorted(set(options) - documented)]
        problems += [f"README's Kinds table does not list the {kind} option `{name}`"
                     for name in sorted(set(options) - listed)]
        for name in sorted((documented | listed) - set(options)):
            why = UNDOCUMENTED.get((kind, name)) or ("a field its `of` fills in, not the user's"
                                                   if name in _fields(kind) else "no field of its options")
            problems.append(f"`{name}` is documented as a {kind} option, but it is not one ({why})")
        for name, default in ((row[0].strip("`"), row[1]) for row in table):
            if name in options and _literal(default) is not ... and _literal(default) != _default(options[name]):
                problems.append(f"loading.md's {title} table: `{name}` defaults to {default}, the code to "
                                f"{options[name].default!r}")
    return problems


def setting_problems(loading: str) -> list[str]:
    """loading.md's Settings table: every `LoaderConfig` field, nothing else, the code's defaults."""
    fields = {f.name: f for f in dataclasses.fields(LoaderConfig)}
    rows = [(name, row[1]) for row in _table(_section(loading, "Settings"), "setting") for name in _names(
        _SPAN.findall(row[0]))]
    problems = [f"loading.md's Settings table lacks the LoaderConfig field `{name}`"
                for name in fields if name not in {n for n, _ in rows}]
    for name, default in rows:
        if name not in fields:
            problems.append(f"loading.md's Settings table names `{name}`, which is no LoaderConfig field")
        elif default == "required" and fields[name].default is not dataclasses.MISSING:
            problems.append(f"loading.md's Settings table: `{name}` is required there, not in LoaderConfig")
        elif _literal(default) is not ... and _literal(default) != _default(fields[name]):
            problems.append(f"loading.md's Settings table: `{name}` defaults to {default}, LoaderConfig to "
                            f"{fields[name].default!r}")
    return problems


def make_target_problems(readme: str, makefile: str) -> list[str]:
    """Every target of the Makefile's .PHONY named in README (`make NAME`)."""
    return [f"README.md does not name `make {target}` (a .PHONY target of the Makefile)" for target in _phony(makefile)
            if not re.search(rf"(?<![\w-])make {re.escape(target)}(?![\w-])", readme)]


def subcommand_problems(readme: str) -> list[str]:
    """Every shard-pack subcommand in README's tool list (the `shard-pack` bullet)."""
    bullet = _paragraph(readme, "- **`shard-pack`**")
    listed = set(_SPAN.findall(bullet))
    return [f"README's shard-pack bullet does not list the subcommand `{name}`" for name in COMMANDS
            if name not in listed]


def member_problems(loading: str) -> list[str]:
    """Every public member of StreamLoader (and `iter`, `len`) in loading.md's member table."""
    cells = [s for row in _table(loading, "member") for s in _SPAN.findall(row[0])]
    heads = {re.match(r"(?:loader\.)?(\w+)", c)[1] for c in cells}
    wanted = _public_members(StreamLoader) | {"iter", "len"}
    return [f"loading.md's StreamLoader table lacks its member `{name}`" for name in sorted(wanted - heads)]


def kind_checklist_problems(architecture: str) -> list[str]:
    """Every member of the `Kind` protocol in architecture.md's new-kind (reading) row."""
    row = next((r for r in _table(architecture, "change") if r[0] == "a new kind (reading)"), None)
    if row is None:
        return ["architecture.md's table of changes has no row 'a new kind (reading)'"]
    named = {m[1] for s in _SPAN.findall(row[1]) for m in [re.match(r"(\w+)", s)] if m}
    wanted = set(Kind.__annotations__) | {n for n in vars(Kind) if not n.startswith("_")}
    return [f"architecture.md's new-kind checklist lacks `{name}` (a member of pipeline.kinds.Kind)"
            for name in sorted(wanted - named)]


def layout_problems(architecture: str) -> list[str]:
    """Every module of pipeline/ and shard_tools/ named in architecture.md's package list or layout."""
    text = architecture.partition("## The reading side")[0] + _section(architecture, "Repository layout")
    spans = _SPAN.findall(text)
    return [f"architecture.md's layout does not name {path.relative_to(REPO)}" for path in CODE
            if path.stem != "__init__"
            and not any(re.search(rf"(?<!\w){re.escape(path.stem)}(?!\w)", s) for s in spans)]


def _signatures(page: str, name: str) -> list[str]:
    """The page's signatures of `name`: each `name(...)` that reads as a definition (`def name(...)`),
    not a call and not elided with `...`."""
    found = []
    for match in re.finditer(rf"(?<![\w.]){name}\(", page):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(page)):
            depth += {"(": 1, ")": -1}.get(page[end], 0)
            if depth == 0:
                break
        text = re.sub(r"\s+", " ", page[match.start():end + 1])
        try:
            ast.parse(f"def {text}: pass")
        except SyntaxError:
            continue
        if "..." not in text:
            found.append(text)
    return found


def signature_problems(page: str, function: Callable[..., Any]) -> list[str]:
    """The page's full signatures of `function`: its parameters, their kinds and defaults, as the code has them."""
    name = function.__name__
    found = _signatures(page, name)
    if not found:
        return [f"no full signature of {name} on the page"]
    signature = inspect.signature(function)
    code = [(p.name, p.kind, "(required)" if p.default is p.empty else p.default)
            for p in signature.parameters.values()]
    problems = []
    for span in found:
        args = ast.parse(f"def {span}: pass").body[0].args
        positional = args.posonlyargs + args.args
        defaults = ["(required)"] * (len(positional) - len(args.defaults)) + args.defaults
        doc = [(a.arg, kind, d if d == "(required)" else ast.literal_eval(d)) for group, kind, values in (
                   (args.posonlyargs, inspect.Parameter.POSITIONAL_ONLY, defaults),
                   (args.args, inspect.Parameter.POSITIONAL_OR_KEYWORD, defaults[len(args.posonlyargs):]),
                   (args.kwonlyargs, inspect.Parameter.KEYWORD_ONLY,
                    ["(required)" if d is None else d for d in args.kw_defaults]))
               for a, d in zip(group, values)]
        doc += [(a.arg, kind, "(required)") for a, kind in ((args.vararg, inspect.Parameter.VAR_POSITIONAL),
                                                            (args.kwarg, inspect.Parameter.VAR_KEYWORD)) if a]
        if sorted(doc, key=lambda x: x[1]) != sorted(code, key=lambda x: x[1]):
            problems.append(f"the page's {span!r} is not the code's {name}{signature}")
    return problems


_EXTRA_HINT = re.compile(r"(?i)the (?:package's )?`?([a-z0-9_-]+)`? extra, or `?pip install ((?:'[^']+'\s*)+)")


def _strings(path: pathlib.Path) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def hint_problems(pages: dict[str, str], code: dict[str, list[str]], extras: dict[str, list[str]]) -> list[str]:
    """No page or message installs `shardstream` from a package index (it is on none); each hint
    'the X extra, or pip install ...' lists exactly pyproject's requirements of X; and the code has
    one for every extra it imports on demand (all but demo, dev and peers)."""
    texts = {**pages, **{f"{where} (string {i})": s for where, strings in code.items() for i, s in enumerate(strings)}}
    problems = [f"{where}: `pip install ... shardstream...` (not on PyPI: name the extra's packages)"
                for where, text in texts.items() if re.search(r"pip install[^\n`]*?['\s\"]shardstream\b", text)]
    hinted = set()
    for where, text in texts.items():
        for extra, requirements in _EXTRA_HINT.findall(re.sub(r"\s+", " ", text)):
            listed = re.findall(r"'([^']+)'", requirements)
            if "(string " in where:
                hinted.add(extra)
            if sorted(listed) != sorted(extras.get(extra, ["(no such extra)"])):
                problems.append(f"{where}: the {extra} extra's hint installs {listed}, pyproject says "
                                f"{extras.get(extra)}")
    problems += [f"no message of pipeline/ or shard_tools/ says how to install the {extra} extra "
                 f"(the X extra, or pip install ...)"
                 for extra in sorted(set(extras) - {"demo", "dev", "peers"} - hinted)]
    return problems


# -- the tests ----------------------------------------------------------------------------------

def _no(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


def test_readme_describes_every_extra_with_its_packages():
    _no(extras_problems(README, EXTRAS))


def test_every_kind_option_is_documented_and_every_documented_one_real():
    _no(kind_option_problems(LOADING, README))


def test_every_loader_setting_is_documented_and_every_documented_one_real():
    _no(setting_problems(LOADING))


def test_every_make_target_is_in_the_readme():
    _no(make_target_problems(README, (REPO / "Makefile").read_text()))


def test_every_subcommand_is_in_the_readmes_tool_list():
    _no(subcommand_problems(README))


def test_every_stream_loader_member_is_in_loadings_table():
    _no(member_problems(LOADING))


def test_architecture_names_every_kind_member_and_every_module():
    _no(kind_checklist_problems(ARCHITECTURE) + layout_problems(ARCHITECTURE))


def test_documented_signatures_are_the_codes():
    _no(signature_problems(LOADING, make_stream_loader)
        + signature_problems((REPO / "docs" / "trainers.md").read_text(), trl_dataset))


def test_install_hints_name_what_pyproject_installs():
    pages = {str(p.relative_to(REPO)): p.read_text() for p in PAGES}
    _no(hint_problems(pages, {str(p.relative_to(REPO)): _strings(p) for p in CODE}, EXTRAS))


@pytest.mark.parametrize("kind", ["sa1b", "vqa", "embeddings"])
def test_the_options_the_docs_are_checked_against_are_what_the_loader_takes(kind, request):
    """Each documented option is taken by `make_stream_loader` (at its default), and each field of
    the options the kind does not take is refused: the docs are checked against the loader's own set."""
    source = request.getfixturevalue({"sa1b": "sa1b_dataset", "vqa": "vqa", "embeddings": "emb"}[kind])
    for name, field in _options(kind).items():
        make_stream_loader(source, "train", batch_size=1, **{name: _default(field)})
    for name in set(_fields(kind)) - KINDS[kind].takes:
        with pytest.raises(ConfigError, match=name):
            make_stream_loader(source, "train", batch_size=1, **{name: None})


# -- each check finds what a page lost (a line taken out, or one put back) -----------------------

def _without(text: str, line: str) -> str:
    assert text.count(line) == 1, line
    return text.replace(line, "")


def test_the_checks_find_a_line_taken_out():
    assert any("`gcs`" in p for p in extras_problems(README.replace("`gcs`:", "gcs:"), EXTRAS))
    assert any("obstore" in p for p in extras_problems(README.replace("(gcsfs, obstore)", "(gcsfs)"), EXTRAS))
    loading = _without(LOADING, "| `box_noise_mode` | `\"normal\"` | or `\"uniform\"` (SAM 2's rule) |\n")
    loading = loading.replace("`points_per_mask`, `box_noise`, `box_noise_mode`;", "`points_per_mask`, `box_noise`;")
    assert any("`box_noise_mode`" in p for p in kind_option_problems(loading, README))
    assert any("`pixel_factor`" in p for p in kind_option_problems(LOADING, README.replace(", `pixel_factor` |", " |")))
    assert any("max_image_pixels" in p for p in kind_option_problems(
        LOADING.replace("`image_size=448` (or `None`: as stored),", "`image_size=448`, `max_image_pixels`,"), README))
    assert any("`points_per_mask` defaults" in p for p in kind_option_problems(
        LOADING.replace("| `points_per_mask` | `0` |", "| `points_per_mask` | `1` |"), README))
    settings = [line for line in LOADING.splitlines(keepends=True) if line.startswith("| `stall_timeout` |")]
    assert any("`stall_timeout`" in p for p in setting_problems(_without(LOADING, settings[0])))
    misnamed = LOADING.replace("| `read_threads` |", "| `read_thread` |")
    assert any("`read_thread`" in p for p in setting_problems(misnamed))
    assert any("make bench-resume" in p for p in make_target_problems(
        README.replace("`make bench-resume`", "bench-resume"), (REPO / "Makefile").read_text()))
    assert any("`upgrade`" in p for p in subcommand_problems(README.replace("(`upgrade`)", "")))
    close = [line for line in LOADING.splitlines(keepends=True) if line.startswith("| `close()` |")]
    assert any("`close`" in p for p in member_problems(_without(LOADING, close[0])))
    assert any("`for_verify`" in p for p in kind_checklist_problems(ARCHITECTURE.replace("`for_verify`", "for_verify")))
    assert any("outdir.py" in p for p in layout_problems(ARCHITECTURE.replace("`outdir`", "the folder module")))
    trainers = (REPO / "docs" / "trainers.md").read_text()
    assert signature_problems(trainers.replace("pixel_factor=None, ", ""), trl_dataset)
    pages = {"README.md": README.replace("`pip install 'gcsfs>=2024.2' 'obstore>=0.12,<0.13'`",
                                         "`pip install 'gcsfs>=2024.2'`")}
    assert any("gcs extra's hint" in p for p in hint_problems(pages, {}, EXTRAS))
    assert any("not on PyPI" in p for p in hint_problems({"x.md": "`pip install 'shardstream[gcs]'`"}, {}, EXTRAS))

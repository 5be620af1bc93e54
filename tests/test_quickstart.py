"""The README as users read it: its quickstart runs as written, it stays short, and every relative
link of the documentation leads to a file (and heading) that exists."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted([README, REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
BIN = pathlib.Path(sys.executable).parent  # the venv's bin (not resolved: a venv's python is a link)

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def _section(text: str, title: str) -> str:
    """The text under the heading `title` (any level), up to the next heading of its level or above."""
    lines, out, level = text.splitlines(keepends=True), [], None
    in_code = False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else _HEADING.match(line)
        if level is None:
            if heading and heading[2] == title:
                level = len(heading[1])
            continue
        if heading and len(heading[1]) <= level:
            break
        out.append(line)
    assert level is not None, f"no heading {title!r}"
    return "".join(out)


def _blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of `text`, in order: (language, code)."""
    return [(match[1], match[2]) for match in _FENCE.finditer(text)]


def _without_code(text: str) -> str:
    """`text` without its fenced blocks and inline code spans (links there are examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else _HEADING.match(line)
        if match:
            anchors.add(_slug(match[2], seen))
    return anchors


def test_quickstart_runs_as_written(tmp_path: pathlib.Path) -> None:
    """Each ```sh and ```python block under "## Quickstart", in order, verbatim, in an empty folder,
    with the venv's bin first on PATH (`python`, `shard-pack`)."""
    blocks = _blocks(_section(README.read_text(), "Quickstart"))
    languages = [language for language, _ in blocks]
    assert "sh" in languages and languages.count("python") == 1, f"the quickstart's blocks: {languages}"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for number, (language, code) in enumerate(blocks):
        if language == "sh":
            command = ["bash", "-euo", "pipefail", "-c", code]
        elif language == "python":
            script = tmp_path / f"quickstart_{number}.py"
            script.write_text(code)
            command = [sys.executable, script.name]
        else:
            pytest.fail(f"the quickstart has a ```{language} block; this test runs sh and python only")
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (
            f"the quickstart's block {number} ({language}) failed with exit code {result.returncode}:\n{code}\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
        if language == "python":
            assert result.stdout.strip(), "the quickstart's python block printed nothing"


def test_the_qwen2_vl_recipe_runs_on_the_demo_data(tmp_path: pathlib.Path) -> None:
    """docs/loading.md's Qwen2-VL GRPO recipe: its data and dataset blocks run as written, in an empty
    folder; its last block, training a hub model, is the example script's command line."""
    blocks = _blocks(_section((REPO / "docs" / "loading.md").read_text(), "Qwen2-VL GRPO recipe"))
    assert [language for language, _ in blocks] == ["sh", "python", "sh"]
    assert blocks[2][1].startswith("python examples/grpo_vqa.py Qwen/Qwen2-VL")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "recipe.py").write_text(blocks[1][1])
    for command in (["bash", "-euo", "pipefail", "-c", blocks[0][1]], [sys.executable, "recipe.py"]):
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.endswith(")") for line in lines[:3])
    sizes, originals = json.loads("[" + lines[3].replace("]] [[", "]], [[") + "]")
    assert all(h % 28 == 0 and w % 28 == 0 for h, w in sizes) and len(originals) == len(sizes) == 4


def test_the_sam_recipe_runs_as_written(tmp_path: pathlib.Path, sa1b_dataset: str) -> None:
    """docs/loading.md's SAM fine-tuning recipe, its blocks in order, verbatim, in a folder whose
    `.cache/demo/shards` is an SA-1B dataset packed as `make demo` packs one."""
    blocks = _blocks(_section((REPO / "docs" / "loading.md").read_text(), "SAM fine-tuning"))
    assert [language for language, _ in blocks] == ["python", "sh"]
    (tmp_path / ".cache" / "demo").mkdir(parents=True)
    (tmp_path / ".cache" / "demo" / "shards").symlink_to(sa1b_dataset)
    code = blocks[0][1] + "\nprint(*(tuple(batch[k].shape) for k in ('point_coords', 'prompt_boxes')))\n"
    (tmp_path / "recipe.py").write_text(code)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in ([sys.executable, "recipe.py"], ["bash", "-euo", "pipefail", "-c", blocks[1][1]]):
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        if command[0] == sys.executable:
            points, boxes = re.findall(r"\(([\d, ]+)\)", result.stdout)
            n = int(points.split(",")[1])
            assert points == f"4, {n}, 1, 2" and boxes == f"4, {n}, 4" and 0 < n <= 16
    with Image.open(tmp_path / "sam.png") as picture:
        picture.verify()


def test_readme_is_short_and_shows_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: keep it to 250, move the rest to docs/"
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_relative_links_lead_somewhere(page: pathlib.Path) -> None:
    """Every relative link names a file of the checkout, and its #anchor a heading of that file."""
    broken = []
    for target in _LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(linked, REPO)}")
    assert not broken, f"{os.path.relpath(page, REPO)}: " + "; ".join(broken)

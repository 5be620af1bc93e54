"""What users install: the wheel, built and installed the way docker/Dockerfile does it, into a fresh
virtualenv, then used from a folder outside the checkout.

The Dockerfile's own lines are replayed (its build context, its `pip wheel`, its `pip install` with
its extras, its CMD) with the image's paths mapped into a temporary folder; what needs a container
engine or root (the base image, `useradd`) is left out. The base image's torch is stood in for by
the torch this suite runs on.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest
import torch

from shard_tools.samples.sa1b import write_sa1b

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def dockerfile_steps(text: str) -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage ("build", "final"), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", text)
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            current = stages.setdefault("build" if " AS build" in line else "final", [])
        elif line and not line.startswith("#"):
            current.append(line)
    return stages


def _run(command: str | list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Replay the Dockerfile: its build context and `pip wheel` (build stage), then its `pip install`
    into a fresh venv (final stage). Returns the venv's environment and the wheel's path."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels, venv = tmp / "src", tmp / "wheels", tmp / "venv"
    _run([sys._base_executable, "-m", "venv", str(venv)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    # The base image's torch: the same release as this suite's (a local wheel here, not a download).
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"], env=env)

    text = (ROOT / "docker" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    paths = {"/wheels": str(wheels), "/src": str(src)}
    steps = dockerfile_steps(text)
    src.mkdir()
    for step in steps["build"]:
        word, _, rest = step.partition(" ")
        if word == "COPY":  # Docker's rules: a folder's contents go to the target, files into it
            *froms, to = rest.split()
            dest = pathlib.Path(_mapped(to, paths)) if to.startswith("/") else src / to
            for name in froms:
                origin = ROOT / name
                if origin.is_dir():
                    shutil.copytree(origin, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(origin, dest / origin.name if to.endswith("/") else dest)
        elif word == "RUN":
            _run(["bash", "-c", _mapped(rest, paths)], cwd=src, env=env)
    install = [s.partition(" ")[2] for s in steps["final"] if s.startswith("RUN ") and "pip install" in s]
    assert len(install) == 1, "the final stage installs the wheel in one RUN"
    _run(["bash", "-c", _mapped(install[0], paths)], cwd=tmp, env={**env, **args})
    cmd = [s for s in steps["final"] if s.startswith("CMD ")]
    return {"env": env, "venv": venv, "tmp": tmp, "cmd": json.loads(cmd[-1].removeprefix("CMD ")),
            "extras": re.search(r"shardstream\[([\w,]+)\]", install[0])[1].split(",")}


def _mapped(command: str, paths: dict[str, str]) -> str:
    for image_path, here in paths.items():
        command = re.sub(rf"(?<![\w/]){re.escape(image_path)}\b", here, command)
    return command


def test_wheel_holds_every_module(tmp_path: pathlib.Path):
    """The wheel built from a clean copy of the checkout (what git holds, no build leftovers) holds
    every module and data file of both packages."""
    files = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout.split()
    clean = tmp_path / "checkout"
    for name in files:
        if (ROOT / name).is_file():
            (clean / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, clean / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path),
          str(clean)], cwd=tmp_path)
    (wheel,) = tmp_path.glob("shardstream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(ROOT)) for package in ("pipeline", "shard_tools")
                for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert expected - names == set(), "the wheel leaves these out"
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "shard-pack = shard_tools.cli:main" in entry


def test_image_command_runs_from_the_installed_wheel(installed: dict):
    """The image's CMD, in the venv the Dockerfile's install made, from outside the checkout."""
    result = _run(installed["cmd"], cwd=installed["tmp"], env=installed["env"])
    assert "usage: shard-pack" in result.stdout and "sa1b" in result.stdout
    site = _run([str(installed["venv"] / "bin" / "python"), "-c", "import pipeline, shard_tools; "
                 "print(pipeline.__file__); print(shard_tools.__file__)"], cwd=installed["tmp"], env=installed["env"])
    for line in site.stdout.split():
        assert pathlib.Path(line).is_relative_to(installed["venv"]), f"imported from {line}, not the installed wheel"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(installed["extras"]) <= set(extras), "the Dockerfile names extras pyproject.toml does not have"


def test_installed_wheel_packs_and_streams(installed: dict):
    """From a folder outside the checkout: pack a few SA-1B samples with the installed `shard-pack`,
    verify them, and stream them with the installed `make_stream_loader`."""
    work = installed["tmp"] / "user"
    work.mkdir()
    write_sa1b(work / "sa1b", images=6, size=(64, 96), masks=(2, 6), images_per_archive=3, seed=3)
    env, bin_ = installed["env"], installed["venv"] / "bin"
    _run([str(bin_ / "shard-pack"), "-q", "sa1b", "sa1b", "shards", "--shard-samples", "2", "--workers", "2"],
         cwd=work, env=env)
    _run([str(bin_ / "shard-pack"), "verify", "shards"], cwd=work, env=env)
    script = textwrap.dedent("""
        from pipeline import make_stream_loader
        loader = make_stream_loader("shards", "train", batch_size=2, num_workers=2, image_size=64, mask_size=32,
                                    drop_last=False)
        keys = [key for batch in loader for key in batch["keys"]]
        print(len(keys), len(set(keys)), tuple(next(iter(loader))["images"].shape))
    """)
    result = _run([str(bin_ / "python"), "-c", script], cwd=work, env=env)
    assert result.stdout.split() == ["6", "6", "(2,", "3,", "64,", "64)"], result.stdout

"""The Dockerfile: linted with hadolint at error level, and the image policy checked (no Docker
engine exists on the build machines, so the image itself is not built here)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
HADOLINT = str(pathlib.Path(sys.executable).parent / "hadolint")


def _hadolint(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "error", str(path)], capture_output=True, text=True)


def policy_problems(text: str, version: str) -> list[str]:
    """Where a Dockerfile breaks the image policy."""
    problems = []
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    stages = re.findall(r"^FROM\s+(\S+)", text, re.M)
    for image in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), image)
        if not re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?", image):
            problems.append(f"base image {image!r} is not pinned to an exact tag")
    final = text[text.rfind("\nFROM ") :]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the final stage does not switch to a non-root USER")
    if re.search(r"^ADD\s+.*\b(https?|ftp)://", text, re.M | re.I):
        problems.append("ADD of a URL")
    if re.search(r"^(ENV|ARG)\s+\w*(SECRET|PASSWORD|TOKEN|ACCESS_KEY)\w*", text, re.M | re.I):
        problems.append("a secret in ENV or ARG")
    if args.get("SHARDSTREAM_VERSION") != version:
        problems.append(f"SHARDSTREAM_VERSION {args.get('SHARDSTREAM_VERSION')!r} is not the project's {version!r}")
    if not re.search(r"^CMD|^ENTRYPOINT", final, re.M):
        problems.append("no CMD or ENTRYPOINT")
    return problems


def _version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_hadolint_passes_at_error_level():
    result = _hadolint(ROOT / "docker" / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_errors(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:22.04\nWORKDIR relative/dir\nRUN sudo apt-get install -y curl\n")
    result = _hadolint(bad)
    assert result.returncode != 0 and "DL3000" in result.stdout and "DL3004" in result.stdout


def test_image_policy():
    assert policy_problems((ROOT / "docker" / "Dockerfile").read_text(), _version()) == []
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignored[0] == "*" and "!pipeline/" in ignored, "the build context holds only what the image needs"


def test_policy_check_catches_violations():
    bad = ("ARG SHARDSTREAM_VERSION=0.0.1\nFROM python:latest\nENV AWS_SECRET_ACCESS_KEY=abc\n"
           "ADD https://example.com/x.tar.gz /x\nUSER root\n")
    problems = " | ".join(policy_problems(bad, "0.1.0"))
    for text in ("not pinned", "non-root", "ADD of a URL", "secret", "SHARDSTREAM_VERSION", "CMD"):
        assert text in problems, text

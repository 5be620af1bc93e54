"""`--storage-options JSON` on every `shard-pack` subcommand that reads or writes by URL (the packers,
inspect, verify, upgrade, preview, tune, index), against the local S3-compatible server
(SeaweedFS on 127.0.0.1, explicit credentials), with no credentials or endpoint in the environment:
the options alone say where and who."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest
import s3fs

from shard_tools.cli import main
from shard_tools.samples.vqa import write_vqa
from conftest import new_bucket
from shard_tools.samples.locals3 import SECRET, SeaweedFS, storage_options

SMALL = ["--image-size", "32", "--mask-size", "8", "--max-masks", "2"]


@pytest.fixture(autouse=True)
def _no_credentials_in_the_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


def _upload(server: SeaweedFS, folder: str | pathlib.Path) -> str:
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    bucket = new_bucket(server)
    fs.put(str(folder) + "/", f"{bucket}/data/", recursive=True)
    return f"s3://{bucket}/data"


@pytest.fixture(scope="module")
def remote(server, sa1b_dataset) -> str:
    return _upload(server, sa1b_dataset)


def _options(server: SeaweedFS) -> list[str]:
    return ["--storage-options", json.dumps(storage_options(server.endpoint))]


def test_inspect_and_verify_read_s3_with_the_options_given(remote, server, capsys):
    assert main(["inspect", remote]) != 0, "no credentials or endpoint in the environment"
    capsys.readouterr()
    assert main(["inspect", remote, *_options(server)]) == 0
    assert "split train:" in capsys.readouterr().out
    assert main(["-q", "verify", remote, *_options(server)]) == 0
    assert capsys.readouterr().out.strip().endswith("verify: OK")


def test_options_from_a_file(remote, server, tmp_path, capsys):
    (tmp_path / "s3.json").write_text(json.dumps(storage_options(server.endpoint)))
    assert main(["inspect", remote, "--storage-options", f"@{tmp_path / 's3.json'}"]) == 0
    assert "split train:" in capsys.readouterr().out


def test_upgrade_on_s3_with_the_options_given(server, sa1b_dataset, tmp_path, capsys):
    from test_index import _downgrade

    old = tmp_path / "old"
    shutil.copytree(sa1b_dataset, old)
    _downgrade(old)
    url = _upload(server, old)
    assert main(["-q", "upgrade", url, *_options(server)]) == 0
    assert "upgraded from schema 2" in capsys.readouterr().out
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    for path in pathlib.Path(sa1b_dataset).iterdir():
        assert fs.cat_file(f"{url}/{path.name}".removeprefix("s3://")) == path.read_bytes(), path.name


def test_preview_and_tune_read_s3_with_the_options_given(remote, server, sa1b_dataset, tmp_path, capsys, monkeypatch):
    argv = ["preview", remote, "--split", "train", "-n", "4", "--out", str(tmp_path / "s3.png"), *SMALL]
    assert main([*argv, *_options(server)]) == 0
    assert main(["preview", sa1b_dataset, *argv[2:-len(SMALL) - 2], "--out", str(tmp_path / "local.png"), *SMALL]) == 0
    assert (tmp_path / "s3.png").read_bytes() == (tmp_path / "local.png").read_bytes()
    capsys.readouterr()
    argv = ["-q", "tune", remote, "--split", "train", "--batch-size", "2", "--workers", "0", "--batches", "2",
            "--warmup", "1", *SMALL]
    commands = []

    class Recorded(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            commands.append(list(args))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    assert main([*argv, *_options(server)]) == 0, "the measuring process reads s3 with the options too"
    assert "recommended: num_workers=0" in capsys.readouterr().out
    assert commands and not any(SECRET in " ".join(c) for c in commands), "credentials never on a command line"


def test_index_archives_on_s3_into_s3_with_the_options_given(server, sa1b_src, capsys):
    url = _upload(server, sa1b_src)
    assert main(["-q", "index", "sa1b", url, f"{url}-index", "--workers", "2", *_options(server)]) == 0
    said = capsys.readouterr().out
    assert "indexed" in said and f"--allow-root {url}" in said  # (the archives lie outside the dataset's folder)
    assert main(["-q", "verify", f"{url}-index", "--allow-root", url, *_options(server)]) == 0


@pytest.mark.parametrize("value, message", [
    ("[1]", "want a JSON object of fsspec options (name: value), e.g. '{\"anon\": true}', not an array"),
    ('"anon"', "not a string"),
    ("3", "not a number"),
    ('{"secret": "s3cr3t"', "not JSON (Expecting ',' delimiter at character 19)"),
    ("@/no/such/file.json", "cannot read '/no/such/file.json': No such file or directory"),
])
@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["upgrade"], ["preview", "--split", "t", "--out", "x.png"],
                                     ["tune", "--split", "t", "--batch-size", "1"], ["index", "sa1b", "src"]])
def test_storage_options_must_be_a_json_object(command, value, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "/d", "--storage-options", value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "argument --storage-options: " in err and message in err and "s3cr3t" not in err, err


def _files(fs: s3fs.S3FileSystem, url: str) -> dict[str, bytes]:
    base = url.removeprefix("s3://")
    return {p.removeprefix(base + "/"): fs.cat_file(p) for p in fs.find(base)}


def _members(tar: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return archive.getnames()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_packers_read_and_write_s3_with_the_options_given(server, sa1b_src, tmp_path, capsys, caplog, workers):
    """`shard-pack sa1b` and `vqa` read their inputs from s3 and write OUT there with the options alone
    (in their worker processes too): the shards hold what packing on local disk gives (SA-1B's the
    same bytes), and the options (credentials) are nowhere in what they wrote. Without them, a clear
    error, not a traceback."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    vqa = write_vqa(tmp_path / "vqa", "vqa-rad", {"train": 3}, per_image=(1, 2))
    src = {"sa1b": _upload(server, sa1b_src), "vqa": _upload(server, tmp_path / "vqa")}
    local = {"sa1b": [str(sa1b_src)], "vqa": ["--images", str(tmp_path / "vqa" / "images"), "--split",
                                              f"train={vqa['train']}"]}
    remote = {"sa1b": [src["sa1b"]], "vqa": ["--images", f"{src['vqa']}/images", "--split", f"train={src['vqa']}/train.json"]}
    for kind in ("sa1b", "vqa"):
        out, made = f"s3://{new_bucket(server)}/{kind}", tmp_path / f"{kind}-local"
        ins = (lambda a, o: [*a, o]) if kind == "sa1b" else (lambda a, o: [o, *a])
        assert main(["-q", kind, *ins(local[kind], str(made)), "--workers", workers]) == 0
        caplog.clear()
        assert main(["-q", kind, *ins(remote[kind], out), "--workers", workers]) == 2, "no credentials in the environment"
        assert "object storage: NoCredentialsError: Unable to locate credentials (its credentials and endpoint: " \
            "--storage-options, or the environment's AWS_*)" in caplog.text
        assert main(["-q", kind, *ins(remote[kind], out), "--workers", workers, *_options(server)]) == 0
        written, packed = _files(fs, out), {p.name: p.read_bytes() for p in made.iterdir() if p.is_file()}
        if kind == "sa1b":
            assert {n: d for n, d in written.items() if n.endswith((".tar", ".idx"))} == \
                {n: d for n, d in packed.items() if n.endswith((".tar", ".idx"))}
        else:  # (a VQA sample records the annotation file it came from: here a URL, there a path)
            assert {n: _members(d) for n, d in written.items() if n.endswith(".tar")} == \
                {n: _members(d) for n, d in packed.items() if n.endswith(".tar")}
        assert all(SECRET.encode() not in data for data in written.values())
    capsys.readouterr()


# `shard-pack` where s3fs cannot be imported: a ConfigError (exit 2) naming the extra, not a traceback.
_NO_S3FS = """
import sys
sys.modules["s3fs"] = sys.modules["aiobotocore"] = sys.modules["aiobotocore.session"] = None
from shard_tools.cli import main
sys.exit(main(["inspect", "s3://bucket/data"]))
"""


def test_a_missing_s3fs_is_a_clear_error():
    repo = str(pathlib.Path(__file__).resolve().parent.parent)
    run = subprocess.run([sys.executable, "-c", _NO_S3FS], cwd=repo, env={**os.environ, "PYTHONPATH": repo,
                                                                          "AWS_EC2_METADATA_DISABLED": "true"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "s3://bucket/data" in run.stderr and "install the package's s3 extra, or pip install 's3fs>=2023.1'" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr

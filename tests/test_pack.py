"""shard_tools.pack + sa1b source: determinism, resume, bad input, the CLI."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from pipeline.format import Manifest
from procs import alive, children
from shard_tools.cli import main
from shard_tools.pack import PackError, PackOptions, TooManySkipped, pack, parse_splits, split_of
from shard_tools.progress import Progress
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.sa1b import write_sa1b
from conftest import indexed, split_keys


def _files(folder: str | pathlib.Path) -> dict[str, bytes]:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _pack(src, out, **kw) -> object:
    options = PackOptions(**{"shard_samples": 3, "splits": (("train", 0.7), ("val", 0.3)), **kw})
    return pack(Sa1bSource(), [str(src)], str(out), options, progress=False)


def test_repeat_pack_is_byte_identical_whatever_workers(sa1b_src, sa1b_dataset, tmp_path):
    _pack(sa1b_src, tmp_path / "w2", workers=2)
    assert _files(tmp_path / "w2") == _files(sa1b_dataset)
    assert "manifest.json" in _files(sa1b_dataset) and not (tmp_path / "w2" / "_pack").exists()


def test_manifest_describes_the_shards(sa1b_dataset):
    manifest = Manifest.from_json((pathlib.Path(sa1b_dataset) / "manifest.json").read_bytes(), "m")
    assert manifest.kind == "sa1b" and set(manifest.splits) == {"train", "val"}
    keys = [k for split in manifest.splits for k in split_keys(sa1b_dataset, split)]
    assert sorted(keys) == sorted(f"sa_{i}" for i in range(1, 15))
    for split in manifest.splits:
        for shard, index in indexed(sa1b_dataset, split):
            data = (pathlib.Path(sa1b_dataset) / shard.name).read_bytes()
            assert len(data) == shard.bytes and 1 <= shard.samples == shard.units <= 3
            assert index.spans[1:, 0].tolist() == index.spans[:-1, 1].tolist(), "samples are adjacent"
            for i, key in enumerate(index.key_list()):
                (jpg, at, size), (ann, at2, _) = index.sample_members(i)
                assert (jpg, ann, at) == ("jpg", "msgpack", index.span(i)[0])
                assert data[at : at + 100].rstrip(b"\0") == f"{key}.jpg".encode()
                assert data[at + 512 : at + 514] == b"\xff\xd8" and at2 == at + 512 + size + (-size % 512)
            assert data[index.spans[-1, 1] :] == b"\0" * 1024


def test_splits_are_deterministic_by_key():
    splits = parse_splits("train=0.9,val=0.1")
    keys = [f"sa_{i}" for i in range(2000)]
    assigned = [split_of(k, splits) for k in keys]
    assert assigned == [split_of(k, splits) for k in keys]
    assert 0.07 < assigned.count("val") / len(keys) < 0.13
    with pytest.raises(ValueError, match="name=fraction"):
        parse_splits("train:1")
    with pytest.raises(ValueError, match="sum to 1"):
        PackOptions(splits=(("train", 0.5),))


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_pack_resumes_without_redoing_shards(sa1b_src, sa1b_dataset, tmp_path, workers):
    out = tmp_path / "out"
    finished: list[str] = []

    def interrupt(name: str) -> None:
        finished.append(name)
        if len(finished) == 2:
            raise KeyboardInterrupt

    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)), workers=workers)
    with pytest.raises(KeyboardInterrupt):
        pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False, on_shard=interrupt)
    assert not (out / "manifest.json").exists(), "no manifest lists an unfinished pack"
    done = {name: os.stat(out / name) for name in finished}
    (out / "train-000001.tar.partial-0123abcd").write_bytes(b"debris of a killed writer")

    summary = pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False)
    assert summary.reused >= 2
    for name, before in done.items():
        after = os.stat(out / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), f"{name} was rewritten"
    assert _files(out) == _files(sa1b_dataset)


def test_finished_pack_is_not_redone_and_other_inputs_are_refused(sa1b_src, sa1b_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(sa1b_dataset, out)
    assert _pack(sa1b_src, out).reused == 0
    assert _files(out) == _files(sa1b_dataset)
    shards = len(list(out.glob("*.tar")))
    assert main(["-q", "sa1b", str(sa1b_src), str(out), "--shard-samples", "3", "--split", "train=0.7,val=0.3"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"already complete: 14 samples in {shards} shards, ") and "nothing to do" in printed
    assert "samples/s" not in printed, "no rate: this run packed nothing"
    with pytest.raises(PackError, match="other inputs or options"):
        _pack(sa1b_src, out, shard_samples=4)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(PackError, match="not empty"):
        _pack(sa1b_src, tmp_path / "busy")


@pytest.fixture()
def bad_source(tmp_path) -> tuple[pathlib.Path, dict[str, str]]:
    """A folder of 12 pairs, 8 of them broken in each way the packer must catch; expected reasons."""
    src = tmp_path / "src"
    write_sa1b(src, images=12, size=(64, 96), masks=(2, 6), layout="folder", seed=5)

    def meta(key):
        return json.loads((src / f"{key}.json").read_text())

    (src / "sa_1.json").unlink()
    (src / "sa_2.jpg").unlink()
    (src / "sa_3.jpg").write_bytes((src / "sa_3.jpg").read_bytes()[:400])
    (src / "sa_4.jpg").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    (src / "sa_5.json").write_text('{"image": {"image_id": 5,')
    m = meta("sa_6")
    m["annotations"][0]["segmentation"]["size"] = [10, 10]
    (src / "sa_6.json").write_text(json.dumps(m))
    m = meta("sa_7")
    m["annotations"][1]["segmentation"]["counts"] = "0" + m["annotations"][1]["segmentation"]["counts"]
    (src / "sa_7.json").write_text(json.dumps(m))
    buffer = io.BytesIO()
    Image.new("RGB", (50, 40)).save(buffer, format="JPEG")
    (src / "sa_8.jpg").write_bytes(buffer.getvalue())  # a whole JPEG, but not the size its JSON states
    dup = tmp_path / "more"
    dup.mkdir()
    shutil.copy(src / "sa_9.jpg", dup / "sa_9.jpg")
    expected = {
        "sa_1": "no JSON", "sa_2": "no image", "sa_3": "truncated or corrupt JPEG", "sa_4": "not a JPEG",
        "sa_5": "invalid JSON", "sa_6": "disagrees with the image", "sa_7": "invalid RLE",
        "sa_8": "the JSON says", "sa_9": "duplicate key",
    }
    return tmp_path, expected


def test_bad_input_is_skipped_named_and_listed(bad_source, tmp_path):
    root, expected = bad_source
    out = tmp_path / "out"
    options = PackOptions(shard_samples=2, max_skipped=9)
    summary = pack(Sa1bSource(), [str(root / "src"), str(root / "more")], str(out), options, progress=False)
    manifest = Manifest.from_json((out / "manifest.json").read_bytes(), "m")
    reasons = {s["key"]: s["reason"] for s in manifest.skipped}
    assert set(reasons) == set(expected) and summary.skipped == 9
    for key, text in expected.items():
        assert text in reasons[key], reasons[key]
        assert f"{key}.jpg" in reasons[key] or f"{key}.json" in reasons[key], "names the file"
        assert repr(key) in reasons[key], "names the key"
    kept = split_keys(str(out))
    assert sorted(kept) == ["sa_10", "sa_11", "sa_12", "sa_9"], "the good samples all land (sa_9: first copy)"
    assert main(["verify", str(out)]) == 0


def test_too_many_skips_fail_without_manifest(bad_source, tmp_path, capsys):
    root, _ = bad_source
    out = tmp_path / "out"
    with pytest.raises(TooManySkipped, match="9 samples skipped"):
        pack(Sa1bSource(), [str(root / "src"), str(root / "more")], str(out), PackOptions(max_skipped=8), progress=False)
    assert not (out / "manifest.json").exists()
    assert main(["-q", "sa1b", str(root / "src"), str(root / "more"), str(out), "--max-skipped", "8"]) == 1
    assert main(["-q", "sa1b", str(root / "src"), str(root / "more"), str(out), "--max-skipped", "9"]) == 0
    assert "skipped 9" in capsys.readouterr().out


def test_cli_pack_inspect_verify(sa1b_src, sa1b_dataset, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["-q", "sa1b", *map(str, sorted(sa1b_src.glob("*.tar"))), str(out), "--shard-samples", "3",
            "--split", "train=0.7,val=0.3", "--workers", "2"]
    assert main(argv) == 0
    assert _files(out) == _files(sa1b_dataset), "archives given one by one pack the same as their folder"
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kind sa1b" in text and "split train:" in text and "split val:" in text
    assert main(["verify", str(out)]) == 0

    shards = sorted(out.glob("train-*.tar"))
    data = bytearray(shards[0].read_bytes())
    data[700] ^= 0xFF  # inside the first JPEG
    shards[0].write_bytes(bytes(data))
    shards[1].unlink()
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "SHA-256" in text and "shard is missing" in text and shards[1].name in text


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["sa1b", str(tmp_path / "nothing.tar"), str(tmp_path / "out")]) == 2
    assert main(["inspect", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        main(["sa1b", str(tmp_path), str(tmp_path / "o"), "--shard-bytes", "lots"])


def test_image_max_side_keeps_masks_consistent(sa1b_src, tmp_path):
    out = tmp_path / "small"
    options = PackOptions(shard_samples=100)
    pack(Sa1bSource(image_max_side=64), [str(sa1b_src)], str(out), options, progress=False)
    import tarfile

    with tarfile.open(next(out.glob("*.tar"))) as archive:
        member = next(m for m in archive if m.name.endswith(".jpg"))
        image = Image.open(io.BytesIO(archive.extractfile(member).read()))
    assert max(image.size) == 64
    assert main(["verify", str(out)]) == 0


@pytest.mark.parametrize("at", ["before", "after"])
def test_quiet_before_or_after_the_subcommand(sa1b_src, tmp_path, capsys, at):
    out = tmp_path / "out"
    args = ["sa1b", str(sa1b_src), str(out), "--workers", "1"]
    assert main(["-q", *args] if at == "before" else [*args, "-q"]) == 0
    assert main(["verify", "-q", str(out)]) == 0
    err = capsys.readouterr().err
    assert "it/s" not in err and "samples/s" not in err and "images/s" not in err


REPO = str(pathlib.Path(__file__).resolve().parent.parent)
_ENV = {**os.environ, "PYTHONPATH": REPO}
_CLI = [sys.executable, "-m", "shard_tools.cli", "-q", "sa1b"]
# The CLI with writes past 1,000 bytes refused (EFBIG, as a full disk refuses them with ENOSPC).
_CLI_SMALL_WRITES = [sys.executable, "-c", "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                     "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); from shard_tools.cli import main; "
                     "sys.exit(main(sys.argv[1:]))", "-q", "sa1b"]


def test_a_failed_manifest_write_is_a_clear_error_and_leaves_nothing_behind(sa1b_src, sa1b_dataset, tmp_path):
    out = tmp_path / "out"
    shards = len(list(pathlib.Path(sa1b_dataset).glob("*.tar")))
    finished = []

    def stop_before_the_manifest(name: str) -> None:
        finished.append(name)
        if len(finished) == shards:
            raise KeyboardInterrupt

    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)))
    with pytest.raises(KeyboardInterrupt):
        pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False, on_shard=stop_before_the_manifest)
    args = [str(sa1b_src), str(out), "--shard-samples", "3", "--split", "train=0.7,val=0.3", "--workers", "1"]
    run = subprocess.run(_CLI_SMALL_WRITES + args, cwd=REPO, env=_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr  # (not 1, which means the data has problems)
    assert "File too large" in run.stderr and "manifest.json" in run.stderr and "run the same command again" in run.stderr
    assert "Traceback" not in run.stderr
    assert not list(out.glob("manifest.json*")), "no manifest, and no temporary file of one"
    (out / "manifest.json.partial-0123abcd").write_bytes(b"debris of a run killed while writing it")
    run = subprocess.run(_CLI + args, cwd=REPO, env=_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert _files(out) == _files(sa1b_dataset)


def _start_and_kill(args: list[str], out: pathlib.Path, group: bool) -> set[int]:
    """Start a pack with 2 worker processes, SIGKILL it (with its whole process group) once a shard is
    written; its child processes as they were."""
    done = len(list(out.glob("*.tar"))) if out.exists() else 0
    child = subprocess.Popen(_CLI + args, cwd=REPO, env=_ENV, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        while (len(list(out.glob("*.tar"))) if out.exists() else 0) <= done:
            assert child.poll() is None, "the pack ended before it could be killed"
            time.sleep(0.01)
        found = children(child.pid)
    finally:
        os.killpg(child.pid, signal.SIGKILL) if group else child.kill()
        child.wait()
    return found


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc/self"), reason="Linux")
def test_a_killed_pack_leaves_no_worker_running_and_its_rerun_is_byte_identical(tmp_path):
    src, out, reference = tmp_path / "src", tmp_path / "out", tmp_path / "reference"
    write_sa1b(src, images=30, size=(160, 240), masks=(10, 30), layout="folder", seed=9)
    pack(Sa1bSource(), [str(src)], str(reference), PackOptions(shard_samples=1), progress=False)
    args = [str(src), str(out), "--shard-samples", "1", "--workers", "2"]

    workers = _start_and_kill(args, out, group=False)  # the packing process alone
    assert len(workers) >= 2
    deadline = time.monotonic() + 60
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers)), "pool workers outlived the packing process"

    _start_and_kill(args, out, group=True)  # workers and the multiprocessing resource tracker too
    run = subprocess.run(_CLI + args, cwd=REPO, env=_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert _files(out) == _files(reference)


def test_progress_off_a_terminal_is_a_line_per_interval_and_one_at_the_end(caplog):
    """On a clock the test moves: no line before `every` seconds, one when due (whatever the count),
    one at the end; each with the rate and ETA of the counts and seconds so far."""
    now = [100.0]
    bar = Progress(10, True, every=0.2, clock=lambda: now[0])
    now[0] += 0.1
    bar.update(3)  # (not due yet: 0.1 s)
    now[0] += 0.15
    bar.update(0)  # due (0.25 s): a line, whatever the count
    now[0] += 0.25
    bar.update(7)  # the end (0.5 s): its line
    now[0] += 0.05
    bar.update(0)  # (not due: 0.05 s after the last line)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("packed")]
    assert lines == ["packed 3/10 samples (12.0/s, ETA 1 s)",  # 3 in 0.25 s; 7 left at 12/s: 0.58 s
                     "packed 10/10 samples (20.0/s, ETA 0 s)"], lines  # 10 in 0.5 s

"""Bad input and Ctrl-C through `shard-pack`: packing or indexing nothing, a text file given as a
`.tar`, refused runs, interrupted runs. Each gets a clear message and its exit code, no traceback,
and leaves nothing behind but what a resume needs. And progress on a terminal, sample by sample."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import termios
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest

from pipeline.errors import InputError, PackError, TooManySkipped
from shard_tools.cli import COMMANDS, main
from shard_tools.pack import Interrupted, PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.sa1b import write_sa1b
from shard_tools.samples.vqa import write_vqa
from shard_tools.tune import TuneError
from procs import ctrl_c_as_at_a_terminal, interruptible, with_startup_code

REPO = str(pathlib.Path(__file__).resolve().parent.parent)
_ENV = {**os.environ, "PYTHONPATH": REPO}


def _tree(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture()
def jpgs_alone(tmp_path) -> pathlib.Path:
    """Three SA-1B JPEGs without their JSON files."""
    folder = tmp_path / "jpgs"
    write_sa1b(folder, images=3, size=(64, 96), masks=(2, 4), layout="folder", seed=3)
    for meta in folder.glob("*.json"):
        meta.unlink()
    return folder


def test_packing_nothing_is_a_data_error_that_writes_nothing(jpgs_alone, tmp_path, caplog):
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    vqa = write_vqa(tmp_path / "vqa", "vqa-rad", {"train": 2}, per_image=(1, 2))
    (tmp_path / "no-images").mkdir()
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "x.npy", np.zeros((0, 4), np.float32))
    (arrays / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    cases = {
        ("sa1b", str(empty)): f"{empty}: no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found no files",
        ("sa1b", str(jpgs_alone)): f"{jpgs_alone}: no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found 3 JPEGs "
                                   "without their JSON",
        ("vqa", "--images", str(tmp_path / "no-images"), "--split", f"train={vqa['train']}"):
            f"{vqa['train']}: no vqa samples to pack (2 inputs skipped; the first: synpic50000.png: image not found",
        ("embeddings", str(arrays)): "schema.json: the arrays have no rows",
    }
    for args, message in cases.items():
        caplog.clear()
        assert main(["-q", *args, str(out)]) == 1, args
        assert message in caplog.text, (args, caplog.text)
        assert not out.exists(), f"{args}: nothing written"
    assert _tree(empty) == [] and len(_tree(jpgs_alone)) == 3


def test_indexing_nothing_is_a_data_error_that_writes_nothing(tmp_path, caplog):
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    for kind in ("sa1b", "webdataset"):
        caplog.clear()
        assert main(["-q", "index", kind, str(empty), str(out)]) == 1
        assert f"{empty}: no .tar archives: nothing to index" in caplog.text
    with tarfile.open(empty / "notes.tar", "w") as archive:
        archive.add(__file__, "notes.txt")  # (neither .jpg nor .json: ignored)
    caplog.clear()
    assert main(["-q", "index", "sa1b", str(empty), str(out)]) == 1
    assert f"{empty / 'notes.tar'}: no sa1b samples: nothing to index" in caplog.text
    assert not out.exists() and _tree(empty) == ["notes.tar"]


def test_a_text_file_given_as_a_tar_or_as_json_is_a_data_error_naming_it(tmp_path, caplog):
    short, long = tmp_path / "short.tar", tmp_path / "long.tar"
    short.write_text("hello\n")
    long.write_text("not a tar, but long enough for a tar header\n" * 40)
    out = tmp_path / "out"
    for path in (short, long):
        for command in (["sa1b"], ["index", "sa1b"], ["index", "webdataset"]):
            caplog.clear()
            assert main(["-q", *command, str(path), str(out)]) == 1, (command, path)
            line = caplog.text
            assert f"{path}: not a tar archive" in line and "run the same command" not in line, (command, line)
            assert not out.exists()
    (tmp_path / "images").mkdir()
    caplog.clear()
    assert main(["-q", "vqa", str(out), "--images", str(tmp_path / "images"), "--split", f"train={short}"]) == 1
    assert f"{short}: not valid JSON" in caplog.text and not out.exists()


def test_a_refused_pack_leaves_nothing_behind(sa1b_src, tmp_path, caplog):
    src, busy = tmp_path / "src", tmp_path / "busy"
    shutil.copytree(sa1b_src, src)
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["-q", "sa1b", str(src), str(src)]) == 2  # OUT is the source folder
    assert main(["-q", "sa1b", str(src), str(busy)]) == 2
    assert "is not empty and holds no pack of these inputs" in caplog.text
    assert _tree(src) == _tree(sa1b_src) and _tree(busy) == ["notes.txt"], "no _pack/ left behind"


@dataclasses.dataclass(frozen=True)
class _Failing(Sa1bSource):
    """Raises `error` at its first sample: a run that ends before it finished a shard."""

    error: BaseException = OSError(28, "No space left on device")

    def encode(self, ref):
        raise self.error


def test_a_run_ended_before_its_first_shard_leaves_nothing_behind(sa1b_src, tmp_path):
    kept = tmp_path / "kept"  # an empty folder given as OUT: it stays
    kept.mkdir()
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        for out in (tmp_path / "new" / "out", kept):
            with pytest.raises(type(error)) as raised:
                pack(_Failing(error=error), [str(sa1b_src)], str(out), PackOptions(), progress=False)
            assert not (tmp_path / "new").exists(), "the folders the run made are removed"
            assert _tree(kept) == [], "a folder that was there stays, without what the run wrote"
        if isinstance(error, KeyboardInterrupt):
            assert isinstance(raised.value, Interrupted)
            assert str(raised.value) == "interrupted after 0 of 14 samples; run the same command to resume"


def test_a_refused_run_keeps_an_interrupted_packs_state(sa1b_src, sa1b_dataset, tmp_path):
    out = tmp_path / "out"
    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)))

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(Interrupted, match=r"^interrupted after 3 of 14 samples; run the same command to resume$"):
        pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False, on_shard=stop)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert any(p.parent.name == "_pack" and p.suffix == ".json" for p in before)
    assert main(["-q", "sa1b", str(sa1b_src), str(out)]) == 2, "other options: refused"
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, "the resumable state is kept"
    assert pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False).reused == 1


@pytest.mark.parametrize("error, code, line", [
    (TooManySkipped("too many"), 1, "shard-pack: too many"),
    (InputError("not valid JSON", url="in.json"), 1, "shard-pack: in.json: not valid JSON"),
    (PackError("busy"), 2, "shard-pack: busy"),
    (ValueError("bad flag"), 2, "shard-pack: bad flag"),
    (FileNotFoundError(2, "No such file or directory", "x"), 2, "shard-pack: [Errno 2] No such file or directory: 'x'"),
    (TuneError("measuring failed"), 3, "shard-pack: measuring failed"),
    (OSError(28, "No space left on device"), 3, "shard-pack: [Errno 28] No space left on device; the finished shards "
     "are kept: fix that, then run the same command again"),
    (BrokenProcessPool(), 3, "shard-pack: a packing worker process died (killed, or out of memory?); the finished "
     "shards are kept: fix that, then run the same command again"),
    (KeyboardInterrupt(), 130, "shard-pack: interrupted"),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None)
def test_each_error_class_has_its_exit_code_and_one_line(error, code, line, monkeypatch, caplog, tmp_path):
    def fail(args):
        raise error
    monkeypatch.setitem(COMMANDS, "inspect", dataclasses.replace(COMMANDS["inspect"], run=fail))
    assert main(["inspect", str(tmp_path)]) == code
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [line]


def test_an_error_no_entry_names_is_raised_as_it_is(monkeypatch, tmp_path):
    def fail(args):
        raise RuntimeError("a bug")
    monkeypatch.setitem(COMMANDS, "inspect", dataclasses.replace(COMMANDS["inspect"], run=fail))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["inspect", str(tmp_path)])


# -- Ctrl-C, as a terminal sends it, and progress on a terminal ---------------------------------

@pytest.fixture(scope="module")
def many(tmp_path_factory) -> pathlib.Path:
    """1,600 SA-1B pairs (8 pictures under 200 keys each, hard links): a pack that runs for seconds."""
    src = tmp_path_factory.mktemp("many")
    pictures = tmp_path_factory.mktemp("pictures")
    write_sa1b(pictures, images=8, size=(480, 720), masks=(30, 80), layout="folder", seed=9)
    for i in range(1600):
        for ext in ("jpg", "json"):
            os.link(pictures / f"sa_{i % 8 + 1}.{ext}", src / f"sa_{i + 1}.{ext}")
    return src


# Held in every process of the run (pool and Dask workers too): each shard but the first, and each
# archive but the first, until the run is stopped (the task's tick raises then). A Ctrl-C sent once
# the first is done finds the run with exactly that done, however fast the machine.
_HOLD_ALL_BUT_THE_FIRST = """
import importlib, time
index, pack = importlib.import_module("shard_tools.index"), importlib.import_module("shard_tools.pack")

write, scan = pack._write_shard, index._scan

def _until_stopped(tick):
    while True:  # (the run's stop, looked at through the task's own tick: it raises once the run is stopped)
        tick(0)
        time.sleep(0.01)

def held_shard(source, task, path, tick):
    if task.index:
        _until_stopped(tick)
    return write(source, task, path, tick)

def held_archive(kind, url, storage_options, check=None):
    if not url.endswith("/a0.tar"):
        _until_stopped(check)
    return scan(kind, url, storage_options, check)

pack._write_shard, index._scan = held_shard, held_archive
"""


def _interrupt(args: list[str], ready: Callable[[], bool], folder: pathlib.Path) -> subprocess.CompletedProcess:
    """Run `shard-pack args` in a process group of its own, each shard or archive but the first held
    until the run is stopped (`_HOLD_ALL_BUT_THE_FIRST`); send the group SIGINT once `ready()`."""
    env = with_startup_code(_ENV, folder, _HOLD_ALL_BUT_THE_FIRST)
    child = interruptible([sys.executable, "-m", "shard_tools.cli", *args], cwd=REPO, env=env,
                          start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ready():
            assert child.poll() is None, "the command ended before it could be interrupted"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_ctrl_c_during_a_pack_prints_one_line_exits_130_and_the_rerun_resumes_byte_identical(many, tmp_path):
    out, reference = tmp_path / "out", tmp_path / "reference"
    pack(Sa1bSource(), [str(many)], str(reference), PackOptions(shard_samples=100), progress=False)
    args = ["sa1b", str(many), str(out), "--shard-samples", "100", "--workers", "2"]

    run = _interrupt(args, lambda: any((out / "_pack").glob("*.json")), tmp_path / "startup")
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if "interrupted" in line]
    assert lines == ["shard-pack: interrupted after 100 of 1600 samples; run the same command to resume"], run.stderr
    assert [p.name for p in (out / "_pack").glob("*.json")] == ["train-000000.tar.json"], "the first shard's record"
    assert not list(out.glob("*.partial-*")), "the shards being written when stopped are removed"

    rerun = subprocess.run([sys.executable, "-m", "shard_tools.cli", "-q", *args], cwd=REPO, env=_ENV,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "(1 shards reused from an interrupted run)" in rerun.stdout
    assert _files(out) == _files(reference)


# Held in every process of the run: the last sample of each shard, until the file `go` exists.
_HOLD_EACH_SHARDS_LAST_SAMPLE = """
import importlib, os, time
pack = importlib.import_module("shard_tools.pack")

GO, write = {go!r}, pack._write_shard

class Held:
    def __init__(self, source, key):
        self.source, self.key = source, key

    def encode(self, ref):
        while ref.key == self.key and not os.path.exists(GO):
            time.sleep(0.01)
        return self.source.encode(ref)

def held(source, task, path, tick):
    return write(Held(source, task.refs[-1].key), task, path, tick)

pack._write_shard = held
"""


def _stderr_on_a_terminal(args: list[str], folder: pathlib.Path | None = None) -> str:
    """What `shard-pack args` writes to stderr when it is a terminal (a pseudo-terminal of 100 columns,
    tqdm showing every count it is given); with `folder`, the last sample of each shard held until the
    bar has shown a count that is not a whole number of shards (then `folder/go` lets them go)."""
    go = None if folder is None else folder / "go"
    held = _ENV if go is None else with_startup_code(_ENV, folder, _HOLD_EACH_SHARDS_LAST_SAMPLE.format(go=str(go)))
    env = {**held, "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen([sys.executable, "-m", "shard_tools.cli", *args], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 120  # (a bound on the wait for the count, not a measure)
    try:
        with contextlib.suppress(OSError):  # (EIO once the child has closed the terminal)
            while (go is not None and go.exists()) or \
                    select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if not (data := os.read(master, 1 << 16)):
                    break
                chunks.append(data)
                if go is not None and not go.exists() and \
                        any(int(n) % 800 for n in re.findall(rb" (\d+)/1600 ", b"".join(chunks))):
                    go.touch()
        assert go is None or go.exists(), \
            "no count inside a shard while each shard's last sample was held: " + repr(b"".join(chunks))
        assert child.wait(timeout=300) == 0
    finally:
        os.close(master)
        if child.poll() is None:
            child.kill()
            child.wait()
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_on_a_terminal_counts_samples_as_they_are_written(many, tmp_path, workers):
    """While each shard's last sample is held, the bar shows the samples written so far: counts
    inside a shard (the bar moved by each sample, not once per shard); at the end, all of them."""
    shown = _stderr_on_a_terminal(["sa1b", str(many), str(tmp_path / "out"), "--shard-samples", "800",
                                   "--workers", str(workers)], tmp_path / "startup")
    counts = [int(n) for n in re.findall(r" (\d+)/1600 ", shown)]
    assert (tmp_path / "startup" / "go").exists(), "let go: the bar showed a count inside a shard"
    assert counts[-1] == 1600 and counts == sorted(counts), shown


@pytest.mark.parametrize("where", [["--workers", "2"], ["--dask", "local:2"]], ids=["pool", "dask"])
def test_ctrl_c_during_an_index_run_prints_one_line_exits_130_and_leaves_nothing(tmp_path, where):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(8):  # big but sparse: the scan hashes 256 MiB of each, the disk holds next to nothing
        info = tarfile.TarInfo(f"s{i}.bin")
        info.size = 256 << 20
        with open(src / f"a{i}.tar", "wb") as f:
            f.write(info.tobuf(format=tarfile.USTAR_FORMAT))
            f.truncate(512 + info.size + 1024)

    run = _interrupt(["index", "webdataset", str(src), str(out), *where], lambda: any(out.glob("*.idx")),
                     tmp_path / "startup")
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if "interrupted" in line]
    assert lines == ["shard-pack: interrupted after 1 of 8 archives; the index files of this run are removed: run the "
                     "same command to start again"], run.stderr
    assert [line for line in run.stderr.splitlines() if not line.startswith("indexed ")] == lines, "nothing else"
    assert not out.exists()


@pytest.fixture()
def at_a_terminal():
    """Ctrl-C handled in this process as in a run started at a terminal (Python's own handler), however
    the test run was started (`nohup make test &` ignores it): what the tests of Ctrl-C below mean."""
    with ctrl_c_as_at_a_terminal():
        yield


def test_ctrl_c_inside_distributed_calls_is_noted_and_raised_between_them(at_a_terminal):
    """dask_tasks takes Ctrl-C between distributed's calls: one raised inside `distributed.utils.sync`
    made it log a NameError traceback of its own (seen in CI, 1 run in ~10)."""
    from shard_tools.runners import _ctrl_c_noted

    inside = False
    with pytest.raises(KeyboardInterrupt), _ctrl_c_noted() as pressed:
        os.kill(os.getpid(), signal.SIGINT)  # (Python runs its handler at the next call: `wait`)
        assert pressed.wait(10), "noted"
        inside = True
    assert inside, "noted inside, raised only on leaving"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_processes_spawned_while_ctrl_c_is_ignored_ignore_it_from_their_start(at_a_terminal):
    """A worker (pool or local Dask cluster) spends its first second importing torch: a Ctrl-C then
    killed it ("Nanny failed to start") unless it was born ignoring it."""
    from shard_tools.runners import _ctrl_c_ignored

    def sigint_ignored(child: subprocess.Popen) -> bool:
        status = pathlib.Path(f"/proc/{child.pid}/status").read_text()
        return bool(int(re.search(r"SigIgn:\s*([0-9a-f]+)", status).group(1), 16) & (1 << (signal.SIGINT - 1)))

    with _ctrl_c_ignored():
        inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # (Popen returns once the child has exec'd: its dispositions are set)
        assert sigint_ignored(inside) and not sigint_ignored(outside)
    finally:
        inside.kill(), outside.kill()
        inside.wait(), outside.wait()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

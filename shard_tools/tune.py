"""`shard-pack tune`: measure a dataset's loader on this machine across `num_workers`,
`prefetch_factor` and `read_ahead`, and recommend settings.

Each setting runs in a subprocess of its own (`python -m shard_tools.tune`, its spec as JSON on
stdin: never on a command line, where other users can read it, since `storage_options` may hold
credentials), so its memory and CPU are its own. The child makes the loader, reads `warmup` batches, then times up to
`batches` batches (or `seconds`) in windows and reports one JSON line. It reports:
- samples/s: the median of the windows' rates;
- CPU per sample: over the timed batches, for the child and its DataLoader workers together;
- first batch: seconds from making the loader to its first batch (workers' start included).
The parent samples peak memory of the child's process tree every 0.1 s: the sum of each
process's PSS (resident memory, a page shared by n processes counted 1/n), so shared-memory
batches and mapped shards count once. Linux's /proc gives the tree's figures; elsewhere memory
is not reported and CPU counts only the child itself.

Recommendation: among the settings within 95% of the best throughput, the one with the least
peak memory (then the least CPU per sample, then the fewest workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from pipeline import make_stream_loader
from pipeline.errors import ConfigError
from shard_tools.progress import Progress
from shard_tools.preview import mask_colours

__all__ = ["Setting", "Row", "TuneResult", "TuneError", "default_workers", "recommend", "tune", "plot", "WITHIN"]

log = logging.getLogger("shard-pack")
WITHIN = 0.95  # a setting this close to the best throughput is as good; the least memory wins among them
_SAMPLE_EVERY = 0.1


class TuneError(RuntimeError):
    """A measuring subprocess failed (its stderr's last lines are in the message)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One loader setting the sweep measures."""

    num_workers: int
    prefetch_factor: int = 2
    read_ahead: int = 1

    def __str__(self) -> str:
        text = f"num_workers={self.num_workers}"
        if self.num_workers:
            text += f", prefetch_factor={self.prefetch_factor}"
        return text + (f", read_ahead={self.read_ahead}" if self.read_ahead != 1 else "")


@dataclasses.dataclass(frozen=True)
class Row:
    """What one setting measured. `peak_mb` is None where /proc cannot tell."""

    setting: Setting
    samples_per_s: float
    cpu_ms_per_sample: float
    peak_mb: float | None
    first_batch_s: float
    samples: int  # timed samples (questions for VQA per question, rows for embeddings)


@dataclasses.dataclass(frozen=True)
class TuneResult:
    rows: tuple[Row, ...]
    best: Row
    recommended: Row

    def lines(self) -> list[str]:
        """The table, one row per setting, and the recommendation."""
        out = [f"{'workers':>7} {'prefetch':>8} {'read_ahead':>10} {'samples/s':>10} {'CPU ms/sample':>13} "
               f"{'peak MB (tree PSS)':>18} {'first batch s':>13}"]
        for r in self.rows:
            s = r.setting
            peak = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
            out.append(f"{s.num_workers:>7} {s.prefetch_factor if s.num_workers else '-':>8} {s.read_ahead:>10} "
                       f"{r.samples_per_s:>10.1f} {r.cpu_ms_per_sample:>13.1f} {peak:>18} {r.first_batch_s:>13.2f}")
        return out + [self.recommendation()]

    def recommendation(self) -> str:
        rec, best = self.recommended, self.best
        if rec is best:
            return f"recommended: {rec.setting}: the best throughput ({rec.samples_per_s:.1f} samples/s)"
        memory = cpu = ""
        if rec.peak_mb is not None and best.peak_mb:
            memory = f" at {rec.peak_mb / best.peak_mb:.0%} of its memory"
        if best.cpu_ms_per_sample:
            cpu = f", {rec.cpu_ms_per_sample / best.cpu_ms_per_sample:.0%} of its CPU per sample"
        return (f"recommended: {rec.setting}: {rec.samples_per_s / best.samples_per_s:.0%} of the best throughput "
                f"({best.setting}){memory}{cpu}")

    def to_json(self) -> dict[str, Any]:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "best": dataclasses.asdict(self.best.setting),
                "recommended": dataclasses.asdict(self.recommended.setting), "recommendation": self.recommendation()}


def default_workers(cores: int | None = None) -> tuple[int, ...]:
    """0, 1, 2, 4, 8 ... up to the cores (and the cores themselves), at most 32."""
    cores = min(cores or os.cpu_count() or 1, 32)
    values, w = [0, 1], 2
    while w < cores:
        values.append(w)
        w *= 2
    return tuple(sorted(set(values + [cores])))


def recommend(rows: Sequence[Row], within: float = WITHIN) -> Row:
    """The setting of least peak memory (then CPU per sample, then workers) among those with at
    least `within` of the best throughput."""
    best = max(rows, key=lambda r: r.samples_per_s)
    good = [r for r in rows if r.samples_per_s >= within * best.samples_per_s]
    return min(good, key=lambda r: (r.peak_mb if r.peak_mb is not None else 0.0, r.cpu_ms_per_sample,
                                    r.setting.num_workers, r.setting.prefetch_factor, r.setting.read_ahead))


def tune(
    source: str,
    split: str,
    *,
    batch_size: int,
    workers: Sequence[int] | None = None,
    prefetch_factors: Sequence[int] = (2,),
    read_aheads: Sequence[int] = (1,),
    batches: int = 20,
    warmup: int = 3,
    seconds: float = 15.0,
    device: str | None = None,
    options: dict[str, Any] | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    allowed_roots: Sequence[str] = (),
) -> TuneResult:
    """Measure every setting (`workers` x `prefetch_factors` x `read_aheads`; prefetch only with
    workers) on `split` of `source` with the kind's `options`, and recommend one (see the module).
    `storage_options` and `allowed_roots` as `make_stream_loader`'s (fsspec's options, e.g. an s3
    endpoint and credentials; places outside the folder its manifest may name).
    Raises ValueError for bad arguments (checked by making a loader here first)."""
    workers = default_workers() if workers is None else tuple(workers)
    for name, values, low in (("workers", workers, 0), ("prefetch_factors", prefetch_factors, 1),
                              ("read_aheads", read_aheads, 1)):
        if not values or any(type(v) is not int or v < low for v in values):
            raise ConfigError(f"{name} must be ints >= {low}, got {list(values)!r}")
    if batches < 1 or warmup < 1 or seconds <= 0:
        raise ConfigError(f"batches and warmup must be >= 1 and seconds > 0, got {batches}, {warmup}, {seconds}")
    options = dict(options or {})
    make_stream_loader(source, split, batch_size=batch_size, num_workers=0, storage_options=storage_options,
                       allowed_roots=allowed_roots, **options)  # refuses what it cannot do
    settings = list(dict.fromkeys(Setting(w, p if w else 2, r) for w in workers for p in prefetch_factors
                                  for r in read_aheads))
    spec = dict(source=source, split=split, batch_size=batch_size, batches=batches, warmup=warmup, seconds=seconds,
                device=device, options=options, storage_options=storage_options, allowed_roots=list(allowed_roots))
    bar = Progress(len(settings) * (warmup + batches), progress, unit="batch", what="tune: %d/%d batches")
    try:
        rows = []
        for setting in settings:
            rows.append(_measure({**spec, **dataclasses.asdict(setting)}, setting, bar))
            if bar.done < bar.total * len(rows) // len(settings):  # a setting cut short by `seconds`
                bar.update(bar.total * len(rows) // len(settings) - bar.done)
    finally:
        bar.close()
    return TuneResult(tuple(rows), max(rows, key=lambda r: r.samples_per_s), recommend(rows))


def plot(result: TuneResult, width: int = 480, height: int = 320) -> Image.Image:
    """Two charts side by side, samples/s and CPU ms per sample against num_workers, a line per
    (prefetch_factor, read_ahead); the recommended setting ringed."""
    image = Image.new("RGB", (2 * width, height), "white")
    draw, font = ImageDraw.Draw(image), ImageFont.load_default()
    lines: dict[tuple[int, int], list[Row]] = {}
    for r in sorted(result.rows, key=lambda r: r.setting.num_workers):
        lines.setdefault((r.setting.prefetch_factor, r.setting.read_ahead), []).append(r)
    workers = sorted({r.setting.num_workers for r in result.rows})
    for panel, (title, value) in enumerate((("samples/s", lambda r: r.samples_per_s),
                                            ("CPU ms per sample", lambda r: r.cpu_ms_per_sample))):
        left, top, right, bottom = panel * width + 50, 30 + 14 * len(lines), panel * width + width - 20, height - 30
        top_value = max(value(r) for r in result.rows) * 1.1 or 1.0
        def at(w: int, v: float) -> tuple[float, float]:
            x = left + (right - left) * (workers.index(w) + 0.5) / len(workers)
            return x, bottom - (bottom - top) * v / top_value
        draw.line([(left, top), (left, bottom), (right, bottom)], fill="black")
        draw.text((left, 8), f"{title} against num_workers", fill="black", font=font)
        for w in workers:
            draw.text((at(w, 0)[0] - 3, bottom + 6), str(w), fill="black", font=font)
        for k in range(5):
            v = top_value * k / 4
            draw.text((panel * width + 4, at(workers[0], v)[1] - 6), f"{v:.3g}", fill="black", font=font)
        for n, ((prefetch, read_ahead), rows) in enumerate(lines.items()):
            colour = mask_colours(len(lines))[n]
            points = [at(r.setting.num_workers, value(r)) for r in rows]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for x, y in points:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
            draw.text((left + 10, 24 + 14 * n), f"prefetch {prefetch}, read_ahead {read_ahead}", fill=colour, font=font)
        x, y = at(result.recommended.setting.num_workers, value(result.recommended))
        draw.ellipse([x - 7, y - 7, x + 7, y + 7], outline="black", width=2)
    return image


def _measure(spec: dict[str, Any], setting: Setting, bar: Progress) -> Row:
    """Run one setting in a child process, sampling its tree's memory while it runs."""
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen([sys.executable, "-m", "shard_tools.tune"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=errors, text=True)
        assert child.stdin is not None and child.stdout is not None
        with child.stdin, contextlib.suppress(BrokenPipeError):  # (a child that died at once: told below)
            child.stdin.write(json.dumps(spec))
        peak, done = [None], threading.Event()
        sampler = threading.Thread(target=_sample_memory, args=(child.pid, peak, done), daemon=True)
        sampler.start()
        last = ""
        for line in child.stdout:
            if line == "batch\n":
                bar.update(1)
            else:
                last = line
        done.set()
        sampler.join()
        if child.wait() != 0 or not last:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-8:]
            raise TuneError(f"measuring {setting} failed (exit {child.returncode}):\n  " + "\n  ".join(tail))
    got = json.loads(last)
    return Row(setting, got["samples_per_s"], got["cpu_ms_per_sample"], peak[0], got["first_batch_s"], got["samples"])


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants, from /proc (just `pid` where /proc cannot tell)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass  # exited meanwhile, or no /proc
    return found


def _pss_mb(pid: int) -> float:
    """A process's PSS (resident memory, shared pages divided among their sharers), in MiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _sample_memory(pid: int, peak: list[float | None], done: threading.Event) -> None:
    while not done.wait(_SAMPLE_EVERY):
        total = 0.0
        for p in _tree(pid):
            try:
                total += _pss_mb(p)
            except (OSError, ValueError):
                if p == pid:  # no /proc, or the child has exited
                    return
        peak[0] = max(peak[0] or 0.0, total)


def _tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (their own
    figures plus their reaped children's)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    tick = os.sysconf("SC_CLK_TCK")
    for p in _tree(os.getpid())[1:]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass  # exited meanwhile: then its time is among its parent's reaped children
    return total


def _batches(loader: Any) -> Iterator[Any]:
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one setting in this process (see the module); prints a line per batch for the bar."""
    started = time.perf_counter()
    loader = make_stream_loader(spec["source"], spec["split"], batch_size=spec["batch_size"],
                                num_workers=spec["num_workers"], prefetch_factor=spec["prefetch_factor"],
                                read_ahead=spec["read_ahead"], device=spec["device"], seed=0,
                                storage_options=spec["storage_options"], allowed_roots=spec["allowed_roots"],
                                **spec["options"])
    warmup, window = spec["warmup"], max(1, spec["batches"] // 5)
    first = mark = deadline = cpu = None
    rates: list[float] = []
    for count, _ in enumerate(_batches(loader), 1):
        now = time.perf_counter()
        print("batch", flush=True)
        first = now - started if first is None else first
        if count == warmup:
            mark, deadline, cpu = now, now + spec["seconds"], (_tree_cpu(),) * 2
        elif count > warmup and (count - warmup) % window == 0:
            rates.append(window * spec["batch_size"] / (now - mark))
            mark, cpu = now, (cpu[0], _tree_cpu())
            if count - warmup >= spec["batches"] or now > deadline:
                break
    timed = len(rates) * window * spec["batch_size"]
    return {"samples_per_s": statistics.median(rates), "cpu_ms_per_sample": (cpu[1] - cpu[0]) * 1000 / timed,
            "first_batch_s": first, "samples": timed}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.read()))), flush=True)

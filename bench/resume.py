"""Resume cost: seconds from resuming mid-epoch to the first batch, at 10% and at 90% of an epoch,
beside a fresh epoch start measured in the same run.

    python bench/resume.py [--rows 102400] [--batch-size 64] [--repeats 15] [--json PATH]   (or: make bench-resume)

Data (cached in .cache/bench-resume/): an embeddings split of `--rows` rows of 4 float32 (a sample
is a row), packed by `pack_embeddings` in blocks of `--rows-per-block` rows, `--shard-blocks`
blocks a shard; seed 0, batches of `--batch-size`, 2 DataLoader workers.
(a) HF Trainer: `trainer_dataset` + `Trainer(..., callbacks=[resume_callback(ds)])`, a model of one
    scalar parameter; `trainer.train(resume_from_checkpoint=ckpt)` to the model's first forward.
(b) Lightning: `make_stream_loader` under `lightning.pytorch.Trainer` (cpu);
    `fit(model, loader, ckpt_path=ckpt)` to the first `training_step`.
(c) the loader alone: `make_stream_loader`, `load_state_dict(state)` to its first batch.
Checkpoints are real: each way trains (or iterates) to the step once, saves as its users do
(HF's `save_steps`, Lightning's `trainer.save_checkpoint` at the step's end, `loader.state_dict()`),
and every timed resume starts from them. The reference is the same way's fresh start (no
checkpoint). Every timed run's first batch is checked against the uninterrupted epoch's batch at
that step (a resume that silently restarted the epoch would look fast). Each way runs in its own
subprocess, cases interleaved over the repeats (after one untimed run of each); figures are
medians, with the fastest run beside them (other work on the machine only adds time). Target:
resuming at 90% within 1.2x of resuming at 10%. Compare figures as ratios within one run, never
across machines.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-resume"
WAYS = {"hf": "HF Trainer + resume_callback", "lightning": "Lightning + make_stream_loader",
        "loader": "make_stream_loader alone"}
TARGET = 1.2  # resuming at the last position over resuming at the first, at most
SEED = 0


def prepare(rows: int, rows_per_block: int, shard_blocks: int) -> pathlib.Path:
    """The packed split (cached): `rows` rows of 4 float32, row i holding 4i..4i+3."""
    from shard_tools.embeddings import pack_embeddings
    from shard_tools.pack import PackOptions

    data = CACHE / f"{rows}-{rows_per_block}-{shard_blocks}"
    if (data / "shards" / "manifest.json").exists():
        return data / "shards"
    print(f"packing {rows:,} rows of 4 float32 in blocks of {rows_per_block} (cached in {data}) ...", file=sys.stderr,
          flush=True)
    src = data / "src"
    src.mkdir(parents=True, exist_ok=True)
    np.save(src / "x.npy", np.arange(rows * 4, dtype=np.float32).reshape(rows, 4))
    (src / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    pack_embeddings(str(src), str(data / "shards"), rows_per_block=rows_per_block,
                    options=PackOptions(splits=None, shard_samples=shard_blocks), progress=False)
    return data / "shards"


# -- in a child process: one way's checkpoints and timed runs ---------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _settle() -> None:
    """Let the last run's DataLoader workers go before the next run starts."""
    gc.collect()
    time.sleep(0.2)


class HfWay:
    """HF Trainer over `trainer_dataset` with `resume_callback`."""

    def __init__(self, root: str, batch_size: int, workers: int, work: pathlib.Path) -> None:
        import torch
        import transformers

        from pipeline import resume_callback, trainer_dataset

        self.root, self.batch_size, self.workers, self.work = root, batch_size, workers, work
        self.torch, self.Trainer, self.Args = torch, transformers.Trainer, transformers.TrainingArguments
        self.Printer = transformers.PrinterCallback
        self.trainer_dataset, self.resume_callback = trainer_dataset, resume_callback

        class Stop(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = True

        self.Stop = Stop

    def _model(self) -> Any:
        torch = self.torch

        class Probe(torch.nn.Module):
            """One scalar parameter; notes when its first forward begins, and that batch's rows."""

            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(()))
                self.first: float | None = None
                self.rows: list[int] = []

            def forward(self, row: Any) -> dict[str, Any]:
                if self.first is None:
                    self.first = time.perf_counter()
                    self.rows = row.tolist()
                return {"loss": (self.weight - 1) ** 2}

        return Probe()

    def _collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return {"row": self.torch.stack([s["row"] for s in samples])}

    def _trainer(self, out: pathlib.Path, model: Any, *, stop: int | None, first_only: bool) -> Any:
        args = self.Args(output_dir=str(out), per_device_train_batch_size=self.batch_size, num_train_epochs=1,
                         max_steps=stop or -1, save_strategy="steps" if stop else "no", save_steps=stop or 500,
                         dataloader_num_workers=self.workers, remove_unused_columns=False, use_cpu=True,
                         report_to="none", logging_steps=10**9, disable_tqdm=True, seed=SEED)
        ds = self.trainer_dataset(self.root, "train", batch_size=self.batch_size, seed=SEED)
        callbacks = [self.resume_callback(ds)] + ([self.Stop()] if first_only else [])
        trainer = self.Trainer(model=model, args=args, train_dataset=ds, data_collator=self._collate,
                               callbacks=callbacks)
        trainer.remove_callback(self.Printer)
        return trainer

    def checkpoint(self, step: int) -> str:
        out = self.work / f"hf-{step}"
        self._trainer(out, self._model(), stop=step, first_only=False).train()
        state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
        if "shardstream" not in state.get("stateful_callbacks", {}):
            raise RuntimeError(f"the checkpoint at step {step} has no stateful_callbacks['shardstream'] record")
        return str(out / f"checkpoint-{step}")

    def first(self, checkpoint: str | None) -> tuple[float, list[int]]:
        model = self._model()
        trainer = self._trainer(self.work / "hf-runs", model, stop=None, first_only=True)
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=checkpoint)
        assert model.first is not None, "the model never ran"
        return model.first - start, model.rows


class LightningWay:
    """Lightning's Trainer over `make_stream_loader`."""

    def __init__(self, root: str, batch_size: int, workers: int, work: pathlib.Path) -> None:
        import lightning.pytorch as pl
        import torch

        from pipeline import make_stream_loader

        self.root, self.batch_size, self.workers, self.work = root, batch_size, workers, work
        self.pl, self.make = pl, make_stream_loader

        class Probe(pl.LightningModule):
            """One scalar parameter; notes when its first training_step begins, and that batch's rows;
            stops after `stop` steps (saving a checkpoint at `save`), or after the first."""

            def __init__(self, save: str | None = None, stop: int = 1) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(()))
                self.first: float | None = None
                self.rows: list[int] = []
                self.save, self.stop = save, stop

            def training_step(self, batch: dict[str, Any], index: int) -> Any:
                if self.first is None:
                    self.first = time.perf_counter()
                    self.rows = batch["row"].tolist()
                return (self.weight - 1) ** 2

            def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
                if self.trainer.global_step >= self.stop:
                    if self.save:
                        self.trainer.save_checkpoint(self.save)
                    self.trainer.should_stop = True

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        self.Probe = Probe

    def _run(self, model: Any, checkpoint: str | None) -> float:
        """`fit`, from a fresh Trainer and loader: when it was called."""
        trainer = self.pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False)
        loader = self.make(self.root, "train", batch_size=self.batch_size, num_workers=self.workers, seed=SEED)
        start = time.perf_counter()
        try:
            trainer.fit(model, loader, ckpt_path=checkpoint)
        finally:
            loader.close()  # (its persistent workers: Lightning drops the loader, the collector would wait 5 s a worker)
        return start

    def checkpoint(self, step: int) -> str:
        path = str(self.work / f"lightning-{step}.ckpt")
        self._run(self.Probe(save=path, stop=step), None)
        return path

    def first(self, checkpoint: str | None) -> tuple[float, list[int]]:
        model = self.Probe()
        start = self._run(model, checkpoint)
        assert model.first is not None, "training_step never ran"
        return model.first - start, model.rows


class LoaderWay:
    """`make_stream_loader`'s own `state_dict()` / `load_state_dict()`."""

    def __init__(self, root: str, batch_size: int, workers: int, work: pathlib.Path) -> None:
        from pipeline import make_stream_loader

        self.root, self.batch_size, self.workers, self.work = root, batch_size, workers, work
        self.make = make_stream_loader

    def _loader(self) -> Any:
        return self.make(self.root, "train", batch_size=self.batch_size, num_workers=self.workers, seed=SEED)

    def checkpoint(self, step: int) -> str:
        loader = self._loader()
        batches = iter(loader)
        for _ in range(step):
            next(batches)
        path = self.work / f"loader-{step}.json"
        path.write_text(json.dumps(loader.state_dict()))
        return str(path)

    def first(self, checkpoint: str | None) -> tuple[float, list[int]]:
        loader = self._loader()
        state = json.loads(pathlib.Path(checkpoint).read_text()) if checkpoint else None
        start = time.perf_counter()
        if state is not None:
            loader.load_state_dict(state)
        batch = next(iter(loader))
        return time.perf_counter() - start, batch["row"].tolist()


def _uninterrupted(root: str, batch_size: int, workers: int, steps: list[int]) -> dict[int, list[int]]:
    """The rows of the uninterrupted epoch's batches at these steps (0-based batch numbers)."""
    from pipeline import make_stream_loader

    wanted, out = set(steps), {}
    loader = make_stream_loader(root, "train", batch_size=batch_size, num_workers=workers, seed=SEED)
    for i, batch in enumerate(loader):
        if i in wanted:
            out[i] = batch["row"].tolist()
    return out


def run_way(way: str, root: str, args: argparse.Namespace) -> dict[str, Any]:
    """One way's checkpoints at each position, then its timed runs (fresh and resumed), interleaved."""
    _quiet()
    from pipeline import make_stream_loader

    batches = len(make_stream_loader(root, "train", batch_size=args.batch_size, num_workers=0, seed=SEED))
    steps = {p: max(1, round(p * batches)) for p in args.positions}
    expected = _uninterrupted(root, args.batch_size, args.workers, [0, *steps.values()])
    with tempfile.TemporaryDirectory(prefix=f"shardstream-bench-resume-{way}-") as tmp:
        cls = {"hf": HfWay, "lightning": LightningWay, "loader": LoaderWay}[way]
        runner = cls(root, args.batch_size, args.workers, pathlib.Path(tmp))
        checkpoints, made = {}, {}
        for p, step in steps.items():
            start = time.perf_counter()
            checkpoints[p] = runner.checkpoint(step)
            made[p] = time.perf_counter() - start
            _settle()
        cases: list[float | None] = [None, *args.positions]  # None: a fresh start
        seconds: dict[float | None, list[float]] = {c: [] for c in cases}
        for r in range(args.repeats + 1):  # round 0: untimed (imports, caches)
            for case in cases[r % len(cases):] + cases[: r % len(cases)]:
                took, rows = runner.first(None if case is None else checkpoints[case])
                want = expected[0 if case is None else steps[case]]
                if rows != want:
                    raise RuntimeError(f"{way}: the first batch {'of a fresh start' if case is None else f'resumed at {case:.0%}'} "
                                       f"is not the uninterrupted epoch's batch {0 if case is None else steps[case]}: "
                                       f"rows {rows[:4]}... where {want[:4]}... were expected")
                if r:
                    seconds[case].append(took)
                _settle()
    return {"way": way, "batches": batches, "fresh": seconds[None],
            "resumed": {f"{p:g}": {"step": steps[p], "seconds": seconds[p], "checkpoint_s": made[p]}
                        for p in args.positions}}


# -- the parent: data, one child per way, the table --------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for name in ("torch", "transformers", "lightning"):
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, {', '.join(versions)}")


def _child(way: str, root: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", way, "--data", str(root), "--batch-size", str(args.batch_size),
            "--workers", str(args.workers), "--repeats", str(args.repeats),
            "--positions", ",".join(f"{p:g}" for p in args.positions)]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{way}: the child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _positions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if not values or any(not 0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"positions are fractions of the epoch in (0, 1), got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=102_400, help="samples of the split (the epoch)")
    parser.add_argument("--rows-per-block", type=int, default=256)
    parser.add_argument("--shard-blocks", type=int, default=16, help="blocks per shard")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs of each case (after one untimed)")
    parser.add_argument("--positions", type=_positions, default=[0.1, 0.9], help="fractions of the epoch, comma-separated")
    parser.add_argument("--ways", default="hf,lightning,loader", help=f"comma-separated, of {','.join(WAYS)}")
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    parser.add_argument("--data", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.child:
        print(json.dumps(run_way(args.child, str(args.data), args)))
        return
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        parser.error(f"unknown ways {unknown}; choose from {list(WAYS)}")

    command = shlex.join([pathlib.Path(sys.executable).name, os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = _machine()
    print(f"{command}   {date}", flush=True)
    print(f"machine: {machine}", flush=True)
    root = prepare(args.rows, args.rows_per_block, args.shard_blocks)
    from pipeline.storage import read_manifest

    shards = len(read_manifest(str(root)).splits["train"])
    results = {}
    for way in ways:
        start = time.perf_counter()
        results[way] = _child(way, root, args)
        print(f"({WAYS[way]}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    batches = next(iter(results.values()))["batches"]
    print(f"resume to the first batch: an epoch of {args.rows:,} samples (embeddings rows, {shards} shards), "
          f"{batches:,} batches of {args.batch_size}, {args.workers} DataLoader workers; {args.repeats} runs of each "
          "case, interleaved; every first batch checked against the uninterrupted epoch's")
    first, last = f"{args.positions[0]:g}", f"{args.positions[-1]:g}"
    several = len(args.positions) > 1
    at = f"{float(first):.0%}"
    header = (f"{'way':<32} {'start':<18} {'step':>6} {'median s':>9} {'min s':>7} {'max s':>7} {'/ fresh':>8} "
              f"{f'/ {at}':>7} {f'min / {at}':>10}  target")
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for way, r in results.items():
        fresh = statistics.median(r["fresh"])
        rows = [("fresh (reference)", 0, r["fresh"])]
        rows += [(f"resumed at {float(p):.0%}", c["step"], c["seconds"]) for p, c in r["resumed"].items()]
        base, base_min = statistics.median(r["resumed"][first]["seconds"]), min(r["resumed"][first]["seconds"])
        for i, (label, step, seconds) in enumerate(rows):
            median = statistics.median(seconds)
            vs_fresh = f"{median / fresh:.2f}x" if i else ""
            vs_first = f"{median / base:.2f}x" if i > 1 else ""
            min_first = f"{min(seconds) / base_min:.2f}x" if i > 1 else ""
            target = ""
            if i == len(rows) - 1 and i > 1:
                target = f"<= {TARGET}x: {'met' if median / base <= TARGET else 'NOT met'}"
            print(f"{WAYS[way] if i == 0 else '':<32} {label:<18} {step:>6,} {median:>9.3f} {min(seconds):>7.3f} "
                  f"{max(seconds):>7.3f} {vs_fresh:>8} {vs_first:>7} {min_first:>10}  {target}")
        ratio = statistics.median(r["resumed"][last]["seconds"]) / base if several else None
        summary[way] = {"label": WAYS[way], "fresh_median_s": fresh, "fresh_seconds": r["fresh"],
                        "ratio_last_first": ratio, "target_met": None if ratio is None else ratio <= TARGET,
                        "resumed": {p: {"step": c["step"], "median_s": statistics.median(c["seconds"]),
                                        "seconds": c["seconds"], "checkpoint_s": c["checkpoint_s"]}
                                    for p, c in r["resumed"].items()}}
    made = "; ".join(f"{WAYS[w]} " + ", ".join(f"{float(p):.0%} {c['checkpoint_s']:.1f} s" for p, c in r["resumed"].items())
                     for w, r in results.items())
    print(f"making each checkpoint once (training or iterating up to it: grows with the position, as it must): {made}")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "date": date, "machine": machine, "rows": args.rows,
                                         "shards": shards, "batches": batches, "batch_size": args.batch_size,
                                         "workers": args.workers, "repeats": args.repeats, "target": TARGET,
                                         "ways": summary}, indent=1))

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

"""SA-1B: this project's loader beside LitData, webdataset and Mosaic Streaming, in one run (issue 17).

    python bench/sa1b_peers.py [--images 256 | --data DIR] [--rounds 3] [--peers NAME ...]   (or: make bench-peers)

Every peer reads the same raw member bytes (jpg + msgpack) of the packed bench data: webdataset
the packed shards themselves (they are WebDataset tars), LitData and Mosaic a copy in their own
format, converted once into .cache/bench-peers/<images>/<peer>/ with shards of about as many
samples. In its DataLoader workers each peer hands them to this project's SA-1B decode, then to
its collate and finish: the finished batch is built in the worker, as a peer's user would build
it, so the machinery is compared, not the decode. Each peer as its docs show it: shuffled,
num_workers=2, batch 8, persistent workers; image 1024, masks 256, max 64 (bench/sa1b_loader.py).
Each run is a fresh subprocess, in rounds (this project's loader, then each peer); per method the
median over rounds of: samples/s, its ratio to this project's loader in the same round, time to
the first batch from constructing the loader and per warm epoch, peak RSS of the process tree
(VmHWM summed), CPU per sample of all its processes. The floor (sa1b_loader's) is the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from sa1b_loader import ROOT, SETTINGS, measured, packed_samples, prepare, run_child, run_floor, run_loader

CACHE = ROOT / ".cache" / "bench-peers"
SHARD_SAMPLES = 32  # per shard or chunk of a converted copy: as the packed bench data's
WDS_SHUFFLE = 1000  # webdataset's sample shuffle buffer, as its docs show it


class PeerDecode:
    """This project's SA-1B decode and collate as a peer's user calls them in the peer's workers; the
    epoch (which masks a sample uses) in shared memory, set by the main process before each epoch."""

    def __init__(self, **options: Any) -> None:
        from pipeline.kinds.sa1b import Sa1b, Sa1bOptions

        self.kind = Sa1b(Sa1bOptions(**options))
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def sample(self, item: dict[str, Any], key: str, url: str) -> dict[str, Any]:
        """`item`'s jpg and msgpack members decoded."""
        from pipeline.stats import Clock

        members = {"jpg": item["jpg"], "msgpack": item["msgpack"]}
        return self.kind.decode(members, unit=0, seed=0, epoch=int(self.epoch), url=url, key=key,
                                clock=Clock(self.kind.stages))

    def batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return self.kind.finish(self.kind.collate(samples, int(self.epoch)))


class PeerLoader:
    """A peer's loader with the `set_epoch` that `timed_epochs` calls (the epoch its workers decode with)."""

    def __init__(self, loader: Iterable[dict[str, Any]], decode: PeerDecode) -> None:
        self.loader, self.decode = loader, decode

    def set_epoch(self, epoch: int) -> None:
        self.decode.epoch.fill_(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)


def _mosaic() -> types.ModuleType:
    """Mosaic Streaming's `streaming.base` (StreamingDataset, MDSWriter), without running the package's
    `__init__`: it imports its dataset zoo, hence torchvision, which PyPI has for CUDA builds of torch
    only (a CPU torch fails on `import torchvision`). What the loader does is the same."""
    if "streaming" not in sys.modules:
        package = types.ModuleType("streaming")
        package.__path__ = list(importlib.util.find_spec("streaming").submodule_search_locations)
        sys.modules["streaming"] = package
    return importlib.import_module("streaming.base")


def _items(shards: str) -> Iterator[dict[str, Any]]:
    """The packed samples as a peer's writer takes them: key and raw member bytes."""
    for key, members in packed_samples(pathlib.Path(shards)):
        yield {"key": key, **members}


def convert_litdata(shards: pathlib.Path, out: pathlib.Path) -> None:
    import litdata

    litdata.optimize(fn=_items, inputs=[str(shards)], output_dir=str(out), chunk_size=SHARD_SAMPLES, num_workers=1,
                     start_method="fork", verbose=False)


def convert_mosaic(shards: pathlib.Path, out: pathlib.Path) -> None:
    largest = max(p.stat().st_size for p in shards.glob("*.tar"))  # (Mosaic's shards are cut by bytes)
    columns = {"key": "str", "jpg": "bytes", "msgpack": "bytes"}
    with _mosaic().MDSWriter(out=str(out), columns=columns, size_limit=largest) as writer:
        for item in _items(str(shards)):
            writer.write(item)


def litdata_loader(source: pathlib.Path, decode: PeerDecode, workers: int, batch_size: int) -> Iterable:
    import litdata

    dataset = litdata.StreamingDataset(str(source), shuffle=True, seed=0,
                                       transform=lambda item: decode.sample(item, item["key"], str(source)))
    return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=decode.batch,
                                       persistent_workers=workers > 0)


def webdataset_loader(source: pathlib.Path, decode: PeerDecode, workers: int, batch_size: int) -> Iterable:
    import webdataset as wds

    urls = [str(p) for p in sorted(source.glob("train-*.tar"))]
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
               .shuffle(WDS_SHUFFLE)
               .map(lambda item: decode.sample(item, item["__key__"], item["__url__"]))
               .batched(batch_size, collation_fn=decode.batch, partial=False))
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def mosaic_loader(source: pathlib.Path, decode: PeerDecode, workers: int, batch_size: int) -> Iterable:
    class Decoded(_mosaic().StreamingDataset):
        def __getitem__(self, index: int) -> dict[str, Any]:
            item = super().__getitem__(index)
            return decode.sample(item, item["key"], str(source))

    dataset = Decoded(local=str(source), shuffle=True, batch_size=batch_size)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=decode.batch,
                                       persistent_workers=workers > 0, drop_last=True)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer: its distribution, its import, its conversion of the packed shards into a folder (None:
    it reads the packed shards), and its loader `(source, decode, workers, batch_size)`."""

    dist: str
    load: Callable[[], types.ModuleType]
    convert: Callable[[pathlib.Path, pathlib.Path], None] | None
    loader: Callable[[pathlib.Path, PeerDecode, int, int], Iterable]

    def version(self) -> str | None:
        """Its installed version; None: not installed."""
        try:
            return importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            return None


PEERS = {
    "litdata": Peer("litdata", lambda: importlib.import_module("litdata"), convert_litdata, litdata_loader),
    "webdataset": Peer("webdataset", lambda: importlib.import_module("webdataset"), None, webdataset_loader),
    "mosaic": Peer("mosaicml-streaming", _mosaic, convert_mosaic, mosaic_loader),
}


def converted(name: str, data: pathlib.Path) -> pathlib.Path:
    """The bench data in this peer's format (cached; redone when the packed data's fingerprint changes)."""
    shards, peer = data / "shards", PEERS[name]
    if peer.convert is None:
        return shards
    from pipeline.format import Manifest

    manifest = Manifest.from_json((shards / "manifest.json").read_bytes(), "m")
    out = CACHE / str(manifest.samples("train")) / name
    stamp = out / "fingerprint"
    if not (stamp.exists() and stamp.read_text() == manifest.fingerprint):
        print(f"converting {shards} for {name} into {out} ...", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        peer.convert(shards, out)
        stamp.write_text(manifest.fingerprint)
    return out


def run_peer(name: str, data: pathlib.Path, workers: int, epochs: int) -> dict:
    peer, source = PEERS[name], converted(name, data)
    peer.load()  # (before the clock, as run_loader's imports)
    decode = PeerDecode(**{k: v for k, v in SETTINGS.items() if k != "batch_size"})
    return measured(lambda: PeerLoader(peer.loader(source, decode, workers, SETTINGS["batch_size"]), decode), epochs)


def _child(method: str, data: pathlib.Path, args: argparse.Namespace) -> dict:
    return run_child(__file__, "--only", method, "--data", str(data), "--workers", str(args.workers),
                     "--epochs", str(args.epochs))


FIGURES = (("samples/s", "rate", ".1f"), ("1st batch s", "cold_first_batch_s", ".2f"),
           ("warm 1st s", "first_batch_s", ".2f"), ("tree MB", "tree_mb", ".0f"), ("CPU ms", "cpu_ms", ".1f"),
           ("/epoch", "epoch_samples", ".0f"))


def _row(label: str, runs: list[dict], ratios: list[float] | None) -> str:
    """A method's medians over the rounds (and of its samples/s over this project's loader's per round)."""
    figures = [format(statistics.median(run[field] for run in runs), fmt) for _, field, fmt in FIGURES]
    figures.insert(1, f"{statistics.median(ratios):.0%}" if ratios else "-")
    return f"{label:<28}" + "".join(f"{figure:>12}" for figure in figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256, help="bench data to build (sa1b_loader's), unless --data")
    parser.add_argument("--data", type=pathlib.Path, help="bench data built by sa1b_loader.prepare (read only)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs of each loader (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="this project's loader, then each peer, this many times")
    parser.add_argument("--peers", nargs="+", choices=sorted(PEERS), default=sorted(PEERS))
    parser.add_argument("--only", choices=["loader", "floor", *PEERS], help="run one method, print its figures as JSON")
    args = parser.parse_args()
    data = args.data or prepare(args.images)
    if args.only == "loader":
        print(json.dumps(run_loader(data, args.workers, args.epochs)))
    elif args.only == "floor":
        print(json.dumps(run_floor(data, args.workers)))
    elif args.only:
        print(json.dumps(run_peer(args.only, data, args.workers, args.epochs)))
    else:
        compare(data, args)


def compare(data: pathlib.Path, args: argparse.Namespace) -> None:
    """The floor once, then rounds of this project's loader and each installed peer; the table."""
    versions = {name: PEERS[name].version() for name in args.peers}
    peers = [name for name, version in versions.items() if version]
    for name in peers:
        converted(name, data)
    print(f"data: {data}; settings {SETTINGS}, num_workers={args.workers}, cores={os.cpu_count()}; "
          f"{args.rounds} rounds of {args.epochs} timed epochs", flush=True)
    floor = _child("floor", data, args)
    rounds = [{method: _child(method, data, args) for method in ("loader", *peers)} for _ in range(args.rounds)]
    print(f"{'method':<28}" + "".join(f"{name:>12}" for name in ("samples/s", "vs ours", *(f[0] for f in FIGURES[1:]))))
    print(_row("shardstream (this project)", [r["loader"] for r in rounds], None))
    for name, version in versions.items():
        if version:
            ratios = [r[name]["rate"] / r["loader"]["rate"] for r in rounds]
            print(_row(f"{name} {version}", [r[name] for r in rounds], ratios))
        else:
            print(f"{name:<28}not installed (make bench-peers)")
    print(f"floor: decode work alone x {args.workers} cores: {floor['rate']:.1f} samples/s ({floor['cpu_ms']:.1f} ms CPU "
          f"per sample)")
    print(f"medians of {args.rounds} rounds, each method in a fresh process; vs ours: samples/s over this project's "
          f"loader's in the same round; 1st batch: from constructing the loader; warm 1st: per timed epoch; tree MB: "
          f"peak RSS of main + workers (VmHWM summed); CPU ms: per sample, all processes; /epoch: samples per epoch")


if __name__ == "__main__":
    main()

"""`make_stream_loader`: shards -> (plan) -> read -> decode -> collate -> device, as a torch DataLoader
(the stages: `pipeline.stream`); `make_stream_dataset`: the stream alone, for another DataLoader."""

from __future__ import annotations

import dataclasses
import logging
import time
import multiprocessing
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from pipeline.collate import Leases
from pipeline.config import DATALOADER_SETTINGS, LoaderConfig
from pipeline.device import prefetch_to_cuda, to_device
from pipeline.errors import ConfigError, DatasetError, ManifestError, StallError
from pipeline.format import Manifest
from pipeline.index import SplitIndex
from pipeline.kinds import Kind, kind_of
from pipeline.outputs.attach import Attachments
from pipeline.plan import Mix, Resume, World
from pipeline.stats import Figures, LoaderStats
from pipeline.state import ORDER_SETTINGS, STATE_VERSION, describe, fingerprint, option_defaults, resume_point
from pipeline.storage import ShardCache, filesystem, is_local, read_manifest, shard_url
from pipeline.storage.places import Places
from pipeline.schedule import FirstOut
from pipeline.watchdog import Progress, next_batch, started, tick
from pipeline.stream import Handoff, ShardStream, WorkerError

__all__ = ["LoaderConfig", "LoaderStats", "StreamLoader", "make_stream_loader", "make_stream_dataset",
           "validate_first_batch"]

log = logging.getLogger(__name__)
_END = object()  # (an iterator's end, where a batch could be anything)


class StreamLoader:
    """Iterable over batches of one split; `len()` is the epoch's batches on this rank, as a
    DataLoader's: after `load_state_dict`, iteration yields those the state had not taken."""

    def __init__(self, stream: ShardStream, loader: DataLoader, device: torch.device | None,
                 manifests: list[Manifest], split: str, stats_callback: Callable[[LoaderStats], None] | None) -> None:
        """`stats_callback` is the main process's alone: the stream's config goes without it (spawned
        workers would pickle it)."""
        self._stream, self._loader, self.device = stream, loader, device
        self.manifests, self.split = manifests, split
        self.manifest = manifests[0]
        self.kind = stream.kind  # (its `options`: the kind's options this loader decodes with)
        self.config = dataclasses.replace(stream.config, stats_callback=stats_callback)
        self._taken: tuple[Resume, ...] = ()  # the epoch's history as of the last iteration, this one included
        self._generation = 0  # of the current iteration: an iterator of an earlier one is no longer valid
        self._started = -1  # the generation whose iterator has begun (one not begun plays the position it finds)
        self._figures = Figures(stream.times, stream.skipped)  # the main process's times, and the workers'

    def stats(self, reset: bool = False) -> LoaderStats:
        """Where the time went since the loader was made (or since the last `stats(reset=True)`): per
        stage in this process and, summed, in its DataLoader workers, with a verdict (`pipeline.stats`).
        Workers' figures count the batches they finished, some of which may still be in transit; the
        loop's time with a batch counts when it asks for the next one (or ends the iteration)."""
        return self._figures.stats(reset)

    @property
    def epoch(self) -> int:
        return self._stream.epoch

    @property
    def stream(self) -> ShardStream:
        """The dataset the DataLoader iterates (batches in transit, before `kind.finish`)."""
        return self._stream

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next `iter()` plays (its shuffle and mask sampling). Call before iterating.

        After `load_state_dict`, setting the saved epoch keeps the resumption point; any other epoch
        starts from its beginning (and an iterator that has begun is no longer valid; one not begun
        plays it: Lightning makes its iterator, then sets the epoch)."""
        stream = self._stream
        stream.attachments.check_epoch(epoch)
        was, loaded = stream.epoch, stream.state.history
        taken = self._taken or loaded  # (as of the last batch handed over: a trainer may stop asking at len())
        rest = stream.batches(taken) if loaded else 0
        if stream.state.set_epoch(epoch):
            if rest:  # (Lightning does this with a checkpoint saved after fit(max_steps=...) returned)
                done = sum(h.batches for h in taken)
                log.warning("set_epoch(%d) leaves epoch %d with %d of its %d batches not played, after a resumption: "
                            "they are dropped", epoch, was, rest, done + rest)
            self._moved()

    def _moved(self) -> None:
        """The position changed: an iterator that has begun would play the old one."""
        self._taken = ()
        if self._started == self._generation:
            self._generation += 1

    @property
    def sampler(self) -> StreamLoader:
        """The loader itself, for trainers that choose the epoch by `loader.sampler.set_epoch(epoch)`,
        as Lightning does at each epoch's start."""
        return self

    @property
    def skipped(self) -> int:
        """Samples skipped so far (on_error='skip'), over all epochs and workers of this process."""
        return int(self._stream.skipped[0].sum())

    @property
    def remaining(self) -> int:
        """The batches the next `iter()` yields: `len()` less those a loaded state had taken."""
        return self._stream.batches()

    def __len__(self) -> int:
        """The epoch's batches on this rank, those a loaded state had taken included (Lightning and
        torchdata's StatefulDataLoader count them so: they restore their own batch count)."""
        return self._stream.epoch_batches()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The epoch's batches (or the rest of them, after `load_state_dict`). A new iterator, like
        `load_state_dict` and `set_epoch` to another epoch after it has begun, ends the validity of
        any earlier one still open: using that again raises, so it never counts batches in
        `state_dict()`. An iterator plays the position the loader has when it begins."""
        self._generation += 1
        return self._iterate(self._generation)

    def close(self) -> None:
        """End the DataLoader's workers now. Persistent workers otherwise live as long as the loader,
        and a trainer that only drops it (Lightning at the end of `fit`) leaves them to the garbage
        collector, whose cycles make torch wait 5 s per worker to end them. Iterating again starts
        new workers; an iterator still open is no longer valid."""
        self._generation += 1
        iterator = getattr(self._loader, "_iterator", None)  # (a DataLoader's persistent workers: torch has no
        if iterator is not None:                            # public way to end them, Lightning does this too)
            iterator._shutdown_workers()
            self._loader._iterator = None

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError("this iterator of the loader is no longer valid: load_state_dict(), set_epoch() or a "
                               "newer iter() came after it began; iterate the loader again")

    def _pulled(self, generation: int, first_out: FirstOut | None, ticket: int) -> Iterator[Any]:
        """The DataLoader's batches, each taken only while `generation` is current (persistent workers
        serve whichever iteration asks: a stale one must not take a batch of the next). The workers'
        read-ahead waits for iteration `ticket`'s first batch (`schedule.FirstOut`)."""
        self._check_current(generation)
        clock, start = self._figures.clock, time.perf_counter_ns()  # the hand-off: asking to getting (workers start)
        if (progress := self._stream.stages.decoder.progress) is not None:
            progress.begin()  # (a stall counts from here at the earliest)
        try:
            batches = started(self._loader, progress, self.config.stall_timeout)
            while True:
                self._check_current(generation)
                try:
                    batch = next_batch(batches, progress, self.config.stall_timeout)
                except StopIteration:
                    clock.add("hand-off", time.perf_counter_ns() - start)
                    return
                except (ConnectionResetError, EOFError) as exc:  # (torch's own message comes at the SIGCHLD, wherever)
                    raise RuntimeError("a DataLoader worker ended while handing over a batch (killed, or out of "
                                       f"memory?): {_describe(exc)}") from exc
                clock.add("hand-off", time.perf_counter_ns() - start)
                yield batch
                if first_out is not None:  # (asked for the next: the first is out, or the device stage takes one ahead)
                    first_out.release(ticket)
                start = time.perf_counter_ns()
        except StallError as error:
            log.error("%s", error)
            self.close()  # (torch ends the stuck workers: SIGTERM after its join timeout)
            raise
        finally:
            if first_out is not None:
                first_out.release(ticket)  # (however the iteration ends, no worker waits for its first batch)

    def _iterate(self, generation: int) -> Iterator[dict[str, Any]]:
        self._check_current(generation)
        self._started = generation
        stream, clock, every = self._stream, self._figures.clock, self.config.stats_every
        clock.mark()  # (from here, the time outside the stages' blocks is "other")
        history, world_size = stream.state.history, stream.world_size
        first_out = stream.first_out
        ticket = stream.ask()  # (before `_pulled` asks the workers)
        batches: Iterator[dict[str, Any]] = map(_raise_worker_errors, self._pulled(generation, first_out, ticket))
        finishing = self.device is None or self.device.type != "cuda"  # (else on the device stage's stream)
        if not finishing:
            batches = prefetch_to_cuda(batches, self.device, stream.attachments.finish)
        elif self.device is not None:
            batches = (to_device(b, self.device) for b in batches)
        stream.skipped[1] = 0
        done = history[-1].batches if history and history[-1].world_size == world_size else 0
        past = history[:-1] if done else history
        self._taken = (*past, Resume(world_size, done))
        while True:
            with clock.stage("fetch"):  # (the hand-off, `_pulled`'s, the device copy; on CUDA, finishing)
                batch = next(batches, _END)
            if batch is _END:
                break
            self._check_current(generation)  # (the device stage takes a batch ahead)
            done += 1  # counted as handed over: a checkpoint taken while the batch is in use includes it
            self._taken = (*past, Resume(world_size, done))
            with clock.stage("finish"):
                finished = stream.attachments.finish(batch) if finishing else batch
                del batch  # (released here, not at the next fetch: freeing its tensors is finishing's cost)
                self._figures.yielded += 1
                if first_out is not None:
                    first_out.release(ticket)  # (the first batch is out: the workers read ahead)
            with clock.stage("loop"):
                yield finished
            if every is not None and self._figures.yielded % every == 0:
                _report(self.stats(), self._figures.yielded, self.config.stats_callback)
        if generation == self._generation:
            stream.state.set(stream.epoch, ())  # the epoch is complete: iterating it again plays all of it

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands, as plain data (no samples): save it with the model's checkpoint.

        In DDP the ranks move in step, so every rank's state is the same but for `rank`; save rank
        0's and load it on every rank, in a world of any size."""
        taken = self._taken or self._stream.state.history
        history = [[t.world_size, t.batches] for t in taken]
        return {**self._stream.identity, "epoch": self.epoch, "history": history, "rank": self._stream.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`: the rest of its epoch, then the following epochs.

        In the same world the remaining batches equal those of an uninterrupted run; with another
        world size, the samples no rank had taken are split over the new world. A state of another
        dataset, split, ordering settings or kind options is refused. An iterator still open is no
        longer valid."""
        epoch, history = resume_point(state, self._stream.identity, self._stream.option_defaults)
        self._stream.attachments.check_epoch(epoch)
        self._stream.state.set(epoch, history)
        self._moved()
        self._stream.batches()  # refuse now a history this dataset cannot have


def _report(stats: LoaderStats, batches: int, callback: Callable[[LoaderStats], None] | None) -> None:
    """`stats_every`'s report: logged (INFO, with the figures as `loader_stats`), and handed to the callback."""
    log.info("loader stats after %d batches: %s", batches, stats, extra={"loader_stats": stats})
    if callback is not None:
        callback(stats)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _raise_worker_errors(batch: Any) -> dict[str, Any]:
    if isinstance(batch, WorkerError):
        raise batch.error
    return batch


def _resolve_device(device: str | torch.device | None, pin_memory: bool | None) -> tuple[torch.device | None, bool]:
    """The device batches go to, and whether the DataLoader pins them (by default: for CUDA)."""
    resolved = None if device is None else torch.device(device)
    if resolved is not None and resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but CUDA is not available (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}); use device='cpu' or None"
        )
    cuda = resolved is not None and resolved.type == "cuda"
    if pin_memory and not cuda:
        raise ConfigError("pin_memory=True needs device='cuda' (pinned memory only helps copies to the GPU)")
    return resolved, cuda if pin_memory is None else pin_memory


def _world(rank: int | None, world_size: int | None) -> World:
    """This process's place among the ranks: `rank` and `world_size` as given, or both from
    torch.distributed when it is initialised (else a single process).

    Given ones that disagree with an initialised torch.distributed are refused, but for
    `world_size=1` (every process reads the whole split) and a `world_size` dividing the process
    group's (data-parallel replicas under model parallelism, `rank` the replica's index)."""
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None or world_size is None:  # (given together: `LoaderConfig` checks)
        return World(dist.get_rank(), dist.get_world_size()) if initialised else World()
    world = World(rank, world_size)
    if initialised and world_size != 1:
        group_rank, group_size = dist.get_rank(), dist.get_world_size()
        if group_size % world_size or (world_size == group_size and rank != group_rank):
            raise ConfigError(
                f"rank={rank}, world_size={world_size} disagree with torch.distributed (rank {group_rank} of "
                f"{group_size}): pass neither to use torch.distributed's, world_size=1 for every process to read "
                f"the whole split, or for data-parallel replicas a world_size dividing {group_size} with rank the "
                "replica's index")
    return world


def _check_picklable(kind: Kind, method: str) -> None:
    """Workers that do not fork receive the dataset by pickle: a kind option that cannot be pickled (a
    lambda, a local function) is named now, rather than by torch's PicklingError at the first batch."""
    if method == "fork":
        return
    try:
        pickle.dumps(kind.options)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(f"multiprocessing_context={method!r} sends the dataset to the workers by pickle, and an "
                          f"option of the kind cannot be pickled ({exc}): define functions such as decode= and "
                          "collate= at a module's top level (not a lambda or a local function), or use 'fork'") from exc


def _config(config: LoaderConfig | None, settings: dict[str, Any]) -> tuple[LoaderConfig, dict[str, Any]]:
    """(`config` with the loader settings among `settings`, the rest: the kind's options)."""
    mine, options = LoaderConfig.split(settings)
    if config is None:
        return LoaderConfig(**mine), options
    return (dataclasses.replace(config, **mine) if mine else config), options


def _manifests(roots: list[str], split: str, config: LoaderConfig) -> list[Manifest]:
    """The sources' manifests, checked: the split in each, one kind, shards within the limits and the cache."""
    if config.verify == "sha256":
        remote = [root for root in roots if not is_local(filesystem(root, config.storage_options)[0])]
        if remote:
            raise ConfigError(f"verify='sha256' checks shards on local disk; {remote[0]} is on object storage (cached "
                              "shards are always checked when downloaded; `shard-pack verify` checks a whole dataset)")
    cache = ShardCache(config.cache_dir, config.cache_limit) if config.cache_dir is not None else None
    manifests = [read_manifest(root, config.storage_options, config.retry, cache) for root in roots]
    limit = config.limits.max_shard_bytes
    for root, manifest in zip(roots, manifests):
        if split not in manifest.splits:
            raise DatasetError(f"no split {split!r}; the dataset has {sorted(manifest.splits)}", url=root)
        places = Places(root, config.allowed_roots)
        for name in manifest.splits[split].names:  # (a name outside the folder and the allowed roots: refused now)
            places.url(name)
        if manifest.kind != manifests[0].kind:
            raise DatasetError(f"cannot mix kinds: {roots[0]} is {manifests[0].kind}, {root} is {manifest.kind}")
        shards = manifest.splits[split]
        if len(shards) and shards.shard_bytes.max() > limit:
            name = shards.names[int(shards.shard_bytes.argmax())]
            raise ManifestError(f"{shards.shard_bytes.max()} bytes, more than max_shard_bytes={limit}",
                                url=shard_url(root, name))
    if cache is not None:
        largest = max((int(m.splits[split].shard_bytes.max(initial=0)) for m in manifests), default=0)
        if cache.limit < largest:
            raise ConfigError(f"cache_limit={cache.limit} cannot hold the largest shard of split {split!r} "
                              f"({largest} bytes)")
    return manifests


def _stream(source: str | Sequence[str], split: str, config: LoaderConfig, options: dict[str, Any], *,
            max_workers: int, **mode: Any) -> tuple[ShardStream, list[Manifest]]:
    """The stream of `split` over the sources (see `make_stream_loader`), with the kind's `options`."""
    world = _world(config.rank, config.world_size)
    roots = [source] if isinstance(source, str) else list(source)
    manifests = _manifests(roots, split, config)
    kind = kind_of(manifests, config.limits, **options)
    sources = [SplitIndex.of(root, manifest, split, kind.units) for root, manifest in zip(roots, manifests)]
    mix = None if len(sources) == 1 and config.weights is None and config.epoch_size is None else \
        Mix.of([int(s.sizes.sum()) for s in sources], config.weights, config.epoch_size)
    # What a saved state must share with the stream that resumes it: the datasets (and, when mixing,
    # each one's share), the split, the settings that decide the order, and the kind's options.
    identity = {"version": STATE_VERSION, "fingerprint": fingerprint(manifests, mix.counts if mix else None),
                "split": split, "units": [int(s.sizes.sum()) for s in sources],
                **{name: getattr(config, name) for name in ORDER_SETTINGS}, "kind": manifests[0].kind,
                "options": describe(kind.options)}
    attachments = Attachments.of(dict(config.attach), manifests, split, kind, sources, config)
    stream = ShardStream(sources, mix, kind, config, world, max_workers=max_workers, identity=identity,
                         option_defaults=option_defaults(kind.options), attachments=attachments, **mode)
    if stream.batches() == 0:
        raise DatasetError(
            f"{', '.join(roots)}: split {split!r} gives {stream.total} samples per epoch, too few for one batch of "
            f"{config.batch_size} on each of {world.world_size} ranks with drop_last=True"
        )
    return stream, manifests


def make_stream_loader(source: str | Sequence[str], split: str, *, config: LoaderConfig | None = None,
                       **settings: Any) -> StreamLoader:
    """A loader over `split` of the dataset at `source` (a folder written by `shard-pack`), or
    of several datasets of one kind: a list of sources, concatenated or, with `weights`, mixed in
    exact shares (`epoch_size` samples per epoch; by default the most that exhausts no source).

    Every sample of the split is yielded exactly once per epoch across all ranks and workers
    (but for the `drop_last` remainder), every rank yields `len(loader)` batches, and the order is
    a function of (seed, epoch) only. `rank` and `world_size` go together; without them, they are
    torch.distributed's when it is initialised (given ones that disagree with it are refused, but
    for `world_size=1` and data-parallel replicas: see `_world`). `persistent_workers=None` keeps
    workers alive across epochs when there are any. `limits` caps what an (untrusted) shard can
    make the reader do; with `on_error="skip"`, `max_errors` (a count, or a fraction of the
    rank's samples) bounds the skips per epoch.

    Settings are `LoaderConfig`'s (`batch_size` and `num_workers` among them), given as keywords,
    as a `config`, or both (keywords replace the config's); any other keyword is an option of the
    kind (the manifest says which), and one the kind does not take is refused by name. For SA-1B
    `image_size=1024`, `mask_size=256`, `max_masks=64` (an int, or a function of the epoch); for
    VQA `per="question"` (or "image") and `image_size=448` (or None: as stored, or with `min_pixels`,
    `max_pixels`, `pixel_factor` at Qwen2-VL's `smart_resize` of each image); for WebDataset tars
    indexed in place, your `decode=fn` (required) and `collate=` (`pipeline.kinds.webdataset`). Kinds whose
    samples hold several units (rows of a block, questions of an image) yield units; each worker
    keeps up to `unit_cache_bytes` of such samples open for their next units (read from a mapped
    local file, a sample counts as none: its bytes are the page cache's).

    Storage: `source` is a local folder or any fsspec URL (`s3://bucket/prefix`, `gs://`,
    `https://`), opened in each worker with `storage_options` (e.g. s3fs's `endpoint_url`, `key`,
    `secret`, `anon`). Samples are read by byte range, `read_ahead` batches ahead of decoding;
    transient failures are retried as `retry` says. With `cache_dir` and `cache_limit` (bytes),
    remote shards are kept whole on local disk, least recently used evicted (`storage.ShardCache`).
    A dataset's names resolve inside its folder: shards elsewhere (archives indexed in place outside
    it) are read only under `allowed_roots` (`storage.places`; docs/security.md).

    Checks of shard content: `verify="size"` (the default) compares each shard's size with the
    manifest's, one stat (or HEAD) per shard per iteration beside its first read: a shard cut or
    replaced by one of another size is named. `verify="sha256"` also hashes each local shard the
    first time the loader reads it (by whichever worker comes first; the others wait for that
    check), again only if its inode, size or mtime change: a shard replaced by one of the same
    size, or a wrong manifest, is named before any of its samples is used. It costs reading each
    shard whole once per loader, workers fresh each epoch or not (~1 s per GiB on one core
    from the page cache), on the path of the first batches that use it. Shards on object
    storage are refused with it: cached ones are always checked when downloaded, and
    `shard-pack verify` checks a whole dataset.
    """
    config, options = _config(config, settings)
    device, pin = _resolve_device(config.device, config.pin_memory)
    workers = config.num_workers
    handoff = Handoff(Leases(workers), FirstOut(config.multiprocessing_context),
                      Progress(workers) if config.stall_timeout is not None else None) if workers else Handoff()
    stream, manifests = _stream(source, split, dataclasses.replace(config, stats_callback=None), options,
                                max_workers=workers, handoff=handoff)
    if workers:
        _check_picklable(stream.kind, config.multiprocessing_context or multiprocessing.get_start_method())
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=config.prefetch_factor if workers else None,
        persistent_workers=bool(workers) if config.persistent_workers is None else config.persistent_workers,
        multiprocessing_context=config.multiprocessing_context if workers else None,
        timeout=tick(config.stall_timeout) if workers else 0,
    )
    return StreamLoader(stream, loader, device, manifests, split, config.stats_callback)


def make_stream_dataset(source: str | Sequence[str], split: str, *, max_workers: int = 16, flatten: bool = False,
                        split_workers: bool = True, config: LoaderConfig | None = None,
                        **settings: Any) -> IterableDataset:
    """The loader's dataset itself, for loops that wrap a dataset in their own DataLoader: a torch
    IterableDataset of the kind's batches of `batch_size`, as `make_stream_loader` yields them (keys,
    dtypes, shapes: see the kind), or with `flatten`, of their samples: row i of each batch, same keys.

    It is split exactly over the ranks and over the workers (at most `max_workers`) of the DataLoader
    that iterates it; each worker takes whole batches of `batch_size` in turn. `split_workers=False`:
    whoever iterates it reads the rank's whole share, in any worker (for a wrapper that splits the
    work itself). It has `set_epoch(epoch)`, `skipped` and `len()`: the batches, or with `flatten` the
    samples, that an iteration yields on this rank (fewer samples when some are skipped). A DataLoader
    that batches the samples again counts `ceil(len / its batch size)` batches, which is what it yields
    only when `batch_size` is a multiple of its batch size: `pipeline.trainer_dataset` sees to that.
    Errors raise in the worker (the DataLoader re-raises them as RuntimeError with the message).
    Other arguments as `make_stream_loader`'s, but for the DataLoader's own.
    """
    if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
        raise ConfigError(f"max_workers must be an int >= 1, got {max_workers!r}")
    theirs = sorted(set(settings) & set(DATALOADER_SETTINGS))
    if theirs:
        raise ConfigError(f"make_stream_dataset does not take {theirs}: the DataLoader that iterates it decides those")
    if settings.get("stats_every") is not None or (config is not None and config.stats_every is not None):
        raise ConfigError("make_stream_dataset does not take stats_every: it has no stats() (make_stream_loader's has)")
    config, options = _config(config, settings)
    return _stream(source, split, config, options, max_workers=max_workers, finished=True, flatten=flatten,
                   split_workers=split_workers)[0]


def validate_first_batch(loader: StreamLoader) -> dict[str, Any]:
    """Take the loader's first batch and check keys, shapes, dtypes, finiteness and ranges; return it."""
    batch = next(iter(loader))
    attached = {name: batch.pop(name) for name, _ in loader.config.attach}
    problems = loader.kind.check(batch, loader.epoch)
    batch.update(attached)
    if problems:
        raise DatasetError("first batch is invalid:\n  " + "\n  ".join(problems))
    return batch

"""`OutputWriter`: outputs computed in the user's own loop (a teacher's embeddings, generated
captions) written into a sidecar (`pipeline.format.outputs`), each beside the plan item it was
computed from, so that a later loader attaches it to that very sample (`pipeline.outputs.attach`).

Exactly once: each rank writes its own share of the epoch, as its loader yields it (the plan's
batches in order, `plan_epoch` for the rank alone), and the sidecar is finished only once every
rank's share is committed, each item once. Resumable: a chunk is committed with the loader's
state after its last batch; a writer started again loads the last commit's state into the loader,
so the loop yields only what is missing. Chunks close at the first batch boundary past
`chunk_bytes`, so a restarted write is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.errors import ConfigError
from pipeline.format import check_key, pack_record
from pipeline.format.outputs import (
    OUTPUT_DTYPES, Commit, OutputField, check_field_name, chunk_name, commit_name, epoch_folder, record_key,
)
from pipeline.index import locate, row_order
from pipeline.loader import StreamLoader
from pipeline.outputs.epochs import committed, finish_epoch, listing, read_outputs, shown
from pipeline.outputs.of import outputs_of, refusal
from pipeline.plan import World, plan_epoch, rank_sample_count
from pipeline.storage import Retry, ShardReader, filesystem, is_local, join, write_bytes
from pipeline.tario import BLOCK, member_header

__all__ = ["OutputWriter"]

log = logging.getLogger(__name__)
_END = b"\0" * (2 * BLOCK)


def _fixed(value: Any) -> tuple[np.ndarray, str] | None:
    """A tensor or array of a fixed output dtype, as a C-contiguous array (bfloat16 as its 16-bit
    patterns) and its dtype's name; None for anything else (a variable field's values)."""
    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in OUTPUT_DTYPES:
            return None
        tensor = value.detach()
        tensor = tensor.view(torch.int16) if name == "bfloat16" else tensor
        return np.ascontiguousarray(tensor.cpu().numpy()), name
    if isinstance(value, np.ndarray) and value.dtype.name in OUTPUT_DTYPES:
        return np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"), copy=False)), value.dtype.name
    return None


def _plain(value: Any) -> Any:
    """A variable field's value as msgpack takes it: tensors and arrays as (nested) lists."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _columns(outputs: Mapping[str, Any], rows: int) -> tuple[tuple[OutputField, ...], dict[str, Any]]:
    """The batch's outputs as fields (sorted by name) and, per field, each row's bytes."""
    if not isinstance(outputs, Mapping) or not outputs:
        raise ConfigError("outputs must be a non-empty dict {field: a (B, ...) tensor or array, or a list of B values}")
    fields, columns = [], {}
    for name in sorted(outputs):
        value = outputs[check_field_name(name)]
        fixed = _fixed(value)
        if fixed is not None:
            array, dtype = fixed
            if array.ndim < 1 or len(array) != rows:
                raise ConfigError(f"output {name!r}: shape {tuple(array.shape)}, want ({rows}, ...): a row per sample")
            fields.append(OutputField(name, dtype, tuple(array.shape[1:])))
            columns[name] = list(map(memoryview, array.reshape(rows, -1).view(np.uint8)))
            continue
        values = list(value) if isinstance(value, (list, tuple)) else None
        if values is None or len(values) != rows:
            raise ConfigError(f"output {name!r}: a {type(value).__name__}; want a ({rows}, ...) tensor or array of "
                              f"{', '.join(OUTPUT_DTYPES)}, or a list of {rows} values")
        fields.append(OutputField(name, None, None))
        columns[name] = [pack_record({"v": _plain(v)}) for v in values]
    return tuple(fields), columns


class _Buffer:
    """A chunk's bytes as they are appended, and their SHA-256 (here, in the loop's thread: measured
    faster than in the writing thread, whose write and sync the loop would then wait for): made at
    `capacity` (a chunk and some more), grown only by a batch that overshoots it, and kept for the
    chunk after next once written (fresh memory costs a page fault per 4 KiB: as much as the copy)."""

    def __init__(self, capacity: int) -> None:
        self.array, self.size, self.sha = np.empty(0, np.uint8), 0, hashlib.sha256()
        self.capacity = capacity

    def add(self, data: Any) -> None:
        size = len(data)
        if self.size + size > len(self.array):
            grown = np.empty(max(2 * len(self.array), self.size + size, self.capacity), np.uint8)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        self.array[self.size : self.size + size] = np.frombuffer(data, np.uint8)
        self.size += size
        self.sha.update(data)

    def view(self) -> memoryview:
        return memoryview(self.array)[: self.size]

    def reset(self) -> None:
        self.size, self.sha = 0, hashlib.sha256()


class _Chunks:
    """A rank's chunks in one epoch folder: records appended to the chunk in progress (copied and
    hashed in the loop's thread), each chunk committed (written whole, then its commit) in a thread
    of its own while the loop goes on, one at a time."""

    def __init__(self, writer: OutputWriter, number: int) -> None:
        self.fs, self.base, self.retry = writer.fs, writer.base, writer.retry
        self.folder, self.rank, self.world_size, self.of = writer.folder, writer.rank, writer.world_size, writer.of
        self.number = number  # of the chunk in progress
        capacity = writer.chunk_bytes + writer.chunk_bytes // 8
        self.data, self.records = _Buffer(capacity), []  # the chunk in progress: bytes, (source, item, start, end)
        self._spare = _Buffer(capacity)  # the chunk being written (then the next one's)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardstream-outputs")
        self._pending: concurrent.futures.Future[None] | None = None

    def add(self, key: str, source: int, item: int, members: Sequence[tuple[str, Any]]) -> None:
        """One record: a member `<key>.<field>` per (field, bytes)."""
        data, start = self.data, self.data.size
        for name, value in members:
            data.add(member_header(f"{key}.{name}", len(value)))
            data.add(value)
            data.add(bytes(-len(value) % BLOCK))
        self.records.append((source, item, start, data.size))

    def commit(self, state: dict[str, Any], schema: tuple[tuple[OutputField, ...], bool], last: bool) -> None:
        """The chunk in progress, committed with the loader's `state` after its last batch; `schema`:
        the fields, and whether records are named by their samples' keys."""
        full, records = self.data, np.array(self.records, dtype=np.int64).reshape(-1, 4)
        full.add(_END)
        self.wait()  # (the chunk before: its buffer is free again)
        self.data, self._spare, self.records = self._spare, full, []
        self.data.reset()
        self._pending = self._thread.submit(self._store, full.view(), full.sha.hexdigest(), self.number, records,
                                            state, (*schema, last))
        self.number += 1

    def _store(self, data: memoryview, digest: str, number: int, records: np.ndarray, state: dict[str, Any],
               schema: tuple[tuple[OutputField, ...], bool, bool]) -> None:
        write_bytes(self.fs, join(self.base, chunk_name(self.folder, self.rank, number)), data, self.retry)
        batches = int(sum(n for _, n in state["history"]))  # (the rank's, with this chunk's)
        commit = Commit(self.rank, self.world_size, number, len(data), digest, records, batches, state, *schema,
                        self.of)
        write_bytes(self.fs, join(self.base, commit_name(self.folder, self.rank, number)), commit.to_bytes(),
                    self.retry)

    def wait(self) -> None:
        """The last commit done (its error raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """The chunk in progress dropped (its batches are written again when the job is run again)."""
        self._thread.shutdown(wait=True)
        self.data, self._spare, self.records = _Buffer(0), _Buffer(0), []


class OutputWriter:
    """Writes outputs computed from `loader`'s batches into the sidecar at `out` (a local folder, or an
    `s3://`, `gs://` or `az://` prefix), in a `with` block around the user's loop over the loader:

        with OutputWriter(out, loader, inputs=("images",)) as writer:
            for batch in loader:
                writer.write(batch["keys"], {"teacher": teacher(batch["images"])})

    `inputs`: the batch fields the outputs are computed from (None: the whole sample). Where they do
    not change with the epoch (SA-1B images without `hflip` or `scale_jitter`), one pass serves
    every epoch; else the sidecar holds the loader's epoch (a writer per epoch adds epochs). Each
    rank writes its share; started again after an interruption, it writes only what is missing (it
    sets the loader's position itself, so enter it before iterating). Chunks of about `chunk_bytes`
    are written in a thread while the loop goes on; an interruption loses at most the chunk in
    progress. The loader must yield every sample (`on_error="raise"`, no `drop_last` remainder)."""

    def __init__(self, out: str, loader: StreamLoader, *, inputs: Sequence[str] | None = None,
                 chunk_bytes: int = 128 << 20, storage_options: dict[str, Any] | None = None,
                 retry: Retry | None = None) -> None:
        if not isinstance(loader, StreamLoader):
            raise ConfigError(f"OutputWriter writes from a make_stream_loader loader, got a {type(loader).__name__}")
        stream, config = loader.stream, loader.config
        if config.on_error != "raise":
            raise ConfigError("OutputWriter needs on_error='raise': a skipped sample would have no output")
        ws, bs = stream.world_size, config.batch_size
        left = stream.total - sum(rank_sample_count(stream.total, ws, r, bs, config.drop_last, ()) for r in range(ws))
        if left:
            raise ConfigError(f"drop_last=True leaves {left} of the epoch's {stream.total} samples out (batches of "
                              f"{bs} on {ws} ranks): they would have no output; pass drop_last=False")
        known = {f.name for f in stream.kind.fields(loader.epoch)}
        if inputs is not None and (not inputs or set(inputs) - known):
            raise ConfigError(f"inputs {list(inputs)}: want batch fields, among {sorted(known)}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.out, self.loader, self.chunk_bytes, self.retry = out, loader, chunk_bytes, retry or config.retry
        self.of = outputs_of(loader.manifests, loader.split, stream.kind, [int(s.sizes.sum()) for s in stream.sources],
                             config.seed, inputs)
        self.fs, self.base = filesystem(out, storage_options if storage_options is not None else config.storage_options)
        self.rank, self.world_size = stream.rank, ws
        self.fields: tuple[OutputField, ...] | None = None
        self.keyed: bool | None = None  # records named by their samples' keys (given to `write`)
        self.folder = ""
        self.batches = self.share = 0  # the rank's batches written, and of the epoch
        self.plan: Sequence[Any] = ()
        self._chunks: _Chunks | None = None
        self._readers: list[ShardReader] = []  # the sources' shard indexes, for a grouped kind's rows

    def __enter__(self) -> OutputWriter:
        stream = self.loader.stream
        manifest = read_outputs(self.fs, self.base, self.out, self.retry)
        if manifest is not None and (problem := refusal(manifest.of, self.of)):
            raise ConfigError(f"{self.out} holds outputs of other samples than this loader's: {problem}")
        self.folder = epoch_folder(self.loader.epoch if self.of["by_epoch"] else None)
        self.share = stream.batches(())
        if manifest is not None and self.folder in manifest.epochs:  # (complete: the loop has nothing to do)
            self.fields, self.keyed, self.batches = manifest.fields, manifest.keyed, self.share
            self.loader.load_state_dict({**self.loader.state_dict(), "history": [[self.world_size, self.share]]})
            log.info("%s: %s is complete; nothing to write", self.out, self.folder)
            self._chunks = _Chunks(self, 0)
            return self
        commits = committed(self.fs, self.base, self.out, self.folder, self.rank, self.retry)
        if commits:
            last = commits[-1]
            if problem := refusal(last.of, self.of):
                raise ConfigError(f"{self.out}: {self.folder} was being written from other samples than this "
                                  f"loader's: {problem}")
            if last.world_size != self.world_size:
                raise ConfigError(f"{self.out}: {self.folder} was being written by {last.world_size} ranks; finish it "
                                  f"with {last.world_size} (this job has {self.world_size}), or write elsewhere")
            self.fields, self.keyed, self.batches = last.fields, last.keyed, last.batches
            self.loader.load_state_dict(last.state)
            log.info("%s: rank %d resumes %s after %d of its %d batches", self.out, self.rank, self.folder,
                     self.batches, self.share)
        elif self.loader.state_dict()["history"]:
            raise ConfigError("the loader was resumed (load_state_dict); the writer sets its position itself from "
                              "what was written: enter the writer on a fresh loader")
        if is_local(self.fs):
            os.makedirs(join(self.base, f"{self.folder}/index"), exist_ok=True)
            for name in listing(self.fs, join(self.base, self.folder)):  # (this rank's, left by a killed write)
                if name.startswith(f"r{self.rank:05d}-") and ".partial-" in name:
                    os.unlink(join(self.base, f"{self.folder}/{name}"))
        cfg = self.loader.config
        self.plan = plan_epoch([s.sizes for s in stream.sources], cfg.seed, self.loader.epoch,
                               World(self.rank, self.world_size), batch_size=cfg.batch_size, drop_last=cfg.drop_last,
                               shuffle=cfg.shuffle, window=cfg.shuffle_window, mix=stream.mix)
        self._chunks = _Chunks(self, len(commits))
        return self

    def write(self, keys: Sequence[str] | None, outputs: Mapping[str, Any]) -> None:
        """The outputs of the batch the loader handed over last: `keys` its `batch["keys"]` (checked
        against each sample's key when attached; None for a kind without keys, embeddings), `outputs`
        {field: a (B, ...) tensor or array of a fixed dtype, or a list of B values of any msgpack data}."""
        chunks = self._chunks
        if chunks is None:
            raise ConfigError("OutputWriter.write: use the writer in a `with` block")
        if self.batches >= self.share:
            raise ConfigError(f"write: this rank's {self.share} batches of the epoch are written; a write more "
                              "is of a batch the loader did not yield")
        state = self.loader.state_dict()
        taken = sum(n for _, n in state["history"])
        if taken != self.batches + 1 or (self.of["by_epoch"] and epoch_folder(state["epoch"]) != self.folder):
            raise ConfigError(f"write is given each batch the loader yields, once, in order: the loader has handed "
                              f"over {taken} batches of epoch {state['epoch']}, and {self.batches} of "
                              f"{self.folder} are written")
        _, sources, items = self.plan[self.batches]
        if self.loader.stream.kind.grouped:  # (a batch's rows grouped by sample: `index.row_order`)
            sources, items = _in_rows(self.loader.stream, self._readers, sources, items)
        keyed, keys = keys is not None, list(keys) if keys is not None else [""] * len(items)
        if len(keys) != len(items):
            raise ConfigError(f"write: {len(keys)} keys for a batch of {len(items)} samples")
        fields, columns = _columns(outputs, len(keys))
        if self.fields is None:
            self.fields, self.keyed = fields, keyed
        elif fields != self.fields:
            raise ConfigError(f"write: outputs {shown(fields)}; earlier batches had {shown(self.fields)}")
        elif keyed != self.keyed:
            raise ConfigError(f"write: keys {'given' if keyed else 'None'}; earlier batches were written "
                              f"{'with' if self.keyed else 'without'} them")
        for i, key in enumerate(keys):
            name = record_key(check_key(key) if keyed else key, int(sources[i]), int(items[i]), keyed)
            chunks.add(name, int(sources[i]), int(items[i]), [(f.name, columns[f.name][i]) for f in fields])
        self.batches += 1
        if chunks.data.size >= self.chunk_bytes or self.batches == self.share:
            chunks.commit(state, (fields, keyed), self.batches == self.share)

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        chunks, self._chunks = self._chunks, None
        if chunks is None:
            return
        try:
            if error is not None:
                with contextlib.suppress(Exception):
                    chunks.wait()
                return
            chunks.wait()
            if self.batches < self.share:
                kept = committed(self.fs, self.base, self.out, self.folder, self.rank, self.retry)
                log.warning("%s: rank %d's loop ended after %d of its %d batches of %s; the %d since its last commit "
                            "are dropped: run again to write the rest", self.out, self.rank, self.batches, self.share,
                            self.folder, self.batches - (kept[-1].batches if kept else 0))
                return
            self._finish()
        finally:
            chunks.close()

    def _finish(self) -> None:
        """Every rank done: the epoch's indexes and the manifest, made once (by rank 0 of an initialised
        torch.distributed of this world, else by each rank that finds every rank's share committed:
        the same bytes, written whole)."""
        together = dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world_size
        if together:
            dist.barrier()
        if not together or self.rank == 0:
            finish_epoch(self.out, self.folder, self.of, self.loader.stream.sources, self.fs, self.base, self.retry,
                         required=together)
        if together:
            dist.barrier()


def _in_rows(stream: Any, readers: list[ShardReader], sources: np.ndarray,
             items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A grouped kind's plan batch in the order of the batch's rows (each sample's units together,
    `index.row_order`): the samples of its items from their shards' indexes (fetched once, kept)."""
    if not readers:
        cfg = stream.config
        readers += [ShardReader(s.root, cfg.storage_options, cfg.retry, None, None, cfg.index_cache_bytes,
                                cfg.allowed_roots) for s in stream.sources]
    samples = np.empty_like(items)
    for number in np.unique(sources).tolist():
        mine, source = sources == number, stream.sources[number]
        shards = np.unique(source.shards_of(items[mine])).tolist()
        starts = {i: readers[number].index(source.split[i]).unit_starts for i in shards}
        samples[mine] = locate(source, items[mine], starts)[0]
    rows = row_order(sources, samples, True)
    return sources[rows], items[rows]



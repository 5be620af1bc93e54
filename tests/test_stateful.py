"""Resuming through torchdata's `StatefulDataLoader` and accelerate's stateful DataLoader, for real (CPU,
offline, no mocks): the dataset's `state_dict` taken in each worker after a batch, loaded into a fresh
dataset and loader, yields exactly what an uninterrupted run yields after that point, in its order, and
decodes only that (counted in every process: each kind's `decode` appends what it decodes to a file);
the next epoch is the uninterrupted one. For the three kinds, 0 and 2 workers, samples (`trainer_dataset`)
and batches (`make_stream_dataset`), a DataLoader batch smaller than the dataset's (resuming inside one
of its batches), `snapshot_every_n_steps`; states of another dataset, split, order, kind option, world
or number of workers refused, naming both values; accelerate's `save_state`/`load_state` on 1 process
and on 2 (torchrun, gloo on 127.0.0.1), where the exact way is `make_stream_loader` registered for
checkpointing. What accelerate's stateful DataLoader does not do on 2 processes is marked
xfail(strict) with the reason.

Run as a script, this file is what each torchrun process runs (`_main`).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from pipeline import make_stream_dataset, make_stream_loader, trainer_dataset
from pipeline.errors import ConfigError
from pipeline.kinds.embeddings import Embeddings
from pipeline.kinds.sa1b import Sa1b
from pipeline.kinds.vqa import Vqa
from conftest import split_keys
from procs import end_process_group, torchrun

SEED = 3
B = 2  # the DataLoader's batch, and trainer_dataset's per-process batch
SA1B = {"image_size": 32, "mask_size": 16, "max_masks": 4}
# (torchdata 0.11 calls a function torch 2.13 deprecates)
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


# -- datasets: conftest's sa1b_dataset, vqa and emb ------------------------------------------------


class Case(NamedTuple):
    """A dataset of one kind: its root, the kind's options, a sample's identity, a batch's identities."""

    root: str
    options: dict[str, Any]
    sample: Callable[[dict[str, Any]], Any]
    batch: Callable[[dict[str, Any]], list[Any]]


KINDS = ["vqa", "sa1b", "embeddings"]


@pytest.fixture(scope="session")
def cases(vqa, sa1b_dataset, emb) -> dict[str, Case]:
    return {
        "vqa": Case(vqa, {"per": "question", "image_size": 16}, lambda s: (s["keys"], int(s["question_index"])),
                    lambda b: list(zip(b["keys"], b["question_index"].tolist()))),
        "sa1b": Case(sa1b_dataset, SA1B, lambda s: s["keys"], lambda b: list(b["keys"])),
        "embeddings": Case(emb, {}, lambda s: int(s["row"]), lambda b: b["row"].tolist()),
    }


# -- what is decoded, in any process ---------------------------------------------------------------

# What each kind's `decode` is handed -> the identities of the samples it decodes (as `Case.sample`).
_DECODED = {
    Sa1b: lambda opened, unit, key: [key],
    Vqa: lambda opened, unit, key: [[key, int(unit)]],
    Embeddings: lambda block, unit, key: [int(row) for row in block.columns["row"][unit]],  # (a block's rows at once)
}


def _patch_decodes(assign: Callable[[Any, str, Any], None], path: pathlib.Path) -> None:
    """Each kind's `decode` also appends what it decodes to `path`, one JSON line per sample. DataLoader
    workers are forked after this: they inherit it."""
    for cls, identities in _DECODED.items():
        def decode(self, opened, *, unit, key, _original=cls.decode, _identities=identities, **kwargs):
            with open(path, "a") as f:
                f.write("".join(json.dumps(i) + "\n" for i in _identities(opened, unit, key)))
            return _original(self, opened, unit=unit, key=key, **kwargs)

        assign(cls, "decode", decode)


def _read_decoded(path: pathlib.Path) -> list[Any]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(x) if isinstance(x, list) else x for x in map(json.loads, lines)]


class Decodes:
    """The samples decoded since the last `reset()`, in this process and its DataLoader workers."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def reset(self) -> None:
        self.path.write_text("")

    def taken(self) -> list[Any]:
        return _read_decoded(self.path)


@pytest.fixture
def decodes(monkeypatch, tmp_path) -> Decodes:
    log = Decodes(tmp_path / "decoded.jsonl")
    _patch_decodes(monkeypatch.setattr, log.path)
    return log


def _flat(batches: Iterable[list[Any]]) -> list[Any]:
    return [x for batch in batches for x in batch]


def _assert_decoded_once(decoded: list[Any], expected: list[Any]) -> None:
    """`decoded` is `expected`, each once (in any order: workers decode side by side)."""
    counts = collections.Counter(decoded)
    assert not [x for x, n in counts.items() if n > 1], "decoded twice after the restore"
    assert counts == collections.Counter(expected), "decoded after the restore: the rest, each once"


# -- StatefulDataLoader ----------------------------------------------------------------------------


def _take(loader: Iterable[Any], ids: Callable[[Any], list[Any]], stop: int | None = None) -> list[list[Any]]:
    """Each batch's sample identities, for the whole iteration or its first `stop` batches (the loop a
    trainer breaks out of to checkpoint)."""
    out: list[list[Any]] = []
    if stop == 0:
        return out
    for batch in loader:
        out.append(ids(batch))
        if len(out) == stop:
            break
    return out


def _released(call: Callable[[], Any]) -> Any:
    """`call()`; an error it raises goes on without its traceback. A DataLoader worker's error, re-raised
    by torch (`ExceptionWrapper.reraise`), is in a reference cycle with the frames that hold the failed
    iterator: the garbage collector ends that later, and then its workers are no longer told to stop
    (their queues are closed first) and are waited for 5 s each. Without the traceback, it ends now."""
    try:
        return call()
    except Exception as exc:
        raise exc.with_traceback(None)


def _stops(n: int) -> list[int]:
    """Where to checkpoint in an epoch of `n` batches: before the first, after the first, mid-epoch,
    before the last, after the last."""
    return sorted({0, 1, n // 2, n - 1, n})


def _only_the_rest(decoded: list[Any], full: list[list[Any]], k: int) -> None:
    _assert_decoded_once(decoded, _flat(full[k:]))


def _check_resumes(make: Callable[[], tuple[Any, StatefulDataLoader]], ids: Callable[[Any], list[Any]],
                   decodes: Decodes, stops: Callable[[int], Iterable[int]] = _stops, epoch: int = 1,
                   check_decoded: Callable[[list[Any], list[list[Any]], int], None] = _only_the_rest) -> None:
    """For each stop: `epoch` taken up to it, its `state_dict()` loaded into a fresh (dataset, loader)
    from `make`: the rest of `epoch` as uninterrupted, decoding only that (or what `check_decoded`
    says, given the decoded samples, the epoch's batches and the stop), then `epoch + 1` as
    uninterrupted. `len()` of the loader and of the dataset stays the epoch's."""
    full = {}
    for e in (epoch, epoch + 1):
        dataset, loader = make()
        dataset.set_epoch(e)
        full[e] = _take(loader, ids)
    n, size = len(full[epoch]), len(dataset)
    assert n >= 4 and len(loader) == n
    for k in stops(n):
        dataset, first = make()
        dataset.set_epoch(epoch)
        assert _take(first, ids, k) == full[epoch][:k]
        state = first.state_dict()
        del first
        dataset, resumed = make()
        resumed.load_state_dict(state)
        assert len(dataset) == size and len(resumed) == n, "len(): the epoch's, those the state had taken included"
        decodes.reset()
        dataset.set_epoch(epoch)  # (as trainers do at an epoch's start; the saved epoch keeps the position)
        assert _take(resumed, ids) == full[epoch][k:], f"resumed after {k} of {n} batches"
        check_decoded(decodes.taken(), full[epoch], k)
        assert len(dataset) == size and len(resumed) == n
        dataset.set_epoch(epoch + 1)
        assert _take(resumed, ids) == full[epoch + 1]


def _samples(case: Case) -> Callable[[list[dict[str, Any]]], list[Any]]:
    return lambda batch: [case.sample(s) for s in batch]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_stateful_dataloader_resumes_at_the_next_sample(kind, workers, cases, decodes):
    case = cases[kind]

    def make():
        dataset = trainer_dataset(case.root, "train", batch_size=B, seed=SEED, **case.options)
        return dataset, StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)

    _check_resumes(make, _samples(case), decodes)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_batch_inside_the_datasets_resumes_mid_batch(workers, cases, decodes):
    """`trainer_dataset(world_size=2)` yields global batches of 2 x B samples; a DataLoader of B stops
    after an odd number of batches inside one of them: its rows already yielded are not decoded again."""
    case = cases["vqa"]

    def make():
        dataset = trainer_dataset(case.root, "train", batch_size=B, world_size=2, shard_ranks=False, seed=SEED,
                                  **case.options)
        assert len(dataset) % (2 * B) == 0
        return dataset, StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)

    _check_resumes(make, _samples(case), decodes, stops=lambda n: [1, 3, n // 2 + 1, n - 1])


def _shards(case: Case, rank: int, workers: int) -> Callable[[], tuple[Any, StatefulDataLoader]]:
    """Rank `rank` of 2 as accelerate feeds it without dispatching: its slice of each global batch."""
    from accelerate.data_loader import IterableDatasetShard

    def make():
        dataset = trainer_dataset(case.root, "train", batch_size=B, world_size=2, shard_ranks=False, seed=SEED,
                                  **case.options)
        shard = IterableDatasetShard(dataset, batch_size=B, num_processes=2, process_index=rank)
        return shard, StatefulDataLoader(shard, batch_size=B, num_workers=workers, collate_fn=list)

    return make


def _among(decoded: list[Any], full: list[list[Any]], k: int) -> None:
    assert set(_flat(full[k:])) <= set(decoded)


@pytest.mark.filterwarnings("ignore:Neither dataset nor iter")
@pytest.mark.parametrize("workers", [0, 2])
def test_accelerates_iterable_dataset_shard_resumes_each_rank_exactly(workers, cases, decodes):
    """Each rank's slice resumes where it stopped (by torchdata's fast-forward: see the next test)."""
    case = cases["vqa"]
    for rank in (0, 1):
        _check_resumes(_shards(case, rank, workers), _samples(case), decodes, stops=lambda n: [1, n - 1],
                       check_decoded=_among)


def _global_batches_once(decoded: list[Any], full: list[list[Any]], k: int) -> None:
    """Each rank decodes whole global batches (both ranks' slices): after the restore, those not yet taken, once."""
    _among(decoded, full, k)
    assert len(decoded) == len(set(decoded)) == 2 * len(_flat(full[k:])), "the untaken global batches, once"


@pytest.mark.xfail(strict=True, reason="accelerate's IterableDatasetShard has no state_dict/load_state_dict, so "
                   "StatefulDataLoader never asks the dataset inside it for its position and fast-forwards instead, "
                   "decoding the global batches the state had taken again")
@pytest.mark.filterwarnings("ignore:Neither dataset nor iter")
def test_accelerates_iterable_dataset_shard_decodes_nothing_twice(cases, decodes):
    case = cases["vqa"]
    _check_resumes(_shards(case, 0, 2), _samples(case), decodes, stops=lambda n: [1],
                   check_decoded=_global_batches_once)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_stateful_dataloader_resumes_batches(kind, workers, cases, decodes):
    """`make_stream_dataset(flatten=False)`: the kind's batches, in a DataLoader that does not batch again."""
    case = cases[kind]

    def make():
        dataset = make_stream_dataset(case.root, "train", batch_size=B, seed=SEED, flatten=False, **case.options)
        return dataset, StatefulDataLoader(dataset, batch_size=None, num_workers=workers)

    _check_resumes(make, case.batch, decodes, stops=lambda n: [0, 1, n // 2, n])


def test_snapshots_every_n_steps_replay_only_the_steps_since_the_last(cases, decodes):
    """`snapshot_every_n_steps=3`: torchdata restores the workers' positions of the last snapshot and
    reads the batches since again (decoded twice: those only), then goes on exactly."""
    case, every = cases["vqa"], 3

    def make():
        dataset = trainer_dataset(case.root, "train", batch_size=B, seed=SEED, **case.options)
        return dataset, StatefulDataLoader(dataset, batch_size=B, num_workers=2, collate_fn=list,
                                           snapshot_every_n_steps=every)

    _check_resumes(make, _samples(case), decodes, stops=lambda n: [1, 3, 5, n - 1],
                   check_decoded=lambda decoded, full, k: _assert_decoded_once(decoded, _flat(full[k - k % every:])))


# -- what is refused -------------------------------------------------------------------------------


def _saved(root: str, workers: int = 2, **options: Any) -> dict[str, Any]:
    """A StatefulDataLoader's state one batch into epoch 1 of an SA-1B `trainer_dataset`."""
    dataset = trainer_dataset(root, "train", **{"batch_size": B, "seed": SEED, **SA1B, **options})
    dataset.set_epoch(1)
    loader = StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)
    next(iter(loader))
    return loader.state_dict()


def _resume(root: str, state: dict[str, Any], split: str = "train", workers: int = 2, **options: Any) -> None:
    dataset = trainer_dataset(root, split, **{"batch_size": B, "seed": SEED, **SA1B, **options})
    loader = StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)
    loader.load_state_dict(state)
    _released(lambda: next(iter(loader)))


@pytest.mark.parametrize(("change", "message"), [
    ({"seed": 4}, "the state's seed is 3, this loader's is 4"),
    ({"batch_size": 3}, "the state's batch_size is 2, this loader's is 3"),
    ({"image_size": 48}, r"the state was saved with other options of the kind \(image_size: 32 there, 48 here\)"),
    ({"split": "val"}, "the state's split is 'train', this loader's is 'val'"),
    ({"workers": 3}, r"the state is of DataLoader worker (\d) of 2, this is worker \1 of 3: resume with num_workers=2"),
    # trainer_dataset(shard_ranks=False) batches by batch_size x world_size: that is what differs
    ({"world_size": 2}, "the state's batch_size is 2, this loader's is 4"),
])
def test_a_state_of_another_loader_is_refused_at_the_first_batch(change, message, sa1b_dataset):
    """The error, raised in a worker, reaches the main process with its type and message (torch wraps it)."""
    state = _saved(sa1b_dataset)
    with pytest.raises(ConfigError, match=f"cannot resume: {message}"):
        _resume(sa1b_dataset, state, **change)


def test_a_state_of_another_rank_resumes_in_step_and_another_world_is_refused(sa1b_dataset):
    """Lightning saves rank 0's state and loads it on every rank: the ranks' workers move in step."""
    keys = lambda b: [s["keys"] for s in b]  # noqa: E731
    state = _saved(sa1b_dataset, shard_ranks=True, rank=0, world_size=2)

    def rank_one(state: dict[str, Any] | None, **options: Any) -> list[list[str]]:
        dataset = trainer_dataset(sa1b_dataset, "train", **{"batch_size": B, "seed": SEED, **SA1B, "shard_ranks": True,
                                                            "rank": 1, "world_size": 2, **options})
        dataset.set_epoch(1)
        loader = StatefulDataLoader(dataset, batch_size=B, num_workers=2, collate_fn=list)
        if state is not None:
            loader.load_state_dict(state)
        return _released(lambda: _take(loader, keys))

    assert rank_one(state) == rank_one(None)[1:]
    with pytest.raises(ConfigError, match="the state is of rank 0 of world_size 2, this dataset is rank 1 of world_size "
                                          "2; .* and with on_error='skip' on its own rank only"):
        rank_one(state, on_error="skip")
    with pytest.raises(ConfigError, match="the state is of rank 0 of world_size 2, this dataset is rank 0 of "
                                          "world_size 1"):
        _resume(sa1b_dataset, state, shard_ranks=True, rank=0, world_size=1)


def test_between_workers_and_none_torchdata_refuses_the_state_itself(sa1b_dataset):
    """2 -> 0 workers and 0 -> 2: the loader's states differ in form, and StatefulDataLoader refuses them
    before the dataset sees them (its own assertion, which names no worker counts)."""
    with pytest.raises(AssertionError, match="_num_yielded"):
        _resume(sa1b_dataset, _saved(sa1b_dataset, workers=2), workers=0)
    with pytest.raises(AssertionError, match="_snapshot"):
        _resume(sa1b_dataset, _saved(sa1b_dataset, workers=0), workers=2)


def test_a_dataset_state_of_another_worker_count_names_both(sa1b_dataset):
    """The dataset's own check, where a state of a worker reaches a process iterating alone."""
    state = _saved(sa1b_dataset)["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    dataset = trainer_dataset(sa1b_dataset, "train", batch_size=B, seed=SEED, **SA1B)
    with pytest.raises(ConfigError, match="the state is of DataLoader worker 1 of 2, this is worker 0 of 1: resume "
                                          "with num_workers=2"):
        dataset.load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_an_epoch_resumes_with_the_next_epoch(workers, cases, decodes):
    """A checkpoint at an epoch's end (the loop done: StatefulDataLoader's state says finished); the
    resumed run sets the next epoch and plays it whole, decoding nothing of the last."""
    case = cases["sa1b"]

    def make():
        dataset = trainer_dataset(case.root, "train", batch_size=B, seed=SEED, **case.options)
        return dataset, StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)

    ids = _samples(case)
    dataset, loader = make()
    dataset.set_epoch(2)
    full = _take(loader, ids)
    dataset, loader = make()
    dataset.set_epoch(1)
    _take(loader, ids)
    state = loader.state_dict()
    dataset, loader = make()
    loader.load_state_dict(state)
    decodes.reset()
    dataset.set_epoch(2)
    assert _released(lambda: _take(loader, ids)) == full
    _assert_decoded_once(decodes.taken(), _flat(full))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_state_carries_its_epoch(workers, sa1b_dataset):
    """Without `set_epoch`, a resumed loader plays the state's epoch; another epoch set before the first
    batch is refused, naming both (the position belongs to its epoch)."""
    def make():
        dataset = trainer_dataset(sa1b_dataset, "train", batch_size=B, seed=SEED, **SA1B)
        return dataset, StatefulDataLoader(dataset, batch_size=B, num_workers=workers, collate_fn=list)

    dataset, loader = make()
    dataset.set_epoch(1)
    full = _take(loader, lambda b: [s["keys"] for s in b])
    state = _saved(sa1b_dataset, workers=workers)
    dataset, loader = make()
    loader.load_state_dict(state)
    assert _take(loader, lambda b: [s["keys"] for s in b]) == full[1:]
    dataset, loader = make()
    loader.load_state_dict(state)
    dataset.set_epoch(2)
    with pytest.raises(ConfigError, match=r"the loaded state is of epoch 1 after \[\], with \d+ batches of this worker "
                                          r"left, and this dataset was set to epoch 2 after \[\] since; call set_epoch\(1\)"):
        _released(lambda: next(iter(loader)))


# -- accelerate ------------------------------------------------------------------------------------


class _Ids:
    """A collate_fn: each sample's number, as a tensor (accelerate concatenates tensors when it dispatches)."""

    def __init__(self, numbers: dict[str, int]) -> None:
        self.numbers = numbers

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor([self.numbers[s["keys"]] for s in samples])}


class _Scalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self) -> torch.Tensor:
        return (self.weight - 1) ** 2


def _numbers(root: str) -> dict[str, int]:
    return {key: i for i, key in enumerate(split_keys(root))}


def _keys(root: str, ids: list[int]) -> list[str]:
    key = {i: k for k, i in _numbers(root).items()}
    return [key[i] for i in ids]


def _prepare(root: str, dispatch: bool | None, batch_size: int = B) -> tuple[Any, ...]:
    """(accelerator, model, optimizer, loader): a fresh Accelerator with a stateful DataLoader over a
    fresh SA-1B `trainer_dataset` with 2 workers (its world: torch.distributed's, which accelerate starts)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                                  dispatch_batches=dispatch))
    model = _Scalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = trainer_dataset(root, "train", batch_size=batch_size, seed=SEED, **SA1B)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=2, collate_fn=_Ids(_numbers(root)))
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _train(accelerator: Any, model: Any, optimizer: Any, loader: Any, stop: int | None = None,
           checkpoint: str | None = None) -> list[list[int]]:
    """One epoch of training (or its first `stop` steps, then `save_state(checkpoint)`): each step's ids."""
    seen: list[list[int]] = []
    for batch in loader if stop != 0 else ():
        seen.append(batch["ids"].tolist())
        accelerator.backward(model())
        optimizer.step()
        optimizer.zero_grad()
        if len(seen) == stop:
            break
    if stop is not None:
        accelerator.save_state(checkpoint)
    return seen


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps its state in process-wide singletons: reset before and after the test."""
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield
    reset()


def _weight(model: Any) -> float:
    return float(model.weight.detach())


@pytest.mark.parametrize("dispatch", [None, False])  # None: accelerate's default, dispatching an iterable dataset
def test_accelerate_save_state_load_state_resumes_exactly(dispatch, sa1b_dataset, decodes, tmp_path, fresh_accelerate):
    run = _prepare(sa1b_dataset, dispatch)
    full = [_train(*run), _train(*run)]  # (accelerate sets the dataset's epoch: 0, then 1)
    weight, n = _weight(run[1]), len(full[0])
    assert len(run[3]) == n and full[0] != full[1]
    for k in _stops(n)[:-1]:  # (after the epoch's last step: the next test)
        checkpoint = str(tmp_path / f"checkpoint-{k}")
        assert _train(*_prepare(sa1b_dataset, dispatch), stop=k, checkpoint=checkpoint) == full[0][:k]
        resumed = _prepare(sa1b_dataset, dispatch)
        accelerator, model, loader = resumed[0], resumed[1], resumed[3]
        accelerator.load_state(checkpoint)
        decodes.reset()
        assert _train(*resumed) == full[0][k:], f"resumed after {k} of {n} steps"
        _assert_decoded_once(decodes.taken(), _keys(sa1b_dataset, _flat(full[0][k:])))
        assert len(loader) == n
        assert _train(*resumed) == full[1], "the next epoch"
        assert _weight(model) == weight, "the same steps as uninterrupted"


def test_accelerate_a_checkpoint_after_an_epochs_last_step_resumes_with_the_next_epoch(sa1b_dataset, decodes, tmp_path,
                                                                                       fresh_accelerate):
    """accelerate marks the state of the epoch's last step finished (`_iterator_finished`); the resumed
    loop goes on with the next epoch, which it tells the loader (accelerate does not save its epoch)."""
    run = _prepare(sa1b_dataset, None)
    full = [_train(*run), _train(*run)]
    _train(*_prepare(sa1b_dataset, None), stop=len(full[0]), checkpoint=str(tmp_path / "checkpoint"))
    resumed = _prepare(sa1b_dataset, None)
    accelerator, loader = resumed[0], resumed[3]
    accelerator.load_state(str(tmp_path / "checkpoint"))
    decodes.reset()
    loader.set_epoch(1)
    assert _released(lambda: _train(*resumed)) == full[1]
    _assert_decoded_once(decodes.taken(), _keys(sa1b_dataset, _flat(full[1])))


# -- accelerate on 2 processes ---------------------------------------------------------------------

STOP = 1  # the step after which the two-process runs save their state


@pytest.fixture(scope="module")
def two_processes(sa1b_dataset, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """`_rank` on 2 torchrun processes, accelerate with and without dispatching: each rank's results."""
    out = tmp_path_factory.mktemp("stateful-two")
    torchrun(__file__, 2, sa1b_dataset, str(out))
    return {mode: [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in (0, 1)]
            for mode in ("dispatch", "shards", "loader")}


@pytest.mark.slow
def test_accelerate_on_two_processes_with_the_loader_registered_resumes_exactly(two_processes, sa1b_dataset):
    """The exact way on several processes: `make_stream_loader` (it splits the ranks itself), not prepared,
    `register_for_checkpointing`: process 0's state, loaded on every process, as the loader's own contract."""
    runs = two_processes["loader"]
    for run in runs:
        assert run["first"] + run["rest"] == run["full"][0] and run["next"] == run["full"][1]
        assert sorted(run["decoded"]) == sorted(_numbers(sa1b_dataset)[k] for step in run["rest"] for k in step)
    assert run["full"][0] != run["full"][1]
    taken = [k for run in runs for epoch in run["full"][:1] for step in epoch for k in step]
    assert len(taken) == len(set(taken)), "each sample on one process only"


@pytest.mark.slow
def test_accelerate_on_two_processes_slicing_global_batches_resumes_exactly(two_processes):
    """dispatch_batches=False: each process slices each global batch (`IterableDatasetShard`)."""
    runs = two_processes["shards"]
    for run in runs:
        assert run["rest"] == run["full"][0][STOP:] and run["next"] == run["full"][1]
    steps = [sorted(a + b) for a, b in zip(runs[0]["full"][0], runs[1]["full"][0])]
    assert sorted(_flat(steps)) == sorted(set(_flat(steps))), "every sample once per epoch, over both processes"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="accelerate's IterableDatasetShard has no state_dict/load_state_dict: "
                   "StatefulDataLoader fast-forwards, decoding the epoch's taken global batches again on each rank")
def test_accelerate_on_two_processes_slicing_global_batches_decodes_nothing_twice(two_processes):
    runs = two_processes["shards"]
    rest = sorted(_flat(runs[0]["rest"]) + _flat(runs[1]["rest"]))  # (each rank decodes both slices)
    for run in runs:
        assert sorted(run["decoded"]) == rest


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="accelerate's DataLoaderDispatcher saves its look-ahead: process 0's state "
                   "is taken after the next step's first batches were fetched (adjust_state_dict_for_prefetch only "
                   "corrects counters, and not a multi-worker state's), and every process writes the same "
                   "dl_state_dict.bin, the others a state they never updated")
def test_accelerate_on_two_processes_dispatching_resumes_exactly(two_processes):
    for run in two_processes["dispatch"]:
        assert run["rest"] == run["full"][0][STOP:]


def _rank(root: str, out: str) -> None:
    """Each mode: 2 uninterrupted epochs; a run saved after `STOP` steps; a fresh one loaded from it."""
    rank, out_dir = int(os.environ["RANK"]), pathlib.Path(out)
    log = out_dir / f"decoded-{rank}.jsonl"
    _patch_decodes(setattr, log)
    for mode, dispatch in (("shards", False), ("dispatch", None)):
        run = _prepare(root, dispatch, batch_size=1)
        full = [_train(*run), _train(*run)]
        checkpoint = str(out_dir / f"checkpoint-{mode}")
        _train(*_prepare(root, dispatch, batch_size=1), stop=STOP, checkpoint=checkpoint)
        resumed = _prepare(root, dispatch, batch_size=1)
        resumed[0].wait_for_everyone()
        resumed[0].load_state(checkpoint)
        log.write_text("")
        rest = _train(*resumed)
        decoded = [_numbers(root)[key] for key in _read_decoded(log)]
        result = {"full": full, "rest": rest, "decoded": decoded, "next": _train(*resumed)}
        (out_dir / f"{mode}-{rank}.json").write_text(json.dumps(result))
        resumed[0].wait_for_everyone()
    run = _loader_run(root)
    full = [_loader_epoch(*run)]
    run[2].set_epoch(1)
    full.append(_loader_epoch(*run))
    checkpoint = str(out_dir / "checkpoint-loader")
    first = _loader_epoch(*_loader_run(root), stop=STOP, checkpoint=checkpoint)
    run = _loader_run(root, load=checkpoint)
    log.write_text("")
    rest = _loader_epoch(*run)
    decoded = [_numbers(root)[key] for key in _read_decoded(log)]
    run[2].set_epoch(1)
    result = {"full": full, "first": first, "rest": rest, "decoded": decoded, "next": _loader_epoch(*run)}
    (out_dir / f"loader-{rank}.json").write_text(json.dumps(result))


def _loader_run(root: str, load: str | None = None) -> tuple[Any, Any, Any]:
    """(accelerator, model, loader): `make_stream_loader` registered for checkpointing, not prepared (it
    splits the ranks itself), its state loaded from `load`."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_Scalar())
    loader = make_stream_loader(root, "train", batch_size=B, num_workers=2, seed=SEED, **SA1B)
    accelerator.register_for_checkpointing(loader)
    if load:
        accelerator.load_state(load)
    return accelerator, model, loader


def _loader_epoch(accelerator: Any, model: Any, loader: Any, stop: int | None = None,
                  checkpoint: str | None = None) -> list[list[str]]:
    seen = []
    for batch in loader:
        seen.append(list(batch["keys"]))
        accelerator.backward(model())
        if len(seen) == stop:
            break
    if stop is not None:
        accelerator.save_state(checkpoint)
    return seen


def _main(argv: list[str]) -> int:
    _rank(*argv)
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

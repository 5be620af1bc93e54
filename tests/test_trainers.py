"""Trainers for real, no mocks and no hub: TRL's GRPOTrainer on `trl_dataset` (a tiny LLaVA built
offline) and HF Trainer on `trainer_dataset`, on 1 and 2 processes (torchrun, gloo on 127.0.0.1),
with 0 and 2 DataLoader workers; `len()` against what a DataLoader yields; `make_stream_dataset`.

Run as a script, this file is what each torchrun process runs (`_main`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys
from typing import Any

import pytest
import torch
from PIL import Image

from pipeline import make_stream_dataset, make_stream_loader, trainer_dataset, trl_dataset
from conftest import indexed
from procs import end_process_group, torchrun

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = 3


# -- data and model, built offline -----------------------------------------------------------------


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="session")
def vlm(vqa, tmp_path_factory) -> str:
    """A random-weight LLaVA saved as a model folder: 2-layer CLIP vision tower (16 px images, 8 px
    patches), 2-layer Llama, a byte-level BPE tokenizer trained on the dataset's questions and answers,
    and a chat template with an image token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              PreTrainedTokenizerFast)
    from transformers.models.clip import CLIPImageProcessorPil  # (the default one needs torchvision)

    text = [f"user: {q}\nassistant: {a}" for q, a in _questions(vqa, texts=True)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<pad>", "<s>", "</s>", "<image>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 16},
                                                                     crop_size={"height": 16, "width": 16}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               chat_template=TEMPLATE, num_additional_image_tokens=1)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=16, patch_size=8, projection_dim=16),
        text_config=LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llava")
    LlavaForConditionalGeneration(config).save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


def _questions(root: str, epoch: int = 0, texts: bool = False) -> list[Any]:
    """The loader's plan for (SEED, epoch) on one process: (image key, qid) of every question, in order."""
    loader = make_stream_loader(root, "train", batch_size=1, num_workers=0, seed=SEED, drop_last=False,
                                rank=0, world_size=1, per="question", image_size=16)
    loader.set_epoch(epoch)
    return [(b["questions"][0], b["answers"][0]) if texts else (b["keys"][0], b["fields"][0]["qid"]) for b in loader]


def _source_questions(root: str) -> dict[int, tuple[str, str]]:
    """qid -> (question, answer) of every question, as the `vqa` fixture's SLAKE annotation file
    (`<root>/../src/train.json`) has them: read as JSON, not through the loader; as text, as the VQA
    packer documents it (strings as they are, JSON numbers and booleans as JSON text)."""
    records = json.loads((pathlib.Path(root).parent / "src" / "train.json").read_text())
    text = lambda value: value if isinstance(value, str) else json.dumps(value)  # noqa: E731
    return {r["qid"]: (text(r["question"]), text(r["answer"])) for r in records}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("grpo_vqa", REPO / "examples" / "grpo_vqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- trl_dataset and make_stream_dataset, as datasets and DataLoaders see them ---------------------


def test_trl_dataset_every_question_once_in_the_plan_of_each_epoch(vqa):
    import datasets
    from datasets.distributed import split_dataset_by_node

    ds = trl_dataset(vqa, "train", image_size=40, seed=SEED)
    assert isinstance(ds, datasets.IterableDataset) and ds.num_shards == 1
    truth = _source_questions(vqa)
    assert ds.info.splits["train"].num_examples == len(truth)
    for x in ds:
        assert x["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": x["question"]}]}]
        assert isinstance(x["image"], Image.Image) and x["image"].mode == "RGB" and max(x["image"].size) == 40
        assert (x["question"], x["answer"]) == truth[x["qid"]]
        assert x["img_name"] == x["image_path"] and x["q_lang"] == "en", "original fields beside ours"
    plans = {e: [qid for _, qid in _questions(vqa, e)] for e in (0, 1, 2)}
    assert plans[0] != plans[1] != plans[2]

    def order(dataset, epoch, **loader):
        dataset.set_epoch(epoch)
        if not loader:
            return [x["qid"] for x in dataset]
        return [x["qid"] for batch in torch.utils.data.DataLoader(dataset, collate_fn=list, **loader) for x in batch]

    # The epoch reaches the plan from the dataset itself and from datasets derived from it.
    mapped = ds.map(lambda batch: batch, batched=True, batch_size=3)
    for epoch in (1, 0, 2):
        assert order(ds, epoch) == order(mapped, epoch) == plans[epoch]
        # One data source: one DataLoader worker reads it all, whatever the number of workers.
        assert order(mapped, epoch, batch_size=3, num_workers=2) == plans[epoch]
        # Ranks that do not slice global batches themselves: every world_size-th question.
        parts = [order(split_dataset_by_node(ds, rank, 2), epoch) for rank in (0, 1)]
        assert parts == [plans[epoch][0::2], plans[epoch][1::2]]


def test_trl_dataset_images_at_a_pixel_budget_unpadded(vqa):
    from pipeline.images import smart_resize

    budget = dict(pixel_factor=14, min_pixels=56 * 56, max_pixels=70 * 70)
    ds = trl_dataset(vqa, "train", image_size=None, seed=SEED, **budget)
    sizes = set()
    for x in ds:
        with Image.open(pathlib.Path(vqa).parent / "src" / "images" / x["image_path"]) as original:
            h, w = smart_resize(original.height, original.width, 14, 56 * 56, 70 * 70)
        assert isinstance(x["image"], Image.Image) and x["image"].mode == "RGB"
        assert (x["image"].height, x["image"].width) == (h, w), "its own budgeted size, no padding"
        sizes.add((h, w))
    assert len(sizes) > 1, "images of several sizes"
    with pytest.raises(ValueError, match="needs image_size=None"):
        trl_dataset(vqa, "train", **budget)


def test_trl_dataset_refuses_other_kinds(sa1b_dataset):
    with pytest.raises(ValueError, match="sa1b datasets do not take 'form'"):
        trl_dataset(sa1b_dataset, "train")


def _broken_record(dataset: str, tmp_path: pathlib.Path, index: int, garbage: bytes):
    """A copy of `dataset` whose first train shard's sample `index` has `garbage` at the start of its
    msgpack record (the member after the image): (root, shard, its index)."""
    root = tmp_path / "broken"
    shutil.copytree(dataset, root)
    shard, shard_index = indexed(str(root))[0]
    data = bytearray((root / shard.name).read_bytes())
    start = shard_index.span(index)[0]
    size = int(data[start + 124 : start + 136].rstrip(b"\0"), 8)  # the image member's size field
    record = start + 512 + size + (-size % 512) + 512
    data[record : record + len(garbage)] = garbage
    (root / shard.name).write_bytes(bytes(data))
    return root, shard, shard_index


def test_trl_dataset_errors_and_skips(vqa, tmp_path):
    from pipeline import SampleError

    root, shard, index = _broken_record(vqa, tmp_path, 1, b"\xc1" * 4)
    with pytest.raises(SampleError, match=rf"{shard.name}: sample {index.key(1)!r}, field 'msgpack': cannot unpack"):
        list(trl_dataset(str(root), "train", shuffle=False))
    lost = int(index.units[1])
    ds = trl_dataset(str(root), "train", on_error="skip", max_errors=lost, image_size=16)
    for epoch in range(2):
        ds.set_epoch(epoch)
        keys = [x["key"] for x in ds]
        assert len(keys) == len(_questions(vqa)) - lost and index.key(1) not in keys


def _kinds(vqa: str, sa1b: str, emb: str) -> dict[str, tuple[str, dict[str, Any], Any]]:
    """kind -> (dataset, options, a sample's identity)."""
    return {"vqa": (vqa, {"per": "question", "image_size": 16}, lambda s: (s["keys"], int(s["question_index"]))),
            "sa1b": (sa1b, {"image_size": 32, "mask_size": 16, "max_masks": 4}, lambda s: s["keys"]),
            "embeddings": (emb, {}, lambda s: int(s["row"]))}


@pytest.mark.parametrize("kind", ["vqa", "sa1b", "embeddings"])
def test_a_dataloaders_first_len_batches_hold_every_sample(kind, vqa, sa1b_dataset, emb):
    from accelerate.data_loader import IterableDatasetShard

    root, options, identity = _kinds(vqa, sa1b_dataset, emb)[kind]
    everything = {identity(s) for s in make_stream_dataset(root, "train", batch_size=1, flatten=True, drop_last=False,
                                                           shuffle=False, **options)}
    for batch_size, workers, world, shard_ranks in ((3, 2, 1, False), (2, 3, 1, False), (3, 2, 2, False),
                                                    (2, 2, 2, True), (4, 0, 2, True), (3, 0, 1, False)):
        seen = []
        for rank in range(world):
            ds = trainer_dataset(root, "train", batch_size=batch_size, shard_ranks=shard_ranks, rank=rank if shard_ranks
                                 else None, world_size=world, seed=SEED, **options)
            ds.set_epoch(1)
            if world > 1 and not shard_ranks:  # accelerate's own split of each global batch
                ds = IterableDatasetShard(ds, batch_size=batch_size, num_processes=world, process_index=rank)
            loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=list)
            batches = list(loader)
            assert len(batches) == len(loader) and all(len(b) == batch_size for b in batches)
            seen += [identity(s) for b in batches for s in b]
        assert len(seen) == len(set(seen)) == len(everything) - len(everything) % (batch_size * world)
        assert set(seen) <= everything, (kind, batch_size, workers, world)
    one = trainer_dataset(root, "train", batch_size=3, drop_last=False, **options)
    assert len(torch.utils.data.DataLoader(one, batch_size=3, num_workers=2)) == -(-len(everything) // 3)
    assert {identity(s) for b in torch.utils.data.DataLoader(one, batch_size=3, num_workers=2, collate_fn=list)
            for s in b} == everything
    with pytest.raises(ValueError, match="drop_last=False needs a single process"):
        trainer_dataset(root, "train", batch_size=3, drop_last=False, world_size=2, **options)


@pytest.mark.parametrize("kind", ["vqa", "sa1b", "embeddings"])
def test_make_stream_dataset_yields_the_documented_batches_and_samples(kind, vqa, sa1b_dataset, emb):
    root, options, identity = _kinds(vqa, sa1b_dataset, emb)[kind]
    loader = make_stream_loader(root, "train", batch_size=3, num_workers=0, seed=SEED, **options)
    expected = list(loader)
    batches = list(make_stream_dataset(root, "train", batch_size=3, seed=SEED, **options))
    samples = make_stream_dataset(root, "train", batch_size=3, seed=SEED, flatten=True, **options)
    rows = list(torch.utils.data.DataLoader(samples, batch_size=None, num_workers=2))
    assert len(samples) == len(rows) == 3 * len(expected)
    assert sorted(map(identity, rows)) == sorted(identity(s) for b in expected for s in _rows(b))
    for got, want in zip(batches, expected):
        assert got.keys() == want.keys()
        for name in want:
            assert (torch.equal(got[name], want[name]) if isinstance(want[name], torch.Tensor)
                    else got[name] == want[name]), name
    row = {identity(r): r for r in rows}
    for b in expected:
        for i, want in enumerate(_rows(b)):
            got = row[identity(want)]
            assert got.keys() == b.keys()
            if kind == "sa1b":  # a sample's own masks only: the batch's padding is cut
                n = int(b["mask_counts"][i])
                assert got["masks"].shape[0] == got["boxes"].shape[0] == n and torch.equal(got["masks"], b["masks"][i, :n])


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    b = len(next(iter(batch.values())))
    return [{name: value[i] for name, value in batch.items()} for i in range(b)]


# -- GRPO ------------------------------------------------------------------------------------------

# 4 questions per generation round on 1 or 2 processes: 4 steps per epoch
GRPO = {"num_generations": 2, "image_size": 16, "seed": SEED, "max_completion_length": 2,
        "report_to": "none", "save_strategy": "no", "use_cpu": True, "bf16": False, "logging_steps": 1000,
        "disable_tqdm": True}


class _Rewards:
    """A reward function that records what each call receives (the questions, in order) and scores 0."""

    def __init__(self, path: pathlib.Path | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.path = path
        self.__name__ = "record"

    def __call__(self, completions, prompts, question, answer, qid, img_name, image_path, q_lang, image,
                 trainer_state, **kwargs) -> list[float]:
        assert all(isinstance(i, Image.Image) and i.mode == "RGB" and max(i.size) == 16 for i in image)
        assert img_name == image_path and set(q_lang) == {"en"}, "original fields beside ours"
        assert all(p[-1]["content"][-1]["text"] == q for p, q in zip(prompts, question))
        self.calls.append({"step": trainer_state.global_step, "qid": list(qid), "question": list(question),
                           "answer": list(answer)})
        if self.path is not None:
            self.path.write_text(json.dumps(self.calls))
        return [0.0] * len(completions)


def _check_grpo(vqa: str, steps: list[list[dict[str, Any]]], prompts: int) -> None:
    """`steps`: each step's reward calls, one per process. Each epoch holds the plan's questions in
    order, each as one group of `num_generations` (but for TRL's trailing partial round)."""
    ng, plans = GRPO["num_generations"], [_questions(vqa, e) for e in (0, 1)]
    truth = dict(zip([qid for _, qid in plans[0]], _questions(vqa, 0, texts=True)))
    rounds = len(plans[0]) // prompts
    assert len(steps) == 2 * rounds and len(set(truth)) == len(plans[0])
    orders = []
    for epoch in (0, 1):
        qids = [q for step in steps[epoch * rounds : (epoch + 1) * rounds] for call in step for q in call["qid"]]
        groups = [qids[i : i + ng] for i in range(0, len(qids), ng)]
        assert all(len(g) == ng and len(set(g)) == 1 for g in groups), "uniform groups of num_generations"
        orders.append([g[0] for g in groups])
        assert orders[-1] == [qid for _, qid in plans[epoch]][: rounds * prompts], "the plan of (seed, epoch)"
        for step in steps[epoch * rounds : (epoch + 1) * rounds]:
            for call in step:
                assert [truth[q] for q in call["qid"]] == list(zip(call["question"], call["answer"]))
    assert orders[0] != orders[1]


@pytest.mark.slow
def test_grpo_trains_every_question_once_per_epoch_in_groups(vqa, vlm, tmp_path):
    rewards = _Rewards()
    example = _example()
    trainer = example.make_trainer(vlm, vqa, str(tmp_path), epochs=2, reward_funcs=(example.exact_match, rewards),
                                   batch_size=8, dataloader_num_workers=2, **GRPO)
    assert trainer.args.dataloader_num_workers == 0, "TRL reads an iterable dataset in the main process"
    trainer.train()
    _check_grpo(vqa, [[call] for call in rewards.calls], prompts=4)


@pytest.mark.slow
def test_grpo_on_two_processes_splits_each_round(vqa, vlm, tmp_path):
    torchrun(__file__, 2, "grpo", vlm, vqa, str(tmp_path))
    calls = [json.loads((tmp_path / f"rewards-{rank}.json").read_text()) for rank in range(2)]
    assert len(calls[0]) == len(calls[1])
    _check_grpo(vqa, [list(step) for step in zip(*calls)], prompts=4)


class _StopAt:
    """Stops training after global step `step` (its checkpoint saved first)."""

    def __init__(self, step: int) -> None:
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    control.should_save = control.should_training_stop = True

        self.callback = Stop()


@pytest.mark.slow
def test_grpo_resumes_at_the_next_question_without_decoding_again(vqa, vlm, tmp_path):
    from pipeline.kinds.vqa import Vqa

    example, decode = _example(), Vqa.decode
    counts: list[int] = []

    def train(out: str, stop: int | None = None, resume: str | None = None) -> list[dict[str, Any]]:
        rewards, decoded = _Rewards(), [0]

        def counted(self, opened, **kwargs):
            decoded[0] += 1
            return decode(self, opened, **kwargs)

        trainer = example.make_trainer(vlm, vqa, out, epochs=2, reward_funcs=(rewards,), batch_size=8,
                                       callbacks=[_StopAt(stop).callback] if stop else (), **GRPO)
        Vqa.decode = counted
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            Vqa.decode = decode
        counts.append(decoded[0])
        return rewards.calls

    whole = train(str(tmp_path / "whole"))
    assert len(whole) == 8  # 4 rounds of 4 questions an epoch
    for stop in (2, 5):  # in epoch 0; in epoch 1
        out = str(tmp_path / f"stop-{stop}")
        first = train(out, stop=stop)
        resumed = train(out, resume=f"{out}/checkpoint-{stop}")
        assert [c["qid"] for c in first + resumed] == [c["qid"] for c in whole], "the uninterrupted run's questions"
        assert [c["step"] for c in resumed][0] == stop
        taken = (stop // 4) * len(_questions(vqa)) + (stop % 4) * 4  # questions before the resumption point
        assert counts[-1] == counts[0] - taken, "decoded after resuming: what the uninterrupted run decoded from there"
    _check_grpo(vqa, [[call] for call in whole], prompts=4)


def test_the_docs_show_the_example_the_tests_run():
    readme = (REPO / "docs" / "trainers.md").read_text()
    block = readme[readme.index("## GRPO with TRL"):]
    block = block[block.index("```python\n") + 10 : block.index("```\n", block.index("```python\n") + 10)]
    script = (REPO / "examples" / "grpo_vqa.py").read_text()
    imports, _, code = block.partition("\n\n\n")
    assert code.strip() and code in script and all(line in script for line in imports.splitlines())


def _grpo_rank(model: str, shards: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    rewards = _Rewards(pathlib.Path(out) / f"rewards-{rank}.json")
    example = _example()
    example.make_trainer(model, shards, str(pathlib.Path(out) / "grpo"), epochs=2, batch_size=4,
                         reward_funcs=(example.exact_match, rewards), **GRPO).train()


# -- HF Trainer ------------------------------------------------------------------------------------


class _Ids:
    """A data collator: each question's number, as a tensor (what the probe model records)."""

    def __init__(self, ids: dict[tuple[str, int], int]) -> None:
        self.ids = ids

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor([self.ids[(s["keys"], int(s["question_index"]))] for s in samples])}


class _Probe(torch.nn.Module):
    """A model that records the question numbers it trains on, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen[-1].extend(ids.tolist())
        return {"loss": (self.weight - 1) ** 2}


def _numbering(root: str) -> dict[tuple[str, int], int]:
    loader = make_stream_loader(root, "train", batch_size=1, num_workers=0, shuffle=False, drop_last=False,
                                rank=0, world_size=1, per="question", image_size=16)
    return {(b["keys"][0], int(b["question_index"][0])): i for i, b in enumerate(loader)}


def _hf_train(root: str, out: str, workers: int, dispatch: bool | None, batch_size: int = 3) -> dict[str, Any]:
    """2 epochs of HF Trainer over `trainer_dataset`: what this process trained on, per epoch."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Epochs(TrainerCallback):
        def on_epoch_begin(self, args, state, control, model=None, **kwargs):
            probe.seen.append([])

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=2,
                             dataloader_num_workers=workers, remove_unused_columns=False, use_cpu=True,
                             report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True,
                             accelerator_config={} if dispatch is None else {"dispatch_batches": dispatch})
    ds = trainer_dataset(root, "train", batch_size=batch_size, world_size=args.world_size, seed=SEED,
                         per="question", image_size=16)
    probe = _Probe()
    trainer = Trainer(model=probe, args=args, train_dataset=ds, data_collator=_Ids(_numbering(root)),
                      callbacks=[Epochs()])
    steps = len(trainer.get_train_dataloader())
    trainer.train()
    return {"seen": probe.seen, "steps": steps, "samples": len(ds)}


def _expected(root: str, epoch: int, world_size: int, batch_size: int = 3) -> list[int]:
    ids = _numbering(root)
    ds = trainer_dataset(root, "train", batch_size=batch_size, world_size=world_size, seed=SEED, per="question",
                         image_size=16)
    ds.set_epoch(epoch)
    return [ids[(s["keys"], int(s["question_index"]))] for s in ds]


def _check_hf(root: str, runs: list[dict[str, Any]], batch_size: int = 3) -> None:
    """Each epoch trains on every sample the plan keeps, once, across the processes, in len() steps."""
    world = len(runs)
    total = len(_numbering(root))
    for epoch in (0, 1):
        trained = [i for run in runs for i in run["seen"][epoch]]
        expected = _expected(root, epoch, world)
        assert sorted(trained) == sorted(expected) and len(set(trained)) == len(trained)
        assert len(trained) == total - total % (batch_size * world) == runs[0]["samples"]
        for run in runs:
            assert len(run["seen"][epoch]) == run["steps"] * batch_size
    assert _expected(root, 0, world) != _expected(root, 1, world)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_hf_trainer_one_process(vqa, tmp_path, workers):
    _check_hf(vqa, [_hf_train(vqa, str(tmp_path), workers, None)])


@pytest.mark.slow
def test_hf_trainer_two_processes(vqa, tmp_path):
    torchrun(__file__, 2, "hf", vqa, str(tmp_path))
    results = {rank: json.loads((tmp_path / f"hf-{rank}.json").read_text()) for rank in range(2)}
    for name in results[0]:
        _check_hf(vqa, [results[rank][name] for rank in range(2)])
    assert len(results[0]) == 4


def _hf_rank(root: str, out: str) -> None:
    rank, results = int(os.environ["RANK"]), {}
    for workers in (0, 2):
        for dispatch in (None, False):  # accelerate's default for an iterable dataset is to dispatch
            results[f"{workers} workers, dispatch {dispatch}"] = _hf_train(root, f"{out}/hf", workers, dispatch)
    (pathlib.Path(out) / f"hf-{rank}.json").write_text(json.dumps(results))


# -- HF Trainer, resumed mid-epoch -------------------------------------------------------------------


def _hf_resumable(root: str, out: str, workers: int, *, stop: int | None = None, resume: str | None = None,
                  batch_size: int = 2, accumulate: int = 1, world: int = 1, seed: int = SEED,
                  image_size: int = 16) -> dict[str, Any]:
    """HF Trainer over `trainer_dataset` with `resume_callback`, 2 epochs: stopped after global step
    `stop` (a checkpoint there), or resumed from the checkpoint `resume`. What it trained on, per epoch,
    and the samples its process decoded (with no DataLoader workers: counted in this process)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from pipeline import resume_callback
    from pipeline.kinds.vqa import Vqa

    class Epochs(TrainerCallback):
        def on_epoch_begin(self, args, state, control, model=None, **kwargs):
            probe.seen.append([])

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=2,
                             gradient_accumulation_steps=accumulate, dataloader_num_workers=workers,
                             remove_unused_columns=False, use_cpu=True, report_to="none", logging_steps=1000,
                             disable_tqdm=True, save_strategy="steps" if stop else "no", save_steps=stop or 500,
                             max_steps=stop or -1)
    ds = trainer_dataset(root, "train", batch_size=batch_size, world_size=world, seed=seed, per="question",
                         image_size=image_size)
    probe = _Probe()
    trainer = Trainer(model=probe, args=args, train_dataset=ds, data_collator=_Ids(_numbering(root)),
                      callbacks=[Epochs(), resume_callback(ds)])
    decoded = []
    decode = Vqa.decode

    def counted(self, opened, **kwargs):
        decoded.append(1)
        return decode(self, opened, **kwargs)

    Vqa.decode = counted
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        Vqa.decode = decode
    return {"seen": probe.seen, "decoded": len(decoded), "steps": len(trainer.get_train_dataloader()),
            "epoch": trainer.state.epoch, "log": trainer.state.log_history}


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "accumulate", "batch"), [(0, 1, 2), (2, 1, 2), (0, 2, 3)])
def test_hf_trainer_resumes_mid_epoch_exactly_without_replay(vqa, tmp_path, workers, accumulate, batch):
    whole = _hf_resumable(vqa, str(tmp_path / "whole"), workers, accumulate=accumulate, batch_size=batch)
    steps = whole["steps"]  # batches an epoch
    assert steps % accumulate == 0 and steps > 2 * accumulate and len(whole["seen"]) == 2
    for stop in (steps // accumulate // 2, steps // accumulate + 1):  # mid-epoch 0, and early in epoch 1
        out = str(tmp_path / f"stop-{stop}")
        first = _hf_resumable(vqa, out, workers, stop=stop, accumulate=accumulate, batch_size=batch)
        resumed = _hf_resumable(vqa, out, workers, resume=f"{out}/checkpoint-{stop}", accumulate=accumulate,
                                batch_size=batch)
        trained = [i for epoch in first["seen"] + resumed["seen"] for i in epoch]
        assert trained == [i for epoch in whole["seen"] for i in epoch], "the uninterrupted run's samples, in order"
        rest = sum(map(len, resumed["seen"]))
        assert rest == batch * (2 * steps - stop * accumulate)
        if workers == 0:
            assert resumed["decoded"] == rest, "nothing decoded twice"
        assert resumed["epoch"] == whole["epoch"] == 2.0
        epochs = [entry["epoch"] for entry in resumed["log"] if "loss" in entry or "train_loss" in entry]
        assert epochs[-1] == 2.0


@pytest.mark.slow
def test_hf_trainer_resumes_on_two_processes_and_on_one(vqa, tmp_path):
    """2 processes (global batches of 2 x 2, accelerate dispatching them), stopped mid-epoch and resumed
    on 2; the same checkpoint resumed on 1 process with the same global batch (1 x 4)."""
    torchrun(__file__, 2, "hf-resume", vqa, str(tmp_path))
    ranks = [json.loads((tmp_path / f"hf-resume-{rank}.json").read_text()) for rank in range(2)]

    def steps(run: dict[str, Any], rank: int) -> list[list[int]]:  # each global batch's part on this rank
        flat = [i for epoch in run["seen"] for i in epoch]
        return [flat[k : k + 2] for k in range(0, len(flat), 2)]

    whole = [a + b for a, b in zip(steps(ranks[0]["whole"], 0), steps(ranks[1]["whole"], 1))]
    first = [a + b for a, b in zip(steps(ranks[0]["first"], 0), steps(ranks[1]["first"], 1))]
    resumed = [a + b for a, b in zip(steps(ranks[0]["resumed"], 0), steps(ranks[1]["resumed"], 1))]
    stop = len(first)
    assert 0 < stop < len(whole) // 2 and first + resumed == whole
    alone = _hf_resumable(vqa, str(tmp_path / "hf"), 0, resume=str(tmp_path / "hf" / f"checkpoint-{stop}"),
                          batch_size=4)
    flat = [i for epoch in alone["seen"] for i in epoch]
    assert flat == [i for batch in whole[stop:] for i in batch], "the same global batch on 1 process: exact"
    assert alone["decoded"] == len(flat)


def _hf_resume_rank(root: str, out: str) -> None:
    rank, results = int(os.environ["RANK"]), {}
    results["whole"] = _hf_resumable(root, f"{out}/whole", 0, world=2)
    stop = results["whole"]["steps"] // 2
    results["first"] = _hf_resumable(root, f"{out}/hf", 0, stop=stop, world=2)
    results["resumed"] = _hf_resumable(root, f"{out}/hf", 0, resume=f"{out}/hf/checkpoint-{stop}", world=2)
    for run in results.values():
        del run["log"]
    (pathlib.Path(out) / f"hf-resume-{rank}.json").write_text(json.dumps(results))


def test_hf_trainer_resume_refuses_what_it_cannot_do_exactly(vqa, tmp_path):
    from pipeline.errors import ConfigError

    out = str(tmp_path / "run")
    _hf_resumable(vqa, out, 0, stop=2, accumulate=2)  # 9 batches an epoch: the last accumulation is partial
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 does not divide the epoch's 9 batches"):
        _hf_resumable(vqa, out, 0, resume=f"{out}/checkpoint-2", accumulate=2)


def test_hf_trainer_resume_refuses_a_checkpoint_of_another_run(vqa, tmp_path):
    from pipeline.errors import ConfigError

    out = str(tmp_path / "run")
    _hf_resumable(vqa, out, 0, stop=2)
    for change, message in (({"seed": SEED + 1}, "seed is 3, this loader's is 4"),
                            ({"image_size": 24}, "image_size: 16 there, 24 here"),
                            ({"batch_size": 3}, "global batch: 2 there, 3 here")):
        with pytest.raises(ConfigError, match=message):
            _hf_resumable(vqa, out, 0, resume=f"{out}/checkpoint-2", **change)

def _main(argv: list[str]) -> int:
    if argv[0] == "grpo":
        _grpo_rank(*argv[1:])
    elif argv[0] == "hf-resume":
        _hf_resume_rank(*argv[1:])
    else:
        _hf_rank(*argv[1:])
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

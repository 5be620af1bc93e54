"""examples/distill_sam.py as its docstring runs it, with a tiny random SAM built offline: the teacher
phase on 2 torchrun processes writes a complete sidecar whose every embedding is the teacher's of
that very image; the student phase, in one process and on 2, resumed from a checkpoint takes the
uninterrupted run's batches from there, decodes only those, and ends with its weights bit for bit."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import pathlib
import sys
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import make_stream_loader
from pipeline.kinds.sa1b import Sa1b

from conftest import split_keys
from procs import end_process_group, torchrun

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "distill_sam.py"
SIZE = 64  # the tiny teacher's embedding: (32, 8, 8)
TEACHER = ["--tiny", "--image-size", str(SIZE), "--batch-size", "3", "--workers", "0", "--device", "cpu"]
STUDENT = ["--image-size", str(SIZE), "--batch-size", "2", "--workers", "0", "--device", "cpu", "--lr", "0.01",
           "--log-every", "1"]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("distill_sam", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counting_decodes(assign: Any, path: pathlib.Path) -> None:
    """`Sa1b.decode` also appends each key it decodes to `path` (the runs here read in-process)."""
    original = Sa1b.decode

    def decode(self: Any, opened: Any, *, unit: Any, key: str, **kwargs: Any) -> Any:
        with open(path, "a") as f:
            f.write(key + "\n")
        return original(self, opened, unit=unit, key=key, **kwargs)

    assign(Sa1b, "decode", decode)


def _decoded(path: pathlib.Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _weights(checkpoint: pathlib.Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def _assert_same_weights(a: pathlib.Path, b: pathlib.Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{a} and {b}: other weights"


@pytest.fixture(scope="module")
def sidecar(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny teacher's embeddings of the train split, written by the example on 2 torchrun processes."""
    out = tmp_path_factory.mktemp("distill") / "teacher"
    torchrun(str(EXAMPLE), 2, "teacher", sa1b_dataset, str(out), *TEACHER)
    return str(out)


def test_images_are_normalised_as_sams_processor_does() -> None:
    from transformers.models.sam.image_processing_pil_sam import SamImageProcessorPil

    example = _example()
    rng = np.random.default_rng(0)
    images = torch.zeros(2, 3, SIZE, SIZE, dtype=torch.uint8)
    sizes = torch.tensor([[40, 64], [64, 23]])
    processor = SamImageProcessorPil()
    for i, (h, w) in enumerate(sizes.tolist()):
        images[i, :, :h, :w] = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        want = processor(images=images[i, :, :h, :w].permute(1, 2, 0).numpy(), do_resize=False,
                         pad_size={"height": SIZE, "width": SIZE}, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(example.normalize(images, sizes)[i], want, rtol=0, atol=1e-5)


def test_the_teacher_on_two_processes_writes_each_images_embedding(sa1b_dataset: str, sidecar: str) -> None:
    """The sidecar is complete, and each attached embedding is the seeded tiny teacher's of the very
    batch it was written from (the teacher's batches: 3 images, ranks 0 and 1 of 2), bit for bit."""
    assert (pathlib.Path(sidecar) / "outputs.json").is_file()
    example = _example()
    teacher = example.tiny_teacher(SIZE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the torchrun processes ran)
    keys, rows = [], []
    try:
        for rank in (0, 1):
            loader = make_stream_loader(sa1b_dataset, "train", batch_size=3, drop_last=False, rank=rank, world_size=2,
                                        image_size=SIZE, mask_size=16, max_masks=0, attach={"teacher": sidecar})
            for batch in loader:
                with torch.no_grad():
                    want = teacher.get_image_embeddings(example.normalize(batch["images"], batch["image_sizes"]))
                got = batch["teacher"]
                assert got.dtype == torch.float16 and got.shape == (len(batch["keys"]), 32, SIZE // 8, SIZE // 8)
                assert torch.equal(got, want.half())
                keys += batch["keys"]
                rows += list(got)
    finally:
        torch.set_num_threads(threads)
    assert sorted(keys) == sorted(split_keys(sa1b_dataset))
    assert len({row.numpy().tobytes() for row in rows}) == len(rows), "each image its own embedding"


def _student(example: Any, dataset: str, sidecar: str, out: pathlib.Path, steps: int, decoded: pathlib.Path,
             *extra: str) -> tuple[list[str], list[str]]:
    """The student phase in this process: (its printed step lines, the keys it decoded)."""
    decoded.write_text("")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert example.main(["student", dataset, sidecar, str(out), "--steps", str(steps), "--save-every", "3",
                             *STUDENT, *extra]) == 0
    return printed.getvalue().splitlines(), _decoded(decoded)


def test_the_student_in_one_process_resumed_takes_the_rest_of_the_uninterrupted_run(
        sa1b_dataset: str, sidecar: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 batches of 2 an epoch: stopped after step 3 (mid epoch 0) and resumed to step 6 (mid epoch 1)."""
    example, log = _example(), tmp_path / "decoded.txt"
    _counting_decodes(monkeypatch.setattr, log)
    whole, whole_keys = _student(example, sa1b_dataset, sidecar, tmp_path / "whole", 6, log)
    first, first_keys = _student(example, sa1b_dataset, sidecar, tmp_path / "stopped", 3, log)
    rest, rest_keys = _student(example, sa1b_dataset, sidecar, tmp_path / "stopped", 6, log,
                               "--resume", str(tmp_path / "stopped" / "step-00000003.pt"))
    assert [line.split()[:4] for line in whole] == [["step", str(s), "epoch", str((s - 1) // 4)] for s in range(1, 7)]
    assert first + rest == whole, "the same losses at each step"
    assert len(whole_keys) == 12 and first_keys + rest_keys == whole_keys, "decoded after resuming: the rest, once"
    _assert_same_weights(tmp_path / "whole" / "step-00000006.pt", tmp_path / "stopped" / "step-00000006.pt")
    assert not torch.equal(_weights(tmp_path / "whole" / "step-00000003.pt")["net.0.weight"],
                           _weights(tmp_path / "whole" / "step-00000006.pt")["net.0.weight"]), "it trains"


def test_the_student_on_two_processes_resumed_ends_as_the_uninterrupted_run(sa1b_dataset: str, sidecar: str,
                                                                             tmp_path: pathlib.Path) -> None:
    """2 batches of 2 an epoch on each rank: stopped after step 3 (mid epoch 1), resumed to step 5."""
    torchrun(__file__, 2, sa1b_dataset, sidecar, str(tmp_path))
    _assert_same_weights(tmp_path / "whole" / "step-00000005.pt", tmp_path / "stopped" / "step-00000005.pt")
    ranks = [json.loads((tmp_path / f"decoded-{rank}.json").read_text()) for rank in (0, 1)]
    for runs in ranks:
        assert len(runs["whole"]) == 10 and runs["first"] + runs["rest"] == runs["whole"], "the rest, once"
    assert not set(ranks[0]["whole"][:4]) & set(ranks[1]["whole"][:4]), "each rank its own share of epoch 0"


def _student_ranks(dataset: str, sidecar: str, out: str) -> None:
    """The example's student phase on this torchrun process, uninterrupted and stopped then resumed, in
    one process group: the keys each run decoded here, to `out/decoded-<rank>.json`."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, root, example = dist.get_rank(), pathlib.Path(out), _example()
    log = root / f"decoded-{rank}.txt"
    _counting_decodes(setattr, log)
    runs = {}
    for name, run, steps, extra in (("whole", "whole", 5, ()), ("first", "stopped", 3, ()),
                                    ("rest", "stopped", 5, ("--resume", str(root / "stopped" / "step-00000003.pt")))):
        _student(example, dataset, sidecar, root / run, steps, log, *extra)
        runs[name] = _decoded(log)
        dist.barrier()  # (the checkpoint saved before another process loads it)
    (root / f"decoded-{rank}.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    _student_ranks(*sys.argv[1:])
    end_process_group()
    sys.exit(0)

"""`shard-pack preview`: SA-1B geometry (mask pixels where the batch's masks say, inside the image
frame, boxes where the batch's boxes say, padding cut away), VQA text under the image, the
embeddings table, the CLI and its atomic PNG."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from pipeline import make_stream_loader
from shard_tools.cli import main
from shard_tools.embeddings import pack_embeddings
from shard_tools.pack import PackOptions
from shard_tools.preview import BACKGROUND, preview
from shard_tools.samples.vqa import write_vqa
from shard_tools.vqa import VqaSource, pack_vqa

TILE = 100


def _scaled(mask: np.ndarray, frame: tuple[int, int], original: tuple[int, int], out: tuple[int, int]) -> np.ndarray:
    """A mask of the mask frame (long side m, padded to m x m) at `out`: each output pixel takes
    the mask pixel that holds its centre, located through the original image."""
    (mh, mw), (h0, w0), (th, tw) = frame, original, out
    rows = np.floor((np.arange(th) + 0.5) * h0 / th * mh / h0).astype(int)
    cols = np.floor((np.arange(tw) + 0.5) * w0 / tw * mw / w0).astype(int)
    return mask[:mh, :mw][rows][:, cols]


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    padded = np.pad(mask, r)
    return np.any([padded[r + dy: r + dy + mask.shape[0], r + dx: r + dx + mask.shape[1]]
                   for dy in range(-r, r + 1) for dx in range(-r, r + 1)], axis=0)


def _mask_extent(content: int, original: int, long: int, s: int, m: int, own_frame: bool) -> int:
    """How many mask pixels along an axis cover the image: its own mask frame's (long side m) where the
    image has its own frame, else those whose centres lie inside the image's content."""
    if own_frame:
        return round(original * m / long)
    return int(((np.arange(m) + 0.5) * s / m < content).sum())


SAM = dict(image_size=64, mask_size=32, max_masks=6, points_per_mask=2, box_noise=0.1, hflip=1.0, resize="square")


@pytest.mark.parametrize("options", [
    dict(image_size=64, mask_size=32, max_masks=6), dict(image_size=64, mask_size=None, max_masks=6),
    dict(image_size=64, mask_size=96, max_masks=6),  # coarser than the image, its frame, finer
    SAM, dict(image_size=64, mask_size=48, max_masks=6, scale_jitter=(0.5, 1.5), points_per_mask=1),
], ids=["32", "none", "96", "sam", "jitter"])
def test_sa1b_masks_boxes_and_prompts_sit_where_the_batch_says_inside_the_image_frame(sa1b_dataset, options):
    shown = preview(sa1b_dataset, "train", n=4, seed=3, tile=TILE, columns=3, options=options)
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=4, num_workers=0, seed=3, drop_last=False, **options)
    batch = next(iter(loader))
    assert shown.keys == tuple(batch["keys"])
    picture = np.asarray(shown.image).astype(int)
    s, m = batch["images"].shape[-1], batch["masks"].shape[-1]
    for i, (left, top, tw, th) in enumerate(shown.frames):
        (h, w), (h0, w0) = batch["image_sizes"][i].tolist(), batch["original_sizes"][i].tolist()
        assert max(tw, th) == TILE and abs(tw / th - w / h) < 0.05  # the padding cut away: the content's aspect
        plain = np.asarray(Image.fromarray(batch["images"][i, :, :h, :w].permute(1, 2, 0).numpy())
                           .resize((tw, th), Image.Resampling.BILINEAR)).astype(int)
        changed = np.abs(picture[top:top + th, left:left + tw] - plain).max(axis=2) > 2
        own = "resize" not in options and "scale_jitter" not in options
        mask_frame = (_mask_extent(h, h0, max(h0, w0), s, m, own), _mask_extent(w, w0, max(h0, w0), s, m, own))
        count = int(batch["mask_counts"][i])
        assert count > 0
        union = np.zeros((th, tw), bool)
        outlines = np.zeros((th, tw), bool)
        scale = np.array([tw / w, th / h, tw / w, th / h])
        for j in range(count):
            union |= _scaled(batch["masks"][i, j].numpy(), mask_frame, (h0, w0), (th, tw))
            for name in ("boxes", "prompt_boxes"):
                if name not in batch:
                    continue
                x0, y0, x1, y1 = (batch[name][i, j].numpy() * scale).tolist()
                if name == "boxes":  # (drawn whole: each corner; prompt boxes are dotted)
                    for y, x in [(round(y0), round(x0)), (round(y0), round(x1) - 1), (round(y1) - 1, round(x0)),
                                 (round(y1) - 1, round(x1) - 1)]:
                        assert changed[max(0, y - 1): y + 2, max(0, x - 1): x + 2].any(), (batch["keys"][i], j, y, x)
                outlines[max(0, round(y0) - 1): round(y1) + 1, max(0, round(x0) - 1): round(x1) + 1] = True
            for x, y in batch["point_coords"][i, j].numpy() * scale[:2] if "point_coords" in batch else ():
                dot = changed[max(0, round(y) - 1): round(y) + 2, max(0, round(x) - 1): round(x) + 2]
                assert dot.mean() > 0.6, (batch["keys"][i], j, x, y)  # a dot drawn there (cut at the edges)
                outlines[max(0, round(y) - 3): round(y) + 4, max(0, round(x) - 3): round(x) + 4] = True
        assert changed[union].mean() > 0.9  # the masks are drawn ...
        assert not (changed & ~_dilate(union, 1) & ~outlines).any()  # ... and nothing else but boxes and prompts
        cell = picture[top:top + TILE, left:left + TILE]
        assert (cell[th:, :] == BACKGROUND).all() and (cell[:, tw:] == BACKGROUND).all()  # no padding shown


def test_sa1b_preview_through_the_cli_writes_a_png_atomically(sa1b_dataset, tmp_path, capsys):
    out = tmp_path / "preview.png"
    argv = ["preview", sa1b_dataset, "--split", "val", "-n", "3", "--out", str(out), "--image-size", "64",
            "--mask-size", "32"]
    umask = os.umask(0o022)
    try:
        assert main(argv) == 0
    finally:
        os.umask(umask)
    with Image.open(out) as image:
        image.verify()
    assert [p.name for p in tmp_path.iterdir()] == ["preview.png"]
    assert out.stat().st_mode & 0o777 == 0o644, "the user's umask, as any new file gets"
    printed = capsys.readouterr().out
    assert printed.startswith(f"preview: {out} (") and printed.count("sa_") == 3
    assert main([*argv[:-4], "--per", "image"]) == 2  # a VQA option for an SA-1B dataset


def test_sa1b_fine_tuning_options_through_the_cli_draw_what_the_options_draw(sa1b_dataset, tmp_path, capsys,
                                                                            caplog):
    options = dict(SAM, max_mask_area=0.5, min_predicted_iou=0.5, min_stability_score=0.5, fill_masks=True,
                   box_noise_mode="uniform", scale_jitter=(0.5, 1.5))
    flags = [f"--{name.replace('_', '-')}={','.join(map(str, value)) if isinstance(value, tuple) else value}"
             for name, value in options.items()]
    out = tmp_path / "preview.png"
    assert main(["preview", sa1b_dataset, "--split", "train", "-n", "3", "--out", str(out), *flags]) == 0
    shown = preview(sa1b_dataset, "train", n=3, options=options)
    with Image.open(out) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(shown.image.convert("RGB")))
    capsys.readouterr()
    for bad in ("--scale-jitter=2", "--fill-masks=maybe", "--resize=crop", "--scale-jitter=2,1", "--hflip=2"):
        try:  # (argparse refuses a value it cannot parse by SystemExit(2); the options' own checks return 2)
            code = main(["preview", sa1b_dataset, "--split", "train", "--out", str(out), bad])
        except SystemExit as exc:
            code = exc.code
        assert code == 2, bad
        said = capsys.readouterr().err + caplog.text  # (argparse's message, or the error the CLI logs)
        caplog.clear()
        assert bad.split("=")[0].removeprefix("--").replace("-", "_") in said.replace("-", "_"), (bad, said)


@pytest.fixture(scope="module")
def vqa_dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("preview-vqa")
    files = write_vqa(root / "src", "vqa-rad", {"train": 4}, per_image=(1, 3), seed=2)
    source = VqaSource(str(root / "src" / "images"), tuple((k, str(v)) for k, v in files.items()))
    pack_vqa(source, str(root / "out"), PackOptions(shard_samples=2), progress=False)
    return str(root / "out")


@pytest.mark.parametrize("per", ["question", "image"])
def test_vqa_tiles_show_the_image_with_text_under_it(vqa_dataset, per):
    shown = preview(vqa_dataset, "train", n=3, tile=TILE, options=dict(per=per, image_size=64))
    picture = np.asarray(shown.image)
    assert len(shown.frames) == 3 and shown.image.height > TILE + 40
    for left, top, tw, th in shown.frames:
        below = picture[top + TILE: top + TILE + 40, left: left + TILE]
        assert (below != BACKGROUND).any(axis=2).sum() > 50  # text: the key, the question and its answer


def test_embeddings_preview_writes_a_table(tmp_path, capsys):
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "emb.npy", rng.standard_normal((40, 4)).astype(np.float16))
    np.save(src / "score.npy", rng.random(40).astype(np.float32))
    (src / "schema.json").write_text(json.dumps({"fields": {"emb": {"file": "emb.npy"},
                                                            "score": {"file": "score.npy", "range": [0, 1]}}}))
    pack_embeddings(str(src), str(tmp_path / "out"), rows_per_block=8, options=PackOptions(splits=None), progress=False)
    png = tmp_path / "emb.png"
    assert main(["preview", str(tmp_path / "out"), "--split", "train", "-n", "16", "--out", str(png),
                 "--fields", "score"]) == 0
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 300
    rows = capsys.readouterr().out.split("): ", 1)[1].split(", ")
    assert len(rows) == 16 and all(0 <= int(r) < 40 for r in rows)

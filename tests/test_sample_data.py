"""Tests for shard_tools.samples.sa1b (SA-1B-shaped sample datasets)."""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import numpy as np
import pycocotools.mask as mask_utils
import pytest
from PIL import Image

from shard_tools.samples.sa1b import PHOTOS, main, photo_paths, write_sa1b

IMAGES = 4
SIZE = (120, 180)
MASKS = (5, 20)
PER_ARCHIVE = 3

# pycocotools' decode() trips a NumPy 2 deprecation warning inside pycocotools itself.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _write(out: pathlib.Path, **kwargs: object) -> list[pathlib.Path]:
    args: dict[str, object] = dict(images=IMAGES, size=SIZE, masks=MASKS, images_per_archive=PER_ARCHIVE, seed=3)
    args.update(kwargs)
    return write_sa1b(out, **args)  # type: ignore[arg-type]


def _members(paths: list[pathlib.Path]) -> dict[str, bytes]:
    """All tar members of the archives, in archive then member order."""
    out: dict[str, bytes] = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for info in tar.getmembers():
                data = tar.extractfile(info)
                assert data is not None
                out[info.name] = data.read()
    return out


@pytest.fixture(scope="module")
def tar_dataset(tmp_path_factory: pytest.TempPathFactory) -> list[pathlib.Path]:
    return _write(tmp_path_factory.mktemp("tar"))


@pytest.fixture(scope="module")
def docs(tar_dataset: list[pathlib.Path]) -> dict[int, dict]:
    members = _members(tar_dataset)
    return {
        int(name[3:-5]): json.loads(data) for name, data in members.items() if name.endswith(".json")
    }


def test_photos_bundled_offline() -> None:
    paths = photo_paths()
    assert len(paths) == len(PHOTOS) >= 8
    for path in paths:
        with Image.open(path) as img:
            img.verify()


def test_deterministic(tmp_path: pathlib.Path, tar_dataset: list[pathlib.Path]) -> None:
    again = _write(tmp_path / "again")
    assert [p.name for p in again] == [p.name for p in tar_dataset]
    for a, b in zip(again, tar_dataset):
        assert a.read_bytes() == b.read_bytes()


def test_seed_changes_output(tmp_path: pathlib.Path, tar_dataset: list[pathlib.Path]) -> None:
    other = _write(tmp_path / "other", images=1, seed=4)
    assert _members(other)["sa_1.jpg"] != _members(tar_dataset)["sa_1.jpg"]


def test_tar_layout(tar_dataset: list[pathlib.Path]) -> None:
    assert [p.name for p in tar_dataset] == ["sa_000000.tar", "sa_000001.tar"]
    expected = [
        ["sa_1.jpg", "sa_1.json", "sa_2.jpg", "sa_2.json", "sa_3.jpg", "sa_3.json"],
        ["sa_4.jpg", "sa_4.json"],
    ]
    for path, names in zip(tar_dataset, expected):
        with open(path, "rb") as fh:
            assert fh.read(2) != b"\x1f\x8b"  # not gzip: plain tar
        with tarfile.open(path, "r:") as tar:
            infos = tar.getmembers()
        assert [i.name for i in infos] == names
        for info in infos:
            assert info.isreg()
            assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)


def test_images(tar_dataset: list[pathlib.Path]) -> None:
    members = _members(tar_dataset)
    for image_id in range(1, IMAGES + 1):
        with Image.open(io.BytesIO(members[f"sa_{image_id}.jpg"])) as img:
            assert img.format == "JPEG"
            assert img.mode == "RGB"
            # every third image is portrait
            expected = (SIZE[0], SIZE[1]) if image_id % 3 else (SIZE[1], SIZE[0])
            assert (img.height, img.width) == expected
            assert np.asarray(img).std() > 5  # a real picture, not a flat colour


def test_json_schema(docs: dict[int, dict]) -> None:
    assert sorted(docs) == list(range(1, IMAGES + 1))
    ann_ids = []
    for image_id, doc in docs.items():
        assert set(doc) == {"image", "annotations"}
        image = doc["image"]
        assert image == {
            "image_id": image_id,
            "width": image["width"],
            "height": image["height"],
            "file_name": f"sa_{image_id}.jpg",
        }
        h, w = image["height"], image["width"]
        assert isinstance(h, int) and isinstance(w, int)
        assert MASKS[0] <= len(doc["annotations"]) <= MASKS[1]
        for ann in doc["annotations"]:
            assert set(ann) == {
                "id",
                "segmentation",
                "bbox",
                "area",
                "predicted_iou",
                "stability_score",
                "point_coords",
                "crop_box",
            }
            assert isinstance(ann["id"], int)
            ann_ids.append(ann["id"])
            seg = ann["segmentation"]
            assert set(seg) == {"size", "counts"}
            assert seg["size"] == [h, w]
            assert isinstance(seg["counts"], str) and seg["counts"]
            assert len(ann["bbox"]) == 4 and all(isinstance(v, float) for v in ann["bbox"])
            assert isinstance(ann["area"], int) and ann["area"] > 0
            assert isinstance(ann["predicted_iou"], float) and 0.75 <= ann["predicted_iou"] <= 1.0
            assert isinstance(ann["stability_score"], float) and 0.8 <= ann["stability_score"] <= 1.0
            assert len(ann["point_coords"]) == 1 and len(ann["point_coords"][0]) == 2
            assert all(isinstance(v, float) for v in ann["point_coords"][0])
            assert ann["crop_box"] == [0.0, 0.0, float(w), float(h)]
            assert all(isinstance(v, float) for v in ann["crop_box"])
    assert len(set(ann_ids)) == len(ann_ids)


def test_masks_decode(docs: dict[int, dict]) -> None:
    for doc in docs.values():
        h, w = doc["image"]["height"], doc["image"]["width"]
        areas = set()
        for ann in doc["annotations"]:
            rle = {"size": ann["segmentation"]["size"], "counts": ann["segmentation"]["counts"].encode("ascii")}
            mask = mask_utils.decode(rle)
            assert mask.shape == (h, w)
            assert mask.dtype == np.uint8
            assert mask.any()
            area = int(mask.sum())
            assert ann["area"] == area == int(mask_utils.area(rle))
            assert ann["bbox"] == [float(v) for v in mask_utils.toBbox(rle)]
            ys, xs = np.nonzero(mask)
            assert ann["bbox"] == [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)]
            # re-encoding the decoded mask gives the same string
            assert mask_utils.encode(np.asfortranarray(mask))["counts"].decode("ascii") == ann["segmentation"]["counts"]
            x, y = ann["point_coords"][0]
            assert x == int(x) and y == int(y)
            assert mask[int(y), int(x)] == 1
            areas.add(area)
        assert len(areas) > 1  # masks differ (several segmentation scales)


def test_masks_overlap(docs: dict[int, dict]) -> None:
    """As in SA-1B, masks overlap (objects and their parts, from several scales)."""
    for doc in docs.values():
        rles = [{"size": a["segmentation"]["size"], "counts": a["segmentation"]["counts"].encode("ascii")} for a in doc["annotations"]]
        coverage = mask_utils.decode(rles).sum(axis=2, dtype=np.int64)
        assert coverage.max() >= 2


def test_folder_layout_matches_tar(tmp_path: pathlib.Path, tar_dataset: list[pathlib.Path]) -> None:
    out = tmp_path / "folder"
    paths = _write(out, layout="folder")
    names = [f"sa_{i}.{ext}" for i in range(1, IMAGES + 1) for ext in ("jpg", "json")]
    assert paths == sorted(out / n for n in names)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    members = _members(tar_dataset)
    for name in names:
        assert (out / name).read_bytes() == members[name]


def test_mask_count_range(tmp_path: pathlib.Path) -> None:
    paths = write_sa1b(tmp_path, images=3, size=(90, 100), masks=(7, 7), layout="folder", seed=1)
    for path in paths:
        if path.suffix == ".json":
            assert len(json.loads(path.read_text())["annotations"]) == 7


def test_workers_identical(tmp_path: pathlib.Path, tar_dataset: list[pathlib.Path]) -> None:
    parallel = _write(tmp_path / "parallel", workers=2)
    assert [p.read_bytes() for p in parallel] == [p.read_bytes() for p in tar_dataset]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"images": -1},
        {"size": (0, 10)},
        {"masks": (5, 4)},
        {"masks": (0, 4)},
        {"images_per_archive": 0},
        {"seed": -1},
        {"layout": "zip"},
        {"workers": -1},
    ],
)
def test_invalid_arguments(tmp_path: pathlib.Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        write_sa1b(tmp_path, **kwargs)


def test_zero_images(tmp_path: pathlib.Path) -> None:
    assert write_sa1b(tmp_path, images=0) == []


def test_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([str(tmp_path), "--images", "2", "--height", "64", "--width", "80", "--masks-min", "3",
               "--masks-max", "6", "--layout", "folder", "--seed", "2"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sa_1.jpg", "sa_1.json", "sa_2.jpg", "sa_2.json"]
    assert "wrote" in capsys.readouterr().out
    doc = json.loads((tmp_path / "sa_1.json").read_text())
    assert (doc["image"]["height"], doc["image"]["width"]) == (64, 80)

"""Small VQA collections built from real photographs, fully offline, in the layouts the field uses.

The images are crops (with flips) of the medical sample photographs bundled with scikit-image
(`retina()`, `immunohistochemistry()`, `microaneurysms()`) and of its grayscale ones (`camera()`,
`coins()`, `moon()`), written as JPEG or PNG in the modes medical data comes in (RGB, grayscale,
RGBA, 16-bit). The questions are templated per photo, with answers true of the photo. Records follow
VQA-RAD's, SLAKE's or LLaVA's JSON (see `shard_tools.vqa`), one file per split, each image in one
split. Output is byte-for-byte deterministic for a given seed and arguments.
"""

from __future__ import annotations

import functools
import io
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import skimage.data
from PIL import Image

__all__ = ["PHOTOS", "STYLES", "write_images", "records", "write_vqa"]

# name -> (loader, organ, modality, questions and answers about it)
PHOTOS: dict[str, tuple[str, str, str, tuple[tuple[str, str], ...]]] = {
    "retina": ("retina", "EYE", "fundus photograph", (
        ("What organ is shown in this image?", "retina"), ("Is the optic disc visible?", "yes"),
        ("What imaging modality was used?", "fundus photography"), ("Is this a radiograph?", "no"))),
    "ihc": ("immunohistochemistry", "TISSUE", "microscopy", (
        ("What staining technique is shown?", "immunohistochemistry"), ("Is this a microscopy image?", "yes"),
        ("What color are the stained nuclei?", "brown"))),
    "microaneurysms": ("microaneurysms", "EYE", "fundus photograph", (
        ("Are microaneurysms present?", "yes"), ("Is this image in color?", "no"),
        ("What abnormality is seen?", "microaneurysms"))),
    "camera": ("camera", "NONE", "photograph", (
        ("Is this a medical image?", "no"), ("Is this image in color?", "no"))),
    "coins": ("coins", "NONE", "photograph", (
        ("How many rows of objects are there?", 4), ("Is this a CT scan?", "no"))),
    "moon": ("moon", "NONE", "photograph", (("Is this image in color?", "no"), ("Is there a fracture?", "no"))),
}
# (format, mode) of the images, in turn: as medical collections have them.
STYLES: tuple[tuple[str, str], ...] = (
    ("JPEG", "RGB"), ("PNG", "L"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"),
)


@functools.cache
def _photo(name: str) -> np.ndarray:
    return getattr(skimage.data, PHOTOS[name][0])()


def _render(name: str, long_side: int, style: tuple[str, str], rng: np.random.Generator) -> bytes:
    pixels = _photo(name)
    h, w = pixels.shape[:2]
    ch, cw = (int(n * rng.uniform(0.6, 1.0)) for n in (h, w))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = pixels[y : y + ch, x : x + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    image = Image.fromarray(np.ascontiguousarray(crop))
    scale = long_side / max(ch, cw)
    image = image.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.LANCZOS)
    fmt, mode = style
    if mode == "I;16":
        image = Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257)
    elif mode == "RGBA":
        rgba = np.dstack([np.asarray(image.convert("RGB")), np.full(image.size[::-1], 255, np.uint8)])
        image = Image.fromarray(rgba)
    else:
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def write_images(folder: pathlib.Path, paths: Sequence[str], long_side: tuple[int, int] = (64, 128), seed: int = 0,
                 styles: Sequence[tuple[str, str]] = STYLES) -> dict[str, str]:
    """Write one image per path (its format by the path's extension); returns path -> photo name."""
    rng = np.random.default_rng(seed)
    names = list(PHOTOS)
    chosen = {}
    for i, path in enumerate(paths):
        name = names[i % len(names)]
        fmt = "PNG" if path.endswith(".png") else "JPEG"
        style = next(s for s in list(styles[i % len(styles):]) + list(styles) if s[0] == fmt)
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_render(name, int(rng.integers(long_side[0], long_side[1] + 1)), style, rng))
        chosen[path] = name
    return chosen


def records(layout: str, photos: dict[str, str], per_image: tuple[int, int], seed: int, first_id: int = 0
            ) -> list[dict[str, Any]]:
    """Question records about each image, in `layout` (vqa-rad, slake or llava)."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for n, (path, name) in enumerate(photos.items()):
        _, organ, modality, qa = PHOTOS[name]
        count = int(rng.integers(per_image[0], per_image[1] + 1))
        pairs = [qa[(n + k) % len(qa)] for k in range(count)]
        if layout == "llava":
            turns: list[dict[str, str]] = []
            for k, (q, a) in enumerate(pairs):
                asked = f"<image>\n{q}" if k == 0 else q
                turns += [{"from": "human", "value": asked}, {"from": "gpt", "value": str(a)}]
            out.append({"id": f"{first_id + n:08d}", "image": path, "conversations": turns})
            continue
        for q, a in pairs:
            qid = first_id + len(out)
            answer_type = "CLOSED" if a in ("yes", "no") else "OPEN"
            if layout == "vqa-rad":
                out.append({"qid": qid, "image_name": path, "image_case_url": f"https://example.org/case/{n}",
                            "image_organ": organ, "answer": a, "answer_type": answer_type,
                            "question_type": "PRES", "question": q, "phrase_type": "freeform"})
            else:
                out.append({"img_id": first_id + n, "img_name": path, "question": q, "answer": a, "q_lang": "en",
                            "location": organ.title(), "modality": modality, "answer_type": answer_type,
                            "base_type": "vqa", "content_type": "Modality", "triple": [name, "_", "_"], "qid": qid})
    return out


def _paths(layout: str, count: int, start: int) -> list[str]:
    if layout == "vqa-rad":
        return [f"synpic{50000 + start + i}.jpg" if i % 3 else f"synpic{50000 + start + i}.png" for i in range(count)]
    if layout == "slake":
        return [f"xmlab{start + i}/source.{'jpg' if i % 2 else 'png'}" for i in range(count)]
    return [f"images/{start + i:06d}.{'png' if i % 3 == 1 else 'jpg'}" for i in range(count)]


def write_vqa(root: pathlib.Path, layout: str, splits: dict[str, int], per_image: tuple[int, int] = (1, 4),
              long_side: tuple[int, int] = (64, 128), seed: int = 0) -> dict[str, pathlib.Path]:
    """An image folder `root/images` and one annotation file per split (`root/<split>.json`) with
    `splits[name]` images each (no image in two splits); returns split -> annotation file."""
    files, start = {}, 0
    for s, (split, count) in enumerate(splits.items()):
        paths = _paths(layout, count, start)
        photos = write_images(root / "images", paths, long_side, seed * 1000 + s)
        files[split] = root / f"{split}.json"
        files[split].write_text(json.dumps(records(layout, photos, per_image, seed * 1000 + s, first_id=start * 10),
                                           indent=1))
        start += count
    return files

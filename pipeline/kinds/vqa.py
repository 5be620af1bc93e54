"""VQA on the reading side: one image per tar sample with all its questions of the split.

`per="question"` (the default) yields one sample per question: the plan orders questions, and a
worker opens each image's sample once for its questions (see `Kind.units`). `per="image"` yields
one sample per image with its lists of questions and answers. Images are resized to long side
`image_size` (or kept as stored with `image_size=None`, or with a pixel budget, `min_pixels`,
`max_pixels`, `pixel_factor`, to the (h, w) Qwen2-VL's `smart_resize` gives their original size)
and always RGB: grayscale is replicated, palettes expanded, alpha dropped, 16-bit samples scaled to
8 bits.

Batches (`make_stream_loader`): `images` uint8 (B, 3, H, W), zero-padded to (image_size,
image_size) or, with `image_size=None` (as stored or budgeted), to the batch's largest height and
width; `image_sizes` and `original_sizes` int64 (B, 2) as (h, w); strings and original records as
lists (see `Vqa.fields`).
The TRL form (`form="trl"`, set by `pipeline.trl_dataset`) gives per-question dicts in the
conversational form TRL's GRPOTrainer consumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgpack.exceptions
import numpy as np
import torch
from PIL import Image

from pipeline.collate import padded_images, rows
from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError, SampleError, excerpt
from pipeline.format import (
    VQA_IMAGE_EXTS, VQA_IMAGE_FIELDS, VQA_QUESTION_FIELDS, VQA_RECORD, VQA_RECORD_FIELDS, unpack_record,
)
from pipeline.images import (
    MAX_IMAGE_PIXELS, QWEN2_VL_FACTOR, QWEN2_VL_MAX_PIXELS, QWEN2_VL_MIN_PIXELS, decode_image, smart_resize,
)
from pipeline.kinds.schema import BatchField, every_option, problems
from pipeline.rle import fit
from pipeline.stats import Clock

__all__ = ["VqaOptions", "VqaSample", "Vqa"]

PER = ("question", "image")
FORMS = ("batch", "trl")
_COUNT = {"question": "question_index", "image": "question_counts"}  # the per-sample integer column, per `per`
LIST_FIELDS = ("keys", "paths", "questions", "answers", "fields")
_FORMATS = {ext: fmt for fmt, ext in VQA_IMAGE_EXTS.items()}
STAGES = ("image",)  # the part of `Vqa.decode` it times (`Kind.stages`)


_BUDGET = ("pixel_factor", "min_pixels", "max_pixels")  # Qwen2-VL's pixel budget (`pipeline.images.smart_resize`)
_BUDGET_DEFAULTS = {"pixel_factor": QWEN2_VL_FACTOR, "min_pixels": QWEN2_VL_MIN_PIXELS,
                    "max_pixels": QWEN2_VL_MAX_PIXELS}


@dataclasses.dataclass(frozen=True)
class VqaOptions:
    """How VQA samples are read: one per question or per image, images at long side `image_size`
    (None: as stored, or with a pixel budget at Qwen2-VL's `smart_resize` of their original size),
    and whether samples are collated into batches or given in TRL's form. Given any of the budget's
    three, the others take Qwen2-VL's defaults (28, 56*56, 28*28*1280)."""

    per: str = "question"
    image_size: int | None = 448
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger images are refused, never decoded
    form: str = "batch"  # "trl": one dict per sample (set by `pipeline.trl_dataset`)
    min_pixels: int | None = None  # the pixel budget, off while all three are None
    max_pixels: int | None = None
    pixel_factor: int | None = None

    def __post_init__(self) -> None:
        if self.per not in PER:
            raise ConfigError(f"per must be one of {PER}, got {self.per!r}")
        if self.image_size is not None and not is_int_at_least(self.image_size, 1):
            raise ConfigError(f"image_size must be a positive int or None (as stored), got {self.image_size!r}")
        if not isinstance(self.max_image_pixels, int) or self.max_image_pixels < 1:
            raise ConfigError(f"max_image_pixels must be a positive int, got {self.max_image_pixels!r}")
        if self.form not in FORMS:
            raise ConfigError(f"form must be one of {FORMS}, got {self.form!r}")
        if self.form == "trl" and self.per != "question":
            raise ConfigError("the TRL form is one prompt per question: per must be 'question'")
        given = {name: getattr(self, name) for name in _BUDGET if getattr(self, name) is not None}
        if given:
            if self.image_size is not None:
                raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: the pixel budget sizes each "
                                  f"image on its own and needs image_size=None, got image_size={self.image_size!r}")
            for name in _BUDGET:  # the budget in full, so that equal budgets are equal options
                object.__setattr__(self, name, given.get(name, _BUDGET_DEFAULTS[name]))
            self._check_budget()

    def _check_budget(self) -> None:
        for name in _BUDGET:
            if not is_int_at_least(getattr(self, name), 1):
                raise ConfigError(f"{name} must be a positive int (None: Qwen2-VL's {_BUDGET_DEFAULTS[name]}), "
                                  f"got {getattr(self, name)!r}")
        factor, low, high = self.pixel_factor, self.min_pixels, self.max_pixels
        if not factor * factor <= high <= self.max_image_pixels:
            raise ConfigError(f"max_pixels must be in [pixel_factor**2, max_image_pixels] = [{factor * factor}, "
                              f"{self.max_image_pixels}], got {high}")
        if low > high:
            raise ConfigError(f"min_pixels must be at most max_pixels ({high}), got {low}")

    @property
    def budget(self) -> tuple[int, int, int] | None:
        """(pixel_factor, min_pixels, max_pixels), the arguments of `smart_resize`; None when off."""
        return None if self.pixel_factor is None else (self.pixel_factor, self.min_pixels, self.max_pixels)


@dataclasses.dataclass(frozen=True)
class VqaSample:
    """An opened tar sample: the image bytes and the checked record."""

    data: bytes
    ext: str
    image: dict[str, Any]  # VQA_IMAGE_FIELDS
    stored_size: tuple[int, int]
    questions: list[dict[str, Any]]  # VQA_QUESTION_FIELDS each


def _check(ok: bool, url: str, key: str, field: str, message: str) -> None:
    if not ok:
        raise SampleError(message, url=url, key=key, field=field)


def _check_questions(questions: Any, url: str, key: str) -> None:
    """A record's questions: a non-empty list of maps of `VQA_QUESTION_FIELDS`, each of its type."""
    _check(isinstance(questions, list) and len(questions) >= 1, url, key, "questions", "expected a non-empty list")
    for i, q in enumerate(questions):
        field = f"questions[{i}]"
        _check(isinstance(q, dict) and set(q) == set(VQA_QUESTION_FIELDS), url, key, field,
               f"expected a map of {sorted(VQA_QUESTION_FIELDS)}")
        _check(all(isinstance(q[f], str) for f in ("question", "answer", "source", "layout"))
               and is_int_at_least(q["record"], 0) and is_int_at_least(q["turn"], 0) and isinstance(q["fields"], dict),
               url, key, field, "invalid question entry")


def _trl(sample: dict[str, Any]) -> dict[str, Any]:
    """A question in the conversational form of TRL's GRPOTrainer, with the record's other fields."""
    question = sample["questions"][0]
    pixels = np.ascontiguousarray(sample["image"].permute(1, 2, 0).numpy())
    return {
        **sample["fields"][0],
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        "image": Image.fromarray(pixels),  # (h, w, 3) uint8: RGB
        "question": question,
        "answer": sample["answers"][0],
        "key": sample["key"],
        "image_path": sample["path"],
    }


def _frame(sample: VqaSample, options: VqaOptions, url: str, key: str) -> tuple[int, int] | None:
    """The (h, w) a sample's image is decoded to: long side `image_size`, Qwen2-VL's `smart_resize` of
    its original size under a pixel budget, or None (as stored)."""
    if options.image_size is not None:
        return fit(*sample.stored_size, options.image_size)
    if options.budget is None:
        return None
    height, width = sample.image["height"], sample.image["width"]
    try:
        return smart_resize(height, width, *options.budget)
    except ValueError as exc:
        raise SampleError(f"{height}x{width} (h x w) has no pixel budget: {exc}", url=url, key=key,
                          field="image") from exc


def _budget_problems(image_sizes: torch.Tensor, original_sizes: torch.Tensor, options: VqaOptions) -> list[str]:
    """Sizes that are not `smart_resize` of their original sizes, under a pixel budget."""
    if options.budget is None:
        return []
    for size, original in zip(image_sizes.tolist(), original_sizes.cpu().tolist()):
        try:
            want = list(smart_resize(*original, *options.budget))
        except ValueError as exc:
            return [f"original_sizes: {original}: {exc}"]
        if size != want:
            return [f"image_sizes: {size} for an original {original}, the pixel budget {options.budget} gives {want}"]
    return []


def _value_problems(batch: dict[str, Any], options: VqaOptions) -> list[str]:
    """What is wrong with the values of a batch of the right keys, dtypes and shapes: image sizes and
    padding, question counts, empty texts."""
    found = []
    images = batch["images"]
    height, width = images.shape[2:]
    sizes = batch["image_sizes"].cpu()
    if (sizes < 1).any() or (sizes[:, 0] > height).any() or (sizes[:, 1] > width).any():
        found.append(f"image_sizes: {sizes.tolist()} outside the {height}x{width} batch frame")
    elif options.image_size is not None and (sizes.max(1).values != options.image_size).any():
        found.append(f"image_sizes: {sizes.tolist()}, the long side should be {options.image_size}")
    elif options.image_size is None and (sizes.max(0).values.tolist() != [height, width]):
        found.append(f"images: {height}x{width}, more than the largest image {sizes.max(0).values.tolist()}")
    elif budget := _budget_problems(sizes, batch["original_sizes"], options):
        found += budget
    else:
        rows = torch.arange(height)[None, :] >= sizes[:, :1]
        cols = torch.arange(width)[None, :] >= sizes[:, 1:]
        pad = (rows[:, :, None] | cols[:, None, :])[:, None].expand(-1, 3, -1, -1).to(images.device)
        if images[pad].any():
            found.append("images: non-zero padding beyond image_sizes")
    counts = batch[_COUNT[options.per]].cpu()
    if options.per == "question":
        texts = [(q, a) for q, a in zip(batch["questions"], batch["answers"])]
        if (counts < 0).any():
            found.append(f"question_index: negative values {counts.tolist()}")
    else:
        if [len(q) for q in batch["questions"]] != counts.tolist() or (counts < 1).any():
            found.append(f"question_counts: {counts.tolist()} do not match the question lists")
        texts = [(q, a) for qs, ans in zip(batch["questions"], batch["answers"]) for q, a in zip(qs, ans)]
    if not all(isinstance(q, str) and q and isinstance(a, str) and a for q, a in texts):
        found.append("questions/answers: empty or not strings")
    return found


@dataclasses.dataclass(frozen=True)
class Vqa:
    """The VQA kind (`pipeline.kinds.Kind`): its options, and how its samples become batches."""

    options: VqaOptions
    grouped = False
    stages = STAGES
    takes = frozenset(f.name for f in dataclasses.fields(VqaOptions)) - {"max_image_pixels"}  # (ReadLimits')

    @classmethod
    def of(cls, manifests: Sequence[Any], limits: Any, *, per: str = "question", image_size: int | None = 448,
           form: str = "batch", min_pixels: int | None = None, max_pixels: int | None = None,
           pixel_factor: int | None = None) -> Vqa:
        return cls(VqaOptions(per=per, image_size=image_size, max_image_pixels=limits.max_image_pixels, form=form,
                              min_pixels=min_pixels, max_pixels=max_pixels, pixel_factor=pixel_factor))

    @classmethod
    def for_verify(cls, manifest: Any) -> Vqa:
        """Every image decoded once, every question checked (`shard-pack verify`)."""
        return cls(VqaOptions(per="image", image_size=256))

    @property
    def units(self) -> bool:
        """per="question" yields a sample's questions one by one (its units); per="image" the image once."""
        return self.options.per == "question"

    def open(self, members: dict[str, bytes], *, url: str, key: str, units: int = 1) -> VqaSample:
        """Unpack and check a sample's record (every field, strictly); the image is not decoded here."""
        images = [ext for ext in members if ext in _FORMATS]
        if len(images) != 1 or set(members) != {images[0], VQA_RECORD}:
            raise SampleError(f"members {sorted(members)}, expected one of "
                              f"{sorted(_FORMATS)} and {VQA_RECORD!r}", url=url, key=key)
        ext = images[0]
        try:
            record = unpack_record(members[VQA_RECORD])
        except (ValueError, msgpack.exceptions.UnpackException) as exc:
            raise SampleError(f"cannot unpack: {exc}", url=url, key=key, field=VQA_RECORD) from exc
        _check(set(record) == set(VQA_RECORD_FIELDS), url, key, VQA_RECORD,
               f"fields {sorted(record)}, expected {sorted(VQA_RECORD_FIELDS)}")
        image, stored = record["image"], record["stored_size"]
        _check(isinstance(image, dict) and set(image) == set(VQA_IMAGE_FIELDS), url, key, "image",
               f"expected a map of {sorted(VQA_IMAGE_FIELDS)}")
        _check(all(isinstance(image[f], str) for f in ("path", "format", "mode", "sha256"))
               and is_int_at_least(image["width"], 1) and is_int_at_least(image["height"], 1), url, key, "image",
               "invalid image info")
        _check(_FORMATS[ext] == image["format"], url, key, "image",
               f"format {excerpt(repr(image['format']))} in a .{ext} member")
        _check(isinstance(stored, list) and len(stored) == 2 and all(is_int_at_least(n, 1) for n in stored)
               and stored[0] * stored[1] <= self.options.max_image_pixels, url, key, "stored_size",
               f"invalid stored size {excerpt(repr(stored))}")
        _check(isinstance(record["split"], str), url, key, "split", "not a string")
        _check_questions(record["questions"], url, key)
        return VqaSample(members[ext], ext, image, (stored[0], stored[1]), record["questions"])

    def decode(self, sample: VqaSample, *, unit: int = 0, seed: int, epoch: int, url: str, key: str,
               clock: Clock | None = None) -> dict[str, Any]:
        """One unit: the image in its frame and one question (per="question") or all of them (per="image")."""
        clock, options, questions = clock or Clock(STAGES), self.options, sample.questions
        if options.per == "question":
            _check(unit < len(questions), url, key, "questions", f"question {unit} asked for, the sample holds "
                   f"{len(questions)} (manifest and shard disagree)")
            questions = [questions[unit]]
        frame = _frame(sample, options, url, key)
        clock.mark()
        pixels = decode_image(sample.data, frame, url, key, options.max_image_pixels,
                              formats=(_FORMATS[sample.ext],), field=sample.ext, size=sample.stored_size)
        clock.split("image")
        return {
            "key": key,
            "path": sample.image["path"],
            "image": pixels,
            "image_size": tuple(pixels.shape[1:]),
            "original_size": (sample.image["height"], sample.image["width"]),
            "count": unit if options.per == "question" else len(questions),
            "questions": [q["question"] for q in questions],
            "answers": [q["answer"] for q in questions],
            "fields": [q["fields"] for q in questions],
        }

    def collate(self, samples: Sequence[dict[str, Any]], epoch: int) -> dict[str, Any] | list[dict[str, Any]]:
        """A batch in transit (see `finish`): images zero-padded in shared memory, the integer columns
        stacked into one tensor, strings and records as lists. In the TRL form, a list of the samples' dicts."""
        if self.options.form == "trl":
            return [_trl(x) for x in samples]
        if self.options.image_size is not None:
            height = width = self.options.image_size
        else:
            height, width = (max(x["image_size"][i] for x in samples) for i in (0, 1))
        images = padded_images([x["image"] for x in samples], height, width)
        info = torch.tensor([[*x["image_size"], *x["original_size"], x["count"]] for x in samples], dtype=torch.int64)
        one = self.options.per == "question"
        return {
            "images": images,
            "info": info,
            "keys": [x["key"] for x in samples],
            "paths": [x["path"] for x in samples],
            **{name: [x[name][0] if one else x[name] for x in samples] for name in ("questions", "answers", "fields")},
        }

    def finish(self, batch: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
        """The batch users get, on whatever device it was moved to: the stacked column split into its fields
        (the TRL form's list of samples as it is)."""
        if self.options.form == "trl":
            return batch
        info = batch["info"]
        return {
            "images": batch["images"],
            "image_sizes": info[:, 0:2].contiguous(),
            "original_sizes": info[:, 2:4].contiguous(),
            _COUNT[self.options.per]: info[:, 4].contiguous(),
            **{name: batch[name] for name in LIST_FIELDS},
        }

    def unbatch(self, batch: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A finished batch's samples: row i of each field, same keys; with `image_size=None` each image
        cut to its own size (the batch pads to its largest). The TRL form is its list."""
        if self.options.form == "trl":
            return batch
        samples = rows(batch, self.options)
        if self.options.image_size is None:
            for sample in samples:
                h, w = sample["image_sizes"].tolist()
                sample["images"] = sample["images"][:, :h, :w]
        return samples

    def fields(self, epoch: int) -> tuple[BatchField, ...]:
        """A finished batch's fields (form "batch"): B images, of (image_size, image_size) or, with
        `image_size=None` (as stored or budgeted), of the batch's largest (H, W); the per-sample
        integers; lists of B."""
        s = self.options.image_size
        return (
            BatchField("images", torch.uint8, ("B", 3, "H", "W") if s is None else ("B", 3, s, s)),
            BatchField("image_sizes", torch.int64, ("B", 2)), BatchField("original_sizes", torch.int64, ("B", 2)),
            BatchField(_COUNT[self.options.per], torch.int64, ("B",)),
            *(BatchField(name, list, ("B",)) for name in LIST_FIELDS),
        )

    def depends(self, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
        return every_option(self.options, False)  # (nothing in a VQA sample changes with the epoch)

    def check(self, batch: dict[str, Any], epoch: int) -> list[str]:
        """What is wrong with a finished batch (empty if nothing): keys, dtypes and shapes (`fields`),
        then sizes (under a pixel budget: each `smart_resize` of its original), padding, counts and texts."""
        return problems(batch, self.fields(epoch)) or _value_problems(batch, self.options)

"""VQA collections on the packing side: question/answer JSON files (one or more per split) and a
folder of images -> one shard sample per image and split, holding the image once and every question
of that split about it (`pipeline.format.VQA_RECORD_FIELDS`).

Layouts, detected per file from its records' fields (or given with `layout`):
- `vqa-rad`: a list of `{"qid", "image_name", "question", "answer", "answer_type", ...}`;
- `slake`: a list of `{"img_id", "img_name": "xmlab1/source.jpg", "question", "answer", "q_lang", ...}`;
- `llava`: a list of `{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}, ...]}`; each human/gpt pair is one question;
- `mapped`: any list of records, with the image, question and answer keys given.
A `.jsonl` file holds one record per line. Every original field is kept with each question.

Bad input is skipped, named and listed: a record without image, question or answer (one entry per
record); a missing, unreadable, truncated or non-JPEG/PNG image, and an image that two splits
reference (leakage), one entry per image and split, naming the image, the files and the records. A
file whose layout cannot be told, or none of whose records fits its layout, stops the pack.

`PACKING` declares the kind to `shard_tools.kinds`: its subcommand (`shard-pack vqa`), its preview
(each image with its question and answer) and its loader options as flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import posixpath
import re
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
from PIL import Image, UnidentifiedImageError

from pipeline.errors import ConfigError, InputError, SampleError
from pipeline.format import VQA_IMAGE_EXTS, VQA_RECORD, check_key, pack_record
from pipeline.images import MAX_IMAGE_PIXELS
from pipeline.rle import fit
from pipeline.storage import filesystem
import shard_tools.flags as flags
from shard_tools.drawing import Drawing, Tiles, picture, tiled, wrap
from shard_tools.flags import Subparsers, int_or_none
from shard_tools.images import load_whole, resize_image
from shard_tools.pack import PackError, PackOptions, PackSummary, Part, SampleRef, pack
from shard_tools.plugin import KindOption, PackingKind

__all__ = ["LAYOUTS", "PACKING", "VqaRef", "VqaSource", "detect_layout", "image_id", "image_key", "pack_vqa"]

log = logging.getLogger(__name__)

# Each layout's fields: (image, question, answer); llava's question and answer come from its conversations.
LAYOUTS: dict[str, tuple[str, str, str] | None] = {
    "vqa-rad": ("image_name", "question", "answer"),
    "slake": ("img_name", "question", "answer"),
    "llava": ("image", "conversations", "conversations"),
    "mapped": None,  # the keys are given
}
# The field that tells each layout apart, for detection.
_SIGNATURES = {"vqa-rad": "image_name", "slake": "img_name", "llava": "conversations"}
_HUMAN, _GPT = ("human", "user"), ("gpt", "assistant")
_IDS = ("qid", "id", "question_id")  # shown in messages when a record has one
_SHOWN = 5  # records named per message


class _Bad(Exception):
    """A record that cannot be packed (the message says why)."""


@dataclasses.dataclass(frozen=True)
class VqaRef(SampleRef):
    """A sample reference that also carries its questions (msgpack list of question maps), so that
    each shard task receives only its own slice of the annotations."""

    questions: bytes = b""


def image_id(path: str) -> int:
    """An image path's 64-bit hash, its key's end: an embeddings id field's value (`shard-pack link`)."""
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "big")


def image_key(path: str) -> str:
    """The sample key of an image path: a readable prefix and a hash of the whole path (stable, unique)."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", posixpath.splitext(path)[0]).strip("_")[:60] or "image"
    return check_key(f"{stem}-{image_id(path):016x}")


def detect_layout(records: Sequence[Any], file: str) -> str:
    """The layout most of `records` have (by each layout's telling field); PackError if none or a tie."""
    dicts = [r for r in records if isinstance(r, dict)]
    counts = {name: sum(1 for r in dicts if field in r) for name, field in _SIGNATURES.items()}
    best = max(counts.values(), default=0)
    winners = [name for name, count in counts.items() if count == best]
    if best == 0 or len(winners) > 1:
        first = next((r for r in records if isinstance(r, dict)), None)
        seen = sorted(first)[:20] if first is not None else "no JSON object"
        why = f"ambiguous between {' and '.join(winners)}" if best else "unknown layout"
        raise PackError(
            f"{file}: {why}: record 0 has fields {seen}; known layouts: vqa-rad (image_name, question, answer), "
            "slake (img_name, question, answer), llava (image, conversations); pass --layout, or "
            "--image-key/--question-key/--answer-key for another layout"
        )
    return winners[0]


def _text(value: Any, what: str) -> str:
    """A question or answer as text: strings as they are, JSON numbers and booleans as JSON text."""
    if isinstance(value, str):
        if not value.strip():
            raise _Bad(f"empty {what}")
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise _Bad(f"no {what}" if value is None else f"{what} is a {type(value).__name__}, want text")


def _image_path(value: Any) -> str:
    """The image path, normalised and relative to the image root; _Bad if it is none or leaves the root."""
    if isinstance(value, list):
        raise _Bad(f"{len(value)} images in one record; one image per record is supported")
    if not isinstance(value, str) or not value.strip():
        raise _Bad("no image")
    path = value.replace("\\", "/")
    norm = posixpath.normpath(path)
    if path.startswith("/") or re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path) or norm in (".", "..") \
            or norm.startswith("../"):
        raise _Bad(f"image path {value!r} is not a path inside --images")
    return norm


def _conversation(turns: Any) -> list[tuple[str, str, int]]:
    """(question, answer, turn) for each human/gpt pair of a LLaVA conversation (a leading system turn is allowed)."""
    if not isinstance(turns, list) or not turns:
        raise _Bad("no conversations")
    start = 1 if isinstance(turns[0], dict) and turns[0].get("from") == "system" else 0
    pairs = []
    for i in range(start, len(turns), 2):
        human = turns[i]
        if not isinstance(human, dict) or human.get("from") not in _HUMAN:
            raise _Bad(f"conversations[{i}] is not a human turn")
        question = _text(human.get("value"), f"question in conversations[{i}]").replace("<image>", "").strip()
        if not question:
            raise _Bad(f"no question in conversations[{i}] (only the <image> token)")
        if i + 1 >= len(turns):
            raise _Bad(f"no answer to conversations[{i}]")
        gpt = turns[i + 1]
        if not isinstance(gpt, dict) or gpt.get("from") not in _GPT:
            raise _Bad(f"conversations[{i + 1}] is not a gpt turn")
        pairs.append((question, _text(gpt.get("value"), f"answer in conversations[{i + 1}]"), len(pairs)))
    return pairs


def _where(file: str, index: int, record: Any) -> str:
    ident = next((f" ({k} {record[k]})" for k in _IDS if isinstance(record, dict)
                  and isinstance(record.get(k), (int, str)) and not isinstance(record.get(k), bool)), "")
    return f"{file} record {index}{ident}"


def _records_text(places: Sequence[str]) -> str:
    more = f" and {len(places) - _SHOWN} more" if len(places) > _SHOWN else ""
    return ", ".join(places[:_SHOWN]) + more


def _load(file: str, storage_options: dict[str, Any] | None) -> list[Any]:
    """The file's records (a JSON list, or JSON Lines for .jsonl); PackError if it cannot be read,
    InputError if it is not such JSON."""
    fs, path = filesystem(file, storage_options)
    try:
        data = fs.cat_file(path)
    except OSError as exc:
        raise PackError(f"{file}: cannot read the annotation file: {exc}") from exc
    if file.endswith(".jsonl"):
        records: list[Any] = []
        for n, line in enumerate(data.splitlines()):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except (ValueError, RecursionError) as exc:
                    records.append(_Bad(f"line {n + 1} is not valid JSON: {exc}"))
        return records
    try:
        records = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"not valid JSON: {exc}"[:300], url=file) from exc
    if not isinstance(records, list):
        raise InputError(f"holds a JSON {type(records).__name__}, want a list of records (or JSON Lines in .jsonl)",
                         url=file)
    return records


def _questions(record: Any, layout: str,
               mapped: tuple[str, str, str] | None) -> tuple[str, list[tuple[str, str, int]]]:
    """(image path, [(question, answer, turn)]) of one record; _Bad says what is missing. `mapped`:
    the (image, question, answer) keys of the mapped layout."""
    if isinstance(record, _Bad):
        raise record
    if not isinstance(record, dict):
        raise _Bad(f"a JSON {type(record).__name__}, not an object")
    if layout == "mapped":
        image, question, answer = mapped  # type: ignore[misc]
    else:
        image, question, answer = LAYOUTS[layout]  # type: ignore[misc]
    path = _image_path(record.get(image))
    if layout == "llava":
        return path, _conversation(record.get("conversations"))
    return path, [(_text(record.get(question), "question"), _text(record.get(answer), "answer"), 0)]


@dataclasses.dataclass
class _Listing:
    """What the annotation files hold, read one after the other."""

    # (split, image path) -> questions
    questions: dict[tuple[str, str], list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # image path -> split -> "file record i (qid q)"
    places: dict[str, dict[str, list[str]]] = dataclasses.field(default_factory=dict)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    storage_options: dict[str, Any] | None = None  # (the source's)

    def add_file(self, split: str, file: str, layout: str | None, mapped: tuple[str, str, str] | None) -> None:
        """Add one annotation file's questions (its layout detected when `layout` is None); a record
        that does not fit is skipped; PackError when none fits."""
        records = _load(file, self.storage_options)
        if not records:
            raise InputError("no records: nothing to pack", url=file)
        layout = layout or detect_layout(records, file)
        good, first_problem = 0, ""
        for i, record in enumerate(records):
            where = _where(file, i, record)
            try:
                path, pairs = _questions(record, layout, mapped)
                pack_record(record)  # storable as msgpack (no 65-bit ints, no deep nesting)
            except _Bad as exc:
                self.skipped.append({"source": file, "key": f"{split}-record-{i}", "reason": f"{where}: {exc}"})
                first_problem = first_problem or f"{where}: {exc}"
                continue
            except (OverflowError, ValueError, TypeError) as exc:
                self.skipped.append({"source": file, "key": f"{split}-record-{i}",
                                     "reason": f"{where}: cannot be stored: {exc}"})
                continue
            good += 1
            self.places.setdefault(path, {}).setdefault(split, []).append(where)
            self.questions.setdefault((split, path), []).extend(
                {"question": q, "answer": a, "source": file, "record": i, "turn": turn, "layout": layout,
                 "fields": record} for q, a, turn in pairs)
        if not good:
            raise PackError(f"{file}: none of its {len(records)} records fits layout {layout} (first: "
                            f"{first_problem}); pass --layout, or --image-key/--question-key/--answer-key")
        log.info("%s: layout %s, %d records, %d skipped", file, layout, len(records), len(records) - good)


@dataclasses.dataclass(frozen=True)
class VqaSource:
    """Question/answer files per split + an image folder -> VQA shard samples (see the module docstring).

    `splits` are (split name, annotation file) pairs, in priority order: an image referenced from
    several splits belongs to the first, and its questions in the others are skipped as leakage
    (`shared_images="keep"` stores it in each, with a warning). A split may have several files."""

    images: str
    splits: tuple[tuple[str, str], ...]
    layout: str | None = None  # None: detected per file
    image_key: str | None = None  # with question_key and answer_key: the "mapped" layout
    question_key: str | None = None
    answer_key: str | None = None
    shared_images: str = "skip"
    image_max_side: int | None = None
    jpeg_quality: int = 90
    # fsspec's options for the input URLs (as `shard-pack --storage-options`): never in the manifest or fingerprint
    storage_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    kind: str = dataclasses.field(default="vqa", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.splits, tuple) or not self.splits or not all(
                isinstance(s, tuple) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in self.splits):
            raise ConfigError(f"splits must be a non-empty tuple of (name, file) pairs, got {self.splits!r}")
        for name, file in self.splits:
            if not name.isidentifier():
                raise ConfigError(f"split name {name!r} (for {file}) must be an identifier, e.g. train, val, test")
        if len({file for _, file in self.splits}) != len(self.splits):
            raise ConfigError(f"an annotation file is given twice: {[f for _, f in self.splits]}")
        keys = (self.image_key, self.question_key, self.answer_key)
        if any(k is not None for k in keys) and not all(isinstance(k, str) and k for k in keys):
            raise ConfigError(f"give all three of image_key, question_key, answer_key, got {keys}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {sorted(LAYOUTS)} or None (detect), got {self.layout!r}")
        if self.layout == "mapped" and self.image_key is None:
            raise ConfigError("layout 'mapped' needs image_key, question_key and answer_key")
        if self.image_key is not None and self.layout not in (None, "mapped"):
            raise ConfigError(f"image_key, question_key and answer_key make the mapped layout, not {self.layout!r}")
        if self.shared_images not in ("skip", "keep"):
            raise ConfigError(f"shared_images must be 'skip' or 'keep', got {self.shared_images!r}")
        if self.image_max_side is not None and (not isinstance(self.image_max_side, int) or self.image_max_side < 16):
            raise ConfigError(f"image_max_side must be an int >= 16 or None, got {self.image_max_side!r}")
        if not isinstance(self.jpeg_quality, int) or not 1 <= self.jpeg_quality <= 95:
            raise ConfigError(f"jpeg_quality must be in [1, 95], got {self.jpeg_quality!r}")

    @property
    def files(self) -> list[str]:
        return [file for _, file in self.splits]

    def options(self) -> dict[str, Any]:
        """What shaped the shards, for the manifest and the fingerprint: settings and each annotation file's SHA-256."""
        digests = []
        for name, file in self.splits:
            fs, path = filesystem(file, self.storage_options)
            try:
                digests.append([name, file, hashlib.sha256(fs.cat_file(path)).hexdigest()])
            except OSError as exc:
                raise PackError(f"{file}: cannot read the annotation file: {exc}") from exc
        mapped = self.layout == "mapped" or self.image_key is not None
        return {
            "layout": "mapped" if mapped else self.layout,
            "keys": [self.image_key, self.question_key, self.answer_key] if mapped else None,
            "shared_images": self.shared_images,
            "image_max_side": self.image_max_side,
            "jpeg_quality": self.jpeg_quality if self.image_max_side else None,
            "annotations": digests,
        }

    # -- listing ---------------------------------------------------------------------------------

    def index(self, sources: Sequence[str]) -> tuple[list[SampleRef], list[dict[str, str]]]:
        """One reference per (split, image) with that split's questions about the image, and the
        records and images skipped. `sources` are the annotation files of `splits` (see `pack_vqa`)."""
        if list(sources) != self.files:
            raise ConfigError(f"sources must be the annotation files of splits, {self.files}, got {list(sources)}")
        mapped = (self.image_key, self.question_key, self.answer_key) if self.image_key is not None else None
        listing = _Listing(storage_options=self.storage_options)
        for split, file in self.splits:
            listing.add_file(split, file, "mapped" if mapped else self.layout, mapped)
        refs = self._references(listing)
        return refs, listing.skipped

    def _references(self, listing: _Listing) -> list[SampleRef]:
        """A reference per (split, image) found under the image root; an image missing, or one of
        an earlier split (unless `shared_images="keep"`), skips its questions."""
        order = {name: i for i, name in enumerate(dict.fromkeys(name for name, _ in self.splits))}
        found = self._listing()
        refs: list[SampleRef] = []
        keys: dict[str, str] = {}
        leaked = 0
        for path, by_split in listing.places.items():
            key = image_key(path)
            if keys.setdefault(key, path) != path:
                raise PackError(f"images {keys[key]!r} and {path!r} have the same key {key!r}; rename one")
            splits = sorted(by_split, key=order.__getitem__)  # priority: the order of the splits
            for n, split in enumerate(splits):
                asked = listing.questions[(split, path)]
                lost = f"skipped its {len(asked)} question(s) in {split!r} ({_records_text(by_split[split])})"
                if path not in found:
                    listing.skipped.append({"source": path, "key": key,
                                            "reason": f"{path}: image not found under {self.images}; {lost}"})
                elif n and self.shared_images == "skip":
                    first = splits[0]
                    listing.skipped.append({"source": path, "key": key, "reason": (
                        f"{path}: leakage: the image is in split {first!r} ({_records_text(by_split[first])}) "
                        f"and in split {split!r}; kept in {first!r}, {lost}")})
                else:
                    leaked += n == 1
                    url, size = found[path]
                    refs.append(VqaRef(key, (("image", Part(url, 0, size, path)),), split, len(asked),
                                       msgpack.packb(asked, use_bin_type=True)))
        if leaked:
            log.warning("%d images are stored in more than one split (shared_images='keep')", leaked)
        refs.sort(key=lambda r: (order[r.split], r.key))  # type: ignore[index]
        return refs

    def _listing(self) -> dict[str, tuple[str, int]]:
        """Every file under the image root: relative path -> (URL, size), from one listing."""
        fs, root = filesystem(self.images, self.storage_options)
        if not fs.isdir(root):
            raise PackError(f"--images {self.images}: not a folder")
        return {posixpath.relpath(path, root): (fs.unstrip_protocol(path), int(info["size"]))
                for path, info in fs.find(root, detail=True).items() if info.get("type") == "file"}

    # -- encoding --------------------------------------------------------------------------------

    def encode(self, ref: SampleRef) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        assert isinstance(ref, VqaRef), "VqaSource encodes the references its index made"
        (_, part), = ref.parts
        questions = msgpack.unpackb(ref.questions, raw=False)
        places = [_where(q["source"], q["record"], q["fields"]) for q in questions if q["turn"] == 0]
        lost = f"skipped its {len(questions)} question(s) in {ref.split!r} ({_records_text(places)})"
        fs, path = filesystem(part.url, self.storage_options)
        try:
            data = fs.cat_file(path)
        except OSError as exc:
            raise SampleError(f"cannot read the image: {exc}; {lost}",
                              url=part.name, key=ref.key, field="image") from exc
        fmt, mode, (height, width) = _check_image(data, part.name, ref.key, lost)
        stored = (height, width)
        if self.image_max_side and max(height, width) > self.image_max_side:
            stored = fit(height, width, self.image_max_side)
            data_out = resize_image(data, fmt, stored, self.jpeg_quality)
        else:
            data_out = data
        record = {
            "image": {"path": part.name, "width": width, "height": height, "format": fmt, "mode": mode,
                      "sha256": hashlib.sha256(data).hexdigest()},
            "stored_size": list(stored),
            "split": ref.split,
            "questions": questions,
        }
        return [(VQA_IMAGE_EXTS[fmt], data_out), (VQA_RECORD, pack_record(record))], {"questions": len(questions)}


def _check_image(data: bytes, where: str, key: str, lost: str) -> tuple[str, str, tuple[int, int]]:
    """(format, mode, (height, width)) of a whole, decodable JPEG or PNG; SampleError otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(VQA_IMAGE_EXTS))
        with image:
            fmt, mode, size = image.format, image.mode, (image.height, image.width)
            fmt = "JPEG" if fmt == "MPO" else fmt  # a camera's multi-picture JPEG: its first picture is the JPEG
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise SampleError(f"{image.width}x{image.height} pixels exceed the cap "
                                  f"{MAX_IMAGE_PIXELS}; {lost}", url=where, key=key, field="image")
            load_whole(image, jpeg=fmt == "JPEG")
    except UnidentifiedImageError as exc:
        raise SampleError(f"not a JPEG or PNG image; {lost}", url=where, key=key, field="image") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise SampleError(f"truncated or corrupt image: {exc}; {lost}", url=where, key=key, field="image") from exc
    assert fmt in VQA_IMAGE_EXTS
    return fmt, mode, size


def pack_vqa(source: VqaSource, out: str, options: PackOptions | None = None, *, progress: bool = True,
             on_shard: Any = None) -> PackSummary:
    """Pack a VQA collection into `out` (see `shard_tools.pack.pack`): the splits are the source's
    files, so `options.splits` is ignored."""
    options = dataclasses.replace(options or PackOptions(), splits=None)
    return pack(source, source.files, out, options, progress=progress, on_shard=on_shard)


# -- `shard-pack vqa` -------------------------------------------------------------------------------

def _split_file(text: str) -> tuple[str, str]:
    name, _, file = text.partition("=")
    if not name.strip() or not file.strip():
        raise argparse.ArgumentTypeError(f"invalid split {text!r}: want NAME=FILE, e.g. train=train.json")
    return name.strip(), file.strip()


def _add(sub: Subparsers, name: str, dask: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[flags.quiet(), flags.images("re-encode larger images to this long side (JPEG "
                                                                  "stays JPEG, PNG stays lossless)"),
                                      flags.shards("images"), flags.workers(skipped="records or images", dask=dask),
                                      flags.storage()],
                       help="pack a VQA collection: question/answer files per split + an image folder")
    p.add_argument("out", metavar="OUT", help=flags.OUT)
    p.add_argument("--images", required=True, metavar="ROOT", help="folder (or URL) the records' image paths are in")
    p.add_argument("--split", dest="splits", action="append", required=True, type=_split_file, metavar="NAME=FILE",
                   help="a split and its annotation file (JSON list, or .jsonl); repeat for each split or file. An "
                   "image referenced from several splits belongs to the first given")
    p.add_argument("--layout", choices=sorted(LAYOUTS), help="the files' layout (default: detected per file)")
    p.add_argument("--image-key", help="for another layout: the record field holding the image path")
    p.add_argument("--question-key", help="... the question")
    p.add_argument("--answer-key", help="... the answer")
    p.add_argument("--shared-images", choices=["skip", "keep"], default="skip", help="an image in several splits: "
                   "skip its questions in the later splits as leakage (default), or keep it in each")
    return p


def _run(args: argparse.Namespace) -> int:
    options = flags.pack_options(args, splits=None, max_skipped=args.max_skipped)
    source = VqaSource(images=args.images, splits=tuple(args.splits), layout=args.layout, image_key=args.image_key,
                       question_key=args.question_key, answer_key=args.answer_key, shared_images=args.shared_images,
                       image_max_side=args.image_max_side, jpeg_quality=args.jpeg_quality,
                       storage_options=args.storage_options)
    return flags.summary(pack_vqa(source, args.out, options, progress=not args.quiet))


# -- `shard-pack preview`: each image with its question and answer ----------------------------------

def _tiles(batch: dict[str, Any], tile: int) -> Tiles:
    tiles = []
    for i in range(len(batch["keys"])):
        questions, answers = batch["questions"][i], batch["answers"][i]
        pairs = list(zip(questions, answers))[:3] if isinstance(questions, list) else [(questions, answers)]
        text = wrap(str(batch["keys"][i]), tile, 1)
        for question, answer in pairs:
            text += wrap(f"Q: {question}", tile) + wrap(f"A: {answer}", tile)
        tiles.append((picture(batch["images"][i], batch["image_sizes"][i], tile), text))
    return tiles


PACKING = PackingKind(
    add=_add, run=_run, preview=Drawing(tiled(_tiles), shows="VQA: question and answer"),
    key_number=(r"-([0-9a-f]{16})$", 16),  # (the image path's `image_id`)
    options=(KindOption("--image-size", "VQA (VQA: none = as stored)", int_or_none),
             KindOption("--per", "VQA", choices=("question", "image")),
             *(KindOption(f"--{name}", "VQA: Qwen2-VL's pixel budget, with --image-size none", int)
               for name in ("min-pixels", "max-pixels", "pixel-factor"))),
)

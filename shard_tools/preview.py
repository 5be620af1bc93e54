"""`shard-pack preview`: a picture of a split's first decoded samples exactly as the loader yields
them, to check geometry and decoding by eye before a long run. Each kind draws its own
(`shard_tools.kinds`, `PackingKind.preview`: e.g. SA-1B's masks and boxes over the image, VQA's
question and answer under it, embeddings' field statistics); tiles are scaled to a long side of
`tile` pixels.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Sequence
from typing import Any

from PIL import Image

from pipeline import make_stream_loader, validate_first_batch
from pipeline.errors import ConfigError
from pipeline.storage import read_manifest
from shard_tools.drawing import ALPHA, BACKGROUND, Preview, mask_colours
from shard_tools.kinds import KINDS

__all__ = ["ALPHA", "BACKGROUND", "Preview", "mask_colours", "preview", "write_png"]


def preview(source: str, split: str, *, n: int = 8, seed: int = 0, tile: int = 256, columns: int = 4,
            options: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
            allowed_roots: Sequence[str] = ()) -> Preview:
    """The first `n` samples of `split` (shuffled by `seed`), decoded with the kind's `options`
    as `make_stream_loader` does and checked by `validate_first_batch`, drawn in a grid.
    `storage_options` and `allowed_roots` as the loader's (fsspec's options, e.g. an s3 endpoint and
    credentials; places outside the folder its manifest may name)."""
    if n < 1 or tile < 16 or columns < 1:
        raise ConfigError(f"n must be >= 1, tile >= 16 and columns >= 1, got {n}, {tile}, {columns}")
    kind = read_manifest(source, storage_options).kind
    loader = make_stream_loader(source, split, batch_size=n, num_workers=0, seed=seed, drop_last=False,
                                storage_options=storage_options, allowed_roots=allowed_roots, **(options or {}))
    batch = validate_first_batch(loader)
    drawing = KINDS[kind].preview if kind in KINDS else None
    if drawing is None:
        raise KeyError(kind)  # (a kind no packing module draws)
    return drawing.draw(batch, tile, columns)


def write_png(image: Image.Image, path: str | os.PathLike[str]) -> None:
    """Write `image` as PNG at `path` atomically (a temporary file beside it, then a rename), with the
    mode the user's umask gives a new file (mkstemp's would be 0600)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            image.save(f, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

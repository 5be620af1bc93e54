"""The registry of kinds on the reading side: how each builds its options, decodes, collates and checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipeline import embeddings, sa1b, vqa
from pipeline.collate import rows
from pipeline.format import Manifest

__all__ = ["Kind", "KINDS"]


def _one_each(options: Any) -> bool:
    return False


def _members(members: dict[str, bytes], options: Any, *, url: str, key: str, units: int) -> dict[str, bytes]:
    return members


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind's reading side. A sample may hold several units (rows of a block, questions of an
    image): the plan orders units, the loader opens a sample once and decodes its units one by one,
    or, for a `grouped` kind, all of its units in a batch at once (an array of them: the batch
    holds them together, samples in order of their first unit in the plan)."""

    options: Callable[..., Any]  # (manifests, limits, **user options) -> the kind's frozen options
    decode: Callable[..., Any]  # (opened, options, *, unit, seed, epoch, url, key) -> sample, as collate takes it
    collate: Callable[..., dict[str, Any]]  # (samples, options) -> batch in transit (in a worker)
    finish: Callable[..., dict[str, Any]]  # (batch, options) -> batch for the user (after the device copy)
    check: Callable[..., list[str]]  # (batch, options, epoch) -> problems
    verify_options: Callable[[Manifest], Any]  # options that decode everything a sample holds (`shard-pack verify`)
    units: Callable[[Any], bool] = _one_each  # (options) -> whether the plan orders a sample's units (else: samples)
    open: Callable[..., Any] = _members  # (members, options, *, url, key, units the manifest says) -> what `decode` takes
    grouped: bool = False
    unbatch: Callable[..., list[dict[str, Any]]] = rows  # (finished batch, options) -> its samples, padding trimmed


def _sa1b_options(manifests: Sequence[Manifest], limits: Any, **options: Any) -> sa1b.Sa1bOptions:
    return sa1b.Sa1bOptions(max_image_pixels=limits.max_image_pixels, **options)


def _sa1b_verify(manifest: Manifest) -> sa1b.Sa1bOptions:
    return sa1b.Sa1bOptions(image_size=256, mask_size=64, max_masks=1 << 30)


def _vqa_options(manifests: Sequence[Manifest], limits: Any, *, per: str = "question",
                 image_size: int | None = 448, form: str = "batch") -> vqa.VqaOptions:
    return vqa.VqaOptions(per=per, image_size=image_size, max_image_pixels=limits.max_image_pixels, form=form)


def _vqa_verify(manifest: Manifest) -> vqa.VqaOptions:
    return vqa.VqaOptions(per="image", image_size=256)  # every image decoded once, every question checked


def _embeddings_options(manifests: Sequence[Manifest], limits: Any, **options: Any) -> embeddings.EmbeddingsOptions:
    return embeddings.options_from_manifests(manifests, **options)


KINDS: dict[str, Kind] = {
    "sa1b": Kind(_sa1b_options, sa1b.decode_sample, sa1b.collate, sa1b.finish, sa1b.check_batch, _sa1b_verify,
                 unbatch=sa1b.unbatch),
    "vqa": Kind(_vqa_options, vqa.decode_sample, vqa.collate, vqa.finish, vqa.check_batch, _vqa_verify, vqa.units,
                vqa.open_sample, unbatch=vqa.unbatch),
    "embeddings": Kind(_embeddings_options, embeddings.decode, embeddings.collate, embeddings.finish,
                       embeddings.check_batch, embeddings.verify_options, embeddings.units, embeddings.open_block,
                       grouped=True),
}

"""pipeline.config alone: keyword construction, validation messages, and settings told from kind options."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pipeline import LoaderConfig, make_stream_loader
from pipeline.storage import Retry
from pipeline.tario import ReadLimits


def test_keywords_only_and_defaults():
    with pytest.raises(TypeError):
        LoaderConfig(8)  # type: ignore[misc]
    config = LoaderConfig(batch_size=8)
    assert config.limits == ReadLimits() and config.retry == Retry() and config.num_workers == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize(("settings", "message"), [
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"batch_size": True}, "batch_size must be an int >= 1, got True"),
    ({"num_workers": -1}, "num_workers must be an int >= 0"),
    ({"prefetch_factor": 0}, "prefetch_factor must be an int >= 1"),
    ({"shuffle": "sideways"}, "shuffle must be True, False or one of"),
    ({"verify": "md5"}, "verify must be 'size' or 'sha256'"),
    ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip'"),
    ({"max_errors": 1.5}, "max_errors must be None"),
    ({"cache_dir": "/tmp/x"}, "cache_dir and cache_limit go together"),
    ({"first_batch_by_range": "no"}, "first_batch_by_range must be True or False, got 'no'"),
    ({"rank": 0}, "rank and world_size go together"),
    ({"rank": 2, "world_size": 0}, "world_size must be an int >= 1"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LoaderConfig(**{"batch_size": 8, **settings})


def test_split_tells_settings_from_kind_options():
    mine, theirs = LoaderConfig.split({"batch_size": 8, "num_workers": 2, "image_size": 64})
    assert mine == {"batch_size": 8, "num_workers": 2} and theirs == {"image_size": 64}


def test_the_loader_takes_a_config_keywords_or_both(sa1b_dataset):
    config = LoaderConfig(batch_size=2, seed=3)
    loader = make_stream_loader(sa1b_dataset, "train", config=config, num_workers=0, image_size=64, mask_size=32)
    assert loader.config == dataclasses.replace(config, num_workers=0) and loader.kind.options.image_size == 64
    keywords = make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=3, num_workers=0, image_size=64,
                                  mask_size=32)
    assert [b["keys"] for b in loader] == [b["keys"] for b in keywords]


def test_an_unknown_keyword_is_refused_by_name(sa1b_dataset):
    with pytest.raises(ValueError, match=r"sa1b datasets do not take 'batch_szie' \(did you mean 'batch_size'\?\).*LoaderConfig"):
        make_stream_loader(sa1b_dataset, "train", batch_szie=2, batch_size=2, num_workers=0)


def test_only_the_options_not_taken_are_named(sa1b_dataset):
    """Valid options given beside an unknown one are not blamed; each unknown one gets the closest name."""
    with pytest.raises(ValueError) as info:
        make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, image_size=256, max_masks=8, bogus=1)
    message = str(info.value)
    assert message.startswith("sa1b datasets do not take 'bogus': neither an option of theirs (box_noise, ")
    assert "image_size'" not in message.split(":")[0] and "max_masks'" not in message
    with pytest.raises(ValueError, match=r"^sa1b datasets do not take 'image_sze' \(did you mean 'image_size'\?\), "
                                         r"'point_per_mask' \(did you mean 'points_per_mask'\?\): "):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, point_per_mask=1, image_sze=256)
    with pytest.raises(ValueError, match=re.escape("'max_image_pixels' (a read limit: limits=ReadLimits(max_image_pixels=...))")):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, max_image_pixels=1 << 20)

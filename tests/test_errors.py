"""The error classes: which one a bad argument and a dataset problem raise, that both stay ValueErrors,
and that every class pickles with its attributes (errors cross DataLoader worker processes)."""

from __future__ import annotations

import pickle

import pytest

from pipeline import LoaderConfig, World, make_stream_loader
from pipeline.errors import (ConfigError, DatasetError, InputError, ManifestError, PackError, PlanError, RLEError,
                             RowError, SampleError, ShardError, ShardIndexError, ShardstreamError, TooManySkipped)
from pipeline.format import decode_array

SMALL = dict(image_size=32, mask_size=8, max_masks=2)


def _masks(epoch: int) -> int:
    """A max_masks schedule that is fine for epoch 0 and not allowed for epoch 1 (top level: picklable)."""
    return 2 - 3 * epoch


def test_the_new_classes_are_value_errors_and_manifest_error_is_not():
    assert issubclass(ConfigError, ShardstreamError) and issubclass(ConfigError, ValueError)
    assert issubclass(DatasetError, ManifestError) and issubclass(DatasetError, ValueError)
    assert not issubclass(ManifestError, ValueError)


@pytest.mark.parametrize("make", [
    lambda: LoaderConfig(batch_size=0),
    lambda: LoaderConfig(batch_size=2, on_error="ignore"),
    lambda: World(2, 2),
])
def test_a_bad_argument_raises_config_error(make):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.url is None and str(info.value) == info.value.message


def test_dataset_problems_raise_dataset_error_with_their_messages(sa1b_dataset):
    with pytest.raises(DatasetError) as info:
        make_stream_loader(sa1b_dataset, "test", batch_size=2, num_workers=0, **SMALL)
    assert info.value.url == sa1b_dataset and str(info.value).startswith(f"{sa1b_dataset}: no split 'test'; ")
    with pytest.raises(DatasetError, match="too few for one batch of 100"):
        make_stream_loader(sa1b_dataset, "val", batch_size=100, num_workers=0, **SMALL)
    with pytest.raises(DatasetError, match="not an encoded array"):
        decode_array({"dtype": "<i4"})


def test_a_setting_error_is_raised_not_skipped_and_crosses_a_worker(sa1b_dataset):
    for workers in (0, 1):
        loader = make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=workers, on_error="skip",
                                    **{**SMALL, "max_masks": _masks})
        assert len(list(loader)) > 0
        loader.set_epoch(1)
        with pytest.raises(ConfigError, match="max_masks must be an int >= 0"):
            list(loader)


@pytest.mark.parametrize("error", [
    ConfigError("batch_size must be an int >= 1, got 0"),
    DatasetError("no split 'test'; the dataset has ['train']", url="s3://b/d"),
    DatasetError("cannot mix kinds: a is sa1b, b is vqa"),
    ManifestError("not valid JSON", url="s3://b/d/manifest.json"),
    ShardError("truncated", url="s3://b/d/train-000000.tar"),
    ShardIndexError("missing", url="s3://b/d/train-000000.idx"),
    SampleError("not JSON", url="s3://b/d/train-000000.tar", key="k1", field="json"),
    InputError("missing", url="/in/a.json"),
    RowError("not finite", url="/in/a.npy", field="label", row=3, value="nan"),
    PackError("/out holds something else"),
    TooManySkipped("12 skipped, more than 10"),
    PlanError("fewer samples than ranks"),
    RLEError("counts run past the mask", index=4),
])
def test_every_error_pickles_with_its_attributes(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.args == error.args and str(back) == str(error)
    assert vars(back) == vars(error)


def test_the_message_comes_first_and_the_rest_are_keywords():
    assert str(ShardError("truncated", url="s3://b/x.tar")) == "s3://b/x.tar: truncated"
    assert str(SampleError("not JSON", url="u", key="k1")) == "u: sample 'k1': not JSON"
    assert str(RLEError("odd counts", index=2)) == "mask 2: odd counts"
    with pytest.raises(TypeError):
        ShardError("s3://b/x.tar", "truncated")  # the old (url, message) order is refused, not misread
    with pytest.raises(TypeError):
        SampleError("u", "k1", "json", "not JSON")


def test_a_subclass_elsewhere_pickles_with_its_attributes():
    from pipeline.storage.cache import Mismatch

    error = Mismatch("another SHA-256", url="s3://b/x.tar")
    error.add_note("while downloading")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is Mismatch and str(back) == str(error) and vars(back) == vars(error)

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
    DatasetError("s3://b/d", "no split 'test'; the dataset has ['train']"),
    DatasetError(None, "cannot mix kinds: a is sa1b, b is vqa"),
    ManifestError("s3://b/d/manifest.json", "not valid JSON"),
    ShardError("s3://b/d/train-000000.tar", "truncated"),
    ShardIndexError("s3://b/d/train-000000.idx", "missing"),
    SampleError("s3://b/d/train-000000.tar", "k1", "json", "not JSON"),
    InputError("/in/a.json", "missing"),
    RowError("/in/a.npy", "label", 3, "nan", "not finite"),
    PackError("/out holds something else"),
    TooManySkipped("12 skipped, more than 10"),
    PlanError("fewer samples than ranks"),
    RLEError(4, "counts run past the mask"),
])
def test_every_error_pickles_with_its_attributes(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.args == error.args and str(back) == str(error)
    assert vars(back) == vars(error)

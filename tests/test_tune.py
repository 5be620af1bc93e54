"""`shard-pack tune`: a small sweep through the CLI (table, recommendation, plot, JSON), the
recommendation rule on given rows, and bad arguments. No timing is asserted."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from shard_tools.cli import main
from shard_tools.tune import Row, Setting, TuneResult, default_workers, plot, recommend

SMALL = ["--image-size", "64", "--mask-size", "32", "--max-masks", "4"]


def test_a_small_sweep_prints_a_row_per_setting_and_a_recommendation(sa1b_dataset, tmp_path, capsys, caplog):
    png, rows = tmp_path / "tune.png", tmp_path / "tune.json"
    argv = ["tune", sa1b_dataset, "--split", "train", "--batch-size", "2", "--workers", "0,1", "--batches", "2",
            "--warmup", "1", *SMALL, "--plot", str(png), "--json", str(rows)]
    umask = os.umask(0o027)
    try:
        assert main(argv) == 0
    finally:
        os.umask(umask)
    assert png.stat().st_mode & 0o777 == 0o640 and rows.stat().st_mode & 0o777 == 0o640, "the user's umask"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["workers", "prefetch", "read_ahead"]
    table = [line.split() for line in lines[1:3]]
    assert [(t[0], t[1], t[2]) for t in table] == [("0", "-", "1"), ("1", "2", "1")]
    assert all(float(t[3]) > 0 and float(t[4]) >= 0 and float(t[5]) > 0 and float(t[6]) > 0 for t in table)
    # samples/s, CPU ms/sample (in clock ticks: 0 for so short a run), peak MB, first batch s
    assert lines[3].startswith("recommended: num_workers=")
    assert "tune: 6/6 batches (" in caplog.text  # progress as log lines off a terminal: 2 x (1 warm-up + 2 timed)
    written = json.loads(rows.read_text())
    assert [r["setting"]["num_workers"] for r in written["rows"]] == [0, 1]
    assert written["recommendation"] == lines[3]
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (960, 320)


def _row(workers: int, rate: float, peak: float | None, cpu: float = 5.0) -> Row:
    return Row(Setting(workers), rate, cpu, peak, 0.1, 100)


def test_the_recommendation_is_the_least_memory_within_95_percent_of_the_best():
    rows = [_row(0, 50, 200), _row(1, 80, 250), _row(2, 96, 300), _row(4, 100, 500), _row(8, 99, 700)]
    assert recommend(rows).setting == Setting(2)
    result = TuneResult(tuple(rows), rows[3], recommend(rows))
    assert result.recommendation() == ("recommended: num_workers=2, prefetch_factor=2: 96% of the best throughput "
                                       "(num_workers=4, prefetch_factor=2) at 60% of its memory, 100% of its CPU "
                                       "per sample")
    assert recommend([_row(2, 97, 300, cpu=9.0), _row(4, 100, 300, cpu=4.0)]).setting == Setting(4)  # then CPU
    assert recommend([_row(4, 100, None), _row(2, 96, None)]).setting == Setting(2)  # no memory figures: fewer workers
    coarse = [_row(4, 100, 500, cpu=0.0), _row(2, 96, 300, cpu=0.0)]  # CPU below a clock tick
    assert TuneResult(tuple(coarse), coarse[0], recommend(coarse)).recommendation().endswith("at 60% of its memory")
    alone = TuneResult((rows[3],), rows[3], rows[3])
    assert alone.recommendation() == "recommended: num_workers=4, prefetch_factor=2: the best throughput (100.0 samples/s)"
    assert plot(result).size == (960, 320)


def test_default_workers_double_up_to_the_cores():
    assert default_workers(1) == (0, 1)
    assert default_workers(2) == (0, 1, 2)
    assert default_workers(6) == (0, 1, 2, 4, 6)
    assert default_workers(16) == (0, 1, 2, 4, 8, 16)
    assert default_workers(256)[-1] == 32


@pytest.mark.parametrize("extra, message", [
    (["--split", "nope"], "nope"),
    (["--workers", "-1"], "workers must be ints >= 0"),
    (["--batches", "0"], "batches and warmup must be >= 1"),
    (["--per", "image"], "per"),  # a VQA option for an SA-1B dataset
])
def test_bad_arguments_exit_2_with_a_message(sa1b_dataset, caplog, extra, message):
    argv = ["tune", sa1b_dataset, "--split", "train", "--batch-size", "2", "--workers", "0", *SMALL, *extra]
    assert main(argv) == 2
    assert message in caplog.text


def test_a_batch_larger_than_the_split_exits_2(sa1b_dataset, caplog):
    assert main(["tune", sa1b_dataset, "--split", "val", "--batch-size", "1000", *SMALL]) == 2
    assert "too few for one batch of 1000" in caplog.text


def test_unparsable_lists_are_refused_by_the_parser(sa1b_dataset, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", sa1b_dataset, "--split", "train", "--batch-size", "2", "--workers", "0,two"])
    assert exit_.value.code == 2
    assert "invalid list '0,two'" in capsys.readouterr().err

"""`make demo` runs shard_tools.samples.demo: it must keep working end to end."""

from __future__ import annotations

from shard_tools.samples import demo


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert demo.main(["--work", str(tmp_path), "--images", "12", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "verify: OK" in out and "epoch 2:" in out and "demo done" in out
    assert "cache warm" in out and "DIFFERENT" not in out  # the object-storage step ran, on SeaweedFS
    assert f"preview: {tmp_path / 'preview.png'} (" in out and (tmp_path / "preview.png").stat().st_size > 0

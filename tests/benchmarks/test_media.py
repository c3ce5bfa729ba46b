"""`python -m hippo.benchmarks.media`: the media path's timing table on a synthetic 720p clip."""

from __future__ import annotations

from hippo.benchmarks import media


def test_media_bench_times_a_clip_at_the_asked_size(capsys):
    (row,) = media.main(["--frames", "4", "--no-prefill", "--repeats", "1"])
    # 4 frames of 1280 x 720 within 448 x 448 pixels: 588 x 336, 2 temporal patches of 21 x 12 tokens
    assert row["visual_tokens"] == 2 * 21 * 12 and row["decode_s"] > 0 and row["build_s"] > 0
    assert "| 4 | 504 |" in capsys.readouterr().out

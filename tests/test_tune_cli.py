"""`trm tune-batching` refuses bad arguments before it starts anything (no progress display, no server)."""

from __future__ import annotations

import pytest
from helpers import run_cli


@pytest.mark.parametrize("args, message", [
    (("--p99-ms", "0", "--low-rps", "10", "--peak-rps", "20"), "--p99-ms must be positive"),
    (("--p99-ms", "40", "--low-rps", "30", "--peak-rps", "20"), "--low-rps <= --peak-rps"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--headroom", "0.5"), "--headroom"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--budget", "-1"), "--budget"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--requests", "0"), "--requests"),
    (("--check", "--p99-ms", "-3"), "--p99-ms must be positive"),
    (("--check", "--requests", "0"), "--requests"),
])
def test_bad_arguments_are_refused_before_the_progress_display(capsys, tmp_path, args, message):
    result = run_cli(capsys, "tune-batching", "m", "--repo", tmp_path / "repo", *args)
    assert result.code == 2, result.err
    assert message in result.err
    assert "of budget" not in result.err and "starting" not in result.err  # the progress bar never began


def test_write_for_an_unknown_model_is_refused_before_the_progress_display(capsys, tmp_path):
    result = run_cli(capsys, "tune-batching", "nope", "--repo", tmp_path / "repo", "--p99-ms", "40",
                     "--low-rps", "10", "--peak-rps", "20", "--write")
    assert result.code == 4, result.err
    assert "of budget" not in result.err

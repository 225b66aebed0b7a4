"""`trm tune-batching` refuses bad arguments before it starts anything (no progress display, no server)."""

from __future__ import annotations

import pytest
from helpers import run_cli


@pytest.mark.parametrize("args, message", [
    (("--p99-ms", "0", "--low-rps", "10", "--peak-rps", "20"), "'--p99-ms': '0' must be above 0"),
    (("--p99-ms", "nan", "--low-rps", "10", "--peak-rps", "20"), "'--p99-ms': 'nan' is not a finite number"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "inf"), "'--peak-rps': 'inf' is not a finite number"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--headroom", "nan"), "--headroom"),
    (("--p99-ms", "40", "--low-rps", "30", "--peak-rps", "20"), "--low-rps <= --peak-rps"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--headroom", "0.5"), "--headroom"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--budget", "-1"), "--budget"),
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--requests", "0"), "--requests"),
    # less than the measurements every run makes (at 10/20/24 requests/s, 300 requests a point: minutes)
    (("--p99-ms", "40", "--low-rps", "10", "--peak-rps", "20", "--budget", "60"),
     "--budget 60 s is less than the measurements every run makes take here: about "),
    (("--check", "--p99-ms", "-3"), "'--p99-ms': '-3' must be above 0"),
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


LLM_SLO = ("--ttft-p99-ms", "500", "--itl-p99-ms", "50", "--low-rps", "1", "--peak-rps", "2")


@pytest.mark.parametrize("args, message", [
    (("--ttft-p99-ms", "500", "--low-rps", "1", "--peak-rps", "2"), "(missing: --itl-p99-ms)"),
    (("--itl-p99-ms", "0", "--ttft-p99-ms", "500"), "'--itl-p99-ms': '0' must be above 0"),
    ((*LLM_SLO, "--p99-ms", "40"), "--p99-ms tunes Triton's dynamic batcher; a vLLM model is tuned with"),
    ((*LLM_SLO, "--check"), "--check tunes Triton's dynamic batcher"),
    ((*LLM_SLO, "--max-num-seqs", "4,x"), "--max-num-seqs takes whole numbers of at least 1 separated by commas"),
    ((*LLM_SLO, "--max-num-batched-tokens", "0"), "--max-num-batched-tokens takes whole numbers"),
    ((*LLM_SLO, "--output-tokens", "1"), "'--output-tokens'"),
    ((*LLM_SLO[:6], "--low-rps", "3", "--peak-rps", "2"), "--low-rps <= --peak-rps"),
])
def test_bad_vllm_tuning_arguments_are_refused_with_one_line_and_exit_2(capsys, tmp_path, args, message):
    result = run_cli(capsys, "tune-batching", "m", "--repo", tmp_path / "repo", *args)
    assert result.code == 2, result.err
    assert message in result.err
    assert "Traceback" not in result.err and "starting the engine" not in result.err


def test_vllm_flags_on_a_model_that_is_not_vllm_are_refused_before_a_server_starts(capsys, tmp_path):
    from onnx_models import linear

    repo = tmp_path / "repo"
    assert run_cli(capsys, "publish", "model", str(linear(tmp_path / "m.onnx")), "--name", "m", "--repo", repo,
                   "--no-verify").code == 0
    result = run_cli(capsys, "tune-batching", "m", "--repo", repo, *LLM_SLO, "--write")
    assert result.code == 3, result.err
    assert "m is not a vLLM model (backend onnxruntime)" in result.err

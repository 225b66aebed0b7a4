"""Helpers for tests: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from repo_manager.cli import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def run_cli(capsys, *args: str) -> Result:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return Result(int(exit_info.value.code or 0), captured.out, captured.err)

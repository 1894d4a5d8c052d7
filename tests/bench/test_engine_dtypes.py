"""`pdserve bench engine --dtypes`: the dtypes a run covers (the GPU check's CPU dry run takes float32 alone), refused
where unknown or on a benchmark that takes none."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.commands.bench import run_bench


def test_dtypes_are_parsed_checked_and_refused_elsewhere(capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "engine", "--dtypes", "float32"]).dtypes == ["float32"]
    assert parser.parse_args(["bench", "engine"]).dtypes is None
    assert run_bench(parser.parse_args(["bench", "engine", "--quick", "--dtypes", "float16"])) == 2
    assert "unknown dtype(s) ['float16']" in capsys.readouterr().err
    assert run_bench(parser.parse_args(["bench", "quant", "--dtypes", "float32"])) == 2
    assert "takes no --dtypes" in capsys.readouterr().out

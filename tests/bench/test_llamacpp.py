"""`pdserve bench llamacpp` without llama.cpp: flags, the not-run rule, decode rates, ratios and the JSON's shape.

The real build and run are `pdserve bench llamacpp --quick --out FILE.json` (docs/performance.md): building llama.cpp
takes too long for the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llamacpp as L
from bench import peer_llamacpp as P
from pdserve.commands.bench import BENCHMARKS


def _figures(decode: float, out: float, ttft: float = 0.1, itl: float = 0.02) -> dict[str, float]:
    return {"decode_tok_s": decode, "output_tok_s": out, "ttft_p50_s": ttft, "itl_p50_s": itl, "itl_p99_s": 2 * itl}


def _precision(single: tuple[float, float], c8: tuple[float, float]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        "single": {"pdserve": _figures(single[0], single[0]), "llamacpp": _figures(single[1], single[1])},
        "c4": {"pdserve": _figures(1.0, 50.0), "llamacpp": _figures(1.0, 100.0)},
        "c8": {"pdserve": _figures(1.0, c8[0]), "llamacpp": _figures(1.0, c8[1])},
    }


def test_registered_as_a_benchmark() -> None:
    assert "llamacpp" in BENCHMARKS


def test_pdserve_flags_per_precision() -> None:
    assert L.pdserve_flags("fp32") == ["--dtype", "float32"]
    assert L.pdserve_flags("bf16") == ["--dtype", "bfloat16"]
    assert L.pdserve_flags("int8") == ["--dtype", "float32", "--quantization", "int8"]
    with pytest.raises(ValueError, match="unknown precision"):
        L.pdserve_flags("fp8")


def test_decode_rate_is_tokens_after_first_over_time_after_first() -> None:
    assert L.decode_tok_s([1.0, 1.5, 2.0, 3.0], 5) == pytest.approx(4 / 2.0)  # a chunk may carry several tokens
    assert L.decode_tok_s([1.0], 1) is None
    assert L.decode_tok_s([1.0, 1.0], 2) is None


def test_ratio_and_median() -> None:
    assert L.ratio(30.0, 20.0) == pytest.approx(1.5)
    assert L.ratio(None, 20.0) is None and L.ratio(3.0, 0.0) is None
    m = L.median_of([{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}])
    assert m == {"a": 2.0, "b": None, "repeats": 3}


def test_assemble_ratios_and_minimum() -> None:
    cfg = L.Config.make(quick=False, threads=2)
    results = {
        "fp32": _precision(single=(60.0, 40.0), c8=(160.0, 200.0)),
        "bf16": _precision(single=(30.0, 60.0), c8=(150.0, 100.0)),
    }
    out = L.assemble(results, cfg, {"version": "test"})
    r = out["ratios"]
    assert r["single_stream_fp32_vs_llamacpp_f32"] == pytest.approx(1.5)
    assert r["single_stream_bf16_vs_llamacpp_bf16"] == pytest.approx(0.5)
    assert r["c8_out_tok_s_vs_llamacpp_parallel_fp32"] == pytest.approx(0.8)
    assert r["c8_out_tok_s_vs_llamacpp_parallel_bf16"] == pytest.approx(1.5)
    assert r["c8_out_tok_s_vs_llamacpp_parallel"] == pytest.approx(0.8)  # the worst precision
    assert set(out["results"]) == {"fp32", "bf16"}
    assert out["config"]["pdserve_flags"]["int8"] == ["--unified", "--dtype", "float32", "--quantization", "int8"]
    single_fp32 = next(row for row in out["table"] if row["precision"] == "fp32 / f32" and row["workload"] == "single")
    assert single_fp32["TTFT p50 ms"] == "100.0 / 100.0"


def test_assemble_without_any_c8_has_no_minimum() -> None:
    single_only = {"fp32": {"single": _precision(single=(60.0, 40.0), c8=(1.0, 1.0))["single"]}}
    out = L.assemble(single_only, L.Config.make(quick=True, threads=2), {})
    assert set(out["ratios"]) == {"single_stream_fp32_vs_llamacpp_f32"}


def test_quick_config_is_smaller() -> None:
    quick, full = L.Config.make(True, 2), L.Config.make(False, 2)
    assert set(quick.precisions) < set(full.precisions) == set(L.PRECISIONS)
    assert quick.repeats < full.repeats and quick.single_tokens < full.single_tokens == 256
    assert [w[:2] for w in L.workloads(full)] == [("single", 1), ("c4", 4), ("c8", 8)]


def test_prompts_are_seeded_and_clear_of_special_ids() -> None:
    a, b = L.prompts(8, 16, 49152, seed=3), L.prompts(8, 16, 49152, seed=3)
    assert a == b and len(a) == 8 and all(len(p) == 16 and min(p) >= 100 and max(p) < 49052 for p in a)
    assert L.prompts(8, 16, 49152, seed=4) != a


def test_build_key_follows_version_and_cpu_flags() -> None:
    k = P.build_key("0.3.36", ["avx2", "fma"])
    assert k == P.build_key("0.3.36", ["fma", "avx2"])  # order of /proc/cpuinfo does not matter
    assert k != P.build_key("0.3.36", ["avx2", "fma", "avx512f"])
    assert k != P.build_key("0.3.37", ["avx2", "fma"])


def test_server_args_share_context_between_slots() -> None:
    args = P.server_args(Path("m.gguf"), 8081, threads=2, parallel=8, ctx_per_slot=400)
    assert args[args.index("-c") + 1] == "3200"
    assert args[args.index("--parallel") + 1] == "8" and "--cont-batching" in args
    assert args[args.index("-t") + 1] == "2" and args[args.index("--host") + 1] == "127.0.0.1"


def test_gguf_types_cover_every_precision() -> None:
    assert set(P.GGUF_TYPES) == set(L.PRECISIONS) == set(L.LLAMA_NAMES)
    assert {P.GGUF_TYPES[p] for p in L.PRECISIONS} == {L.LLAMA_NAMES[p] for p in L.PRECISIONS}
    with pytest.raises(ValueError, match="no GGUF type"):
        P.ensure_gguf(Path("unused"), "fp8")


def test_int8_from_gguf_is_taken_by_llamacpp_alone(capsys) -> None:
    import inspect

    from pdserve.cli import build_parser
    from pdserve.commands.bench import run_bench

    parser = build_parser()
    assert parser.parse_args(["bench", "llamacpp", "--int8-from-gguf"]).int8_from_gguf is True
    assert parser.parse_args(["bench", "llamacpp"]).int8_from_gguf is None
    assert inspect.signature(L.run).parameters["int8_from_gguf"].default is False
    assert run_bench(parser.parse_args(["bench", "quant", "--int8-from-gguf"])) == 2
    assert "takes no --int8-from-gguf" in capsys.readouterr().out

"""Router.ValidateConfig as a table test over a grid of models x parallel configs x roles, through real gRPC.

The expected verdict comes from pdserve.parallel_config (the ONE module with vLLM's rules; its own grid test checks
it against an independent restatement) plus the two role rules stated plainly here: DCP only on decode pods, and
one data-parallel replica per pod. The RPC must agree on valid / message / fix for every row, its fixes must make
the config valid, and a valid row must come with the KV layout.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import pytest
from router_helpers import run, running_router, stubs

from pdserve.parallel_config import ModelParallelInfo, ParallelConfig, check_parallel_config, num_local_kv_heads
from pdserve_api.v1 import common_pb2, router_pb2

DECODE, PREFILL = common_pb2.ROLE_DECODE, common_pb2.ROLE_PREFILL

# (heads, kv heads, mla, sliding window): GQA, MHA, MQA, odd GQA, MLA, and a windowed GQA model.
MODELS = [
    (32, 8, False, 0),
    (32, 32, False, 0),
    (32, 1, False, 0),
    (40, 8, False, 0),
    (24, 2, False, 0),
    (16, 16, True, 0),
    (32, 8, False, 4096),
]
TPS = [0, 1, 2, 3, 4, 8, 16, 32, -1]  # 0 = unset -> 1 (proto convention); -1 -> the positive-size rule
DCPS = [0, 1, 2, 3, 4, 8]
EXTRA = [  # (pp, interleave, block)
    (0, 0, 0),
    (2, 1, 16),
    (1, 4, 16),
    (1, 32, 16),
    (1, 16, 64),
    (1, 3, 16),
    (1, 1, -16),
]
ROLES = [DECODE, PREFILL, common_pb2.ROLE_UNSPECIFIED]


def rows():
    for (h, kv, mla, sw), tp, dcp, (pp, inter, bs), role in itertools.product(MODELS, TPS, DCPS, EXTRA, ROLES):
        if role == PREFILL and (pp, inter, bs) not in ((0, 0, 0), (1, 4, 16)):
            continue  # prefill: the role rule is what matters; keep the table affordable on 2 cores
        yield h, kv, mla, sw, tp, dcp, pp, inter, bs, role


ROWS = list(rows())


def d(v, default=1):
    return default if v == 0 else v


def expected(h, kv, mla, sw, tp, dcp, pp, inter, bs, role):
    """(valid, message, {flag: value} of the fix) stated from the rules."""
    model = ModelParallelInfo(h, kv, mla, sw or None)
    cfg = ParallelConfig(d(tp), d(dcp), d(pp), d(inter), d(bs, 16))
    if role == PREFILL and cfg.decode_context_parallel_size != 1:
        rest = check_parallel_config(
            model, ParallelConfig(cfg.tensor_parallel_size, 1, cfg.pipeline_parallel_size, 1, cfg.block_size)
        )
        fix = {"--decode-context-parallel-size": 1, **({} if rest.valid else rest.fix.changes)}
        msg = (
            f"decode context parallelism is for decode pods only, but this prefill pod has "
            f"`--decode-context-parallel-size` ({cfg.decode_context_parallel_size})."
        )
        return False, msg, fix, cfg
    v = check_parallel_config(model, cfg)
    return v.valid, v.message, ({} if v.valid else v.fix.changes), cfg


def request(h, kv, mla, sw, tp, dcp, pp, inter, bs, role):
    return router_pb2.ValidateConfigRequest(
        shape=common_pb2.ModelShape(
            num_attention_heads=h,
            num_kv_heads=kv,
            use_mla=mla,
            sliding_window=sw,
            num_layers=4,
            head_dim=64,
            dtype="bfloat16",
            kv_lora_rank=448 if mla else 0,
            qk_rope_head_dim=64 if mla else 0,
        ),
        parallel=common_pb2.ParallelConfig(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            pipeline_parallel_size=pp,
            dcp_kv_cache_interleave_size=inter,
        ),
        block_size=bs,
        role=role,
    )


@pytest.mark.slow
def test_grid_over_rpc():
    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            results = []
            for i in range(0, len(ROWS), 64):
                batch = ROWS[i : i + 64]
                results += await asyncio.gather(*(router.ValidateConfig(request(*r)) for r in batch))
            return results

    results = run(body())
    assert len(results) == len(ROWS) > 1500
    n_valid = 0
    for row, resp in zip(ROWS, results):
        h, kv, mla, sw, tp, dcp, pp, inter, bs, role = row
        valid, msg, fix, cfg = expected(*row)
        assert resp.valid == valid, row
        if valid:
            n_valid += 1
            assert resp.message.startswith(msg), (row, resp.message)
            assert not resp.fixes
            lay = resp.kv_layout
            assert lay.tp_size == cfg.tensor_parallel_size and lay.block_size == cfg.block_size
            assert lay.num_layers == 4 and lay.dtype == "bfloat16" and lay.element_size == 2
            eff_dcp = 1 if role == PREFILL else cfg.decode_context_parallel_size
            assert lay.dcp_size == eff_dcp
            if mla:
                assert lay.use_mla and lay.num_kv_heads == 1 and lay.num_kv_heads_per_rank == 1
                assert lay.head_dim == 448 + 64
            else:
                assert lay.num_kv_heads == kv and lay.head_dim == 64
                assert lay.num_kv_heads_per_rank == num_local_kv_heads(kv, cfg.tensor_parallel_size)
            replicated = not mla and cfg.tensor_parallel_size > kv
            assert any("replicated" in w for w in resp.warnings) == replicated, (row, list(resp.warnings))
        else:
            assert resp.message == msg, (row, resp.message)
            assert not resp.HasField("kv_layout")
            got = {f.flag: int(f.suggested_value) for f in resp.fixes}
            assert got == fix, row
            assert all(f.text for f in resp.fixes)
            # The fix, applied through the RPC's own structured fields, makes the row valid.
            names = {
                "--tensor-parallel-size": "tp",
                "--decode-context-parallel-size": "dcp",
                "--pipeline-parallel-size": "pp",
                "--dcp-kv-cache-interleave-size": "inter",
                "--block-size": "bs",
            }
            fixed = dict(zip(("h", "kv", "mla", "sw", "tp", "dcp", "pp", "inter", "bs", "role"), row))
            for flag, value in got.items():
                fixed[names[flag]] = value
            v2, _, _, _ = expected(*fixed.values())
            assert v2, (row, got)
    assert n_valid > 200


def test_fix_text_and_structured_field_for_the_seed_example():
    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            return await router.ValidateConfig(request(32, 8, False, 0, 8, 2, 0, 0, 0, DECODE))

    r = run(body())
    assert not r.valid
    assert r.message.startswith("Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (8)")
    assert [(f.flag, f.suggested_value) for f in r.fixes] == [("--tensor-parallel-size", "16")]
    assert "--tensor-parallel-size 16" in r.fixes[0].text


def test_model_path_is_read_and_errors_are_grpc_codes(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 128,
                "num_hidden_layers": 3,
                "torch_dtype": "float32",
            }
        )
    )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")

    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            ok = await router.ValidateConfig(
                router_pb2.ValidateConfigRequest(
                    model_path=str(tmp_path),
                    parallel=common_pb2.ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2),
                )
            )
            bad = await router.ValidateConfig(
                router_pb2.ValidateConfigRequest(
                    model_path=str(tmp_path),
                    parallel=common_pb2.ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
                )
            )
            codes = []
            for req in (
                router_pb2.ValidateConfigRequest(),
                router_pb2.ValidateConfigRequest(model_path=str(tmp_path / "missing")),
                router_pb2.ValidateConfigRequest(model_path=str(tmp_path / "broken")),
                router_pb2.ValidateConfigRequest(shape=common_pb2.ModelShape(num_attention_heads=0)),
                router_pb2.ValidateConfigRequest(shape=common_pb2.ModelShape(num_attention_heads=8, num_kv_heads=3)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await router.ValidateConfig(req)
                codes.append(e.value.code())
            return ok, bad, codes

    ok, bad, codes = run(body())
    assert ok.valid and ok.kv_layout.num_layers == 3 and ok.kv_layout.head_dim == 16
    assert ok.kv_layout.dcp_size == 2 and ok.kv_layout.num_kv_heads_per_rank == 1
    assert not bad.valid and bad.fixes[0].flag == "--tensor-parallel-size" and bad.fixes[0].suggested_value == "4"
    assert codes == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]


def test_data_parallel_is_refused_with_a_fix():
    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            req = request(32, 8, False, 0, 2, 1, 0, 0, 0, DECODE)
            req.parallel.data_parallel_size = 2
            return await router.ValidateConfig(req)

    r = run(body())
    assert not r.valid and "data-parallel-size" in r.message
    assert [(f.flag, f.suggested_value) for f in r.fixes] == [("--data-parallel-size", "1")]


def test_rpc_agrees_with_the_cli(tmp_path, capsys):
    """`pdserve validate --json` and the RPC give the same verdict and fix (one module behind both)."""
    from pdserve.commands.validate import main_validate

    cases = [(32, 8, 8, 2), (32, 8, 16, 2), (32, 32, 4, 2), (24, 2, 8, 4), (40, 8, 3, 1)]

    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            return [
                await router.ValidateConfig(request(h, kv, False, 0, tp, dcp, 0, 0, 0, DECODE))
                for h, kv, tp, dcp in cases
            ]

    rpc = run(body())
    for (h, kv, tp, dcp), r in zip(cases, rpc):
        capsys.readouterr()
        code = main_validate(
            ["--num-attention-heads", str(h), "--num-kv-heads", str(kv), "-tp", str(tp), "-dcp", str(dcp), "--json"]
        )
        cli = json.loads(capsys.readouterr().out)
        assert cli["valid"] == r.valid and (code == 0) == r.valid
        assert r.message.startswith(cli["message"])
        if not r.valid:
            assert {f.flag: int(f.suggested_value) for f in r.fixes} == cli["fix"]["changes"]
            assert r.fixes[0].text == cli["fix"]["text"]

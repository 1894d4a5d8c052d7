"""The committed pdserve_api/ package matches proto/ and every generated module imports.

Also proves that `scripts/gen_proto.py --check` fails on stale, missing and extra files,
and smoke-tests the API shape (services, streaming kinds, a real in-process gRPC call).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"
PROTO_DIR = REPO_ROOT / "proto" / "pdserve_api" / "v1"


def _load_script():
    spec = importlib.util.spec_from_file_location("gen_proto", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen_proto = _load_script()

version_pinned = pytest.mark.skipif(
    gen_proto.installed_grpcio_tools_version() != gen_proto.GRPCIO_TOOLS_VERSION,
    reason=f"generated code is pinned to grpcio-tools=={gen_proto.GRPCIO_TOOLS_VERSION}",
)


def _run_check(target: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--check"]
    if target is not None:
        cmd += ["--target", str(target)]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@version_pinned
def test_committed_code_is_up_to_date():
    res = _run_check()
    assert res.returncode == 0, f"stale generated code:\n{res.stdout}{res.stderr}"


@version_pinned
def test_check_fails_on_stale_missing_and_extra_files(tmp_path):
    files = gen_proto.generate(tmp_path)
    assert "pdserve_api/__init__.py" in files and "pdserve_api/v1/__init__.py" in files
    assert "pdserve_api/v1/router_pb2_grpc.py" in files

    # A fresh generation is identical to itself (deterministic) and passes --check.
    again = tmp_path / "again"
    gen_proto.generate(again)
    assert gen_proto.compare(tmp_path, again) == []
    assert _run_check(tmp_path).returncode == 0

    stale = tmp_path / "pdserve_api" / "v1" / "router_pb2.py"
    stale.write_text(stale.read_text() + "\n# hand edit\n")
    (tmp_path / "pdserve_api" / "v1" / "decode_pb2.pyi").unlink()
    (tmp_path / "pdserve_api" / "v1" / "old_pb2.py").write_text("")

    res = _run_check(tmp_path)
    assert res.returncode == 1
    assert "stale: pdserve_api/v1/router_pb2.py" in res.stderr
    assert "missing: pdserve_api/v1/decode_pb2.pyi" in res.stderr
    assert "extra: pdserve_api/v1/old_pb2.py" in res.stderr

    # A regen repairs the tree.
    gen_proto.sync(again, tmp_path)
    assert gen_proto.compare(again, tmp_path) == []


def _all_modules():
    import pdserve_api

    return sorted(m.name for m in pkgutil.walk_packages(pdserve_api.__path__, "pdserve_api."))


def test_every_proto_has_generated_modules():
    mods = set(_all_modules())
    protos = sorted(p.stem for p in PROTO_DIR.glob("*.proto"))
    assert protos
    for stem in protos:
        assert f"pdserve_api.v1.{stem}_pb2" in mods
        assert f"pdserve_api.v1.{stem}_pb2_grpc" in mods


@pytest.mark.parametrize("name", _all_modules())
def test_import_every_module(name):
    importlib.import_module(name)


def test_every_declaration_is_commented():
    """Every service, rpc, message, enum and oneof has a `//` comment right above it."""
    missing = []
    for path in sorted(PROTO_DIR.glob("*.proto")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*(service|rpc|message|enum|oneof)\s", line):
                if i == 0 or not lines[i - 1].strip().startswith("//"):
                    missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)


# (service, method) -> (client_streaming, server_streaming)
EXPECTED_RPCS = {
    ("Router", "Generate"): (False, True),
    ("Router", "ValidateConfig"): (False, False),
    ("Router", "ClusterStatus"): (False, False),
    ("Router", "Cancel"): (False, False),
    ("Registry", "RegisterWorker"): (False, False),
    ("Registry", "Heartbeat"): (False, False),
    ("Registry", "DeregisterWorker"): (False, False),
    ("PrefillWorker", "Prefill"): (False, False),
    ("PrefillWorker", "CancelPrefill"): (False, False),
    ("PrefillWorker", "ReleaseKV"): (False, False),
    ("DecodeWorker", "AllocateKV"): (False, False),
    ("DecodeWorker", "Decode"): (False, True),
    ("DecodeWorker", "CancelDecode"): (False, False),
}


def test_services_and_rpcs():
    from pdserve_api.v1 import decode_pb2, kv_transfer_pb2, prefill_pb2, registry_pb2, router_pb2

    found = {}
    for mod in (router_pb2, registry_pb2, prefill_pb2, decode_pb2, kv_transfer_pb2):
        assert mod.DESCRIPTOR.package == "pdserve.v1"
        for svc in mod.DESCRIPTOR.services_by_name.values():
            for m in svc.methods:
                found[(svc.name, m.name)] = (m.client_streaming, m.server_streaming)
    assert found == EXPECTED_RPCS


def test_messages_round_trip():
    from pdserve_api.v1 import common_pb2, prefill_pb2, router_pb2

    req = router_pb2.GenerateRequest(
        request_id="r1",
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3]),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"]),
    )
    assert req.WhichOneof("prompt") == "token_ids"
    assert req.sampling_params.HasField("temperature") and not req.sampling_params.HasField("seed")
    req.chat.messages.add(role="user", content="hi")  # switching the oneof clears token_ids
    assert req.WhichOneof("prompt") == "chat" and not req.HasField("token_ids")
    assert router_pb2.GenerateRequest.FromString(req.SerializeToString()) == req

    pre = prefill_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=[5, 6],
        decode_target=prefill_pb2.DecodeTarget(
            decode_pod_id="d0",
            layout=common_pb2.KVLayout(num_layers=2, block_size=16, tp_size=2, dcp_size=2),
            transfer_modes=[common_pb2.TRANSFER_MODE_NIXL_PULL, common_pb2.TRANSFER_MODE_TCP],
        ),
    )
    assert prefill_pb2.PrefillRequest.FromString(pre.SerializeToString()) == pre
    # The TCP fallback keeps GRPC's number, so peers built before the rename read the same mode.
    assert common_pb2.TransferMode.Value("TRANSFER_MODE_TCP") == 3
    assert set(common_pb2.TransferMode.values()) == {0, 1, 3}  # 2 (NIXL_PUSH) is reserved
    assert common_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert common_pb2.Role.Value("ROLE_DECODE") == 2


def test_in_process_streaming_call():
    """The generated stubs and servicers work end to end (Router.Generate stream + Cancel)."""
    import grpc

    from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

    class Router(router_pb2_grpc.RouterServicer):
        def Generate(self, request, context):
            for tok in request.token_ids.ids:
                yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[tok])
            yield router_pb2.GenerateResponse(
                request_id=request.request_id,
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3),
                timing=common_pb2.Timing(ttft_s=0.01),
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    router_pb2_grpc.add_RouterServicer_to_server(Router(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            msgs = list(
                stub.Generate(
                    router_pb2.GenerateRequest(request_id="x", token_ids=common_pb2.TokenIds(ids=[7, 8, 9])), timeout=10
                )
            )
            assert [t for m in msgs for t in m.token_ids] == [7, 8, 9]
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert msgs[-1].usage.completion_tokens == 3
            # Unimplemented RPCs answer UNIMPLEMENTED (base servicer behaviour).
            with pytest.raises(grpc.RpcError) as ei:
                stub.Cancel(router_pb2.CancelRequest(request_id="x"), timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)

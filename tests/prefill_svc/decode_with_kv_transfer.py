"""A decode pod (decode_svc's DecodeServer) whose KV source is a kv_transfer puller fed from PrefillResponse.kv_handle.

Stop-gap for the prefill -> decode tests while `python -m decode_svc` serves only file:// KV handles: same flags as
`python -m decode_svc`; the only addition is the kv_source_factory below (KVHandle -> kv_transfer KVHandoff ->
TransferKVSource, one TCP puller per decode rank over that rank's region)."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys


def make_rank_puller(runner):
    """Runs on each decode rank (pickled by reference): a puller over this rank's KV region."""
    from kv_transfer.factory import make_puller
    from kv_transfer.layout import KVLayout

    cfg, ps, cache = runner.cfg, runner.ps, runner.kv_cache
    layout = KVLayout(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      dtype=str(cache.dtype), block_size=runner.block_size, tp_size=ps.tp_size, dcp_size=ps.dcp_size,
                      interleave=ps.dcp_interleave, num_blocks=cache.shape[2])
    return make_puller(layout, ps.tp_rank, cache, backend="tcp")


def kv_source_factory(req):
    from decode_svc.kv_source import TransferKVSource
    from pdserve.pod.convert import kv_handle_to_handoff

    handoff = kv_handle_to_handoff(req.kv_handle, req.request_id)
    return TransferKVSource(handoff.to_json(), len(req.prompt_token_ids), make_rank_puller, timeout_s=60.0)


async def serve(cfg) -> None:
    from decode_svc.server import DecodeServer

    server = DecodeServer(cfg, kv_source_factory=kv_source_factory)
    await server.start()
    loop = asyncio.get_running_loop()

    async def shutdown() -> None:
        await server.drain()
        await server.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(shutdown()))
    print(f"decode_svc ready: DecodeWorker on {cfg.serving.host}:{server.port}", flush=True)
    await server.wait_stopped()


def main() -> int:
    from decode_svc.__main__ import build_parser, config_from_args

    a = build_parser().parse_args(sys.argv[1:])
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config_from_args(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

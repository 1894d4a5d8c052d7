"""``python -m router.openai_http``: the front on its own, a client of one router or several (OpenAIHttpConfig's
flags; ``--http-tls-*`` serve HTTPS, ``--tls-*`` reach a router that serves TLS)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pdserve import cli_config
from pdserve.heap import freeze_startup_heap
from pdserve.security import TLSConfig
from router.config import OpenAIHttpConfig
from router.openai.app import start_openai_http


def parser() -> argparse.ArgumentParser:
    """The ``python -m router.openai_http`` command line: one flag per OpenAIHttpConfig field."""
    ap = cli_config.build_parser(
        OpenAIHttpConfig, "python -m router.openai_http", "OpenAI-compatible HTTP API in front of a pdserve router"
    )
    cli_config.add_log_level(ap)
    return ap


async def serve(cfg: OpenAIHttpConfig, http_tls: TLSConfig | None, router_tls: TLSConfig | None) -> None:
    """Run the front until SIGTERM / SIGINT."""
    server = await start_openai_http(
        cfg.router,
        cfg.host,
        cfg.port,
        api_key=cfg.api_key,
        router_tls=router_tls,
        tls=http_tls,
        tool_call_parser=cfg.tool_call_parser,
    )
    print(f"pdserve OpenAI-compatible API on {server.url}/v1 (router {cfg.router})", flush=True)
    freeze_startup_heap("OpenAI front")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # every certificate file is read now: a bad one fails here, naming its flag
        cfg = cli_config.from_args(OpenAIHttpConfig, args)
        http_tls, router_tls = cfg.http_tls, cfg.router_tls
    except ValueError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    asyncio.run(serve(cfg, http_tls, router_tls))
    return 0

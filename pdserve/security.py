"""Transport security and authentication shared by every pdserve service, the SDK and the CLI.

- ``TLSConfig``: certificate files from flags / env (``--tls-cert-file`` / ``PDSERVE_TLS_CERT_FILE``, ...), checked
  when built (a missing, unreadable or mismatched file names the flag to fix), turned into gRPC server / channel
  credentials and ``ssl.SSLContext`` s for plain sockets. ``require_client_cert`` = mutual TLS.
- ``http_server_tls`` (``--http-tls-*``, ``PDSERVE_HTTP_TLS_*``, router/config.py's flags): the OpenAI HTTP front's
  own serving certificate (HTTPS, mutual TLS), checked like TLSConfig, errors naming those flags.
- ``bind`` / ``aio_channel`` / ``sync_channel``: the one place servers listen and channels dial, so TLS and the
  message-size limits (``grpc_options``) are the same everywhere.
- ``ApiKeyInterceptor``: the router's client API key (metadata ``authorization: Bearer KEY`` or ``x-api-key: KEY``).
- ``secrets_match``: constant-time comparison for keys and tokens.
"""

from __future__ import annotations

import argparse
import hmac
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import grpc

# One limit for every gRPC server and channel (requests carry prompts, answers token batches; 64 MiB is far above
# any legitimate message and bounds what one peer can make a server buffer).
MAX_MESSAGE_BYTES = 64 << 20

ENV = {
    "cert_file": "PDSERVE_TLS_CERT_FILE",
    "key_file": "PDSERVE_TLS_KEY_FILE",
    "ca_file": "PDSERVE_TLS_CA_FILE",
    "require_client_cert": "PDSERVE_TLS_REQUIRE_CLIENT_CERT",
    "server_name": "PDSERVE_TLS_SERVER_NAME",
}
FLAGS = {
    "cert_file": "--tls-cert-file",
    "key_file": "--tls-key-file",
    "ca_file": "--tls-ca-file",
    "require_client_cert": "--tls-require-client-cert",
    "server_name": "--tls-server-name",
}
API_KEY_ENV = "PDSERVE_API_KEY"
ROUTER_SERVICE_PREFIX = "/pdserve.v1.Router/"


_TLS_HELP = {
    "cert_file": "serve TLS with this certificate; also the client certificate this process presents to others",
    "key_file": "private key of --tls-cert-file",
    "ca_file": "CA that signs the other services' (and, with mTLS, clients') certificates",
    "require_client_cert": "mutual TLS: refuse clients without a certificate signed by --tls-ca-file",
    "server_name": "name expected in the other services' certificates (default: the host dialed)",
}


def tls_field(part: str, default: Any = None) -> Any:
    """A config dataclass field for TLSConfig's ``part``: the --tls-* flag and PDSERVE_TLS_* default of every
    service (pdserve.cli_config reads the metadata)."""
    meta: dict[str, Any] = {"help": _TLS_HELP[part], "env": ENV[part]}
    if part != "require_client_cert":
        meta["metavar"] = "NAME" if part == "server_name" else "PEM"
    return field(default=default, metadata=meta)


class TLSConfigError(ValueError):
    """A TLS setting that cannot work; the message names the flag (or environment variable) to fix."""


def grpc_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, extra: Sequence[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """Channel / server options with explicit send and receive limits (gRPC's defaults differ per side)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *extra,
    ]


def _read(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TLSConfigError(f"{FLAGS[field]} ({ENV[field]}): cannot read {path!r}: {e.strerror or e}") from None


@dataclass(frozen=True)
class TLSConfig:
    """Certificate files of one process. Server side: cert + key (+ CA to verify clients under mTLS). Client side:
    CA to trust (None: the system roots) and, for mTLS, cert + key presented as the client certificate."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False  # servers: refuse clients without a certificate signed by ca_file (mTLS)
    server_name: str | None = None  # clients: name expected in the server's certificate (default: the host dialed)

    def __post_init__(self) -> None:
        for f in ("cert_file", "key_file", "ca_file", "server_name"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not v):
                raise TLSConfigError(f"{FLAGS[f]} ({ENV[f]}) must be a non-empty string, got {v!r}")
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise TLSConfigError(
                f"{FLAGS['cert_file']} and {FLAGS['key_file']} go together: set {FLAGS[missing]} ({ENV[missing]}) too"
            )
        if self.require_client_cert and (self.ca_file is None or self.cert_file is None):
            raise TLSConfigError(
                f"{FLAGS['require_client_cert']} (mutual TLS) needs {FLAGS['ca_file']} (the CA that "
                f"signs client certificates) and this process's own {FLAGS['cert_file']} / "
                f"{FLAGS['key_file']}"
            )
        # Load every file now: a bad path or a key that does not match the certificate fails at startup, named.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.cert_file is not None:
            _read(self.cert_file, "cert_file")
            _read(self.key_file, "key_file")  # type: ignore[arg-type]
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as e:
                raise TLSConfigError(
                    f"{FLAGS['cert_file']} {self.cert_file!r} / {FLAGS['key_file']} "
                    f"{self.key_file!r}: not a PEM certificate and its matching private key ({e})"
                ) from None
        if self.ca_file is not None:
            _read(self.ca_file, "ca_file")
            try:
                ctx.load_verify_locations(cafile=self.ca_file)
            except ssl.SSLError as e:
                raise TLSConfigError(f"{FLAGS['ca_file']} {self.ca_file!r}: not a PEM CA certificate ({e})") from None

    # --- construction from flags / environment ---
    @property
    def enabled(self) -> bool:
        """True when this process speaks TLS (a certificate to serve, or a CA to trust as a client)."""
        return self.cert_file is not None or self.ca_file is not None

    @property
    def serves_tls(self) -> bool:
        return self.cert_file is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TLSConfig":
        return cls(
            cert_file=args.tls_cert_file,
            key_file=args.tls_key_file,
            ca_file=args.tls_ca_file,
            require_client_cert=bool(args.tls_require_client_cert),
            server_name=args.tls_server_name,
        )

    # --- gRPC ---
    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None or self.key_file is None:
            raise TLSConfigError(f"serving TLS needs {FLAGS['cert_file']} and {FLAGS['key_file']}")
        pair = (_read(self.key_file, "key_file"), _read(self.cert_file, "cert_file"))
        root = _read(self.ca_file, "ca_file") if self.ca_file is not None else None
        return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trust ca_file (else the system roots); present cert/key as client certificate when set (mTLS)."""
        root = _read(self.ca_file, "ca_file") if self.ca_file is not None else None
        key = _read(self.key_file, "key_file") if self.key_file is not None else None
        chain = _read(self.cert_file, "cert_file") if self.cert_file is not None else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # --- plain sockets (KV control channel) ---
    def ssl_server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)  # type: ignore[arg-type]
        ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        ctx.num_tickets = 0  # no TLS 1.3 session tickets: an idle connection then has nothing unread on it
        return ctx

    def ssl_client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def _truthy(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


def add_tls_arguments(p: argparse.ArgumentParser, *, client_only: bool = False) -> None:
    """--tls-* flags, defaulting to the PDSERVE_TLS_* environment variables (what the container entrypoint sets)."""
    g = p.add_argument_group("TLS")
    env = os.environ
    if client_only:
        g.add_argument(
            FLAGS["ca_file"],
            default=env.get(ENV["ca_file"]) or None,
            metavar="PEM",
            help=f"CA certificate to trust: connect with TLS (env {ENV['ca_file']})",
        )
        g.add_argument(
            FLAGS["cert_file"],
            default=env.get(ENV["cert_file"]) or None,
            metavar="PEM",
            help="client certificate, for servers that require mutual TLS",
        )
        g.add_argument(
            FLAGS["key_file"],
            default=env.get(ENV["key_file"]) or None,
            metavar="PEM",
            help="private key of the client certificate",
        )
        g.add_argument(
            FLAGS["server_name"],
            default=env.get(ENV["server_name"]) or None,
            metavar="NAME",
            help="name expected in the server certificate (default: the host dialed)",
        )
        g.set_defaults(tls_require_client_cert=False)
        return
    g.add_argument(
        FLAGS["cert_file"],
        default=env.get(ENV["cert_file"]) or None,
        metavar="PEM",
        help=f"serve TLS with this certificate (env {ENV['cert_file']}); also the client certificate "
        "this process presents to other services",
    )
    g.add_argument(
        FLAGS["key_file"],
        default=env.get(ENV["key_file"]) or None,
        metavar="PEM",
        help=f"private key of --tls-cert-file (env {ENV['key_file']})",
    )
    g.add_argument(
        FLAGS["ca_file"],
        default=env.get(ENV["ca_file"]) or None,
        metavar="PEM",
        help=f"CA that signs the other services' (and, with mTLS, clients') certificates (env {ENV['ca_file']})",
    )
    g.add_argument(
        FLAGS["require_client_cert"],
        action="store_true",
        default=_truthy(env.get(ENV["require_client_cert"], "")),
        help=f"mutual TLS: refuse clients without a certificate signed by --tls-ca-file "
        f"(env {ENV['require_client_cert']})",
    )
    g.add_argument(
        FLAGS["server_name"],
        default=env.get(ENV["server_name"]) or None,
        metavar="NAME",
        help=f"name expected in the other services' certificates (env {ENV['server_name']}; default: the host dialed)",
    )


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The TLSConfig of parsed --tls-* flags, or None when no TLS flag is set."""
    tls = TLSConfig.from_args(args)
    return tls if tls.enabled or tls.require_client_cert else None


# --- HTTPS of the OpenAI HTTP front ------------------------------------------------------------------------------
# The front is both a server (its own certificate: --http-tls-*) and the router's gRPC client (--tls-*, client side),
# so its serving certificate has flags of its own. Validation is TLSConfig's; errors name these flags instead.
HTTP_FLAGS = {
    "cert_file": "--http-tls-cert-file",
    "key_file": "--http-tls-key-file",
    "ca_file": "--http-tls-ca-file",
    "require_client_cert": "--http-tls-require-client-cert",
}
HTTP_ENV = {
    "cert_file": "PDSERVE_HTTP_TLS_CERT_FILE",
    "key_file": "PDSERVE_HTTP_TLS_KEY_FILE",
    "ca_file": "PDSERVE_HTTP_TLS_CA_FILE",
    "require_client_cert": "PDSERVE_HTTP_TLS_REQUIRE_CLIENT_CERT",
}


def _renamed(msg: str, flags: dict[str, str], env: dict[str, str]) -> str:
    """A TLSConfigError message with the --tls-* flag / PDSERVE_TLS_* names replaced by ``flags`` / ``env``."""
    names = {FLAGS[f]: flags[f] for f in flags} | {ENV[f]: env[f] for f in env}
    return re.sub(
        "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)), lambda m: names[m.group(0)], msg
    )


def http_server_tls(
    cert_file: str | None = None,
    key_file: str | None = None,
    ca_file: str | None = None,
    require_client_cert: bool = False,
) -> TLSConfig | None:
    """The checked server-side TLSConfig of an HTTPS front (None: plain HTTP). Errors name the --http-tls-* flags."""
    if cert_file is None and key_file is None and ca_file is None and not require_client_cert:
        return None
    try:
        tls = TLSConfig(
            cert_file=cert_file, key_file=key_file, ca_file=ca_file, require_client_cert=require_client_cert
        )
    except TLSConfigError as e:
        raise TLSConfigError(_renamed(str(e), HTTP_FLAGS, HTTP_ENV)) from None
    check_https_serving(tls)
    return tls


def check_https_serving(tls: TLSConfig | None) -> None:
    """Refuses a TLSConfig an HTTPS server cannot serve: a checked one without a certificate and key has only a CA
    (require_client_cert alone already fails in TLSConfig). None (plain HTTP) passes."""
    if tls is not None and not tls.serves_tls:
        raise TLSConfigError(
            f"{HTTP_FLAGS['ca_file']} ({HTTP_ENV['ca_file']}) only says which client certificates "
            f"to trust: serving HTTPS needs {HTTP_FLAGS['cert_file']} and {HTTP_FLAGS['key_file']}"
        )


# --- servers and channels ---------------------------------------------------------------------------------------
def bind(server: grpc.Server | grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Listen on ``address`` with TLS when configured; returns the port (0 = could not bind)."""
    if tls is not None and tls.serves_tls:
        return server.add_secure_port(address, tls.server_credentials())
    if tls is not None and tls.enabled:
        raise TLSConfigError(
            f"{address}: a server needs {FLAGS['cert_file']} and {FLAGS['key_file']} to serve TLS "
            f"({FLAGS['ca_file']} alone only configures what it trusts)"
        )
    return server.add_insecure_port(address)


def aio_channel(address: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    opts = grpc_options(extra=[*(tls.channel_options() if tls else []), *options])
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def sync_channel(address: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    opts = grpc_options(extra=[*(tls.channel_options() if tls else []), *options])
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


# --- shared secrets ---------------------------------------------------------------------------------------------
def secrets_match(given: str | bytes | None, expected: str | bytes) -> bool:
    """Constant-time comparison (no timing oracle on how many leading characters were right)."""
    if given is None:
        return False
    g = given.encode() if isinstance(given, str) else given
    e = expected.encode() if isinstance(expected, str) else expected
    return hmac.compare_digest(g, e)


def api_key_from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The key a client sent: ``authorization: Bearer KEY`` or ``x-api-key: KEY``."""
    for k, v in metadata or ():
        if isinstance(v, bytes):
            continue
        if k == "authorization" and v[:7].lower() == "bearer ":
            return v[7:].strip()
        if k == "x-api-key":
            return v.strip()
    return None


API_KEY_HELP = (
    "this router requires an API key: send gRPC metadata 'authorization: Bearer <key>' (or "
    "'x-api-key: <key>'); SDK: Client(..., api_key=KEY); CLI: --api-key KEY or PDSERVE_API_KEY"
)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the Router service (Generate, ClusterStatus, ...) without the right key: UNAUTHENTICATED.

    Registry (pods; protected by the cluster token) and grpc.health are not covered."""

    def __init__(self, api_key: str, prefix: str = ROUTER_SERVICE_PREFIX) -> None:
        if not api_key:
            raise ValueError("ApiKeyInterceptor needs a non-empty key")
        self._key = api_key
        self._prefix = prefix

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        given = api_key_from_metadata(details.invocation_metadata)
        if secrets_match(given, self._key):
            return handler
        msg = ("wrong API key: " if given else "missing API key: ") + API_KEY_HELP
        return _deny(handler, msg)


def _deny(handler: grpc.RpcMethodHandler, msg: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - abort raises

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)

"""Control channel shared by both transports: length-prefixed JSON + bytes frames over TCP. The wire contract, every
operation included, is written down in proto/pdserve_api/v1/kv_transfer.proto.

Frame: ``b"PDKV" | u32 json_len | u64 payload_len | json | payload`` (network byte order).
A request is one frame with ``{"op": ...}``; the answer is one frame, or for streamed reads several
frames ending with ``{"end": true}``. Errors come back as ``{"ok": false, "error": KIND, "detail": ...}``
and are raised on the client as the matching typed exception.

Authentication: a publisher started with the cluster token (``auth_token``, handed down by the pods from
``--cluster-token``) serves nothing until the connection proves it holds the token: the client asks
``{"op": "auth_challenge"}`` and answers ``{"op": "auth", "mac": HMAC-SHA256(token, nonce)}``. Any other first
request gets an ``unauthenticated`` error and the connection is closed, so a peer that could not have registered
with the router cannot handshake, pin or read KV. ``ControlClient.connect`` does this by itself.

TLS: when the pod serves TLS (``tls``, the TLSConfig the pods hand down from their --tls-* flags) every control
connection is wrapped in TLS (mutual when the pod requires client certificates), KV bytes of the TCP path included.

Why our own protocol and not gRPC: it is the data-path side channel (handshake, lease checks, layer
progress, completion, fallback bytes), it must not depend on the service API, and it must time out
on every read: every socket read here has a deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_transfer.transport import (
    BadTransferRequest,
    Endpoint,
    HandshakeTimeout,
    KVTransferError,
    LeaseExpired,
    TransferUnavailable,
)

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

log = logging.getLogger(__name__)


class KVAuthError(BadTransferRequest):
    """The peer does not hold (or did not present) the cluster token."""


_AUTH_CONTEXT = b"pdserve-kv-auth-v1|"  # domain separation: this MAC means nothing anywhere else


def auth_mac(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), _AUTH_CONTEXT + nonce.encode(), hashlib.sha256).hexdigest()


_MAGIC = b"PDKV"
_HEADER = struct.Struct("!4sIQ")
MAX_JSON = 16 << 20
MAX_PAYLOAD = 4 << 30

_ERROR_KINDS: dict[str, type[KVTransferError]] = {
    "unavailable": TransferUnavailable,
    "lease_expired": LeaseExpired,
    "handshake_timeout": HandshakeTimeout,
    "bad_request": BadTransferRequest,
    "internal": KVTransferError,
    "unauthenticated": KVAuthError,
}
_KIND_OF = {v: k for k, v in _ERROR_KINDS.items()}

Payload = bytes | bytearray | memoryview


# ---- framing --------------------------------------------------------------------------------------
def send_frame(sock: socket.socket, msg: dict[str, Any], payload: Payload = b"") -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    plen = memoryview(payload).nbytes
    sock.sendall(_HEADER.pack(_MAGIC, len(body), plen) + body)
    if plen:
        sock.sendall(payload)


def recv_exact_into(sock: socket.socket, buf: memoryview, deadline: float) -> None:
    """Fill ``buf`` completely; every recv is bounded by ``deadline`` (time.monotonic())."""
    got, n = 0, buf.nbytes
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("control read deadline passed")
        sock.settimeout(left)
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k


def recv_header(sock: socket.socket, deadline: float) -> tuple[dict[str, Any], int]:
    """Read a frame's header and JSON; returns (message, payload length) with the payload still unread."""
    head = bytearray(_HEADER.size)
    recv_exact_into(sock, memoryview(head), deadline)
    magic, jlen, plen = _HEADER.unpack(head)
    if magic != _MAGIC or jlen > MAX_JSON or plen > MAX_PAYLOAD:
        raise ConnectionResetError("bad control frame (not a pdserve kv peer?)")
    body = bytearray(jlen)
    recv_exact_into(sock, memoryview(body), deadline)
    return json.loads(body), plen


def recv_frame(sock: socket.socket, deadline: float) -> tuple[dict[str, Any], bytearray]:
    msg, plen = recv_header(sock, deadline)
    payload = bytearray(plen)
    if plen:
        recv_exact_into(sock, memoryview(payload), deadline)
    return msg, payload


def pack_blobs(*blobs: bytes) -> tuple[list[int], bytes]:
    """Several byte strings in one payload: (lengths for the JSON, concatenated bytes)."""
    return [len(b) for b in blobs], b"".join(blobs)


def unpack_blobs(lengths: list[int], payload: Payload) -> list[bytes]:
    out, pos, mv = [], 0, memoryview(payload)
    for n in lengths:
        out.append(bytes(mv[pos : pos + n]))
        pos += n
    return out


def error_reply(exc: BaseException) -> dict[str, Any]:
    kind = next((k for cls, k in _KIND_OF.items() if type(exc) is cls), None)
    if kind is None:
        kind = next((k for cls, k in _KIND_OF.items() if isinstance(exc, cls)), "internal")
    return {"ok": False, "error": kind, "detail": str(exc)}


def raise_if_error(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("ok", True) is False:
        raise _ERROR_KINDS.get(msg.get("error", "internal"), KVTransferError)(msg.get("detail", ""))
    return msg


# ---- client ---------------------------------------------------------------------------------------
class ControlClient:
    """One connection to a publisher. Calls are serialised by a lock (one request in flight)."""

    def __init__(
        self, endpoint: Endpoint, io_timeout_s: float = 10.0, auth_token: str = "", tls: "TLSConfig | None" = None
    ) -> None:
        self.endpoint = endpoint
        self.io_timeout_s = io_timeout_s
        self._auth_token = auth_token  # the cluster token presented to the publisher ("" = none)
        self._tls = tls  # the pod's TLS settings; None: plain TCP
        self._ssl = self._tls.ssl_client_context() if self._tls is not None else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def connect(self, timeout_s: float) -> None:
        """Connect within ``timeout_s``, retrying transient failures. A refused connection is not retried: a
        publisher listens before its pod hands out any lease, so nobody listening means the prefill pod that held
        the KV is gone (or restarted on another port), and waiting would only hold up the decode pod."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeTimeout(f"no kv publisher listening at {self.endpoint} within {timeout_s:.1f}s")
            try:
                sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=left)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (socket.timeout, TimeoutError):
                continue
            except ConnectionRefusedError:
                raise TransferUnavailable(
                    f"kv publisher at {self.endpoint} refused the connection: the prefill pod holding this KV is gone"
                ) from None
            except OSError:
                time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, 0.5)
                continue
            try:
                if self._ssl is not None:
                    sock.settimeout(max(deadline - time.monotonic(), 1.0))
                    name = self._tls.server_name if self._tls is not None else None
                    sock = self._ssl.wrap_socket(sock, server_hostname=name or self.endpoint.host)
                if self._auth_token:
                    self._authenticate(sock, max(deadline, time.monotonic() + 1.0))
            except KVAuthError:
                sock.close()
                raise
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: a TLS refusal lands here
                sock.close()
                raise HandshakeTimeout(
                    f"connecting (TLS / authentication) to kv publisher {self.endpoint} failed: {e!r}"
                ) from e
            self._sock = sock
            return

    def _authenticate(self, sock: socket.socket, deadline: float) -> None:
        """Prove we hold the cluster token (HMAC of the publisher's fresh nonce; the token never travels)."""
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        send_frame(sock, {"op": "auth_challenge"})
        challenge, _ = recv_frame(sock, deadline)
        raise_if_error(challenge)
        if not challenge.get("auth"):
            return  # the publisher checks nothing (no cluster token configured there)
        send_frame(sock, {"op": "auth", "mac": auth_mac(self._auth_token, str(challenge.get("nonce", "")))})
        reply, _ = recv_frame(sock, deadline)
        raise_if_error(reply)

    def call(
        self, msg: dict[str, Any], payload: Payload = b"", timeout_s: float | None = None, handshake: bool = False
    ) -> tuple[dict[str, Any], bytearray]:
        """One request, one answer. Raises the typed error the peer sent, TransferUnavailable when the
        connection breaks or the answer is late (HandshakeTimeout instead when ``handshake``)."""
        with self._lock:
            deadline = time.monotonic() + (self.io_timeout_s if timeout_s is None else timeout_s)
            try:
                sock = self._require()
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                send_frame(sock, msg, payload)
                reply, data = recv_frame(sock, deadline)
            except (OSError, ValueError) as e:  # socket.timeout is an OSError; ValueError: bad JSON
                self._drop()
                timed_out = isinstance(e, (socket.timeout, TimeoutError))
                if handshake:
                    raise HandshakeTimeout(f"handshake with {self.endpoint} failed: {e!r}") from e
                what = "timed out" if timed_out else f"failed: {e!r}"
                raise TransferUnavailable(f"control call {msg.get('op')} to {self.endpoint} {what}") from e
            raise_if_error(reply)
            return reply, data

    def stream(
        self,
        msg: dict[str, Any],
        payload: Payload,
        on_frame: Callable[[dict[str, Any], socket.socket, int, float], None],
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Send a request answered by many frames; ``on_frame(msg, sock, payload_len, deadline)`` must read
        the payload itself (so it can land straight in place). Returns the final ``{"end": true}`` frame."""
        with self._lock:
            io = self.io_timeout_s if timeout_s is None else timeout_s
            try:
                sock = self._require()
                sock.settimeout(io)
                send_frame(sock, msg, payload)
                while True:
                    deadline = time.monotonic() + io  # per frame: a live but slow peer is fine
                    reply, plen = recv_header(sock, deadline)
                    if reply.get("ok", True) is False or reply.get("end"):
                        if plen:
                            raise ConnectionResetError("end frame with payload")
                        break
                    on_frame(reply, sock, plen, deadline)
            except (OSError, ValueError) as e:
                self._drop()
                raise TransferUnavailable(f"stream {msg.get('op')} from {self.endpoint} failed: {e!r}") from e
            raise_if_error(reply)
            return reply

    def close(self) -> None:
        with self._lock:
            self._drop()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def alive(self) -> bool:
        """Cheap check of an idle connection: False once the peer closed it (or it is out of sync)."""
        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.setblocking(False)
                if isinstance(self._sock, ssl.SSLSocket):  # no MSG_PEEK through TLS: anything readable is unusable
                    if not select.select([self._sock], [], [], 0)[0] and not self._sock.pending():
                        return True
                    self._sock.recv(1)
                else:
                    self._sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, ssl.SSLWantReadError):
                return True  # nothing to read: still open
            except OSError:
                pass  # reset by the peer: as unusable as closed
            finally:
                if self._sock is not None:
                    self._sock.setblocking(True)
            self._drop()  # closed by the peer (b"") or unexpected bytes: unusable either way
            return False

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise ConnectionResetError("not connected")
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


# ---- server ---------------------------------------------------------------------------------------
class ServerConn:
    """The server's view of one client connection, handed to the request handler."""

    def __init__(self, sock: socket.socket, peer: str, io_timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.io_timeout_s = io_timeout_s

    def send(self, msg: dict[str, Any], payload: Payload = b"") -> None:
        self.sock.settimeout(self.io_timeout_s)  # a reader that stops reading for this long is dropped
        send_frame(self.sock, msg, payload)


Handler = Callable[[ServerConn, dict[str, Any], bytearray], None]


class ControlServer:
    """Thread-per-connection TCP server. ``handler`` answers each request by calling ``conn.send``;
    KVTransferErrors it raises go back to the client as typed error frames."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = 600.0,
        io_timeout_s: float = 30.0,
        auth_token: str = "",
        tls: "TLSConfig | None" = None,
    ) -> None:
        self._handler = handler
        self._auth_token = auth_token  # the cluster token clients must prove they hold ("" = no check)
        self._ssl = tls.ssl_server_context() if tls is not None and tls.serves_tls else None
        self.idle_timeout_s = idle_timeout_s
        self.io_timeout_s = io_timeout_s
        self._lsock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._lsock.settimeout(0.2)
        self.endpoint = Endpoint(host, self._lsock.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-control-{self.endpoint.port}", daemon=True)

    def start(self) -> "ControlServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        try:
            self._lsock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # shut down so blocked readers on both ends wake up now
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._lsock.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        if self._ssl is not None:  # the TLS handshake runs here, not in the accept loop: a slow peer blocks only itself
            raw = sock
            try:
                raw.settimeout(self.io_timeout_s)
                sock = self._ssl.wrap_socket(raw, server_side=True)
            except (OSError, ValueError) as e:
                log.warning("kv control %s: TLS handshake with %s failed: %s", self.endpoint, peer, e)
                with self._lock:
                    self._conns.discard(raw)
                raw.close()
                return
            with self._lock:  # close() must shut down the TLS socket (the raw one was detached by wrap_socket)
                self._conns.discard(raw)
                self._conns.add(sock)
        conn = ServerConn(sock, peer, self.io_timeout_s)
        authed, nonce = not self._auth_token, ""
        try:
            while not self._closed.is_set():
                try:
                    msg, payload = recv_frame(sock, time.monotonic() + self.idle_timeout_s)
                except (OSError, ValueError):
                    return  # closed, idle too long, or garbage: drop the connection
                op = msg.get("op")
                if op == "auth_challenge":
                    nonce = secrets.token_hex(16)
                    conn.send({"ok": True, "auth": bool(self._auth_token), "nonce": nonce})
                    continue
                if not authed:
                    given = msg.get("mac") if op == "auth" else None
                    if (
                        isinstance(given, str)
                        and nonce
                        and hmac.compare_digest(given.encode(), auth_mac(self._auth_token, nonce).encode())
                    ):
                        authed = True
                        conn.send({"ok": True})
                        continue
                    # Why close: a peer without the cluster token gets nothing more from this connection.
                    log.warning(
                        "kv control %s: refused %s from %s: cluster token not presented or wrong",
                        self.endpoint,
                        op,
                        peer,
                    )
                    conn.send(
                        error_reply(
                            KVAuthError(
                                f"kv publisher {self.endpoint} refused {op!r}: "
                                + ("wrong cluster token" if op == "auth" else "this peer did not authenticate")
                                + "; start the decode pod with the cluster's --cluster-token (PDSERVE_CLUSTER_TOKEN)"
                            )
                        )
                    )
                    return
                if op == "auth":  # no token configured here, or already authenticated: nothing to check
                    conn.send({"ok": True})
                    continue
                try:
                    self._handler(conn, msg, payload)
                except KVTransferError as e:
                    conn.send(error_reply(e))
                except (OSError, ConnectionError):
                    return
                except Exception as e:  # keep serving other requests; the client gets an error frame
                    log.exception("kv control: op %s from %s failed", msg.get("op"), peer)
                    conn.send(error_reply(e))
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(sock)
            try:
                sock.close()
            except OSError:
                pass

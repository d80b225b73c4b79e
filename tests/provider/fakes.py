"""Engines played from recordings on a real loopback server (pytest-httpserver), and a raw
socket server that drops kept-alive connections."""

from __future__ import annotations

import socket
import threading
from typing import TypeVar

from pytest_httpserver import HTTPServer

from tests.conftest import serve


def vllm_031(server: HTTPServer, *, metrics: str = "vllm/0.31.0/GET_metrics_idle.http") -> None:
    serve(server, "/health", "vllm/0.32.0/GET_health.http")
    serve(server, "/version", "vllm/0.31.0/GET_version.http")
    serve(server, "/v1/models", "vllm/0.31.0/GET_v1_models.http")
    serve(server, "/metrics", metrics)


def llamacpp_10798(server: HTTPServer, *, props: bool = True) -> None:
    serve(server, "/health", "llamacpp/b10798/GET_health.http")
    serve(server, "/v1/models", "llamacpp/b10798/GET_v1_models.http")
    serve(server, "/metrics", "llamacpp/b10798/GET_metrics_busy_2_generating.http")
    if props:
        serve(server, "/props", "llamacpp/b10798/GET_props.http")


def sglang_0521(server: HTTPServer) -> None:
    serve(server, "/health", "sglang/0.5.21/GET_health.http")
    serve(server, "/v1/models", "sglang/0.5.21/GET_v1_models.http")
    serve(server, "/metrics", "sglang/0.5.21/GET_metrics.http")
    serve(server, "/server_info", "sglang/0.5.21/GET_server_info.http")


class RawServer:
    """A raw TCP server on a loopback port for HTTP faults no HTTP server library will make:
    each connection is handed to `handle` in the server's thread, one at a time."""

    def __init__(self) -> None:
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                self.handle(conn, self.connections)

    def handle(self, conn: socket.socket, n: int) -> None:
        """Serve the ``n``th connection."""
        raise NotImplementedError

    @staticmethod
    def read_head(conn: socket.socket) -> bytes:
        """A request's head, or what came before the client closed."""
        data = b""
        while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
            data += chunk
        return data

    def close(self) -> None:
        self._sock.close()


class DroppingServer(RawServer):
    """A raw HTTP/1.1 server whose first connection answers one request with keep-alive, then
    closes without answering the next; with ``always=True`` every request is dropped."""

    def __init__(self, *, always: bool = False) -> None:
        self.always = always
        self.answered = 0
        super().__init__()

    def handle(self, conn: socket.socket, n: int) -> None:
        first = n == 1
        for i in range(2 if first else 100):
            if not self.read_head(conn) or self.always or (first and i == 1):
                return  # close without a word
            body = b'{"status":"ok"}'
            self.answered += 1  # before the answer, which the client may read at once
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )


E = TypeVar("E", bound=Exception)


def subclasses_of(cls: type[E]) -> set[type[E]]:
    """``cls`` and every class below it."""
    found = {cls}
    for sub in cls.__subclasses__():
        found |= subclasses_of(sub)
    return found

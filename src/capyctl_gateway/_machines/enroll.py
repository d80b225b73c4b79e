"""Enrolling hosts: the server's control identity, single-use join files, and a host's identity.

The server keeps a certificate authority of its own for the control channel (under
``<state>/identity/``). ``invite host NAME`` writes a join file: the control address, the CA
certificate and its fingerprint, the host's name, a random token (the server keeps its SHA-256)
and its expiry; a name has one usable at most. ``host join`` checks the CA against the
fingerprint, makes the host's key (it never leaves the host) and sends a certificate request
with the token over TLS that trusts only that CA. A copied file is worth nothing once used.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from .._errors import OperatorError
from .._identity import check_private
from . import pki
from .roster import Roster

__all__ = [
    "HostIdentity",
    "Invites",
    "JoinError",
    "JoinFile",
    "join",
    "ServerIdentity",
    "read_join_file",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS invite (
    token_sha256 TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    expires_at REAL NOT NULL,
    spent_at REAL
);
"""


class JoinError(OperatorError):
    """A join file or enrollment that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ServerIdentity:
    """The server's control CA and certificate, under ``<state>/identity``."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "control-ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "control-ca.key"

    @property
    def cert(self) -> Path:
        return self.directory / "control-server.pem"

    @property
    def key(self) -> Path:
        return self.directory / "control-server.key"

    @property
    def address_file(self) -> Path:
        return self.directory / "control-address"

    def ensure(self) -> None:
        """Create the CA and the server certificate on first start (mode 0600 keys)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.ca_cert.exists():
            key, cert = pki.new_ca()
            pki.write_private(self.ca_key, key)
            pki.write_private(self.ca_cert, cert)
        if not self.cert.exists():
            key, cert = pki.issue_server_cert(self.ca_key.read_bytes(), self.ca_cert.read_bytes())
            pki.write_private(self.key, key)
            pki.write_private(self.cert, cert)
        check_private(self.ca_key)
        check_private(self.key)

    def sign(self, csr_pem: bytes, host: str) -> bytes:
        return pki.sign_host_csr(self.ca_key.read_bytes(), self.ca_cert.read_bytes(), csr_pem, host)


class Invites:
    """Join tokens, kept by their SHA-256 in ``<state>/machines.sqlite3``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self.roster = Roster(self._db)
        """The enrolled hosts' certificates and revocations (same database)."""

    def close(self) -> None:
        self._db.close()

    def create(
        self, host: str, valid_s: float, now: float | None = None, *, replace: bool = False
    ) -> tuple[str, float]:
        """A new token for ``host``; returns (token, expires_at). A host has one open
        invitation at most: with one open, JoinError unless ``replace``, which voids it."""
        token, now = secrets.token_urlsafe(32), time.time() if now is None else now
        expires = now + valid_s
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            # Invitations spent or expired for a day are no use to anyone: the table stays small.
            self._db.execute("DELETE FROM invite WHERE expires_at < ?", (now - 86400,))
            open_until = self._db.execute(
                "SELECT MAX(expires_at) FROM invite "
                "WHERE host = ? AND spent_at IS NULL AND expires_at >= ?",
                (host, now),
            ).fetchone()[0]
            if open_until is not None and not replace:  # the second would take the name
                raise JoinError(
                    f"host {host} has a join file still usable for "
                    f"{max(1, round((open_until - now) / 60))} min; --replace voids it"
                )
            self._void(host, now)
            self._db.execute(
                "INSERT INTO invite VALUES (?, ?, ?, NULL)", (_digest(token), host, expires)
            )
        return token, expires

    def spend(self, token: str, host: str, now: float | None = None) -> None:
        """Use ``token`` for ``host`` once, voiding every other open invitation for ``host``.
        Raises JoinError (unknown, spent or voided, expired, another host's)."""
        now = time.time() if now is None else now
        with self._db:  # one transaction: two joins racing with one token, one wins
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute(
                "SELECT host, expires_at, spent_at FROM invite WHERE token_sha256 = ?",
                (_digest(token),),
            ).fetchone()
            if row is None:
                raise JoinError("this join file is not one the server issued")
            invited, expires, spent = row
            if spent is not None:
                raise JoinError("this join file was used or voided already; ask for a new one")
            if now > expires:
                raise JoinError("this join file has expired; ask for a new one")
            if invited != host:
                raise JoinError(f"this join file is for host {invited!r}, not {host!r}")
            self._void(host, now)  # this one with the others: an old file cannot follow it

    def _void(self, host: str, now: float) -> None:
        self._db.execute(
            "UPDATE invite SET spent_at = ? WHERE host = ? AND spent_at IS NULL", (now, host)
        )


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class JoinFile:
    host: str
    control: str
    """The server's control address as the host reaches it (HOST:PORT)."""
    ca_pem: bytes
    ca_fingerprint: str
    token: str = field(repr=False)
    expires_at: float

    def write(self, path: Path) -> None:
        doc = {
            "capyctl_join": 1,
            "host": self.host,
            "control": self.control,
            "ca_fingerprint": self.ca_fingerprint,
            "ca_pem": self.ca_pem.decode(),
            "token": self.token,
            "expires_at": self.expires_at,
        }
        pki.write_private(path, json.dumps(doc, indent=1).encode() + b"\n")


def read_join_file(path: Path, now: float | None = None) -> JoinFile:
    """Read and check a join file (shape, CA fingerprint, expiry). Raises JoinError."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise JoinError(f"cannot read the join file {path}: {exc.strerror}") from None
    except ValueError:
        raise JoinError(f"{path} is not a join file (not JSON)") from None
    fields = ("host", "control", "ca_fingerprint", "ca_pem", "token", "expires_at")
    if (
        not isinstance(doc, dict)
        or doc.get("capyctl_join") != 1
        or any(f not in doc for f in fields)
    ):
        raise JoinError(f"{path} is not a capyctl join file")
    join = JoinFile(
        host=str(doc["host"]),
        control=str(doc["control"]),
        ca_pem=str(doc["ca_pem"]).encode(),
        ca_fingerprint=str(doc["ca_fingerprint"]),
        token=str(doc["token"]),
        expires_at=float(doc["expires_at"]),
    )
    try:
        found = pki.fingerprint(join.ca_pem)
    except (ValueError, pki.PkiError):
        raise JoinError(f"{path}: its CA certificate cannot be read") from None
    if found != join.ca_fingerprint:
        raise JoinError(f"{path}: its CA certificate does not match its fingerprint")
    if (time.time() if now is None else now) > join.expires_at:
        raise JoinError("this join file has expired; ask the server's operator for a new one")
    return join


@dataclass(frozen=True)
class HostIdentity:
    """A host's key, certificate and what it knows of its server, under ``<state>/identity``."""

    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / "host.key"

    @property
    def cert(self) -> Path:
        return self.directory / "host.pem"

    @property
    def ca(self) -> Path:
        return self.directory / "control-ca.pem"

    @property
    def about(self) -> Path:
        return self.directory / "host.json"

    def enrolled(self) -> tuple[str, str] | None:
        """(host name, server control address), or None before ``host join``."""
        try:
            doc = json.loads(self.about.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return str(doc["host"]), str(doc["control"])

    def save(self, join: JoinFile, cert_pem: bytes) -> None:
        pki.write_private(self.cert, cert_pem)
        pki.write_private(self.ca, join.ca_pem)
        about = {"host": join.host, "control": join.control}
        pki.write_private(self.about, json.dumps(about).encode() + b"\n")


async def join(join_file: Path, state_dir: Path) -> str:
    """Enroll this host with the join file's server; returns the host's name. Raises
    JoinError with what to do."""
    identity = HostIdentity(state_dir / "identity")
    done = identity.enrolled()
    if done is not None:
        raise JoinError(
            f"this state directory is enrolled already (host {done[0]}); use another "
            "--state-dir, or remove its identity/ to join afresh"
        )
    joining = read_join_file(join_file)
    if not pki.valid_host_name(joining.host):
        raise JoinError(f"{joining.host!r} cannot name a host")
    identity.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = pki.new_host_key()
    csr = pki.host_csr(key, joining.host)
    ctx = pki.client_context(joining.ca_pem)
    body = {"host": joining.host, "token": joining.token, "csr": csr.decode()}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
            http.post(
                f"https://{joining.control}/v1/enroll",
                json=body,
                ssl=ctx,
                server_hostname=pki.SERVER_NAME,
            ) as resp,
        ):
            answer = await resp.json(loads=orjson.loads, content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise JoinError(f"cannot enroll with the server at {joining.control}: {exc}") from None
    if not isinstance(answer, dict):
        raise JoinError(f"the server at {joining.control} did not answer as a capyctl server")
    if resp.status != 200:
        raise JoinError(f"the server refused this host: {answer.get('message', resp.status)}")
    pki.write_private(identity.key, key)
    identity.save(joining, str(answer["certificate"]).encode())
    return joining.host

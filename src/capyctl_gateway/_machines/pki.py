"""The control channel's TLS between a capyctl-gateway server and its GPU hosts: the trust model,
both sides' TLS contexts, a peer's host name, and private key files. The keys and certificates
themselves are made and checked in ``certs.py``; this module re-exports those names.

Trust model: the server keeps one private CA (EC P-256, path length 0) and is the only signer.
It issues itself a certificate named ``SERVER_NAME`` (DNS SAN, extended key usage serverAuth
only) and signs each host's CSR into a certificate whose subject CN is the host's name (clientAuth
only). A host's key is made on the host and never leaves it. Hosts trust nothing but that CA and
check the server's DNS name, never an address; the server verifies client certificates against
the CA and takes a host's identity from the CN of its verified certificate (`peer_host`). The
key usages keep the roles apart: a host certificate cannot serve, the server's cannot be a host,
and no host may be named like the server. Both sides speak TLS 1.3 only (standard ``ssl``).
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path
from typing import Any

from .certs import (
    SERVER_NAME,
    PkiError,
    fingerprint,
    host_csr,
    issue_server_cert,
    new_ca,
    new_host_key,
    sign_host_csr,
    valid_host_name,
)

__all__ = [
    "SERVER_NAME",
    "PkiError",
    "client_context",
    "fingerprint",
    "host_csr",
    "issue_server_cert",
    "new_ca",
    "new_host_key",
    "peer_host",
    "server_context",
    "sign_host_csr",
    "valid_host_name",
    "write_private",
]


# --- TLS ----------------------------------------------------------------------------------------


def server_context(cert_path: Path, key_path: Path, ca_path: Path) -> ssl.SSLContext:
    """The server's control listener: TLS 1.3 only, its own certificate, and client certificates
    verified against the CA when presented (CERT_OPTIONAL: enrollment comes before a host has a
    certificate; what needs one checks `peer_host`)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.load_cert_chain(certfile=cert_path, keyfile=key_path)
    ctx.load_verify_locations(cafile=ca_path)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(
    ca_pem: bytes, cert_path: Path | None = None, key_path: Path | None = None
) -> ssl.SSLContext:
    """A host's side: TLS 1.3 only, trusting nothing but ``ca_pem``, checking the server's name
    (connect with ``server_hostname=SERVER_NAME``), and presenting the host's certificate when
    ``cert_path`` and ``key_path`` are given (both or neither)."""
    if (cert_path is None) != (key_path is None):
        raise ValueError("give both cert_path and key_path, or neither")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        raise PkiError(f"cannot read the CA certificate: {exc}") from exc
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if cert_path is not None:
        ctx.load_cert_chain(certfile=cert_path, keyfile=key_path)
    return ctx


def peer_host(peercert: dict[str, Any] | None) -> str | None:
    """The host name (subject CN) of a verified peer certificate, as ``getpeercert()`` gives it,
    or None without one. None too for a name that is no valid host name (as `SERVER_NAME`)."""
    if not peercert:
        return None
    names = [
        value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"
    ]
    if len(names) != 1 or not isinstance(names[0], str) or not valid_host_name(names[0]):
        return None
    return names[0]


# --- files --------------------------------------------------------------------------------------


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a file only its owner can read (mode 0600 from creation on); an existing
    file is replaced atomically through a 0600 temporary file in the same directory."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # mode 0600
        try:
            _write_all(fd, data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    try:
        _write_all(fd, data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

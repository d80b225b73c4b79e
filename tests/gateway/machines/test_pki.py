"""The control channel's certificates, over real TLS on real sockets (127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capyctl_gateway._machines.pki import (
    SERVER_NAME,
    PkiError,
    client_context,
    fingerprint,
    host_csr,
    issue_server_cert,
    new_ca,
    new_host_key,
    peer_host,
    server_context,
    sign_host_csr,
    valid_host_name,
    write_private,
)

# A handshake the other side refuses shows up as one of these, depending on who refuses and when
# (in TLS 1.3 a client learns that its certificate was refused only at its first read, and
# asyncio hangs up without sending the alert, so the client reads an end of stream).
REFUSED = (ssl.SSLError, ConnectionResetError, asyncio.IncompleteReadError)


@dataclass
class Pki:
    """A CA in a directory, with the server's certificate and key written next to it."""

    dir: Path
    ca_key: bytes
    ca_cert: bytes

    @property
    def ca_path(self) -> Path:
        return self.dir / "ca.pem"

    def server(self) -> ssl.SSLContext:
        return server_context(self.dir / "server.pem", self.dir / "server.key", self.ca_path)

    def host(self, name: str) -> tuple[Path, Path]:
        """Enroll host ``name`` as the real flow does: key and CSR on the host, signed by the CA."""
        key = new_host_key()
        cert = sign_host_csr(self.ca_key, self.ca_cert, host_csr(key, name), name)
        return self.write(f"{name}.pem", cert), self.write(f"{name}.key", key)

    def client(self, name: str | None = None) -> ssl.SSLContext:
        if name is None:
            return client_context(self.ca_cert)
        return client_context(self.ca_cert, *self.host(name))

    def write(self, name: str, data: bytes) -> Path:
        write_private(self.dir / name, data)
        return self.dir / name


def make_pki(directory: Path) -> Pki:
    directory.mkdir()
    ca_key, ca_cert = new_ca()
    pki = Pki(directory, ca_key, ca_cert)
    server_key, server_cert = issue_server_cert(ca_key, ca_cert)
    pki.write("ca.pem", ca_cert)
    pki.write("server.pem", server_cert)
    pki.write("server.key", server_key)
    return pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def other(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "other")


@dataclass
class Listener:
    port: int
    seen: list[str | None]  # peer_host of each connection whose handshake completed


@contextlib.asynccontextmanager
async def listening(ctx: ssl.SSLContext) -> AsyncIterator[Listener]:
    seen: list[str | None] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(peer_host(writer.get_extra_info("peercert")))
        writer.write(b"hello\n")
        await writer.drain()
        writer.close()
        with contextlib.suppress(*REFUSED):
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield Listener(server.sockets[0].getsockname()[1], seen)
    finally:
        server.close()
        await server.wait_closed()


async def talk(port: int, ctx: ssl.SSLContext) -> bytes:
    """Connect, read what the server says until it hangs up, and close."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname=SERVER_NAME
    )
    try:
        return await reader.readuntil(b"\n")
    finally:
        writer.close()
        with contextlib.suppress(*REFUSED):
            await writer.wait_closed()


# --- the handshake --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_enrolled_host_is_seen_by_its_name(pki: Pki) -> None:
    async with listening(pki.server()) as server:
        assert await talk(server.port, pki.client("gpu-7")) == b"hello\n"
    assert server.seen == ["gpu-7"]


@pytest.mark.anyio
async def test_host_without_a_certificate_reaches_the_server_anonymously(pki: Pki) -> None:
    async with listening(pki.server()) as server:
        assert await talk(server.port, pki.client()) == b"hello\n"
    assert server.seen == [None]


@pytest.mark.anyio
async def test_client_certificate_from_another_ca_is_refused(pki: Pki, other: Pki) -> None:
    stranger = client_context(pki.ca_cert, *other.host("gpu-7"))  # trusts the server, though
    async with listening(pki.server()) as server:
        with pytest.raises(REFUSED) as refused:
            await talk(server.port, stranger)
    assert server.seen == []
    assert isinstance(refused.value, asyncio.IncompleteReadError)  # handshake done, then hung up


@pytest.mark.anyio
async def test_servers_certificate_cannot_be_a_hosts(pki: Pki) -> None:
    """The server's own certificate (serverAuth only) presented as a client certificate."""
    posing = client_context(pki.ca_cert, pki.dir / "server.pem", pki.dir / "server.key")
    async with listening(pki.server()) as server:
        with pytest.raises(REFUSED):
            await talk(server.port, posing)
    assert server.seen == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("client", "code"),
    [
        ("stranger", 20),  # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
        ("server", 26),  # X509_V_ERR_INVALID_PURPOSE: serverAuth only, not clientAuth
    ],
)
async def test_server_refuses_client_certificates_for_the_right_reason(
    pki: Pki, other: Pki, client: str, code: int
) -> None:
    """The same refusals, with the TLS started inside the handler so that the server's reason
    can be read (a server made with ``ssl=`` drops it)."""
    if client == "stranger":
        ctx = client_context(pki.ca_cert, *other.host("gpu-7"))
    else:
        ctx = client_context(pki.ca_cert, pki.dir / "server.pem", pki.dir / "server.key")
    errors: list[BaseException] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.start_tls(pki.server())
        except ssl.SSLError as exc:
            errors.append(exc)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        with pytest.raises(REFUSED):
            await talk(server.sockets[0].getsockname()[1], ctx)
    finally:
        server.close()
        await server.wait_closed()
    assert len(errors) == 1
    assert isinstance(errors[0], ssl.SSLCertVerificationError)
    assert errors[0].verify_code == code


@pytest.mark.anyio
async def test_host_certificate_cannot_serve(pki: Pki) -> None:
    posing = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    posing.load_cert_chain(*pki.host("gpu-7"))
    async with listening(posing) as server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await talk(server.port, pki.client("gpu-8"))
    assert server.seen == []
    assert refused.value.verify_code == 26  # X509_V_ERR_INVALID_PURPOSE: the EKU, checked first


@pytest.mark.anyio
async def test_host_certificate_named_like_the_server_still_cannot_serve(pki: Pki) -> None:
    """A certificate with the server's DNS name but clientAuth only (forged with the CA key, as
    the CA would never sign it): the key usage alone keeps it from serving."""
    ca_key = serialization.load_pem_private_key(pki.ca_key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca_cert.not_valid_before_utc)
        .not_valid_after(ca_cert.not_valid_after_utc)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    posing = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    posing.load_cert_chain(
        pki.write("forged.pem", cert.public_bytes(serialization.Encoding.PEM)),
        pki.write("forged.key", _pkcs8(key)),
    )
    async with listening(posing) as server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await talk(server.port, pki.client())
    assert server.seen == []
    assert refused.value.verify_code == 26  # X509_V_ERR_INVALID_PURPOSE


def _pkcs8(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.mark.anyio
async def test_host_trusting_another_ca_refuses_the_server(pki: Pki, other: Pki) -> None:
    async with listening(pki.server()) as server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await talk(server.port, other.client())
    assert server.seen == []
    # X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN (the server sends its CA along), or without it
    # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY: either way, not the CA this host trusts.
    assert refused.value.verify_code in (19, 20)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "code"),
    [("gpu-7", 62), ("127.0.0.1", 64)],  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
)
async def test_host_checks_the_servers_name(pki: Pki, name: str, code: int) -> None:
    async with listening(pki.server()) as server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await asyncio.open_connection(
                "127.0.0.1", server.port, ssl=pki.client(), server_hostname=name
            )
    assert refused.value.verify_code == code
    assert server.seen == []


@pytest.mark.anyio
async def test_tls_1_2_is_refused(pki: Pki) -> None:
    old = pki.client()
    old.minimum_version = ssl.TLSVersion.TLSv1_2
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    async with listening(pki.server()) as server:
        with pytest.raises(REFUSED):
            await talk(server.port, old)
    assert server.seen == []


# --- issuing --------------------------------------------------------------------------------


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_certificates_carry_their_roles(pki: Pki) -> None:
    ca = x509.load_pem_x509_certificate(pki.ca_cert)
    server = _load(pki.dir / "server.pem")
    host = _load(pki.host("gpu-7")[0])
    again = _load(pki.host("gpu-7")[0])

    ca_bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert (ca_bc.critical, ca_bc.value.ca, ca_bc.value.path_length) == (True, True, 0)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    assert ca.subject == ca.issuer
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert lifetime.days == 3650  # ten years, and the hour of skew
    assert lifetime.seconds == 3600

    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [SERVER_NAME]
    assert san.get_values_for_type(x509.IPAddress) == []
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == SERVER_NAME
    assert _eku(server) == [ExtendedKeyUsageOID.SERVER_AUTH]

    assert host.subject.rfc4514_string() == "CN=gpu-7"
    assert host.issuer == ca.subject
    assert _eku(host) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert host.serial_number != again.serial_number
    for leaf in (server, host):
        assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
        assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
        leaf.verify_directly_issued_by(ca)


def test_host_key_is_unencrypted_pkcs8_p256() -> None:
    pem = new_host_key()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"


def test_host_certificate_lives_as_many_days_as_asked(pki: Pki) -> None:
    key = new_host_key()
    pem = sign_host_csr(pki.ca_key, pki.ca_cert, host_csr(key, "gpu-7"), "gpu-7", days=30)
    cert = x509.load_pem_x509_certificate(pem)
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30


def test_csr_for_another_name_is_refused(pki: Pki) -> None:
    csr = host_csr(new_host_key(), "gpu-7")
    with pytest.raises(PkiError, match="not CN=gpu-8"):
        sign_host_csr(pki.ca_key, pki.ca_cert, csr, "gpu-8")


def _tamper(pem: bytes, old: bytes, new: bytes) -> bytes:
    der = x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER)
    assert der.count(old) == 1
    return x509.load_der_x509_csr(der.replace(old, new)).public_bytes(serialization.Encoding.PEM)


def test_csr_with_a_changed_name_is_refused(pki: Pki) -> None:
    """The name rewritten after signing: the name matches what is asked, the signature does not."""
    csr = _tamper(host_csr(new_host_key(), "gpu-7"), b"gpu-7", b"gpu-8")
    with pytest.raises(PkiError, match="signature"):
        sign_host_csr(pki.ca_key, pki.ca_cert, csr, "gpu-8")


def test_csr_with_a_damaged_signature_is_refused(pki: Pki) -> None:
    pem = host_csr(new_host_key(), "gpu-7")
    signature = x509.load_pem_x509_csr(pem).signature
    damaged = signature[:-1] + bytes([signature[-1] ^ 1])
    csr = _tamper(pem, signature, damaged)
    with pytest.raises(PkiError, match="signature"):
        sign_host_csr(pki.ca_key, pki.ca_cert, csr, "gpu-7")


def test_server_name_and_bad_names_are_never_signed(pki: Pki) -> None:
    csr = host_csr(new_host_key(), "gpu-7")
    for name in (SERVER_NAME, "GPU-7", ""):
        with pytest.raises(PkiError):
            sign_host_csr(pki.ca_key, pki.ca_cert, csr, name)
    with pytest.raises(PkiError):
        host_csr(new_host_key(), SERVER_NAME)


def test_signing_needs_the_cas_own_key(pki: Pki, other: Pki) -> None:
    csr = host_csr(new_host_key(), "gpu-7")
    with pytest.raises(PkiError, match="does not belong"):
        sign_host_csr(other.ca_key, pki.ca_cert, csr, "gpu-7")
    with pytest.raises(PkiError, match="cannot read the CSR"):
        sign_host_csr(pki.ca_key, pki.ca_cert, b"not a csr", "gpu-7")


# --- names and fingerprints -----------------------------------------------------------------


def test_fingerprint_is_the_sha256_of_the_der(pki: Pki, other: Pki) -> None:
    der = x509.load_pem_x509_certificate(pki.ca_cert).public_bytes(serialization.Encoding.DER)
    assert fingerprint(pki.ca_cert) == "sha256:" + hashlib.sha256(der).hexdigest()
    assert fingerprint(pki.ca_cert) == fingerprint(pki.ca_path.read_bytes())
    assert fingerprint(pki.ca_cert) != fingerprint(other.ca_cert)
    assert len(fingerprint(pki.ca_cert)) == len("sha256:") + 64


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("gpu-7", True),
        ("a", True),
        ("0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("-gpu", False),
        ("gpu-", False),
        ("-", False),
        ("GPU-7", False),
        ("gpu_7", False),
        ("gpu.7", False),
        ("gpu 7", False),
        ("gpu-7\n", False),
        ("gpü", False),
        (SERVER_NAME, False),
        (SERVER_NAME + "s", True),
    ],
)
def test_valid_host_name(name: str, valid: bool) -> None:
    assert valid_host_name(name) is valid


def test_peer_host_without_a_usable_name() -> None:
    assert peer_host(None) is None
    assert peer_host({}) is None
    assert peer_host({"subject": ((("commonName", "gpu-7"),),)}) == "gpu-7"
    assert peer_host({"subject": ((("commonName", SERVER_NAME),),)}) is None
    assert peer_host({"subject": ((("organizationName", "gpu-7"),),)}) is None
    two = ((("commonName", "gpu-7"),), (("commonName", "gpu-8"),))
    assert peer_host({"subject": two}) is None


# --- files ----------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_private_creates_owner_only_files(tmp_path: Path) -> None:
    path = tmp_path / "host.key"
    write_private(path, b"secret")
    assert (path.read_bytes(), _mode(path)) == (b"secret", 0o600)


def test_write_private_replaces_an_open_file_with_a_private_one(tmp_path: Path) -> None:
    path = tmp_path / "host.key"
    path.write_bytes(b"old and longer")
    path.chmod(0o644)
    old_inode = path.stat().st_ino
    write_private(path, b"new")
    assert (path.read_bytes(), _mode(path)) == (b"new", 0o600)
    assert path.stat().st_ino != old_inode  # replaced, not rewritten in place
    assert os.listdir(tmp_path) == ["host.key"]  # no temporary file left behind

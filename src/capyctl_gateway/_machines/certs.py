"""The control channel's keys and certificates: the names they carry, the CA, and issuing.

A new CA (EC P-256, path length 0), the server's certificate (``SERVER_NAME``, serverAuth
only), a host's key and CSR (made on the host, CN its name) and the certificate the CA signs
from it (clientAuth only), and a certificate's fingerprint. Everything that reads a key, CSR or
certificate checks its kind and raises `PkiError`. How they are used, and the trust model, is
in ``pki.py``, which re-exports these names.
"""

from __future__ import annotations

import datetime
import hashlib
import re

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .._errors import OperatorError

__all__ = [
    "SERVER_NAME",
    "PkiError",
    "fingerprint",
    "host_csr",
    "issue_server_cert",
    "new_ca",
    "new_host_key",
    "sign_host_csr",
    "valid_host_name",
]

SERVER_NAME = "capyctl-server"  # the DNS SAN on the server's certificate; hosts check it

_TEN_YEARS = datetime.timedelta(days=3650)
_SKEW = datetime.timedelta(hours=1)  # not_before lies this far back: clocks disagree
_HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


class PkiError(OperatorError):
    """A key, CSR or certificate cannot be used: unreadable, of the wrong kind, or not matching."""


def valid_host_name(name: str) -> bool:
    """1-63 characters of ``[a-z0-9-]``, not starting or ending with ``-``, not `SERVER_NAME`."""
    return _HOST_NAME.fullmatch(name) is not None and name != SERVER_NAME


# --- making keys and certificates ---------------------------------------------------------------


def new_ca(common_name: str = "capyctl control CA") -> tuple[bytes, bytes]:
    """(key_pem, cert_pem) of a new self-signed CA: EC P-256, CA:true pathlen 0, keyCertSign and
    cRLSign, valid 10 years (not_before 1 h back for clock skew)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + _TEN_YEARS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def issue_server_cert(ca_key_pem: bytes, ca_cert_pem: bytes) -> tuple[bytes, bytes]:
    """(key_pem, cert_pem) for the server's control listener: EC P-256, CN and DNS SAN =
    `SERVER_NAME`, extended key usage serverAuth only, CA:false, valid 10 years."""
    ca_key, ca_cert = _load_ca(ca_key_pem, ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _leaf(ca_key, ca_cert, SERVER_NAME, key.public_key(), _TEN_YEARS)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def new_host_key() -> bytes:
    """A new EC P-256 private key for a host, PEM PKCS8, unencrypted."""
    return _key_pem(ec.generate_private_key(ec.SECP256R1()))


def host_csr(key_pem: bytes, host_name: str) -> bytes:
    """A CSR (PEM) for ``host_name`` (its subject CN), signed with the host's key."""
    if not valid_host_name(host_name):
        raise PkiError(f"not a valid host name: {host_name!r}")
    key = _load_ec_key(key_pem, "host key")
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name(host_name))
    return csr.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def sign_host_csr(
    ca_key_pem: bytes, ca_cert_pem: bytes, csr_pem: bytes, host_name: str, *, days: int = 3650
) -> bytes:
    """A host's certificate (PEM) from its CSR: extended key usage clientAuth only, CA:false,
    CN = ``host_name``, a random serial, valid ``days`` (never past the CA itself).

    Raises `PkiError` when the CSR cannot be read, its signature does not verify, or its subject
    is not exactly the CN ``host_name`` (nor when ``host_name`` itself is not a valid name).
    """
    if not valid_host_name(host_name):
        raise PkiError(f"not a valid host name: {host_name!r}")
    if days < 1:
        raise PkiError(f"a certificate must be valid for at least one day, not {days}")
    ca_key, ca_cert = _load_ca(ca_key_pem, ca_cert_pem)
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        signature_ok = csr.is_signature_valid
        public_key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise PkiError(f"cannot read the CSR: {exc}") from exc
    if not signature_ok:
        raise PkiError("the CSR's signature does not verify")
    if csr.subject != _name(host_name):
        raise PkiError(f"the CSR names {csr.subject.rfc4514_string()!r}, not CN={host_name}")
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise PkiError("the CSR's key is not an elliptic-curve key")
    lifetime = min(datetime.timedelta(days=days), ca_cert.not_valid_after_utc - _now())
    cert = (
        _leaf(ca_key, ca_cert, host_name, public_key, lifetime)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def fingerprint(cert_pem: bytes) -> str:
    """``sha256:`` and the lowercase hex SHA-256 of the certificate's DER encoding."""
    der = _load_cert(cert_pem, "certificate").public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


# --- helpers ------------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    public_key: ec.EllipticCurvePublicKey,
    lifetime: datetime.timedelta,
) -> x509.CertificateBuilder:
    """What a server and a host certificate share; the caller adds the key purpose and signs."""
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_ec_key(pem: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise PkiError(f"cannot read the {what}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"the {what} is not an elliptic-curve key")
    return key


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise PkiError(f"cannot read the {what}: {exc}") from exc


def _load_ca(
    key_pem: bytes, cert_pem: bytes
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _load_ec_key(key_pem, "CA key")
    cert = _load_cert(cert_pem, "CA certificate")
    if cert.public_key() != key.public_key():
        raise PkiError("the CA key does not belong to the CA certificate")
    return key, cert

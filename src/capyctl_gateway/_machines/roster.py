"""The hosts a server enrolled: the certificate each name holds (by its fingerprint) and its
revocation, kept in ``<state>/machines.sqlite3`` beside the join tokens.

A name holds one certificate: the one its latest enrollment signed. A session is admitted only
with that certificate, not revoked, so two machines can never share a name (the one enrolled
last holds it; the other is refused). ``revoke host NAME`` writes the revocation to the
database; the server reads a host's row at each new session and once a second for each live
session (with its ping), so a revocation closes a live session within a second and needs no
channel to the running server but the database. A host enrolled before the server kept this
table has its certificate recorded at its first session.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time

__all__ = ["Roster", "der_fingerprint"]

logger = logging.getLogger("capyctl_gateway")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS host (
    name TEXT PRIMARY KEY,
    cert_sha256 TEXT NOT NULL,
    enrolled_at REAL NOT NULL,
    revoked_at REAL
);
"""


def der_fingerprint(der: bytes) -> str:
    """A certificate's fingerprint from its DER bytes, as `pki.fingerprint` writes it."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


class Roster:
    """The enrolled hosts, over the invites' database connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        db.executescript(_SCHEMA)

    def enrolled(self, name: str) -> bool:
        """Whether ``name`` holds a certificate that is not revoked."""
        row = self._db.execute(
            "SELECT 1 FROM host WHERE name = ? AND revoked_at IS NULL", (name,)
        ).fetchone()
        return row is not None

    def enroll(self, name: str, cert_sha256: str, now: float | None = None) -> str | None:
        """Record ``name``'s new certificate; the one it replaces (None if none, or the same),
        with a warning: the machine that held the name is refused from now on."""
        row = self._db.execute("SELECT cert_sha256 FROM host WHERE name = ?", (name,)).fetchone()
        self._db.execute(
            "INSERT INTO host VALUES (?, ?, ?, NULL) ON CONFLICT(name) DO UPDATE SET "
            "cert_sha256 = excluded.cert_sha256, enrolled_at = excluded.enrolled_at, "
            "revoked_at = NULL",
            (name, cert_sha256, time.time() if now is None else now),
        )
        if row is None or row[0] == cert_sha256:
            return None
        logger.warning(
            "host %s: enrolled again, with a new certificate; the one before (%s) is refused "
            "from now on, and a session that holds it is closed",
            name,
            row[0],
        )
        return str(row[0])

    def revoke(self, name: str, now: float | None = None) -> bool:
        """Revoke ``name``'s certificate; whether it held one that was not revoked."""
        done = self._db.execute(
            "UPDATE host SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
            (time.time() if now is None else now, name),
        )
        return done.rowcount > 0

    def refusal(self, name: str, cert_sha256: str) -> str | None:
        """Why a session of host ``name`` with this certificate is refused; None if admitted."""
        row = self._db.execute(
            "SELECT cert_sha256, revoked_at FROM host WHERE name = ?", (name,)
        ).fetchone()
        if row is None:  # enrolled before the server kept its roster: this one holds the name
            self.enroll(name, cert_sha256)
            return None
        if row[1] is not None:
            return "its certificate was revoked (`capyctl-gateway revoke host`)"
        if row[0] != cert_sha256:
            return "its certificate is not the one last enrolled under its name"
        return None

"""``invite host`` and ``revoke host``: the server's side of enrolling a machine, a join file
written for it, and its certificate refused from then on."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter, ValidationError

from ._cli_common import address
from ._config import ConfigError, Seconds
from ._machines import pki
from ._machines.enroll import Invites, JoinError, JoinFile, ServerIdentity

__all__ = ["MAX_INVITE_S", "StateOpt", "invite_app", "revoke_app"]

MAX_INVITE_S = 30 * 86400.0
"""The longest a join file may be valid (``--valid``): 30 days. A join file is a bearer secret
that enrolls a machine; a month is enough to post one to a remote site and have it used, and a
file forgotten in a mailbox or a backup stops working within that (11,400 years was accepted)."""

StateOpt = Annotated[
    Path | None, typer.Option("--state-dir", help="State directory (env CAPYCTL_STATE_DIR).")
]


def _duration(value: str) -> float:
    try:
        seconds = float(TypeAdapter(Seconds).validate_python(value))
    except ValidationError:
        raise ConfigError(f"--valid takes a duration such as 1h or 30m, got {value!r}") from None
    if seconds > MAX_INVITE_S:
        raise ConfigError(
            f"--valid {value}: a join file is valid for at most 30 days ({MAX_INVITE_S / 3600:g}h)"
        )
    return seconds


def invite_app(
    state_of: Callable[[Path | None], Path], fail: Callable[[str], typer.Exit]
) -> typer.Typer:
    """``invite host``."""
    app = typer.Typer(help="Invite machines to this server.", no_args_is_help=True)

    @app.command("host")
    def invite_host(
        name: Annotated[str, typer.Argument(help="The host's name, as deployments name it.")],
        output: Annotated[Path, typer.Option("--output", help="The join file to write.")],
        valid: Annotated[str, typer.Option("--valid", help="How long it may be used.")] = "1h",
        server: Annotated[
            str | None,
            typer.Option("--server", help="The control address as the host reaches it."),
        ] = None,
        replace: Annotated[
            bool,
            typer.Option(
                "--replace",
                help="NAME is enrolled, or has a join file still usable: enroll a new machine "
                "in its place, voiding that file.",
            ),
        ] = False,
        state_dir: StateOpt = None,
    ) -> None:
        """Write a single-use join file (mode 0600) for host NAME."""
        state = state_of(state_dir)
        try:
            _write_join_file(state, name, output, valid=valid, server=server, replace=replace)
        except (ConfigError, JoinError, OSError) as exc:
            raise fail(str(exc)) from None
        typer.echo(f"join file for host {name} written to {output} (valid {valid}, used once)")

    return app


def _write_join_file(
    state: Path, name: str, output: Path, *, valid: str, server: str | None, replace: bool
) -> None:
    """Write host ``name``'s join file to ``output``, once its name, the server's state and
    address, ``valid`` and whether ``name`` is taken are checked."""
    identity = ServerIdentity(state / "identity")
    if not pki.valid_host_name(name):
        raise ConfigError(f"{name!r} cannot name a host: 1 to 63 of a-z, 0-9 and '-'")
    if not identity.ca_cert.exists():
        raise ConfigError(f"no server state in {state}: start `serve --role server` once")
    control = server or identity.address_file.read_text(encoding="utf-8").strip()
    chost, _ = address(control, "--server")
    if chost in ("0.0.0.0", "::"):  # noqa: S104 - what hosts cannot be sent to
        raise ConfigError(
            f"the server listens on {control}: say how the host reaches it with --server"
        )
    seconds = _duration(valid)
    invites = Invites(state / "machines.sqlite3")
    try:
        if invites.roster.enrolled(name) and not replace:
            raise ConfigError(
                f"host {name} is enrolled already: a second machine of that name would "
                "take its place. To enroll a new machine in its place, add --replace "
                "(the old one is refused once the new one joins); to cut it off, "
                f"`capyctl-gateway revoke host {name}`"
            )
        token, expires = invites.create(name, seconds, replace=replace)
    finally:
        invites.close()
    ca = identity.ca_cert.read_bytes()
    JoinFile(name, control, ca, pki.fingerprint(ca), token, expires).write(output)


def revoke_app(
    state_of: Callable[[Path | None], Path], fail: Callable[[str], typer.Exit]
) -> typer.Typer:
    """``revoke host``."""
    app = typer.Typer(help="Cut machines off this server.", no_args_is_help=True)

    @app.command("host")
    def revoke_host(
        name: Annotated[str, typer.Argument(help="The host's name.")],
        state_dir: StateOpt = None,
    ) -> None:
        """Refuse host NAME's certificate from now on; a running server closes its session
        within a second (it reads the revocation from its state directory)."""
        state = state_of(state_dir)
        path = state / "machines.sqlite3"
        try:
            if not path.exists():
                raise ConfigError(f"no server state in {state}: no host was enrolled there")
            invites = Invites(path)
            try:
                done = invites.roster.revoke(name)
            finally:
                invites.close()
        except (ConfigError, OSError, sqlite3.Error) as exc:
            raise fail(str(exc)) from None
        if not done:
            raise fail(f"host {name} holds no certificate here (never enrolled, or revoked)")
        typer.echo(
            f"host {name} revoked: its certificate is refused from now on, and a running "
            "server closes its session within a second; to enroll it again, invite it"
        )

    return app

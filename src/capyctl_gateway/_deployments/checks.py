"""Whether an instance is routed to, from the collector's startup checks (an EventHook).

An instance whose engine answers but does not list the deployment's model (or reports another
version under ``version_mismatch: refuse``) is not routed to; what the checks found is
logged once per change, naming the deployment and instance. An engine that is merely down is
still offered requests: a refused connection moves them on to the next instance.
"""

from __future__ import annotations

import logging

from canopyx_provider import CheckReport, ChecksCompleted, Event

from .._config import Deployment
from .routes import Route

__all__ = ["CheckWatch", "same_version", "unusable_reason"]

logger = logging.getLogger("capyctl_gateway")


class CheckWatch:
    def __init__(self, routes: dict[str, Route]) -> None:
        self._routes = routes
        self._instances = {i.key: i for r in routes.values() for i in r.instances}
        self._said: dict[str, tuple[str | None, str | None]] = {}
        """What was last logged of each instance's checks (failed check, version seen)."""

    def __call__(self, event: Event, /) -> None:
        """The collector's startup checks decide whether an instance is routed to; what they
        found is logged once per change, with the deployment and instance it concerns."""
        if not isinstance(event, ChecksCompleted):
            return
        inst = self._instances.get(event.key)
        if inst is None:
            return
        dep = self._routes[inst.deployment].deployment
        report = event.report
        failed = report.failed
        said = (
            None if failed is None else f"{failed.name}: {failed.reason}",
            report.engine_version,
        )
        before, self._said[inst.key] = self._said.get(inst.key), said
        reason = unusable_reason(dep, report)
        if said != before:
            if failed is not None:
                logger.error(
                    "%s failed its startup checks (%s: %s)%s",
                    inst.where,
                    failed.name,
                    failed.reason,
                    "; it is not routed to" if reason else "; requests still go to it",
                )
            elif reason is None and before is not None and inst.unusable:
                logger.warning("%s passed its startup checks; it is routed to again", inst.where)
            version = report.engine_version
            if version is not None and not same_version(version, dep.engine_version):
                logger.warning(
                    "%s reports engine version %s, not the configured %s%s",
                    inst.where,
                    version,
                    dep.engine_version,
                    "; it is not routed to" if reason else " (version_mismatch: warn)",
                )
        inst.unusable = reason


_DOWN = ("unreachable", "timeout")
"""The codes of a check the engine never answered (down, or gone while it was checked): it
said nothing of the models it serves."""


def unusable_reason(deployment: Deployment, report: CheckReport) -> str | None:
    """Why an instance whose startup checks ended with ``report`` must not be routed to.

    An engine that is down or slow (health, discovery, metrics) is still offered requests: a
    refused connection moves them to the next instance, and the metrics are the SDK's concern,
    not the answers'. One that answers but does not serve the model would answer every request
    wrongly.
    """
    failed = report.failed
    if failed is not None and failed.name == "models" and failed.code not in _DOWN:
        return f"{failed.name} check failed: {failed.reason}"
    reported = report.engine_version
    if (
        deployment.version_mismatch == "refuse"
        and reported is not None
        and not same_version(reported, deployment.engine_version)
    ):
        return (
            f"the engine reports version {reported}, not engine_version "
            f"{deployment.engine_version} (version_mismatch: refuse)"
        )
    return None


def same_version(reported: str, configured: str) -> bool:
    return reported.strip().lower().removeprefix("v") == configured.strip().lower().removeprefix(
        "v"
    )

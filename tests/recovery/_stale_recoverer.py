"""A recovery worker process that stops right after it claimed an orphaned run.

``python _stale_recoverer.py`` (configured by the ``FLEET_*`` variables of ``_app``) sweeps
once. When its claim is made, just before its ``run.recover`` entry is written, it prints
``{"event": "claimed"}`` and waits for a line on stdin (the parent SIGSTOPs it meanwhile,
past the claim's lease, and resumes the run elsewhere). Then it goes on and prints
``{"event": "done", ...}`` with what the sweep reported and counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import _app
from prometheus_client import CollectorRegistry

from loomflow.audit import AuditEntry, AuditLog
from loomflow.audit.actions import RUN_RECOVER
from loomflow.recovery import Recovery
from loomflow.telemetry import Metrics
from loomflow.telemetry._metrics import RECOVERY_OUTCOMES


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


class _StopsAtTheClaim(AuditLog):
    """The app's audit log; its first ``run.recover`` waits for the parent's line."""

    stopped = False

    async def record(
        self, action: str, *, payload: Mapping[str, Any] | None = None, **fields: Any
    ) -> AuditEntry:
        if action == RUN_RECOVER and not self.stopped:
            self.stopped = True
            emit("claimed")
            if not await asyncio.to_thread(sys.stdin.readline):
                raise SystemExit(4)  # the parent is gone
        return await super().record(action, payload=payload, **fields)


async def main() -> None:
    agents = _app.agents()
    runtime = agents["orders"].runtime
    assert runtime is not None
    audit = _StopsAtTheClaim(os.environ.get("FLEET_AUDIT_URL", os.environ["FLEET_URL"]))
    registry = CollectorRegistry()
    recovery = Recovery(runtime, agents, audit=audit, metrics=Metrics(registry), worker_id="stale")
    try:
        report = await recovery.sweep()
        await recovery.wait()
        counted = {
            o: registry.get_sample_value("loomflow_recoveries_total", {"outcome": o})
            for o in RECOVERY_OUTCOMES
        }
        emit(
            "done",
            resumed=len(report.resumed),
            failures=recovery.failures,
            outcomes=sorted(o for o, n in counted.items() if n),
        )
    finally:
        await runtime.close()
        await audit.close()
        closing = agents["orders"].audit
        if isinstance(closing, AuditLog):
            await closing.close()


if __name__ == "__main__":
    asyncio.run(main())

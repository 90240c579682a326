"""A process that runs ``Stores.forget_user`` and is killed (SIGKILL) at a chosen point.

Usage: python _forget_worker.py USER WHERE
WHERE: ``tombstone`` (after the erasure record is written, before any payload is erased) or
``rename`` (a JSON-lines audit log: its rewritten file is on disk, not yet renamed into place).
The stores come from LOOMFLOW_RUNTIME_URL / LOOMFLOW_AUDIT_URL, as the CLI's do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from loomflow.audit import jsonl
from loomflow.audit._sql import SqlAuditStore
from loomflow.stores import Stores


def _die(*_: Any, **__: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


async def main(user: str, where: str) -> None:
    if where == "tombstone":
        SqlAuditStore._tombstone = _die  # type: ignore[method-assign]
    else:
        rename = os.replace

        def replace(src: Any, dst: Any) -> None:
            if str(src).endswith(".erase"):  # the rewritten log, not a heads file
                _die()
            rename(src, dst)

        jsonl.os.replace = replace  # type: ignore[assignment]
    async with Stores() as stores:
        await stores.forget_user(user, actor="test:crash")
    raise SystemExit("the kill point was never reached")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

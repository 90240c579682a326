"""A worker process that appends audit records as fast as it can (for the multi-process test).

Usage: python _writer.py URL WORKER COUNT READY_FILE GO_FILE
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from loomflow.audit import AuditRecord, audit_store_from_url


async def main(url: str, worker: int, count: int, ready: Path, go: Path) -> None:
    store = audit_store_from_url(url)
    await store.open()
    ready.touch()  # noqa: ASYNC240 - a marker file, nothing else runs on this loop
    deadline = time.monotonic() + 60
    while not go.exists():  # noqa: ASYNC240 - start together, so the writers really contend
        if time.monotonic() > deadline:
            raise SystemExit("no go signal")
        await asyncio.sleep(0.005)
    for i in range(count):
        records = [
            AuditRecord(
                user_id="shared", actor=f"w{worker}", action="test.write", payload={"i": i}
            ),
            AuditRecord(user_id=f"u{i % 3}", actor=f"w{worker}", action="test.write"),
        ]
        await store.append(records[: 1 + i % 2])
    await store.close()


if __name__ == "__main__":
    url, worker, count, ready, go = sys.argv[1:6]
    asyncio.run(main(url, int(worker), int(count), Path(ready), Path(go)))

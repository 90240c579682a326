"""A journal worker stopped in the middle of a write (for test_leases.py).

``python _locked_writer.py <db> <session> <user> <lease_s>``: runs step 1 of a run, begins a
write transaction on the journal file (as a lease renewal or step write does), prints
``locked`` and stops itself with SIGSTOP while holding SQLite's write lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from loomflow.runtime import SqliteRuntime


async def main(path: str, session: str, user: str, lease_s: float) -> None:
    runtime = SqliteRuntime(path, lease_seconds=lease_s)
    async with runtime.session(session, user):
        await runtime.step("step-1", lambda: "written")
        conn = runtime.database.conn
        await conn.execute("BEGIN IMMEDIATE")
        await conn.execute("UPDATE loom_sessions SET updated_at = updated_at")
        print(json.dumps({"event": "locked", "pid": os.getpid()}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)  # continued: never reached in the test, which kills it


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))

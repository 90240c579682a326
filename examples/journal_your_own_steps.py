"""The runtime on its own: journal any async function as a step, crash, replay.

python examples/journal_your_own_steps.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from loomflow.runtime import SqliteRuntime

sent: list[str] = []


async def send_invoice(customer: str, amount: float) -> dict[str, object]:
    sent.append(customer)
    return {"invoice": f"INV-{customer}", "amount": amount}


async def billing_run(runtime: SqliteRuntime, *, crash: bool) -> None:
    async with runtime.session("billing-2026-11", user_id="finance-bot") as run:
        for customer, amount in [("acme", 120.0), ("globex", 75.5), ("initech", 19.9)]:
            await runtime.step(f"invoice_{customer}", send_invoice, customer, amount)
            if crash and customer == "globex":
                raise RuntimeError("worker lost power")
    print(f"epoch {run.epoch}: {run.stats.hits} replayed, {run.stats.misses} ran")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runtime = SqliteRuntime(Path(tmp) / "journal.db")
        try:
            await billing_run(runtime, crash=True)
        except RuntimeError as exc:
            print("first attempt failed:", exc)
        await billing_run(runtime, crash=False)  # the open run resumes
        assert sent == ["acme", "globex", "initech"], sent
        print("each invoice was sent once:", sent)
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main())

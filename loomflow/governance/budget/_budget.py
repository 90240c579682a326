"""``StandardBudget``: caps on tokens, cost and time, enforced before every live model call.

The agent plugs it in through :meth:`StandardBudget.as_hooks`:

- before a *live* model call, the budget reserves the most the call can spend (its input,
  estimated from above, plus ``max_tokens`` of output, priced) in every bucket a cap watches,
  atomically; a cap that would be crossed ends the run with ``budget:<cap>``;
- after the call, it charges what the call really spent and frees the rest;
- a failed call frees its reservation; a replayed call is never charged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, NoReturn, TypeVar

from ulid import ULID

from ..._cleanup import raise_if_cancelled
from ..._ids import check_id
from ...errors import (
    BudgetExceededError,
    BudgetUnavailableError,
    InvalidArgumentTypeError,
    InvalidUsageError,
    StorageError,
    UnknownModelPriceError,
    UntrustedUsageError,
    UserError,
)
from ...hooks import Interrupt, RunHooks, RunInfo
from ...messages import Message, ModelResponse, ModelSettings, Usage
from ...models.pricing import PRICES, ModelPrice, normalize_prices, price_for, warn_unpriced
from ...storage._answers import yes_or_no
from ..events import BudgetDenied, BudgetUnavailable, BudgetWarning
from ._owner import current_owner
from ._store import BudgetStore
from ._types import (
    MAX_TOKENS_PER_CALL,
    Amount,
    Bucket,
    BucketLimit,
    Cap,
    CommitResult,
    Denial,
    OnExpiry,
    Reservation,
    Totals,
    _count,
    evaluate,
    usd,
)
from .inmemory import InMemoryBudgetStore

__all__ = ["BudgetHooks", "CapStatus", "StandardBudget", "Ticket", "bound_input_tokens"]

log = logging.getLogger("loomflow.governance.budget")

T = TypeVar("T")

# What the budget calls on its store (see BudgetStore).
_STORE_OPS = ("reserve", "commit", "record", "release", "renew", "reclaim", "totals", "close")

# What a store failure costs a call, in BudgetUnavailableError's message (a commit comes after
# the call: its figure is what is lost, not the call).
_REFUSED = "the model call is refused"
_UNRECORDED = "the call's charge is not recorded"

# Role markers and separators a chat template adds around each message.
_PER_MESSAGE_TOKENS = 8


def bound_input_tokens(messages: Sequence[Message]) -> int:
    """An upper bound on the input tokens of ``messages`` for byte-level BPE tokenizers.

    Every token of such a tokenizer (the Claude and GPT families) covers at least one byte of
    UTF-8, so the byte count plus a few tokens of framing per message bounds the real count
    from above; on English text it is about four times the real figure. Tool schemas are not
    in ``messages``: :class:`StandardBudget` adds ``overhead_tokens`` for them.
    """
    total = 0
    for message in messages:
        total += len(message.content.encode()) + _PER_MESSAGE_TOKENS
        for call in message.tool_calls:
            arguments = json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"))
            total += len(call.name.encode()) + len(arguments.encode()) + _PER_MESSAGE_TOKENS
        if message.tool_call_id:
            total += len(message.tool_call_id.encode())
    return total


def _cost(
    price: ModelPrice,
    tokens_in: int,
    tokens_out: int,
    *,
    cache_read: int = 0,
    cache_write: int = 0,
    input_rate: float | None = None,
) -> int:
    """Nano-USD of a call: uncached input, cache reads, cache writes and output, each at its
    rate (``cache_read`` and ``cache_write`` are part of ``tokens_in``). ``input_rate``
    replaces the input rate (a reservation assumes the highest)."""
    # Decimal keeps list prices such as 0.15 exact; rounding up never undercounts.
    rate = price.input_per_mtok if input_rate is None else input_rate
    nano = (
        Decimal(str(rate)) * (tokens_in - cache_read - cache_write)
        + Decimal(str(price.cache_read_rate)) * cache_read
        + Decimal(str(price.cache_write_rate)) * cache_write
        + Decimal(str(price.output_per_mtok)) * tokens_out
    ) * 1000
    return math.ceil(nano)


def _usage_cost(price: ModelPrice, usage: Usage, tokens_in: int, tokens_out: int) -> int:
    return _cost(
        price,
        tokens_in,
        tokens_out,
        cache_read=usage.cache_read_tokens,
        cache_write=usage.cache_write_tokens,
    )


@dataclass(frozen=True, slots=True)
class Ticket:
    """A reservation for one model call, handed back to :meth:`StandardBudget.commit`.

    Attributes:
        reservation: What the store holds.
        limits: The caps it was checked against, bucket by bucket.
        user_id: Whom the call is charged to.
        model: The model the call was priced for.
        price: That model's price.
        started: ``time.monotonic()`` when it was granted (the call's time is measured from
            here).
        held: Whether the store holds the reservation. A call no cap watches holds nothing
            (a budget that only records): its commit is one write, and a worker that dies
            during it leaves nothing to reclaim (and charges nothing for it).
        provider: The model's provider label, if known (``"scripted"`` models are free).
    """

    reservation: Reservation
    limits: tuple[BucketLimit, ...]
    user_id: str | None
    model: str
    price: ModelPrice
    started: float
    held: bool = True
    provider: str | None = None

    @property
    def amount(self) -> Amount:
        """What the reservation holds."""
        return self.reservation.amount


@dataclass(frozen=True, slots=True)
class CapStatus:
    """Where one cap stands for a user (figures in the cap's unit)."""

    cap: str
    limit: float
    used: float
    reserved: float
    remaining: float
    fraction: float
    period: str


class StandardBudget:
    """Per-user, global and per-run caps on tokens, cost and time, kept in a shared store.

    Args:
        caps: The caps to enforce (see :class:`Cap`). Without any, the budget only records.
        store: Where totals live: :class:`InMemoryBudgetStore` (the default: one process,
            lost on exit) or :class:`SqlBudgetStore` on SQLite or PostgreSQL (survives
            restarts, shared by every worker).
        mode: ``"hard"`` refuses a call unless its whole reservation fits under every cap, so
            concurrent calls never overshoot together; ``"soft"`` refuses only once a cap is
            used up, and a few calls in flight may overshoot it.
        warn_at: Fractions of a cap at which a :class:`BudgetWarning` is emitted (once, by
            the call that crosses it).
        prices: Extra or overriding prices (USD per million tokens) by model id. Ids are
            matched as calls name them: case, an ``openai:``/``anthropic:`` prefix and a date
            suffix do not matter (two keys naming one model with different prices raise
            :class:`~loomflow.errors.InvalidArgumentError`). A model in no table is refused
            before the call with :class:`UnknownModelPriceError` when a ``cost_usd`` cap
            watches it; with no cost cap its calls count their tokens and no cost.
        overhead_tokens: Input tokens added to each reservation for what the messages do not
            show (tool schemas, provider system prompts).
        estimate_input_tokens: Replaces :func:`bound_input_tokens`. In hard mode it must not
            underestimate, or a call may spend more than it reserved.
        lease_s: How long a reservation outlives a dead worker before it is reclaimed. Live
            workers renew it every third of that. A dead worker on the same host is noticed
            at once.
        on_expiry: What a reclaim does with a dead worker's reservation: ``"charge"`` it as
            spent (the call may have been billed; never undercounts) or ``"release"`` it
            (gives the capacity back; a billed call is then missing from the totals).
        store_timeout_s: How long a store operation may take before the call is refused.
        clock: Unix time, for calendar windows (tests may pass a fake one).

    Example:
        >>> budget = StandardBudget(
        ...     [Cap("tokens_total", 200_000), Cap("cost_usd", 2.0, window="day"),
        ...      Cap("cost_usd", 500.0, scope="global", window="month")],
        ...     store=SqlBudgetStore(runtime.database),
        ... )  # doctest: +SKIP
        >>> agent = Agent("...", model="claude-opus-4-7", budget=budget)  # doctest: +SKIP
    """

    def __init__(
        self,
        caps: Sequence[Cap] = (),
        *,
        store: BudgetStore | None = None,
        mode: Literal["hard", "soft"] = "hard",
        warn_at: float | Sequence[float] = (0.8,),
        prices: Mapping[str, ModelPrice] | None = None,
        overhead_tokens: int = 1024,
        estimate_input_tokens: Callable[[Sequence[Message]], int] | None = None,
        lease_s: float = 60.0,
        on_expiry: OnExpiry = "charge",
        store_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        given: object = caps  # typed loosely: callers pass None or a single Cap
        if isinstance(given, Cap | str) or not isinstance(given, Iterable):
            raise InvalidArgumentTypeError(
                f"caps must be a sequence of Cap, e.g. caps=[Cap(...)], not {caps!r}"
            )
        caps = tuple(caps)  # read once: a generator would be spent by the checks below
        for cap in caps:
            if not isinstance(cap, Cap):
                raise UserError(f"caps must be Cap objects, not {cap!r}")
        names = [cap.name for cap in caps]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise UserError(f"caps {duplicated} are given more than once")
        if mode not in ("hard", "soft"):
            raise UserError(f"mode must be 'hard' or 'soft', not {mode!r}")
        fractions: object = warn_at
        if isinstance(fractions, str) or not isinstance(fractions, int | float | Iterable):
            raise InvalidArgumentTypeError(
                f"warn_at must be a fraction or a sequence of fractions (warn_at=() for no "
                f"warnings), not {warn_at!r}"
            )
        thresholds = (warn_at,) if isinstance(warn_at, int | float) else tuple(warn_at)
        for t in thresholds:
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < 1:
                raise UserError(f"warn_at fractions must lie strictly between 0 and 1, not {t!r}")
        _count("overhead_tokens", overhead_tokens, MAX_TOKENS_PER_CALL)
        for what, value in (("lease_s", lease_s), ("store_timeout_s", store_timeout_s)):
            # bool is an int subclass: lease_s=True is a slip, not one second.
            number = _real(value)
            if number is None or number <= 0:
                raise UserError(f"{what} must be a positive number of seconds, not {value!r}")
        self.caps: tuple[Cap, ...] = tuple(caps)
        # The caps that need every call priced: without one, a model in no table counts 0.
        self._cost_caps = tuple(cap.name for cap in caps if cap.metric == "cost_usd")
        if store is not None and not all(callable(getattr(store, op, None)) for op in _STORE_OPS):
            # A URL here failed only at the first model call, with an AttributeError.
            raise InvalidArgumentTypeError(
                f"store must be a budget store, e.g. SqlBudgetStore(url) or "
                f"InMemoryBudgetStore(), not {store!r}"
            )
        self.store: BudgetStore = store if store is not None else InMemoryBudgetStore()
        self.mode = mode
        self.warn_at: tuple[float, ...] = tuple(sorted(float(t) for t in thresholds))
        # Keyed as price_for looks names up, so "My-Model" or a dated id still prices the call.
        self.prices: Mapping[str, ModelPrice] = normalize_prices(
            {**PRICES, **normalize_prices(prices or {})}
        )
        for name, price in self.prices.items():
            for side in (
                price.input_per_mtok,
                price.output_per_mtok,
                price.cache_read_rate,
                price.cache_write_rate,
            ):
                if _real(side) is None or side < 0:
                    raise InvalidUsageError(f"price of {name!r} must be finite and >= 0: {price}")
        self.overhead_tokens = overhead_tokens
        self._estimate = estimate_input_tokens or bound_input_tokens
        self.lease_s = float(lease_s)
        if on_expiry not in ("charge", "release"):
            raise UserError(f"on_expiry must be 'charge' or 'release', not {on_expiry!r}")
        self.on_expiry: OnExpiry = on_expiry
        self.store_timeout_s = float(store_timeout_s)
        self._clock = clock
        self._abandoned: set[asyncio.Future[Any]] = set()
        self._last_reclaim = -math.inf

    def __repr__(self) -> str:
        return (
            f"StandardBudget(caps={[c.name for c in self.caps]}, mode={self.mode!r}, "
            f"store={self.store!r})"
        )

    @property
    def hard(self) -> bool:
        """Whether reservations must fit under every cap (see ``mode``)."""
        return self.mode == "hard"

    def as_hooks(self) -> BudgetHooks:
        """The hooks an :class:`~loomflow.agent.Agent` calls (``Agent(budget=...)`` does it)."""
        return BudgetHooks(self)

    # -- pricing and sizing ----------------------------------------------------------------

    def price(self, model: str, provider: str | None = None) -> ModelPrice:
        """The price the budget charges ``model`` at.

        A model in no table is priced at 0 when no cap watches cost: its tokens still count
        and a warning is logged once per model.

        Raises:
            UnknownModelPriceError: when no table knows the model and a ``cost_usd`` cap
                needs its price.
        """
        found = price_for(model, provider=provider, prices=self.prices)
        if found is not None:
            return found
        if self._cost_caps:
            raise UnknownModelPriceError(
                f"no price is known for model {model!r}, and cost cap "
                f"{', '.join(self._cost_caps)} cannot be kept without one; pass "
                f"StandardBudget(prices={{{model!r}: ModelPrice(input_usd_per_mtok, "
                "output_usd_per_mtok)}) (ModelPrice is in loomflow.models.pricing)"
            )
        warn_unpriced(model)
        return _UNPRICED

    def size(
        self,
        *,
        model: str,
        max_tokens: int,
        messages: Sequence[Message] = (),
        input_tokens: int | None = None,
        provider: str | None = None,
    ) -> tuple[ModelPrice, Amount]:
        """The most a call can spend: (its price, the amount a reservation holds for it)."""
        price = self.price(model, provider)
        return price, self._most(price, max_tokens, messages, input_tokens)

    def _most(
        self,
        price: ModelPrice,
        max_tokens: int,
        messages: Sequence[Message],
        input_tokens: int | None = None,
    ) -> Amount:
        _count("max_tokens", max_tokens, MAX_TOKENS_PER_CALL)
        if input_tokens is None:
            estimated = self._estimate(messages)
            input_tokens = _count("estimated input tokens", estimated, MAX_TOKENS_PER_CALL)
            input_tokens = min(input_tokens + self.overhead_tokens, MAX_TOKENS_PER_CALL)
        tokens_in = _count("input tokens", input_tokens, MAX_TOKENS_PER_CALL)
        # The input could all be cache writes, dearer than plain input at some providers.
        cost = _cost(price, tokens_in, max_tokens, input_rate=price.max_input_rate)
        return Amount(tokens_in, max_tokens, cost)

    def actual(self, ticket: Ticket, usage: Usage, *, model: str | None, wall_s: float) -> Amount:
        """What a finished call spent, priced as the model that answered (validated).

        Raises:
            InvalidUsageError: for a negative, NaN, non-integer or absurd token count.
        """
        tokens_in = _count("reported input tokens", usage.input_tokens, MAX_TOKENS_PER_CALL)
        tokens_out = _count("reported output tokens", usage.output_tokens, MAX_TOKENS_PER_CALL)
        # The rule RunResult.cost_usd and the audit trail price the call by, too.
        found = price_for(
            ticket.model, provider=ticket.provider, prices=self.prices, reported=model
        )
        price = ticket.price if found is None else found
        return Amount(
            tokens_in, tokens_out, _usage_cost(price, usage, tokens_in, tokens_out), wall_s
        )

    def _plan(
        self, user_id: str | None, now: float
    ) -> tuple[tuple[Bucket, ...], list[BucketLimit]]:
        # The user's all-time bucket is always kept (reports); others only where a cap looks.
        buckets: dict[str, Bucket] = {}
        first = Bucket("user", user_id, "")
        buckets[first.key] = first
        limits: list[BucketLimit] = []
        for cap in self.caps:
            if cap.scope == "run":
                continue
            bucket = Bucket.for_window(cap.scope, user_id, cap.window, now)
            buckets.setdefault(bucket.key, bucket)
            limits.append(BucketLimit(bucket.key, cap.name, cap.metric, cap.limit))
        return tuple(buckets.values()), limits

    # -- store access (fail closed) --------------------------------------------------------

    async def _call(
        self,
        what: str,
        operation: Awaitable[T],
        *,
        outcome: str | None = None,
        undo: Callable[[asyncio.Future[T]], Awaitable[object] | None] | None = None,
    ) -> T:
        # The operation runs in a task of its own so that a hung store costs the caller no
        # more than store_timeout_s: cancelling a driver call can itself block (asyncpg rolls
        # back over the stalled connection), so on timeout the task is cancelled and left to
        # finish in the background instead of being waited for.
        task = asyncio.ensure_future(operation)
        # What the failure costs the caller, if anything: a read for a report costs nothing.
        so = f", so {outcome}" if outcome else ""
        try:
            done, _ = await asyncio.wait({task}, timeout=self.store_timeout_s)
        except asyncio.CancelledError:  # the caller went away (a stream closed mid-call)
            self._give_up(task, undo)
            raise
        if not done:
            self._give_up(task, undo)
            raise BudgetUnavailableError(
                f"the budget store ({self.store.backend}) did not answer {what} within "
                f"{self.store_timeout_s:g} s{so}"
            )
        try:
            return task.result()
        except (StorageError, TimeoutError) as exc:  # down, unmigrated, or a damaged row
            raise BudgetUnavailableError(
                f"the budget store ({self.store.backend}) failed during {what}{so}: {exc}"
            ) from exc

    def _give_up(
        self,
        task: asyncio.Future[T],
        undo: Callable[[asyncio.Future[T]], Awaitable[object] | None] | None,
    ) -> None:
        task.cancel()
        self._abandon(task)
        if undo is not None:
            # The cancel may come too late (a SQLite COMMIT runs on to its end on the
            # driver's thread, though the task ends cancelled): once the operation is done,
            # whatever it did anyway is undone.
            task.add_done_callback(lambda late: self._undo(late, undo))

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        self._abandoned.add(task)
        task.add_done_callback(self._forget)

    def _undo(
        self,
        late: asyncio.Future[T],
        undo: Callable[[asyncio.Future[T]], Awaitable[object] | None],
    ) -> None:
        follow = undo(late)
        if follow is not None:
            self._abandon(asyncio.ensure_future(follow))

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("an abandoned budget store call failed", exc_info=task.exception())

    async def reclaim(self) -> int:
        """Settle the reservations of dead workers now (see ``on_expiry``); return how many."""
        return await self._reclaim()

    async def _reclaim(self, outcome: str | None = None) -> int:
        self._last_reclaim = time.monotonic()
        return await self._call("reclaim", self.store.reclaim(), outcome=outcome)

    async def _reclaim_if_due(self, every_s: float) -> int:
        if time.monotonic() - self._last_reclaim < every_s:
            return 0
        return await self._reclaim(_REFUSED)  # a sweep before a reservation

    # -- the three operations of a call ----------------------------------------------------

    async def reserve(
        self,
        *,
        user_id: str | None,
        model: str,
        max_tokens: int,
        messages: Sequence[Message] = (),
        input_tokens: int | None = None,
        provider: str | None = None,
        run_id: str | None = None,
    ) -> Ticket:
        """Reserve the most a model call can spend, or refuse it.

        ``run_id`` names the run the call belongs to in the stored hold (``loomflow budget
        holds`` shows it).

        Raises:
            BudgetExceededError: a cap would be crossed.
            BudgetUnavailableError: the store failed (the call must not go ahead).
            UnknownModelPriceError: the model has no price and a cost cap needs one.
            InvalidUsageError: a count is negative, NaN or absurd.
        """
        price, amount = self.size(
            model=model,
            max_tokens=max_tokens,
            messages=messages,
            input_tokens=input_tokens,
            provider=provider,
        )
        return await self.reserve_amount(
            user_id=user_id,
            model=model,
            price=price,
            amount=amount,
            provider=provider,
            run_id=run_id,
        )

    async def reserve_amount(
        self,
        *,
        user_id: str | None,
        model: str,
        price: ModelPrice,
        amount: Amount,
        provider: str | None = None,
        run_id: str | None = None,
    ) -> Ticket:
        """Reserve an amount sized by :meth:`size` (see :meth:`reserve`)."""
        # Stored with the hold: a driver error on a bad id would read as the store being down.
        run = check_id("run_id", run_id or None)  # a RunInfo outside a run says ""
        buckets, limits = self._plan(user_id, self._clock())
        reservation = Reservation(
            str(ULID()), current_owner(), buckets, amount, self.on_expiry, run
        )
        if not limits:
            # No cap watches these buckets, so there is nothing to hold against: skip the
            # reservation round trip (1.2-1.7 ms a call with its commit) and only record.
            return Ticket(
                reservation,
                (),
                user_id,
                model,
                price,
                time.monotonic(),
                held=False,
                provider=provider,
            )
        # Dead workers' holds are swept now and then, and again before a refusal (a released
        # hold frees room; a charged one at least turns into a definite figure).
        await self._reclaim_if_due(30.0)

        def give_back(late: asyncio.Future[Denial | None]) -> Awaitable[bool] | None:
            # A hold written after the call was refused for want of an answer: no one would
            # renew or settle it, and once its lease ran out it was charged in full. Unless
            # the store answered with a refusal, it may be there (given back by id: a no-op
            # when it is not).
            refused = not late.cancelled() and late.exception() is None and late.result()
            return None if refused else self.store.release(reservation)

        denial = await self._call(
            "reservation",
            self.store.reserve(reservation, limits, hard=self.hard, lease_s=self.lease_s),
            outcome=_REFUSED,
            undo=give_back,
        )
        if denial is not None and await self._reclaim_if_due(1.0):
            denial = await self._call(
                "reservation",
                self.store.reserve(reservation, limits, hard=self.hard, lease_s=self.lease_s),
                outcome=_REFUSED,
                undo=give_back,
            )
        if denial is not None:
            raise BudgetExceededError(
                denial.cap, denial.limit, denial.used, denial.reserved, denial.requested
            )
        return Ticket(
            reservation, tuple(limits), user_id, model, price, time.monotonic(), provider=provider
        )

    async def commit(
        self,
        ticket: Ticket,
        usage: Usage,
        *,
        model: str | None = None,
        wall_s: float | None = None,
        usage_reported: bool = True,
    ) -> list[BudgetWarning]:
        """Charge what the call really spent; return the warnings it triggered.

        A usage that fails validation is not trusted: the whole reservation is charged
        instead (the most the call could have spent), then :class:`InvalidUsageError` raises.
        A call whose provider reported no usage (``usage_reported=False``, see
        :attr:`ModelResponse.usage_reported`) is charged its whole reservation too, rather
        than the zeros it came with; the run goes on.
        """
        elapsed = time.monotonic() - ticket.started if wall_s is None else wall_s
        if not usage_reported:
            _warn_unreported(model or ticket.model)
            return self._warnings(ticket.limits, await self.charge_in_full(ticket, wall_s=elapsed))
        try:
            actual = self.actual(ticket, usage, model=model, wall_s=elapsed)
        except InvalidUsageError:
            await self.charge_in_full(ticket, wall_s=elapsed)
            raise
        held = ticket.amount
        if actual.tokens_in > held.tokens_in or actual.tokens_out > held.tokens_out:
            log.warning(
                "model %r spent %d/%d tokens (in/out), more than the %d/%d reserved; raise "
                "overhead_tokens or fix estimate_input_tokens",
                model or ticket.model,
                actual.tokens_in,
                actual.tokens_out,
                held.tokens_in,
                held.tokens_out,
            )
        elif actual.cost_nanousd > held.cost_nanousd:
            # The tokens fit, but the call was priced as a dearer model than the one asked for
            # (the response named it): a hard cost cap can be passed, as with tokens above.
            log.warning(
                "model %r cost $%.9f, more than the $%.9f reserved for %r: the call is priced "
                "as the model the response named",
                model,
                usd(actual.cost_nanousd),
                usd(held.cost_nanousd),
                ticket.model,
            )
        result = await self.charge(ticket, actual)
        return self._warnings(ticket.limits, result)

    async def charge_in_full(self, ticket: Ticket, *, wall_s: float | None = None) -> CommitResult:
        """Charge the whole reservation: the most the call could have spent, for a call that
        was made but whose usage is unknown or not trusted."""
        elapsed = time.monotonic() - ticket.started if wall_s is None else wall_s
        held = ticket.amount
        worst = Amount(held.tokens_in, held.tokens_out, held.cost_nanousd, _clip(elapsed))
        return await self.charge(ticket, worst)

    async def charge(self, ticket: Ticket, amount: Amount) -> CommitResult:
        """Charge ``amount`` for the ticket's call as it stands (no checks or warnings)."""
        if not ticket.held:
            recording = self.store.record(ticket.reservation.buckets, amount)
            return await self._call("commit", recording, outcome=_UNRECORDED)
        return await self._call(
            "commit", self.store.commit(ticket.reservation, amount), outcome=_UNRECORDED
        )

    async def release(self, ticket: Ticket) -> bool:
        """Give a reservation back uncharged (the call failed before spending)."""
        if not ticket.held:
            return True
        return await self._call(
            "release",
            self.store.release(ticket.reservation),
            outcome="the hold stays until its lease runs out, then is settled as a dead worker's",
        )

    def _warnings(self, limits: Sequence[BucketLimit], result: CommitResult) -> list[BudgetWarning]:
        warnings: list[BudgetWarning] = []
        for limit in limits:
            after = result.totals.get(limit.bucket)
            if after is None or limit.limit <= 0:
                continue
            crossed = _crossed(
                self.warn_at,
                limit.limit,
                after.minus(result.charged).used(limit.metric),
                after.used(limit.metric),
            )
            if crossed:
                used = after.used(limit.metric)
                warnings.append(
                    BudgetWarning(
                        cap=limit.cap, limit=limit.limit, used=used, fraction=used / limit.limit
                    )
                )
        return warnings

    # -- reports ---------------------------------------------------------------------------

    async def status(self, user_id: str | None) -> list[CapStatus]:
        """Where each user and global cap stands for ``user_id`` in the current periods."""
        buckets, limits = self._plan(user_id, self._clock())
        period = {b.key: b.period for b in buckets}
        totals = await self._call("read", self.store.totals([b.key for b in buckets]))
        out = []
        for limit in limits:
            t = totals.get(limit.bucket, Totals())
            used, held = t.used(limit.metric), t.reserved(limit.metric)
            out.append(
                CapStatus(
                    cap=limit.cap,
                    limit=limit.limit,
                    used=used,
                    reserved=held,
                    remaining=max(0.0, limit.limit - used - held),
                    fraction=used / limit.limit if limit.limit else 1.0,
                    period=period[limit.bucket] or "all time",
                )
            )
        return out

    async def close(self) -> None:
        """Close the store."""
        await self.store.close()


# Models already warned about (see _warn_unreported).
_unreported: set[str] = set()

# What a model in no price table costs a budget without a cost cap.
_UNPRICED = ModelPrice(0.0, 0.0)


def _warn_unreported(model: str) -> None:
    if model not in _unreported:
        _unreported.add(model)
        log.warning(
            "model %r reported no token usage for a call, so the budget charges the call's "
            "whole reservation (the most it could have spent) instead of trusting 0",
            model,
        )


def _real(value: object) -> float | None:
    """``value`` as a finite float; ``None`` for a bool, text, NaN, an infinity or an int too
    large for a float (which ``math.isfinite`` would raise ``OverflowError`` on)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _clip(seconds: float) -> float:
    return min(max(seconds, 0.0), 86400.0) if math.isfinite(seconds) else 0.0


def _crossed(thresholds: Sequence[float], limit: float, before: float, after: float) -> bool:
    return any(before < t * limit <= after for t in thresholds)


# -- the agent's hooks ---------------------------------------------------------------------


@dataclass(slots=True)
class _RunState:
    started: float
    tokens_in: int = 0
    tokens_out: int = 0
    cost_nanousd: int = 0
    tickets: dict[str, tuple[Ticket, asyncio.Task[None] | None]] = field(default_factory=dict)
    # The answers of live calls not yet journaled, by reservation id, with their wall time:
    # what a hold the loop never settled is charged if the journal write then fails.
    answered: dict[str, tuple[ModelResponse, float]] = field(default_factory=dict)

    def totals(self) -> Totals:
        """The run's figures as a bucket's: its wall clock is the time since it started."""
        held = [t.amount for t, _ in self.tickets.values()]
        return Totals(
            self.tokens_in,
            self.tokens_out,
            self.cost_nanousd,
            time.monotonic() - self.started,
            reserved_in=sum(a.tokens_in for a in held),
            reserved_out=sum(a.tokens_out for a in held),
            reserved_cost_nanousd=sum(a.cost_nanousd for a in held),
        )

    def add(self, amount: Amount) -> None:
        self.tokens_in += amount.tokens_in
        self.tokens_out += amount.tokens_out
        self.cost_nanousd += amount.cost_nanousd


class BudgetHooks(RunHooks):
    """Plugs a :class:`StandardBudget` into the agent loop (see the module docstring)."""

    def __init__(self, budget: StandardBudget) -> None:
        self.budget = budget
        self._runs: dict[str, _RunState] = {}
        self._run_caps = tuple(
            BucketLimit("run", c.name, c.metric, c.limit) for c in budget.caps if c.scope == "run"
        )

    def _state(self, info: RunInfo) -> _RunState:
        state = self._runs.get(info.run_id)
        if state is None:
            state = self._runs[info.run_id] = _RunState(time.monotonic())
        return state

    async def run_started(self, info: RunInfo) -> None:
        self._state(info)

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        budget = self.budget
        state = self._state(info)
        price, amount = budget.size(
            model=info.model_name,
            max_tokens=settings.max_tokens,
            messages=messages,
            provider=info.provider,
        )
        if self._run_caps:
            # Judged as a store judges its buckets: cost in nano-USD, where floats would
            # refuse a call that fits exactly (0.1 + 0.2 > 0.3).
            denial = evaluate({"run": state.totals()}, self._run_caps, amount, hard=budget.hard)
            if denial is not None:
                exceeded = BudgetExceededError(
                    denial.cap, denial.limit, denial.used, denial.reserved, denial.requested
                )
                self._deny(info, exceeded)
        try:
            ticket = await budget.reserve_amount(
                user_id=info.user_id,
                model=info.model_name,
                price=price,
                amount=amount,
                provider=info.provider,
                run_id=info.run_id,
            )
        except BudgetExceededError as exc:
            self._deny(info, exc)
        except BudgetUnavailableError as exc:
            info.emit(BudgetUnavailable(detail=str(exc)))
            raise
        renewal = (
            asyncio.create_task(self._renew(ticket), name="loomflow-budget-lease")
            if ticket.held
            else None
        )
        state.tickets[ticket.reservation.id] = (ticket, renewal)
        return ticket

    def _deny(self, info: RunInfo, exc: BudgetExceededError) -> NoReturn:
        info.emit(
            BudgetDenied(
                cap=exc.cap,
                limit=exc.limit,
                used=exc.used,
                requested=exc.requested,
                reserved=exc.reserved,
            )
        )
        raise Interrupt(f"budget:{exc.cap}", str(exc)) from None

    async def _renew(self, ticket: Ticket) -> None:
        budget = self.budget
        while True:
            await asyncio.sleep(budget.lease_s / 3)
            try:
                async with asyncio.timeout(budget.store_timeout_s):
                    answer = await budget.store.renew(ticket.reservation.id, budget.lease_s)
                # Anything but a bool is a failed renewal, not "reclaimed": read as False, a
                # broken store's None ended the renewals and let a live call's hold lapse.
                if not yes_or_no(answer, budget.store, "budget", "renew", "the hold was kept"):
                    return  # reclaimed: the commit will charge only what exceeds it
            except Exception as exc:  # the next attempt may succeed; the lease has slack
                raise_if_cancelled()  # the call ended while the renewal timed out
                log.warning("renewing budget reservation %s failed: %s", ticket.reservation.id, exc)

    def _take(self, info: RunInfo, token: Any) -> Ticket | None:
        if not isinstance(token, Ticket):
            return None
        state = self._runs.get(info.run_id)
        entry = state.tickets.pop(token.reservation.id, None) if state else None
        if entry is not None and entry[1] is not None:
            entry[1].cancel()
        return token

    async def model_call_finished(
        self, info: RunInfo, turn: int, response: ModelResponse, *, token: Any
    ) -> None:
        state = self._runs.get(info.run_id)
        if isinstance(token, Ticket) and state is not None:
            state.answered[token.reservation.id] = (response, time.monotonic() - token.started)

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        state = self._state(info)
        if isinstance(token, Ticket):
            state.answered.pop(token.reservation.id, None)
        ticket = None if replayed else self._take(info, token)
        if ticket is None:
            # A replayed call is never charged, but it is part of this run's own usage.
            state.add(self._replayed(info, response))
            return
        try:
            warnings = await self.budget.commit(
                ticket,
                response.usage,
                model=response.model,
                usage_reported=response.usage_reported,
            )
        except BudgetUnavailableError as exc:
            info.emit(BudgetUnavailable(detail=str(exc)))
            raise
        before = (state.tokens_in, state.tokens_out, state.cost_nanousd)
        if response.usage_reported:
            state.add(self.budget.actual(ticket, response.usage, model=response.model, wall_s=0.0))
        else:
            state.add(ticket.amount)  # what commit charged: the run's caps count it too
        for warning in warnings:
            info.emit(warning)
        self._run_warnings(info, state, before)

    def _replayed(self, info: RunInfo, response: ModelResponse) -> Amount:
        """What a replayed call adds to the run's figures: what it added when it ran."""
        usage = response.usage
        budget = self.budget
        request = info._replayed_request
        try:
            if not response.usage_reported and request is not None:
                # Live, the call counted its whole reservation (see commit): sized again
                # from the same messages and settings, it is the same amount.
                messages, settings = request
                asked = price_for(info.model_name, provider=info.provider, prices=budget.prices)
                return budget._most(asked or _UNPRICED, settings.max_tokens, messages)
            price = price_for(
                info.model_name,
                provider=info.provider,
                prices=budget.prices,
                reported=response.model,
            )
            if price is None:  # live, the call was priced at 0 (no cost cap) or refused
                price = _UNPRICED
            return Amount(
                usage.input_tokens,
                usage.output_tokens,
                _usage_cost(price, usage, usage.input_tokens, usage.output_tokens),
            )
        except InvalidUsageError:
            return Amount()

    def _run_warnings(self, info: RunInfo, state: _RunState, before: tuple[int, int, int]) -> None:
        previous = Totals(*before)
        for cap in self._run_caps:
            if cap.metric == "wall_clock_s" or cap.limit <= 0:
                continue
            after = state.totals().used(cap.metric)
            if _crossed(self.budget.warn_at, cap.limit, previous.used(cap.metric), after):
                info.emit(
                    BudgetWarning(
                        cap=cap.cap, limit=cap.limit, used=after, fraction=after / cap.limit
                    )
                )

    async def model_call_failed(
        self, info: RunInfo, turn: int, error: BaseException, token: Any
    ) -> None:
        ticket = self._take(info, token)
        if ticket is None:
            return
        if isinstance(error, UntrustedUsageError):
            # The model answered (and billed) but reported a usage that cannot be true: the
            # whole reservation is charged, as commit does for any usage it does not trust (if
            # the store fails, the hold is settled when its lease runs out).
            await self.budget.charge_in_full(ticket)
            return
        try:
            await self.budget.release(ticket)
        except Exception as exc:
            # The hold stays until its lease runs out; it is then charged, never lost.
            log.warning("releasing budget reservation %s failed: %s", ticket.reservation.id, exc)

    async def run_finished(
        self, info: RunInfo, result: Any | None, error: BaseException | None
    ) -> None:
        state = self._runs.pop(info.run_id, None)
        if state is None:
            return
        for ticket, renewal in state.tickets.values():
            if renewal is not None:
                renewal.cancel()
            # A hold the loop never settled. When its answer came, the call was made and
            # billed: it is charged what the answer says it spent, as the audit trail records
            # it, whether the run raised (the journal write failed after the stream ended:
            # the store is down, or another owner took the run over) or returned (a guardrail
            # before the budget stopped the run on the answer). Without an answer, a run that
            # returned never made the call (a later hook refused it) and one that raised may
            # have made it: charged in full.
            answered = state.answered.get(ticket.reservation.id)
            try:
                if answered is not None:
                    response, wall_s = answered
                    await self.budget.commit(
                        ticket,
                        response.usage,
                        model=response.model,
                        wall_s=wall_s,
                        usage_reported=response.usage_reported,
                    )
                elif error is None:
                    await self.budget.release(ticket)
                else:
                    await self.budget.charge(ticket, ticket.amount)
            except Exception as exc:
                log.warning("settling budget reservation %s failed: %s", ticket.reservation.id, exc)

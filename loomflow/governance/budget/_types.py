"""Values the budget and its stores exchange: caps, amounts, buckets and running totals.

Amounts are stored in integer units so that sums are exact and a hard cap compares exactly:
tokens as integers, cost in nano-US-dollars (10^-9 USD; the cheapest listed price, 0.05 USD per
million tokens, is 50 nano-USD a token), model-call time in float seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

from ..._ids import check_id
from ...errors import InvalidArgumentError, InvalidUsageError, UserError
from ...messages import MAX_TOKENS_PER_CALL

__all__ = [
    "Amount",
    "Bucket",
    "BucketLimit",
    "BucketUsage",
    "Cap",
    "CommitResult",
    "Denial",
    "MAX_COST_NANOUSD_PER_CALL",
    "MAX_SECONDS_PER_CALL",
    "MAX_TOKENS_PER_CALL",
    "Metric",
    "OnExpiry",
    "Reservation",
    "ReservationInfo",
    "Totals",
    "UnreadableBucket",
    "Window",
    "evaluate",
    "late_charge",
    "lease_seconds",
    "nanousd",
    "sweep_limit",
    "usd",
]

Metric: TypeAlias = Literal["tokens_in", "tokens_out", "tokens_total", "cost_usd", "wall_clock_s"]
CapScope: TypeAlias = Literal["user", "global", "run"]
Window: TypeAlias = Literal["day", "month"]
OnExpiry: TypeAlias = Literal["charge", "release"]

_METRICS = frozenset(get_args(Metric))
_SCOPES = frozenset(get_args(CapScope))
_WINDOWS = frozenset(get_args(Window))
_WINDOW_SUFFIX = {"day": "daily", "month": "monthly"}

MAX_COST_NANOUSD_PER_CALL = 10**14
"""100 000 USD: no single model call costs more; a larger figure is a pricing bug."""
MAX_SECONDS_PER_CALL = 7 * 86400.0
"""A week: longer than any model call can take."""
# Caps may be far larger than one call, but must stay in the range BIGINT columns hold.
_MAX_LIMIT = 1e15


def nanousd(usd_value: float) -> int:
    """USD as integer nano-USD (rounded to the nearest unit)."""
    return round(usd_value * 1e9)


def usd(nano: int) -> float:
    """Integer nano-USD as USD."""
    return nano / 1e9


def lease_seconds(value: object) -> float:
    """A store's ``lease_s``: a finite, positive number of seconds.

    Raises:
        InvalidArgumentError: anything else; NaN or an infinity would store an expiry no
            clock reaches, so the hold would be swept at once (or, before, never).
    """
    try:
        number = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:  # an int too large for a float
        number = math.inf
    if isinstance(value, bool) or not 0 < number < math.inf:
        raise InvalidArgumentError(f"lease_s must be a positive number of seconds, not {value!r}")
    return number


def sweep_limit(value: object) -> int:
    """A reclaim's ``limit``: a positive integer (one beyond BIGINT is no limit at all).

    Raises:
        InvalidArgumentError: anything else; SQL reads a negative LIMIT as none (SQLite) or
            an error (PostgreSQL), a slice as all but the last.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"limit must be a positive integer, not {value!r}")
    return min(value, 2**62)


def _count(what: str, value: object, limit: int) -> int:
    # bool is an int subclass, and True tokens is always a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidUsageError(f"{what} must be an integer, not {value!r}")
    if value < 0:
        raise InvalidUsageError(f"{what} must not be negative, got {value}")
    if value > limit:
        raise InvalidUsageError(f"{what} of {value} is implausibly large (over {limit})")
    return value


def _seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidUsageError(f"{what} must be a number of seconds, not {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise InvalidUsageError(f"{what} must be a finite, non-negative number, got {value!r}")
    if number > MAX_SECONDS_PER_CALL:
        raise InvalidUsageError(f"{what} of {number:g} s is implausibly large")
    return number


@dataclass(frozen=True, slots=True)
class Cap:
    """One spending cap.

    Args:
        metric: ``tokens_in``, ``tokens_out``, ``tokens_total``, ``cost_usd`` or
            ``wall_clock_s``.
        limit: The most that may be spent (tokens, USD or seconds). ``0`` refuses every call.
        scope: ``user`` (each user on their own), ``global`` (all users together) or ``run``
            (one agent run, kept in memory).
        window: ``day`` or ``month`` (UTC calendar periods) for a cap that starts afresh each
            period; ``None`` for a cap over all time. Not for ``run`` caps.

    ``wall_clock_s`` counts the seconds of live model calls for ``user`` and ``global`` caps,
    and the time since the run started for ``run`` caps. Its check happens before each call
    (a call that starts under the limit may finish above it).

    Example:
        >>> Cap("cost_usd", 5.0, window="day").name
        'user.cost_usd.daily'
    """

    metric: Metric
    limit: float
    scope: CapScope = "user"
    window: Window | None = None

    def __post_init__(self) -> None:
        if self.metric not in _METRICS:
            raise UserError(f"unknown cap metric {self.metric!r}; use one of {sorted(_METRICS)}")
        if self.scope not in _SCOPES:
            raise UserError(f"unknown cap scope {self.scope!r}; use one of {sorted(_SCOPES)}")
        if self.window is not None and self.window not in _WINDOWS:
            raise UserError(f"unknown cap window {self.window!r}; use 'day', 'month' or None")
        if self.scope == "run" and self.window is not None:
            raise UserError("a run cap has no window: a run is its own period")
        limit = self.limit
        if isinstance(limit, bool) or not isinstance(limit, int | float):
            raise InvalidUsageError(f"cap {self.name}: the limit must be a number, not {limit!r}")
        # Compared, not passed to math.isfinite: an int too large for a float would raise
        # OverflowError there; NaN fails every comparison.
        if not 0 <= limit <= _MAX_LIMIT:
            raise InvalidUsageError(
                f"cap {self.name}: the limit must be finite, non-negative and at most "
                f"{_MAX_LIMIT:g}, got {limit!r}"
            )

    @property
    def name(self) -> str:
        """``<scope>.<metric>[.daily|.monthly]``: the name in ``budget:<cap>`` reasons."""
        base = f"{self.scope}.{self.metric}"
        return f"{base}.{_WINDOW_SUFFIX[self.window]}" if self.window else base


@dataclass(frozen=True, slots=True)
class Amount:
    """What one model call reserves or spends. Every field is validated on construction.

    Raises:
        InvalidUsageError: for a negative, NaN, non-integer or implausibly large figure.
    """

    tokens_in: int = 0
    tokens_out: int = 0
    cost_nanousd: int = 0
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        _count("input tokens", self.tokens_in, MAX_TOKENS_PER_CALL)
        _count("output tokens", self.tokens_out, MAX_TOKENS_PER_CALL)
        _count("cost (nano-USD)", self.cost_nanousd, MAX_COST_NANOUSD_PER_CALL)
        object.__setattr__(self, "wall_s", _seconds("model-call time", self.wall_s))

    def value(self, metric: Metric) -> float:
        """This amount measured in a cap's unit (USD for ``cost_usd``)."""
        return _measure(metric, self.tokens_in, self.tokens_out, self.cost_nanousd, self.wall_s)

    def exceeding(self, other: Amount) -> Amount:
        """The part of this amount above ``other``, field by field."""
        return Amount(
            max(0, self.tokens_in - other.tokens_in),
            max(0, self.tokens_out - other.tokens_out),
            max(0, self.cost_nanousd - other.cost_nanousd),
            max(0.0, self.wall_s - other.wall_s),
        )


def _measure(metric: Metric, tin: int, tout: int, cost: int, wall: float) -> float:
    if metric == "tokens_in":
        return tin
    if metric == "tokens_out":
        return tout
    if metric == "tokens_total":
        return tin + tout
    if metric == "cost_usd":
        return usd(cost)
    return wall


@dataclass(frozen=True, slots=True)
class Totals:
    """The running totals of one bucket: spent, and held by calls in flight."""

    tokens_in: int = 0
    tokens_out: int = 0
    cost_nanousd: int = 0
    wall_s: float = 0.0
    calls: int = 0
    reserved_in: int = 0
    reserved_out: int = 0
    reserved_cost_nanousd: int = 0

    def used(self, metric: Metric) -> float:
        """Spent so far, in the metric's unit."""
        return _measure(metric, self.tokens_in, self.tokens_out, self.cost_nanousd, self.wall_s)

    def reserved(self, metric: Metric) -> float:
        """Held by calls in flight, in the metric's unit (time is never reserved)."""
        return _measure(
            metric, self.reserved_in, self.reserved_out, self.reserved_cost_nanousd, 0.0
        )

    def minus(self, spent: Amount) -> Totals:
        """The totals before ``spent`` was added (reservations unchanged)."""
        return Totals(
            self.tokens_in - spent.tokens_in,
            self.tokens_out - spent.tokens_out,
            self.cost_nanousd - spent.cost_nanousd,
            self.wall_s - spent.wall_s,
            self.calls,
            self.reserved_in,
            self.reserved_out,
            self.reserved_cost_nanousd,
        )


@dataclass(frozen=True, slots=True)
class Bucket:
    """A set of totals: one user's or everyone's, over all time or one calendar period.

    ``period`` is ``""`` (all time), ``"day:2026-05-08"`` or ``"month:2026-05"`` (UTC).
    """

    scope: Literal["user", "global"]
    user_id: str | None
    period: str = ""
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        check_id("user_id", self.user_id)  # the same id rule as every other store
        # A JSON array is injective: no user id, however spelled, makes another bucket's key.
        key = json.dumps([self.scope, self.user_id, self.period], separators=(",", ":"))
        object.__setattr__(self, "key", key)

    @classmethod
    def for_window(
        cls,
        scope: Literal["user", "global"],
        user_id: str | None,
        window: Window | None,
        now: float,
    ) -> Bucket:
        """The bucket of ``window`` that contains the Unix time ``now``."""
        who = user_id if scope == "user" else None
        if window is None:
            return cls(scope, who, "")
        day = dt.datetime.fromtimestamp(now, dt.UTC)
        period = f"day:{day:%Y-%m-%d}" if window == "day" else f"month:{day:%Y-%m}"
        return cls(scope, who, period)

    @classmethod
    def from_key(cls, key: str) -> Bucket:
        """The bucket a stored key names.

        Raises:
            InvalidArgumentError: the key is no bucket key (a row edited by hand, or
                damaged): not JSON, not ``[scope, user_id, period]``, or holding values no
                bucket has.
        """
        try:
            parts = json.loads(key)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidArgumentError(f"bucket key {str(key)[:80]!r} is not JSON: {exc}") from None
        if not isinstance(parts, list) or len(parts) != 3:
            raise InvalidArgumentError(
                f"bucket key {str(key)[:80]!r} is not a [scope, user_id, period] list"
            )
        scope, user_id, period = parts
        if (
            scope not in ("user", "global")
            or (scope == "global" and user_id is not None)
            or not _is_period(period)
        ):
            # Settled into a row of its own, such a key would make a bucket no budget has: a
            # global one keeping a user's id through their erasure, a period no prune ends.
            raise InvalidArgumentError(f"bucket key {str(key)[:80]!r} names no bucket")
        return cls(scope, user_id, period)  # check_id refuses a user id no store accepts


def _is_period(period: object) -> bool:
    """Whether ``period`` is one :meth:`Bucket.for_window` makes: ``""``, or a day or a month
    written as it writes them."""
    if period == "":
        return True
    if not isinstance(period, str):
        return False
    kind, _, date = period.partition(":")
    form = {"day": "%Y-%m-%d", "month": "%Y-%m"}.get(kind)
    try:
        return form is not None and dt.datetime.strptime(date, form).strftime(form) == date
    except ValueError:
        return False


def ended_periods(cutoff: float) -> tuple[str, str]:
    """Upper bounds (exclusive) of the day and month periods that ended by ``cutoff``.

    Period names sort by time, so ``"day:" <= period < days`` selects every day bucket that
    ended at or before the Unix time ``cutoff`` (likewise for months).
    """
    try:
        when = dt.datetime.fromtimestamp(cutoff, dt.UTC)
    except (OverflowError, ValueError, OSError):  # inf, NaN, or before year 1
        raise InvalidArgumentError(f"{cutoff!r} is out of range as a Unix time") from None
    return f"day:{when:%Y-%m-%d}", f"month:{when:%Y-%m}"


def period_ended(period: str, cutoff: float) -> bool:
    """Whether a windowed bucket's ``period`` ended by ``cutoff`` (all-time ones never do)."""
    days, months = ended_periods(cutoff)
    if period.startswith("day:"):
        return period < days
    return period.startswith("month:") and period < months


@dataclass(frozen=True, slots=True)
class BucketLimit:
    """A cap applied to one bucket, as a store evaluates it."""

    bucket: str  # Bucket.key
    cap: str  # Cap.name
    metric: Metric
    limit: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """Capacity held for one model call in flight, until it is committed or released.

    ``on_expiry`` says what a reclaim does if the owner dies first: ``charge`` the held
    amount as spent (the call may have been billed), or ``release`` it. ``run_id`` names the
    agent run the call belongs to (``None`` for a call made outside one).
    """

    id: str
    owner: str
    buckets: tuple[Bucket, ...]
    amount: Amount
    on_expiry: OnExpiry = "charge"
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.on_expiry not in ("charge", "release"):
            raise UserError(f"on_expiry must be 'charge' or 'release', not {self.on_expiry!r}")


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a reservation was refused (figures in the cap's unit)."""

    cap: str
    limit: float
    used: float
    reserved: float
    requested: float


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit charged, and each bucket's totals afterwards."""

    charged: Amount
    totals: Mapping[str, Totals]
    reservation_found: bool


@dataclass(frozen=True, slots=True)
class BucketUsage:
    """One bucket's totals, for reports and the CLI."""

    bucket: Bucket
    totals: Totals
    updated_at: float


@dataclass(frozen=True, slots=True)
class UnreadableBucket:
    """A stored bucket that cannot be read back, as listings and exports show it.

    A row edited by hand or damaged (a key that is no bucket key, a negative or non-finite
    total, text where a number belongs) counts for nothing in a report: it is shown with
    what its row still tells, instead of failing the report or being read as wrong figures.
    A model call whose cap watches such a row is refused (the budget fails closed).

    Attributes:
        key: The row's bucket key, as stored (its ``repr`` when it is not text).
        scope: The row's ``scope`` column, as far as it reads.
        user_id: The row's ``user_id`` column, as far as it reads.
        period: The row's ``period`` column, as far as it reads.
        unreadable: Why it cannot be read back.
    """

    key: str
    scope: str | None
    user_id: str | None
    period: str | None
    unreadable: str


@dataclass(frozen=True, slots=True)
class ReservationInfo:
    """A reservation held in the store, for operators.

    ``run_id`` is the run whose model call holds it; ``None`` when that is unknown (a hold
    stored before reservations named their run, or made outside a run).
    """

    id: str
    owner: str
    buckets: tuple[Bucket, ...]
    amount: Amount
    on_expiry: OnExpiry
    created_at: float
    expires_at: float
    run_id: str | None = None


def evaluate(
    before: Mapping[str, Totals],
    limits: Sequence[BucketLimit],
    requested: Amount,
    *,
    hard: bool,
) -> Denial | None:
    """Decide a reservation against the totals it found (shared by every store).

    Hard mode refuses a call when spent + held + this call's reservation would pass a limit,
    so N concurrent calls can never overshoot it together. Soft mode refuses only once spent +
    held has reached the limit. Time is not reserved: a time cap refuses once it is reached.
    """
    for limit in limits:
        totals = before.get(limit.bucket, Totals())
        used = totals.used(limit.metric)
        held = totals.reserved(limit.metric)
        if limit.metric == "wall_clock_s":
            asked = 0.0
            over = used >= limit.limit
        else:
            asked = requested.value(limit.metric)
            over = used + held + asked > limit.limit if hard else used + held >= limit.limit
        if limit.metric == "cost_usd":
            # Compare in integer nano-USD so a cap of exactly the spend is not lost to floats
            # (spent and held summed in USD can fall a rounding short of the cap they reach).
            taken = totals.cost_nanousd + totals.reserved_cost_nanousd
            cap = nanousd(limit.limit)
            over = taken + requested.cost_nanousd > cap if hard else taken >= cap
        if over:
            return Denial(limit.cap, limit.limit, used, held, asked)
    return None


def late_charge(reservation: Reservation, actual: Amount) -> Amount:
    """What a commit charges after its hold was reclaimed: a charged hold already counts the
    held amount, so only the excess is new; a released one counts nothing."""
    if reservation.on_expiry == "charge":
        return actual.exceeding(reservation.amount)
    return actual


def late_calls(reservation: Reservation) -> int:
    """The calls such a commit counts: a charged hold was counted as a call when it was
    reclaimed, a released one was not (its call would be missing from the totals)."""
    return 0 if reservation.on_expiry == "charge" else 1

"""Who may use the console: bearer tokens, the sign-in cookie, a trusted proxy header.

Two roles. A **reader** finds users, reads their trails, entries and runs' stories and
verifies the chain of the user shown. An **admin** may also export a trail (JSON lines and
heads), verify every user's chain at once and list the journal's runs by state.

Tokens are never kept in memory as given: each is held as its SHA-256, and a presented token
is hashed and compared with every known hash in constant time (``hmac.compare_digest``), so
neither the comparison nor the number of tokens compared tells an attacker how close a guess
came.

A sign-in through the form is a signed cookie, which on its own would stay good until it
expires whoever kept a copy; :class:`SignIns` holds the sign-ins this process handed out, so
that signing out ends one for every copy of its cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ConfigurationError

__all__ = [
    "ConsoleAccess",
    "Principal",
    "Role",
    "SignIns",
    "TokenEntry",
    "cookie_value",
    "load_tokens",
    "token_sha256",
]

# A header name as HTTP spells one (a "token": RFC 9110, section 5.1).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

Role = Literal["reader", "admin"]
ROLES: tuple[Role, ...] = ("reader", "admin")

_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
# Names end up in audit entries and pages: printable, no spaces, bounded.
_NAME = re.compile(r"[A-Za-z0-9._@+\-]{1,64}")
MIN_TOKEN_LENGTH = 16


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token as a tokens file may hold it (``sha256:<hex>``)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def cookie_value(entry: TokenEntry, key: bytes) -> str:
    """What the sign-in cookie holds for a token: a keyed hash of its hash.

    The cookie is signed, not encrypted: whoever holds it can read it. A plain SHA-256 of the
    token there would let them guess weak tokens offline; keyed with the session secret, it
    tells nothing without that key.
    """
    return hmac.new(key, entry.sha256.encode("ascii"), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Someone signed in: a name for the audit log and a role."""

    name: str
    role: Role
    via: Literal["token", "cookie", "proxy"]

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One known token, by its SHA-256."""

    role: Role
    sha256: str
    name: str


def load_tokens(path: Path) -> list[TokenEntry]:
    """Read a tokens file: one ``role token name`` per line, ``#`` starts a comment.

    ``role`` is ``reader`` or ``admin``; ``token`` is the token itself (16 characters or more)
    or, better, ``sha256:<hex>`` of it (``loomflow console --hash-token`` prints that); ``name``
    is who it belongs to, as the audit log will record it.

    Raises:
        ConfigurationError: the file cannot be read, or a line is malformed (the message
            gives its number, never the token).
    """
    try:
        # utf-8-sig: a byte order mark (some editors save one) is no part of the first role.
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ConfigurationError(f"cannot read tokens file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"tokens file {path} is not UTF-8 text") from exc
    entries: list[TokenEntry] = []
    names: set[str] = set()
    lines_of: dict[str, int] = {}  # a token's SHA-256 -> the line that gives it
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"tokens file {path}, line {number}"
        if len(parts) != 3:
            raise ConfigurationError(f"{where}: expected `role token name`")
        given, token, name = parts
        if given == "reader":
            role: Role = "reader"
        elif given == "admin":
            role = "admin"
        else:
            raise ConfigurationError(f"{where}: role must be reader or admin, not {given!r}")
        if not _NAME.fullmatch(name):
            raise ConfigurationError(
                f"{where}: a name is 1 to 64 letters, digits or ._@+- characters"
            )
        if name in names:
            raise ConfigurationError(f"{where}: the name {name!r} is given twice")
        names.add(name)
        if (found := _SHA256.fullmatch(token)) is not None:
            digest = found.group(1)
        elif token.startswith("sha256:"):
            raise ConfigurationError(f"{where}: sha256: takes 64 lowercase hex digits")
        elif len(token) < MIN_TOKEN_LENGTH:
            raise ConfigurationError(
                f"{where}: a token is {MIN_TOKEN_LENGTH} characters or more (or sha256:<hex>)"
            )
        else:
            digest = token_sha256(token)
        if digest in lines_of:
            # Whoever holds it would be signed in as one of the two names, with its role,
            # and the audit log would name that one for both.
            raise ConfigurationError(
                f"{where}: the same token as line {lines_of[digest]} (each name needs a token "
                "of its own)"
            )
        lines_of[digest] = number
        entries.append(TokenEntry(role, digest, name))
    if not entries:
        # An operator who names a tokens file means to sign in with it: an empty one (a
        # secret not mounted yet) is said as such, not as "the console needs a way in".
        raise ConfigurationError(f"tokens file {path} holds no `role token name` line")
    return entries


class ConsoleAccess:
    """The console's access rules.

    Args:
        tokens: Known tokens (from a tokens file and ``LOOMFLOW_CONSOLE_TOKEN``).
        proxy_header: Trust this request header (e.g. ``X-Forwarded-User``) to name the
            signed-in user; only set it behind a proxy that always sets or strips it.
        proxy_admins: Names the proxy header may carry that get the admin role (others read).
    """

    def __init__(
        self,
        tokens: Iterable[TokenEntry] = (),
        *,
        proxy_header: str | None = None,
        proxy_admins: Iterable[str] = (),
    ) -> None:
        self.tokens = list(tokens)
        if proxy_header is not None and not _HEADER_NAME.fullmatch(proxy_header):
            # No request can carry such a header: every proxy sign-in would be refused.
            raise ConfigurationError(
                f"--trust-proxy-header {proxy_header!r} is not an HTTP header name (letters, "
                "digits and !#$%&'*+-.^_`|~, e.g. X-Forwarded-User)"
            )
        self.proxy_header = proxy_header.lower() if proxy_header else None
        self.proxy_admins = frozenset(proxy_admins)
        # Either would be an admin who silently is not one: no header to carry the name, or a
        # name the header can never carry (from_proxy refuses it).
        if self.proxy_admins and self.proxy_header is None:
            raise ConfigurationError("--proxy-admin needs --trust-proxy-header")
        for name in sorted(self.proxy_admins):
            if not _NAME.fullmatch(name):
                raise ConfigurationError(
                    f"--proxy-admin {name!r}: a name is 1 to 64 letters, digits or ._@+- "
                    "characters, as the proxy header must carry it"
                )
        if not self.tokens and self.proxy_header is None:
            raise ConfigurationError(
                "the console needs a way in: set LOOMFLOW_CONSOLE_TOKEN, pass --tokens-file, "
                "or --trust-proxy-header behind a signing-in proxy"
            )

    def by_digest(self, digest: str) -> TokenEntry | None:
        """The entry whose SHA-256 is ``digest``; every entry is compared (constant time)."""
        found: TokenEntry | None = None
        for entry in self.tokens:
            if hmac.compare_digest(entry.sha256, digest):
                found = entry
        return found

    def by_cookie(self, value: str, key: bytes) -> TokenEntry | None:
        """The entry a sign-in cookie names (see :func:`cookie_value`), compared like tokens."""
        found: TokenEntry | None = None
        for entry in self.tokens:
            if hmac.compare_digest(cookie_value(entry, key), value):
                found = entry
        return found

    def by_token(self, token: str) -> TokenEntry | None:
        """The entry a presented token matches, if any (whitespace around it, as a paste into
        the sign-in form may bring, is no part of it: no token holds any)."""
        return self.by_digest(token_sha256(token.strip()))

    def from_proxy(self, value: str) -> Principal | None:
        """The user a trusted proxy named, if the value is a usable name."""
        name = value.strip()
        if not _NAME.fullmatch(name):
            return None
        return Principal(name, "admin" if name in self.proxy_admins else "reader", "proxy")


MAX_SIGN_INS = 10_000
"""How many sign-ins one console process keeps live at once (about 1 MB of ids); past it
the oldest is signed out to make room."""


class SignIns:
    """The sign-ins through the form that are live in this process.

    The cookie is signed, not stored: on its own it stays good until it expires, whoever
    kept a copy of it, and signing out could only ask the browser to forget it. So each
    sign-in gets a random id, carried in the cookie and kept here until it is signed out or
    expires; a cookie whose id is not here is signed out. The set lives in this process's
    memory only: a restart signs everyone out, and of several processes behind one address
    each knows only the sign-ins it made.

    Args:
        lifetime: Seconds a sign-in lasts (the cookie's ``Max-Age``).
        limit: At most this many live at once; a sign-in past it signs the oldest out, so a
            token holder signing in in a loop cannot grow the set without bound.
        clock: Monotonic seconds (a test's clock).
    """

    def __init__(
        self,
        lifetime: float,
        *,
        limit: int = MAX_SIGN_INS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lifetime = lifetime
        self.limit = limit
        self.clock = clock
        # id -> when it expires, oldest first: every sign-in lasts as long, so the front of
        # the order is also the first to expire.
        self._live: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def start(self) -> str:
        """A new sign-in's id (192 random bits), live from now."""
        now = self.clock()
        self._drop_expired(now)
        while len(self._live) >= self.limit:
            self._live.popitem(last=False)
        sign_in = secrets.token_urlsafe(24)
        self._live[sign_in] = now + self.lifetime
        return sign_in

    def live(self, sign_in: object) -> bool:
        """Whether a cookie's id names a sign-in that is neither signed out nor expired."""
        if not isinstance(sign_in, str):
            return False
        expires = self._live.get(sign_in)
        if expires is None:
            return False
        if expires <= self.clock():
            del self._live[sign_in]
            return False
        return True

    def end(self, sign_in: object) -> None:
        """Sign out: the id is live no more (an unknown one is ignored)."""
        if isinstance(sign_in, str):
            self._live.pop(sign_in, None)

    def _drop_expired(self, now: float) -> None:
        while self._live:
            oldest, expires = next(iter(self._live.items()))
            if expires > now:
                break
            del self._live[oldest]

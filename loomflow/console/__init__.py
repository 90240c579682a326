"""``loomflow console``: a read-only web view of per-user audit trails, runs and verification.

Built on Starlette (the ``console`` extra). Pages are rendered on the server; every page has
a JSON twin under ``/api/``. Nothing but ``/healthz`` and the sign-in form is served without
signing in (a bearer token, the sign-in cookie, or a trusted proxy header), and every query
is itself written to the audit log. See ``docs/console.md``.
"""

from __future__ import annotations

from ._access import ConsoleAccess, Principal, TokenEntry, load_tokens, token_sha256
from ._build import ConsoleOptions, build_console, serve
from ._data import (
    CONSOLE_ACTION,
    CONSOLE_REFUSED,
    CONSOLE_SIGNIN,
    CONSOLE_SIGNIN_FAILED,
    CONSOLE_SIGNOUT,
    SIGNIN_FAILURES_CHAIN,
    ConsoleData,
    SignInFailures,
    console_user_id,
)

__all__ = [
    "CONSOLE_ACTION",
    "CONSOLE_REFUSED",
    "CONSOLE_SIGNIN",
    "CONSOLE_SIGNIN_FAILED",
    "CONSOLE_SIGNOUT",
    "ConsoleAccess",
    "ConsoleData",
    "ConsoleOptions",
    "Principal",
    "SIGNIN_FAILURES_CHAIN",
    "SignInFailures",
    "TokenEntry",
    "build_console",
    "console_user_id",
    "load_tokens",
    "serve",
    "token_sha256",
]

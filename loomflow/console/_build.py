"""Building the console for a deployment: its stores, its access rules, its server."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Settings
from ..errors import ConfigurationError
from ..redaction import Redactor
from ..storage._url import sqlite_path
from ..stores import Stores
from ._access import MIN_TOKEN_LENGTH, ConsoleAccess, TokenEntry, load_tokens, token_sha256
from ._data import ConsoleData

__all__ = ["ConsoleOptions", "build_console", "serve"]


@dataclass
class ConsoleOptions:
    """How to open and guard one console (the ``loomflow console`` flags).

    Attributes:
        tokens_file: A file of ``role token name`` lines.
        proxy_header: A request header a signing-in proxy sets to the user's name.
        proxy_admins: Names that header may carry that get the admin role.
        audit_url: The audit log (default: ``audit_url``, else the journal's database).
        secure_cookie: Send the sign-in cookie over HTTPS only.
    """

    tokens_file: Path | None = None
    proxy_header: str | None = None
    proxy_admins: Sequence[str] = field(default_factory=tuple)
    audit_url: str | None = None
    secure_cookie: bool = False


_SETTING_NAME = "console-token"  # who LOOMFLOW_CONSOLE_TOKEN signs in, in the audit log


def _tokens(settings: Settings, options: ConsoleOptions) -> list[TokenEntry]:
    tokens = [] if options.tokens_file is None else load_tokens(options.tokens_file)
    if settings.console_token is not None:
        # Whitespace around it (the newline a secrets file ends with) is no part of a token:
        # a bearer or a typed token is read without it, and so is a tokens file.
        token = settings.console_token.get_secret_value().strip()
        if len(token) < MIN_TOKEN_LENGTH:
            raise ConfigurationError(
                f"LOOMFLOW_CONSOLE_TOKEN is {len(token)} characters without the whitespace "
                f"around it; a console token is {MIN_TOKEN_LENGTH} or more"
            )
        # The one token of a small deployment is its operator's: admin.
        digest = token_sha256(token)
        for entry in tokens:
            if entry.name == _SETTING_NAME:
                raise ConfigurationError(
                    f"the tokens file names someone {_SETTING_NAME!r}, the name "
                    "LOOMFLOW_CONSOLE_TOKEN is recorded under: their looks and the setting's "
                    "would share one chain"
                )
            if entry.sha256 == digest:
                raise ConfigurationError(
                    f"LOOMFLOW_CONSOLE_TOKEN is the token of {entry.name!r} in the tokens file: "
                    "give each a token of its own"
                )
        tokens.append(TokenEntry("admin", digest, _SETTING_NAME))
    return tokens


def _has_journal(settings: Settings) -> bool:
    """Whether the journal is there to read (a missing SQLite file is not made)."""
    path = sqlite_path(settings.runtime_url)
    return path is None or path == ":memory:" or Path(path).exists()


def build_console(settings: Settings, options: ConsoleOptions) -> tuple[Any, Stores]:
    """The ASGI application and the stores it reads (close them when done).

    The journal is opened without migrating (``auto_migrate`` off): the console reads it
    and must leave its schema as it found it. The audit log is written to (every query is
    recorded there), so it is opened as any writer opens it.

    Raises:
        ConfigurationError: no way to sign in, or a bad tokens file.
        ImportError: the ``console`` extra is not installed.
    """
    from ._app import create_app

    access = ConsoleAccess(
        _tokens(settings, options),
        proxy_header=options.proxy_header,
        proxy_admins=options.proxy_admins,
    )
    reading = settings.model_copy(update={"auto_migrate": False})
    stores = Stores(reading, journal=_has_journal(settings), audit_url=options.audit_url)
    secret = settings.console_session_secret
    app = create_app(
        ConsoleData(stores, Redactor.from_settings(settings)),
        access,
        session_secret=None if secret is None else secret.get_secret_value(),
        secure_cookie=options.secure_cookie,
    )
    return app, stores


async def serve(
    settings: Settings, options: ConsoleOptions, *, host: str = "127.0.0.1", port: int = 8470
) -> None:
    """Serve the console until interrupted, then close its stores."""
    try:
        import uvicorn
    except ImportError as exc:  # pragma: no cover - the extra is part of dev
        raise ImportError("the console needs its extra: pip install 'loomflow[console]'") from exc
    app, stores = build_console(settings, options)
    try:
        # Connected now, not on the first request: a database that is not there (a typo in
        # its name, a server that does not answer) is one line and exit 1, as for every other
        # command, rather than a console announced and then a 503 on every page.
        await stores.audit.open()
        listening = _listen(host, port)
        # Announced once it can be signed in to and is listening: a console with no way in,
        # or an address it cannot bind, fails before this with one line.
        print(f"loomflow console on http://{host}:{port}/ (Ctrl-C stops it)", file=sys.stderr)
        # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from any client on
        # 127.0.0.1 (the default bind) as the client's address, and the failed sign-ins the
        # audit log records would name whatever such a client wrote there.
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
        )
        await uvicorn.Server(config).serve(sockets=[listening])
    finally:
        await stores.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or a ConfigurationError naming why not (a host
    that does not resolve, a port in use, one below 1024 without the right)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigurationError(f"the console cannot listen on {host}:{port}: {why}") from None

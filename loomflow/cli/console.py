"""``loomflow console``: serve the compliance console (read-only, signed in, audited).

The journal is ``--url`` or ``LOOMFLOW_RUNTIME_URL``; the audit log ``--audit-url``, else
``LOOMFLOW_AUDIT_URL``, else the journal's database. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import Settings
from ._format import fixed_port, some_path
from ._stores import existing

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``console`` command to the CLI."""
    console = subparsers.add_parser(
        "console", help="serve the compliance console: audit trails, runs and verification"
    )
    console.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    console.add_argument("--port", type=fixed_port, default=8470, help="port (8470)")
    console.add_argument(
        "--audit-url",
        help="audit store URL (default: LOOMFLOW_AUDIT_URL, else the journal's database)",
    )
    console.add_argument(
        "--tokens-file",
        type=some_path,
        help="lines of `role token name` (role reader or admin; token as sha256:<hex>)",
    )
    console.add_argument(
        "--trust-proxy-header",
        metavar="NAME",
        help="take the signed-in user's name from this header (only behind a proxy that "
        "always sets it), e.g. X-Forwarded-User",
    )
    console.add_argument(
        "--proxy-admin",
        action="append",
        default=[],
        metavar="NAME",
        help="a user named by the proxy header who gets the admin role (repeatable)",
    )
    console.add_argument(
        "--secure-cookie", action="store_true", help="send the sign-in cookie over HTTPS only"
    )
    console.add_argument(
        "--hash-token",
        action="store_true",
        help="read a token on stdin, print the sha256:<hex> form for a tokens file, and exit",
    )
    console.set_defaults(handler=_handle)


async def _handle(args: argparse.Namespace) -> int:
    if args.hash_token:
        from ..console import token_sha256
        from ..console._access import MIN_TOKEN_LENGTH

        token = sys.stdin.readline().strip()
        if not token:
            print("loomflow: error: no token on stdin", file=sys.stderr)
            return 2
        if len(token) < MIN_TOKEN_LENGTH:
            # The console refuses a short plain token; its hash must not be a way around that.
            print(
                f"loomflow: error: the token is {len(token)} characters; a console token is "
                f"{MIN_TOKEN_LENGTH} or more (`python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'` makes one)",
                file=sys.stderr,
            )
            return 2
        print(f"sha256:{token_sha256(token)}")
        return 0
    settings = Settings()
    if args.url:
        settings = settings.model_copy(update={"runtime_url": args.url})
    existing(args.audit_url or settings.audit_store_url, "audit log")
    try:
        from ..console import ConsoleOptions, serve
    except ImportError as exc:
        raise ImportError("the console needs its extra: pip install 'loomflow[console]'") from exc
    options = ConsoleOptions(
        tokens_file=args.tokens_file,
        proxy_header=args.trust_proxy_header,
        proxy_admins=tuple(args.proxy_admin),
        audit_url=args.audit_url,
        secure_cookie=args.secure_cookie,
    )
    await serve(settings, options, host=args.host, port=args.port)
    return 0

"""The console's web application: Starlette routes, server-rendered pages, a JSON twin.

Every page ``/x`` has ``/api/x`` returning the same data as JSON for scripts. Pages carry no
script at all, and the Content-Security-Policy forbids any, so text from the audit log
(escaped by Jinja2 everywhere) could not run even if an escape were missed.

User ids are arbitrary text (slashes, ``..``, markup, any script): a trail's address is
``/users/<id>`` with the id percent-encoded as one path segment; an id that is only dots,
which browsers fold into the path, and the anonymous bucket use ``/trail?user=<id>`` and
``/trail?anonymous=1``. Every other page names its user in the query string.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .._ids import MAX_ID_BYTES, check_id, check_key
from .._printable import escaped_controls, escaped_surrogates, is_unicode, printable, shown_id
from .._timefmt import UNREADABLE_TIME, iso_time, parse_when
from ..audit import ANY_USER, AuditPage, ChainHead, ChainProblem
from ..audit._store import damaged_row, export_line
from ..errors import (
    AuditIntegrityError,
    InvalidArgumentError,
    LoomflowError,
    StorageError,
    UserError,
)
from ..runtime import RUN_STATES, SessionInfo
from ..runtime._states import UNREADABLE
from ._access import ConsoleAccess, Principal, Role, SignIns, cookie_value
from ._data import (
    CONSOLE_REFUSED,
    CONSOLE_SIGNIN,
    CONSOLE_SIGNOUT,
    ConsoleData,
    TrailFilter,
    names_no_user,
)

__all__ = ["create_app", "user_url"]

log = logging.getLogger("loomflow.console")

_SESSION_HOURS = 8
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
# A page of a trail (or of its export) holds 10 to 500 entries; the menu on the page offers
# the usual sizes, and the one asked for when it is another.
_PAGE_MIN, _PAGE_MAX = 10, 500
_PAGE_SIZES = (10, 25, 50, 100, 500)


class _JSON(JSONResponse):
    """A JSON answer that any UTF-8 reader, and a terminal it is printed on, takes as it is.

    Text read back from a hand-edited row may hold bytes that are not UTF-8 (read as lone
    surrogates, which the encoder cannot spell: a 500 for the whole answer), or DEL, a C1
    control, a bidirectional override or a zero-width space, which JSON may carry raw and a
    terminal would act on. Each is written as its ``\\u`` escape, as the CLI's ``--json``
    writes it: a JSON reader still reads back the value as stored.
    """

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return escaped_controls(escaped_surrogates(text)).encode("utf-8")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _RefuseControlCharacters:
    """Refuse (400) a request whose decoded path holds a control character, or whose path or
    query percent-encodes bytes that are not UTF-8, before routing.

    Ids in a path (``/users/<id>``) must get the same answer as in a query, but a route's
    pattern never sees such an id whole: its ``.`` stops at a line feed and its ``$`` matches
    before a final one, so ``/api/users/bob%0A`` would be served as bob's trail. Bytes that
    are not UTF-8 (``%FF``, an encoded surrogate) are decoded to U+FFFD: ``?user=%FF`` would be
    served (and recorded as a look) as the trail of the user ``"\ufffd"``, whom it never named.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = _refused_address(scope) if scope["type"] == "http" else None
        if message is None:
            await self.app(scope, receive, send)
            return
        headers = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}
        response: Response
        if scope["path"].startswith("/api/"):
            response = _JSON({"error": message}, 400, headers=headers)
        else:
            response = PlainTextResponse(message, 400, headers=headers)
        await response(scope, receive, send)


def _refused_address(scope: Scope) -> str | None:
    """Why the address of a request is refused before routing (``None``: it is not)."""
    found = _CONTROL.search(scope.get("path", ""))
    if found is not None:
        return f"the path contains the control character U+{ord(found.group()):04X}"
    for part, raw in (("path", scope.get("raw_path")), ("query", scope.get("query_string"))):
        try:
            unquote_to_bytes(raw or b"").decode("utf-8")
        except UnicodeDecodeError:
            return f"the {part} percent-encodes bytes that are not UTF-8 text"
    return None


def _check_named(request: Request) -> None:
    """Refuse (400) a user, session, run, action, cursor or search that no id, key or cursor
    can be, before the look is recorded: the asker's chain keeps what it is given for good,
    and an address can carry some 60 KB. (The stores would refuse them too, after it.)"""
    q = request.query_params
    for user in (request.path_params.get("user_id"), q.get("user")):
        if user is not None:
            check_id("user_id", user, optional=False)
    for name, field in (("session", "session_id"), ("run", "run_id")):
        check_id(field, q.get(name) or None)
    check_key("action", q.get("action") or None)
    cursor = q.get("cursor") or ""
    if cursor and not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 19):
        raise _Refused(400, f"bad cursor {cursor[:40]!r}: pass the next_cursor of a previous page")
    if len(q.get("q", "").encode("utf-8")) > MAX_ID_BYTES:
        raise _Refused(400, f"the search is longer than any user id ({MAX_ID_BYTES} bytes)")


def _cross_site(request: Request) -> bool:
    """Whether a form post comes from another site's page (a forged sign-in or sign-out).

    Browsers say so in ``Sec-Fetch-Site``; one too old to send it still sends ``Origin`` on a
    post, compared with the address the browser asked for (``Host``). A client that sends
    neither (a script) is not a browser another site can drive.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site.lower() not in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return False
    host = request.headers.get("host", "")
    return origin.lower() not in (f"http://{host}".lower(), f"https://{host}".lower())


def _loaded_by_another_site(request: Request) -> bool:
    """Whether another site's page makes the browser load this address in the background
    (an image, a script, a fetch, a frame), by the browser's own ``Sec-Fetch-*`` headers.

    Such a request carries whatever the browser sends the console on its own: the sign-in
    cookie (from a sibling subdomain, which ``SameSite`` counts as the same site) or, behind
    a signing-in proxy, the user's name on every request. Served, it would run an export or
    "verify all" in their name and record looks they never took. A link followed from another
    site (a top-level navigation) is served: its reader sees the page that is recorded.
    """
    site = request.headers.get("sec-fetch-site")
    if site is None or site.lower() in ("same-origin", "none"):
        return False
    mode = request.headers.get("sec-fetch-mode", "").lower()
    dest = request.headers.get("sec-fetch-dest", "").lower()
    return not (mode == "navigate" and dest == "document" and request.method in ("GET", "HEAD"))


def user_url(user_id: str | None) -> str:
    """The trail page of a user, safe in a URL whatever the id holds."""
    if user_id is None:
        return "/trail?anonymous=1"
    if user_id.strip(".") == "":  # "." and "..": a browser would fold them into the path
        return "/trail?" + urlencode({"user": user_id})
    return "/users/" + quote(user_id, safe="")


def _trail_link(user_id: str | None) -> str | None:
    """The trail page of a user id read from a store, or ``None`` for one that is not UTF-8
    (bytes a hand-edited SQLite row holds): no address can name it (the console refuses one
    that percent-encodes such bytes), and it cannot even be percent-encoded."""
    return user_url(user_id) if user_id is None or is_unicode(user_id) else None


_CROSS_SITE = "This form was sent from another site's page; sign in from the console itself."
_LOADED_ELSEWHERE = (
    "This address was loaded by another site's page, not opened in the console: open it "
    "from the console itself (a bearer token is needed to read it from a script)."
)


def _local(target: str) -> bool:
    """Whether a ``next`` address stays on this console (browsers read ``/\\host`` as
    ``//host``, another site)."""
    return (
        target.startswith("/")
        and not target.startswith(("//", "/\\"))
        and "\\" not in target
        and target.isprintable()
    )


def _user_query(user_id: str | None) -> dict[str, str]:
    return {"anonymous": "1"} if user_id is None else {"user": user_id}


def _query_url(path: str, user_id: str | None, **more: Any) -> str:
    params = _user_query(user_id) | {k: str(v) for k, v in more.items() if v not in (None, "")}
    return path + "?" + urlencode(params)


def _time(text: str | None, what: str) -> dt.datetime | None:
    """A time from a filter box: an ISO date or time (UTC unless it says), or an age such as
    ``24h`` or ``7d`` (that long ago), read as ``loomflow audit query --since`` reads them.
    A value out of range (``999999d``, ``9999-12-31T23:00-05:00``) is a 400 naming the box,
    never an OverflowError."""
    if not text:
        return None
    try:
        return parse_when(text)
    except InvalidArgumentError as exc:
        raise _Refused(400, f"{what}: {exc}") from None


def _pretty(value: Any) -> str:
    """A payload as indented JSON with every non-printable character as a JSON escape (see
    :func:`printable`): ``json`` escapes only C0 controls, and leaves a bidirectional override
    or a line separator inside a string raw. Outside strings the text is ASCII punctuation,
    digits and the indentation, so escaping character by character keeps the layout."""
    text = json.dumps(value, ensure_ascii=False, indent=2)
    if text.replace("\n", "").isprintable():
        return text
    return "".join(c if c == "\n" or c.isprintable() else json.dumps(c)[1:-1] for c in text)


def _when(moment: dt.datetime) -> str:
    # Not strftime("%Y"): the C library writes the years before 1000 without their zeros.
    return f"{moment.year:04d}-" + moment.strftime("%m-%d %H:%M:%S")


def _ts(seconds: float) -> str:
    """A journal time (Unix seconds) for a page; a stored value no date can hold (NaN, 1e300,
    from a hand-edited row) is said to be unreadable (the JSON gives null), rather than
    failing the whole page or passing for a time."""
    try:
        return _when(dt.datetime.fromtimestamp(seconds, dt.UTC))
    except (OverflowError, ValueError, OSError, TypeError):
        return UNREADABLE_TIME


# The longest text a page shows for one value, as the CLI's widest table cell: every id fits
# whole (256 UTF-8 bytes are at most 768 characters escaped); a longer value read back from a
# store (a hand-edited row) is cut, or one would make every page it is on megabytes. The JSON
# has it whole.
_SHOWN_LIMIT = 1000


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN_LIMIT else text[: _SHOWN_LIMIT - 1] + "\u2026"


def _shown(value: Any) -> str:
    """A value as a page shows it: non-printable characters as escapes, cut."""
    return _cut(printable(value))


def _shown_id(value: str | None) -> str:
    """An id as a page shows it (quoted when it would read as another), cut."""
    return _cut(shown_id(value))


def _env() -> Environment:
    env = Environment(
        loader=FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["user_url"] = user_url
    env.filters["trail_link"] = _trail_link
    env.tests["unicode"] = is_unicode  # a run id a link can carry (see _trail_link)
    env.tests["problem"] = lambda row: isinstance(row, ChainProblem)  # a row read as no entry
    env.globals["query_url"] = _query_url
    env.filters["shown"] = _shown
    env.filters["id"] = _shown_id
    env.filters["pretty"] = _pretty
    env.filters["when"] = _when
    env.filters["ts"] = _ts
    return env


Handler = Callable[[Request, Principal], Awaitable[dict[str, Any] | Response]]


def create_app(
    data: ConsoleData,
    access: ConsoleAccess,
    *,
    session_secret: str | None = None,
    secure_cookie: bool = False,
) -> Starlette:
    """The console as an ASGI application.

    Args:
        data: The stores to read (and the audit log to record reads in).
        access: Who may sign in, and how.
        session_secret: Signs the sign-in cookie; a random one per process when left out.
            Either way sign-ins through the form live in this application's memory
            (:class:`SignIns`) and end with it.
        secure_cookie: Send the cookie over HTTPS only (set it when served over TLS).
    """
    env = _env()
    secret = session_secret or secrets.token_urlsafe(32)
    cookie_key = hashlib.sha256(b"loomflow console cookie\0" + secret.encode("utf-8")).digest()
    sign_ins = SignIns(_SESSION_HOURS * 3600)

    def render(template: str, request: Request, who: Principal | None, **ctx: Any) -> Response:
        html = env.get_template(template).render(who=who, path=request.url.path, **ctx)
        return HTMLResponse(html, headers=_headers())

    def _headers() -> dict[str, str]:
        return {
            "Content-Security-Policy": _CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        }

    def principal(request: Request) -> tuple[Principal | None, str | None]:
        """Who is signed in; else ``None`` and the way in that failed (``"bearer"``: an
        unknown token; ``"proxy"``: a header value that is no name; ``None`` for someone who
        presented nothing, or a cookie that expired or was signed out, which is no attempt
        to sign in)."""
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            entry = access.by_token(auth[7:].strip())
            if entry is None:
                return None, "bearer"
            return Principal(entry.name, entry.role, "token"), None
        if access.proxy_header is not None:
            values = request.headers.getlist(access.proxy_header)
            if len(values) > 1:
                # Sent twice: a proxy that adds its header to the one the client sent rather
                # than replacing it. The first would be the client's own, an admin name for
                # the asking; neither can be trusted to be the proxy's.
                return None, "proxy"
            if values:
                who = access.from_proxy(values[0])
                return who, "proxy" if who is None else None
        return signed_in(request), None

    def signed_in(request: Request) -> Principal | None:
        """The sign-in the cookie carries, if it is live."""
        held = request.session.get("token")
        if isinstance(held, str):
            if not sign_ins.live(request.session.get("sign_in")):
                # Signed out (or expired, or from before a restart): a kept copy of the
                # cookie is worth nothing. The browser is told to drop it.
                request.session.clear()
                return None
            # The cookie names the token (keyed hash), looked up again on every request:
            # removing a line from the tokens file (and restarting) ends those sessions.
            entry = access.by_cookie(held, cookie_key)
            if entry is not None:
                return Principal(entry.name, entry.role, "cookie")
        return None

    def unauthorized() -> Response:
        return _JSON(
            {"error": "sign in: send Authorization: Bearer <token>"},
            401,
            headers={"WWW-Authenticate": "Bearer"} | _headers(),
        )

    def client_of(request: Request) -> str | None:
        return None if request.client is None else request.client.host

    def page(
        template: str, role: Role = "reader", *, about_user: bool = False
    ) -> Callable[[Handler], Callable[..., Any]]:
        """A route serving ``template`` at its path and JSON at ``/api`` + its path.

        ``about_user``: the route reads the user its query names (``?user=`` or
        ``?anonymous=1``); a refusal records that user, as a served query does.
        """

        def wrap(handler: Handler) -> Callable[..., Any]:
            async def endpoint(request: Request) -> Response:
                api = request.url.path.startswith("/api/")
                who, failed = principal(request)
                if who is None:
                    if failed is not None:
                        await data.signin_failed(failed, client_of(request))
                    if api:
                        return unauthorized()
                    # The path as sent (still percent-encoded: an id may hold "?" or "/").
                    raw = request.scope.get("raw_path") or request.url.path.encode()
                    back = raw.decode("latin-1")
                    if request.url.query:
                        back += "?" + request.url.query
                    target = "/signin?" + urlencode({"next": back})
                    return RedirectResponse(target, 303, headers=_headers())
                if who.via != "token" and _loaded_by_another_site(request):
                    # Not recorded: it is no look the signed-in user took. (Nor is the
                    # address logged: it may name a user.)
                    log.warning("console: refused a load by another site's page (%s)", who.name)
                    return _error(request, who, 403, _LOADED_ELSEWHERE, api)
                try:
                    _check_named(request)
                    if role == "admin" and not who.is_admin:
                        await data.record(
                            who,
                            request.url.path,
                            viewed=named_user(request) if about_user else ANY_USER,
                            details={"needs": "admin"},
                            action=CONSOLE_REFUSED,
                        )
                        raise _Refused(403, "this page is for the admin role")
                    result = await handler(request, who)
                except _Refused as exc:
                    return _error(request, who, exc.status, exc.message, api)
                except UserError as exc:  # a bad id or filter, named by the store
                    return _error(request, who, 400, str(exc), api)
                except StorageError as exc:  # down, locked, unmigrated: not the asker's fault
                    return _unusable(request, who, exc, api)
                except LoomflowError as exc:  # e.g. a journal without its schema
                    return _error(request, who, 400, str(exc), api)
                if isinstance(result, Response):
                    return result
                context = result
                if api:
                    return _JSON(_jsonable(context.get("api", context)), headers=_headers())
                return render(template, request, who, **context)

            return endpoint

        return wrap

    def _error(
        request: Request, who: Principal | None, status: int, message: str, api: bool
    ) -> Response:
        if api:
            return _JSON({"error": message}, status, headers=_headers())
        response = render("error.html", request, who, status=status, message=message)
        response.status_code = status
        return response

    def _unusable(
        request: Request, who: Principal | None, exc: StorageError, api: bool
    ) -> Response:
        # The detail (a file name, the pid holding a lock) is for the operator's log, not for
        # every signed-in reader.
        log.warning("console: a store cannot be used: %s", exc)
        message = f"a store cannot be used right now ({type(exc).__name__})"
        return _error(request, who, 503, message, api)

    def named_user(request: Request) -> str | Any | None:
        """The user a query names, as :func:`user_of` reads it, without refusing: ANY_USER
        when it names none (or names both a user and the anonymous bucket)."""
        if request.query_params.get("anonymous") == "1":
            return ANY_USER if "user" in request.query_params else None
        return request.query_params.get("user", ANY_USER)

    def user_of(request: Request, where: str = "user") -> str | None:
        """The user a query names (``anonymous=1`` is the bucket of runs without one)."""
        value = request.query_params.get(where)
        if request.query_params.get("anonymous") == "1":
            if value is not None:  # which one? answering for either would mislead
                raise _Refused(400, f"name either ?{where}=<id> or ?anonymous=1, not both")
            return None
        if value is None:
            raise _Refused(400, f"name the user: ?{where}=<id> or ?anonymous=1")
        return value

    def page_size(request: Request, default: str = "25") -> int:
        text = request.query_params.get("limit", default)
        # Up to three ASCII digits: int() would also take " 20", "1_0", "٢٠" or 5,000 digits.
        if text.isascii() and text.isdigit() and len(text) <= 3:
            limit = int(text)
            if _PAGE_MIN <= limit <= _PAGE_MAX:
                return limit
        raise _Refused(400, f"limit must be a whole number from {_PAGE_MIN} to {_PAGE_MAX}")

    def filters(request: Request) -> TrailFilter:
        q = request.query_params
        since, until = _time(q.get("since"), "since"), _time(q.get("until"), "until")
        if since is not None and until is not None and since >= until:
            # As `loomflow audit query` refuses it: an empty page (or an export of nothing)
            # would pass for a trail with nothing in that time.
            raise _Refused(
                400,
                f"since ({iso_time(since)}) is not before until ({iso_time(until)}): the range "
                "selects nothing; an age counts back from now, so the older bound is the "
                "larger age",
            )
        return TrailFilter(
            since=since,
            until=until,
            session_id=q.get("session") or None,
            action=q.get("action") or None,
        )

    # -- pages ----------------------------------------------------------------------------

    @page("users.html")
    async def users(request: Request, who: Principal) -> dict[str, Any]:
        search = request.query_params.get("q", "")
        await data.record(who, "users", details={"search": search})
        heads, more = await data.users(search)
        listed = [
            {
                "user_id": h.user_id,
                # A head row that reads as no head counts nothing that can be believed.
                "entries": h.seq if isinstance(h, ChainHead) else None,
                # A head row whose key names no trail has no page; nor has an id that is not
                # UTF-8 (see _trail_link).
                "url": None if names_no_user(h) else _trail_link(h.user_id),
                "problem": why,
            }
            for h, why in heads
        ]
        return {
            "search": search,
            "users": listed,
            "more": more,
            "api": {"users": listed, "more": more},
        }

    async def trail_of(request: Request, who: Principal, user_id: str | None) -> Any:
        where = filters(request)
        q = request.query_params
        limit = page_size(request)
        cursor = q.get("cursor") or None
        verify = q.get("verify") == "1"
        await data.record(
            who,
            "trail",
            viewed=user_id,
            details=where.as_json() | {"cursor": cursor, "limit": limit, "verify": verify},
        )
        unreadable = None
        try:
            page_ = await data.trail(user_id, where, limit=limit, cursor=cursor)
        except AuditIntegrityError as exc:
            # A hand-edited row (text in its seq, say) makes the page's entries unreadable,
            # not the chain's verification, which reports the row with its place: asked
            # for, it is shown; else the page says why and offers it.
            if request.url.path.startswith("/api/") and not verify:
                raise
            page_, unreadable = AuditPage([], None), str(exc)
        report = await data.verify(user_id) if verify else None
        shown = {k: v for k, v in where.as_json().items() if v}
        next_url = None
        if page_.next_cursor is not None:
            next_url = _query_url("/trail", user_id, **shown, limit=limit, cursor=page_.next_cursor)
        base = user_url(user_id)
        sep = "&" if "?" in base else "?"
        api = {
            "user_id": user_id,
            "filters": where.as_json(),
            # None, not []: a page that could not be read is not an empty one.
            "entries": None if unreadable else [e.to_json() for e in page_.entries],
            "next_cursor": page_.next_cursor,
            "verify": None if report is None else report.to_json(),
        }
        if unreadable:
            api["unreadable"] = unreadable
        if page_.damaged:  # only then, as `audit query --json` adds it: the rows not listed
            api["damaged"] = [p.to_json() for p in page_.damaged]
        context = {
            "user_id": user_id,
            "filters": where,
            "form": {k: q.get(k, "") for k in ("since", "until", "session", "action")},
            "entries": page_.entries,
            "damaged": page_.damaged,
            "limit": limit,
            "sizes": sorted({*_PAGE_SIZES, limit}),
            "next_url": next_url,
            "first_url": _query_url("/trail", user_id, **shown, limit=limit) if cursor else None,
            "verify_url": base + sep + urlencode({**shown, "limit": limit, "verify": 1}),
            "export_url": _query_url("/export", user_id, **shown),
            "export_page_url": _query_url("/export", user_id, **shown, limit=limit, cursor=cursor),
            "heads_url": _query_url("/export/heads", user_id),
            "report": report,
            "unreadable": unreadable,
            "api": api,
        }
        if unreadable and report is None:
            response = render("trail.html", request, who, **context)
            response.status_code = 400
            return response
        return context

    @page("trail.html")
    async def trail_by_path(request: Request, who: Principal) -> Any:
        return await trail_of(request, who, request.path_params["user_id"])

    @page("trail.html")
    async def trail_by_query(request: Request, who: Principal) -> Any:
        return await trail_of(request, who, user_of(request))

    @page("entry.html")
    async def entry(request: Request, who: Principal) -> Any:
        user_id = user_of(request)
        text = request.query_params.get("seq", "")
        # ASCII digits only, as a page size is read: int() would also take " 1", "1_0",
        # Arabic-Indic digits or thousands of digits, and show (and record) an entry the
        # address does not name.
        if not (text.isascii() and text.isdigit() and len(text) <= 19):
            raise _Refused(400, "seq must be a whole number")
        seq = int(text)
        await data.record(who, "entry", viewed=user_id, details={"seq": seq})
        found = await data.entry(user_id, seq)  # redacted, as every page and route shows it
        if found is None:
            raise _Refused(404, f"no entry {seq} in this user's trail")
        if isinstance(found, ChainProblem):
            # The row stored with that seq reads as no entry: named and marked, as the export
            # marks it (nothing of its content), rather than a 400 the asker did not cause.
            return {"user_id": user_id, "seq": seq, "damaged": found, "api": damaged_row(found)}
        run_url = None
        # A run id that is not UTF-8 (a hand-edited row) is no address: shown, not linked.
        if found.run_id is not None and is_unicode(found.run_id):
            run_url = _query_url("/run", user_id, run=found.run_id)
        return {
            "user_id": user_id,
            "entry": found,
            "payload": found.payload,
            "run_url": run_url,
            "api": found.to_json(),
        }

    @page("run.html")
    async def run(request: Request, who: Principal) -> Any:
        user_id = user_of(request)
        run_id = request.query_params.get("run")
        if not run_id:
            raise _Refused(400, "name the run: ?run=<run id>")
        await data.record(who, "run", viewed=user_id, details={"run": run_id})
        story = await data.run(user_id, run_id)
        if not story.rows:
            raise _Refused(404, "this user's trail has no entry of that run")
        base = user_url(user_id)
        verify_url = base + ("&" if "?" in base else "?") + "verify=1"
        return {
            "story": story,
            "user_id": user_id,
            "verify_url": verify_url,
            "api": story.to_json(),
        }

    @page("runs.html", role="admin")
    async def runs(request: Request, who: Principal) -> Any:
        state = request.query_params.get("state") or None
        # "unreadable" too, as `runs list --state` takes it: the page lists such rows.
        if state is not None and state not in (*RUN_STATES, UNREADABLE):
            raise _Refused(400, f"state must be one of {', '.join((*RUN_STATES, UNREADABLE))}")
        await data.record(who, "runs", details={"state": state})
        listed, more = await data.runs(state)

        def row(info: SessionInfo, shown: str, when: float | str | None) -> dict[str, Any]:
            return {
                "session_id": info.session_id,
                "user_id": info.user_id,
                "state": shown,
                "epoch": info.epoch,
                "entries": info.entries,
                "owner": info.owner,
                "updated_at": when,
            }

        return {
            "runs": [row(i, s, i.updated_at) for i, s in listed],  # the page formats it
            "state": state,
            "has_journal": data.stores.runtime is not None,
            "more": more,
            "api": {"runs": [row(i, s, iso_time(i.updated_at)) for i, s in listed], "more": more},
        }

    @page("verify.html", role="admin")
    async def verify_all(request: Request, who: Principal) -> Any:
        await data.record(who, "verify all")
        report = await data.verify(ANY_USER)
        return {"report": report, "api": report.to_json()}

    @page("", role="admin", about_user=True)
    async def export(request: Request, who: Principal) -> Response:
        user_id = user_of(request)
        where = filters(request)
        # With ``limit`` (and ``cursor``): the one page shown; without, every page.
        one_page = "limit" in request.query_params
        limit = page_size(request) if one_page else None
        cursor = request.query_params.get("cursor") or None
        if cursor is not None and not one_page:
            # Dropped, it would hand a script going on from a cursor the whole trail again.
            raise _Refused(400, "cursor= picks one page of an export: give limit= with it")
        details = where.as_json() | ({"limit": limit, "cursor": cursor} if one_page else {})
        await data.record(who, "export", viewed=user_id, details=details)
        # Bad ids are a 400 now, not a stream cut short after its headers went out.
        check_id("user_id", user_id)
        check_id("session_id", where.session_id)
        check_key("action", where.action)
        name = "audit-export.jsonl"
        lines: AsyncIterator[str]
        if limit is not None:
            shown = await data.export_page(user_id, where, limit=limit, cursor=cursor)
            page_lines = "".join(export_line(row) + "\n" for row in shown.rows)
            after = min((e.seq for e in shown.entries), default=1) - 1
            lines = _once(data.export_header(user_id, where, after) + page_lines)
        else:
            # Streamed a page at a time: a long trail is never held in memory whole. The first
            # chunk is read before the answer starts, so a store that cannot be read is an
            # error page, not a download cut off after a 200. A row that reads as no entry is
            # marked in its place, as `loomflow audit export` marks it.
            rest = data.export_lines(user_id, where)
            lines = _then(await anext(rest), rest)
        return StreamingResponse(
            lines,
            media_type="application/x-ndjson",
            headers=_headers() | {"Content-Disposition": f'attachment; filename="{name}"'},
        )

    @page("", role="admin", about_user=True)
    async def export_heads(request: Request, who: Principal) -> Response:
        user_id = user_of(request)
        await data.record(who, "export heads", viewed=user_id)
        report = await data.verify(user_id)
        # A `loomflow audit verify --json` report: `verify --file x.jsonl --heads this` reads it.
        return _JSON(
            report.to_json(),
            headers=_headers() | {"Content-Disposition": 'attachment; filename="heads.json"'},
        )

    # -- sign-in and health ---------------------------------------------------------------

    async def healthz(request: Request) -> Response:
        return _JSON({"ok": True})

    async def signin(request: Request) -> Response:
        target = request.query_params.get("next", "/users")
        if not _local(target):
            target = "/users"  # never sign someone in and send them elsewhere
        error = None
        if request.method == "POST":
            if _cross_site(request):
                return _error(request, None, 403, _CROSS_SITE, api=False)
            form = await request.form()
            token = form.get("token")
            entry = access.by_token(token) if isinstance(token, str) else None
            if entry is not None:
                sign_ins.end(request.session.get("sign_in"))  # one sign-in per cookie
                request.session.clear()
                who = Principal(entry.name, entry.role, "cookie")
                try:
                    await data.record(who, "sign in", action=CONSOLE_SIGNIN)
                except StorageError as exc:  # no sign-in that is not audited, as no query
                    return _unusable(request, None, exc, api=False)
                request.session["token"] = cookie_value(entry, cookie_key)
                request.session["sign_in"] = sign_ins.start()
                return RedirectResponse(target, 303, headers=_headers())
            await data.signin_failed("form", client_of(request))
            error = "That token is not known."
        response = render("signin.html", request, None, error=error, next=target)
        if error is not None:
            response.status_code = 401
        return response

    async def signout(request: Request) -> Response:
        if _cross_site(request):
            return _error(request, None, 403, _CROSS_SITE, api=False)
        who = signed_in(request)
        # Ended here, not only forgotten by this browser: every copy of the cookie is out.
        sign_ins.end(request.session.get("sign_in"))
        if who is not None:  # a sign-in was live: its end goes on the record by its start
            try:
                await data.record(who, "sign out", action=CONSOLE_SIGNOUT)
            except LoomflowError as exc:
                # Still signed out: ending access is never held up by the audit log.
                log.warning("console: could not record %s signing out: %s", who.name, exc)
        request.session.clear()
        return RedirectResponse("/signin", 303, headers=_headers())

    async def root(request: Request) -> Response:
        return RedirectResponse("/users", 303)

    routes = [
        Route("/healthz", healthz),
        Route("/", root),
        Route("/signin", signin, methods=["GET", "POST"]),
        Route("/signout", signout, methods=["POST"]),
    ]
    for prefix in ("", "/api"):
        routes += [
            Route(f"{prefix}/users", users),
            Route(prefix + "/users/{user_id:path}", trail_by_path),
            Route(f"{prefix}/trail", trail_by_query),
            Route(f"{prefix}/entry", entry),
            Route(f"{prefix}/run", run),
            Route(f"{prefix}/runs", runs),
            Route(f"{prefix}/verify", verify_all),
            Route(f"{prefix}/export", export),
            Route(f"{prefix}/export/heads", export_heads),
        ]
    middleware = [
        Middleware(_RefuseControlCharacters),
        Middleware(
            SessionMiddleware,
            secret_key=secret,
            session_cookie="loomflow_console",
            max_age=_SESSION_HOURS * 3600,
            same_site="strict",
            https_only=secure_cookie,
        ),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await data.flush_failures()  # failed sign-ins counted since the last record

    async def no_route(request: Request, exc: Exception) -> Response:
        # Starlette's own answers (no such address, a method the route does not take) carry
        # the headers of every other answer, and are JSON under /api/ as the rest of it is.
        assert isinstance(exc, HTTPException)
        headers = _headers() | dict(exc.headers or {})
        if request.url.path == "/api" or request.url.path.startswith("/api/"):
            # Only to someone signed in: a 404 (or 405) to anyone else, where the routes that
            # exist answer 401, would map the API for them.
            who, failed = principal(request)
            if who is None:
                if failed is not None:
                    await data.signin_failed(failed, client_of(request))
                return unauthorized()
            return _JSON({"error": exc.detail}, exc.status_code, headers=headers)
        return PlainTextResponse(exc.detail, exc.status_code, headers=headers)

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: no_route},
    )
    # "/runs/" is a 404, not a redirect to "/runs" built from the request's Host header (a
    # forged Host would send a shared cache's users elsewhere) without the console's headers.
    app.router.redirect_slashes = False
    return app


async def _once(text: str) -> AsyncIterator[str]:
    yield text


async def _then(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for text in rest:
        yield text


def _jsonable(value: Any) -> Any:
    # A figure worked out from stored ones may be no JSON number (costs of 1e308 sum to
    # inf): it is written as the text "Infinity" or "NaN", not made a 500 by the encoder.
    return json.loads(json.dumps(value, default=_json_default), parse_constant=str)


def _json_default(value: Any) -> Any:
    # Times as everywhere in loomflow's JSON (the CLI's --json, exports): ISO 8601 in UTC
    # with microseconds and a Z. Routes convert their Unix-seconds fields themselves.
    if isinstance(value, dt.datetime):
        return iso_time(value)
    return str(value)

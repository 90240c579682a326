"""Redaction before storage: secret shapes, configured secret values, sensitive arguments, PII.

A :class:`Redactor` rewrites text and JSON data so that none of these reach a store:

- *secret shapes*: API keys (``sk-…``, ``AKIA…``, ``AIza…``, ``sk_live_…``, GitHub and Slack
  tokens), bearer tokens, JSON web tokens and PEM private keys, found anywhere in any string;
- *configured secret values*: ``Settings.redact_secrets`` and the values of the environment
  variables named in ``Settings.redact_env``, found anywhere in any string;
- *learned values*: the values of tool arguments a tool declares ``sensitive``; the audit hook
  teaches them to the redactor as soon as it sees them, so that the same value is also
  scrubbed from loomflow's own log records (see :func:`install_log_redaction`);
- *sensitive keys*: a mapping key such as ``password``, ``db_password`` or ``X-Api-Key``
  hides its value (one whose words name a secret, see :data:`DEFAULT_SENSITIVE_KEYS`); the
  agent loop also seals tool arguments of such names out of the journal, and learns them;
- *personal-data shapes* (:data:`PII_KINDS`): payment card numbers that pass the Luhn check,
  e-mail addresses and IBANs that pass their checksum (the shapes the PII guardrail finds),
  plus any patterns you add. These are
  removed from what the audit log and loomflow's logs store, but never from what the agent
  loop journals (``pii=False``): a tool that looks up a customer's e-mail must still hand it
  to the model. Tools whose results are personal data say so with ``sensitive_result=True``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import threading
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel

from ._json import json_safe
from ._pii import FINDERS
from .config import Settings
from .errors import UserError

__all__ = [
    "DEFAULT_SENSITIVE_KEYS",
    "KEY_WORDS_ABOUT_A_SECRET",
    "PII_KINDS",
    "PLACEHOLDER",
    "Redactor",
    "SCRUBBED_LOGGERS",
    "SECRET_KEY_PAIRS",
    "SECRET_KEY_WORDS",
    "SECRET_PATTERNS",
    "TOKEN_AS_TEXT",
    "install_log_redaction",
]

PLACEHOLDER = "[REDACTED]"
"""What a sensitive argument or a secret value becomes."""

# Each shape starts with its literal and checks the word boundary behind it: re scans fast
# for a leading literal, while a leading ``\b`` makes it try the whole pattern at every
# position (about 30 times slower on ordinary text, on every string a run stores).
SECRET_PATTERNS: tuple[tuple[str, str], ...] = (
    ("private_key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"),
    ("api_key", r"sk-(?<=\bsk-)[A-Za-z0-9_\-]{16,}"),
    ("aws_access_key", r"A[KS]IA(?<=\bA[KS]IA)[0-9A-Z]{16}\b"),
    ("google_api_key", r"AIza(?<=\bAIza)[0-9A-Za-z_\-]{35}"),
    ("github_token", r"g(?<=\bg)(?:h[pousr]_[A-Za-z0-9]{36,}|ithub_pat_[A-Za-z0-9_]{40,})"),
    ("slack_token", r"xox(?<=\bxox)[abposr]-[A-Za-z0-9\-]{10,}"),
    ("stripe_key", r"[rs](?<=\b[rs])k_live_[A-Za-z0-9]{16,}"),  # secret and restricted keys
    ("jwt", r"eyJ(?<=\beyJ)[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    ("bearer_token", r"[Bb](?<=\b[Bb])(?i:earer\s+[A-Za-z0-9\-._~+/]{8,}=*)"),
)
"""``(kind, regular expression)`` of the secret shapes found in any string."""


class _Shape(Protocol):
    def sub(self, repl: str, string: str) -> str: ...


class _UpToTheLastEnd:
    """The private key shape, applied only up to the text's last end marker.

    Its lazy body scans from a begin marker to the first end marker after it, so with none
    after it, every begin marker scanned on to the end of the text: 140 KB of begin markers
    took 13 s. No match ends past the last end marker, so the text after it is left alone,
    and every begin marker before it finds an end marker (one scan each, at most, up to it).
    """

    _END = re.compile(r"-----END [A-Z ]*PRIVATE KEY-----")

    def __init__(self, pattern: str) -> None:
        self._rx = re.compile(pattern)

    def sub(self, repl: str, string: str) -> str:
        cut, at = -1, 0
        while (end := self._END.search(string, at)) is not None:  # overlapping ones too
            cut, at = end.end(), end.start() + 1
        if cut < 0:
            return string
        return self._rx.sub(repl, string[:cut]) + string[cut:]


class _WhereItCanBe:
    """A shape whose first character is one of two (``[rs]k_live_``), so re cannot scan ahead
    for a literal (about 15 times slower on ordinary text): tried only on text holding the
    literal every match contains."""

    def __init__(self, literal: str, pattern: str) -> None:
        self._literal = literal
        self._rx = re.compile(pattern)

    def sub(self, repl: str, string: str) -> str:
        return self._rx.sub(repl, string) if self._literal in string else string


def _compiled(kind: str, pattern: str) -> _Shape:
    if kind == "private_key":
        return _UpToTheLastEnd(pattern)
    if kind == "stripe_key":
        return _WhereItCanBe("k_live_", pattern)
    return re.compile(pattern)


class _Values:
    """Secret values found anywhere in a text, the longest one where several start at the
    same place (``a-secret`` and ``a-secret-too``).

    The values are compiled into one pattern shaped as a tree of their characters: re tries
    the alternatives of ``v1|v2|…`` one by one at every place, so with 4,096 values the
    tree is some 30 times faster. Compiling costs about 0.3 ms a value, so a value learned
    since is looked for on its own (``str.find``), and one forgotten since is skipped where
    the pattern finds it, until they make up a quarter of the compiled ones
    (:meth:`worth_recompiling`): learning costs a constant amortised, not all the values.
    """

    def __init__(self) -> None:
        # Replaced, never changed in place, so that text() on another thread reads a whole
        # state (it reads the changes since before the compiled state: a value folded into
        # the pattern meanwhile is then looked for twice rather than not at all).
        self._state: tuple[re.Pattern[str] | None, frozenset[str], list[int]] = (
            None,
            frozenset(),
            [],  # lengths of the compiled values, longest first
        )
        self._added: tuple[str, ...] = ()  # learned since
        self._forgotten: frozenset[str] = frozenset()  # compiled, forgotten since

    def compile(self, values: Collection[str]) -> None:
        compiled = frozenset(values)
        rx = re.compile(_tree(sorted(compiled), 0)) if compiled else None
        self._state = (rx, compiled, sorted({len(v) for v in compiled}, reverse=True))
        self._added, self._forgotten = (), frozenset()

    def add(self, value: str) -> None:
        if value in self._state[1]:
            self._forgotten = self._forgotten - {value}
        elif value not in self._added:
            self._added = (*self._added, value)

    def forget(self, value: str) -> None:
        if value in self._state[1]:
            self._forgotten = self._forgotten | {value}
        else:
            self._added = tuple(v for v in self._added if v != value)

    def worth_recompiling(self) -> bool:
        return len(self._added) + len(self._forgotten) > max(32, len(self._state[1]) // 4)

    def sub(self, repl: str, text: str) -> str:
        added, forgotten = self._added, self._forgotten
        rx, compiled_values, lengths = self._state
        added_here = [v for v in added if v in text]
        if not added_here and not forgotten:
            return text if rx is None else rx.sub(repl, text)
        # The leftmost match of any value, the longest there; then on from its end.
        pieces: list[str] = []
        pos = 0

        def next_compiled(pos: int) -> tuple[int, int] | None:
            # Where the pattern finds a forgotten value, a shorter one may start there.
            while rx is not None and (match := rx.search(text, pos)) is not None:
                if match.group() not in forgotten:
                    return match.span()
                at = match.start()
                for length in lengths:
                    value = text[at : at + length]
                    if value in compiled_values and value not in forgotten:
                        return at, at + len(value)
                pos = at + 1
            return None

        compiled = next_compiled(0)
        found = {v: text.find(v) for v in added_here}
        while True:
            best = compiled
            for v, at in list(found.items()):
                if at < pos:
                    at = found[v] = text.find(v, pos)
                    if at < 0:
                        del found[v]
                        continue
                if best is None or at < best[0] or (at == best[0] and at + len(v) > best[1]):
                    best = (at, at + len(v))
            if best is None:
                break
            pieces += (text[pos : best[0]], repl)
            pos = best[1]
            if compiled is not None and compiled[0] < pos:
                compiled = next_compiled(pos)
        pieces.append(text[pos:])
        return "".join(pieces)


_TREE_DEPTH = 64  # below it, a branch lists its values flat (re nests groups recursively)


def _tree(values: list[str], depth: int) -> str:
    """A pattern matching the longest of ``values`` (sorted, distinct) that starts where it
    is tried: one branch per first character, each tried before the value that ends there."""
    if len(values) == 1:
        return re.escape(values[0])
    if depth >= _TREE_DEPTH:
        return "(?:" + "|".join(map(re.escape, sorted(values, key=len, reverse=True))) + ")"
    ends = values[0] == ""  # sorted: the empty rest comes first
    branches: list[str] = [
        re.escape(first) + _tree([v[1:] for v in group], depth + 1)
        for first, group in itertools.groupby(values[int(ends) :], key=lambda v: v[0])
    ]
    if ends:
        branches.append("")
    if len(branches) == 1:
        return branches[0]
    return "(?:" + "|".join(branches) + ")"


PII_KINDS: tuple[str, ...] = tuple(FINDERS)
"""The personal-data kinds redacted by default: ``card`` (13 to 19 digits, spaced or dashed,
that pass the Luhn check), ``email`` and ``iban`` (that pass the ISO 13616 checksum)."""

DEFAULT_SENSITIVE_KEYS = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "secret",
        "client_secret",
        "api_key",
        "apikey",
        "x_api_key",
        "access_token",
        "refresh_token",
        "id_token",
        "auth_token",
        "token",
        "authorization",
        "private_key",
        "cookie",
        "set_cookie",
    }
)
"""Mapping keys whose values are always hidden (compared lower-case, without ``-`` and ``_``:
``accessToken``, ``access-token`` and ``ACCESS_TOKEN`` are all ``access_token``).

These are matched whole. Besides them, a key is also hidden when one of its *words* names a
secret (``Redactor(key_words=True)``, the default): the key is cut into words at ``_``, ``-``,
``.``, spaces, digits and camelCase humps (``dbPassword``, ``AWS_SECRET_ACCESS_KEY``,
``X-Api-Key``), and it is hidden when a word is one of :data:`SECRET_KEY_WORDS` (``password``,
``secret``, ``token``, ``cookie``, ``authorization``, ``credentials``...) or two
neighbouring words are one of :data:`SECRET_KEY_PAIRS` (``api key``, ``private key``, ``access
key``...); ``pass`` and ``pwd`` count only as a key's last word (``smtp_pass``, ``db_pwd``;
``pwd`` alone is a working directory). Words are whole: ``secretary``, ``passage`` and
``tokenizer`` are not ``secret``, ``pass`` or ``token``, and neither is the plural ``tokens``
(``max_tokens``, ``input_tokens``: counts) unless a pair names it (``access_tokens``).

A key whose secret word is followed by a word that describes the secret rather than holding it
(:data:`KEY_WORDS_ABOUT_A_SECRET`: ``token_count``, ``token_usage``, ``password_policy``,
``secret_name``, ``api_key_id``, ``cookie_consent``, ``authorization_url``...) stays visible, and
so does a ``token`` that a word before it makes a unit of text or a cursor
(:data:`TOKEN_AS_TEXT`: ``cost_per_token``, ``eos_token``, ``next_token``). When in doubt, the
key is hidden: ``password_hash`` and ``boarding_pass`` are."""

SECRET_KEY_WORDS = frozenset(
    {
        "apikey",
        "apikeys",
        "authorization",
        "cookie",
        "cookies",
        "credential",
        "credentials",
        "jwt",
        "passcode",
        "passphrase",
        "passwd",
        "password",
        "passwords",
        "privatekey",
        "secret",
        "secrets",
        "token",
    }
)
"""Words that make a key sensitive wherever they stand in it (:data:`DEFAULT_SENSITIVE_KEYS`)."""

SECRET_KEY_PAIRS = frozenset(
    {
        ("access", "key"),
        ("access", "tokens"),
        ("api", "key"),
        ("api", "keys"),
        ("api", "tokens"),
        ("auth", "tokens"),
        ("encryption", "key"),
        ("id", "tokens"),
        ("master", "key"),
        ("pass", "phrase"),
        ("pass", "word"),
        ("private", "key"),
        ("private", "keys"),
        ("refresh", "tokens"),
        ("secret", "key"),
        ("session", "key"),
        ("signing", "key"),
    }
)
"""Neighbouring words that make a key sensitive together (``x_api_key``, ``privateKey``)."""

KEY_WORDS_ABOUT_A_SECRET = frozenset(
    {
        "age",
        "arn",
        "budget",
        "consent",
        "cost",
        "count",
        "counts",
        "created",
        "dir",
        "domain",
        "enabled",
        "endpoint",
        "env",
        "estimate",
        "exists",
        "expiration",
        "expired",
        "expires",
        "expiry",
        "field",
        "file",
        "format",
        "id",
        "ids",
        "kind",
        "len",
        "length",
        "lifetime",
        "limit",
        "limits",
        "max",
        "min",
        "name",
        "names",
        "path",
        "per",
        "policy",
        "present",
        "price",
        "rate",
        "ref",
        "required",
        "rotated",
        "rules",
        "size",
        "strength",
        "ttl",
        "type",
        "types",
        "updated",
        "uri",
        "url",
        "usage",
        "used",
        "version",
    }
)
"""Words that, right after a secret word, make the key describe the secret rather than hold it
(``token_count``, ``secret_name``, ``api_key_id``)."""

TOKEN_AS_TEXT = frozenset(
    {
        "bos",
        "cache",
        "cached",
        "cls",
        "completion",
        "continuation",
        "eos",
        "first",
        "input",
        "mask",
        "max",
        "min",
        "next",
        "num",
        "output",
        "pad",
        "page",
        "pagination",
        "per",
        "prompt",
        "reasoning",
        "sep",
        "special",
        "stop",
        "total",
        "unk",
    }
)
"""Words that, right before ``token``, make it a unit of text (``max_token``, ``eos_token``,
``cost_per_token``) or a page cursor (``next_token``, ``page_token``), not a credential."""

# Only as a key's last word, in keys of at least this many words: "smtp_pass", "db_pwd".
_LAST_WORDS = {"pass": 1, "pwd": 2}
# The last words that also seal a tool argument (Redactor.seals_key): "pass" is left out, as a
# key ending in it holds a ticket as often as a password (boarding_pass, ski_pass).
_SEALING_LAST_WORDS = {"pwd": 2}
# Upper-case runs (an acronym: "API" of "APIKey"), capitalised or lower-case words, digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

_MIN_SECRET = 4  # a shorter "secret" would redact ordinary text everywhere
# The shortest text each kind of rule can change (tests check them against the patterns): a
# shorter string is returned as it is, without a regex scan. Most strings a run stores are.
_SHORTEST_SHAPE = 15  # "xoxb-" and ten characters, or "bearer " and eight
_SHORTEST_BUILTIN_PII = 6  # "a@b.cd"
_NO_RULE = 1 << 30  # the shortest text a kind of rule that is off can change: none


def _norm_key(key: str) -> str:
    # Without separators, so that camelCase (accessToken, clientSecret) is the key that
    # snake_case (access_token) and kebab-case (access-token) name.
    return key.lower().replace("-", "").replace("_", "")


def _names_a_secret(key: str, last_words: Mapping[str, int] = _LAST_WORDS) -> bool:
    """Whether a word of ``key`` (or two neighbouring ones) names a secret that the key holds
    (see :data:`DEFAULT_SENSITIVE_KEYS`)."""
    words = [w.lower() for w in _WORD.findall(key)]
    n = len(words)
    for i, word in enumerate(words):
        if i + 1 < n and (word, words[i + 1]) in SECRET_KEY_PAIRS:
            end = i + 2  # the longer match first: "secret_key_id" describes a key
        elif word in SECRET_KEY_WORDS:
            if word == "token" and i and words[i - 1] in TOKEN_AS_TEXT:
                continue
            end = i + 1
        elif i == n - 1 and n >= last_words.get(word, n + 1):
            end = n
        else:
            continue
        if end == n or words[end] not in KEY_WORDS_ABOUT_A_SECRET:
            return True
    return False


class Redactor:
    """Rewrites text and JSON data before it is stored or logged.

    Args:
        secrets: Secret values to remove wherever they appear.
        env: Names of environment variables whose values are secrets.
        patterns: Also remove secret *shapes* (:data:`SECRET_PATTERNS`).
        sensitive_keys: Mapping keys whose values are always hidden (matched whole).
        key_words: Also hide the values of keys whose words name a secret (``db_password``,
            ``githubToken``; see :data:`DEFAULT_SENSITIVE_KEYS`). ``False`` hides only the
            keys of ``sensitive_keys``.
        max_learned: How many learned values to keep (oldest forgotten first).
        pii: Remove the built-in personal-data shapes (:data:`PII_KINDS`).
        pii_patterns: Personal-data shapes of your own, ``{kind: regular expression}``, used
            whatever ``pii`` says; a match becomes ``[REDACTED:<kind>]``. A call with
            ``pii=False`` (the agent loop's) skips every personal-data shape.

    Example:
        >>> r = Redactor(secrets=["hunter22"])
        >>> r.text("login with hunter22 and sk-abcdefghijklmnopqrstu")
        'login with [REDACTED] and [REDACTED:api_key]'
        >>> r.text("paid with 4111 1111 1111 1111, receipt to ana@example.com")
        'paid with [REDACTED:card], receipt to [REDACTED:email]'

    Raises:
        UserError: a pattern of ``pii_patterns`` is not a valid regular expression.
    """

    def __init__(
        self,
        *,
        secrets: Iterable[str] = (),
        env: Iterable[str] = (),
        patterns: bool = True,
        sensitive_keys: Collection[str] = DEFAULT_SENSITIVE_KEYS,
        key_words: bool = True,
        max_learned: int = 4096,
        pii: bool = True,
        pii_patterns: Mapping[str, str] | None = None,
    ) -> None:
        values = {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET}
        for name in env:
            value = os.environ.get(name)
            if value and len(value) >= _MIN_SECRET:
                values.add(value)
        self._configured = frozenset(values)
        self._patterns: list[tuple[str, _Shape]] = (
            [(f"[REDACTED:{kind}]", _compiled(kind, rx)) for kind, rx in SECRET_PATTERNS]
            if patterns
            else []
        )
        finders: list[tuple[str, Callable[[str], list[tuple[int, int]]]]] = (
            list(FINDERS.items()) if pii else []
        )
        for kind, rx in (pii_patterns or {}).items():
            try:
                compiled = re.compile(rx)
            except (re.error, TypeError) as exc:
                raise UserError(f"redaction pattern {kind!r} is not a valid regex: {exc}") from exc
            finders.append((str(kind), _spans_of(compiled)))
        self._pii = finders
        # A pattern of one's own may match a single character (an empty match changes nothing).
        self._shortest_pii = 1 if pii_patterns else _SHORTEST_BUILTIN_PII if pii else _NO_RULE
        self._keys = frozenset(_norm_key(k) for k in sensitive_keys)
        self._key_words = key_words
        # Whether a key hides its value, by key: decided once per key (a few come back in
        # every record), and unlike _redacted_keys, not changed by what is learned.
        self._hiding: dict[str, bool] = {}
        self._learned: OrderedDict[str, None] = OrderedDict()
        self._max_learned = max_learned
        self._lock = threading.Lock()  # log records are built on any thread
        self._values = _Values()
        self._compile()

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Redactor:
        """The redactor ``Settings`` describe (``redact_secrets``, ``redact_env``,
        ``redact_pii``, ``redact_patterns``)."""
        s = settings or Settings()
        return cls(
            secrets=[v.get_secret_value() for v in s.redact_secrets],
            env=s.redact_env,
            pii=s.redact_pii,
            pii_patterns=s.redact_patterns,
        )

    def __repr__(self) -> str:
        return (
            f"Redactor({len(self._configured)} configured secrets, {len(self._learned)} learned, "
            f"patterns={'on' if self._patterns else 'off'}, "
            f"pii={[kind for kind, _ in self._pii] or 'off'})"
        )

    def _compile(self) -> None:
        values = self._configured | self._learned.keys()
        self._values.compile(values)
        self._shortest_secret = min(
            min(map(len, values), default=_NO_RULE), _SHORTEST_SHAPE if self._patterns else _NO_RULE
        )
        self._shortest = min(self._shortest_secret, self._shortest_pii)
        # Redacted object keys, by (key, pii): the same few keys come back in every record,
        # and a value learned since may change what a key becomes.
        self._redacted_keys: dict[tuple[str, bool], str] = {}

    def learn(self, value: Any) -> None:
        """Treat ``value`` (and every string or number inside it) as a secret from now on.

        Cheap: the values compiled into one pattern are recompiled only once the values
        learned (or forgotten) since make up a quarter of them; until then :meth:`text`
        looks for the newer ones on their own.
        """
        leaves: list[str] = []
        _leaves(value, leaves)
        fresh = [v for v in leaves if len(v) >= _MIN_SECRET and v not in self._configured]
        if not fresh:
            return
        with self._lock:
            changed = False
            for v in fresh:
                if v in self._learned:
                    self._learned.move_to_end(v)
                    continue
                self._learned[v] = None
                self._values.add(v)
                changed = True
                while len(self._learned) > self._max_learned:
                    self._values.forget(self._learned.popitem(last=False)[0])
            if changed:
                # A shortest secret that was forgotten leaves the shortcut lower than it
                # could be (safe: a recompile raises it again).
                shortest = min(map(len, fresh))
                self._shortest_secret = min(self._shortest_secret, shortest)
                self._shortest = min(self._shortest, shortest)
                self._redacted_keys = {}
                if self._values.worth_recompiling():
                    self._compile()

    def text(self, text: str, *, pii: bool = True) -> str:
        """``text`` with every secret value and secret shape replaced, and with personal-data
        shapes replaced too unless ``pii=False``."""
        if len(text) < (self._shortest if pii else self._shortest_secret):
            return text
        text = self._values.sub(PLACEHOLDER, text)
        for replacement, pattern in self._patterns:
            text = pattern.sub(replacement, text)
        if pii:
            for kind, find in self._pii:
                # Right to left, so earlier spans keep their offsets.
                for start, end in reversed(find(text)):
                    text = f"{text[:start]}[REDACTED:{kind}]{text[end:]}"
        return text

    def contains_secret(self, text: str) -> bool:
        """Whether :meth:`text` would change ``text`` for a secret (personal data aside)."""
        return self.text(text, pii=False) != text

    def value(self, value: Any, *, max_text: int | None = None, pii: bool = True) -> Any:
        """``value`` as redacted JSON data; strings longer than ``max_text`` are cut."""
        return self._walk(json_safe(value), max_text, pii)

    def _plain_value(self, value: Any, *, pii: bool = True) -> Any:
        """:meth:`value` of data that :func:`~loomflow._json.json_safe` has already made plain
        (a caller that keeps the plain form too need not walk it twice)."""
        return self._walk(value, None, pii)

    def _walk(self, value: Any, max_text: int | None, pii: bool = True) -> Any:
        if isinstance(value, str):
            out = self.text(value, pii=pii)
            if max_text is not None and len(out) > max_text:
                out = f"{out[:max_text]}…[+{len(out) - max_text} chars]"
            return out
        if isinstance(value, dict):
            # Keys too: a model may key an object by a secret (a header map keyed by the
            # token), and a key is as much on show as a value.
            walked: dict[str, Any] = {}
            for k, v in value.items():
                walked[distinct_key(self._key(k, pii), walked)] = (
                    PLACEHOLDER if self._hides(k) else self._walk(v, max_text, pii)
                )
            return walked
        if isinstance(value, list):
            return [self._walk(v, max_text, pii) for v in value]
        if pii and isinstance(value, int) and not isinstance(value, bool):
            # A card number returned as a JSON number rather than a string.
            text = str(value)
            if self.text(text) != text:
                return self.text(text)
        return value

    def _key(self, key: str, pii: bool) -> str:
        """:meth:`text` of an object key, remembered (keys of up to 128 characters)."""
        kept = self._redacted_keys
        found = kept.get((key, pii))
        if found is None:
            found = self.text(key, pii=pii)
            if len(key) <= 128:
                if len(kept) >= 4096:
                    kept.clear()
                kept[(key, pii)] = found
        return found

    def hides_key(self, key: str) -> bool:
        """Whether the value under the mapping key (or argument name) ``key`` is hidden: a key
        of ``sensitive_keys``, or with ``key_words``, one whose words name a secret."""
        return self._hides(key)

    def seals_key(self, key: str) -> bool:
        """Whether a tool argument named ``key`` is sealed out of the journal by its name alone:
        as :meth:`hides_key`, except for a trailing ``pass`` (``boarding_pass``), which a
        display hides when in doubt. A sealed value is also learned as a secret, so a doubtful
        name would take the value out of the tool results the model reads as well."""
        if not self._hides(key):
            return False
        return _norm_key(key) in self._keys or _names_a_secret(key, _SEALING_LAST_WORDS)

    def _hides(self, key: str) -> bool:
        """Whether the value under ``key`` is hidden, remembered (keys of up to 128 characters)."""
        kept = self._hiding
        found = kept.get(key)
        if found is None:
            found = _norm_key(key) in self._keys or (self._key_words and _names_a_secret(key))
            if len(key) <= 128:
                if len(kept) >= 4096:
                    kept.clear()
                kept[key] = found
        return found

    def arguments(
        self,
        arguments: Mapping[str, Any],
        sensitive: Collection[str] | None,
        *,
        max_text: int | None = None,
    ) -> dict[str, Any]:
        """A tool call's arguments for storage.

        Args:
            arguments: The arguments as the model sent them.
            sensitive: The tool's declared sensitive argument names; ``None`` when the tool is
                not known, in which case every value is hidden.
            max_text: Cut longer strings.

        The names are redacted as any object key is (a secret or personal-data shape in a
        name the model made up becomes its placeholder).
        """
        out: dict[str, Any] = {}
        for name, value in arguments.items():
            key = str(name)
            hidden = sensitive is None or key in sensitive or self._hides(key)
            out[distinct_key(self._key(key, True), out)] = (
                PLACEHOLDER if hidden else self.value(value, max_text=max_text)
            )
        return out


def distinct_key(key: Any, taken: Mapping[Any, Any]) -> Any:
    """``key``, or ``key#2``, ``key#3``... when ``taken`` holds it already: two keys redacted
    to one placeholder (two e-mail addresses) must not merge into one entry."""
    if key not in taken:
        return key
    n = 2
    while f"{key}#{n}" in taken:
        n += 1
    return f"{key}#{n}"


def _spans_of(pattern: re.Pattern[str]) -> Callable[[str], list[tuple[int, int]]]:
    def find(text: str) -> list[tuple[int, int]]:
        return [m.span() for m in pattern.finditer(text) if m.end() > m.start()]

    return find


def _leaves(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int | float):
        out.append(str(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _leaves(v, out)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, BaseModel):  # a sealed argument may be a model or a dataclass
        for name in type(value).model_fields:
            _leaves(getattr(value, name, None), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _leaves(getattr(value, field.name, None), out)


# -- loomflow's own log records -------------------------------------------------------------

SCRUBBED_LOGGERS = ("loomflow", "aiosqlite", "asyncpg")
"""Loggers (and their children) whose records are scrubbed: loomflow's own, and the database
drivers', whose debug records print every statement with its parameters."""

_active: weakref.WeakSet[Redactor] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False


def _scrub(record: logging.LogRecord) -> None:
    redactors = list(_active)
    if not redactors:
        return

    def clean(text: str) -> str:
        for redactor in redactors:
            text = redactor.text(text)
        return text

    try:
        message = record.getMessage()
    except Exception:  # a malformed call still gets logged, as its bare format string
        message = str(record.msg)
    record.msg = clean(message)
    record.args = None
    if record.exc_info and record.exc_info[1] is not None:
        # Formatters print exc_text when it is set; the exception object itself (whose
        # message may hold the secret) is dropped from the record.
        exc = record.exc_info[1]
        record.exc_text = clean("".join(traceback.format_exception(*record.exc_info)).rstrip())
        # ``Type: message``, scrubbed, for handlers that show no traceback (the CLI's one line).
        record.exc_line = clean(_exception_line(exc))
        record.exc_info = None
    elif record.exc_text:
        record.exc_text = clean(record.exc_text)
    if record.stack_info:
        record.stack_info = clean(record.stack_info)


def _exception_line(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:  # a broken __str__ still leaves the type to name
        message = ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def install_log_redaction(redactor: Redactor) -> None:
    """Scrub every record of the :data:`SCRUBBED_LOGGERS` with ``redactor`` (and any
    installed before it) as the record is created, before any handler sees it.

    Records of other loggers (your application's) are left alone. Installed once per process
    by chaining :func:`logging.setLogRecordFactory`; a garbage-collected redactor drops out.
    """
    global _installed
    _active.add(redactor)
    with _install_lock:
        if _installed:
            return
        previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            name = record.name
            if name.split(".", 1)[0] in SCRUBBED_LOGGERS:
                _scrub(record)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True

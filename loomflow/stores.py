"""Where a deployment keeps its data: the one place that builds, migrates and closes the stores.

Five kinds of store hold what loomflow records: the **journal** (``runtime_url``), the
**checkpoints** and the **memory** (always in the journal's database), the **budget** totals
(``budget_url``) and the **audit** log (``audit_url``). The budget and the audit log live
beside the journal, on its connection, unless their URLs name somewhere else; an in-memory
journal keeps them in memory.

:class:`Stores` makes that decision once, for :meth:`Agent.from_settings
<loomflow.Agent.from_settings>`, ``loomflow migrate``, ``loomflow users export`` and every
other command that opens a store. :data:`SCHEMES` is the one table of which URL schemes each
kind accepts, and :func:`store_from_url` the one function turning a URL into a store.

Example:
    >>> stores = Stores(Settings(runtime_url="sqlite:///journal.db"))  # doctest: +SKIP
    >>> for step in (await stores.migrate()).steps:  # doctest: +SKIP
    ...     print(step.message)
    >>> await stores.close()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._ids import check_id, user_label
from ._printable import id_literal, is_unicode
from ._progress import OnProgress
from .config import Settings
from .errors import (
    AuditIntegrityError,
    InvalidIdError,
    ProtectedChainError,
    SessionBusyError,
    UnknownUserError,
    UserError,
)
from .storage import Database
from .storage._schemes import SCHEMES, StoreKind, check_scheme, scheme_of

if TYPE_CHECKING:
    from .audit import AuditStore
    from .checkpoints import CheckpointStore
    from .governance.budget import BucketUsage, BudgetStore, UnreadableBucket
    from .memory import Memory
    from .runtime import JournalRuntime

# "Any user" and "any session" (None is the anonymous bucket, so it cannot mean "any").
_ANY: Any = object()

__all__ = [
    "ForgetReport",
    "MigrationReport",
    "MigrationStep",
    "SCHEMES",
    "StoreKind",
    "Stores",
    "audit_store_for",
    "budget_store_for",
    "journal_database",
    "scheme_of",
    "store_from_url",
]


def store_from_url(
    kind: StoreKind, url: str, *, settings: Settings | None = None, **options: Any
) -> Any:
    """Build (without connecting) the ``kind`` store a URL names.

    Each store package turns its own URLs into stores, after checking the scheme against the
    one table, :data:`SCHEMES`; this picks the package. ``options`` go to the runtime's class
    (``kind="journal"`` only).

    Raises:
        ConfigurationError: the scheme is not one of ``SCHEMES[kind]`` (the message lists
            them), or a file URL is malformed.
    """
    check_scheme(kind, url)  # before any package is loaded
    if kind == "journal":
        from .runtime import runtime_from_url

        return runtime_from_url(url, settings=settings, **options)
    if options:
        raise UserError(f"a {kind} store built from a URL takes no options")
    if kind == "checkpoints":
        from .checkpoints import checkpoint_store_from_url

        return checkpoint_store_from_url(url, settings=settings)
    if kind == "memory":
        from .memory._factory import memory_store_from_url

        return memory_store_from_url(url, settings=settings)
    if kind == "budget":
        from .governance.budget import budget_store_from_url

        return budget_store_from_url(url, settings=settings)
    from .audit import audit_store_from_url

    return audit_store_from_url(url, settings=settings)


# -- placement: what lives beside the journal ---------------------------------------------------


def journal_database(runtime: object) -> Database | None:
    """The SQL database a runtime keeps its journal in (``None`` for an in-memory journal)."""
    database = getattr(runtime, "database", None)
    return database if isinstance(database, Database) else None


def budget_store_for(settings: Settings, database: Database | None) -> BudgetStore | None:
    """``budget_url``'s store, else one in ``database`` (sharing it), else ``None``."""
    from .governance.budget import budget_store_for as placed

    return placed(settings, database)


def audit_store_for(
    settings: Settings, database: Database | None, *, url: str | None = None
) -> AuditStore | None:
    """``url`` (else ``audit_url``)'s store, else one in ``database`` (sharing it), else None."""
    from .audit import audit_store_for as placed

    return placed(settings, database, url=url)


@dataclass(frozen=True)
class MigrationStep:
    """One thing :meth:`Stores.migrate` did.

    Attributes:
        store: ``journal``, ``checkpoints``, ``memory``, ``budget``, ``audit``, ``app role``
            or ``0.20 journal``.
        message: What was done, in one line for an operator.
        version: The schema version now in place, for a SQL store.
    """

    store: str
    message: str
    version: int | None = None


@dataclass
class MigrationReport:
    """What :meth:`Stores.migrate` did, in order.

    Attributes:
        steps: One entry per store migrated, role granted or 0.20 journal handled.
        app_role_granted: Whether ``app_role`` was granted somewhere (it needs PostgreSQL).
    """

    steps: list[MigrationStep] = field(default_factory=list)
    app_role_granted: bool = False

    def versions(self) -> dict[str, int]:
        """Schema version per SQL store migrated."""
        return {s.store: s.version for s in self.steps if s.version is not None}


@dataclass
class ForgetReport:
    """What :meth:`Stores.forget_user` removed, per store (counts only: no personal data).

    Attributes:
        user_id: The user forgotten.
        journal: Journal rows deleted: entries, idempotency results and session rows.
        checkpoints: Checkpoints deleted.
        memory: Memory rows deleted, per kind (episodes, facts, blocks).
        budget: The user's budget buckets deleted (global totals stay).
        audit_erased: Audit payloads erased (the entries stay, chained).
        audit_record_seq: ``seq`` of the ``audit.erasure`` entry recording the forget.
        console_erased: Payloads of console chains (``console:<name>``) erased because they
            named the user: the looks at their trail, searches for them.
    """

    user_id: str | None
    journal: int = 0
    checkpoints: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    budget: int = 0
    audit_erased: int = 0
    audit_record_seq: int | None = None
    console_erased: int = 0

    def deleted(self) -> dict[str, int]:
        """What went from the stores other than the audit log, by store."""
        return {
            "journal": self.journal,
            "checkpoints": self.checkpoints,
            "memory": sum(self.memory.values()),
            "budget": self.budget,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            **self.deleted(),
            "memory_by_kind": dict(self.memory),
            "audit_erased": self.audit_erased,
            "audit_record_seq": self.audit_record_seq,
            "console_erased": self.console_erased,
        }


class Stores:
    """The stores of one deployment, placed as the settings say, built on first use.

    Args:
        settings: Where the URLs come from (default ``Settings()``).
        runtime: A journal to use instead of building ``runtime_url``'s (left for the caller
            to close).
        journal: ``False`` for a deployment without a journal: the audit log is then at
            ``audit_url`` or, unset, ``runtime_url`` (as ``Settings.audit_store_url`` says).
        audit_url: Overrides ``settings.audit_url`` (``loomflow migrate --audit-url``).
        checkpoints_url: Open the checkpoint store at this URL, on a connection of its own,
            instead of beside the journal: ``loomflow checkpoints`` reads snapshots this way so
            that it never opens (and so migrates) the journal it does not need.

    Stores this object builds are closed by :meth:`close` (every one, even if one fails;
    the first failure is raised afterwards). Checkpoints and memory share the journal's
    connection and are closed with it.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        runtime: JournalRuntime | None = None,
        journal: bool = True,
        audit_url: str | None = None,
        checkpoints_url: str | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self._runtime = runtime
        self._journal = journal or runtime is not None
        self._audit_url = audit_url
        self._checkpoints_url = checkpoints_url
        self._built: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Stores(built={sorted(self._built)})"

    def _once(self, kind: str, build: Callable[[], Any]) -> Any:
        if kind not in self._built:
            self._built[kind] = build()
        return self._built[kind]

    @property
    def runtime(self) -> JournalRuntime | None:
        """The journal: the one given, else ``runtime_url``'s (``None`` with ``journal=False``)."""
        if self._runtime is not None or not self._journal:
            return self._runtime
        runtime: JournalRuntime = self._once(
            "journal",
            lambda: store_from_url("journal", self.settings.runtime_url, settings=self.settings),
        )
        return runtime

    @property
    def database(self) -> Database | None:
        """The journal's SQL database, which the stores beside it share."""
        return journal_database(self.runtime)

    @property
    def checkpoints(self) -> CheckpointStore | None:
        """``checkpoints_url``'s store if one was given, else the checkpoint store beside the
        journal (``None`` without a journal)."""
        from .checkpoints import checkpoint_store_for

        if (url := self._checkpoints_url) is not None:
            found: CheckpointStore = self._once(
                "checkpoints", lambda: store_from_url("checkpoints", url, settings=self.settings)
            )
            return found
        runtime = self.runtime
        return None if runtime is None else checkpoint_store_for(runtime)

    @property
    def memory(self) -> Memory | None:
        """Memory beside the journal (``None`` without a journal)."""
        from .memory import memory_for

        runtime = self.runtime
        return None if runtime is None else memory_for(runtime)

    @property
    def budget(self) -> BudgetStore:
        """``budget_url``'s store, else one beside the journal, else an in-memory one."""

        def build() -> BudgetStore:
            from .governance.budget.inmemory import InMemoryBudgetStore

            return budget_store_for(self.settings, self.database) or InMemoryBudgetStore()

        store: BudgetStore = self._once("budget", build)
        return store

    @property
    def audit(self) -> AuditStore:
        """``audit_url``'s store, else one beside the journal; an in-memory journal keeps its
        audit log in memory, and no journal at all means ``runtime_url``'s database."""

        def build() -> AuditStore:
            store = audit_store_for(self.settings, self.database, url=self._audit_url)
            if store is not None:
                return store
            if self.runtime is not None:
                from .audit.inmemory import InMemoryAuditStore

                return InMemoryAuditStore()
            found: AuditStore = store_from_url(
                "audit", self.settings.audit_store_url, settings=self.settings
            )
            return found

        store: AuditStore = self._once("audit", build)
        return store

    def on_postgres(self) -> bool:
        """Whether any store of this deployment lives in PostgreSQL (nothing is connected)."""
        places = (self.database, getattr(self.budget, "db", None), getattr(self.audit, "db", None))
        return any(getattr(db, "backend", None) == "postgres" for db in places)

    async def migrate(
        self, *, app_role: str | None = None, app_login: bool = False, import_legacy: bool = False
    ) -> MigrationReport:
        """Bring every store up to date: a deploy step, run once.

        Migrates the journal, checkpoints, memory (in the journal's database), the budget and
        the audit log (a JSON-lines log is created and its heads checked); with ``app_role``,
        grants that PostgreSQL role what the application needs on each database; then reports
        (or with ``import_legacy`` imports) a loomflow 0.20 journal found in the database.
        """
        if app_role is not None and not self.on_postgres():
            raise UserError("app_role needs a PostgreSQL database; no store here is in one")
        if app_role is not None:
            from .storage._roles import app_role_problem

            if (problem := app_role_problem(app_role)) is not None:
                raise UserError(problem)  # before anything is migrated
        report = MigrationReport()
        grants = _AppRoleGrants(app_role, app_login, report)
        runtime = self.runtime
        if runtime is not None:
            version = await runtime.migrate()
            report.steps.append(
                MigrationStep("journal", f"journal schema at version {version}", version)
            )
        database = self.database
        if runtime is not None and database is not None:
            for kind, store in (("checkpoints", self.checkpoints), ("memory", self.memory)):
                assert store is not None  # there is a journal
                version = await store.migrate()
                report.steps.append(
                    MigrationStep(kind, f"{kind} schema at version {version}", version)
                )
        grants.add(database)
        budget = self.budget
        if budget.backend != "memory":
            version = await budget.migrate()
            report.steps.append(
                MigrationStep("budget", f"budget schema at version {version}", version)
            )
            grants.add(getattr(budget, "db", None))
        audit = self.audit
        from .audit import JsonlAuditStore

        if isinstance(audit, JsonlAuditStore):
            created = await audit.prepare()
            state = "created" if created else "exists, heads checked"
            report.steps.append(
                MigrationStep(
                    "audit",
                    f"audit log (JSON lines) at {audit.path} ({state}; heads {audit.heads_path})",
                )
            )
        elif (migrate := getattr(audit, "migrate", None)) is not None:  # memory has no schema
            version = await migrate()
            report.steps.append(
                MigrationStep("audit", f"audit schema at version {version}", version)
            )
        grants.add(getattr(audit, "db", None))
        # Once every table exists: a grant covers the loomflow tables of its database, and
        # its report line says truly what it covered (the audit table there, or not).
        await grants.grant_all()
        if runtime is not None:
            for line in await _legacy(runtime, do_import=import_legacy):
                report.steps.append(MigrationStep("0.20 journal", line))
        return report

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        """Everything the stores keep about one user (``None``: runs without a user), as one
        JSON-ready document. Reads only.

        ``journal`` holds the user's ``sessions``, their ``entries`` and the results kept
        under the user's idempotency keys (``idempotency``; ``None`` when the journal's
        store cannot list them), each described without its value. ``audit_problems`` lists
        what ``verify`` finds wrong with the user's trail (empty when it is intact). A stored
        audit row that reads as no entry is in ``audit`` in its place as a marker
        (:func:`~loomflow.audit.damaged_row`, no ``hash``), an entry whose payload alone is
        damaged has an ``"unreadable"`` key, and ``counts`` then has ``"damaged audit
        rows"``: the export goes on past them, and says so.
        """
        check_id("user_id", user_id)
        runtime = self.runtime
        sessions = [] if runtime is None else await runtime.sessions(user_id=user_id, limit=10**6)
        entries = []
        for info in sessions:
            assert runtime is not None
            if info.session_id is not None and not is_unicode(info.session_id):
                # A session row whose id is not UTF-8 (storage/_sqlite.read_text) is listed
                # as unreadable; its entries cannot be looked up by that id.
                continue
            for entry in await runtime.entries(info.session_id, user_id):
                entries.append({**dataclasses.asdict(entry), "created_at": _iso(entry.created_at)})
        # Results kept under the user's idempotency keys (they outlive their runs, and
        # forget_user deletes them): None when the journal's store cannot list them.
        keyed = [] if runtime is None else await runtime.idempotency_results(user_id)
        idempotency = (
            None
            if keyed is None
            else [{**dataclasses.asdict(i), "created_at": _iso(i.created_at)} for i in keyed]
        )
        checkpoints: dict[str, Any] = {}
        memory: dict[str, Any] = {}
        if self.database is not None and self.checkpoints is not None and self.memory is not None:
            checkpoints = await self.checkpoints.export_user(user_id)
            memory = await self.memory.export_user(user_id)
        budget = [_budget_json(u) for u in await self._budget_of(user_id)]
        # A row that reads as no entry stands in its place as a marker (damaged_row: no hash,
        # no time), so the rest of the trail is still handed out and the gap is not hidden.
        from .audit import ChainProblem, damaged_row

        audit: list[dict[str, Any]] = []
        damaged = markers = 0
        async for row in self.audit.rows(user_id=user_id):
            if isinstance(row, ChainProblem):
                damaged += 1
                markers += 1
                audit.append(damaged_row(row))
            else:
                damaged += row.unreadable is not None
                audit.append(row.to_json())
        # The trail is shown as stored; what verify finds wrong with it goes along, so an
        # entry edited in the storage is not handed out as the record.
        damage = (await self.audit.verify(user_id=user_id)).problems
        document: dict[str, Any] = {
            "user_id": user_id,
            "exported_at": _iso(dt.datetime.now(dt.UTC)),
            "journal": {
                "sessions": [
                    {
                        **dataclasses.asdict(s),
                        "updated_at": _iso(s.updated_at),
                        # 0: no run began on the row (a claim alone), or one from before
                        # the column: no time to show rather than 1970.
                        "created_at": _iso(s.created_at) if s.created_at else None,
                    }
                    for s in sessions
                ],
                "entries": entries,
                "idempotency": idempotency,
            },
            "checkpoints": checkpoints,
            "memory": memory,
            "budget": budget,
            "audit": audit,
            "audit_problems": [problem.to_json() for problem in damage],
        }
        document["counts"] = {
            "sessions": len(sessions),
            "journal entries": len(entries),
            "idempotency results": len(idempotency or ()),
            "checkpoints": len(checkpoints.get("checkpoints", [])),
            "episodes": len(memory.get("episodes", [])),
            "facts": len(memory.get("facts", [])),
            "blocks": len(memory.get("blocks", [])),
            "audit entries": len(audit) - markers,
        }
        if damaged:
            # Only when there are some: the counts of an intact trail stay as they were.
            document["counts"]["damaged audit rows"] = damaged
        return document

    async def forget_user(self, user_id: str | None, *, actor: str = "loomflow") -> ForgetReport:
        """Erase what the stores keep about one user, for an erasure request.

        Deletes the user's journal entries (open runs' too), idempotency results and session
        rows (``JournalRuntime.forget_user``), checkpoints, memory (episodes, facts, blocks)
        and per-user budget buckets, then erases the payloads of the user's audit entries,
        recording the forget (with these counts and no personal data) as an ``audit.erasure``
        entry in the user's trail. Last, the console's chains (``console:<name>``) lose the
        payloads of the entries that name the user (a look at their trail, a search for
        them), each chain with an ``audit.erasure`` entry of its own listing the seqs, so
        the user's id is left in no payload and every chain still verifies. Each step is
        idempotent, so running it again after a crash finishes the work. Run it as the tables'
        owner: the application role may not erase audit payloads.

        Not erased: the user id itself on the user's own entries and the other fields of audit
        entries (action, time, session and run ids, actor); see docs/audit.md, "Erasure,
        retention and legal hold". A console look at the user after the forget names them
        again; forget again to erase it.

        Raises:
            LegalHoldError: the user, or a console chain naming them, is under legal hold
                (nothing is deleted).
            ProtectedChainError: ``user_id`` is a console chain (``console:<name>``).
            UnknownUserError: no store holds anything about the user.
            SessionBusyError: a run of the user is in progress (its owner would write its
                checkpoints, episode, budget and audit entries back after the erasure);
                cancel it (``loomflow runs cancel``) or let it finish, then forget.
            ErasureRefusedError: the audit store's role may not erase payloads.
            AuditIntegrityError: an entry of the user's trail is damaged (nothing is deleted).
        """
        from .audit.actions import CONSOLE_CHAINS

        check_id("user_id", user_id)
        if user_id is not None and user_id.startswith(CONSOLE_CHAINS):
            raise ProtectedChainError(
                f"{user_id!r} is a console chain, the record of who looked at what: it is not "
                "forgotten (forgetting a user erases the entries of it that name them)",
                user_id=user_id,
            )
        audit = self.audit
        await audit.check_not_held(user_id)
        await audit.check_can_erase()  # before anything is deleted anywhere
        if not await self.knows_user(user_id):
            raise UnknownUserError(
                f"no store holds anything about {user_label(user_id)}"
                + spelled_otherwise(await self.other_spellings(user_id))
            )
        for chain in await self._console_mentions(user_id):
            await audit.check_not_held(chain)  # a held chain keeps its entries: delete nothing
            await self._check_appendable(chain)
        await self._check_appendable(user_id)
        await self._check_trail_readable(user_id)
        runtime = self.runtime
        if runtime is not None:
            await _refuse_live_runs(runtime, user_id)
        report = ForgetReport(user_id)
        if runtime is not None:
            report.journal = await runtime.forget_user(user_id)
        if self.database is not None and self.checkpoints is not None and self.memory is not None:
            report.checkpoints = await self.checkpoints.forget_user(user_id)
            report.memory = await self.memory.forget_user(user_id)
        report.budget = await self.budget.forget_user(user_id)
        done = await audit.erase(user_id, reason="forget", actor=actor, deleted=report.deleted())
        report.audit_erased, report.audit_record_seq = done.erased, done.record_seq
        # Looked up again: a look at the user while the stores were being emptied counts too.
        for chain, seqs in (await self._console_mentions(user_id)).items():
            erased = await audit.erase_entries(chain, seqs, reason="forget", actor=actor)
            report.console_erased += erased.erased
        return report

    async def _check_appendable(self, user_id: str | None) -> None:
        """The erasure records are appends: a trail whose appends the store refuses (a
        JSON-lines log found it damaged) must stop a forget before the other stores are
        emptied, or the user's data would go with no record of the forget in the trail."""
        try:
            await self.audit.check_appendable(user_id)
        except AuditIntegrityError as exc:
            raise AuditIntegrityError(
                f"forget of {user_label(user_id)} stopped before deleting anything: {exc}"
            ) from exc

    async def _check_trail_readable(self, user_id: str | None) -> None:
        """Read the user's audit trail as the erasure will, before anything is deleted: a
        damaged entry (a row edited by hand) must stop a forget here, not after the other
        stores were emptied and with no erasure record written."""
        try:
            await self.audit.check_erasable(user_id)
        except AuditIntegrityError as exc:
            hint = (
                ""
                if "loomflow audit verify" in str(exc)
                else " (see `loomflow audit verify`; the erasure cannot vouch for a damaged trail)"
            )
            raise AuditIntegrityError(
                f"forget of {user_label(user_id)} stopped before deleting anything: {exc}{hint}"
            ) from exc

    async def forget_checkpoints(self, user_id: str | None, *, actor: str = "loomflow") -> int:
        """Delete every checkpoint of one user; returns how many went.

        Refused for a user under legal hold, and while a run of the user is in progress. A
        deletion is noted in the user's audit trail: ``audit.deletion.start`` (how many it
        found) before it, ``audit.deletion`` (how many went) after.

        Raises:
            LegalHoldError: the user is under legal hold (nothing is deleted).
            SessionBusyError: a run of the user is in progress (it would write its next
                snapshot right after the deletion); nothing is deleted.
        """
        check_id("user_id", user_id)
        store = self.checkpoints
        if store is None:
            raise UserError("these stores have no checkpoints (no journal database)")
        await self.audit.check_not_held(user_id)
        if self.runtime is not None:
            await _refuse_live_runs(self.runtime, user_id)
        # Noted before the rows go as well as after (see prune_journal): a forget killed, or
        # whose audit write failed, after its DELETE leaves nothing for a re-run to note.
        counter = getattr(store, "count_user", None)
        found = (
            await counter(user_id)
            if counter is not None
            else len((await store.export_user(user_id)).get("checkpoints", []))
        )
        if found:
            await self._note_deletion(user_id, "checkpoints", found, actor, {}, start=True)
        deleted = await store.forget_user(user_id)
        if deleted:
            await self._note_deletion(user_id, "checkpoints", deleted, actor, {})
        return deleted

    async def prune_journal(
        self,
        *,
        older_than: dt.timedelta | None = None,
        session_id: Any = _ANY,
        user_id: Any = _ANY,
        include_open: bool = False,
        batch_size: int = 5000,
        on_progress: OnProgress | None = None,
        dry_run: bool = False,
        actor: str = "loomflow",
    ) -> int:
        """:meth:`JournalRuntime.prune <loomflow.runtime.JournalRuntime.prune>` that keeps
        everything of the users under legal hold.

        A prune of one user (``user_id``) is refused while they are held, and noted in their
        audit trail when it finds something: ``audit.deletion.start`` before the first batch,
        ``audit.deletion`` after the last.

        Raises:
            LegalHoldError: ``user_id`` is under legal hold (nothing is deleted).
        """
        runtime = self.runtime
        if runtime is None:
            raise UserError("these stores have no journal")
        filters: dict[str, Any] = {}
        if session_id is not _ANY:
            filters["session_id"] = session_id
        if user_id is not _ANY:
            check_id("user_id", user_id)
            await self.audit.check_not_held(user_id)
            filters["user_id"] = user_id
        held = [hold.user_id for hold in await self.audit.legal_holds()]
        filters.update(older_than=older_than, include_open=include_open, keep_users=held)
        noted = user_id is not _ANY and not dry_run
        details: dict[str, Any] = {"include_open": include_open}
        if older_than is not None:
            details["older_than_s"] = older_than.total_seconds()
        if session_id is not _ANY:
            details["session_id"] = session_id
        if noted:
            # Noted before the first row goes: a prune killed part-way (or between its last
            # batch and the note after it) has deleted rows that a re-run no longer finds, so
            # only a note written first keeps that deletion on the user's record.
            found = await runtime.prune(dry_run=True, **filters)
            if found:
                await self._note_deletion(user_id, "journal", found, actor, details, start=True)
        deleted = await runtime.prune(
            batch_size=batch_size, on_progress=on_progress, dry_run=dry_run, **filters
        )
        if noted and deleted:
            await self._note_deletion(user_id, "journal", deleted, actor, details)
        return deleted

    async def _note_deletion(
        self,
        user_id: str | None,
        store: str,
        count: int,
        actor: str,
        details: dict[str, Any],
        *,
        start: bool = False,
    ) -> None:
        from .audit import AuditRecord
        from .audit.actions import AUDIT_DELETION, AUDIT_DELETION_START

        # The start of a deletion counts what it found; its end, what went.
        action, counted = (AUDIT_DELETION_START, "found") if start else (AUDIT_DELETION, "deleted")
        payload = {"store": store, counted: count, **details}
        await self.audit._write(
            AuditRecord(user_id=user_id, actor=actor, action=action, payload=payload)
        )

    async def _console_mentions(self, user_id: str | None) -> dict[str, list[int]]:
        """The entries of console chains whose payload names ``user_id`` (see :func:`_names`),
        by chain. The anonymous bucket has no id to name: nothing is found."""
        from .audit import ChainProblem
        from .audit.actions import CONSOLE_CHAINS, KEPT_BY_ERASURE

        if user_id is None:
            return {}
        found: dict[str, list[int]] = {}
        # Head rows read one by one: another user's damaged head is no reason to refuse this
        # forget (verify reports it).
        async for head in self.audit.iter_head_rows():
            chain = head.user_id
            if chain is None or not chain.startswith(CONSOLE_CHAINS):
                continue
            async for entry in self.audit.entries(user_id=chain):
                if entry.action not in KEPT_BY_ERASURE and _names(entry.payload, user_id):
                    found.setdefault(chain, []).append(entry.seq)
            if chain in found and isinstance(head, ChainProblem):
                # Its erasure record could not be appended: refused before anything goes.
                raise AuditIntegrityError(
                    f"the console chain {chain!r} names {user_label(user_id)}, but {head.detail}"
                )
        return found

    async def _budget_of(self, user_id: str | None) -> list[BucketUsage | UnreadableBucket]:
        """The user's own budget buckets. ``usage(None)`` is every bucket of everyone, so the
        anonymous user's are picked out of it (an export of the anonymous bucket must not
        carry other users' totals). A damaged row is in it as an :class:`UnreadableBucket`
        (a store without ``listing``, one written before it, gives what it can read)."""
        listing = getattr(self.budget, "listing", self.budget.usage)
        if user_id is not None:
            return list(await listing(user_id))
        return [u for u in await listing() if _whose(u) == ("user", None)]

    async def knows_user(self, user_id: str | None) -> bool:
        """Whether any store holds something about the user (``False`` for a mistyped id)."""
        runtime = self.runtime
        if runtime is not None and await runtime.sessions(user_id=user_id, limit=1):
            return True
        if await self.audit.head(user_id) is not None or await self._budget_of(user_id):
            return True
        if self.database is not None and self.checkpoints is not None and self.memory is not None:
            memory = await self.memory.export_user(user_id)
            if any(memory.get(kind) for kind in ("episodes", "facts", "blocks")):
                return True
            if (await self.checkpoints.export_user(user_id)).get("checkpoints"):
                return True
        return False

    async def other_spellings(self, user_id: str | None) -> list[str]:
        """The ids some store knows that are ``user_id`` in another Unicode normalization
        form (NFC, NFD, NFKC, NFKD). Ids are compared code point for code point, so these
        are other users: named when ``user_id`` itself is unknown, they tell an operator
        who typed ``café`` that the user on file spells it with a combining accent."""
        if user_id is None or user_id.isascii():
            return []
        found = []
        for form in sorted({unicodedata.normalize(f, user_id) for f in _FORMS} - {user_id}):
            try:
                check_id("user_id", form)  # NFD is longer: it may be over the limit
            except InvalidIdError:
                continue
            if await self.knows_user(form):
                found.append(form)
        return found

    async def close(self) -> None:
        """Close every store this object built (all of them, even if one fails; the first
        failure is raised afterwards). A ``runtime`` passed in stays open."""
        built, self._built = self._built, {}
        failure: BaseException | None = None
        for store in reversed(built.values()):
            try:
                await store.close()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def __aenter__(self) -> Stores:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _AppRoleGrants:
    """``migrate(app_role=...)``: grant the role once on each PostgreSQL database migrated."""

    def __init__(self, role: str | None, login: bool, report: MigrationReport) -> None:
        self.role = role
        self.login = login
        self.report = report
        self.done: set[str] = set()
        self.databases: list[Database] = []

    def add(self, db: Database | None) -> None:
        """Note a database migrated; :meth:`grant_all` grants there after every migration."""
        if self.role is None or db is None or db.backend != "postgres":
            return
        if all(db is not seen for seen in self.databases):  # a store sharing the journal's
            self.databases.append(db)

    async def grant_all(self) -> None:
        for db in self.databases:
            await self._grant(db)

    async def _grant(self, db: Database) -> None:
        from .storage import grant_app_role

        assert self.role is not None  # add() notes nothing without one
        result = await grant_app_role(db, self.role, login=self.login)
        where = f"{result.database}.{result.schema}"
        if where in self.done:  # the audit log or budget beside the journal
            return
        self.done.add(where)
        self.report.app_role_granted = True
        made = ""
        if result.created:
            made = " (created with LOGIN: set its password)" if self.login else " (created NOLOGIN)"
        elif result.login_granted:
            made = " (existing role given LOGIN: set its password)"
        # Only where the audit table is: a JSON-lines log or another database's is not.
        guarded = "; the audit log is append-only for it" if "loom_audit" in result.grants else ""
        self.report.steps.append(
            MigrationStep(
                "app role",
                f"app role {result.role}{made}: {len(result.grants)} tables and sequences "
                f"granted in {where}{guarded}",
            )
        )


async def _refuse_live_runs(runtime: JournalRuntime, user_id: str | None) -> None:
    """Refuse to forget a user while a run of theirs is in progress: its owner would write
    its snapshots, episode, budget and audit entries back once the stores are emptied."""
    live = await runtime.sessions(user_id=user_id, state="running", limit=5)
    if live:
        sessions = ", ".join(repr(info.session_id) for info in live)
        raise SessionBusyError(
            f"{user_label(user_id)} has a run in progress (session {sessions}): cancel it "
            "(`loomflow runs cancel SESSION --user USER`) or let it finish, then forget; "
            "nothing was deleted"
        )


async def _legacy(runtime: JournalRuntime, *, do_import: bool) -> list[str]:
    """What a loomflow 0.20 journal in the runtime's database holds or, with ``do_import``,
    what was imported of it."""
    from .runtime import import_legacy_journal, inspect_legacy_journal

    if journal_database(runtime) is None:
        if do_import:
            return ["no loomflow 0.20 journal in a memory:// journal: nothing to import"]
        return []
    found = await inspect_legacy_journal(runtime)
    if not do_import:
        return [] if found is None else [found.describe()]
    if found is None:
        return ["no loomflow 0.20 journal in this database: nothing to import"]
    done = await import_legacy_journal(runtime)
    return [
        done.describe(),
        "the 0.20 tables were only read; drop them once the imported runs have resumed",
    ]


def _whose(usage: BucketUsage | UnreadableBucket) -> tuple[str | None, str | None]:
    from .governance.budget import UnreadableBucket

    if isinstance(usage, UnreadableBucket):
        return usage.scope, usage.user_id
    return usage.bucket.scope, usage.bucket.user_id


def _budget_json(usage: BucketUsage | UnreadableBucket) -> dict[str, Any]:
    from .governance.budget import UnreadableBucket

    if isinstance(usage, UnreadableBucket):
        # Shown as the damage it is: what the row still tells, and why, never its figures.
        return {
            "scope": usage.scope,
            "period": usage.period or "all",
            "bucket": usage.key,
            "unreadable": usage.unreadable,
        }
    return {
        "scope": usage.bucket.scope,
        "period": usage.bucket.period or "all",
        **dataclasses.asdict(usage.totals),
        "updated_at": _iso(usage.updated_at),
    }


def _iso(when: float | dt.datetime | None) -> str | None:
    from ._timefmt import iso_time  # the CLI's --json time format, shared by the export

    return iso_time(when)


def _names(payload: Any, user_id: str) -> bool:
    """Whether a console entry's payload names ``user_id``: as the user it viewed (a trail,
    an entry, a run, an export, a refused export), or as the whole text of a search for
    users (case-blind, as the search is: "ALICE" listed alice).

    Not as part of a longer id ("al" in "alice", "bob" in "bob@corp.com": other users, whose
    looks stay on record), nor as one of the entry's own words (a role called "admin", the
    query "users"). A filter inside a viewed trail (a session) is about the viewed user.
    """
    if not isinstance(payload, dict):
        return False
    if payload.get("viewed_user") == user_id:
        return True
    details = payload.get("details")
    search = details.get("search") if isinstance(details, dict) else None
    return isinstance(search, str) and search.strip().casefold() == user_id.casefold()


_FORMS: tuple[Literal["NFC", "NFD", "NFKC", "NFKD"], ...] = ("NFC", "NFD", "NFKC", "NFKD")


def spelled_otherwise(user_ids: list[str]) -> str:
    """The end of a "no store holds anything" message naming :meth:`Stores.other_spellings`."""
    if not user_ids:
        return ""
    named = " and ".join(id_literal(u) for u in user_ids)
    return (
        f"; the same name in another Unicode form is held as {named}, another user (ids "
        "are compared exactly): pass that id to reach them"
    )

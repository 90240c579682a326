"""The seam where budgets, permissions, audit logs, telemetry and guardrails plug into a run.

Each such component is either a :class:`~loomflow.hooks.RunHooks` itself or a
:class:`~loomflow.hooks.HookProvider`, which hands the loop the ``RunHooks`` it acts
through. Two of them are also read directly, through the small protocols below: a budget's
price table (what the run's cost is computed at) and an audit log's redactor (what the agent
seals tool arguments with).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import UserError
from ..hooks import HookProvider, RunHooks, RunPlugin

if TYPE_CHECKING:
    from ..models import ModelPrice
    from ..redaction import Redactor

__all__ = ["HookProvider", "PricedBudget", "RedactingAudit", "RunPlugin", "hooks_of"]


@runtime_checkable
class PricedBudget(Protocol):
    """A budget with a price table of its own; a run's cost is computed at those prices."""

    @property
    def prices(self) -> Mapping[str, ModelPrice]: ...


@runtime_checkable
class RedactingAudit(Protocol):
    """An audit log with a redactor; the agent seals sensitive tool arguments with it."""

    @property
    def redactor(self) -> Redactor: ...


def hooks_of(components: Iterable[object]) -> list[RunHooks]:
    """The hooks of each component, in order; ``None`` entries are skipped.

    Takes ``object``: what a caller passes is checked here, not trusted to match the types.
    """
    hooks: list[RunHooks] = []
    for component in components:
        if component is None:
            continue
        hook = component.as_hooks() if isinstance(component, HookProvider) else component
        if not isinstance(hook, RunHooks):
            raise UserError(
                f"{type(component).__name__} cannot plug into the agent loop: it is not a "
                "RunHooks and has no as_hooks()"
            )
        hooks.append(hook)
    return hooks

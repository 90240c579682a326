"""One run of an agent: the loop's state as attributes, its passes as methods.

:meth:`_Run.events` reads top to bottom: :meth:`~_Run.start` (hooks, the input check, then
recalled memory or a restored snapshot), per turn :meth:`~_Run.model_turn` and, while the
model calls tools, :meth:`~_Run.tool_turn`; then :meth:`~_Run.check_output` and
:meth:`~_Run.finish` (the episode, the result, the hooks). An :class:`Interrupt` from a hook
ends it early through :meth:`~_Run.stop`, any other error through :meth:`~_Run.fail`.

What a hook emits (``info.emit``) reaches every hook once (:meth:`~_Run.to_hooks`), then the
caller's stream (:meth:`~_Run.flush`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel
from ulid import ULID

from .._cleanup import closing, run_cleanup
from .._json import valid_line, valid_text, valid_value
from .._printable import shown
from ..checkpoints import (
    Checkpoint,
    CheckpointRestored,
    CheckpointSaved,
    CheckpointStore,
)
from ..context import RunContext
from ..errors import (
    CheckpointError,
    CorruptEntryError,
    MemoryEntryTooLargeError,
    OutputValidationError,
    UserError,
)
from ..governance.approvals import ApprovalPending, PendingApproval, journaled_request
from ..hooks import Interrupt, RunHooks, RunInfo
from ..memory import AgentMemory, Episode, Memory
from ..messages import (
    Message,
    ModelResponse,
    ModelSettings,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from ..models.pricing import normalize_prices, warn_unpriced
from ..redaction import Redactor
from ..runtime import JournalRun, JournalRuntime, OpenRun, Runtime, codec
from ..runtime._expect import expecting
from ..runtime._journal import Encoded
from ..runtime._names import tool_step, tool_step_name
from ..tools import TOOL_ERROR, ToolOutcome
from ._output import TEXT_OUTPUT, StructuredOutput, contract_digest
from ._sealing import SealedValueLost, Sealer
from ._seams import PricedBudget
from ._types import ModelDeltaEvent, RunFinished, RunResult, ToolCallFinished, ToolCallStarted

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["check_prompt", "contract_mismatch", "latest_of_run", "tool_step_name"]

log = logging.getLogger("loomflow.agent")

# Finish reasons of an answer the model did not finish, with what the log says of each: at
# its output limit, declined (Anthropic's refusal) or stopped by the provider's content filter,
# or a turn Anthropic paused (pause_turn: its server tools ran long; loomflow offers none, and
# does not send the turn back to go on).
_CUT_SHORT = {
    "length": "the answer is cut short (raise ModelSettings.max_tokens)",
    "content_filter": "the answer is cut short: the model declined to answer, or a content "
    "filter stopped it",
    "pause_turn": "the provider paused the turn before it ended, and loomflow does not "
    "continue it: the answer is unfinished",
}


class _Run:
    """The state of one run in progress; :meth:`events` runs it."""

    def __init__(
        self,
        agent: Agent,
        runtime: Runtime,
        ctx: RunContext,
        open_run: OpenRun | None,
        prompt: str,
        history: Sequence[Message],
        *,
        store: CheckpointStore | None,
        restore: Checkpoint | None,
        forked: bool,
        memory: AgentMemory | None,
        structured: StructuredOutput | None = None,
    ) -> None:
        self.agent = agent
        self.runtime = runtime
        self.ctx = ctx
        # A budget's own price table (its prices= overrides) is what the run is charged at.
        # Looked up once: a protocol isinstance check costs microseconds on every model call.
        # Without a budget there is nothing to look up (the check walks the protocol's
        # attributes even for None: about 470 bytecodes a run).
        budget = agent.budget
        prices = (
            normalize_prices(budget.prices)
            if budget is not None and isinstance(budget, PricedBudget)
            else None
        )
        self.open_run = open_run  # None without a journal
        self.epoch: int | None = open_run.epoch if open_run is not None else None
        self.prompt = prompt
        self.original_prompt = prompt  # what a later resume's prompt is compared with
        self.history = history
        self.store = store  # where snapshots go (Tuning(checkpoint=True)), if anywhere
        self.restore = restore  # the snapshot the run continues from, if any
        self.forked = forked  # restore is another session's snapshot
        self.memory = memory  # None inside another run, or with memory=False
        self.structured = structured  # the output_type contract, if the run has one
        self.parsed: BaseModel | None = None
        self.hooks: Sequence[RunHooks] = agent._hooks
        self.before = _counts(open_run)  # the journal's tallies before this run
        self.pending: list[BaseModel] = []  # emitted, not yet seen by the hooks
        self.handed: list[BaseModel] = []  # seen by the hooks, not yet yielded
        self.info = RunInfo(
            ctx=ctx,
            agent_name=agent.name,
            model_name=agent.model.name,
            provider=agent.model.provider,
            backend=runtime.backend,
            prompt=prompt,
            epoch=self.epoch,
            resumed=(open_run is not None and open_run.resumed) or restore is not None,
            tools=agent.tools,
            runtime=runtime,
            redactor=agent._redactor,
            prices=prices,
            _emit=self.pending.append,
        )
        self.sealer = Sealer(
            agent.tools,
            agent._redactor,
            results=agent._sealed_results,
            arguments=agent._sealed_arguments,
        )
        # The transcript and its tallies: what a snapshot holds and the result reports.
        self.messages: list[Message] = []
        self.prompt_index = 0  # where the run's own messages start (after system and history)
        # The snapshot a forked run continues (its snapshots carry it as parent_id): its
        # episode starts after the system prompt, since its session recalls nothing earlier.
        self.fork_of: str | None = None
        self.usage = Usage()
        self.cost = 0.0
        self.output = ""
        self.turns = 0
        self.interrupted: str | None = "max_turns"
        self.answered = False  # a restored snapshot that already holds the final answer
        self.checking_output = False  # an Interrupt now blocks the final answer
        # The turn in progress.
        self.tool_calls: list[ToolCall] = []  # what the last model response asked for
        self.live_model = False  # the model call ran (it was not replayed)
        self.tokens: list[object] = []  # what each hook's before_model_call returned
        self.live_tools: set[str] = set()  # tool steps that ran (were not replayed)
        self.awaiting: list[PendingApproval] = []  # calls of the turn waiting for a person
        self.transcript = codec.GrowingHasher()  # the fingerprint state of self.messages

    # -- the run, top to bottom ------------------------------------------------------------

    async def events(self) -> AsyncGenerator[BaseModel, None]:
        """Run to the end; the stream of events, :class:`RunFinished` last."""
        try:
            for event in await self.start():
                yield event
            # Turn numbers continue from a restored snapshot, so model_call_<turn> keys match
            # what the journal holds for this run.
            for turn in range(self.turns, self.turns if self.answered else self.agent.max_turns):
                # aclosing: an abandoned stream closes the turn here, before the hooks hear of
                # the run's end, as it would if the turn's code were written inline.
                async with contextlib.aclosing(self.model_turn(turn)) as model_events:
                    async for event in model_events:
                        yield event
                if self.interrupted is None:  # answered without calling a tool
                    break
                async with contextlib.aclosing(self.tool_turn(turn)) as tool_events:
                    async for event in tool_events:
                        yield event
            if self.interrupted is None:
                await self.check_output()
                if not self.answered:  # a restored answer is in its snapshot already
                    # After the output checks: a snapshot holds the answer as they left it,
                    # and none of one they blocked.
                    await self.save(final=True)
        except Interrupt as interrupt:
            for event in await self.stop(interrupt):
                yield event
        except BaseException as exc:
            await self.fail(exc)
            raise
        for event in await self.finish():
            yield event

    async def start(self) -> list[BaseModel]:
        """Tell the hooks, then build the transcript: fresh, or from the restored snapshot."""
        restore = self.restore
        if restore is not None and self.forked:
            # The fork's session was claimed when its run opened. Its first snapshot goes in
            # before any hook can fail (or the process die in one): without it, a resume of
            # the fork would start the errand again from its prompt.
            self.load(restore)
            await self.save(restore.final)
        for hook in self.hooks:
            await hook.run_started(self.info)
        if restore is None:
            prompt = self.prompt
            # The history is the caller's text as much as the prompt is: an input guardrail
            # must not be got round by putting what it stops there.
            history = list(self.history)
            for hook in self.hooks:
                history = await hook.check_history(self.info, history)
                prompt = await hook.check_input(self.info, prompt)
            recalled = await self.recall()
            if recalled:
                # What memory recalls reaches the model as the history does: through the
                # same input checks (recall is the same on a replay, so is what they leave).
                for hook in self.hooks:
                    recalled = await hook.check_history(self.info, recalled)
            self.messages = [
                Message.system(self.agent.instructions),
                *recalled,
                *history,
                Message.user(prompt),
            ]
            self.prompt_index = len(self.messages) - 1
        elif not self.forked:
            self.load(restore)
        events = await self.flush()
        if self.answered:
            self.interrupted = None
        return events

    def load(self, restore: Checkpoint) -> None:
        """Restored, not replayed: earlier turns are neither re-run nor re-billed (no hook
        sees them again) and memory is not consulted: the snapshot holds it all."""
        self.original_prompt = restore.prompt
        self.messages = list(restore.messages)
        self.usage, self.cost, self.output = restore.usage, restore.cost_usd, restore.output
        self.turns, self.answered = restore.turn, restore.final
        self.prompt_index = restore.prompt_index
        # A forked run, or a snapshot of one (resumed after a crash): see fork_of.
        self.fork_of = restore.id if self.forked else restore.parent_id
        self.info.emit(
            CheckpointRestored(
                checkpoint_id=restore.id,
                turn=restore.turn,
                forked_from=restore.session_id if self.forked else None,
            )
        )

    async def model_turn(self, turn: int) -> AsyncGenerator[BaseModel, None]:
        """One journaled model call, streamed; an answer without tool calls ends the run."""
        response: ModelResponse | None = None
        self.live_model = False
        self.tokens = [None] * len(self.hooks)
        name = f"model_call_{turn}"
        try:
            with expecting(name, _is_model_reply, "a model call's chunks and its response"):
                step = self.runtime.stream_step(
                    name,
                    functools.partial(self._call_model, turn),  # the turn is not a step input
                    # With a journal, a snapshot that hashes only the messages added since the
                    # last call (the step's fingerprint); without one, nothing hashes it.
                    self.transcript.snapshot(self.messages)
                    if self.open_run is not None
                    else list(self.messages),
                    self.agent._specs,
                    self.agent._settings,
                    # Only runs with an output_type add this input: other runs keep their keys.
                    *(self.structured.step_inputs if self.structured is not None else ()),
                )
                # Closed here when the stream is abandoned: the model call's hooks (a budget
                # giving its hold back) must hear of it before the run's end does.
                async with closing(step) as chunks:
                    async for chunk in chunks:
                        if isinstance(chunk, ModelResponse):
                            response = chunk
                        elif isinstance(chunk, TextDelta | ToolCallDelta):
                            yield ModelDeltaEvent(
                                turn=turn, delta=chunk, replayed=not self.live_model
                            )
        finally:
            for event in await self.flush():
                yield event
        if response is None:
            raise UserError(f"model {self.agent.model.name!r} ended a stream without a response")
        # Ids for calls the model left without, the same way when the journal replays it.
        response = _with_call_ids(response, turn)
        live = self.live_model
        # One attribute a turn: what a budget sizes a replayed call by (see RunInfo).
        self.info._replayed_request = None if live else (self.messages, self.agent._settings)
        for hook, token in zip(self.hooks, self.tokens, strict=True):
            await hook.after_model_call(
                self.info, turn, response, replayed=not live, token=token if live else None
            )
        self.turns += 1
        self.usage = self.usage + response.usage
        self.cost += self._cost(response)
        self.messages.append(response.to_message())
        self.output = response.text or self.output
        self.tool_calls = list(response.tool_calls)
        if live and not self.tool_calls and response.finish_reason in _CUT_SHORT:
            # The run still ends as answered (the text is what the model said); the log says
            # it is not the whole answer, which nothing else would.
            log.warning(
                "agent %r: model %r stopped its answer at turn %d with finish_reason %r: %s",
                self.agent.name,
                self.agent.model.name,
                turn,
                response.finish_reason,
                _CUT_SHORT[response.finish_reason],
            )
        if not self.tool_calls:
            if self.structured is not None:
                try:
                    retry = self.structured.retry_message(
                        self.messages,
                        self.prompt_index,
                        at_limit=response.finish_reason == "length",
                    )
                except OutputValidationError as refused:
                    cut = _CUT_SHORT.get(response.finish_reason)
                    if cut is not None:  # why it did not parse, which the JSON error hides
                        refused = OutputValidationError(
                            refused.output_type,
                            f"{refused.detail} (finish_reason {response.finish_reason!r}: {cut})",
                            refused.attempts,
                            refused.output,
                        )
                    raise await self.checked_refusal(refused) from None
                if retry is not None:  # ask again; the (empty) tool turn saves the snapshot
                    self.messages.append(retry)
                    return
            self.interrupted = None  # answered; events() checks the answer, then saves

    async def tool_turn(self, turn: int) -> AsyncGenerator[BaseModel, None]:
        """The tool calls of the last response, each a journaled step; results to the model."""
        calls = self.tool_calls
        for slot, call in enumerate(calls):
            yield ToolCallStarted(turn=turn, slot=slot, call=call)
        steps = [self.call_tool(turn, slot, call) for slot, call in enumerate(calls)]
        try:
            # A single call is awaited as in sequential mode: gather would wrap it in a task
            # of its own, one more loop iteration per turn for nothing to overlap.
            if self.agent.tuning.parallel_tools and len(steps) > 1:
                outcomes = await asyncio.gather(*steps)
            else:
                outcomes = [await step for step in steps]
        finally:
            for event in await self.flush():
                yield event
        if self.awaiting:
            # The turn's other calls ran (and are journaled); the run stops for the rest. In
            # the order of the calls, not of parallel checks finishing: the result lists them.
            self.awaiting.sort(key=lambda r: r.slot)
            raise ApprovalPending(list(self.awaiting))
        for slot, (call, (outcome, replayed)) in enumerate(zip(calls, outcomes, strict=True)):
            for hook in self.hooks:
                await hook.after_tool_call(self.info, turn, slot, call, outcome, replayed=replayed)
            self.messages.append(
                Message.tool_result(
                    call.id, outcome.as_text(), name=call.name, is_error=not outcome.ok
                )
            )
            yield ToolCallFinished(
                turn=turn, slot=slot, call=call, outcome=outcome, replayed=replayed
            )
        await self.save(final=False)
        for event in await self.flush():
            yield event

    async def check_output(self) -> None:
        """Let the hooks check (or rewrite) the final answer."""
        self.checking_output = True
        answer = checked = self.output
        self.output = ""  # an answer a guardrail blocks must not leave
        for hook in self.hooks:
            checked = await hook.check_output(self.info, checked)
        self.output = checked
        last = self.messages[-1] if self.messages else None
        said = last is not None and last.role == "assistant" and last.content == answer
        if checked != answer and last is not None and said:
            # Rewritten (redacted): the transcript, the snapshot and the episode carry what the
            # hooks let through. The journal keeps the model's answer as it came: a replay
            # needs it, and checks it again the same way.
            self.messages[-1] = last.model_copy(update={"content": checked})
        if self.structured is not None:
            self.parsed = self.structured.parse(checked)

    async def checked_refusal(self, refused: OutputValidationError) -> OutputValidationError:
        """``refused`` carrying the last answer as the output guardrails leave it.

        The error hands the answer to the caller as a final answer would be: a blocking
        guardrail interrupts the run instead (its Interrupt propagates), a redacting one
        rewrites what the error holds.
        """
        self.checking_output = True  # a block keeps the answer out of the transcript
        shown, self.output = self.messages[-1].content, ""  # nor may the result hold it
        for hook in self.hooks:
            shown = await hook.check_output(self.info, shown)
        self.checking_output = False
        return OutputValidationError(refused.output_type, refused.detail, refused.attempts, shown)

    async def stop(self, interrupt: Interrupt) -> list[BaseModel]:
        """A hook interrupted the run: it returns, with the hook's reason."""
        self.interrupted = interrupt.reason
        if not isinstance(interrupt, ApprovalPending):
            self.awaiting = []
        if self.checking_output and self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()  # the blocked answer stays out of the transcript and episode
        return await self.flush()

    async def fail(self, exc: BaseException) -> None:
        """The run raised: the hooks hear of it; ``exc`` stays the error raised (see _cleanup)."""
        # Hooks still see what was emitted before the failure (a BudgetUnavailable, say):
        # the audit log records it before the failed run's end.
        with contextlib.suppress(Exception):
            await self.flush()
        await self._finished_with(exc)

    async def finish(self) -> list[BaseModel]:
        """Record the episode, build the result and tell the hooks; the closing events."""
        if self.memory is not None:
            try:
                await self.persist_episode(self.memory)
            except BaseException as exc:
                await self._finished_with(exc)
                raise
        result = self.result()
        # What the run emitted (an output guardrail's finding, say) reaches the hooks, and so
        # the audit log, before the run's end does; if that fails, they hear of the failure.
        try:
            events = await self.flush()
        except BaseException as exc:
            await self._finished_with(exc)
            raise
        for index, hook in enumerate(self.hooks):
            try:
                await hook.run_finished(self.info, result, None)
            except BaseException as exc:
                # The caller gets this error (an audit store that failed to record the run's
                # end, say): the hooks not told yet hear of the run's end as that failure,
                # not never (telemetry ends the run's span and counts the run there).
                for later in self.hooks[index + 1 :]:
                    await run_cleanup(
                        exc, "a hook's run_finished", later.run_finished(self.info, None, exc)
                    )
                raise
        return [*events, *await self.flush(), RunFinished(result=result)]

    def result(self) -> RunResult:
        hits, misses = _counts(self.open_run)
        return RunResult(
            output=self.output,
            turns=self.turns,
            tokens_in=self.usage.input_tokens,
            tokens_out=self.usage.output_tokens,
            cost_usd=round(self.cost, 10),
            session_id=self.ctx.session_id or "",
            run_id=self.ctx.run_id or "",
            interrupted=self.interrupted is not None,
            interruption_reason=self.interrupted,
            messages=self.messages,
            replayed_steps=hits - self.before[0],
            fresh_steps=misses - self.before[1],
            restored_from=self.restore.id if self.restore is not None else None,
            parsed=self.parsed,
            pending_approvals=self.awaiting,
        )

    # -- events ----------------------------------------------------------------------------

    async def to_hooks(self) -> None:
        """Hand every emitted event to every hook once; :meth:`flush` then yields them.

        A tool step calls this before its body runs, so the audit trail records a permission
        decision before the tool execution it allowed.
        """
        while self.pending:
            event = self.pending.pop(0)
            for hook in self.hooks:
                await hook.on_event(self.info, event)
            self.handed.append(event)

    async def flush(self) -> list[BaseModel]:
        """The emitted events, once every hook has seen them, for the caller's stream."""
        await self.to_hooks()
        out = self.handed[:]
        self.handed.clear()
        return out

    async def _finished_with(self, exc: BaseException) -> None:
        for hook in self.hooks:
            await run_cleanup(exc, "a hook's run_finished", hook.run_finished(self.info, None, exc))

    # -- the model -------------------------------------------------------------------------

    async def _call_model(
        self,
        turn: int,
        msgs: list[Message],
        tools: list[ToolSpec],
        settings: ModelSettings,
        *_output: object,  # the output format, which self.structured holds
    ) -> AsyncIterator[Any]:
        """The live model call of ``turn`` (the journal calls it unless it replays the turn)."""
        self.live_model = True
        hooks, tokens = self.hooks, self.tokens
        for i, hook in enumerate(hooks):
            try:
                # What earlier hooks emitted (a budget warning) is recorded before the audit
                # log's model.start.
                await self.to_hooks()
                tokens[i] = await hook.before_model_call(self.info, turn, msgs, settings)
            except BaseException as exc:
                # Hooks that already reserved (a budget, say) must get it back.
                for earlier, token in zip(hooks[:i], tokens[:i], strict=True):
                    await run_cleanup(
                        exc,
                        "a hook's model_call_failed",
                        earlier.model_call_failed(self.info, turn, exc, token),
                    )
                raise
        answer: ModelResponse | None = None
        first = True  # the first delta ends the time to first chunk
        try:
            # Hooks and the journal keep sealed tool results; the model reads them.
            unsealed = self.sealer.unseal_messages(msgs)
            model = self.agent.model
            if self.structured is not None:
                stream = self.structured.open_stream(model, unsealed, tools, settings)
            else:
                stream = model.stream(unsealed, tools=tools, settings=settings)
            async with contextlib.aclosing(self.sealer.stream(stream)) as sealed:
                async for chunk in sealed:
                    if isinstance(chunk, ModelResponse):
                        # Journaled as the run keeps it: a lone surrogate in its text (half
                        # an emoji) becomes U+FFFD, so a replay needs no second look.
                        chunk = answer = _valid_answer(chunk)
                    elif first:
                        first = False
                        for hook, token in zip(hooks, tokens, strict=True):
                            await hook.model_first_chunk(self.info, turn, token=token)
                    yield chunk
        except BaseException as exc:
            for hook, token in zip(hooks, tokens, strict=True):
                await run_cleanup(
                    exc,
                    "a hook's model_call_failed",
                    hook.model_call_failed(self.info, turn, exc, token),
                )
            raise
        if answer is not None:
            # Before the journal write: a response that was received and paid for is on
            # record even if journaling it fails.
            for hook, token in zip(hooks, tokens, strict=True):
                await hook.model_call_finished(self.info, turn, answer, token=token)

    def _cost(self, response: ModelResponse) -> float:
        # The budget's rule and table (the audit's model.call entries use the same).
        value = self.info.cost_usd(response)
        if value is None:
            # Named as the call asked for it: what a prices= table has to key it by.
            warn_unpriced(self.info.model_name)
            return 0.0
        return value

    # -- tools -----------------------------------------------------------------------------

    async def call_tool(self, turn: int, slot: int, call: ToolCall) -> tuple[ToolOutcome, bool]:
        """One tool call as a journaled step: its outcome, and whether it was replayed."""
        # The arguments come back printed: the step's fingerprint reuses the text its name
        # hashed.
        step, arguments = tool_step(turn, slot, call)
        live = functools.partial(self._live_tool_call, turn, slot, call, step)
        try:
            with expecting(step, _is_outcome, "a tool outcome"):
                # The journal hands back an Encoded result's value.
                outcome = cast(
                    ToolOutcome, await self.runtime.step(step, live, call.name, arguments)
                )
        except ApprovalPending as pending:  # collected: tool_turn stops the run after the turn
            self.awaiting.extend(pending.requests)
            return _AWAITING, False
        return outcome, step not in self.live_tools

    async def _live_tool_call(
        self,
        turn: int,
        slot: int,
        call: ToolCall,
        step: str,
        tool_name: str,
        arguments: dict[str, Any],
    ) -> ToolOutcome | Encoded:
        """What the journal runs for a tool call it does not replay: hooks, then the tool."""
        self.live_tools.add(step)
        executed = False
        try:
            current = self.sealer.unseal(call)  # the real values, for this invocation only
            gone: SealedValueLost | None = None
        except SealedValueLost as lost:
            # Resumed in a process that does not hold the values. A decision journaled on
            # the call's approval request may still settle it (a denial, or an edit that
            # gives every value): the hooks apply it. Without one the model is told.
            current, gone = call, lost
        asked = current  # what the model asked for; a hook (an approver's edit) may replace it
        if gone is not None and journaled_request(self.info, turn, slot) is None:
            outcome = self.sealer.lost(gone)
        else:
            answer: ToolOutcome | None = None
            tool = self.agent.tools.get(tool_name)  # None: a name the model made up
            checking = len(self.agent._checks)
            for index, hook in enumerate(self.hooks):
                checked = await hook.before_tool_call(self.info, turn, slot, current, tool)
                if index >= checking and _rewritten(checked, current):
                    # Rewritten after the permission check: what runs is checked too.
                    checked = await self._checked_again(turn, slot, cast(ToolCall, checked))
                if isinstance(checked, ToolOutcome):
                    answer = checked  # denied (or answered) without running the tool
                    break
                current = checked
            await self.to_hooks()  # the decisions just emitted, before what they decided
            if answer is None and gone is not None:
                try:  # allowed as asked: the values are still gone, unless an edit gave them
                    current = self.sealer.unseal(current)
                except SealedValueLost as lost:
                    answer = self.sealer.lost(lost)
            if answer is not None:
                outcome = answer
            elif self.agent.tools.get(current.name) is None:
                # A name the model made up: nothing starts, so the audit trail's tool.call
                # says executed=false (it lists only executions that really began).
                outcome = await self.agent.tools.invoke(current.name, current.arguments)
            else:
                # Announced before the body runs: a crash inside it still leaves a trace.
                # Hooks see the call as it runs (an approver's edit, if a hook made one),
                # sealed as every other hook's call is: ``current`` holds the real values.
                started = call if current is asked else self.sealer.seal_call(current)
                for hook in self.hooks:
                    await hook.tool_started(self.info, turn, slot, started, step)
                executed = True
                with self.runtime.subrun(step):  # steps the tool makes key under this call
                    outcome = await self._run_tool(current.name, current.arguments)
            for hook in self.hooks:
                outcome = await hook.check_tool_result(self.info, turn, slot, call, outcome)
        # Journaled and shown to hooks without secrets, and sealed if the tool says so.
        outcome = self.sealer.seal_result(call.name, self.sealer.scrub(outcome, current))
        outcome, raw = _fit_payload(outcome, call.name, self.runtime.max_payload_bytes)
        for hook in self.hooks:
            await hook.tool_finished(
                self.info, turn, slot, call, outcome, step=step, executed=executed
            )
        if raw is not None and isinstance(self.runtime, JournalRuntime):
            # Sized by its encoding: the journal stores that instead of encoding it again.
            return Encoded(outcome, raw)
        return outcome

    async def _checked_again(self, turn: int, slot: int, call: ToolCall) -> ToolCall | ToolOutcome:
        """``call``, as a hook rewrote it, through the checking hooks once more."""
        tool = self.agent.tools.get(call.name)
        for hook in self.agent._checks:
            checked = await hook.before_tool_call(self.info, turn, slot, call, tool)
            if isinstance(checked, ToolOutcome):
                return checked
            call = checked  # an approver's edit of the rewritten call
        return call

    async def _run_tool(self, tool_name: str, arguments: dict[str, Any]) -> ToolOutcome:
        tools, timeout = self.agent.tools, self.agent.tuning.tool_timeout
        tool = tools.get(tool_name)
        if tool is None or timeout is None or tool.timeout is not None:
            return await tools.invoke(tool_name, arguments)
        try:
            async with asyncio.timeout(timeout):
                return await tool.invoke(arguments)
        except TimeoutError:
            return ToolOutcome(
                ok=False,
                error_type="timeout",
                error=f"tool {tool_name!r} took longer than {timeout:g}s",
            )

    # -- checkpoints and memory ------------------------------------------------------------

    async def save(self, final: bool) -> None:
        """Snapshot the transcript (``Tuning(checkpoint=True)``); a forked run's snapshots
        name the one it was forked from, so that its resume knows it is one."""
        if self.store is None or self.epoch is None:
            return  # no snapshots asked for (a store always comes with a journal's epoch)
        if isinstance(self.open_run, JournalRun) and not self.open_run.claimed:
            # A resume of a closed run that has only replayed so far writes nothing (it holds
            # no turn): its passes were snapshotted when they ran, or never were, and these
            # would push the snapshots of a newer run out of the retention.
            return
        snapshot = Checkpoint(
            id=str(ULID()),
            session_id=self.ctx.session_id or "",
            user_id=self.ctx.user_id,
            run_id=self.ctx.run_id or "",
            epoch=self.epoch,
            turn=self.turns,
            final=final,
            prompt=self.original_prompt,
            output=self.output,
            messages=list(self.messages),
            prompt_index=self.prompt_index,
            usage=self.usage,
            cost_usd=round(self.cost, 10),
            parent_id=self.fork_of,
            output_type=self.structured.type.__qualname__ if self.structured else None,
            output_format=contract_digest(self.structured),
        )
        retention = self.agent.tuning.checkpoint_retention
        if isinstance(self.runtime, JournalRuntime):
            # Not over the snapshots of whoever took the run over: fenced on the run's token.
            saved = await self.runtime.put_checkpoint(
                self.store, snapshot, retention=retention, name=f"checkpoint_{self.turns}"
            )
        else:
            saved = await self.store.put(snapshot, retention=retention)
        self.info.emit(CheckpointSaved(checkpoint_id=saved.id, turn=self.turns, final=final))

    async def recall(self) -> list[Message]:
        """What memory reminds the run of: the episodes of *earlier* runs of (session, user).

        Only runs journaled at a lower epoch than this one count. A run that is replayed, even
        after it finished and recorded its own episode, therefore recalls exactly what it
        recalled the first time, so its first model call has the same inputs and replays.
        """
        if self.memory is None or self.ctx.session_id is None:
            return []
        strict = self.open_run is not None and self.open_run.strict
        session = self.ctx.session_id

        def left_out(exc: CorruptEntryError) -> None:
            # One damaged episode costs the run that episode, not the session's whole memory:
            # re-recording never rewrites an earlier run's row, so it would hide it for good.
            # One over the recall's byte cap is left out alike on every replay: never raised.
            if strict and not isinstance(exc, MemoryEntryTooLargeError):
                raise exc
            log.warning("an episode of session %r is left out of memory: %s", session, exc)

        # Without a journal the epoch is None: every episode is earlier.
        try:
            if isinstance(self.memory, Memory):
                return await self.memory.history(
                    session, user_id=self.ctx.user_id, before_epoch=self.epoch, on_damaged=left_out
                )
            return await self.memory.history(
                session, user_id=self.ctx.user_id, before_epoch=self.epoch
            )
        except CorruptEntryError:
            # Like a damaged journal entry or checkpoint: one bad row must not fail every
            # later run of the session. Strict runs raise.
            if strict:
                raise
            log.warning(
                "the memory of session %r cannot be read; this run goes on without it",
                self.ctx.session_id,
                exc_info=True,
            )
            return []

    async def persist_episode(self, memory: AgentMemory) -> None:
        """Record the run's turns as an episode, in a journaled step with a per-run key.

        The key names the run's position in the journal (session, user, epoch), not its run
        id, so a replay or a retry after a crash between the write and its journal entry lands
        on the same episode: the store replaces it instead of adding one. Replayed with the
        same inputs, the step is a journal hit and memory is not touched at all.

        Secrets are redacted from what is stored (tool arguments and results are already
        sealed and scrubbed; a prompt may still hold a key). That happens inside the step, so
        the step's inputs, and with them its journal key, do not depend on what the redactor
        has learned.
        """
        # A forked run's episode starts after the system prompt: its session has no episodes
        # of its own to recall the forked history from.
        start = 1 if self.fork_of is not None else self.prompt_index
        own = _answered(self.messages[start:])
        ctx = self.ctx
        if not own or ctx.session_id is None:
            return
        # Without a journal there is no replay: the run id is as stable as the run.
        position: list[object] = (
            ["epoch", self.epoch] if self.epoch is not None else ["run", ctx.run_id]
        )
        key = json.dumps([ctx.session_id, ctx.user_id, *position], ensure_ascii=False)
        turns = sum(1 for m in own if m.role == "assistant")
        write = functools.partial(self._write_episode, memory)
        await self.runtime.step(f"persist_episode_{turns}", write, key, own, self.output)

    async def _write_episode(
        self, memory: AgentMemory, key: str, messages: list[Message], output: str
    ) -> str:
        redactor = self.agent._redactor
        session = self.ctx.session_id or ""
        fields: dict[str, Any] = {
            "user_id": self.ctx.user_id,
            "key": key,
            "messages": [_redacted(redactor, m) for m in messages],
            "output": redactor.text(output),
            "run_id": self.ctx.run_id,
            "epoch": self.epoch,
        }
        if isinstance(self.runtime, JournalRuntime):
            # Not over the episode of whoever took the run over: fenced on the run's token.
            episode: Episode = await self.runtime.record_episode(
                memory, session, name="persist_episode", **fields
            )
        else:
            episode = await memory.record_episode(session, **fields)
        return episode.id


# -- helpers the agent uses before a run starts ----------------------------------------------


def check_prompt(checkpoint: Checkpoint, prompt: str) -> None:
    if checkpoint.prompt != prompt:
        raise UserError(
            f"checkpoint {checkpoint.id} of session {checkpoint.session_id!r} was taken for "
            f"the prompt {checkpoint.prompt[:60]!r}, not {prompt[:60]!r}: resume with the "
            "original prompt, or use run() for a new request"
        )


def contract_mismatch(checkpoint: Checkpoint, structured: StructuredOutput | None) -> str | None:
    """How the snapshot's output contract differs from the run's, if it does.

    The output format keys every model call, so a run under another contract replays none of
    the journaled ones; restoring the snapshot instead would validate an answer given for one
    type into another. A snapshot that does not record its contract (written by an earlier
    loomflow) is taken as it always was.
    """
    stored = checkpoint.output_format
    if stored is None or stored == contract_digest(structured):
        return None
    now = "none" if structured is None else structured.type.__qualname__
    if stored == TEXT_OUTPUT:
        was = "a run without output_type"
    elif checkpoint.output_type == now:  # the same name, another schema (a changed model)
        was = f"a run whose output_type {now} had another schema (format {stored[:12]}…)"
    else:
        name = checkpoint.output_type or "another model"
        was = f"a run with output_type {shown(name)} (format {stored[:12]}…)"
    return f"was taken by {was}; this run's output_type is {now}"


def inconsistency(checkpoint: Checkpoint) -> str | None:
    """What in a snapshot disagrees with its own transcript, if anything.

    Every model turn adds one assistant message after the run's prompt, and a finished run
    ends on an answer without tool calls. A snapshot edited to say otherwise (``turn = 5``
    over one turn's messages) would have the loop look for journal steps of turns that never
    ran, and so run the tools of the turns that did run a second time.
    """
    messages, at = checkpoint.messages, checkpoint.prompt_index
    if not 0 <= at < len(messages) or messages[at].role != "user":
        return f"puts its prompt at message {at} of {len(messages)}, which is not a user message"
    turns = sum(1 for m in messages[at + 1 :] if m.role == "assistant")
    if checkpoint.turn != turns:
        return f"says turn {checkpoint.turn}, but its transcript holds {turns} model turn(s)"
    last = messages[-1]
    if checkpoint.final and not (last.role == "assistant" and not last.tool_calls):
        return "is marked final, but its transcript does not end on an answer"
    return None


async def latest_of_run(
    store: CheckpointStore,
    ctx: RunContext,
    open_run: OpenRun | None,
    prompt: str,
    structured: StructuredOutput | None,
) -> Checkpoint | None:
    """The newest snapshot, if it belongs to the run being resumed; else journal replay.

    A snapshot of an *earlier* epoch is not this run's: the last run crashed before its first
    pass ended, so its journal, not an older transcript, says where it stands. Nor is one
    taken under another output contract: the journal's model calls are keyed on it, so the
    replay does what a resume without checkpoints does (asks the model again, or raises
    ``ReplayDivergenceError`` under ``strict_replay``).
    """
    try:
        latest = await store.latest(ctx.session_id or "", user_id=ctx.user_id)
        if latest is not None and (why := inconsistency(latest)) is not None:
            raise CheckpointError(f"checkpoint {latest.id} of session {ctx.session_id!r} {why}")
    except CheckpointError:
        if open_run is not None and open_run.strict:
            raise
        log.warning(
            "the latest checkpoint of session %r cannot be read; replaying the journal instead",
            ctx.session_id,
            exc_info=True,
        )
        return None
    if latest is None or open_run is None or latest.epoch != open_run.epoch:
        return None
    check_prompt(latest, prompt)
    if (why := contract_mismatch(latest, structured)) is not None:
        log.warning(
            "checkpoint %r of session %r %s: replaying the journal instead",
            latest.id,
            ctx.session_id,
            why,
        )
        return None
    return latest


# -- pure helpers of the run ---------------------------------------------------------------


def _fit_payload(
    outcome: ToolOutcome, tool_name: str, limit: int | None
) -> tuple[ToolOutcome, bytes | None]:
    """A result over the journal's size cap becomes a tool error the model reads; with the
    stored form of a result that fits (``None`` when there is no journal, or none made).

    Raising instead would fail the run with the tool's side effects done but unrecorded, and
    every resume would run the tool again and fail the same way. The error is journaled like
    any result, so a resume replays it and the tool runs once.
    """
    if limit is None:
        return outcome, None  # no journal, no cap
    try:
        raw = codec.dumps(outcome)
    except codec.UnsupportedValueError:
        return outcome, None  # the journal reports it with the step's name
    size = len(raw)
    if size <= limit:
        return outcome, raw
    log.warning("tool %r returned %d bytes, over the %d-byte journal cap", tool_name, size, limit)
    return ToolOutcome(
        ok=False,
        error_type=TOOL_ERROR,
        error=f"tool {tool_name!r} returned {size} bytes, more than the {limit} bytes a step "
        "may store (max_payload_bytes); ask it for less (a narrower query, a page, a summary)",
    ), None


def _valid_answer(response: ModelResponse) -> ModelResponse:
    """``response`` with U+FFFD for each lone surrogate in its text (and each NUL: see
    :func:`loomflow._json.valid_line`) and in its tool calls' names, ids and arguments (see
    :func:`loomflow._json.valid_text`); the same instance when
    there is none. The fields are checked one by one: printing the whole response to find out
    (``codec.valid``) costs a turn about 12 us, this about 3."""
    text = valid_line(response.text)
    calls = [_valid_call(call) for call in response.tool_calls]
    same = all(a is b for a, b in zip(calls, response.tool_calls, strict=True))
    if text is response.text and same:
        return response
    return response.model_copy(update={"text": text, "tool_calls": calls})


def _valid_call(call: ToolCall) -> ToolCall:
    """``call`` with :func:`valid_text` applied to its name, id and arguments; the same
    instance when nothing needed replacing. A name is the model's text like any other: a
    lone surrogate in it reached the budget's estimate, the audit hash and the journal as a
    ``UnicodeEncodeError``; now it names no tool, and the model is told so."""
    name, call_id = valid_text(call.name), valid_text(call.id)
    arguments = valid_value(call.arguments)
    if name is call.name and call_id is call.id and arguments is call.arguments:
        return call
    return call.model_copy(update={"name": name, "id": call_id, "arguments": arguments})


def _rewritten(checked: ToolCall | ToolOutcome, call: ToolCall) -> bool:
    """Whether a hook returned ``call`` with another tool name or other arguments."""
    if isinstance(checked, ToolOutcome):
        return False
    return (checked.name, checked.arguments) != (call.name, call.arguments)


def _is_outcome(value: Any) -> bool:
    return isinstance(value, ToolOutcome)


def _is_model_reply(value: Any) -> bool:
    """A model call's journaled chunks: a list holding its response (what a live call
    journals; a list without one never is)."""
    return isinstance(value, list) and any(isinstance(c, ModelResponse) for c in value)


def _with_call_ids(response: ModelResponse, turn: int) -> ModelResponse:
    """``response`` with an id of its own for every tool call: one the model left without an
    id, or gave the id of an earlier call of the same answer, gets a new one.

    A tool result must name the call it answers, and some OpenAI-compatible servers send
    calls with an empty id, or the same id for every call (the provider then refuses the next
    request: the results no longer tell which call they answer). The id is made from the turn
    and slot, so a replay of the journaled response (which keeps the ids as sent) names the
    calls the same way and the next model call's inputs match.
    """
    ids = [call.id for call in response.tool_calls]
    if all(ids) and len(set(ids)) == len(ids):
        return response
    taken = set(ids)
    seen: set[str] = set()
    calls = []
    for slot, call in enumerate(response.tool_calls):
        if call.id and call.id not in seen:
            seen.add(call.id)
            calls.append(call)
            continue
        new_id = f"call_{turn}_{slot}"
        while new_id in taken:  # a model's own id may look like ours
            new_id += "_"
        taken.add(new_id)
        seen.add(new_id)
        calls.append(call.model_copy(update={"id": new_id}))
    return response.model_copy(update={"tool_calls": calls})


def _counts(open_run: OpenRun | None) -> tuple[int, int]:
    """Steps replayed and run fresh so far in ``open_run`` (none without a journal)."""
    if open_run is None:
        return (0, 0)
    return (open_run.stats.hits, open_run.stats.misses)


# The stand-in outcome of a call waiting for approval (never journaled nor shown to the model).
_AWAITING = ToolOutcome(ok=False, error_type="approval_pending", error="waiting for approval")


def _redacted(redactor: Redactor, message: Message) -> Message:
    """``message`` with secrets redacted; the same instance when there were none (its
    encoding is then already kept, see loomflow._memo)."""
    content = redactor.text(message.content)
    calls = []
    changed = content != message.content
    for call in message.tool_calls:
        arguments = redactor.value(call.arguments)
        if arguments != call.arguments:
            call = call.model_copy(update={"arguments": arguments})
            changed = True
        calls.append(call)
    if not changed:
        return message
    return message.model_copy(update={"content": content, "tool_calls": calls})


def _answered(messages: list[Message]) -> list[Message]:
    """Drop a trailing tool request whose results never came (the run was interrupted).

    Providers refuse a transcript with an unanswered tool call, and this one will be sent
    back to the model by the next run on the session.
    """
    out = list(messages)
    while out and out[-1].role == "assistant" and out[-1].tool_calls:
        out.pop()
    return out

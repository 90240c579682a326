"""Span and attribute names: OpenTelemetry's GenAI conventions first, ``loom.*`` for the rest.

Kept as plain strings so that the library needs only ``opentelemetry-api`` (the
``semantic-conventions`` package comes with the SDK, not the API).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ERROR_TYPE",
    "GEN_AI_AGENT_NAME",
    "GEN_AI_CONVERSATION_ID",
    "GEN_AI_INPUT_MESSAGES",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_OUTPUT_MESSAGES",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_MAX_TOKENS",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_REQUEST_TEMPERATURE",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_SYSTEM_INSTRUCTIONS",
    "GEN_AI_TOOL_CALL_ARGUMENTS",
    "GEN_AI_TOOL_CALL_ID",
    "GEN_AI_TOOL_CALL_RESULT",
    "GEN_AI_TOOL_DESCRIPTION",
    "GEN_AI_TOOL_NAME",
    "GEN_AI_TOKEN_TYPE",
    "GEN_AI_TOOL_TYPE",
    "GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS",
    "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "LOOM_BACKEND",
    "LOOM_RUN_COST_USD",
    "LOOM_RUN_EPOCH",
    "LOOM_RUN_FRESH_STEPS",
    "LOOM_RUN_ID",
    "LOOM_RUN_INTERRUPTION_REASON",
    "LOOM_RUN_OUTCOME",
    "LOOM_RUN_REPLAYED_STEPS",
    "LOOM_RUN_RESUMED",
    "LOOM_RUN_TURNS",
    "LOOM_STEP_EPOCH",
    "LOOM_STEP_KIND",
    "LOOM_STEP_NAME",
    "LOOM_STEP_PATH",
    "LOOM_STEP_REPLAY",
    "LOOM_STEP_STREAM",
    "LOOM_USAGE_REPLAYED_CACHE_CREATION_INPUT_TOKENS",
    "LOOM_USAGE_REPLAYED_CACHE_READ_INPUT_TOKENS",
    "LOOM_USAGE_REPLAYED_INPUT_TOKENS",
    "LOOM_USAGE_REPLAYED_OUTPUT_TOKENS",
    "SESSION_ID",
    "STEP_SPAN",
    "USER_ID",
    "USER_ID_DOCUMENTED",
]

STEP_SPAN: Final = "loom.workflow.step"
"""Name of the span of every journaled step."""

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
"""Input tokens served from the provider's prompt cache (part of the input tokens)."""
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: Final = "gen_ai.usage.cache_creation.input_tokens"
"""Input tokens written to the provider's prompt cache (part of the input tokens)."""
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"
"""``input`` or ``output``: the attribute of ``gen_ai.client.token.usage``."""
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE: Final = "gen_ai.tool.type"
GEN_AI_TOOL_DESCRIPTION: Final = "gen_ai.tool.description"
GEN_AI_TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
ERROR_TYPE: Final = "error.type"

# General conventions (user.*, session.*).
USER_ID: Final = "user.id"
SESSION_ID: Final = "session.id"
USER_ID_DOCUMENTED: Final = "user_id"
"""The name the reference documents give the user on ``loom.workflow.step`` spans; emitted
beside ``user.id`` (same value)."""

# loomflow's own.
LOOM_BACKEND: Final = "loom.backend"
LOOM_RUN_ID: Final = "loom.run.id"
LOOM_RUN_EPOCH: Final = "loom.run.epoch"
LOOM_RUN_RESUMED: Final = "loom.run.resumed"
LOOM_RUN_OUTCOME: Final = "loom.run.outcome"
LOOM_RUN_INTERRUPTION_REASON: Final = "loom.run.interruption_reason"
LOOM_RUN_TURNS: Final = "loom.run.turns"
LOOM_RUN_COST_USD: Final = "loom.run.cost_usd"
LOOM_RUN_REPLAYED_STEPS: Final = "loom.run.replayed_steps"
LOOM_RUN_FRESH_STEPS: Final = "loom.run.fresh_steps"
LOOM_STEP_NAME: Final = "loom.step.name"
LOOM_STEP_KIND: Final = "loom.step.kind"
LOOM_STEP_EPOCH: Final = "loom.step.epoch"
LOOM_STEP_PATH: Final = "loom.step.path"
LOOM_STEP_STREAM: Final = "loom.step.stream"
LOOM_STEP_REPLAY: Final = "loom.step.replay"
"""``hit``, ``miss``, ``divergence`` or ``corrupt``: what the journal did at the step."""
LOOM_USAGE_REPLAYED_INPUT_TOKENS: Final = "loom.usage.replayed.input_tokens"
"""On a run's root span: input tokens of model calls replayed from the journal (not billed
again; ``gen_ai.usage.input_tokens`` there counts live calls only)."""
LOOM_USAGE_REPLAYED_OUTPUT_TOKENS: Final = "loom.usage.replayed.output_tokens"
LOOM_USAGE_REPLAYED_CACHE_READ_INPUT_TOKENS: Final = "loom.usage.replayed.cache_read.input_tokens"
LOOM_USAGE_REPLAYED_CACHE_CREATION_INPUT_TOKENS: Final = (
    "loom.usage.replayed.cache_creation.input_tokens"
)

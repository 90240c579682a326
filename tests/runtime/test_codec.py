"""The tagged-JSON codec: round trips, canonical fingerprints, safe decoding."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from loomflow.errors import InvalidArgumentTypeError
from loomflow.messages import Message, ToolCall
from loomflow.runtime import codec
from loomflow.runtime._store import Scope, fingerprint
from loomflow.tools import ToolOutcome


@codec.register_type
class Colour(enum.Enum):
    RED = "red"


@codec.register_type
class Point(BaseModel):
    x: int
    y: tuple[int, ...] = ()


@codec.register_type
@dataclasses.dataclass
class Box:
    label: str
    size: float


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.uuids(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.dates(),
    st.timedeltas(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(), inner, max_size=4),
        st.dictionaries(st.integers(), inner, max_size=3),
        st.frozensets(st.integers(), max_size=4),
    ),
    max_leaves=20,
)


@given(values)
def test_every_supported_value_round_trips(value: Any) -> None:
    assert codec.loads(codec.dumps(value)) == value


@given(st.dictionaries(st.text(), st.integers(), max_size=6))
def test_fingerprints_ignore_dict_and_set_order(data: dict[str, int]) -> None:
    reordered = dict(reversed(list(data.items())))
    assert fingerprint((data, set(data)), {}) == fingerprint(
        (reordered, set(reversed(list(data)))), {}
    )


@given(st.text(), st.text())
def test_user_dicts_that_look_tagged_stay_dicts(tag: str, payload: str) -> None:
    value = {"$t": tag, "v": payload}
    assert codec.loads(codec.dumps(value)) == value


@given(
    st.tuples(st.one_of(st.none(), st.text()), st.one_of(st.none(), st.text())),
    st.tuples(st.one_of(st.none(), st.text()), st.one_of(st.none(), st.text())),
)
def test_scope_keys_are_injective(
    a: tuple[str | None, str | None], b: tuple[str | None, str | None]
) -> None:
    assert (Scope(*a).key == Scope(*b).key) == (a == b)


def test_special_floats_models_dataclasses_and_enums() -> None:
    value = [
        math.inf,
        -math.inf,
        Point(x=1, y=(2, 3)),
        Box("b", 1.5),
        Colour.RED,
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        dt.time(1, 2),
    ]
    decoded = codec.loads(codec.dumps(value))
    assert decoded[:2] == [math.inf, -math.inf]
    assert decoded[2] == Point(x=1, y=(2, 3))
    assert decoded[3] == Box("b", 1.5)
    assert decoded[4] is Colour.RED
    assert decoded[5:] == value[5:]
    assert math.isnan(codec.loads(codec.dumps(math.nan)))


def test_decoding_never_imports_modules() -> None:
    raw = json.dumps({"$t": "model", "v": {"cls": "antigravity:Thing", "fields": {}}})
    assert codec.loads(raw) == {}
    import sys

    assert "antigravity" not in sys.modules


def test_decoding_never_looks_classes_up_outside_the_registry() -> None:
    raw = json.dumps({"$t": "dataclass", "v": {"cls": "os:system", "fields": {"x": 1}}})
    assert codec.loads(raw) == {"x": 1}  # plain data: os.system is never even looked up


def test_unsupported_values_are_named() -> None:
    with pytest.raises(codec.UnsupportedValueError, match="'function'"):
        codec.dumps(lambda: None)


def test_register_type_rejects_arbitrary_classes() -> None:
    with pytest.raises(TypeError):
        codec.register_type(int)


def test_malformed_tagged_payloads_are_unknown_tags() -> None:
    with pytest.raises(codec.UnknownTagError):
        codec.loads(json.dumps({"$t": "timedelta", "v": "nope"}))


# -- kept encodings of value instances (codec.mark_immutable) ---------------------------------

_calls = st.lists(
    st.builds(
        ToolCall,
        id=st.text(min_size=1, max_size=5),
        name=st.text(min_size=1, max_size=5),
        arguments=st.dictionaries(st.text(max_size=5), values, max_size=3),
    ),
    max_size=2,
)
messages = st.one_of(
    st.builds(Message, role=st.just("user"), content=st.text(max_size=20)),
    st.builds(Message, role=st.just("assistant"), content=st.text(max_size=20), tool_calls=_calls),
)


def _one_dumps(value: Any) -> bytes:
    """The canonical bytes as one json.dumps of the whole encoding (the definition)."""
    return json.dumps(
        codec.encode(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


@given(st.lists(st.one_of(messages, values), max_size=5), st.lists(messages, max_size=4))
def test_canonical_bytes_of_kept_values_match_one_dumps(
    items: list[Any], shared: list[Any]
) -> None:
    transcript = [*shared, *items]
    for _ in range(2):  # the second time from the kept texts
        assert codec.canonical_bytes([[1, transcript], {}]) == _one_dumps([[1, transcript], {}])
        assert codec.canonical_bytes(transcript) == _one_dumps(transcript)
    assert fingerprint((1, transcript), {}) == fingerprint((1, list(transcript)), {})


def test_a_kept_value_still_counts_towards_the_depth_cap() -> None:
    message = Message(role="user", content="x")
    codec.canonical_bytes([message])  # kept at a shallow depth
    deep: list[Any] = [message]
    for _ in range(codec.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(codec.NestingTooDeepError):
        codec.canonical_bytes(deep)
    with pytest.raises(codec.NestingTooDeepError):
        codec.dumps(deep)


def test_kept_encodings_go_with_their_instances() -> None:
    import gc

    from loomflow.runtime.codec import _canonical_printer, _compact_printer, _encoded

    kept = (_encoded._kept, _canonical_printer._kept, _compact_printer._kept)
    before = [len(k) for k in kept]
    batch = [Message(role="user", content=f"m{i}") for i in range(50)]
    codec.canonical_bytes(batch)  # the fingerprint's text, kept per message
    codec.dumps(batch)  # the stored text, kept per message
    codec.encode(batch)  # the encoding, kept per message
    assert all(len(k) >= n + 50 for k, n in zip(kept, before, strict=True))
    del batch
    gc.collect()
    assert all(len(k) <= n for k, n in zip(kept, before, strict=True))


# Models that are not value classes (a tool outcome, a user's model) are printed field by
# field too, without being kept: a user may change what their fields hold.
_models = st.one_of(
    st.builds(Point, x=st.integers(), y=st.lists(st.integers(), max_size=3).map(tuple)),
    st.builds(ToolOutcome, ok=st.booleans(), value=values, error=st.one_of(st.none(), st.text())),
)
_printed = st.recursive(
    st.one_of(values, messages, _models, st.sampled_from([math.inf, -math.inf, -0.0, 1e16])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(_printed)
def test_printed_texts_are_byte_for_byte_the_encoders(value: Any) -> None:
    encoding = codec.encode(value)
    stored = json.dumps(encoding, separators=(",", ":"), ensure_ascii=False).encode()
    for _ in range(2):  # the second time from the kept texts
        assert codec.dumps(value) == stored
        assert codec.canonical_bytes(value) == _one_dumps(value)
    assert codec.loads(stored) == codec.loads(codec.dumps(value))


def test_a_user_model_is_printed_again_after_it_changes() -> None:
    class Draft(BaseModel):
        lines: list[str]

    draft = Draft(lines=["a"])
    first = codec.dumps(draft)
    draft.lines.append("b")  # not frozen, so its text is never kept
    assert codec.dumps(draft) != first
    assert codec.loads(codec.dumps(draft)) == {"lines": ["a", "b"]}


def test_mark_immutable_takes_frozen_models_only() -> None:
    with pytest.raises(InvalidArgumentTypeError, match="frozen pydantic model"):
        codec.mark_immutable(Point)


def test_a_model_class_renamed_after_printing_is_printed_under_its_new_name() -> None:
    import gc
    import weakref

    from pydantic import create_model

    made: Any = create_model("Made", n=(int, 0))
    first = codec.dumps(made(n=1))
    assert b'"cls":"' + made.__module__.encode() + b":Made" in first
    made.__qualname__ = "Renamed"  # a package re-exporting a class may rename it
    again = codec.dumps(made(n=1))
    assert (
        again
        == json.dumps(codec.encode(made(n=1)), separators=(",", ":"), ensure_ascii=False).encode()
    )
    assert b":Renamed" in again
    # And a class made per call goes away with its last use: the layouts hold it weakly.
    gone = weakref.ref(made)
    del made
    gc.collect()
    assert gone() is None


# -- text that is no Unicode, and values that render alike after a replay --------------------

LONE = json.loads('"caf\\udce9"')  # a lone surrogate, as json.loads reads a "\udce9" escape


def test_a_lone_surrogate_is_stored_as_its_escape_and_read_back() -> None:
    value = {"k" + LONE: [LONE, ("x\ud83d",)]}
    raw = codec.dumps(value)
    assert b"\\udce9" in raw
    raw.decode("utf-8")  # valid UTF-8: any store takes it
    assert codec.loads(raw) == value
    # Fingerprints are defined too, and the growing form agrees with the plain one.
    messages = [Message.user(LONE), Message.assistant("ok " + LONE)]
    grown = codec.GrowingHasher().snapshot(messages)
    assert fingerprint([grown], {}) == fingerprint([list(messages)], {})


def test_valid_replaces_lone_surrogates_and_keeps_everything_else() -> None:
    clean = {"a": [1, "ok"], "m": Message.user("hi")}
    assert codec.valid(clean) is clean
    fixed = codec.valid(ToolOutcome(ok=True, value={"name": LONE, "n": 1}))
    assert isinstance(fixed, ToolOutcome)
    assert fixed.value == {"name": "caf\ufffd", "n": 1}
    pair = codec.valid(Message.user("\ud83d\ude00"))  # a pair spelled as two code points
    assert pair.content == "\U0001f600"
    with pytest.raises(codec.UnsupportedValueError):
        codec.valid(object())


class Plain(enum.Enum):  # not registered: a replay hands back its value
    SHIPPED = "shipped"


class Unregistered(BaseModel):
    name: str
    tags: frozenset[str]


@pytest.mark.parametrize(
    "value",
    [
        {"gamma", "alpha", "beta", "eps", "delta"},
        frozenset({3, 1, 2}),
        {2: "shipped", 1: "pending", 3: None},
        {(2, "b"): 1, (1, "a"): 2},
        Plain.SHIPPED,
        [Plain.SHIPPED, {"s": Plain.SHIPPED}],
        Unregistered(name="x", tags=frozenset({"b", "a"})),
        {"when": dt.datetime(2026, 5, 8, 12, 0, tzinfo=dt.UTC), "n": math.inf},
        Point(x=1, y=(2, 3)),
        Box("b", 2),
    ],
)
def test_a_value_renders_as_its_replay_does(value: Any) -> None:
    replayed = codec.loads(codec.dumps(value))
    assert codec.plain(value) == codec.plain(replayed)
    live, again = ToolOutcome(ok=True, value=value), ToolOutcome(ok=True, value=replayed)
    assert live.as_text() == again.as_text()


def test_plain_orders_what_python_does_not() -> None:
    assert codec.plain({"b", "a", "c"}) == ["a", "b", "c"]
    assert codec.plain({2: "x", 1: "y"}) == {"1": "y", "2": "x"}
    assert codec.plain(Plain.SHIPPED) == "shipped"
    assert ToolOutcome(ok=True, value=Plain.SHIPPED).as_text() == "shipped"
    assert ToolOutcome(ok=True, value={"a": 1, "b": [True, None]}).as_text() == (
        '{"a":1,"b":[true,null]}'
    )


class Level(enum.IntEnum):  # not registered: a replay hands back its value
    LOW = 1
    HIGH = 10


class Shade(enum.StrEnum):  # not registered
    RED = "red"
    BLUE = "blue"


hashables = st.one_of(
    st.integers(-20, 20),
    st.text(max_size=3),
    st.sampled_from(list(Level)),
    st.sampled_from(list(Shade)),
    st.sampled_from(list(Plain)),
    st.tuples(st.integers(0, 3), st.text(max_size=2)),
)
rendered = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), hashables),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(hashables, inner, max_size=4),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.sets(hashables, max_size=4),
    ),
    max_leaves=15,
)


@given(rendered)
def test_a_result_renders_as_its_replays_do(value: Any) -> None:
    """The text a model reads of a tool result is the same on the first run, on a replay,
    and on a replay of a replay: whatever enums, sets and keys it holds."""
    once = codec.loads(codec.dumps(value))
    twice = codec.loads(codec.dumps(once))
    texts = {ToolOutcome(ok=True, value=v).as_text() for v in (value, once, twice)}
    assert len(texts) == 1, texts


def test_a_surrogate_pair_spelled_as_two_code_points_keeps_its_fingerprint() -> None:
    pair = "\ud83d\ude00"  # what the character U+1F600 is in UTF-16, as two code points
    back = codec.loads(codec.dumps(pair))
    assert back == "\U0001f600"
    assert fingerprint((pair,), {}) == fingerprint((back,), {})
    assert codec.canonical_bytes(pair) == codec.canonical_bytes(back)


def test_a_stored_codec_version_below_1_is_malformed_not_the_current_one() -> None:
    raw = codec.dumps({"a": 1})
    assert codec.loads(raw, version=codec.CODEC_VERSION) == {"a": 1}
    for version in (0, -1):
        with pytest.raises(codec.UnknownTagError, match=f"malformed codec version {version}"):
            codec.loads(raw, version=version)
    with pytest.raises(codec.UnknownTagError, match="newer than this loomflow reads"):
        codec.loads(raw, version=codec.CODEC_VERSION + 1)

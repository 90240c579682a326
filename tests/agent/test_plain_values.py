"""The walks over every tool call's arguments and result: leaves they hand back untouched
(ints, bools, None) skip a call, the rest is still made plain and valid."""

from __future__ import annotations

import enum
import math

from loomflow._json import json_safe, valid_value


class Level(enum.IntEnum):
    LOW = 1


def test_json_safe_keeps_plain_leaves_and_still_fixes_the_others() -> None:
    value = {
        "n": 3,
        "yes": True,
        "none": None,
        "nan": math.nan,
        "bad": "a\udce9",
        "level": Level.LOW,
        "items": [1, False, None, math.inf, "b\ud800", {"deep": -math.inf}],
    }
    assert json_safe(value) == {
        "n": 3,
        "yes": True,
        "none": None,
        "nan": "nan",
        "bad": "a\ufffd",
        "level": Level.LOW,
        "items": [1, False, None, "inf", "b\ufffd", {"deep": "-inf"}],
    }
    assert json_safe([1, True, None]) == [1, True, None]


def test_valid_value_is_the_same_object_unless_a_text_needed_replacing() -> None:
    clean = {"page": 2, "ok": True, "none": None, "tags": [1, "x", None], "key": "k"}
    assert valid_value(clean) is clean
    listed = [3, False, None]
    assert valid_value(listed) is listed
    fixed = valid_value({"page": 2, "tags": [1, "x\udce9"], "k\ud800": False})
    assert fixed == {"page": 2, "tags": [1, "x\ufffd"], "k\ufffd": False}

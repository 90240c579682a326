"""The Google-style docstring reader behind tool descriptions."""

from __future__ import annotations

from loomflow.tools._docstring import parse_docstring


def test_empty_docstrings() -> None:
    assert parse_docstring(None).summary == ""
    assert parse_docstring("").params == {}


def test_summary_is_the_first_paragraph_joined() -> None:
    doc = parse_docstring(
        """Look up the weather
        for one city.

        Second paragraph, not part of the summary.
        """
    )
    assert doc.summary == "Look up the weather for one city."


def test_summary_stops_at_a_section_header() -> None:
    doc = parse_docstring("Summary line.\nArgs:\n    x: The x.\n")
    assert doc.summary == "Summary line."
    assert doc.params == {"x": "The x."}


def test_args_entries_types_and_continuations() -> None:
    doc = parse_docstring(
        """Do it.

        Args:
            city: The city name.
            days (int): How many days
                to forecast, at most 10.
            *extra: Ignored extras.
            flag:
                Description on the next line.

        Returns:
            days: not an argument, this is the Returns section.
        """
    )
    assert doc.params == {
        "city": "The city name.",
        "days": "How many days to forecast, at most 10.",
        "extra": "Ignored extras.",
        "flag": "Description on the next line.",
    }


def test_other_sections_are_ignored_and_variants_accepted() -> None:
    doc = parse_docstring(
        """Summary.

        Example:
            x: this is example code, not an argument

        Parameters:
            y: The y.

        Raises:
            ValueError: never.
        """
    )
    assert doc.params == {"y": "The y."}

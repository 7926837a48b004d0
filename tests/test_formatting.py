"""One byte formatter and one table renderer: the figures and columns every page prints."""

from __future__ import annotations

import pytest

from lightning_ckpt.formatting import MIB, format_bytes, markdown_table, table


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (600 * MIB, "600.0 MiB"), (1.5 * 2**30, "1.5 GiB"),
     (3 * 2**40, "3.0 TiB"), (5000 * 2**40, "5000.0 TiB"), (-2 * MIB, "-2.0 MiB")],
)  # fmt: skip
def test_bytes_read_in_the_largest_unit_they_reach(n, text):
    assert format_bytes(n) == text


def test_a_column_of_one_unit_has_bare_figures():
    assert format_bytes(123 * MIB + MIB // 4, unit="MiB", digits=2, suffix=False) == "123.25"
    assert format_bytes(3 * MIB, unit="MiB") == "3.0 MiB"
    assert format_bytes(12, unit="B") == "12 B"
    with pytest.raises(ValueError, match="unit 'MB' is none of"):
        format_bytes(1, unit="MB")


def test_numbers_align_right_text_left_and_nothing_trails():
    text = table(["block", "full", "kept for backward"], [["h.0", "1.00", "23.4"], ["h.10", "-", "3.0"]], right=[1, 2])
    assert text.splitlines() == [
        "block  full  kept for backward",
        "h.0    1.00               23.4",
        "h.10      -                3.0",
    ]
    indented = table(["a", "b"], [["x", ""]], indent="  ").splitlines()
    assert indented == ["  a  b", "  x"]  # an empty last cell leaves no trailing spaces


def test_a_rule_spans_the_table_under_its_header():
    lines = table(["#", "label"], [["1", "selective(mlp)"]], right=[0], rule=True).splitlines()
    assert (
        lines[0] == "#  label" and set(lines[1]) == {"-"} and len(lines[1]) == len(lines[2]) == len("1  selective(mlp)")
    )


def test_markdown_rows_are_cells_between_pipes():
    text = markdown_table(["mode", "`h.0-3`"], [["none", "10.0"], ["**plan**", "**full**"]])
    assert text.splitlines() == ["| mode | `h.0-3` |", "|---|---|", "| none | 10.0 |", "| **plan** | **full** |"]

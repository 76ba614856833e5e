"""Plain-text tables for the benchmark scripts' output."""

from __future__ import annotations


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """The rows' `columns` as left-aligned text columns under a header line."""
    cells = [[str(row[column]) for column in columns] for row in rows]
    widths = [
        max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)
    ]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths, strict=True))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in cells
    ]
    return "\n".join(lines)

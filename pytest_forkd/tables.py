"""Plain-text tables: the one renderer behind every table forkd prints.

The terminal summary, ``forkd compare``, ``forkd bench``, ``forkd snapshots
ls`` and ``forkd image ls`` all print the same kind of table: a header row,
columns separated by two spaces, each as wide as its widest cell, numbers
right-aligned where asked, no trailing blanks. One function, so they stay
alike and a change of style happens once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["render_table"]


def render_table(
    rows: Iterable[Sequence[object]],
    header: Sequence[str] | None = None,
    *,
    right: Iterable[int] = (),
    indent: str = "",
    gap: str = "  ",
) -> str:
    """Render ``rows`` (under ``header``, if given) as aligned text; ``right`` lists right-aligned columns.

    Cells are converted with ``str``; rows may be shorter than the header
    (missing cells are blank). Returns the lines joined by newlines, without
    a final one.
    """
    table = [[str(cell) for cell in row] for row in ([header] if header is not None else [])]
    table += [[str(cell) for cell in row] for row in rows]
    if not table:
        return ""
    columns = max(len(row) for row in table)
    widths = [max((len(row[column]) for row in table if column < len(row)), default=0) for column in range(columns)]
    aligned_right = set(right)
    lines = []
    for row in table:
        cells = [
            (cell.rjust(width) if column in aligned_right else cell.ljust(width))
            for column, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append((indent + gap.join(cells)).rstrip())
    return "\n".join(lines)

"""Rows that cannot be trained on, as `data.bad_rows` says: skipped and counted by reason (`skip`,
the default), or the run stops at the first (`stop`). Under `skip` the run stops once more than
`data.max_bad_fraction` of the rows read are bad, counted over at least MIN_ROWS rows (so a small
file may hold one bad row, and a file of another format stops at once, not after an epoch).

A stop is a DataError: before the start it is refused before Ray starts (data/summary.py); during
the run the driver writes the last finished step's checkpoint first (runtime/training.py).
Skipping keeps resume exact: which rows are bad is a property of the data, so the stream of
trainable rows, and the position a checkpoint records in it, are the same in every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain_ray.data.documents import BadRow, DataError, Document

MIN_ROWS = 100


def apply_policy(error: BadRow, policy: str) -> Document:
    """A bad row under data.bad_rows: the skipped document that stands for it, or the error."""
    if policy == "stop":
        raise error
    return Document.of_bad_row(error)


@dataclass
class BadRowCount:
    """Rows read and bad rows among them, by reason; `first` is the first bad row's message."""

    max_fraction: float | None  # None: not checked here (the whole source was checked before the start)
    rows: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    first: str | None = None

    @property
    def bad(self) -> int:
        return sum(self.by_reason.values())

    def count(self, doc: Document) -> None:
        """One row read; a bad one is counted by its reason, and the cap checked."""
        self.rows += 1
        if doc.bad is None:
            return
        self.by_reason[doc.bad.reason] = self.by_reason.get(doc.bad.reason, 0) + 1
        self.first = self.first or str(doc.bad)
        self.check()

    def over_cap(self) -> bool:
        return self.max_fraction is not None and self.bad > self.max_fraction * max(self.rows, MIN_ROWS)

    def check(self, where: str = "the training data") -> None:
        if self.over_cap():
            raise DataError(f"{where}: {self.rows:,} rows read, {self.describe()}: more than data."
                            f"max_bad_fraction={self.max_fraction:g} (of at least {MIN_ROWS} rows). The first: "
                            f"{self.first}. Fix the data, or raise data.max_bad_fraction to skip such rows")

    def describe(self) -> str:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.by_reason.items(), key=lambda kv: -kv[1]))
        return f"{self.bad:,} of them bad ({reasons})" if self.by_reason else "none of them bad"

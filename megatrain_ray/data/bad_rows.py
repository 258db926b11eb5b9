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
FIRST_FEW = 3  # bad rows located in the messages (file, row, line, what is wrong)


def apply_policy(error: BadRow, policy: str) -> Document:
    """A bad row under data.bad_rows: the skipped document that stands for it, or the error."""
    if policy == "stop":
        raise error
    return Document.of_bad_row(error)


@dataclass
class BadRowCount:
    """Rows read and bad rows among them, by reason; `examples`: the first few bad rows' messages."""

    max_fraction: float | None  # None: not checked here (the whole source was checked before the start)
    rows: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def bad(self) -> int:
        return sum(self.by_reason.values())

    @property
    def first(self) -> str | None:
        return self.examples[0] if self.examples else None

    def count(self, doc: Document) -> None:
        """One row read; a bad one is counted by its reason, and the cap checked."""
        self.rows += 1
        if doc.bad is None:
            return
        self.by_reason[doc.bad.reason] = self.by_reason.get(doc.bad.reason, 0) + 1
        if len(self.examples) < FIRST_FEW:
            self.examples.append(str(doc.bad))
        self.check()

    @property
    def allowed(self) -> int:
        """The bad rows data.max_bad_fraction allows among the rows read so far."""
        return int(self.max_fraction * max(self.rows, MIN_ROWS)) if self.max_fraction is not None else self.bad

    def over_cap(self) -> bool:
        return self.bad > self.allowed

    def check(self, where: str = "the training data") -> None:
        if self.over_cap():
            basis = (f"of the {self.rows:,} rows read" if self.rows >= MIN_ROWS else
                     f"of {MIN_ROWS} rows: fewer rows read count as {MIN_ROWS}")
            allows = f"{self.allowed} bad row{'' if self.allowed == 1 else 's'} ({self.max_fraction:g} {basis})"
            raise DataError(f"{where}: {self.rows:,} rows read, {self.describe()}: more than data."
                            f"max_bad_fraction={self.max_fraction:g} allows here, {allows}. {located(self.examples)}. "
                            f"Fix the data, or raise data.max_bad_fraction to skip such rows")

    def describe(self) -> str:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.by_reason.items(), key=lambda kv: -kv[1]))
        return f"{self.bad:,} of them bad ({reasons})" if self.by_reason else "none of them bad"


def located(examples: list[str]) -> str:
    """'The first bad row: ...' / 'The first 3 bad rows: ...; ...; ...'."""
    if len(examples) == 1:
        return f"The first bad row: {examples[0]}"
    return f"The first {len(examples)} bad rows: " + "; ".join(examples)

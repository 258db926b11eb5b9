"""What a data source holds for training, counted before the run starts: files, rows read, rows
held out for validation, rows skipped by reason, bad rows by reason, rows truncated, tokens and the
tokens that carry loss, the rows' format and the chat template they are rendered with, and where the
first few bad rows are (file, row and line, what is wrong with them). Printed at start and written into the first row of metrics.jsonl that a
run writes.

The count reads the source once in file order through the same steps as the training stream
(reader, hold-out split, tokenizer and chat template, data.seq_len): the whole source when its
files hold at most SCAN_BYTES, else its first SCAN_ROWS rows (and it says which); image-text rows,
whose images are read and processed, its first SCAN_IMAGE_ROWS (the run then counts the rest). So a bad row
anywhere in a source of that size is found before Ray starts: under data.bad_rows=stop it is
refused (DataError, exit 2), under skip it is counted, and more than data.max_bad_fraction of bad
rows is refused (data/bad_rows.py). A source without a single trainable row is read to its end and
refused with the reasons. Skip reasons: the SFT formats' "empty conversation", "no assistant
turn" and "empty answer" and the text format's "empty text" (known before tokenizing), "answer
cut off by data.seq_len" (an SFT example whose trained tokens all lie past the cut) and "no loss
tokens" (any other row without a target, such as a tokens row whose labels are all -100).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatrain_ray.data.bad_rows import FIRST_FEW, BadRowCount
from megatrain_ray.data.dataset import IMAGE_FORMAT, SPLITTABLE_FORMATS, Dataset
from megatrain_ray.data.image_text import IMAGE_READ_ROWS
from megatrain_ray.data.documents import IGNORE_INDEX, DataError, Document
from megatrain_ray.data.packing import fit_length
from megatrain_ray.data.readers import column_spec, read_rows

SCAN_ROWS = 10_000
SCAN_IMAGE_ROWS = 256  # image-text rows: a row of two 896 x 896 images took 0.36 s on one busy core
SCAN_BYTES = 16 * 1024**2  # counted whole up to this size on disk: 8 MB of alpaca rows took 6.5 s on 2 busy cores


@dataclass
class DataSummary:
    files: int = 0
    rows_read: int = 0
    rows_split_off: int = 0  # on the other side of eval.holdout_fraction's split
    rows_skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    rows_bad: dict[str, int] = field(default_factory=dict)  # reason -> bad rows skipped (data.bad_rows=skip)
    rows_truncated: int = 0  # SFT examples cut at data.seq_len
    rows_trainable: int = 0
    tokens: int = 0  # of the trainable rows, after truncation
    loss_tokens: int = 0  # positions whose next token is a target
    complete: bool = True  # False: the first SCAN_ROWS rows were counted
    source_bytes: int = 0  # the files' size on disk
    format: str = ""  # the rows' format (data/formats.py)
    format_detected: bool = False  # told from the first row's columns (data.format: auto)
    chat_template: str | None = None  # the template the rows are rendered with, in words
    bad_examples: list[str] = field(default_factory=list)  # the first few bad rows: file, row, line, what

    def to_dict(self) -> dict:
        return asdict(self)

    def skip(self, reason: str) -> None:
        self.rows_skipped[reason] = self.rows_skipped.get(reason, 0) + 1

    def count(self, doc: Document, seq_len: int, truncate: bool, splittable: bool) -> None:
        if doc.bad is not None:
            self.rows_bad[doc.skip] = self.rows_bad.get(doc.skip, 0) + 1
            if len(self.bad_examples) < FIRST_FEW:
                self.bad_examples.append(str(doc.bad))
            return
        if doc.skip is not None:
            self.skip(doc.skip)
            return
        fitted = fit_length(doc, seq_len, truncate, splittable)  # a too-long row without truncate: its DataError
        cut = len(fitted) < len(doc)
        self.rows_truncated += cut
        loss = int((fitted.labels != IGNORE_INDEX).sum())
        if not loss:
            self.skip("answer cut off by data.seq_len" if cut and (doc.labels != IGNORE_INDEX).any() else "no loss tokens")
            return
        self.rows_trainable += 1
        self.tokens += len(fitted)
        self.loss_tokens += loss

    def skipped_text(self) -> str:
        """'none skipped', or the rows skipped and the bad rows skipped, each by reason."""
        parts = []
        if self.rows_skipped:
            parts.append(f"{sum(self.rows_skipped.values()):,} skipped ({by_reason(self.rows_skipped)})")
        if self.rows_bad:
            bad = sum(self.rows_bad.values())
            parts.append(f"{bad:,} bad row{'' if bad == 1 else 's'} skipped ({by_reason(self.rows_bad)})")
        return ", ".join(parts) or "none skipped"

    def format_text(self) -> str:
        """'; format alpaca (told from the first row's columns), the fallback chat template'."""
        if self.format in ("", "synthetic"):
            return ""
        how = "told from the first row's columns" if self.format_detected else "data.format"
        return f"; format {self.format} ({how})" + (f", {self.chat_template}" if self.chat_template else "")

    def scanned(self) -> str:
        """How much of the source was counted."""
        if self.complete:
            return " (all of it)" if self.files else ""
        return (f" (the first {self.rows_read:,} rows of {self.source_bytes / 1e9:.1f} GB; the rest is read as "
                f"training reaches it)")

    def describe(self, what: str = "training data") -> str:
        part = self.scanned()
        side = "held out for validation" if what == "training data" else "left to training"
        held = f", {self.rows_split_off:,} {side}" if self.rows_split_off else ""
        source = f"{self.files} file(s)" if self.files else "synthetic"
        located = "".join(f"\n  bad row: {example}" for example in self.bad_examples)
        more = sum(self.rows_bad.values()) - len(self.bad_examples)
        located += f"\n  ... and {more:,} more bad row{'' if more == 1 else 's'}" if more > 0 and located else ""
        return (f"{what}: {source}, {self.rows_read:,} rows read{part}{held}, {self.skipped_text()}, "
                f"{self.rows_truncated:,} truncated at data.seq_len; {self.rows_trainable:,} trainable rows, "
                f"{self.tokens:,} tokens, {self.loss_tokens:,} carrying loss{self.format_text()}{located}")


def by_reason(counts: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def summarize(dataset: Dataset, what: str = "training data", max_rows: int | None = None,
              max_bytes: int | None = None) -> DataSummary:
    """Count the source (see the module docstring; the limits default to SCAN_ROWS and SCAN_BYTES);
    refuses one without a trainable row, or with too many bad rows."""
    cfg = dataset.cfg
    splittable = dataset.format in SPLITTABLE_FORMATS
    max_rows, max_bytes = max_rows or SCAN_ROWS, SCAN_BYTES if max_bytes is None else max_bytes
    if dataset.format == IMAGE_FORMAT:  # each row's images are read and processed: its first rows only
        max_rows, max_bytes = min(max_rows, SCAN_IMAGE_ROWS), 0
    summary = DataSummary(files=len(dataset.files), source_bytes=sum(p.stat().st_size for p in dataset.files),
                          format=dataset.format, format_detected=cfg.format == "auto",
                          chat_template=dataset.chat_template_text())
    whole = summary.source_bytes <= max_bytes
    bad = BadRowCount(None)
    batches = source_batches(dataset)
    for batch in batches:
        summary.rows_read += len(batch)
        kept = batch if dataset.holdout is None else [(o, r) for o, r in batch if dataset.holdout.admits(o)]
        summary.rows_split_off += len(batch) - len(kept)
        for doc in documents_of(dataset, kept):
            bad.count(doc)
            summary.count(doc, cfg.seq_len, cfg.truncate, splittable)
        if not whole and summary.rows_read >= max_rows and summary.rows_trainable:
            summary.complete = next(batches, None) is None
            break
    bad.max_fraction = cfg.max_bad_fraction
    bad.check(f"{what} ({dataset.describe()})")
    if not summary.rows_trainable:
        raise DataError(f"no trainable rows in {what} ({dataset.describe()}): {summary.rows_read:,} rows read, "
                        f"{summary.skipped_text()}" + (f", {summary.rows_split_off:,} on the other side of "
                                                       f"eval.holdout_fraction" if summary.rows_split_off else ""))
    return summary


def source_batches(dataset: Dataset):
    """Epoch 0's rows in file order, in the reader's batches (synthetic data: its documents)."""
    if dataset.format == "synthetic":
        from megatrain_ray.data.synthetic import synthetic_documents

        yield [(d.origin, d) for d in synthetic_documents(dataset.cfg, dataset.vocab_size, dataset.seed, 0)]
        return
    columns = column_spec(dataset.format, dataset.cfg.text_column)
    rows_at_once = IMAGE_READ_ROWS if dataset.format == IMAGE_FORMAT else max(1, dataset.cfg.read_batch_rows)
    for path in dataset.files:
        yield from read_rows(path, columns, rows_at_once)


def documents_of(dataset: Dataset, batch) -> list[Document]:
    if not batch:
        return []
    if dataset.format == "synthetic":
        return [doc for _, doc in batch]
    return dataset.to_documents(batch)


def summarize_data(data_cfg, eval_cfg, vocab_size: int, seed: int) -> dict:
    """The training data and the validation data (when `eval` is on), counted and printed; the
    counts as metrics.jsonl records them."""
    from megatrain_ray.data.dataset import build_datasets

    train, held_out = build_datasets(data_cfg, eval_cfg, vocab_size, seed)
    counted = {"train": summarize(train)}
    if held_out is not None:
        counted["validation"] = summarize(held_out, "validation data")
    for name, summary in counted.items():
        print(summary.describe("training data" if name == "train" else "validation data"), flush=True)
    return {name: summary.to_dict() for name, summary in counted.items()}

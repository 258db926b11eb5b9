"""Image-text SFT rows, as LlamaFactory and ShareGPT write them, to documents with their image
tensors, through the model's own processor (data/processor.py).

A row: `messages` [{role, content}] (or `conversations` [{from, value}]) whose text holds one
`<image>` placeholder per image, and `images`, a list of image paths (relative ones from the
data file's directory). Each placeholder becomes an image item of the message's content, as the
model's chat template expects; the template renders the conversation, the processor turns each
image placeholder into the model's image tokens and the images into its pixel tensors.

The loss is on the assistant's turns only: their characters are found by rendering, as for text
SFT (chat_template.py), and marked on the tokens of the rendered text; the processor's tokens are
those with each image's placeholder expanded, so the marks are carried over by aligning the two
token sequences (the image tokens, in user turns, are never trained).

A row whose image cannot be read, whose placeholders do not match its images, or that is longer
than data.seq_len (its image tokens cannot be cut) is a bad row (data/bad_rows.py): skipped and
counted by reason, or a stop under data.bad_rows=stop.
"""

from __future__ import annotations

import copy
import difflib
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from megatrain_ray.data.bad_rows import apply_policy
from megatrain_ray.data.chat_template import ChatTemplate, trained_tokens
from megatrain_ray.data.documents import (IGNORE_INDEX, BadRow, Document, Origin, RowBatch, check_token_ids,
                                          masked_document)
from megatrain_ray.data.sft import sharegpt_messages, skip_reason

PLACEHOLDER = "<image>"
# Rows made into documents at once, each on a thread with its own copy of the processor (reading and
# resizing images, pixel arithmetic and the tokenizer release the GIL: a row of two 896 x 896 images
# took 0.36 s on one busy core); the driver's node also runs a store's optimizer threads
IMAGE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
IMAGE_READ_ROWS = 16  # rows read from a file at a time (their documents hold pixel tensors: few at once)
# the processor's outputs that are not image tensors: one value per token, or not the model's
PER_TOKEN = ("token_type_ids", "mm_token_type_ids")
NOT_MODEL_INPUTS = ("input_ids", "attention_mask", "offset_mapping", "labels")  # labels: PaliGemma's, of a suffix
# an image processor's old names of the model's inputs -> the names its forward now takes (Video-LLaVA's
# image processor still returns pixel_values_images by default; its forward maps it to pixel_values)
RENAMED = {"pixel_values_images": "pixel_values"}
PROBE_PIXELS = 56  # a side of the blank images that tell how a processor joins images (joined_axes)


def with_image_items(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Messages whose `<image>` placeholders are image items of their content, and their count."""
    out, count = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(message)
            continue
        items: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(PLACEHOLDER)):
            if i:
                items.append({"type": "image"})
                count += 1
            if text:
                items.append({"type": "text", "text": text})
        out.append({**message, "content": items})
    return out, count


def open_images(row: dict[str, Any], origin: Origin, wanted: int) -> list:
    from PIL import Image

    paths = row.get("images") or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise BadRow(origin, "'images' not a list of paths", f"column 'images' must be a list of paths, got {str(paths)[:80]}")
    if len(paths) != wanted:
        raise BadRow(origin, "images and <image> placeholders differ in number",
                     f"{len(paths)} image(s) but {wanted} {PLACEHOLDER} placeholder(s) in the messages")
    images = []
    for path in paths:
        file = Path(path).expanduser()
        file = file if file.is_absolute() else Path(origin.path).parent / file
        try:
            with Image.open(file) as image:
                images.append(image.convert("RGB"))
        except (OSError, ValueError) as e:
            raise BadRow(origin, "unreadable image", f"cannot read image {path}: {type(e).__name__}: {e}") from None
    return images


def carried_marks(plain: list[int], marks: list[bool], expanded: list[int]) -> np.ndarray:
    """The marks of `plain`'s tokens on `expanded`, the same tokens with image placeholders
    expanded: equal stretches keep their marks, inserted (image) tokens are unmarked."""
    out = np.zeros(len(expanded), dtype=bool)
    matcher = difflib.SequenceMatcher(None, plain, expanded, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        out[b:b + size] = marks[a:a + size]
    return out


def joined_axes(processor) -> dict[str, int]:
    """Per image tensor of the processor's image processor whose images are not joined along the
    first axis, the axis they are joined along: a processor that packs a batch's images side by
    side into one row of patches (MiniCPM-V's pixel_values, [1, channels, patch, patches x patch])
    grows that axis, not the first, with more rows. Found from its outputs for one and for two rows
    of a small blank image each (as it is given a batch's images: a list per row); none where it
    cannot process them."""
    from PIL import Image

    image = Image.new("RGB", (PROBE_PIXELS, PROBE_PIXELS))
    try:
        one, two = (processor.image_processor([[image]] * n, return_tensors="np") for n in (1, 2))
    except Exception:  # an image processor that wants other images: its tensors are joined along the first axis
        return {}
    out = {}
    for key in one:
        a, b = np.shape(one[key]), np.shape(two[key])
        grown = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(a) == len(b) and a[:1] == (1,) and len(grown) == 1 and grown[0] > 0:
            out[key] = grown[0]
    return out


def token_types_asked(processor) -> dict[str, bool]:
    """The processor asked for the image tokens' marks (mm_token_type_ids) where the model takes
    them (its model_input_names): Cosmos3-Edge's processor makes them only when asked, and its
    model's 3D rotary positions need them."""
    return {"return_mm_token_type_ids": True} if "mm_token_type_ids" in getattr(processor, "model_input_names", ()) else {}


def marks_a_suffix(processor) -> bool:
    """Whether the processor marks a row's answer apart from its prefix (PaliGemma's: `suffix`, its
    tokens' token_type_ids 1, the image and the prompt's 0), which its model attends to causally after
    a prefix it attends to bidirectionally."""
    import inspect

    return "suffix" in inspect.signature(type(processor).__call__).parameters


def suffix_types(labels: np.ndarray) -> np.ndarray:
    """token_type_ids of a row whose answer is its suffix: 1 from the first trained token on (the
    assistant's first turn; the tokens before it are the prefix, 0), as the processor marks a
    `suffix` it is given apart. `labels` are the document's: labels[t] is the target of token t."""
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    types = np.zeros(len(labels), dtype=np.int64)
    if len(trained):
        types[trained[0] + 1:] = 1  # labels[t] trains token t + 1
    return types


def image_text_document(origin: Origin, row: dict[str, Any], processor, template: ChatTemplate,
                        vocab_size: int, seq_len: int, joined: dict[str, int] | None = None) -> Document:
    chat, count = with_image_items(sharegpt_messages(row, origin, strict=False))
    skip = skip_reason(chat)
    if skip is not None:
        return Document.skipped(origin, skip)
    images = open_images(row, origin, count)
    text, spans = template.render_chat(chat, origin)
    tokenizer = processor.tokenizer
    plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    marks = trained_tokens(plain["offset_mapping"], spans)
    out = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="np",
                    **token_types_asked(processor))
    ids = np.asarray(out["input_ids"][0], dtype=np.int64)
    if len(ids) > seq_len:
        raise BadRow(origin, "image-text row longer than data.seq_len",
                     f"{len(ids)} tokens with its image tokens, longer than data.seq_len={seq_len} (an image's "
                     "tokens cannot be cut); raise data.seq_len")
    check_token_ids(ids, vocab_size, origin, "tokens")
    doc = masked_document(ids, carried_marks(list(plain["input_ids"]), marks, ids.tolist()), origin)
    per_token = {k: np.asarray(out[k][0]) for k in out if k in PER_TOKEN}
    fill = {}
    if marks_a_suffix(processor):  # the padding after the answer attended causally too
        per_token["token_type_ids"], fill["token_type_ids"] = suffix_types(doc.labels), 1
    per_image = {RENAMED.get(k, k): np.asarray(out[k]) for k in out if k not in PER_TOKEN and k not in NOT_MODEL_INPUTS}
    return Document(doc.input_ids, doc.labels, origin, images=ImageInputs(per_token, per_image, joined or {}, fill))


def image_text_documents(batch: RowBatch, processor, template: ChatTemplate, vocab_size: int,
                         seq_len: int, joined: dict[str, int] | None = None) -> list[Document]:
    """`joined`: joined_axes of the processor, found once per dataset."""
    return [image_text_document(origin, row, processor, template, vocab_size, seq_len, joined) for origin, row in batch]


class RowConverter:
    """One row to its document, a bad row to what data.bad_rows makes of it; safe on several
    threads (each thread converts with its own copy of the processor: a fast tokenizer refuses
    concurrent calls that set its padding)."""

    def __init__(self, processor, template: ChatTemplate, vocab_size: int, seq_len: int, policy: str,
                 joined: dict[str, int] | None = None):
        """`joined`: joined_axes of the processor, found once per dataset."""
        self.processor, self.template, self.vocab_size, self.seq_len = processor, template, vocab_size, seq_len
        self.policy, self.joined = policy, joined
        self.local = threading.local()

    def __call__(self, item: tuple[Origin, Any]) -> Document:
        origin, row = item
        if isinstance(row, BadRow):
            return apply_policy(row, self.policy)
        processor = getattr(self.local, "processor", None)
        if processor is None:
            processor = self.local.processor = copy.deepcopy(self.processor)
        try:
            return image_text_document(origin, row, processor, self.template, self.vocab_size, self.seq_len,
                                       self.joined)
        except BadRow as e:
            return apply_policy(e, self.policy)


def in_order_on_threads(fn: Callable, items: Iterable, threads: int = IMAGE_THREADS) -> Iterator:
    """fn over items on `threads` threads, a bounded few ahead, results (and errors) in the items' order."""
    with ThreadPoolExecutor(threads, thread_name_prefix="image-rows") as pool:
        ahead: deque = deque()
        for item in items:
            ahead.append(pool.submit(fn, item))
            if len(ahead) > 2 * threads:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


class ImageInputs:
    """A document's inputs for the model's vision side, as its processor made them: `per_token`,
    one value per token (token types; padded with 0, or with `fill`'s value for the key), and
    `per_image`, the image tensors (pixel values, image grids or sizes: a micro-batch concatenates its
    rows' along the first axis, or along the axis `joined` names, where its processor packs images
    side by side: joined_axes)."""

    def __init__(self, per_token: dict[str, np.ndarray], per_image: dict[str, np.ndarray],
                 joined: dict[str, int] | None = None, fill: dict[str, int] | None = None):
        self.per_token, self.per_image, self.joined = per_token, per_image, joined or {}
        self.fill = fill or {}


def stack_image_inputs(rows: list, seq_len: int) -> dict[str, np.ndarray]:
    """A micro-batch's image inputs: per-token values stacked (0 where a row has none), image
    tensors concatenated in row order (along the axis their processor joins images on)."""
    found = [r.images for r in rows if r.images is not None]
    if not found:
        return {}
    out: dict[str, np.ndarray] = {}
    for key in sorted({k for f in found for k in f.per_token}):
        stacked = np.full((len(rows), seq_len), next((f.fill[key] for f in found if key in f.fill), 0), dtype=np.int64)
        for i, r in enumerate(rows):
            if r.images is not None and key in r.images.per_token:
                values = r.images.per_token[key]
                stacked[i, :len(values)] = values
        out[key] = stacked
    for key in sorted({k for f in found for k in f.per_image}):
        with_key = [f for f in found if key in f.per_image]
        out[key] = np.concatenate([f.per_image[key] for f in with_key], axis=with_key[0].joined.get(key, 0))
    return out

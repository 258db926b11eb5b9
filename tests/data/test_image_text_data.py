"""Image-text SFT rows through the model's own processor: the image placeholders become the
model's image tokens and pixel tensors, the loss falls on the assistant's tokens only, and a row
whose image cannot be read is a bad row, counted by reason before the run."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from megatrain_ray.config import DataConfig  # noqa: E402
from megatrain_ray.data import build_dataset  # noqa: E402
from megatrain_ray.data.documents import IGNORE_INDEX  # noqa: E402
from megatrain_ray.data.summary import summarize  # noqa: E402
from helpers.image_text import TEXT, tiny_model_dir, write_images, write_rows  # noqa: E402


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_model_dir("qwen2_5_vl", tmp_path_factory.mktemp("vl") / "hf")[1]


def test_the_loss_falls_on_the_assistants_tokens_and_the_images_on_their_tokens(qwen_dir, tmp_path):
    from transformers import AutoTokenizer

    images = write_images(tmp_path / "images", 1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [
        {"role": "user", "content": "<image>what is this"}, {"role": "assistant", "content": "a red cat"},
        {"role": "user", "content": "sky"}, {"role": "assistant", "content": "blue"}], "images": images}) + "\n")
    data = build_dataset(DataConfig(source=str(rows), tokenizer=str(qwen_dir), seq_len=48), TEXT["vocab_size"], 0)
    assert data.format == "sharegpt_images"
    mb = data.fixed_batches(1, 1)[0]
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    ids, labels = mb["input_ids"][0], mb["labels"][0]
    targets = [int(t) for t in labels if t != IGNORE_INDEX]
    assert tok.decode(targets) == tok.decode(tok("a red cat<|im_end|> blue<|im_end|>")["input_ids"])
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    grid = mb["image_grid_thw"]
    assert int((ids == image_token).sum()) == int(np.prod(grid, axis=1).sum()) // 4, "a token per 2 x 2 patches"
    assert mb["pixel_values"].shape[0] == int(np.prod(grid, axis=1).sum())
    assert set(mb["mm_token_type_ids"][0][ids == image_token]) == {1}, "the image's tokens are typed as such"


def test_an_unreadable_image_is_a_bad_row_counted_before_the_run(qwen_dir, tmp_path):
    images = write_images(tmp_path / "images", 2)
    rows = write_rows(tmp_path / "rows.jsonl", images, 5, broken=1)
    (tmp_path / "images" / "image1.png").write_bytes(b"not a png")  # rows 2 and 4 name it, row 5 a missing file
    cfg = DataConfig(source=str(rows), tokenizer=str(qwen_dir), seq_len=48, max_bad_fraction=0.05)
    summary = summarize(build_dataset(cfg, TEXT["vocab_size"], 0))
    assert summary.rows_bad == {"unreadable image": 3} and summary.rows_trainable == 2
    # where they are, the missing image's path among them, and the processor's chat template
    assert [line.split(": cannot read image ")[0] for line in summary.describe().splitlines()[1:]] == [
        f"  bad row: {rows} row {row} (line {row}, counting from 1)" for row in (2, 4, 5)]
    assert f"cannot read image {tmp_path / 'missing.png'}: FileNotFoundError" in summary.describe()
    assert summary.describe().splitlines()[0].endswith(
        f"; format sharegpt_images (told from the first row's columns), the processor's chat template ({qwen_dir})")


def test_images_packed_side_by_side_are_joined_as_their_processor_joins_them(tmp_path):
    """MiniCPM-V's image processor packs a batch's images side by side into one row of patches
    ([1, channels, patch, patches x patch]): a micro-batch of two rows of an image each joins them
    as the processor joins the two images at once; a processor of one entry an image (LLaVA's
    CLIP) joins them along the first axis."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    from megatrain_ray.data.documents import Document, Origin
    from megatrain_ray.data.image_text import ImageInputs, joined_axes, stack_image_inputs

    images = [Image.open(path).convert("RGB") for path in write_images(tmp_path, 2)]
    for image_processor, packed in ((MiniCPMV4_6ImageProcessorPil(), {"pixel_values": 3}),
                                    (CLIPImageProcessorPil(), {})):
        joined = joined_axes(SimpleNamespace(image_processor=image_processor))
        assert joined == packed
        rows = []
        for image in images:
            out = image_processor([image], return_tensors="np")
            per_image = {k: np.asarray(out[k]) for k in ("pixel_values", "target_sizes") if k in out}
            rows.append(Document(np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64), Origin("rows", 0),
                                 images=ImageInputs({}, per_image, joined)))
        both = image_processor(images, return_tensors="np")
        stacked = stack_image_inputs(rows, 4)
        assert set(stacked) == set(rows[0].images.per_image)
        for key, value in stacked.items():
            assert np.array_equal(value, np.asarray(both[key])), key


def test_the_format_named_in_the_config_reads_image_rows_as_auto_does(qwen_dir, tmp_path):
    """`data.format: sharegpt_images`, as the README and `megatrain-ray config` list it: the config
    takes it and the rows read as the detected format's do."""
    from dataclasses import replace

    from megatrain_ray.config import config_from_dict

    rows = write_rows(tmp_path / "rows.jsonl", write_images(tmp_path / "images", 2), 4)
    config = config_from_dict({"model": {"path": str(qwen_dir)},
                               "data": {"format": "sharegpt_images", "source": str(rows), "tokenizer": str(qwen_dir),
                                        "seq_len": 48}})
    named = build_dataset(config.data, TEXT["vocab_size"], 0)
    detected = build_dataset(replace(config.data, format="auto"), TEXT["vocab_size"], 0)
    assert named.format == detected.format == "sharegpt_images"
    for a, b in zip(named.fixed_batches(1, 4), detected.fixed_batches(1, 4), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)

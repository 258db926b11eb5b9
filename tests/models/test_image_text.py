"""Image-text models through transformers' own modules: a tiny model of each covered type (its
config class's defaults, only sizes cut: helpers/image_text.py), image-text SFT rows with tiny
random images read through the data path and the model's own processor, 3 AdamW steps of the
streaming trainer against transformers' model trained by torch.optim.AdamW on the same
micro-batches (its vision tower frozen as ours is, or trained with model.train_vision), the
export read back by transformers, which generates."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForImageTextToText  # noqa: E402

from megatrain_ray import cli  # noqa: E402
from megatrain_ray.config import config_from_dict  # noqa: E402
from megatrain_ray.models.image_text import embed_inputs, vision_kwargs  # noqa: E402
from megatrain_ray.files import shard  # noqa: E402
from megatrain_ray.files.checkpoint import CheckpointError  # noqa: E402
from megatrain_ray.host.store import ShardStore  # noqa: E402
from megatrain_ray.models.registry import model_arch, model_layouts  # noqa: E402
from megatrain_ray.runtime.local import LocalTrainer  # noqa: E402
from helpers.hf_parity import PARITY_OPTIM, RTOL, save, steps_and_export, the_runs_batches, token_loss_sum, train_transformers  # noqa: E402
from helpers.reference_training import assert_within_fp32_noise  # noqa: E402
from helpers.image_text import HAND_MADE, WITH_PROCESSOR, hand_made_batches, tiny_model_dir, write_images, write_rows  # noqa: E402

STEPS, ROWS, BROKEN = 3, 7, 1


def run_dict(model_dir: Path, data: Path, out: Path, train_vision: bool = False) -> dict:
    return {
        "model": {"path": str(model_dir), "compute_dtype": "float32", "train_vision": train_vision},
        "data": {"source": str(data), "tokenizer": str(model_dir), "seq_len": 40, "shuffle": False},
        "optim": dict(PARITY_OPTIM),
        "train": {"steps": STEPS, "grad_accum": 1, "micro_batch_size": 2, "seed": 0, "output_dir": str(out)},
        "checkpoint": {"export_hf": True, "export_dtype": "float32"},
        "executor": {"device": "cpu", "loss_chunk_tokens": 7, "compile": False},
    }


def prepared(model_type: str, tmp_path: Path, train_vision: bool = False):
    model, model_dir = tiny_model_dir(model_type, tmp_path / "hf")
    images = write_images(tmp_path / "images", 3)
    rows = write_rows(tmp_path / "rows.jsonl", images, ROWS, broken=BROKEN)
    config = config_from_dict(run_dict(model_dir, rows, tmp_path / "run", train_vision))
    return model, config


def vision_of(model) -> set[str]:
    """transformers' names of the vision tower and projector: all but the language model and head."""
    decoder = model.get_decoder()
    inner = {n for n, _ in decoder.named_parameters()}
    prefix = next(n for n, m in model.named_modules() if m is decoder) + "."
    return {n for n, _ in model.named_parameters()
            if not (n.startswith(prefix) and n[len(prefix):] in inner) and not n.startswith("lm_head")}


def exact_copy(model):
    """The model in float64: the exact result that fp32's runs both round. Its experts run one by
    one (grouped_mm, transformers' default for them, has no float64)."""
    exact = copy.deepcopy(model).double()
    if any("experts" in name for name, _ in exact.named_modules()):
        exact.set_experts_implementation("eager")
    return exact


def transformers_losses(model, config, data, train_vision: bool) -> list[float]:
    vision = vision_of(model)
    for name, p in model.named_parameters():
        p.requires_grad_(train_vision or name not in vision)

    def loss_sum(mb):  # the pixel values in the model's dtype (float64's exact run: LFM3-VL's tower does not cast them)
        inputs = vision_kwargs(embed_inputs(mb), dict(model.named_parameters()))
        return token_loss_sum(model(**inputs, use_cache=False).logits, mb["labels"])

    return train_transformers(model, config, data, loss_sum=loss_sum)


def check_export(export: Path, model, exact_model, initial: dict, frozen: set[str]) -> None:
    """Each tensor within fp32's noise of transformers' run (helpers/reference_training.py: a few
    Adam steps amplify rounding where gradients are near zero), frozen ones exactly as they were."""
    exported = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    ours, theirs, exact = exported.state_dict(), model.state_dict(), exact_model.state_dict()
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert_within_fp32_noise(ours[key], expected, exact[key], key)
        if key in frozen:
            assert torch.equal(ours[key], initial[key]), f"{key} is frozen: carried through unchanged"
    # buffers (a router's e_score_correction_bias) are transformers' too, but no optimizer moves them
    unchanged = [k for k, _ in model.named_parameters() if k not in frozen and torch.equal(ours[k], initial[k])]
    assert not unchanged, f"{unchanged} did not train"
    out = exported.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6), "the export generates"


def steps_in_process(model_type: str, tmp_path: Path, train_vision: bool = False) -> None:
    model, config = prepared(model_type, tmp_path, train_vision)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    arch = model_arch(config.model)
    data = the_runs_batches(config, arch.vocab_size)
    assert all("pixel_values" in mb for step in data for mb in step), "each micro-batch carries its images"
    losses, export = steps_and_export(config, arch, config.model.path, data, tmp_path / "export")
    exact_model = exact_copy(model)
    assert losses == pytest.approx(transformers_losses(model, config, data, train_vision), rel=RTOL)
    transformers_losses(exact_model, config, data, train_vision)
    check_export(export, model, exact_model, initial, set() if train_vision else vision_of(model))


@pytest.mark.parametrize("train_vision", [False, True])
def test_train_command_trains_as_transformers_and_skips_an_unreadable_image(local_ray, tmp_path, capsys, train_vision):
    """`megatrain-ray train CONFIG` on the module's Ray cluster: the unreadable image's row is
    counted and skipped at start, the metrics' losses and the export are transformers', the vision
    tower frozen or, with model.train_vision, trained (the stores' actors and the GPU worker are
    handed the setting)."""
    model, config = prepared("qwen2_5_vl", tmp_path, train_vision)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "shm").mkdir()
    fields = {**run_dict(Path(config.model.path), Path(config.data.source), tmp_path / "run", train_vision),
              "runtime": {"shm_dir": str(tmp_path / "shm")}}
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(fields))

    assert cli.main(["train", str(config_file)]) == 0
    out = capsys.readouterr().out
    tower = "trained (model.train_vision)" if train_vision else "frozen (model.train_vision: false)"
    assert "1 unreadable image" in out and f"its vision tower and projector {tower}" in out
    data = the_runs_batches(config, model.config.text_config.vocab_size)
    exact_model = exact_copy(model)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(transformers_losses(model, config, data, train_vision),
                                                         rel=RTOL)
    transformers_losses(exact_model, config, data, train_vision)
    final = tmp_path / "run" / "checkpoints" / f"step-{STEPS:08d}" / "hf"
    assert (final / "preprocessor_config.json").is_file(), "the export carries the processor"
    check_export(final, model, exact_model, initial, set() if train_vision else vision_of(model))


@pytest.mark.parametrize("model_type", WITH_PROCESSOR)
def test_in_process_steps_export_equals_transformers_adamw(tmp_path, model_type):
    steps_in_process(model_type, tmp_path)


@pytest.mark.parametrize("model_type", HAND_MADE)
def test_from_micro_batches_made_as_its_processor_makes_them(tmp_path, model_type):
    """Pixtral's, Cohere 2 Vision's and LFM2-VL's image processors need torchvision (absent here),
    Gemma 4's pads an image to more image tokens than the test's rows hold: the micro-batches are
    made by hand, the rest as for the other types."""
    model, model_dir = tiny_model_dir(model_type, tmp_path / "hf")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = config_from_dict(run_dict(model_dir, tmp_path / "unused.jsonl", tmp_path / "run"))
    arch = model_arch(config.model)
    data = hand_made_batches(model_type, model_dir, STEPS)
    losses, export = steps_and_export(config, arch, model_dir, data, tmp_path / "export")
    exact_model = exact_copy(model)
    assert losses == pytest.approx(transformers_losses(model, config, data, False), rel=RTOL)
    transformers_losses(exact_model, config, data, False)
    check_export(export, model, exact_model, initial, vision_of(model))


def test_qwen3_5_multi_token_prediction_module_is_carried_unchanged(tmp_path):
    """Qwen3.5's published files hold its multi-token-prediction module beside the model (`mtp.*`,
    text_config.mtp_num_hidden_layers), which transformers' model ignores on load: the weights load
    past it, a step trains, and the export carries it as it was stored; transformers loads the export."""
    from safetensors.torch import load_file, save_file

    from megatrain_ray.files.carried import carried_tensors
    from megatrain_ray.files.hf import export_hf
    from megatrain_ray.models.transformers.family import TRANSFORMERS

    model, config = prepared("qwen3_5", tmp_path)
    model_dir = Path(config.model.path)
    gen, hidden = torch.Generator().manual_seed(3), model.config.text_config.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen).to(torch.bfloat16),
           "mtp.norm.weight": torch.randn(hidden, generator=gen)}
    save_file({**load_file(model_dir / "model.safetensors"), **mtp}, model_dir / "model.safetensors",
              metadata={"format": "pt"})
    saved = json.loads((model_dir / "config.json").read_text())
    saved["text_config"]["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(saved))

    arch = model_arch(config.model)
    assert "1 multi-token-prediction layer (config.json)" in TRANSFORMERS.carried_note(arch)
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        trainer.train_step(the_runs_batches(config, arch.vocab_size)[0])
        export = export_hf(tmp_path / "export", arch, enumerate(trainer.layer_weights()),
                           carried=carried_tensors(model_dir, arch))
    finally:
        trainer.close()
    stored = {k: v for file in export.glob("*.safetensors") for k, v in load_file(file).items() if k in mtp}
    assert set(stored) == set(mtp) and all(stored[k].dtype == v.dtype and torch.equal(stored[k], v)
                                           for k, v in mtp.items())
    AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)


def test_validation_loss_is_transformers_with_the_images(tmp_path):
    """eval_loss (forward only, layer-major) on image-text micro-batches: transformers' summed loss."""
    model, config = prepared("gemma3", tmp_path)
    arch = model_arch(config.model)
    data = the_runs_batches(config, arch.vocab_size)[0]
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(config.model.path))
        ours = trainer.eval_loss(data)
    finally:
        trainer.close()
    model.eval()
    with torch.no_grad():
        theirs = sum(float(token_loss_sum(model(**embed_inputs(mb), use_cache=False).logits, mb["labels"]))
                     for mb in data)
    assert ours.loss_sum == pytest.approx(theirs, rel=RTOL)


def test_a_frozen_tower_holds_no_optimizer_state_and_resumes_exactly(tmp_path):
    """The vision tower, at the embedding layer's end, has no moments while frozen (8 bytes a
    parameter less in fp32), and 3 steps equal 2, a checkpoint and 1 more, bit for bit."""
    model, config = prepared("llava", tmp_path)
    arch = model_arch(config.model)
    embedding = model_layouts(arch)[0]
    vision = sum(p.numel() for n, p in model.named_parameters() if n in vision_of(model))
    assert embedding.trained_numel == embedding.numel - vision
    data = the_runs_batches(config, arch.vocab_size)
    whole = LocalTrainer(config, arch)
    trained = LocalTrainer(config_from_dict(run_dict(Path(config.model.path), Path(config.data.source),
                                                    tmp_path / "run", train_vision=True)), arch)
    try:
        assert whole.stores[0].layers[0].exp_avg.numel() == embedding.trained_numel
        assert trained.stores[0].host_bytes() - whole.stores[0].host_bytes() == 8 * vision
        losses = [whole.train_step(step).loss for step in data]
        ours = [t.clone() for t in whole.layer_weights()]
    finally:
        whole.close()
        trained.close()
    first = LocalTrainer(config, arch)
    try:
        split = [first.train_step(step).loss for step in data[:2]]
        (tmp_path / "ckpt").mkdir()
        files = save(first, tmp_path / "ckpt")
    finally:
        first.close()
    unfrozen = ShardStore(arch, list(files), torch.float32, train_vision=True)
    with pytest.raises(CheckpointError, match="saved with another model.train_vision"):
        shard.load_layers(unfrozen, files)
    second = LocalTrainer(config, arch)
    try:
        for store in second.stores:
            shard.load_layers(store, files)
        second.lr_schedule.updates_done = 2
        split.append(second.train_step(data[2]).loss)
        resumed = second.layer_weights()
        assert split == losses and all(torch.equal(a, b) for a, b in zip(ours, resumed, strict=True))
    finally:
        second.close()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl"])
def test_train_vision_trains_the_tower_as_transformers_does(tmp_path, model_type):
    """Qwen3-VL's deepstack mergers get their gradients only through the features that the first
    decoder layers add: they train as transformers trains them; so do Qwen3.5's tower and InternVL's."""
    steps_in_process(model_type, tmp_path, train_vision=True)


def test_dropout_in_a_sub_config_is_replayed_in_the_recompute(tmp_path):
    """A training forward that draws random numbers in the decoder or the tower (their sub-configs'
    dropout) has its draws replayed (streaming/rng.py), as for a decoder alone."""
    from megatrain_ray.models.transformers.family import TRANSFORMERS

    model, config = prepared("llava", tmp_path)
    assert not TRANSFORMERS.draws_random(model_arch(config.model))
    saved = json.loads((Path(config.model.path) / "config.json").read_text())
    saved["text_config"]["attention_dropout"] = 0.1
    (Path(config.model.path) / "config.json").write_text(json.dumps(saved))
    assert TRANSFORMERS.draws_random(model_arch(config.model))


def test_deepstack_features_flow_behind_the_hidden_states_and_the_plan_counts_them(tmp_path):
    """Qwen3-VL: the embedding layer hands on the hidden states and, per deepstack layer, the
    vision tower's features at the image tokens (zero elsewhere), as transformers' own vision
    forward makes them; a block hands them on unchanged behind its output (the first ones add
    theirs to it: the steps against transformers above), and the planner's boundary activations
    are that wide."""
    from megatrain_ray.models.transformers.family import TRANSFORMERS
    from megatrain_ray.planning.memory import hidden_state_bytes

    model, config = prepared("qwen3_vl", tmp_path)
    arch = model_arch(config.model)
    deep, hidden = len(model.config.vision_config.deepstack_visual_indexes), arch.hidden_size
    assert 0 < arch.deepstack_layers == deep < arch.num_layers
    assert arch.stream_width == hidden * (1 + deep)
    mb = the_runs_batches(config, arch.vocab_size)[0][0]
    state = model.state_dict()
    layouts = model_layouts(arch)
    weights = [{p.name: state[layout.hf_name(p.name)] for p in layout.params} for layout in layouts]
    model.set_attn_implementation("sdpa")  # as the streamed layers run it: the same arithmetic
    with torch.no_grad():
        x = TRANSFORMERS.embed(arch, weights[0], TRANSFORMERS.embed_inputs(arch, mb))
        maps = model.model.get_image_features(mb["pixel_values"], mb["image_grid_thw"], return_dict=True)
        ctx = TRANSFORMERS.batch_context(arch, mb, x.dtype)
        y = TRANSFORMERS.block(arch, weights[1], x, TRANSFORMERS.layer_context(arch, ctx, 1))
    at = mb["input_ids"] == model.config.image_token_id
    theirs = torch.zeros(*at.shape, deep, hidden)
    theirs[at] = torch.stack([torch.cat(m) for m in maps.deepstack_features], dim=-2)
    assert at.any() and theirs[at].abs().sum() > 0
    assert torch.equal(x[..., hidden:].unflatten(-1, (deep, hidden)), theirs)
    assert torch.equal(y[..., hidden:], x[..., hidden:])
    assert hidden_state_bytes(arch, config) == config.train.micro_batch_size * config.data.seq_len * arch.stream_width * 4


def tower_peak(model, patches: int, trained: bool) -> int:
    """The peak bytes torch's memory tracker counts while Qwen2-VL's vision tower and merger run on
    `patches` patches (forward without gradient; or, trained, forward and backward), beside the
    pixel values (alive throughout, as a micro-batch's are) and without its weights and their
    gradients (the plan's weight slots and gradient buffers)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    visual = model.model.visual
    grid = torch.tensor([[1, 16, patches // 16]])  # one image of 16 rows of patches (even: 2 x 2 merged)
    tracker = MemTracker()
    tracker.track_external(visual)
    with tracker:
        pixels = torch.randn(patches, 3 * 2 * 14 * 14)
        with torch.set_grad_enabled(trained):
            out = visual(pixels, grid_thw=grid)
            out = out if torch.is_tensor(out) else out.pooler_output
            if trained:
                out.sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    visual.zero_grad(set_to_none=True)
    return peak["Total"] - peak[_MemRefType.PARAM] - peak[_MemRefType.GRAD]


def test_the_plan_counts_the_vision_tower_by_its_patches_and_whether_it_trains(tmp_path, capsys):
    """The plan's line for the vision tower and projector (ModelFamily.vision_bytes): in proportion
    to a micro-batch's positions (every one an image token at most: 4 patches each, Qwen2-VL's
    merger), larger when the tower trains, within 2x above the peak torch's memory tracker counts
    for the tiny Qwen2-VL's tower on that many patches, frozen and trained; a GPU too small for it
    is told to freeze the tower; `megatrain-ray plan` prints it."""
    from megatrain_ray.planning.decisions import check_gpu_fit
    from megatrain_ray.planning.memory import PlanError, gpu_plan, vision_line

    model, model_dir = tiny_model_dir("qwen2_vl", tmp_path / "hf")
    model.set_attn_implementation("sdpa")  # as the embedding layer runs it (eager attention keeps patches^2 a head)
    fields = run_dict(model_dir, tmp_path / "rows.jsonl", tmp_path / "run")
    lines = {}
    for seq_len in (40, 80):
        for trained in (False, True):
            fields["data"]["seq_len"], fields["model"]["train_vision"] = seq_len, trained
            config = config_from_dict(fields)
            arch = model_arch(config.model)
            lines[seq_len, trained] = gpu_plan(arch, config).by_use[vision_line(trained)]
    assert lines[80, False] == 2 * lines[40, False] and lines[80, True] == 2 * lines[40, True]
    assert lines[40, True] > lines[40, False]
    with pytest.raises(PlanError, match=r"the vision tower frozen \(model.train_vision: false"):
        check_gpu_fit(gpu_plan(arch, config), lines[80, True], "the GPU")  # the trained tower's alone

    patches = 4 * 2 * 80  # micro_batch_size 2 of seq_len 80
    for trained in (False, True):
        measured = tower_peak(model, patches, trained)
        assert measured <= lines[80, trained] <= 2 * measured, (trained, measured, lines[80, trained])

    (tmp_path / "rows.jsonl").write_text("")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(fields))
    assert cli.main(["plan", str(config_file), "--cluster", "examples/cluster-h100-128g.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"{vision_line(config.model.train_vision)}: " in out, out


def test_a_paligemma_row_attends_causally_from_its_answer_on(tmp_path):
    """PaliGemma's processor marks a `suffix` it is given apart (token_type_ids 1: attended causally,
    the image and the prompt before it bidirectionally); a chat row's answer is that suffix: its
    tokens and the padding after them are 1, the image tokens and the prompt 0, and the loss is on
    the answer only. (The steps against transformers above run these micro-batches.)"""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    model, config = prepared("paligemma:rows", tmp_path)
    image_token = model.config.image_token_id
    processor = AutoProcessor.from_pretrained(config.model.path)
    theirs = processor(text=["<image>what is this"], images=[[Image.new("RGB", (28, 28))]], suffix=["a cat"])
    assert set(np.asarray(theirs["token_type_ids"][0]).tolist()) == {0, 1}, "the processor marks a suffix"
    data = the_runs_batches(config, model.config.text_config.vocab_size)
    for mb in (mb for step in data for mb in step):
        for ids, labels, types in zip(mb["input_ids"], mb["labels"], mb["token_type_ids"], strict=True):
            first_answer = int(torch.nonzero(labels != -100)[0]) + 1  # labels[t]: the target of token t
            assert not types[:first_answer].any() and types[first_answer:].all()
            assert not types[ids == image_token].any()

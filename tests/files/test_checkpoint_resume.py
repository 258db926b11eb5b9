"""Exact resume through the driver: 10 steps in one go equal 5 + resume + 5, bit for bit, and a
checkpoint write killed half way leaves the previous checkpoint whole."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.config import config_from_dict
from megatrain_ray.data import DataPosition, build_dataset
from megatrain_ray.runtime.training import run_training
from helpers.runs import as_stood_at, tensors_of, tiny_raw



def layer_steps(checkpoint: Path) -> dict[str, int]:
    """Each layer's AdamW update count, as the shards' metadata keeps it."""
    steps = {}
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(str(file), "pt") as shard:
            steps.update(json.loads(shard.metadata()["layer_steps"]))
    return steps


def meta_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / ckpt.META).read_text())


@pytest.fixture(scope="module", params=["host", "device"])
def resumed(local_ray, tmp_path_factory, request) -> dict:
    """10 steps in one go ("whole"), and the same run from step 5 resumed ("split"), recording each
    file the resume hashed. host: the same config stopped after step 5 (until_step: its own final
    checkpoint); device: the one-go run's own checkpoint of step 5 (checkpoint.every=5), and the
    embedding's state and update count go through the checkpoint from the GPU worker's step
    (streaming/device_step.py), and its bias correction goes on from there."""
    root = tmp_path_factory.mktemp(f"resume-{request.param}")

    def config(run: str):
        return config_from_dict(tiny_raw(root / run, executor={"device": "cpu", "compile": False,
                                                                "embedding_step": request.param}))

    whole = run_training(config("whole"))
    if request.param == "host":
        run_training(config("split"), until_step=5)
    else:  # the checkpoint a run writes on its way: a third run proves no more
        as_stood_at(root / "whole", root / "split", 5)
    hashed, real_digest = [], ckpt.file_digest

    def counting_digest(path):
        hashed.append(Path(path))
        return real_digest(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "file_digest", counting_digest)
        resumed = run_training(config("split"), resume="latest")
    return {"root": root, "whole": whole, "resumed": resumed, "hashed": hashed}


def test_ten_steps_equal_five_then_resume_five(resumed):
    root = resumed["root"]
    first = ckpt.list_checkpoints(root / "split" / "checkpoints")[0]
    assert first.name == "step-00000005"
    assert set(layer_steps(first).values()) == {5}  # every layer's update count, the embedding's too

    a, b = Path(resumed["whole"]["checkpoint"]), Path(resumed["resumed"]["checkpoint"])
    assert a.name == b.name == "step-00000010"
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys() and any(k.endswith("exp_avg_sq") for k in ta)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    ma, mb = meta_of(a), meta_of(b)
    for key in ("step", "updates_done", "data_position", "rng"):
        assert ma[key] == mb[key], key
    assert resumed["whole"]["final_loss"] == resumed["resumed"]["final_loss"]

    def losses(run):
        records = map(json.loads, (root / run / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records]

    assert losses("split") == losses("whole")

    # The next batch after the resumed run is the one the uninterrupted run would take.
    config = config_from_dict(tiny_raw(root / "whole"))
    dataset = build_dataset(config.data, 256, config.train.seed)
    next_a, _ = next(dataset.batches(2, 2, DataPosition.from_dict(ma["data_position"])))
    next_b, _ = next(dataset.batches(2, 2, DataPosition.from_dict(mb["data_position"])))
    for x, y in zip(next_a, next_b, strict=True):
        assert all((x[k] == y[k]).all() for k in x)


def test_resume_hashes_each_checkpoint_file_once(resumed):
    """At 7B a checkpoint is ~91 GB: the driver reads it once to verify it, not once per layer of code."""
    resumed_from = ckpt.list_checkpoints(resumed["root"] / "split" / "checkpoints")[0]
    files = sorted(p.name for p in resumed_from.iterdir() if p.name != ckpt.MANIFEST)
    assert len(files) >= 2  # a shard and meta.json
    of_resumed = sorted(p.name for p in resumed["hashed"] if p.parent == resumed_from)
    assert of_resumed == files, of_resumed


def test_a_resume_with_more_steps_keeps_the_lr_schedule_unless_asked():
    """A checkpoint of a 10-step run resumed with train.steps=12 keeps its 10-step cosine (steps 11
    and 12 at its floor, not a cosine over 12 steps that jumps back up) and says so; optim.schedule_steps
    asks for a new horizon. Through the CLI and the actors: tests/entry/test_quick_start.py."""
    from helpers.reference_training import reference_lr
    from megatrain_ray.host.adamw import LrSchedule

    first = config_from_dict(tiny_raw(Path("out"), steps=10))
    meta = {"step": 10, "config": first.to_dict()}
    longer = config_from_dict(tiny_raw(Path("out"), steps=12))
    kept, line = ckpt.schedule_on_resume(longer, meta)
    assert kept == 10 and longer.optim.schedule_steps is None  # the step plan's length; the config as written
    assert line == ("LR schedule: kept from the checkpoint's run (warmup + cosine over 10 steps); train.steps=12 goes "
                    "on past its end: from step 11 the LR stays at its floor, optim.lr x optim.min_lr_ratio. For a "
                    "schedule over the new length: --set optim.schedule_steps=12")
    floor = first.optim.lr * first.optim.min_lr_ratio
    schedule = LrSchedule(longer.optim, kept, updates_done=10)
    assert [schedule.next(0.0).lr for _ in range(2)] == pytest.approx([floor, floor])
    assert reference_lr(first.optim, 10, 12) > 1.1 * floor  # what a cosine over the new length would give

    asked = config_from_dict(tiny_raw(Path("out"), steps=16, optim={"schedule_steps": 16}))
    wider, line = ckpt.schedule_on_resume(asked, meta)
    assert wider is None and line == ("LR schedule: a new horizon of 16 steps (optim.schedule_steps) from step 11; "
                                       "the checkpoint's run followed one of 10 steps")
    assert LrSchedule(asked.optim, 16, updates_done=10).next(0.0).lr == pytest.approx(reference_lr(first.optim, 10, 16))
    # the same length again (an interrupted run resumed as it was) is no news; a resumed run's checkpoint
    # records the length its plan followed (a third run keeps 10, not the resumed run's train.steps)
    assert ckpt.schedule_on_resume(first, meta) == (10, None)
    assert ckpt.schedule_on_resume(longer, {"step": 12, "config": longer.to_dict(), "schedule_steps": 10})[0] == 10


def test_rng_state_round_trips_through_json():
    torch.manual_seed(1)
    state = json.loads(json.dumps(ckpt.capture_rng_state()))
    expected = (torch.rand(3), __import__("numpy").random.rand(2).tolist(), __import__("random").random())
    ckpt.restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert __import__("numpy").random.rand(2).tolist() == expected[1]
    assert __import__("random").random() == expected[2]


# ---------------------------------------------------------------------------------------------
# A crash while a checkpoint is written
# ---------------------------------------------------------------------------------------------

WRITER = textwrap.dedent('''
    """Writes a complete checkpoint at step 1, then starts step 2 and stalls inside `stage`,
    announcing it on stdout, so that the test can SIGKILL it there."""
    import sys, time
    from pathlib import Path
    import torch
    from megatrain_ray.files import checkpoint as ckpt; from megatrain_ray.files import durable as files

    root, stage = Path(sys.argv[1]), sys.argv[2]
    def save(step, stall):
        staging = ckpt.new_staging_dir(root, step)
        tensors = {ckpt.tensor_name(0, k): torch.full((1 << 16,), float(step)) for k in ckpt.STATE_KEYS}
        if stall == "shard":  # half a shard on disk, then the kill
            (staging / "shard-000.safetensors").write_bytes(b"\\0" * 4096)
            print("STALLED", flush=True); time.sleep(600)
        shards = [ckpt.write_shard(staging, "shard-000.safetensors", tensors, {0: step})]
        if stall == "manifest":  # shards and meta written, the manifest not yet
            ckpt.write_json(staging / ckpt.META, {"step": step})
            print("STALLED", flush=True); time.sleep(600)
        if stall == "rename":  # complete in the staging directory, not yet renamed into place
            real_rename = files.os.rename
            def stall_rename(a, b):
                print("STALLED", flush=True); time.sleep(600)
            files.os.rename = stall_rename
        ckpt.commit(staging, root, step, shards, {"step": step}, keep=2)
    save(1, None)
    save(2, stage)
''')


@pytest.mark.parametrize("stage", ["shard", "manifest", "rename"])
def test_kill_during_checkpoint_write_keeps_previous(tmp_path, stage):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, str(script), str(root), stage], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout.readline().strip() == "STALLED"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000001"]
    latest = ckpt.resolve("latest", root)
    manifest, meta = ckpt.read_manifest(latest)  # hashes verified
    assert meta["step"] == 1
    files = ckpt.shard_files_by_layer(latest, manifest)
    state, step = ckpt.read_layer_state(files[0], 0)
    assert step == 1 and torch.equal(state["master"], torch.full((1 << 16,), 1.0))
    assert any(p.name.startswith(".step-00000002.tmp-") for p in root.iterdir())  # the torso, ignored


def test_rewriting_the_same_step_keeps_a_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for value in (1.0, 2.0):
        staging = ckpt.new_staging_dir(root, 7)
        tensors = {ckpt.tensor_name(0, k): torch.full((4,), value) for k in ckpt.STATE_KEYS}
        shards = [ckpt.write_shard(staging, "shard-000.safetensors", tensors, {0: 7})]
        ckpt.commit(staging, root, 7, shards, {"step": 7}, keep=2)
    latest = ckpt.resolve("latest", root)
    manifest, _ = ckpt.read_manifest(latest)
    state, _ = ckpt.read_layer_state(ckpt.shard_files_by_layer(latest, manifest)[0], 0)
    assert torch.equal(state["master"], torch.full((4,), 2.0))
    assert [p.name for p in root.iterdir()] == ["step-00000007"]


def test_a_shard_the_disk_refuses_is_an_os_error_naming_the_file(tmp_path):
    """safetensors' own I/O error becomes the OSError it stands for (the CLI's file-system error,
    exit 2); here the directory is gone, as a full disk would refuse the write."""
    gone = tmp_path / "gone"
    with pytest.raises(OSError) as e:
        ckpt.write_shard(gone, "shard-000.safetensors", {"layers.0.master": torch.zeros(4)}, {0: 1})
    assert e.value.errno == 2 and e.value.filename == str(gone / "shard-000.safetensors")

"""Bad input through the CLI: one clear paragraph on stderr and exit status 2, before any heavy
work, never a traceback."""

from pathlib import Path

import pytest
import ray
import torch
import yaml

from megatrain_ray.files import checkpoint as ckpt, shard
from megatrain_ray.cli import main
from megatrain_ray.files.checkpoint import checkpoint_meta
from megatrain_ray.models.registry import model_arch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.host.store import ShardStore
from helpers.runs import tiny_raw



def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_raw(tmp_path / "out", **sections)))
    return path


def train(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *map(str, argv)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def write_checkpoint(config_path: Path, step: int = 1) -> Path:
    """A real checkpoint of the config's model, written in process (no cluster needed)."""
    from megatrain_ray.config import load_config

    config = load_config(config_path)
    arch = model_arch(config.model)
    store = ShardStore(arch, list(range(len(model_layouts(arch)))), torch.float32)
    store.init_random(0, 0.02)
    root = Path(config.train.output_dir) / "checkpoints"
    staging = ckpt.new_staging_dir(root, step)
    tensors, steps = shard.state_tensors(store)
    shards = [ckpt.write_shard(staging, "shard-000.safetensors", tensors, steps)]
    return ckpt.commit(staging, root, step, shards, checkpoint_meta(config, arch, step, step, None), keep=2)


# ---------------------------------------------------------------------------------------------
# Config mistakes: refused before Ray starts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("train.stpes=3", "unknown config key 'train.stpes'; did you mean 'steps'?"),
    ("trian.steps=3", "unknown config key 'trian'; did you mean 'train'?"),
    ("train.steps=many", "train.steps must be an integer, got 'many'"),
    ("optim.lr=fast", "optim.lr must be a number, got 'fast'"),
    ("data.pack=maybe", "data.pack must be true or false"),
    ("optim.betas=0.9", "optim.betas must be a list of 2 values"),
    ("train.grad_accum=0", "train.grad_accum must be >= 1"),
    ("executor.device=tpu", "executor.device must be auto, cuda or cpu"),
    ("model.overrides.num_layer=3", "unknown key model.overrides.num_layer; did you mean 'num_layers'?"),
    ("model.overrides.num_heads=3", "num_heads (3) must be a multiple of num_kv_heads"),
    ("model.preset=tiny-lama", "unknown model preset 'tiny-lama'"),
])
def test_config_mistakes_are_one_line_errors(tmp_path, capsys, override, expected):
    code, err = train(capsys, write_config(tmp_path), "--set", override)
    assert code == 2 and expected in err, err
    assert err.startswith("megatrain-ray: configuration error:"), err


def test_on_and_off_are_words_in_config_files_and_overrides(tmp_path):
    """YAML 1.1 (PyYAML's default) reads on/off as booleans, which the string settings refused."""
    from megatrain_ray.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny\nexecutor:\n  device: cpu\n  offload_activations: off\n")
    assert load_config(path).executor.offload_activations == "off"
    assert load_config(path, ["executor.offload_activations=on"]).executor.offload_activations == "on"
    assert load_config(path, ["data.pack=false"]).data.pack is False
    with pytest.raises(ConfigError, match="data.pack must be true or false, got 'yes'"):
        load_config(path, ["data.pack=yes"])


# Values of the right type that cannot work: each refused by config.check_values before Ray starts
# (not as a traceback inside an actor).
IMPOSSIBLE = [
    ("executor.loss_chunk_tokens=0", "executor.loss_chunk_tokens must be >= 1"),
    ("executor.mlp_chunk_tokens=-1", "executor.mlp_chunk_tokens must be >= 0"),
    ("executor.num_slots=1", "executor.num_slots must be >= 2"),
    ("executor.keep_graphs=-1", "executor.keep_graphs must be >= 0"),
    ("data.shuffle_buffer=0", "data.shuffle_buffer must be >= 1"),
    ("data.read_batch_rows=0", "data.read_batch_rows must be >= 1"),
    ("data.synthetic_docs=0", "data.synthetic_docs must be >= 1"),
    ("data.eos_token_id=-2", "data.eos_token_id must be >= 0"),
    ("data.format=csv", "data.format must be auto, tokens, text, alpaca, sharegpt or sharegpt_images"),
    ("runtime.optimizer_threads=0", "runtime.optimizer_threads must be >= 1"),
    ("runtime.num_cpus=0", "runtime.num_cpus must be >= 1"),
    ("runtime.object_store_memory=-1", "runtime.object_store_memory must be >= 78643200 bytes"),
    ("optim.eps=0", "optim.eps must be a finite number > 0"),
    ("optim.eps=-1e-8", "optim.eps must be a finite number > 0"),
    ("optim.betas=[0.9,1.0]", "optim.betas must both be within [0, 1)"),
    ("optim.betas=[-0.1,0.95]", "optim.betas must both be within [0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
    ("optim.lr=.inf", "optim.lr must be a finite number >= 0"),
    ("optim.grad_clip=.nan", "optim.grad_clip must be a finite number >= 0"),
    ("model.init_std=-0.02", "model.init_std must be a finite number >= 0"),
    ("train.seed=-1", "train.seed must be within [0, 2**32)"),
    ("checkpoint.keep=0", "checkpoint.keep must be >= 1"),
    ("eval.batches=0", "eval.batches must be >= 1"),
    ("model.router_aux_loss_coef=-0.01", "model.router_aux_loss_coef must be a finite number >= 0"),
    ("checkpoint.every=-5", "checkpoint.every must be >= 0"),
    ("model.overrides.num_kv_heads=0", "model.num_kv_heads must be positive"),
    ("model.overrides.rms_norm_eps=0", "model.rms_norm_eps must be positive"),
]


@pytest.mark.parametrize("override, expected", IMPOSSIBLE)
def test_impossible_values_are_refused_before_ray_starts(tmp_path, capsys, override, expected):
    code, err = train(capsys, write_config(tmp_path), "--set", override)
    assert code == 2 and expected in err, err
    assert err.startswith("megatrain-ray: configuration error:") and err.count("\n") == 1, err
    assert not ray.is_initialized()


def test_every_impossible_value_is_named_in_one_message(tmp_path, capsys):
    overrides = [o for o, _ in IMPOSSIBLE if not o.startswith("model.overrides")]
    code, err = train(capsys, write_config(tmp_path), *[a for o in overrides for a in ("--set", o)])
    assert code == 2 and err.count("\n") == 1, err
    for override, expected in IMPOSSIBLE:
        if not override.startswith("model.overrides"):
            assert expected in err, (override, err)


def test_missing_or_broken_config_file(tmp_path, capsys):
    code, err = train(capsys, tmp_path / "nope.yaml")
    assert code == 2 and "does not exist" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [steps: 3\n")
    code, err = train(capsys, broken)
    assert code == 2 and "is not valid YAML" in err


def test_missing_data_file(tmp_path, capsys):
    code, err = train(capsys, write_config(tmp_path, data={"source": str(tmp_path / "none.parquet")}))
    assert code == 2 and "DataError" in err and "none.parquet" in err, err


# ---------------------------------------------------------------------------------------------
# Checkpoints that cannot be resumed
# ---------------------------------------------------------------------------------------------


def test_resume_without_any_checkpoint(tmp_path, capsys):
    code, err = train(capsys, write_config(tmp_path), "--resume")
    assert code == 2 and "no complete checkpoint under" in err, err
    code, err = train(capsys, write_config(tmp_path), "--resume", tmp_path / "elsewhere")
    assert code == 2 and "no such checkpoint directory" in err, err


def test_resume_a_checkpoint_of_another_model(tmp_path, capsys):
    config = write_config(tmp_path)
    path = write_checkpoint(config)
    code, err = train(capsys, config, "--resume", path, "--set", "model.overrides.num_layers=3")
    assert code == 2 and "is from another model: num_layers is 2 there but 3 here" in err, err


def test_resume_a_corrupt_shard(tmp_path, capsys):
    config = write_config(tmp_path)
    path = write_checkpoint(config)
    shard = path / "shard-000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte deep in a tensor
    shard.write_bytes(bytes(data))
    code, err = train(capsys, config, "--resume", "latest")
    assert code == 2 and "shard-000.safetensors is corrupt" in err, err


def test_resume_a_half_written_checkpoint(tmp_path, capsys):
    config = write_config(tmp_path)
    path = write_checkpoint(config)
    (path / ckpt.MANIFEST).unlink()
    code, err = train(capsys, config, "--resume", path)
    assert code == 2 and "not a complete checkpoint" in err and "half-written" in err, err


# ---------------------------------------------------------------------------------------------
# Runs the cluster cannot hold: refused by the placement plan, before any actor exists
# ---------------------------------------------------------------------------------------------


def test_model_too_big_for_host_memory(local_ray, tmp_path, capsys):
    config = write_config(tmp_path, model={"preset": "qwen2.5-14b"})
    code, err = train(capsys, config)
    assert code == 2 and "the model needs" in err and "GiB of host memory" in err and "add RAM nodes" in err, err
    assert not any(a["State"] == "ALIVE" for a in ray._private.state.actors().values())  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a cluster without GPUs")
def test_cuda_demanded_on_a_cluster_without_gpus(local_ray, tmp_path, capsys):
    code, err = train(capsys, write_config(tmp_path), "--set", "executor.device=cuda")
    assert code == 2 and "no node of the Ray cluster offers a GPU" in err, err


def test_a_step_that_cannot_fit_is_bad_input_not_a_cluster_fault(local_ray, tmp_path, capsys):
    """The executor refuses it from its actor before allocating: exit 2, one paragraph, and no
    auto-resume retrying the same impossible step. (On the CPU the executor's activations live in
    host memory; train.steps=0 would make any run that is not refused finish at once.)"""
    config = write_config(tmp_path, train={"steps": 0, "micro_batch_size": 64, "grad_accum": 64,
                                           "resume_wait_s": 1, "max_restarts": 3},
                          data={"seq_len": 2**20})
    code = main(["train", str(config), "--auto-resume"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("megatrain-ray: PlanError: the step needs about") and err.count("\n") == 1, err
    assert "train.grad_accum" in err and "ClusterFault" not in err and "auto-resume" not in err, err
    assert "auto-resume" not in out, out  # no retry of the same impossible step


# ---------------------------------------------------------------------------------------------
# Export of something that is not a checkpoint
# ---------------------------------------------------------------------------------------------


def test_export_of_a_run_directory_names_its_checkpoints(tmp_path, capsys):
    config = write_config(tmp_path)
    write_checkpoint(config, step=1)
    last = write_checkpoint(config, step=2)
    run = tmp_path / "out"
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatrain-ray: CheckpointError: {run} is not a checkpoint but holds 2: "
                          f"step-00000001, step-00000002 in {run / 'checkpoints'}"), err
    assert f"`megatrain-ray export {last} {tmp_path / 'hf'}`" in err and err.count("\n") == 1, err
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2  # no checkpoint there or beneath
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a checkpoint (no MANIFEST.json" in err and "holds none" in err, err
    assert not (tmp_path / "hf").exists()

"""What the transformers family cannot run is refused before Ray starts, in one paragraph that
names it, with exit status 2; model.implementation picks or refuses a path. No Ray cluster in this
module: the refusals must come before one starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import ray  # noqa: E402

from megatrain_ray.cli import main as cli_main  # noqa: E402
from megatrain_ray.config import ConfigError, ModelConfig  # noqa: E402
from megatrain_ray.models.transformers.arch import TransformersArch  # noqa: E402
from megatrain_ray.models.registry import model_arch  # noqa: E402



def write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, named", [
    ({"model_type": "t5"}, "no causal language model for model_type 't5'"),
    ({"model_type": "roberta"}, "its decoder holds no list of layers beside its input embedding"),
    # its language model below its model, beside the patch embedding that model holds too
    ({"model_type": "fuyu"}, "its decoder holds no list of layers beside its input embedding"),
    ({"model_type": "opt", "layerdrop": 0.1}, "skips each layer at random in training (layerdrop: 0.1)"),
    ({"model_type": "mllama"}, "its layers have cross-attention"),
    # its config class requires n_input_layers + n_recurrent_layers + n_output_layers == num_hidden_layers
    # (all counted twice: a layer's attention and MLP blocks apart), which its small instance keeps
    ({"model_type": "dory"}, "it runs some of them more than once (a looped section)"),
])
def test_a_model_it_cannot_run_is_refused_before_ray_starts(tmp_path, capsys, config, named):
    model_dir = write_config(tmp_path / "hf", config)
    with pytest.raises(ConfigError, match="cannot be trained") as refused:
        model_arch(ModelConfig(path=str(model_dir)))
    assert named in str(refused.value) and "\n" not in str(refused.value), "one paragraph naming it"
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(f"model:\n  path: {model_dir}\n")
    assert not ray.is_initialized()
    assert cli_main(["train", str(run_yaml)]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1
    assert not ray.is_initialized(), "refused before Ray starts"


def test_implementation_native_refuses_what_has_no_hand_written_family(tmp_path):
    model_dir = write_config(tmp_path / "hf", {"model_type": "olmo2"})
    with pytest.raises(ConfigError, match="no hand-written family"):
        model_arch(ModelConfig(path=str(model_dir), implementation="native"))


def test_implementation_transformers_runs_a_hand_written_familys_model(tmp_path):
    arch = model_arch(ModelConfig(preset="tiny-qwen2", implementation="transformers"))
    assert isinstance(arch, TransformersArch) and arch.model_type == "qwen2"
    assert arch.num_layers == 2 and arch.hidden_size == 64


def test_a_transformers_arch_survives_a_checkpoint_and_a_measurement(tmp_path):
    """What a checkpoint's meta.json records reads back as the same model; a measured working set
    (planning/probe.py) does not make it another model, a changed config does."""
    from megatrain_ray.files.checkpoint import CheckpointError, check_compatible
    from megatrain_ray.models.registry import arch_from_dict

    arch = model_arch(ModelConfig(preset="tiny-qwen2", implementation="transformers"))
    meta = {"arch": json.loads(json.dumps(arch.to_dict()))}
    assert arch_from_dict(meta["arch"]) == arch
    older = {"arch": {**meta["arch"], "train_vision": False}}  # written while model.train_vision lived on the arch
    assert arch_from_dict(older["arch"]) == arch
    check_compatible(older, arch, tmp_path)
    other = model_arch(ModelConfig(preset="tiny-qwen2", implementation="transformers", overrides={"num_layers": 1}))
    with pytest.raises(CheckpointError, match="from another model"):
        check_compatible(meta, other, tmp_path)


@pytest.mark.parametrize("config, named", [
    ({"model_type": "shieldgemma2"}, "an image-text model of a type megatrain-ray has not been checked on"),
])
def test_an_image_text_model_it_cannot_run_is_refused_before_ray_starts(tmp_path, capsys, config, named):
    """Image-text models of other types: refused by the command before Ray starts, exit 2, one paragraph."""
    model_dir = write_config(tmp_path / "hf", config)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"model: {{path: {model_dir}, compute_dtype: float32}}\nexecutor: {{device: cpu}}\n")
    assert cli_main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert named in err and "cannot be trained" in err and "\n" not in err.strip()
    assert not ray.is_initialized(), "refused before Ray starts"

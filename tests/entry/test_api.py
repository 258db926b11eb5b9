"""megatrain_ray.train / plan for Python: configs in any form, overrides by section, the CLI's checks;
`import megatrain_ray` stays cheap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatrain_ray.api import to_config
from megatrain_ray.config import ConfigError, DataConfig, MetricsConfig
from megatrain_ray.runtime.trackers import check_trackers


def test_import_is_cheap_and_the_entry_points_load_on_use():
    code = ("import sys, megatrain_ray; heavy = {'torch', 'ray', 'jinja2'} & set(sys.modules); "
            "assert not heavy, heavy; assert callable(megatrain_ray.train) and callable(megatrain_ray.plan)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_overrides_merge_into_sections_and_are_checked(tmp_path):
    base = tmp_path / "c.yaml"
    base.write_text("model: {preset: tiny-llama}\ntrain: {steps: 3, grad_accum: 2}\n")
    config = to_config(base, train={"steps": 7}, sets=["optim.lr=0.5"])
    assert (config.train.steps, config.train.grad_accum, config.optim.lr) == (7, 2, 0.5)
    assert to_config(config, data={"seq_len": 9}).data.seq_len == 9
    assert to_config({"model": {"preset": "tiny-llama"}}).data == DataConfig()
    assert to_config(tmp_path / "c.yaml") == to_config(str(base))
    with pytest.raises(ConfigError, match="unknown config key 'train.stesp'; did you mean 'steps'"):
        to_config(base, train={"stesp": 7})
    with pytest.raises(ConfigError, match="override train= must be a mapping"):
        to_config(base, train=7)
    with pytest.raises(ConfigError, match="config file .*missing.yaml does not exist"):
        to_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("section, message", [
    ({"holdout_fraction": 1.0}, r"eval.holdout_fraction must be within \[0, 1\)"),
    ({"holdout_fraction": 0.1, "source": "val.jsonl"}, "set eval.source or eval.holdout_fraction, not both"),
    ({"every": -1}, "eval.every must be >= 0"),
    ({"batches": 0}, "eval.batches must be >= 1"),
    ({"evrey": 2}, "unknown config key 'eval.evrey'; did you mean 'every'"),
])
def test_bad_eval_settings_are_refused(section, message):
    with pytest.raises(ConfigError, match=message):
        to_config({"model": {"preset": "tiny-llama"}}, eval=section)


def test_a_tracker_without_its_package_is_refused_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.wandb: true needs the wandb package: "
                                          r"pip install 'megatrain-ray\[wandb\]'"):
        check_trackers(MetricsConfig(wandb=True))
    check_trackers(MetricsConfig(wandb=False))


def test_plan_returns_whether_it_fits_and_why_not(tmp_path, capsys):
    """A described cluster (no Ray): the result is true when the run fits and says why when not."""
    import megatrain_ray

    small = tmp_path / "small.yaml"
    small.write_text("gpu_node: {gpu: H100 80GB, gpu_memory_gib: 78, host_memory_gib: 8, network_gbps: 100}\n")
    tiny = Path(__file__).parents[2] / "examples" / "tiny.yaml"
    result = megatrain_ray.plan(tiny, cluster=small, model={"preset": "qwen2.5-7b"})
    assert not result and result.fits is False
    assert result.reason.startswith("does not fit in host memory: the model needs"), result.reason
    assert result.text.endswith(result.reason) and result.text in capsys.readouterr().out
    fitting = megatrain_ray.plan(tiny, cluster=small)
    assert fitting and fitting.reason is None and fitting.text.endswith("fits")

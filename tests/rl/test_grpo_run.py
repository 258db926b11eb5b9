"""`train.objective: grpo` through the run's own path on the session's Ray head (stores, a GPU
worker and the rollout as actors), from a Hugging Face model with a KL to it (the reference
streamed by the worker from its copy in host memory) and two updates per rollout (the old
policy's log-probabilities through the worker's streamed forward): metrics per step, and 4 steps
in one go, its rollout streaming a decoder layer, equal its first 2 + resume + 2 with every layer
resident bit for bit (weights, optimizer state, the prompts' position and the sampler's state). A
wrong reward path stops the command before Ray, exit 2."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.runtime.training import run_training
from helpers.runs import as_stood_at, tensors_of

REWARD = "def low_tokens(prompts, completions, completion_ids, **columns):\n" \
         "    return [sum(t < 32 for t in ids) / len(ids) for ids in completion_ids]\n"


def tiny_model(root: Path) -> Path:
    """A small random Qwen2 in transformers' own files (the run's start and its KL's reference)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return root / "model"


def grpo_raw(root: Path, run: str, optim: dict | None = None) -> dict:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 * i + k for k in range(5)], "id": i}) + "\n"
                               for i in range(6)))
    return {
        "model": {"path": str(root / "model"), "compute_dtype": "float32"},
        "data": {"source": str(prompts), "seq_len": 16},
        "optim": {"lr": 1e-2, "weight_decay": 0.0, **(optim or {})},
        "train": {"objective": "grpo", "steps": 4, "micro_batch_size": 4, "output_dir": str(root / run)},
        "grpo": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6,
                 "rewards": {"grpo_test_rewards:low_tokens": 1.0}, "updates_per_rollout": 2, "kl_coef": 0.05},
        "checkpoint": {"keep": 5, "export_hf": False},
        "executor": {"device": "cpu", "compile": False},
        "runtime": {"worker_threads": 1, "optimizer_threads": 1},
    }


MUON = {"name": "muon", "muon_lr": 0.02}


@pytest.fixture(scope="module")
def runs(local_ray, tmp_path_factory) -> Path:
    # the run "whole" streams one of its two decoder layers at every forward; the resumed "split" does
    # not, and samples with two copies of the rollout, a step's two prompts split between them. Both
    # with optim.name muon (the rollout's streaming and copies do not depend on the optimizer; AdamW's
    # GRPO resume is the `ahead` runs'): one pair of runs for both, not two
    return whole_then_split(tmp_path_factory.mktemp("grpo"), {"rollout_resident_layers": 1}, {"rollout_gpus": 2},
                            MUON)


@pytest.fixture(scope="module")
def ahead(local_ray, tmp_path_factory) -> Path:
    """The same runs with the rollout in its own process, one policy version behind (the resumed
    run's in two processes of their own)."""
    return whole_then_split(tmp_path_factory.mktemp("grpo-ahead"), {"rollout_gpu": "own"},
                            {"rollout_gpu": "own", "rollout_gpus": 2})


def whole_then_split(root: Path, whole_grpo: dict, split_grpo: dict, optim: dict | None = None) -> Path:
    """4 steps in the run "whole" (its output kept in whole.out), and its first 2 + resume + 2 in "split"."""
    (root / "grpo_test_rewards.py").write_text(REWARD)
    tiny_model(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        whole = grpo_raw(root, "whole", optim)
        whole["checkpoint"]["every"] = 2
        whole["grpo"].update(whole_grpo)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            summary = run_training(config_from_dict(whole))
        (root / "whole.out").write_text(out.getvalue())
        (root / "whole.summary.json").write_text(json.dumps(summary))
        as_stood_at(root / "whole", root / "split", 2)  # two runs, not three
        split = grpo_raw(root, "split", optim)
        split["grpo"].update(split_grpo)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            run_training(config_from_dict(split), resume="latest")
        (root / "split.out").write_text(out.getvalue())
    return root


def records(root: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]


def test_each_step_logs_its_rewards_and_rates(runs):
    rows = records(runs, "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0 <= r["reward_mean"] <= 1 and r["completion_length"] == 6 and r["updates"] == 2
        assert r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0 and r["entropy"] > 0
        assert r["kl"] >= 0  # k3 is never negative
    assert rows[0]["kl"] > 0  # the second update of the first step already differs from the reference
    # the second update's ratio moves off 1 after the first (lr 1e-2): the old log-probabilities
    # came back from the workers' forward, and some tokens leave the clip range
    assert any(r["clip_fraction"] > 0 for r in rows)


def test_a_grpo_run_ends_with_its_rewards_first_and_last(runs):
    """Its summary, and the CLI's last line, say how the rewards went (the mean of the first steps
    and of the last: one step of 4 here), not a loss that means nothing for GRPO."""
    from megatrain_ray.cli import rewards_text

    rows, summary = records(runs, "whole"), json.loads((runs / "whole.summary.json").read_text())
    name = "grpo_test_rewards:low_tokens"
    assert summary["rewards"] == {"steps": 1, "reward": [rows[0]["reward_mean"], rows[-1]["reward_mean"]],
                                  name: [rows[0]["rewards"][name], rows[-1]["rewards"][name]]}
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    assert rewards_text(summary["rewards"]) == (f"reward {first:.3f} -> {last:.3f} (at the first step and the last; "
                                                f"{name} {first:.3f} -> {last:.3f})")


def test_four_steps_equal_two_then_resume_two(runs):
    """The run "whole" rolls out with one of its two decoder layers streamed, the resumed "split"
    with both resident and two copies of the rollout: the same completions, so the same weights,
    bit for bit."""
    assert "rollout device: cpu (cpu), bfloat16; 1 of 2 decoder layers resident, 1 streamed" in \
        (runs / "whole.out").read_text()
    assert "(and 1 more copies like it, the prompts split between them)" in (runs / "split.out").read_text()
    assert_resumed_bit_for_bit(runs)


def test_the_config_a_grpo_run_carries_is_the_one_read(runs):
    """Nothing writes the config after it is read: a step's micro-batches, the LR schedule's length
    and the rollout's resident layers are the step plan's, so the config each checkpoint records (the
    session's, which its workers and the rollout got) is the user's."""
    raw = grpo_raw(runs, "whole", MUON)
    raw["checkpoint"]["every"] = 2
    raw["grpo"]["rollout_resident_layers"] = 1
    read = json.loads(json.dumps(config_from_dict(raw).to_dict()))
    for checkpoint in ckpt.list_checkpoints(runs / "whole" / "checkpoints"):
        assert json.loads((checkpoint / ckpt.META).read_text())["config"] == read


def test_a_rollout_one_version_behind_resumes_bit_for_bit(ahead):
    """With the rollout sampling the next step's completions while a step trains, the checkpoint
    keeps those completions and their log-probabilities (the resumed run trains on them: it
    cannot sample them again from weights it no longer has), and the resume is exact."""
    meta = json.loads((ckpt.list_checkpoints(ahead / "split" / "checkpoints")[0] / ckpt.META).read_text())
    pending = meta["data_position"]["pending"]
    assert meta["step"] == 2 and meta["data_position"]["prompts"] == 6  # step 3's prompts taken, sampled
    assert [len(c) for c in pending["completions"]] == [6] * 8 == [len(lp) for lp in pending["logprobs"]]
    assert all(lp < 0 for row in pending["logprobs"] for lp in row)
    assert "(and 1 more copies like it" in (ahead / "split.out").read_text()
    assert_resumed_bit_for_bit(ahead, prompts=10)


def assert_resumed_bit_for_bit(runs: Path, prompts: int = 8) -> None:
    a = ckpt.list_checkpoints(runs / "whole" / "checkpoints")[-1]
    b = ckpt.list_checkpoints(runs / "split" / "checkpoints")[-1]
    assert a.name == b.name == "step-00000004"
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    ma, mb = (json.loads((c / ckpt.META).read_text()) for c in (a, b))
    timeless = [{k: v for k, v in m["data_position"].get("pending", {}).items() if not k.endswith("seconds") and k != "copies"}
                for m in (ma, mb)]
    assert timeless[0] == timeless[1] and ma["data_position"]["prompts"] == mb["data_position"]["prompts"] == prompts
    assert ma["data_position"]["sampler"] == mb["data_position"]["sampler"]
    assert ma["updates_done"] == 8 and ma["schedule_steps"] == 8  # two updates a step: the plan's LR schedule
    assert ma["config"]["optim"]["schedule_steps"] is None and ma["config"]["train"]["grad_accum"] == 1  # as written
    keys = ("loss", "grad_norm", "reward_mean", "entropy")
    assert [[r[k] for k in keys] for r in records(runs, "whole")] == [[r[k] for k in keys] for r in records(runs, "split")]


def test_a_grpo_run_with_muon_resumes_bit_for_bit(runs):
    """GRPO's updates with optim.name muon: its blocks' momentum in the checkpoint, and 4 steps equal 2 +
    resume + 2 bit for bit."""
    assert_resumed_bit_for_bit(runs)
    last = ckpt.list_checkpoints(runs / "whole" / "checkpoints")[-1]
    meta = json.loads((last / ckpt.META).read_text())
    assert meta["config"]["optim"]["name"] == "muon"
    files = ckpt.shard_files_by_layer(last, json.loads((last / ckpt.MANIFEST).read_text()))
    state, _ = ckpt.read_layer_state(files[1], 1)  # a decoder block: one momentum, a second moment for its norms
    assert state["exp_avg"].abs().sum() > 0 and state["exp_avg_sq"].numel() < state["exp_avg"].numel() / 10


def test_a_grpo_step_on_two_workers_beside_its_own_rollout_trains_like_one(ahead):
    """The split of grpo.rollout_gpu=own on a node of several GPUs, on the CPU: two data-parallel
    workers take a step's two micro-batches beside the rollout's own process; its first step (whose
    completions the starting weights sample, as in the one-worker run) has that run's loss, gradient
    norm and rewards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ahead))
        raw = grpo_raw(ahead, "two-workers")
        raw["train"]["steps"] = 1
        raw["grpo"]["rollout_gpu"] = "own"
        raw["runtime"]["num_gpus"] = 2
        run_training(config_from_dict(raw))
    two, one = records(ahead, "two-workers")[0], records(ahead, "whole")[0]
    assert two["num_gpus"] == 2 and one["num_gpus"] == 1
    for key in ("loss", "grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert two["reward_mean"] == one["reward_mean"]


def test_a_wrong_reward_path_stops_before_ray_with_exit_2(tmp_path, capsys):
    """The command's own entry, in this process (a Python started for it would import torch again)."""
    from megatrain_ray import cli

    tiny_model(tmp_path)
    raw = grpo_raw(tmp_path, "bad")
    raw["grpo"]["rewards"] = {"no_such_module_xyz:score": 1.0}
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps(raw))
    code = cli.main(["train", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no_such_module_xyz" in err and "cannot be imported" in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()  # refused before the run's output directory was made


@pytest.mark.parametrize("embedding_step", ["host", "device"])
def test_the_rollout_reads_the_weights_the_workers_compute_with(local_ray, embedding_step):
    """Session.rollout_weights maps each store's bf16 compute copy in place (the driver shares the
    stores' node): after an update it is the new master rounded to bf16, for every layer. Where a
    worker steps the embedding on its device, the embedding is its fp32 master, mapped in place too:
    after the next update the same mapping holds the new master."""
    from megatrain_ray.models.registry import PRESETS
    from megatrain_ray.runtime.session import Session
    from helpers.reference_training import random_micro_batches

    arch = PRESETS["tiny-llama"]
    config = config_from_dict({"model": {"preset": "tiny-llama", "compute_dtype": "bfloat16"},
                               "train": {"grad_accum": 1, "micro_batch_size": 2},
                               "executor": {"device": "cpu", "compile": False, "embedding_step": embedding_step},
                               "runtime": {"worker_threads": 1, "optimizer_threads": 1}})
    session = Session(config, arch)
    batches = random_micro_batches(arch, 2, 1, batch=2, seq=8, seed=0)
    try:
        session.init_weights()
        session.start_executor()
        session.train_step(batches[0])
        live = dict(session.rollout_weights())
        rollout = {i: w.clone() for i, w in live.items()}
        masters = dict(session.iter_layer_weights())
        session.train_step(batches[1])
        embedding = dict(session.iter_layer_weights())[0]
    finally:
        session.close()
    assert sorted(rollout) == list(range(len(masters)))
    stepped_on_device = {0} if embedding_step == "device" else set()
    for i, master in masters.items():
        expected = master if i in stepped_on_device else master.to(torch.bfloat16)
        assert rollout[i].dtype == expected.dtype and torch.equal(rollout[i], expected), i
    assert not torch.equal(embedding, masters[0])  # the second update moved it
    assert torch.equal(live[0], embedding if embedding_step == "device" else embedding.to(torch.bfloat16))


@pytest.mark.gpu
def test_a_grpo_run_rolls_out_on_the_gpu_it_trains_on(local_ray, tmp_path, capsys):
    """On a GPU machine: a rollout actor sees each worker's GPU and samples there in bf16 between
    the steps that train on it (the run plans the step within what the rollout's copy leaves); with
    several GPUs visible the 2 workers' copies take one prompt each."""
    (tmp_path / "grpo_test_rewards.py").write_text(REWARD)
    tiny_model(tmp_path)
    raw = grpo_raw(tmp_path, "gpu")
    raw["model"]["compute_dtype"] = "bfloat16"
    raw["train"]["steps"] = 2
    raw["executor"] = {"device": "cuda"}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))
        run_training(config_from_dict(raw))
    out = capsys.readouterr().out
    assert "rollout device: cuda" in out and "bfloat16" in out.split("rollout device:")[1].splitlines()[0]
    assert "the step is planned within the other" in out
    assert ("(and 1 more copies like it" in out) == (torch.cuda.device_count() >= 2)
    rows = records(tmp_path, "gpu")
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout_tokens_per_s"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_grpo_run_rolls_out_on_a_gpu_of_its_own_one_version_behind(local_ray, tmp_path, capsys):
    """On every visible GPU (2, 3, 4 or more), grpo.rollout_gpu=own: the GPU workers train while the
    rollout's actors, each holding a GPU of its own (two of them, a prompt each, where 3 GPUs or more
    are visible: grpo.rollout_gpus), sample the next step's completions; the checkpoint keeps them.
    The workers are as many of the other GPUs as split a step's 2 micro-batches evenly (1 of 1, 2 of
    2 or more: planning/placement.py, worker_count)."""
    (tmp_path / "grpo_test_rewards.py").write_text(REWARD)
    tiny_model(tmp_path)
    raw = grpo_raw(tmp_path, "gpu-ahead")
    raw["model"]["compute_dtype"] = "bfloat16"
    raw["train"]["steps"] = 3
    raw["grpo"]["rollout_gpu"] = "own"
    copies = 2 if torch.cuda.device_count() >= 3 else 1
    raw["grpo"]["rollout_gpus"] = copies
    raw["executor"] = {"device": "cuda"}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))
        run_training(config_from_dict(raw))
    out = capsys.readouterr().out
    workers = 1 if torch.cuda.device_count() - copies == 1 else 2
    own = "a GPU of its own" if copies == 1 else "2 GPUs of its own, the prompts split"
    assert f"the rollout samples on {own}" in out and f"{workers} GPU worker(s)" in out
    assert ("(and 1 more copies like it" in out) == (copies == 2)
    assert "rollout device: cuda" in out
    rows = records(tmp_path, "gpu-ahead")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout_tokens_per_s"] > 0 for r in rows)
    meta = json.loads((ckpt.list_checkpoints(tmp_path / "gpu-ahead" / "checkpoints")[-1] / ckpt.META).read_text())
    assert len(meta["data_position"]["pending"]["completions"]) == 8

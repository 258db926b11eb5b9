"""Hugging Face import/export against real transformers models (tiny, random, CPU, no downloads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.files.hf import CheckpointMismatch, export_hf, load_hf_weights  # noqa: E402
from megatrain_ray.models.arch import RopeScaling
from megatrain_ray.models.registry import PRESETS, load_hf_arch  # noqa: E402
from megatrain_ray.models.registry import model_layouts  # noqa: E402

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, intermediate_size=128,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024, "rope_theta": 500000.0}
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 12345.0})),
    "llama3-rope": (transformers.LlamaConfig, dict(max_position_embeddings=8192, rope_parameters=LLAMA3_ROPE)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)),
}


def tiny_model(family: str, seed: int = 0):
    config_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**TINY, **extra), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1; make them random so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_()
    return model


def save(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def empty_buffers(arch) -> dict[int, torch.Tensor]:
    return {layout.index: torch.full((layout.numel,), float("nan")) for layout in model_layouts(arch)}


def load_buffers(model_dir: Path, arch=None) -> dict[int, torch.Tensor]:
    arch = arch or load_hf_arch(model_dir)
    buffers = empty_buffers(arch)
    load_hf_weights(model_dir, arch, buffers.__getitem__)
    return buffers


def assert_buffers_equal_state_dict(arch, buffers, state_dict) -> None:
    names = set()
    for layout in model_layouts(arch):
        for local, view in layout.views(buffers[layout.index]).items():
            name = layout.hf_name(local)
            names.add(name)
            assert torch.equal(view, state_dict[name].float()), name
    extra = set(state_dict) - names - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    assert not extra


def logits(model, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        return model(input_ids=ids).logits


def rewrite(file: Path, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------- arch


@pytest.mark.parametrize("family", FAMILIES)
def test_arch_read_from_saved_config(tmp_path, family):
    model = tiny_model(family)
    arch = load_hf_arch(save(model, tmp_path / "m"))
    config = model.config
    assert arch.model_type == config.model_type
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers) == (256, 64, 2)
    assert (arch.num_heads, arch.num_kv_heads, arch.intermediate_size) == (4, 2, 128)
    assert arch.head_dim == (32 if family == "qwen3" else 16)
    assert arch.rope_theta == config.rope_parameters["rope_theta"]
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.tie_word_embeddings == (family == "qwen3")
    assert arch.qkv_bias == (family == "qwen2")
    assert arch.qk_norm == (family == "qwen3")
    if family == "llama3-rope":
        assert arch.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 1024)
    else:
        assert arch.rope_scaling is None


# ---------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("family", FAMILIES)
def test_load_then_export_round_trip(tmp_path, family):
    model = tiny_model(family)
    src = save(model, tmp_path / "src")
    arch = load_hf_arch(src)
    buffers = load_buffers(src, arch)
    assert_buffers_equal_state_dict(arch, buffers, model.state_dict())

    out = export_hf(tmp_path / "out", arch, buffers.items())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_hf_arch(out) == arch
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is type(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert torch.equal(logits(reloaded), logits(model))


def test_sharded_checkpoint_in_and_out(tmp_path):
    model = tiny_model("qwen2")
    src = save(model, tmp_path / "src", max_shard_size="100KB")
    assert len(list(src.glob("model-*-of-*.safetensors"))) > 1 and (src / "model.safetensors.index.json").exists()
    arch = load_hf_arch(src)
    buffers = load_buffers(src, arch)
    assert_buffers_equal_state_dict(arch, buffers, model.state_dict())

    out = export_hf(tmp_path / "out", arch, reversed(list(buffers.items())), max_shard_bytes=100_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == expected_bytes
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded), logits(model))
    assert_buffers_equal_state_dict(arch, load_buffers(out, arch), model.state_dict())


def test_bf16_export(tmp_path):
    model = tiny_model("llama")
    arch = load_hf_arch(save(model, tmp_path / "src"))
    buffers = load_buffers(tmp_path / "src", arch)
    out = export_hf(tmp_path / "out", arch, buffers.items(), dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < (tmp_path / "src" / "model.safetensors").stat().st_size * 0.6
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert reloaded.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(reloaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    # and back into fp32 buffers: bf16 values widen exactly
    rounded = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    assert_buffers_equal_state_dict(arch, load_buffers(out, arch), rounded)


def test_load_only_owned_layers(tmp_path):
    model = tiny_model("llama")
    src = save(model, tmp_path / "src")
    arch = load_hf_arch(src)
    buffers = empty_buffers(arch)
    asked = []

    def layer_buffer(i):
        asked.append(i)
        return buffers[i]

    load_hf_weights(src, arch, layer_buffer, layers=[1, 2])
    assert sorted(set(asked)) == [1, 2]
    assert buffers[0].isnan().all() and buffers[3].isnan().all()
    assert not buffers[1].isnan().any() and not buffers[2].isnan().any()


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path):
    model = tiny_model("qwen3")
    src = save(model, tmp_path / "src")
    file = src / "model.safetensors"
    rewrite(file, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert_buffers_equal_state_dict(load_hf_arch(src), load_buffers(src), model.state_dict())

    rewrite(file, lambda t: t["lm_head.weight"].__setitem__((3, 5), 9.0))
    with pytest.raises(CheckpointMismatch, match=r"lm_head\.weight.*differs"):
        load_buffers(src)


def test_old_checkpoint_rotary_buffers_are_ignored(tmp_path):
    """A checkpoint that still holds the rotary buffers loads, and its weights load as they are."""
    model = tiny_model("llama")
    src = save(model, tmp_path / "src")
    rewrite(src / "model.safetensors",
            lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    assert_buffers_equal_state_dict(load_hf_arch(src), load_buffers(src), model.state_dict())


# ---------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    return save(tiny_model("llama"), tmp_path / "src")


def test_wrong_shape_names_tensor_shapes_and_file(llama_dir):
    file = llama_dir / "model.safetensors"
    rewrite(file, lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(128, 63)))
    with pytest.raises(CheckpointMismatch) as err:
        load_buffers(llama_dir)
    message = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "(128, 64)" in message and "(128, 63)" in message and str(file) in message


def test_missing_tensor_is_named(llama_dir):
    rewrite(llama_dir / "model.safetensors", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointMismatch, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: missing"):
        load_buffers(llama_dir)


def test_extra_tensor_is_named(llama_dir):
    rewrite(llama_dir / "model.safetensors", lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.ones(2)))
    with pytest.raises(CheckpointMismatch, match=r"model\.layers\.0\.mlp\.extra\.weight: unexpected"):
        load_buffers(llama_dir)


def test_tensor_in_two_shards_is_refused(tmp_path):
    src = save(tiny_model("llama"), tmp_path / "src", max_shard_size="100KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    rewrite(src / second, lambda t: t.update(load_file(src / first)))
    with pytest.raises(CheckpointMismatch, match="present twice"):
        load_buffers(src)


def test_truncated_file_is_named(llama_dir):
    file = llama_dir / "model.safetensors"
    os.truncate(file, file.stat().st_size - 1000)
    with pytest.raises(CheckpointMismatch, match=f"cannot read {file}"):
        load_buffers(llama_dir)


def test_corrupt_header_is_named(llama_dir):
    file = llama_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"garbage!!!!!"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatch, match=f"cannot read {file}"):
        load_buffers(llama_dir)


def test_missing_shard_is_named(tmp_path):
    src = save(tiny_model("llama"), tmp_path / "src", max_shard_size="100KB")
    victim = sorted(src.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointMismatch, match=victim.name):
        load_buffers(src)


def test_config_of_another_model_is_refused(llama_dir):
    arch = load_hf_arch(llama_dir).replace(intermediate_size=256)
    with pytest.raises(CheckpointMismatch, match="intermediate_size: expected 256, found 128"):
        load_hf_weights(llama_dir, arch, empty_buffers(arch).__getitem__)


def test_export_refuses_wrong_layers(tmp_path):
    arch = PRESETS["tiny-llama"]
    buffers = {layout.index: torch.randn(layout.numel) for layout in model_layouts(arch)}
    with pytest.raises(ValueError, match=r"layers \[2\] were never given"):
        export_hf(tmp_path / "out", arch, [(i, b) for i, b in buffers.items() if i != 2])
    with pytest.raises(ValueError, match="layer 1 has"):
        export_hf(tmp_path / "out", arch, [(1, torch.randn(5))])
    assert not any(tmp_path.iterdir())  # nothing half written, no staging left behind


# ---------------------------------------------------------------------------------------------- atomic export


def test_crash_mid_export_leaves_previous_export_intact(tmp_path):
    arch = PRESETS["tiny-qwen3"]
    first = {layout.index: torch.randn(layout.numel) for layout in model_layouts(arch)}
    out = export_hf(tmp_path / "out", arch, first.items(), max_shard_bytes=50_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crashing():
        yield 0, torch.zeros_like(first[0])
        yield 1, torch.zeros_like(first[1])
        raise RuntimeError("store died")

    with pytest.raises(RuntimeError, match="store died"):
        export_hf(out, arch, crashing(), max_shard_bytes=50_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    second = {i: b + 1 for i, b in first.items()}
    export_hf(out, arch, second.items())  # replaces the earlier export
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_buffers(out, arch)
    assert all(torch.equal(loaded[i], second[i]) for i in second)


def test_export_refuses_to_replace_unrelated_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    arch = PRESETS["tiny-llama"]
    with pytest.raises(FileExistsError):
        export_hf(tmp_path / "out", arch, [])
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------- memory

PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from megatrain_ray.files.hf import load_hf_weights
    from megatrain_ray.models.registry import load_hf_arch
    from megatrain_ray.models.registry import model_layouts

    def status_kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    model_dir = sys.argv[1]
    arch = load_hf_arch(model_dir)
    buffers = {l.index: torch.zeros(l.numel) for l in model_layouts(arch)}  # zeros touch every page
    try:  # reset the high-water mark so it measures the load alone
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = status_kib("VmRSS")
    load_hf_weights(model_dir, arch, buffers.__getitem__)
    peak = status_kib("VmHWM")
    checksum = sum(float(b.double().sum()) for b in buffers.values())
    print(json.dumps({"growth": (peak - before) * 1024, "checksum": checksum}))
    """
)


def test_load_peak_memory_is_one_tensor(tmp_path):
    """Loading must not hold a state dict: RSS grows by at most the largest tensor plus slack."""
    arch = PRESETS["tiny-llama"].replace(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_layers=8,
                                        num_heads=8, num_kv_heads=4, head_dim=64)
    torch.manual_seed(0)
    buffers = {layout.index: torch.randn(layout.numel) for layout in model_layouts(arch)}
    model_dir = export_hf(tmp_path / "model", arch, buffers.items())
    total = sum(b.numel() * 4 for b in buffers.values())
    largest = arch.vocab_size * arch.hidden_size * 4
    slack = 32 * 1024**2
    assert total > 2 * (largest + slack)  # otherwise the test could not tell one tensor from all of them
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(model_dir)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected_checksum = sum(float(b.double().sum()) for b in buffers.values())
    assert report["checksum"] == pytest.approx(expected_checksum, rel=1e-9)
    assert report["growth"] < largest + slack, f"grew {report['growth'] / 2**20:.1f} MiB, total {total / 2**20:.0f} MiB"


def test_a_bf16_checkpoint_loads_in_pieces_over_threads_as_torch_casts_it(tmp_path, monkeypatch):
    """Transformers' own bf16 shards (several files) read in pieces over threads straight into the
    fp32 buffers (widened by numpy) and into bf16 buffers (byte for byte): exactly what torch's cast
    of each stored tensor gives, whatever the pieces and threads."""
    import megatrain_ray.files.hf as hf

    model = tiny_model("qwen2").to(torch.bfloat16)
    model_dir = save(model, tmp_path / "bf16", max_shard_size="100KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    arch = load_hf_arch(model_dir)
    state = model.state_dict()
    monkeypatch.setattr(hf, "READ_PIECE_BYTES", 4096)  # every tensor of more than 2,048 bf16 elements in pieces
    for threads in (1, 4):
        wide = empty_buffers(arch)
        load_hf_weights(model_dir, arch, wide.__getitem__, threads=threads)
        assert_buffers_equal_state_dict(arch, wide, {k: v.float() for k, v in state.items()})
        narrow = {i: b.to(torch.bfloat16) for i, b in empty_buffers(arch).items()}
        load_hf_weights(model_dir, arch, narrow.__getitem__, threads=threads)
        assert_buffers_equal_state_dict(arch, {i: b.float() for i, b in narrow.items()},
                                        {k: v.float() for k, v in state.items()})

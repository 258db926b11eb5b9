"""Gemma 3 and Phi-3/Phi-4 against transformers' own models: forward, loss, every gradient, packed
rows, and 5 AdamW steps through `megatrain-ray train` (training.run_training on a real Ray).

Tiny random Gemma3ForCausalLM and Phi3ForCausalLM, fp32 on the CPU, saved with save_pretrained and
read back through the project's streamed Hugging Face import. Each config turns on what the
family adds: Gemma 3's sliding window shorter than the rows, its two RoPE bases and the global
one's linear scaling, query_pre_attn_scalar, final logit soft-capping, an untied head; Phi-3's
fused tensors, partial rotary embeddings, LongRoPE (short factors up to 8 positions, long ones
past them), a sliding window. Every config has a pad token inside the vocabulary, and the data
holds it: transformers' embedding gives that row no gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.config import config_from_dict  # noqa: E402
from megatrain_ray.models.registry import (PRESETS, arch_from_dict, arch_from_hf_config, family,  # noqa: E402
                                          load_hf_arch, model_layouts)
from megatrain_ray.models import ops  # noqa: E402
from helpers.files import write_documents  # noqa: E402
from helpers.reference_model import ReferenceModel  # noqa: E402
from megatrain_ray.runtime.training import run_training  # noqa: E402
from helpers.hf_parity import (RTOL, assert_bf16_tracks, assert_gradients_match, grads_by_hf_name, hf_flats,  # noqa: E402
                               bf16_cuda_config, local_steps, on_cuda, rel, run_config, saved,
                               the_runs_batches, tiny_hf_model, token_loss_sum, train_transformers)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, intermediate_size=128, pad_token_id=5)
PAD = TINY["pad_token_id"]
SLIDING, FULL = "sliding_attention", "full_attention"
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]}
# name -> (config class, extra config, attention implementation)
FAMILIES = {
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=16, sliding_window=4, layer_types=[SLIDING, FULL], query_pre_attn_scalar=24,
        rope_theta=1e6, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0}), "sdpa"),
    "gemma3-softcap": (transformers.Gemma3TextConfig, dict(
        head_dim=16, sliding_window=3, layer_types=[FULL, SLIDING], query_pre_attn_scalar=16,
        final_logit_softcapping=2.0, attn_logit_softcapping=50.0, tie_word_embeddings=False), "eager"),
    "phi3": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.75, max_position_embeddings=64, original_max_position_embeddings=8,
        rope_scaling=LONGROPE), "sdpa"),
    "phi3-window": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.5, rope_theta=500.0, sliding_window=5, tie_word_embeddings=True), "eager"),
}
STEPS, GRAD_ACCUM, BATCH, SEQ = 5, 2, 2, 12


def random_rows(seed: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids holding the pad token, and shifted labels with a few ignored positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (rows, seq + 1), generator=gen)
    ids[:, 2] = PAD
    labels = ids[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.15] = -100
    return ids[:, :-1].contiguous(), labels


# ---------------------------------------------------------------------------------------------- a


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    """One document a row, longer than the window and (Phi-3) than original_max_position_embeddings."""
    model = tiny_hf_model(FAMILIES, TINY, name)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    ids, labels = random_rows(1, BATCH, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()

    model.train()
    logits = model(input_ids=ids, use_cache=False).logits
    target = int((labels != -100).sum())
    (token_loss_sum(logits, labels) / target).backward()
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert theirs["model.embed_tokens.weight"][PAD].abs().sum() == 0 or arch.tie_word_embeddings

    ref = ReferenceModel(arch, hf_flats(model_dir, arch))
    ours = ref(ids, positions)
    assert rel(ours.detach(), logits.detach()) < RTOL
    loss = ref.loss_sum({"input_ids": ids, "labels": labels, "position_ids": positions}) / target
    assert float(loss.detach()) == pytest.approx(float(token_loss_sum(logits.detach(), labels)) / target, rel=RTOL)
    loss.backward()
    assert_gradients_match(grads_by_hf_name(ref), theirs)


def packed_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Two rows of 14 positions, two documents each (6 + 8, 8 + 6): position ids restart at 0.
    Documents of at most 8 positions keep Phi-3's LongRoPE on its short factors in every call."""
    ids, labels = random_rows(seed, 2, 14)
    lengths = [[6, 8], [8, 6]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    for r, row in enumerate(lengths):
        labels[r, row[0] - 1] = -100  # no target across the document boundary
    return ids, labels, positions, lengths


def per_document_loss_sum(model, ids, labels, lengths) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers on each document on its own: the summed token loss and each row's logits."""
    total, rows = 0.0, []
    for r, row in enumerate(lengths):
        pieces, start = [], 0
        for n in row:
            logits = model(input_ids=ids[r : r + 1, start : start + n], use_cache=False).logits
            total = total + token_loss_sum(logits, labels[r : r + 1, start : start + n])
            pieces.append(logits[0])
            start += n
        rows.append(torch.cat(pieces))
    return total, rows


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_rows_match_transformers_on_each_document(tmp_path, name):
    """Block-diagonal causal mask (AND the window): our packed rows equal transformers run on each
    document separately, and so does transformers' own handling of packed position_ids, which the
    training test below compares with."""
    model = tiny_hf_model(FAMILIES, TINY, name, seed=3)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    ids, labels, positions, lengths = packed_rows(seed=4)
    target = int((labels != -100).sum())

    model.train()
    separate, rows = per_document_loss_sum(model, ids, labels, lengths)
    (separate / target).backward()
    theirs = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert rel(packed, torch.stack(rows).detach()) < RTOL

    ref = ReferenceModel(arch, hf_flats(model_dir, arch))
    ours = ref(ids, positions)
    assert rel(ours.detach(), torch.stack(rows).detach()) < RTOL
    loss = ref.loss_sum({"input_ids": ids, "labels": labels, "position_ids": positions}) / target
    assert float(loss.detach()) == pytest.approx(float(separate.detach()) / target, rel=RTOL)
    loss.backward()
    assert_gradients_match(grads_by_hf_name(ref), theirs)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"])
def test_a_context_told_whether_rows_pack_documents_equals_one_that_asks(preset):
    """The executor tells each context from the batch's host copy (numpy, as Ray hands it over)
    whether a row packs documents, so that no context waits on the GPU to find out."""
    arch = PRESETS[preset]
    _, _, packed_positions, _ = packed_rows(seed=4)
    plain = torch.arange(packed_positions.shape[1]).expand_as(packed_positions).contiguous()
    fam = family(arch)
    for positions, packs in ((packed_positions, True), (plain, False)):
        assert ops.packs_documents(positions.numpy()) is packs and ops.packs_documents(positions) is packs
        told, asked = fam.context(arch, positions, torch.float32, packs), fam.context(arch, positions, torch.float32)
        for layer in range(1, arch.num_layers + 1):
            a, b = fam.layer_context(arch, told, layer), fam.layer_context(arch, asked, layer)
            assert torch.equal(a.cos, b.cos) and (a.mask is None) == (b.mask is None)
            assert a.mask is not None or not packs, "packed rows attend within their documents"
            if a.mask is not None:
                assert torch.equal(a.mask, b.mask)


def test_longrope_switches_factors_past_the_original_length(tmp_path):
    """The short factors up to original_max_position_embeddings positions, the long ones past it,
    as transformers: positions 0..7 and 0..8 give different tables (and the test configs use both)."""
    arch = load_hf_arch(saved(tiny_hf_model(FAMILIES, TINY, "phi3"), tmp_path / "hf"))
    fam = family(arch)
    short = fam.context(arch, torch.arange(8)[None], torch.float32).cos
    long = fam.context(arch, torch.arange(9)[None], torch.float32).cos
    assert not torch.allclose(short[0, 1:8], long[0, 1:8])


# ---------------------------------------------------------------------------------------------- b


def train_config(model_dir: Path, data: Path, out: Path, pack: bool):
    return config_from_dict(run_config(model_dir, data, out, pack=pack, seq=SEQ, steps=STEPS, grad_accum=GRAD_ACCUM,
                                       batch=BATCH))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_train_export_equals_transformers_adamw(local_ray, tmp_path, name, pack):
    model = tiny_hf_model(FAMILIES, TINY, name)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    docs = write_documents(tmp_path / "docs.jsonl", TINY["vocab_size"], seed=5, pad=PAD)
    config = train_config(model_dir, docs, tmp_path / "run", pack)
    data = the_runs_batches(config, arch.vocab_size)
    restarts = sum(int((mb["position_ids"][:, 1:] == 0).sum()) for step in data for mb in step)
    assert (restarts > 0) == pack, "packed rows hold several documents; unpacked ones one each"
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    summary = run_training(config)
    ref_losses = train_transformers(model, config, data)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > config.optim.grad_clip for r in records), "clipping must be active"
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=RTOL)
    export = Path(summary["checkpoint"]) / "hf"
    assert load_hf_arch(export) == arch, "the exported config.json reads back as the same model"
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ours, theirs = exported.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert rel(ours[key], expected) < RTOL, key
        assert not torch.equal(ours[key], initial[key]), f"{key} did not train"
    ids = data[0][0]["input_ids"]
    with torch.no_grad():  # the exported config.json runs the same model (RoPE, window, caps)
        assert rel(exported(input_ids=ids).logits, model(input_ids=ids, use_cache=False).logits) < RTOL


# ---------------------------------------------------------------------------------------------- c


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-phi3"])
def test_blocks_trace_into_one_graph(preset):
    """The executor torch.compiles the family's block: dynamo must trace it whole (fullgraph) for
    every layer kind, packed rows or not, and the compiled forward and backward equal the eager ones
    (the aot_eager backend: dynamo and AOT autograd, no C++ compiler needed)."""
    arch = PRESETS[preset]
    fam = family(arch)
    layout = model_layouts(arch)[1]
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(layout.numel, generator=gen) * 0.2
    compiled = torch.compile(fam.block, dynamic=False, fullgraph=True, backend="aot_eager")
    one_doc = torch.arange(12).expand(2, 12)
    two_docs = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    for positions in (one_doc, two_docs):
        ctx = fam.context(arch, positions, torch.float32)
        for layer in range(1, arch.num_layers + 1):
            layer_ctx = fam.layer_context(arch, ctx, layer)
            results = []
            for block in (fam.block, compiled):
                w = {k: v.clone().requires_grad_() for k, v in layout.views(flat).items()}
                x = torch.randn(2, 12, arch.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
                y = block(arch, w, x, layer_ctx)
                grads = torch.autograd.grad(y.square().sum(), [x, *w.values()])
                results.append((y.detach(), grads))
            (y0, g0), (y1, g1) = results
            assert rel(y1, y0) < RTOL
            assert all(rel(a, b) < RTOL for a, b in zip(g1, g0, strict=True))


# ---------------------------------------------------------------------------------------------- d

# The Hub's config.json of the shapes the presets name, as published (Gemma 3: the text_config of
# google/gemma-3-4b-it and -27b-it, which leaves the rest to Gemma3TextConfig's defaults).
HUB_CONFIGS = {
    "gemma-3-4b": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                   "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                   "sliding_window": 1024},
    "gemma-3-27b": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "phi-4-mini": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "bos_token_id": 199999,
                   "eos_token_id": 199999, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
                   "max_position_embeddings": 131072, "num_attention_heads": 24, "num_hidden_layers": 32,
                   "num_key_value_heads": 8, "original_max_position_embeddings": 4096, "pad_token_id": 199999,
                   "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-05,
                   "rope_scaling": {"long_factor": list(PRESETS["phi-4-mini"].rope_long_factor),
                                    "short_factor": [1.0] * 48, "type": "longrope"},
                   "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
                   "vocab_size": 200064},
    "phi-4": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 5120,
              "intermediate_size": 17920, "max_position_embeddings": 16384, "num_attention_heads": 40,
              "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
              "pad_token_id": 100257, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
              "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 100352},
}


@pytest.mark.parametrize("preset", HUB_CONFIGS)
def test_presets_are_the_hub_configs_as_read_by_us_and_by_transformers(preset):
    hub = HUB_CONFIGS[preset]
    assert arch_from_hf_config(hub) == PRESETS[preset]
    config_class = transformers.Gemma3TextConfig if hub["model_type"] == "gemma3_text" else transformers.Phi3Config
    as_transformers_saves_it = config_class(**hub).to_dict()  # transformers 5's own format
    assert arch_from_hf_config(as_transformers_saves_it) == PRESETS[preset]


def test_multimodal_gemma3_is_refused_with_what_to_do(tmp_path):
    from megatrain_ray.config import ConfigError, ModelConfig
    from megatrain_ray.models.registry import model_arch

    def arch_of(config: dict, implementation: str = "auto"):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return model_arch(ModelConfig(path=str(tmp_path), implementation=implementation))

    # the hand-written family (auto runs it through transformers' modules: tests/models/test_image_text.py)
    with pytest.raises(ConfigError, match="multimodal Gemma 3.*Gemma3ForCausalLM"):
        arch_of({"model_type": "gemma3", "text_config": HUB_CONFIGS["gemma-3-4b"]}, "native")
    with pytest.raises(ConfigError, match="'roberta' cannot be trained: its decoder holds no list of layers"):
        arch_of({"model_type": "roberta"})  # no hand-written family, and its layers are in an encoder


@pytest.mark.parametrize("preset", ["gemma-3-4b", "tiny-phi3"])
def test_arch_survives_a_checkpoint_and_a_layer_override(preset):
    arch = PRESETS[preset]
    again = arch_from_dict(json.loads(json.dumps(arch.to_dict())))
    assert again == arch and hash(again) == hash(arch)
    fewer = arch.replace(num_layers=8)
    assert fewer.num_layers == 8
    if preset == "gemma-3-4b":  # the 5:1 pattern continues over the layers an override leaves
        assert fewer.layer_types == ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 2


def test_flops_count_only_the_window_and_working_sets_grow_by_what_the_family_adds():
    """Attention FLOPs: a sliding layer counts the keys its queries see (here against a sum over
    every position of a row), a global one seq/2 as the Llama count; working sets: the Llama fit
    plus the family's own tensors, and an explicit mask only where a window is shorter than the row."""
    llama = PRESETS["qwen2.5-3b"]
    llama_fam = family(llama)
    gemma, phi_mini = PRESETS["gemma-3-4b"], PRESETS["phi-4-mini"]
    seq, window = 4096, gemma.sliding_window
    per_key = 12 * gemma.num_heads * gemma.head_dim
    seen = sum(min(t + 1, window) for t in range(seq)) / seq
    sliding, full = gemma.layer_types.count("sliding_attention"), gemma.layer_types.count("full_attention")
    assert (sliding, full) == (29, 5)
    assert family(gemma).attention_flops_per_token(gemma, seq) == pytest.approx(
        per_key * (sliding * seen + full * seq / 2), rel=1e-3)
    as_llama = llama.replace(num_layers=phi_mini.num_layers, num_heads=phi_mini.num_heads, head_dim=phi_mini.head_dim)
    assert family(phi_mini).attention_flops_per_token(phi_mini, seq) == llama_fam.attention_flops_per_token(as_llama, seq)

    assert family(phi_mini).working_set_bytes(phi_mini, seq, seq, 2) == llama_fam.working_set_bytes(phi_mini, seq, seq, 2)
    phi3_mini = phi_mini.replace(sliding_window=2047)  # Phi-3-mini's window
    assert family(phi3_mini).working_set_bytes(phi3_mini, seq, seq, 2) - llama_fam.working_set_bytes(phi_mini, seq, seq, 2) \
        >= seq * seq * 3
    no_window = gemma.replace(sliding_window=None)
    assert llama_fam.working_set_bytes(gemma, seq, seq, 2) < family(gemma).working_set_bytes(no_window, seq, seq, 2) \
        < family(gemma).working_set_bytes(gemma, seq, seq, 2) - seq * seq * 3


# ---------------------------------------------------------------------------------------------- e


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_bf16_on_the_gpu_tracks_transformers_autocast(tmp_path, name):
    """bf16 on CUDA with the executor's torch.compile of the block (inductor), packed rows: the
    losses track transformers under autocast, and go down."""
    steps = 6
    model = tiny_hf_model(FAMILIES, TINY, name)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    docs = write_documents(tmp_path / "docs.jsonl", TINY["vocab_size"], seed=6, count=400, pad=PAD, distinct=4)
    config = bf16_cuda_config(model_dir, steps, GRAD_ACCUM,
                              data={"source": str(docs), "format": "tokens", "seq_len": 128, "pack": True})
    data = the_runs_batches(config, arch.vocab_size)
    ours = [r.loss for r in local_steps(config, arch, model_dir, data)]
    theirs = train_transformers(model.to("cuda"), config, on_cuda(data), autocast_dtype=torch.bfloat16)
    assert_bf16_tracks(name, ours, theirs)

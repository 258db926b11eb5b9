"""What runs compiled on the GPU (streaming/compiled.py) against the eager templates, on the CPU: the two
compilations of a decoder block give the same gradients, the kept graph's saved tensors within its
activation budget, smaller than the default's (which they would equal if the second compilation
reused the first's graphs); the head's chunk loss gives the same loss and gradients."""

import dataclasses

import pytest
import torch

from megatrain_ray.streaming.compiled import compile_block, compile_head_loss, compile_kept_block
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX
from megatrain_ray.models.registry import family, model_layouts, resolve_arch

ARCH = ModelArch("llama", 512, 128, 512, 2, 4, 2, 32)


def run(block, w, x, ctx, dy):
    """Output, gradients and the bytes autograd saved for the backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(ARCH, w, x, ctx)
    return y.detach(), torch.autograd.grad(y, [x, *w.values()], dy), sum(saved)


def test_kept_compilation_saves_less_and_differentiates_as_eager():
    fam = family(ARCH)
    layout = model_layouts(ARCH)[1]
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(layout.numel, generator=g) * 0.05
    w = {name: view.detach().clone().requires_grad_() for name, view in layout.views(flat).items()}
    x = torch.randn(2, 64, ARCH.hidden_size, generator=g, requires_grad=True)
    ctx = fam.layer_context(ARCH, fam.context(ARCH, torch.arange(64).expand(2, 64), torch.float32), 1)
    dy = torch.randn(2, 64, ARCH.hidden_size, generator=g)

    y_eager, grads_eager, _ = run(fam.block, w, x, ctx, dy)
    _, _, default_bytes = run(compile_block(fam.block), w, x, ctx, dy)
    y_kept, grads_kept, kept_bytes = run(compile_kept_block(fam.block, fam.kept_activation_budget), w, x, ctx, dy)

    assert kept_bytes < default_bytes
    torch.testing.assert_close(y_kept, y_eager, rtol=1e-5, atol=1e-5)
    for kept, eager in zip(grads_kept, grads_eager, strict=True):
        torch.testing.assert_close(kept, eager, rtol=1e-4, atol=1e-5)


HEADS = {
    "llama": ARCH,
    "gemma3, soft-capped, tied": dataclasses.replace(resolve_arch("tiny-gemma3"), final_logit_softcapping=30.0),
    "gpt_oss": resolve_arch("tiny-gpt-oss"),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_compiled_head_loss_matches_eager_with_ignored_targets(name):
    arch = HEADS[name]
    fam = family(arch)
    layouts = model_layouts(arch)
    g = torch.Generator().manual_seed(1)

    def leaves(layout):
        flat = torch.randn(layout.numel, generator=g) * 0.05
        return {n: view.detach().clone().requires_grad_() for n, view in layout.views(flat).items()}

    head = leaves(layouts[-1])
    embed = leaves(layouts[0]) if arch.tie_word_embeddings else None
    weights = [*head.values(), *(embed or {}).values()]
    x = torch.randn(96, arch.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, arch.vocab_size, (96,), generator=g)
    labels[::7] = IGNORE_INDEX

    def loss_and_grads(head_loss):
        loss = head_loss(arch, head, embed, x, labels, 96, 1.0)
        return loss.detach(), torch.autograd.grad(loss, [x, *weights])

    eager_loss, eager_grads = loss_and_grads(fam.head_loss)
    compiled_loss, compiled_grads = loss_and_grads(compile_head_loss(fam.head_loss))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)


def test_a_template_that_fails_to_compile_runs_eagerly_and_the_others_stay_compiled(capsys):
    """streaming/compiled.py's per-template fallback, with a stand-in for torch.compile that fails on
    one template: that template's calls run the eager block from then on, said once."""
    from megatrain_ray.streaming.compiled import EagerWhereItFails

    calls = []

    def compiled(arch, w, x, ctx):
        calls.append(("compiled", ctx))
        if ctx == 1:
            raise RuntimeError("inductor cannot lower this\nsecond line")
        return x + 1

    def eager(arch, w, x, ctx):
        calls.append(("eager", ctx))
        return x + 1

    block = EagerWhereItFails(compiled, eager, lambda arch, ctx: ctx)
    x = torch.zeros(2)
    for ctx in (0, 1, 0, 1, 1):
        assert torch.equal(block(ARCH, {}, x, ctx), x + 1)
    assert calls == [("compiled", 0), ("compiled", 1), ("eager", 1), ("compiled", 0), ("eager", 1), ("eager", 1)]
    out = capsys.readouterr().out
    assert out.count("torch.compile failed on layer template 1") == 1 and "inductor cannot lower this" in out

"""Which decoder-only model types of the installed transformers train through transformers' own
modules, and why the others are refused: the table in megatrain_ray/models/README.md.

For every model type of AutoModelForCausalLM: its config class's default values with only the
sizes shrunk (hidden size, layers, heads, vocabulary, intermediate and expert sizes:
modules.small_config), refused with the one-paragraph reason `megatrain-ray train` gives, or a
tiny random model saved as a Hugging Face directory, 3 fp32 AdamW steps of the streaming trainer
(the same stores, executor and export as `megatrain-ray train`, in one process) against
transformers' model trained by torch.optim.AdamW on the same micro-batches, its export compared
tensor by tensor. Each type runs in a process of its own, with a time limit.

    python examples/model_table.py                 # every type: the README's table
    python examples/model_table.py llama gpt_neox  # some types, printed only
    python examples/model_table.py --sizes other   # every type in other proportions, printed only
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "megatrain_ray" / "models" / "README.md"
BEGIN, END = "<!-- model table: begin -->", "<!-- model table: end -->"
STEPS, RTOL = 3, 1e-4
SIZES = {"small": "SMALL", "other": "OTHER_PROPORTIONS"}  # names in megatrain_ray.models.transformers.modules
OPTIM = {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 0.5, "weight_decay": 0.1, "min_lr_ratio": 0.1, "eps": 1e-6}


def one_type(model_type: str, sizes: str = "small") -> dict:
    """{"result": "trains" | "refused" | "differs" | "failed", "why": ...} for one model type, its
    sizes cut to modules.SMALL's (`sizes` "small") or to OTHER_PROPORTIONS' ("other")."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain_ray.config import ConfigError, ModelConfig
    from megatrain_ray.models.transformers import modules as hm
    from megatrain_ray.models.transformers.check import worst_relative_difference
    from megatrain_ray.models.registry import model_arch

    config = {k: v for k, v in AutoConfig.for_model(model_type).to_dict().items()
              if k not in ("transformers_version", "architectures")}
    if hm.is_image_text(config):  # its small instance needs images: tests/models/test_image_text.py
        return image_text_row(config)
    with tempfile.TemporaryDirectory() as tmp:
        full_dir = Path(tmp) / "full"
        full_dir.mkdir()
        (full_dir / "config.json").write_text(json.dumps(config))
        try:  # what `megatrain-ray train` checks first, on the full-size config
            model_arch(ModelConfig(path=str(full_dir), implementation="transformers"))
        except ConfigError as e:
            return {"result": "refused", "why": str(e)}
        torch.manual_seed(0)
        small = hm.small_config(config, hm.decoder_parts(hm.build_empty(config)).kinds,
                                 getattr(hm, SIZES[sizes]))
        model = hm.build_small(small)
        model_dir = Path(tmp) / "hf"
        model.save_pretrained(model_dir)
        try:
            export = streamed_steps(model_dir, Path(tmp))
        except Exception as e:
            return {"result": "failed", "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        transformers_steps(model, model_dir)
        ours = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
        worst = worst_relative_difference(ours, model.state_dict())
    if worst[0] > RTOL:
        return {"result": "differs", "why": f"after {STEPS} steps {worst[1]} differs by {worst[0]:.1e} (relative)"}
    return {"result": "trains", "why": f"{STEPS} steps equal to transformers + AdamW (worst {worst[0]:.0e})"}


def image_text_row(config: dict) -> dict:
    """An image-text model among the causal LM's types: refused as `train` refuses it, or trained
    with images by the tests (models/image_text.py, COVERED)."""
    from megatrain_ray.models.transformers.check import refusal

    why = refusal(config)
    if why:
        return {"result": "refused", "why": why}
    return {"result": "image-text", "why": "trains with images as an image-text model: tests/models/test_image_text.py, "
                                           "3 steps against transformers + AdamW"}


def run_config(model_dir: Path):
    from megatrain_ray.config import config_from_dict

    return config_from_dict({
        "model": {"path": str(model_dir), "compute_dtype": "float32", "implementation": "transformers"},
        "optim": OPTIM,
        "train": {"steps": STEPS, "grad_accum": 1, "micro_batch_size": 2, "seed": 0},
        "executor": {"device": "cpu", "loss_chunk_tokens": 7, "compile": False},
    })


def micro_batches(vocab: int) -> list[list[dict]]:
    import torch

    gen = torch.Generator().manual_seed(2)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (2, 13), generator=gen)
        steps.append([{"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                       "position_ids": torch.arange(12).expand(2, 12).contiguous()}])
    return steps


def streamed_steps(model_dir: Path, tmp: Path) -> Path:
    import torch

    from megatrain_ray.files import shard
    from megatrain_ray.files.hf import export_hf
    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.runtime.local import LocalTrainer

    config = run_config(model_dir)
    arch = model_arch(config.model)
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        for i, step in enumerate(micro_batches(arch.vocab_size)):
            torch.manual_seed(100 + i)  # dropout: the same draws as transformers' step (one micro-batch, same order)
            trainer.train_step(step)
        return export_hf(tmp / "export", arch, enumerate(trainer.layer_weights()))
    finally:
        trainer.close()


def transformers_steps(model, model_dir: Path) -> None:
    """The same steps on transformers' model: torch.optim.AdamW, decay on matrices but biases (as
    the stores decay: models/layout.py, ParamSlot.decays; Zamba's dt_proj_bias is 2-D), the schedule."""
    import torch
    import torch.nn.functional as F

    from megatrain_ray.host.adamw import lr_factor

    o = run_config(model_dir).optim
    named = list(model.named_parameters())
    decays = {name for name, p in named if p.dim() >= 2 and not name.endswith("bias")}
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decays], "weight_decay": o.weight_decay},
                             {"params": [p for n, p in named if n not in decays], "weight_decay": 0.0}],
                            lr=o.lr, betas=o.betas, eps=o.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, o.warmup_steps, STEPS, o.min_lr_ratio))
    model.train()
    for i, (mb,) in enumerate(micro_batches(model.config.get_text_config().vocab_size)):
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], o.grad_clip)
        opt.step()
        sched.step()


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def in_subprocess(model_type: str, timeout_s: float, sizes: str = "small") -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import model_table; " \
           f"print('RESULT ' + json.dumps(model_table.one_type({model_type!r}, {sizes!r})))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"result": "failed", "why": f"did not finish within {timeout_s:.0f} s on this machine"}
    found = [line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        return json.loads(found[-1])
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"result": "failed", "why": last}


def table(results: dict[str, dict]) -> str:
    trains = sorted(t for t, r in results.items() if r["result"] == "trains")
    lines = [f"{len(trains)} of {len(results)} decoder-only model types of transformers "
             f"(AutoModelForCausalLM) train, from their config classes' default values with small sizes "
             f"(`python examples/model_table.py`):", "", "| model_type | result | why |", "|---|---|---|"]
    for model_type, r in sorted(results.items()):
        why = re.sub(r"^model_type '[^']*' cannot be trained( through transformers' modules)?: ", "", r["why"])
        lines.append(f"| `{model_type}` | {r['result']} | {why.replace('|', '/')} |")
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = README.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in readme:
        readme = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, readme, flags=re.S)
    else:
        readme = readme.rstrip("\n") + "\n\n## Which model types train through transformers' modules\n\n" + block + "\n"
    README.write_text(readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: all, and the README's table is rewritten)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    parser.add_argument("--results", type=Path, help="a JSON file of results: read, extended, written")
    parser.add_argument("--sizes", choices=("small", "other"), default="small",
                        help="the small sizes (modules.SMALL, the README's table), or the same keys in other "
                             "proportions (modules.OTHER_PROPORTIONS: printed only)")
    args = parser.parse_args()
    types = args.types or causal_lm_types()
    results = json.loads(args.results.read_text()) if args.results and args.results.exists() else {}
    for model_type in types:
        if model_type in results:
            continue
        start = time.perf_counter()
        results[model_type] = in_subprocess(model_type, args.timeout, args.sizes)
        print(f"{model_type}: {results[model_type]['result']} ({time.perf_counter() - start:.0f} s) "
              f"{results[model_type]['why'][:200]}", flush=True)
        if args.results:
            args.results.write_text(json.dumps(results, indent=1, sort_keys=True))
    if not args.types and args.sizes == "small":
        write_readme(table({t: results[t] for t in types}))
        print(f"{README}: {sum(r['result'] == 'trains' for r in results.values())} of {len(types)} train")


if __name__ == "__main__":
    main()

"""`megatrain-ray bench`'s options. Apart from bench/run.py, which imports torch, so that the CLI builds
the bench command's parser, and answers `bench --help`, without it."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-1.5b", help="preset name or a Hugging Face config.json / model dir")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder blocks")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="load the first weights from this Hugging Face directory (model.path: config.json and "
                        "safetensors) instead of drawing them; its config.json gives the model")
    p.add_argument("--implementation", default="auto", choices=["auto", "native", "transformers"],
                   help="model.implementation: a hand-written family (native), transformers' own modules "
                        "(transformers), or the hand-written one where it exists (auto)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096],
                   help="one or more: several run one after another on the same host state (a sweep)")
    p.add_argument("--micro-batch", type=int, nargs="+", default=[1], help="one, or one per --seq-len")
    p.add_argument("--grad-accum", type=int, nargs="+", default=[4], help="one, or one per --seq-len")
    p.add_argument("--keep-graphs", type=keep_graphs_arg, nargs="+", default=[None], metavar="N|auto",
                   help="blocks that keep their forward graphs (executor.keep_graphs; auto: as many as fit); one, "
                        "or one per --seq-len")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (0: the first step, compilation included, is timed)")
    p.add_argument("--num-slots", type=int, default=None,
                   help="weight slots per layer size (executor.num_slots; default: the plan's, 3 unless memory is "
                        "short)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--loss-chunk-tokens", type=int, default=None,
                   help="tokens per chunk of the LM-head loss (default: 8192, or the plan's with --gpu-memory-gib)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                   help="the GPU memory the run may use (executor.gpu_memory_gib): the plan fits the step under it and "
                        "the workers' allocator is held to it, so a large GPU stands for a small one")
    p.add_argument("--offload-activations", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--embedding-step", default="auto", choices=["auto", "device", "host"],
                   help="where the embedding's AdamW step runs (executor.embedding_step)")
    p.add_argument("--num-gpus", type=int, default=None,
                   help="GPU workers, data parallel over each step's micro-batches (default: every GPU of the node); "
                        "--grad-accum is the whole step's, a multiple of it")
    p.add_argument("--store-memory-gib", type=float, default=None,
                   help="host memory a store may take on its node (runtime.store_memory_gib), instead of what the "
                        "node reads free at start: for a machine whose memory grows as it is used")
    p.add_argument("--disk-dir", default=None,
                   help="a directory on a local SSD for the disk tier (runtime.disk_dir): the optimizer state of the "
                        "layers the stores' memory cannot hold lives there")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="one GPU's bf16 matmul peak, the MFU denominator (default: the GPU's rates: the rates "
                        "table's, e.g. 799 on the H100, else probed on it)")
    p.add_argument("--baseline", nargs="*", default=None, metavar="NAME",
                   help="also run baselines (plain fsdp2_offload deepspeed_offload; none named = all)")
    p.add_argument("--baseline-splits", default="same", metavar="same|best|MBxGA,...",
                   help="the micro-batch splits each baseline runs the step's tokens in: same as ours, best (every "
                        "power-of-two split, the fastest kept), or a list such as 1x16,4x4")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--profile", default=None, help="write a torch.profiler trace of one step to this directory")
    p.add_argument("--parts", action="store_true",
                   help="instead of training: time one decoder layer's fwd+bwd on the device (eager and compiled) "
                        "and the host AdamW on one layer (one pass and torch's three, per thread count), "
                        "the two ceilings the step is built from; a mixture-of-experts layer also beside a "
                        "dense layer with as many active parameters")
    p.add_argument("--parts-layers", type=int, nargs="+", default=None, metavar="INDEX",
                   help="with --parts: the decoder layers to time, by layout index (default: the first block, or "
                        "a mixture of experts' first sparse one); families whose layers differ (Gemma 3: "
                        "sliding-window and global) time one of each")
    p.add_argument("--ram-nodes", type=int, default=0, metavar="N",
                   help="start a head and N RAM-node raylets on this machine and put every layer on them "
                        "(runtime.store_on_gpu_node false): the TCP transport without a network")
    p.add_argument("--remote-window", type=int, default=0,
                   help="pinned slots per layer size for layers on other nodes (runtime.remote_window; 0: the plan's)")
    p.add_argument("--transport-streams", type=int, default=8,
                   help="TCP connections per store and direction (runtime.transport_streams)")
    p.add_argument("--transport-piece-mib", type=float, default=64.0,
                   help="pieces the step's first layer travels and is updated in on a RAM node "
                        "(runtime.transport_piece_mib; 0: whole)")
    p.add_argument("--optimizer-threads", type=int, nargs="+", default=None,
                   help="host optimizer threads per store (runtime.optimizer_threads; default: cores less one and one per GPU worker); "
                        "with --parts, the thread counts to time (default: 4 8 12, cores less two, cores)")
    p.add_argument("--no-compile", action="store_true", help="run the decoder blocks eagerly (executor.compile: false)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="optim.name: muon steps the decoder blocks' matrices by Muon (its Newton-Schulz on the GPU)")
    p.add_argument("--optim-modes", nargs="+", default=None, metavar="MASTER/MOMENTS", type=optim_mode,
                   help="optimizer state modes, optim.master/optim.moments (fp32/fp32: 14 bytes a parameter, "
                        "fp32/bf16: 10, fp32/int8: 8, bf16/int8: 6): the run's (the first; default fp32/fp32), or "
                        "with --parts every one to time (default: those four)")


def keep_graphs_arg(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of blocks >= 0 or auto, got {text!r}")
    return int(text)


def optim_mode(text: str) -> str:
    """MASTER/MOMENTS, as optim.master and optim.moments take them."""
    master, _, moments = text.partition("/")
    if master not in ("fp32", "bf16") or moments not in ("fp32", "bf16", "int8"):
        raise argparse.ArgumentTypeError(f"{text!r}: give MASTER/MOMENTS, MASTER fp32 or bf16, MOMENTS fp32, bf16 or int8")
    return text

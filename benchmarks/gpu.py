"""MAGRPO on a GPU: ``python -m benchmarks.gpu [--steps 8]`` (a prepared script; CI never runs it).

Two agents, each a random-weight Qwen2 model with the body of Qwen2-0.5B (24 layers, hidden 896,
MLP 4864, 14 heads, 2 KV heads) and the tiny models' 505-token vocabulary, in bfloat16. Reports
generated tokens per second and the fraction of the card's memory bandwidth (decoding reads every
weight once per token step) and of its bf16 matmul throughput (2 FLOPs per parameter per generated
token, 6 per trained token) that the run reaches. ``--peak-tb-s``/``--peak-tflops`` default to an
H200 (4.8 TB/s, 989 dense bf16 TFLOP/s). The trainer takes the default device (the first GPU);
``--allow-cpu --layers 2`` checks the script on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (to check the script)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8, help="training prompts (one MAGRPO step each)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--peak-tb-s", type=float, default=4.8)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("benchmarks.gpu: no CUDA device here; run it on a GPU machine (or pass --allow-cpu --layers 2 "
              "to check the script).", file=sys.stderr)
        return 2

    from benchmarks.measure import Meter
    from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
    from comlrl_core.tiny_models import TOKENIZERS, TinyModelSpec, build_model, build_tokenizer
    from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    spec = TinyModelSpec("qwen2-0.5b-body", "qwen2", "shared", 896, args.layers, 14, 2, 4864)
    tokenizer = build_tokenizer(TOKENIZERS["shared"])
    model = build_model(spec, tokenizer).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    directory = Path(tempfile.mkdtemp(prefix="comlrl-gpu-bench-")) / spec.name
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model

    trainer = MAGRPOTrainer(
        agent_model=str(directory), num_agents=2, reward_func=length_ratio_reward,
        train_dataset=length_ratio_dataset(args.steps), model_config={"dtype": "bfloat16"},
        args=MAGRPOConfig(num_train_epochs=1, num_generations=args.num_generations,
                          max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=None,
                          agent_learning_rate=1e-6, rollout_buffer_size=1, eval_interval=0, verbose=False),
    )
    meter = Meter()
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    trainer.train()
    synchronize()
    seconds = time.perf_counter() - start

    decode_steps = meter.generated_tokens / args.num_generations  # one forward per token step per batch
    bytes_read = decode_steps * params * 2  # bf16 weights, read once per decode step
    flops = 2 * params * meter.generated_tokens + 6 * params * meter.generated_tokens
    figures = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "parameters_per_agent": params, "steps": args.steps, "seconds": round(seconds, 2),
        "generated_tokens": meter.generated_tokens,
        "generate_tok_s": round(meter.generated_tokens / meter.generate_seconds, 1),
        "step_tok_s": round(meter.generated_tokens / seconds, 1),
        "generate_share": round(meter.generate_seconds / seconds, 3),
        "decode_bandwidth_fraction": round(bytes_read / meter.generate_seconds / (args.peak_tb_s * 1e12), 4),
        "bf16_throughput_fraction": round(flops / seconds / (args.peak_tflops * 1e12), 4),
    }
    if cuda:
        figures["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

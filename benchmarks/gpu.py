"""MAGRPO on a GPU: ``python -m benchmarks.gpu [--steps 8]`` (a prepared script; CI never runs it).

Two agents, each a random-weight Qwen2 model with the body of Qwen2-0.5B (24 layers, hidden 896,
MLP 4864, 14 heads, 2 KV heads) and the tiny models' 505-token vocabulary, in bfloat16. Reports
generated tokens per second and the fraction of the card's memory bandwidth (decoding reads every
weight once per token step) and of its bf16 matmul throughput (2 FLOPs per parameter per generated
token, 6 per trained token) that the run reaches. ``--peak-tb-s``/``--peak-tflops`` default to an
H200 (4.8 TB/s, 989 dense bf16 TFLOP/s). The trainer takes the default device (the first GPU);
``--allow-cpu --layers 2`` checks the script on a machine without one.

It then times one agent's update pass (forward and backward) over K completions of one prompt, the
prompt run once vs within the full rows, for several prompt lengths: the figures that set
``batching.PAYS_FROM`` for this device type (where running the prompt once starts to pay).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def sharing_crossover(model, k: int, width: int, prompt_lengths: list[int], synchronize) -> list[dict]:
    """Shared-prompt ÷ full-rows time of ``token_logprobs`` plus backward, per prompt length."""
    import torch

    from comlrl_core import batching, rollout

    device_type = next(model.parameters()).device.type
    thresholds = dict(batching.PAYS_FROM)
    figures = []
    for length in prompt_lengths:
        prompt = torch.randint(5, 400, (length,))
        rows = [(prompt, torch.randint(5, 400, (width,)), torch.ones(width, dtype=torch.bool)) for _ in range(k)]
        seconds = {}
        for name, pays_from in (("full", float("inf")), ("shared", 0)):
            batching.PAYS_FROM[device_type] = pays_from  # force one path
            runs = []
            for _ in range(4):
                model.zero_grad()
                synchronize()
                start = time.perf_counter()
                rollout.token_logprobs(model, rows).sum().backward()
                synchronize()
                runs.append(time.perf_counter() - start)
            seconds[name] = sorted(runs[1:])[1]  # median of 3 after a warm-up
        figures.append({"prompt_tokens": length, "saved_tokens": (k - 1) * (length - 1),
                        "full_s": round(seconds["full"], 4),
                        "shared_over_full": round(seconds["shared"] / seconds["full"], 3)})
    batching.PAYS_FROM.clear()
    batching.PAYS_FROM.update(thresholds)
    return figures


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
    from comlrl_core import rollout
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
    meter = Meter(rollout, "generate_ids")  # the sampler's entry point (generate only as its fallback)
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
    crossover = sharing_crossover(trainer.agents[0], args.num_generations, args.max_new_tokens, [16, 64, 256],
                                  synchronize)
    print(json.dumps({"prompt_run_once_vs_full_rows": crossover}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MAGRPO on a GPU: ``python -m benchmarks.gpu [--steps 8]`` (a prepared script; CI never runs it).

Two agents, each a random-weight Qwen2 model with the body of Qwen2-0.5B (24 layers, hidden 896,
MLP 4864, 14 heads, 2 KV heads) and the tiny models' 505-token vocabulary, in bfloat16. Reports
generated tokens per second and the fraction of the card's memory bandwidth (decoding reads every
weight once per token step) and of its bf16 matmul throughput (2 FLOPs per parameter per generated
token, 6 per trained token) that the run reaches. ``--peak-tb-s``/``--peak-tflops`` default to an
H200 (4.8 TB/s, 989 dense bf16 TFLOP/s). The trainer takes the default device (the first GPU);
``--allow-cpu --layers 2 --prompt-lengths 4 16`` checks the script on a machine without one
(short prompts: bfloat16 on a CPU without native support is slow); ``BENCH_PROFILE=1`` adds where
the training time goes.

It then times the sampler (decode steps replayed as a CUDA graph, and launched op by op) against
Hugging Face ``generate`` (what the reference library calls) on one prompt, and one decode step
launched op by op vs replayed as a graph vs the time its weights take to read at peak bandwidth.
Last, one agent's update pass (forward and backward) over K completions of one prompt, run as a
token tree (the prompt once, ``comlrl_core.token_tree``) vs the model's own forward on the full rows,
for 4- to 1024-token prompts, with the full rows' bf16 TFLOP/s.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path


def _median_seconds(run, synchronize, repeats: int) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls after one warm-up, the device synchronised."""
    run()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sampler_costs(model, k: int, new_tokens: int, peak_tb_s: float, synchronize) -> dict:
    """Generated tokens/s on one 32-token prompt of our sampler (decode steps replayed as a CUDA
    graph, and launched op by op) and of ``generate``; one decode step's milliseconds launched op by
    op, in its fixed-shape form, replayed as a graph and at peak bandwidth; and how far the graph's
    logits are from the op-by-op step's."""
    import torch

    from comlrl_core import decoding, rollout

    device = next(model.parameters()).device
    prompt = torch.randint(5, 400, (1, 32), device=device)
    generation = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 1.0, "max_new_tokens": new_tokens}
    pad = model.generation_config.pad_token_id
    figures = {"lean_sampler_used": decoding.lean_sample(model, [prompt], 1, {**generation, "max_new_tokens": 1},
                                                         pad) is not None}
    ours = lambda: rollout.generate_ids(model, [prompt], k, generation, pad)[0]  # noqa: E731
    graph_from = decoding.GRAPH_FROM_TOKENS
    for name, draw, graphs_from in (
            ("ours", ours, graph_from), ("ours_op_by_op", ours, float("inf")),
            ("generate", lambda: model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                                num_return_sequences=k, pad_token_id=pad, **generation), graph_from)):
        decoding.GRAPH_FROM_TOKENS = graphs_from
        with torch.inference_mode():
            tokens = int((draw()[:, prompt.shape[1]:] != pad).sum())
            figures[f"{name}_tok_s"] = round(tokens / _median_seconds(draw, synchronize, 3), 1)
    if device.type == "cuda":  # the same seed through both step forms: how often the draws agree
        draws = []
        for graphs_from in (graph_from, float("inf")):
            decoding.GRAPH_FROM_TOKENS = graphs_from
            torch.manual_seed(0)
            draws.append(ours())
        width = min(d.shape[1] for d in draws)  # a row's EOS may end one draw sooner
        figures["graph_draws_equal_op_by_op"] = round(float((draws[0][:, :width] == draws[1][:, :width])
                                                            .float().mean()), 4)
    decoding.GRAPH_FROM_TOKENS = graph_from
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    figures["decode_step_ms_at_peak_bandwidth"] = round(weight_bytes / (peak_tb_s * 1e12) * 1e3, 4)
    with torch.inference_mode():
        decoder = decoding._Decoder(model, k, prompt.shape[1] + 2, device)
        decoder.logits(prompt, 0)
        token = torch.randint(5, 400, (k, 1), device=device)
        position = torch.tensor([prompt.shape[1]], device=device)
        eager = decoder.logits(token, prompt.shape[1])
        figures["decode_step_ms_op_by_op"] = round(
            _median_seconds(lambda: decoder.logits(token, prompt.shape[1]), synchronize, 21) * 1e3, 3)
        figures["decode_step_ms_fixed_shape_op_by_op"] = round(
            _median_seconds(lambda: decoder.step(token, position), synchronize, 21) * 1e3, 3)
        if device.type == "cuda":
            synchronize()
            start = time.perf_counter()
            graphed = decoding._GraphedStep(decoder, position.expand(k))
            synchronize()
            figures["graph_capture_ms"] = round((time.perf_counter() - start) * 1e3, 2)
            replay = lambda: graphed(token[:, 0], position)  # noqa: E731
            figures["decode_step_ms_cuda_graph"] = round(_median_seconds(replay, synchronize, 21) * 1e3, 3)
            logits = replay()
            figures["graph_equals_fixed_shape_step"] = bool(torch.equal(logits, decoder.step(token, position)))
            figures["graph_vs_op_by_op_max_abs_diff"] = round(float((logits - eager).abs().max()), 5)
            figures["op_by_op_logit_std"] = round(float(eager.std()), 5)
    return figures


def tree_vs_full_rows(model, k: int, width: int, prompt_lengths: list[int], synchronize) -> list[dict]:
    """Token-tree ÷ full-rows time of ``token_logprobs`` plus backward, per prompt length (the full
    rows: the model's own forward, which a forward hook forces since the tree would bypass it)."""
    import torch

    from comlrl_core import rollout

    params = sum(p.numel() for p in model.parameters())
    figures = []
    for length in prompt_lengths:
        prompt = torch.randint(5, 400, (length,))
        rows = [(prompt, torch.randint(5, 400, (width,)), torch.ones(width, dtype=torch.bool)) for _ in range(k)]
        run = lambda: (model.zero_grad(), rollout.token_logprobs(model, rows).sum().backward())  # noqa: E731
        tree = _median_seconds(run, synchronize, 3)
        handle = model.register_forward_pre_hook(lambda *_: None)
        full = _median_seconds(run, synchronize, 3)
        handle.remove()
        figures.append({"prompt_tokens": length, "saved_tokens": (k - 1) * length, "full_s": round(full, 4),
                        "full_tflops": round(6 * params * k * (length + width) / full / 1e12, 2),
                        "tree_over_full": round(tree / full, 3)})
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
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[4, 16, 64, 256, 1024],
                        help="prompt lengths of the token tree vs full rows comparison (a CPU without native "
                             "bfloat16 takes minutes per length from 256 on)")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("benchmarks.gpu: no CUDA device here; run it on a GPU machine (or pass --allow-cpu --layers 2 "
              "--prompt-lengths 4 16 to check the script).", file=sys.stderr)
        return 2

    from benchmarks.measure import Meter
    from benchmarks.ours_case import breakdown
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
    profile = cProfile.Profile() if os.environ.get("BENCH_PROFILE") == "1" else None
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
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
    if profile is not None:
        profile.disable()
        figures["profile"] = breakdown(profile, seconds)
        # The GPU runs behind Python: its time shows where Python waits for it (.item(), .cpu(), any()).
        top = sorted(pstats.Stats(profile).stats.items(), key=lambda entry: -entry[1][2])[:12]
        figures["top_own_seconds"] = {f"{Path(f).name}:{name}": round(tt, 3) for (f, _, name), (_, _, tt, _, _) in top}
    print(json.dumps(figures))
    print(json.dumps({"sampler": sampler_costs(trainer.agents[0], args.num_generations, args.max_new_tokens,
                                               args.peak_tb_s, synchronize)}))
    versus = tree_vs_full_rows(trainer.agents[0], args.num_generations, args.max_new_tokens, args.prompt_lengths,
                               synchronize)
    print(json.dumps({"token_tree_vs_full_rows": versus}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

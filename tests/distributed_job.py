"""A small training job the distributed tests run in one process or under ``accelerate launch``.

``python distributed_job.py JOB.json`` builds the trainer the job names, trains (optionally resuming),
and writes into ``job["out"]``: ``rank-R.json`` per rank (its weight digest and which checkpoints and
exports it published) and, from rank 0, ``final.safetensors`` (every trained module) and ``history.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from comlrl_core import distributed
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers import base, checkpointing
from comlrl_core.trainers.actor_critic import IACConfig, IACTrainer
from comlrl_core.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

COMMON = dict(num_agents=2, max_new_tokens=6, num_generations=2, agent_learning_rate=1e-2, temperature=1.0,
              top_p=1.0, top_k=None, eval_interval=0, verbose=False)


def build(job: dict):
    """The job's trainer on two qwen2-tiny agents: MAGRPO, MARLHF (MAGRPO backend), or IAC with separate
    llama-tiny critics."""
    models, data = job["models"], length_ratio_dataset(job.get("items", 4))
    if job["algorithm"] == "magrpo":
        return MAGRPOTrainer(agent_model=models["qwen2-tiny"], reward_func=length_ratio_reward, train_dataset=data,
                             wandb_config=job.get("wandb"), args=MAGRPOConfig(**COMMON, **job["config"]))
    if job["algorithm"] == "marlhf":
        config = MARLHFConfig(**COMMON, reward_model_device=None, preference_num_candidates=4,
                              preference_pairs_per_sample=4, reward_train_batch_size=4, reward_learning_rate=1e-3,
                              **job["config"])
        return MARLHFTrainer(agent_model=models["qwen2-tiny"], reward_func=length_ratio_reward, train_dataset=data,
                             args=config)
    return IACTrainer(agent_model=models["qwen2-tiny"], critic_model=models["llama-tiny"],
                      reward_func=length_ratio_reward, train_dataset=data, wandb_config=job.get("wandb"),
                      args=IACConfig(**COMMON, use_separate_critic=True, critic_learning_rate=1e-3, **job["config"]))


def modules(trainer) -> dict[str, torch.Tensor]:
    roles = {"agents": trainer.agents, "critics": getattr(trainer, "critics", []),
             "reward_model": [trainer.reward_model] if getattr(trainer, "reward_model", None) else []}
    return {f"{role}.{i}.{name}": t.detach().cpu().clone()
            for role, ms in roles.items() for i, m in enumerate(ms) for name, t in m.state_dict().items()}


def run(job: dict) -> None:
    writes = []
    publish, export = checkpointing.publish_dir, base.export_models
    checkpointing.publish_dir = lambda path, write: (writes.append(f"checkpoint {Path(path).name}"), publish(path, write))
    base.export_models = lambda out, *a: (writes.append("export"), export(out, *a))
    trainer = build(job)
    trainer.train(resume_from_checkpoint=job.get("resume"), checkpoint_dir=job.get("checkpoint_dir"),
                  checkpoint_steps=job.get("checkpoint_steps"))
    if job.get("export"):
        trainer.save_model(job["export"])
    weights = modules(trainer)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in weights.values())).hexdigest()
    rank = distributed.context().rank
    out = Path(job["out"])
    (out / f"rank-{rank}.json").write_text(json.dumps({"digest": digest, "writes": writes,
                                                       "world_size": distributed.context().world_size}))
    if rank == 0:
        save_file(weights, out / "final.safetensors")
        (out / "history.json").write_text(json.dumps(trainer.history))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(json.loads(Path(sys.argv[1]).read_text()))

"""MAGRPO: each agent samples K completions per prompt; joint rewards give group-relative advantages.

Per training item a rollout tree is built (one node per turn and joint sample), returns flow
bottom-up with ``discount``, and each (node, agent) pair becomes a sample in that agent's buffer.
A full buffer is trained on: loss = -mean_k A_k * log pi(completion_k), the log-prob summed over
the completion's tokens up to and including its first EOS (never padding).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch

from ...entities import frozen_copy, load_agents, place_entities
from ...export import ExportEntry
from ...rollout import reference_kl, sample_agents, token_logprobs
from ..base import TrainerBase
from ..data import next_prompts
from ..optim import adamw
from .config import MAGRPOConfig


@dataclass
class NodeSample:
    """One agent's K completions at one tree node, with their (KL-shaped) returns."""

    agent: int
    turn: int
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    returns: list[float]

    def to_state(self) -> dict:
        return {"agent": self.agent, "turn": self.turn, "prompt_ids": self.prompt_ids,
                "completion_ids": self.completion_ids, "mask": self.mask, "returns": list(self.returns)}


def group_advantages(returns: list[float], mode: str, normalize: bool) -> torch.Tensor:
    """Baseline-subtracted returns; normalisation divides by the group's std but does not re-centre,
    so ``raw``/``max``/``rloo`` stay distinct from ``mean`` (in the reference they collapse into one)."""
    r = torch.tensor(returns, dtype=torch.float64)
    k = r.numel()
    if mode == "mean":
        adv = r - r.mean()
    elif mode == "max":
        adv = r - r.max()
    elif mode == "rloo":
        adv = (k * r - r.sum()) / (k - 1)
    else:
        adv = r
    if normalize:
        std = r.std(unbiased=False)
        if std > 1e-6:
            adv = adv / std
    return adv.float()


class MAGRPOTrainer(TrainerBase):
    """Multi-agent GRPO; the constructor follows the seed (see ``comlrl_core.entities`` for the rules)."""

    algorithm_name = "MAGRPO"
    config_class = MAGRPOConfig
    _buffer_keys = ("buffers",)

    def __init__(self, agent_model=None, agents=None, num_agents=None, tokenizer=None, model_config=None,
                 train_dataset=None, eval_dataset=None, reward_func=None, reward_processor=None, formatters=None,
                 external_transition=None, wandb_config=None, eval_logger=None, eval_aggregator=None, args=None):
        plan = self._setup(args=args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                           tokenizer=tokenizer, model_config=model_config, train_dataset=train_dataset,
                           eval_dataset=eval_dataset, reward_func=reward_func, reward_processor=reward_processor,
                           formatters=formatters, external_transition=external_transition,
                           wandb_config=wandb_config, eval_logger=eval_logger, eval_aggregator=eval_aggregator)
        self.placement = place_entities(plan, self.args, default=self.device, data_parallel=self.dist.active)
        self.agents = load_agents(plan, self.placement.agents)
        for agent in self.agents:
            agent.train()
        self.reference_models = []
        if self.args.reference_kl_enabled:
            self.reference_models = [frozen_copy(a, d) for a, d in zip(self.agents, self.placement.references)]
        self.optimizers = [adamw(a.parameters(), lr=self.args.agent_learning_rate) for a in self.agents]
        self.buffers: list[list[NodeSample]] = [[] for _ in self.agents]

    # ---- rollout --------------------------------------------------------------------------------
    def _joint_indices(self) -> list[tuple[int, ...]]:
        k, n = self.args.num_generations, self.num_agents
        if self.args.joint_mode == "cross":
            return list(itertools.product(range(k), repeat=n))
        return [(j,) * n for j in range(k)]

    def _node(self, item, prompts, turn, history, generation, draws, samples, stats) -> list[float]:
        """Expand one node; returns the discounted return of each of its joint samples."""
        args = self.args
        k = args.num_generations
        completions = sample_agents(self.agents, self.tokenizers, prompts, k, generation, draws)
        stats["tokens"] += sum(int(c.mask.sum()) for c in completions)
        stats["sampling_seconds"] += sum(c.seconds for c in completions)
        joint = self._joint_indices()
        texts = [[completions[i].texts[j[i]] for j in joint] for i in range(self.num_agents)]
        rewards = self.reward(texts, prompts=list(prompts), batch_items=[item])
        self.progress.env_step += len(joint)
        stats["rewards"].setdefault(turn, []).extend(rewards)
        returns = list(rewards)
        stop = args.early_termination_threshold is not None and sum(rewards) / len(rewards) > args.early_termination_threshold
        if turn + 1 < args.num_turns and not stop:
            for x, j in enumerate(joint):
                chosen = [completions[i].texts[j[i]] for i in range(self.num_agents)]
                prompt_hist = [h + [p] for h, p in zip(history[0], prompts)]
                response_hist = [h + [c] for h, c in zip(history[1], chosen)]
                nxt = next_prompts(self.external_transition, item, chosen, prompt_hist, response_hist,
                                   self.formatters, args.external_prompt_passthrough)
                child = self._node(item, nxt, turn + 1, (prompt_hist, response_hist), generation, draws, samples,
                                   stats)
                returns[x] += args.discount * sum(child) / len(child)
        stats["returns"].setdefault(turn, []).extend(returns)
        for i, comp in enumerate(completions):
            per_completion = [
                sum(r for r, j in zip(returns, joint) if j[i] == c) / sum(1 for j in joint if j[i] == c)
                for c in range(k)
            ]
            if self.reference_models:
                kls = reference_kl(self.agents[i], self.reference_models[i], comp)
                stats["kl"].extend(kls)
                per_completion = [r - args.reference_kl_coef * kl for r, kl in zip(per_completion, kls)]
            samples.append(NodeSample(i, turn, comp.prompt_ids, comp.completion_ids, comp.mask, per_completion))
        return returns

    # ---- update ---------------------------------------------------------------------------------
    def _update(self, agent_index: int) -> list[float]:
        """Train one agent on its buffer: per turn, shuffled mini-batches of ``train_batch_size`` samples,
        each one right-padded forward over every completion of its samples.

        A sample's loss is the mean over its K completions and a mini-batch's the sum over its samples,
        averaged over every rank's samples: in a data-parallel job the global mini-batch is every
        rank's j-th one.
        """
        args = self.args
        agent = self.agents[agent_index]
        buffer, self.buffers[agent_index] = self.buffers[agent_index], []
        losses = []
        for batch in self._minibatches(buffer):
            loss, total = None, 0.0
            if batch:
                rows = [(s.prompt_ids, c, m) for s in batch for c, m in zip(s.completion_ids, s.mask)]
                logp = token_logprobs(agent, rows).sum(dim=1)
                weights = torch.cat([group_advantages(s.returns, args.advantage_mode, args.advantage_normalization)
                                     / len(s.returns) for s in batch])
                loss = -(weights.to(logp.device) * logp).sum()
                total = loss.item()
            count, total = self.dist.sum([len(batch), total])
            self._step(self.optimizers[agent_index], agent, loss, count, f"agent {agent_index}")
            losses.append(total / count)
        return losses

    def _items_until_update(self) -> int:
        """Each item adds at least one sample to every agent's buffer, on every rank with an item."""
        buffered = max(self.dist.sum([len(b) for b in self.buffers]))
        full, world = self.args.rollout_buffer_size * self.dist.world_size, self.dist.world_size
        return max(1, -(-(full - buffered) // world))

    def _train_item(self, item: dict | None, generation: dict, draws=None) -> dict:
        metrics = {}
        if item is not None:
            stats = {"rewards": {}, "returns": {}, "kl": [], "tokens": 0, "sampling_seconds": 0.0}
            samples: list[NodeSample] = []
            prompts = [f(item) for f in self.formatters]
            empty = [[] for _ in range(self.num_agents)]
            self._node(item, prompts, 0, (empty, copy.deepcopy(empty)), generation, draws, samples, stats)
            for s in samples:
                self.buffers[s.agent].append(s)
            for turn, values in stats["rewards"].items():
                metrics[f"turn_{turn + 1}/reward_mean"] = sum(values) / len(values)
            for turn, values in stats["returns"].items():
                metrics[f"turn_{turn + 1}/expected_return"] = sum(values) / len(values)
            if stats["kl"]:
                metrics["reference_kl_mean"] = sum(stats["kl"]) / len(stats["kl"])
            if stats["sampling_seconds"] > 0:  # the sampling calls' own time, a sampled-ahead share included
                metrics["generated_tokens_per_second"] = stats["tokens"] / stats["sampling_seconds"]
        full = self.args.rollout_buffer_size * self.dist.world_size  # buffers fill on every rank
        losses = {i: self._update(i) for i, n in enumerate(self.dist.sum([len(b) for b in self.buffers])) if n >= full}
        metrics.update({f"agent_{i}/loss": sum(v) / len(v) for i, v in losses.items() if v})
        return metrics

    def _end_epoch(self) -> dict:
        losses = {i: self._update(i) for i, n in enumerate(self.dist.sum([len(b) for b in self.buffers])) if n}
        return {f"agent_{i}/loss": sum(v) / len(v) for i, v in losses.items() if v}

    # ---- state and export -----------------------------------------------------------------------
    def _roles(self) -> dict:
        return {"agents": self.agents}

    def _optimizer_groups(self) -> dict:
        return {"agents": self.optimizers}

    def _runtime_state(self) -> dict:
        return {"buffers": [[s.to_state() for s in buffer] for buffer in self.buffers],
                "last_log_step": self._last_log_step}

    def _load_runtime_state(self, state: dict) -> None:
        self.buffers = [[NodeSample(**s) for s in buffer] for buffer in state["buffers"]]
        self._last_log_step = state["last_log_step"]

    def _export_entries(self) -> list[ExportEntry]:
        return [ExportEntry(f"agent_{i}", agent, self.tokenizers[i]) for i, agent in enumerate(self.agents)]

    def _export_info(self) -> dict:
        return {"sources": self.sources, "layout": {"agents": [f"agent_{i}" for i in range(self.num_agents)]}}

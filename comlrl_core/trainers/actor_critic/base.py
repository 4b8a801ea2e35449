"""Actor-critic training shared by IAC and MAAC: rollout with value estimates, TD targets, updates.

Per training item each agent samples ``num_generations`` completions per turn; the critic's value
of each state (``critic_type="v"``: the prompt) or state-action (``"q"``: prompt + completion) is
read without autograd; targets are one-step TD (``r + discount * V(next)``, ``r`` at the last turn)
and advantages ``target - V``. A full buffer is trained on: the actor on ``-logp * A`` (normalised
per turn), the critic on ``(target - V)^2`` (optionally clipped around the rollout value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...entities import frozen_copy, load_agents, load_critics, place_entities
from ...models import CausalLMWithValueHead
from ...models.backbone import last_token_scores
from ...rollout import completion_logprobs, reference_kl, rows_forward, sample_agents, token_logprobs
from ..base import TrainerBase
from ..data import next_prompts
from ..optim import adamw


@dataclass
class ActorSample:
    """One completion of one agent with its advantage; ``value_index`` locates the shared-head value."""

    agent: int
    turn: int
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor  # [T]
    mask: torch.Tensor  # [T]
    advantage: float
    old_value: float
    target: float


@dataclass
class CriticSample:
    """What a separate critic reads (``ids``) and the target for its value at the last position."""

    critic: int
    turn: int
    ids: torch.Tensor
    old_value: float
    target: float


def _state(sample) -> dict:
    return dict(vars(sample))


def _value_loss(values: torch.Tensor, old: torch.Tensor, target: torch.Tensor, clip: float | None) -> torch.Tensor:
    """The squared TD error summed over the samples (the update averages it over every rank's)."""
    loss = (target - values) ** 2
    if clip is not None:
        clipped = old + torch.clamp(values - old, -clip, clip)
        loss = torch.maximum(loss, (target - clipped) ** 2)
    return loss.sum()


def last_values(critic: CausalLMWithValueHead, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The critic's value at the last token of each sequence [B]: one batch, with identical sequences
    (a V-critic sees one prompt for all its completions) and common prefixes run once."""
    return last_token_scores(critic.model, critic.value_head, sequences)


class ActorCriticTrainerBase(TrainerBase):
    """The IAC/MAAC constructor and loop; subclasses give the critic layout (``_entity_options``), the
    critic head's size (``_critic_head``) and what the critics read (``_critic_inputs``)."""

    _buffer_keys = ("actor_buffers", "critic_buffers")

    def __init__(self, agent_model=None, critic_model=None, tokenizer=None, reward_func=None, reward_processor=None,
                 formatters=None, args=None, train_dataset=None, eval_dataset=None, model_config=None,
                 wandb_config=None, metrics_callback=None, external_transition=None, agents=None, critics=None,
                 num_agents=None):
        plan = self._setup(args=args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                           tokenizer=tokenizer, model_config=model_config, train_dataset=train_dataset,
                           eval_dataset=eval_dataset, reward_func=reward_func, reward_processor=reward_processor,
                           formatters=formatters, external_transition=external_transition, wandb_config=wandb_config,
                           critic_model=critic_model, critics=critics,
                           extra_callbacks={"metrics_callback": metrics_callback})
        self.metrics_callback = metrics_callback
        self._build(plan)

    def _critic_head(self, plan) -> tuple[int | None, str]:
        """The separate critics' value-head width and the setting that names it (for error messages)."""
        raise NotImplementedError

    def _build(self, plan) -> None:
        """Load actors and critics (value heads seeded from ``args.seed``) and build the optimizers."""
        args = self.args
        shared_head = plan.critic_layout == "shared"
        hidden_dim, field = self._critic_head(plan)
        placement = self.placement = place_entities(plan, args, default=self.device, data_parallel=self.dist.active)
        # Value heads are initialised from the seed, so two trainers built alike start identical.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            self.agents = load_agents(plan, placement.agents, value_head=shared_head,
                                      value_head_hidden_dim=getattr(args, "value_head_hidden_dim", None),
                                      field="IACConfig.value_head_hidden_dim")
            self.critics = load_critics(plan, placement.critics,
                                        value_head_hidden_dim=hidden_dim, field=field)
        self.shared_head = shared_head
        for module in [*self.agents, *self.critics]:
            module.train()
        self.reference_models = []
        if args.reference_kl_enabled:
            self.reference_models = [frozen_copy(self._policy(i), placement.references[i])
                                     for i in range(self.num_agents)]
        self.agent_optimizers = [adamw(a.parameters(), lr=args.agent_learning_rate) for a in self.agents]
        self.critic_optimizers = [adamw(c.parameters(), lr=args.critic_lr) for c in self.critics]
        self.actor_buffers: list[list[ActorSample]] = [[] for _ in self.agents]
        self.critic_buffers: list[list[CriticSample]] = [[] for _ in self.critics]

    def _policy(self, i: int):
        """The causal LM that generates for agent i (the backbone under a shared value head)."""
        agent = self.agents[i]
        return agent.model if isinstance(agent, CausalLMWithValueHead) else agent

    # ---- what the critics read -------------------------------------------------------------------
    def _critic_inputs(self, prompts: list[str], completions: list) -> list[list[tuple[int, torch.Tensor]]]:
        """Per agent, per generation: ``(critic index, ids)`` whose last-token value is V or Q."""
        raise NotImplementedError

    def _rollout_values(self, prompts, completions) -> tuple[list[list[float]], list[list[tuple[int, torch.Tensor]]]]:
        """Old values [agent][k] from the critics (or shared heads), read without autograd."""
        k = self.args.num_generations
        if self.shared_head:
            inputs = []
            for i, comp in enumerate(completions):
                rows = []
                for j in range(k):
                    ids = comp.prompt_ids
                    if self.args.critic_type == "q":
                        ids = torch.cat([ids, comp.completion_ids[j][comp.mask[j]]])
                    rows.append((i, ids))
                inputs.append(rows)
            models = self.agents
        else:
            inputs = self._critic_inputs(prompts, completions)
            models = self.critics
        per_model: dict[int, list[torch.Tensor]] = {}
        for rows in inputs:
            for c, ids in rows:
                per_model.setdefault(c, []).append(ids)
        with torch.inference_mode():  # one batch per model
            read = {c: iter(last_values(models[c], sequences).tolist()) for c, sequences in per_model.items()}
        return [[next(read[c]) for c, _ in rows] for rows in inputs], inputs

    # ---- rollout --------------------------------------------------------------------------------
    def _items_until_update(self) -> int:
        """Each item adds at least K samples to every actor's buffer, on every rank with an item (the
        critics' updates leave the policies as they are, but a shared value head's is the actor's)."""
        buffered = max(self.dist.sum([len(b) for b in self.actor_buffers]))
        full, world = self.args.rollout_buffer_size * self.dist.world_size, self.dist.world_size
        return max(1, -(-(full - buffered) // (self.args.num_generations * world)))

    def _train_item(self, item: dict | None, generation: dict, draws=None) -> dict:
        if item is None:  # a rank left without an item still joins the updates
            return self._update_full_buffers()
        args = self.args
        n, k = self.num_agents, args.num_generations
        prompts = [f(item) for f in self.formatters]
        history = ([[] for _ in range(n)], [[] for _ in range(n)])
        turns, tokens, kls, sampling_seconds = [], 0, [], 0.0
        for turn in range(args.num_turns):
            completions = sample_agents([self._policy(i) for i in range(n)], self.tokenizers, prompts, k, generation,
                                        draws)
            tokens += sum(int(c.mask.sum()) for c in completions)
            sampling_seconds += sum(c.seconds for c in completions)
            values, critic_inputs = self._rollout_values(prompts, completions)
            rewards = self.reward([c.texts for c in completions], prompts=list(prompts), batch_items=[item])
            self.progress.env_step += k
            shaped = [list(rewards) for _ in range(n)]
            if self.reference_models:
                for i, comp in enumerate(completions):
                    kl = reference_kl(self._policy(i), self.reference_models[i], comp)
                    kls.extend(kl)
                    shaped[i] = [r - args.reference_kl_coef * d for r, d in zip(rewards, kl)]
            turns.append({"prompts": list(prompts), "completions": completions, "values": values,
                          "critic_inputs": critic_inputs,
                          "rewards": rewards, "shaped": shaped})
            stop = args.early_termination_threshold is not None and sum(rewards) / k > args.early_termination_threshold
            if turn + 1 == args.num_turns or stop:
                break
            texts = [c.texts[0] for c in completions]
            history = ([h + [p] for h, p in zip(history[0], prompts)], [h + [t] for h, t in zip(history[1], texts)])
            prompts = next_prompts(self.external_transition, item, texts, history[0], history[1], self.formatters,
                                   args.external_prompt_passthrough)
        self._store(turns)
        metrics = self._update_full_buffers()
        for t, record in enumerate(turns):
            reward_mean = sum(record["rewards"]) / len(record["rewards"])
            future = sum(args.discount ** (u - t) * turns[u]["rewards"][0] for u in range(t + 1, len(turns)))
            metrics[f"turn_{t + 1}/reward_mean"] = reward_mean
            metrics[f"turn_{t + 1}/expected_return"] = reward_mean + future
        if self.metrics_callback is not None:
            rollouts = [{"agent": i, "turn": t, "prompt": record["prompts"][i], "completion": text,
                         "reward": record["rewards"][j]}
                        for t, record in enumerate(turns) for i, comp in enumerate(record["completions"])
                        for j, text in enumerate(comp.texts)]
            for key, value in (self.metrics_callback(rollouts) or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[key] = float(value)
        if kls:
            metrics["reference_kl_mean"] = sum(kls) / len(kls)
        if sampling_seconds > 0:  # the sampling calls' own time, a sampled-ahead share included
            metrics["generated_tokens_per_second"] = tokens / sampling_seconds
        return metrics

    def _store(self, turns: list[dict]) -> None:
        """One-step TD targets from the rollout-time values, then samples into the buffers."""
        gamma = self.args.discount
        seen_critic = set()
        for t, record in enumerate(turns):
            last = t + 1 == len(turns)
            for i, comp in enumerate(record["completions"]):
                for j in range(comp.completion_ids.shape[0]):
                    value = record["values"][i][j]
                    target = record["shaped"][i][j] + (0.0 if last else gamma * turns[t + 1]["values"][i][0])
                    self.actor_buffers[i].append(ActorSample(i, t, comp.prompt_ids, comp.completion_ids[j],
                                                             comp.mask[j], target - value, value, target))
                    if not self.shared_head:
                        c, ids = record["critic_inputs"][i][j]
                        if (t, c, j) not in seen_critic:  # a shared MAAC critic gets each joint sample once
                            seen_critic.add((t, c, j))
                            self.critic_buffers[c].append(CriticSample(c, t, ids, value, target))

    # ---- updates --------------------------------------------------------------------------------
    def _update_full_buffers(self, force: bool = False) -> dict:
        """Update every actor and critic whose buffer is full on all ranks together (``force``: non-empty)."""
        size = 1 if force else self.args.rollout_buffer_size * self.dist.world_size
        counts = self.dist.sum([len(b) for b in [*self.actor_buffers, *self.critic_buffers]])
        metrics = {}
        for i, n in enumerate(counts[:len(self.actor_buffers)]):
            if n >= size:
                metrics.update(self._update_actor(i))
        for c, n in enumerate(counts[len(self.actor_buffers):]):
            if n >= size:
                metrics.update(self._update_critic(c))
        return metrics

    def _normalised(self, buffer: list[ActorSample]) -> dict[int, float]:
        """Advantages normalised over each turn's group on all ranks (mean 0, std 1) when enabled."""
        out = {}
        everyone = [pair for rank in self.dist.gather([(s.turn, s.advantage) for s in buffer]) for pair in rank]
        for turn in {s.turn for s in buffer}:
            group = [s for s in buffer if s.turn == turn]
            adv = torch.tensor([s.advantage for s in group], dtype=torch.float64)
            if self.args.advantage_normalization:
                every = torch.tensor([a for t, a in everyone if t == turn], dtype=torch.float64)
                if len(every) > 1:
                    adv = (adv - every.mean()) / every.std(unbiased=False).clamp_min(1e-6)
            out.update({id(s): float(a) for s, a in zip(group, adv)})
        return out

    def _update_actor(self, i: int) -> dict:
        args = self.args
        buffer, self.actor_buffers[i] = self.actor_buffers[i], []
        advantages = self._normalised(buffer)
        agent = self.agents[i]
        device = next(agent.parameters()).device
        policy_losses, value_losses = [], []
        for batch in self._minibatches(buffer):  # one batched pass per mini-batch
            loss, policy, value = None, 0.0, 0.0
            if batch:
                rows = [(s.prompt_ids, s.completion_ids, s.mask) for s in batch]
                if self.shared_head:  # log-probs and values from the same hidden states
                    hidden, covered = rows_forward(agent.model, rows, last_position=args.critic_type == "q", hidden=True)
                    logp = completion_logprobs(agent.model.get_output_embeddings()(hidden), covered).sum(dim=1)
                    ends = covered.mask.sum(dim=1) if args.critic_type == "q" else torch.zeros(len(batch), dtype=torch.long)
                    values = agent.value_head(hidden[torch.arange(len(batch), device=device), ends.to(device)])
                else:
                    logp = token_logprobs(agent, rows).sum(dim=1)
                advantage = torch.tensor([advantages[id(s)] for s in batch], device=device)
                loss = (-logp * advantage).sum()
                policy = loss.item()
                if self.shared_head:
                    value_loss = _value_loss(values.float(), torch.tensor([s.old_value for s in batch], device=device),
                                             torch.tensor([s.target for s in batch], device=device),
                                             args.value_clip_range)
                    value = value_loss.item()
                    loss = loss + args.value_loss_coef * value_loss
            count, policy, value = self.dist.sum([len(batch), policy, value])
            policy_losses.append(policy / count)
            value_losses.append(value / count)
            self._step(self.agent_optimizers[i], agent, loss, count, f"agent {i}")
        metrics = {f"agent_{i}/policy_loss": sum(policy_losses) / len(policy_losses)}
        if self.shared_head:
            metrics[f"agent_{i}/value_loss"] = sum(value_losses) / len(value_losses)
        return metrics

    def _update_critic(self, c: int) -> dict:
        """One optimizer step per global mini-batch of this critic's samples."""
        args = self.args
        buffer, self.critic_buffers[c] = self.critic_buffers[c], []
        critic = self.critics[c]
        device = next(critic.parameters()).device
        losses = []
        for batch in self._minibatches(buffer):
            loss, total = None, 0.0
            if batch:
                values = last_values(critic, [s.ids for s in batch]).float()
                loss = args.value_loss_coef * _value_loss(
                    values, torch.tensor([s.old_value for s in batch], device=device),
                    torch.tensor([s.target for s in batch], device=device), args.value_clip_range)
                total = loss.item()
            count, total = self.dist.sum([len(batch), total])
            losses.append(total / count)
            self._step(self.critic_optimizers[c], critic, loss, count, f"critic {c}")
        return {f"critic_{c}/value_loss": sum(losses) / len(losses)}

    def _end_epoch(self) -> dict:
        return self._update_full_buffers(force=True)

    # ---- state ----------------------------------------------------------------------------------
    def _roles(self) -> dict:
        return {"agents": self.agents, "critics": self.critics}

    def _optimizer_groups(self) -> dict:
        return {"agents": self.agent_optimizers, "critics": self.critic_optimizers}

    def _runtime_state(self) -> dict:
        return {"actor_buffers": [[_state(s) for s in b] for b in self.actor_buffers],
                "critic_buffers": [[_state(s) for s in b] for b in self.critic_buffers],
                "last_log_step": self._last_log_step}

    def _load_runtime_state(self, state: dict) -> None:
        self.actor_buffers = [[ActorSample(**s) for s in b] for b in state["actor_buffers"]]
        self.critic_buffers = [[CriticSample(**s) for s in b] for b in state["critic_buffers"]]
        self._last_log_step = state["last_log_step"]

    def _head_info(self, module) -> dict | None:
        head = getattr(module, "value_head", None)
        return None if head is None else {"hidden_dim": head.hidden_dim, "critic_type": self.args.critic_type}

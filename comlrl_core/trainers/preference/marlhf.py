"""MARLHF: learn one joint reward model from preference pairs, then train the agents against it.

Three stages, each callable on its own (the pipeline runs each as a task) and each ending on a
checkpoint when ``train(checkpoint_dir=...)`` is used:

1. :meth:`MARLHFTrainer.collect_preferences` — every agent samples candidates per prompt, the task
   ``reward_func`` labels aligned joint candidates, strictly better pairs are kept (ties dropped);
2. :meth:`MARLHFTrainer.fit_reward_model` — a causal-LM backbone from ``reward_model_name`` (default
   agent 0's source) with its own tokenizer and a scalar head, fitted with the Bradley-Terry loss;
   held-out pair accuracy is reported;
3. policy learning — MAGRPO, IAC or MAAC (``rl_algorithm``) with the fixed reward model as reward;
   evaluation always uses the task reward.

``MARLHFIterTrainer`` repeats the three stages ``num_iterations`` times, reloading the reward model
from its source and collecting fresh preferences with the current policy each time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ...checkpoint import METADATA, CheckpointError
from ...entities import load_reward_model, place_entities
from ...export import ExportEntry
from ...rollout import ROWS_PER_CALL, ItemDraws, sample_items
from ..actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from ..base import TrainerBase
from ..checkpointing import Progress
from ..config import TrainerConfig
from ..data import epoch_items
from ..optim import adamw
from ..reinforce import MAGRPOConfig, MAGRPOTrainer
from .config import RL_ALGORITHMS, MARLHFConfig, MARLHFIterConfig
from .preferences import PreferenceSet, joint_text, select_pairs


class LearnedReward:
    """The fitted joint reward model as a reward function: one score per aligned joint sample."""

    def __init__(self, trainer: MARLHFTrainer):
        self.trainer = trainer

    def __call__(self, *completions, prompts=None):
        texts = [joint_text(prompts, [c[j] for c in completions]) for j in range(len(completions[0]))]
        with torch.inference_mode():
            return self.trainer.score(texts).tolist()


class MARLHFTrainer(TrainerBase):
    """Preference-based MARL; constructor arguments as MAGRPO's plus ``critic_model``/``critics``."""

    algorithm_name = "MARLHF"
    config_class = MARLHFConfig

    def __init__(self, agent_model=None, agents=None, num_agents=None, tokenizer=None, model_config=None,
                 train_dataset=None, eval_dataset=None, reward_func=None, reward_processor=None, formatters=None,
                 external_transition=None, wandb_config=None, eval_logger=None, eval_aggregator=None, args=None,
                 metrics_callback=None, critic_model=None, critics=None):
        plan = self._setup(
            args=args, agent_model=agent_model, agents=agents, num_agents=num_agents, tokenizer=tokenizer,
            model_config=model_config, train_dataset=train_dataset, eval_dataset=eval_dataset,
            reward_func=reward_func, reward_processor=reward_processor, formatters=formatters,
            external_transition=external_transition, wandb_config=wandb_config, eval_logger=eval_logger,
            eval_aggregator=eval_aggregator, critic_model=critic_model, critics=critics,
            extra_callbacks={"metrics_callback": metrics_callback},
        )
        self.plan = plan
        self.placement = place_entities(plan, self.args, default=self.device, data_parallel=self.dist.active)
        self.reward_model = None
        self.reward_tokenizer = None
        self.reward_optimizer = None
        self.preferences: PreferenceSet | None = None
        self.reward_metrics: dict = {}
        self._preference_dir: Path | None = None
        self._resumed = False
        self._stop_after: str | None = None
        common = dict(agent_model=agent_model, agents=agents, num_agents=self.num_agents, tokenizer=plan.tokenizers,
                      model_config=model_config, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      reward_func=LearnedReward(self), formatters=formatters,
                      external_transition=external_transition)
        self.policy = self._policy_trainer(common, plan, model_config, eval_logger, eval_aggregator, metrics_callback)
        self.policy.eval_reward = self.reward  # evaluation always uses the task reward

    @classmethod
    def _entity_options(cls, args) -> dict:
        layout = {"magrpo": "none", "maac": "central",
                  "iac": "separate" if args.use_separate_critic else "shared"}[args.backend]
        return {"family": "magrpo", "critic_layout": layout, "reward_model": True,
                "reward_model_name": args.reward_model_name, "reward_model_device": args.reward_model_device,
                "critic_model_name": args.critic_model_name, "critic_defaults_to_actor": True}

    def _policy_trainer(self, common, plan, model_config, eval_logger, eval_aggregator, metrics_callback):
        """The RL backend, built on the same sources, with every critic and value-head option forwarded."""
        args = self.args
        shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainerConfig)}
        critic = dict(critic_learning_rate=args.critic_learning_rate, critic_type=args.critic_type,
                      value_loss_coef=args.value_loss_coef, value_clip_range=args.value_clip_range,
                      critic_devices=args.critic_devices)
        if args.backend == "magrpo":
            config = MAGRPOConfig(**shared, joint_mode="aligned", advantage_mode=RL_ALGORITHMS[args.rl_algorithm][1])
            return MAGRPOTrainer(**common, eval_logger=eval_logger, eval_aggregator=eval_aggregator, args=config)
        critics = plan.critic_sources or None
        if args.backend == "iac":
            config = IACConfig(**shared, **critic, use_separate_critic=args.use_separate_critic,
                               value_head_hidden_dim=args.value_head_hidden_dim,
                               critic_value_head_hidden_dim=args.critic_value_head_hidden_dim)
            return IACTrainer(**common, critics=critics, metrics_callback=metrics_callback, args=config)
        if args.critic_value_head_hidden_dim is not None:  # the reference dropped this for MAAC
            common["model_config"] = {**(model_config or {}),
                                      "critic_value_head_hidden_dim": args.critic_value_head_hidden_dim}
        return MAACTrainer(**common, critics=critics, metrics_callback=metrics_callback, args=MAACConfig(**shared, **critic))

    @property
    def agents(self):
        return self.policy.agents

    @property
    def critics(self):
        return getattr(self.policy, "critics", [])

    # ---- stage 1: preferences -------------------------------------------------------------------
    def collect_preferences(self) -> PreferenceSet:
        """Sample ``preference_num_candidates`` joint candidates per prompt (one ``generate`` per agent)
        and keep the selected strictly-better pairs; raises if every candidate tied."""
        generation = self._generation or self._generation_kwargs({})
        records = self._synced_step(lambda: self._collect(generation))
        if not records:
            raise ValueError(f"{type(self).__name__}: every candidate tied under reward_func, so there are no "
                             "preference pairs; raise preference_num_candidates or use a finer reward.")
        self.preferences = PreferenceSet(records)
        directory = self._output_dir() if self.dist.is_main else None
        if directory is not None:
            self.preferences.save(directory, name=f"preferences-iteration-{self.progress.iteration + 1:04d}")
        self.tracker.log({"preferences/num_pairs": len(records),
                          "preferences/candidate_reward_mean": sum(r["candidate_reward_mean"] for r in records)
                          / len(records)}, self.progress.env_step)
        return self.preferences

    def _collect(self, generation: dict) -> list[dict]:
        """Every rank's pairs, in item order; in a data-parallel job each rank samples every world_size-th item."""
        args = self.args
        records = []
        items = epoch_items(self.train_dataset, self.progress.iteration, args.seed, False, 0)
        mine = itertools.islice(items, self.dist.rank, None, self.dist.world_size)
        policies = [self.policy._policy(i) for i in range(self.num_agents)]
        k = args.preference_num_candidates
        for chunk in iter(lambda: list(itertools.islice(mine, max(1, ROWS_PER_CALL // k))), []):
            prompts_of = [[f(item) for f in self.formatters] for _, item in chunk]
            draws = [ItemDraws(self._item_seed("collect", self.progress.iteration, index)) for index, _ in chunk]
            sampled = sample_items(policies, self.tokenizers, prompts_of, k, generation, draws)
            for (index, item), prompts, candidates in zip(chunk, prompts_of, sampled):
                self._collect_item(index, item, prompts, candidates, records)
        return sorted((r for rank in self.dist.gather(records) for r in rank), key=lambda r: r["item"])

    def _collect_item(self, index: int, item: dict, prompts: list[str], candidates: list, records: list[dict]) -> None:
        """Score one item's candidates with the task reward and keep its chosen pairs in ``records``."""
        args = self.args
        self._seed_item("collect", self.progress.iteration, index)  # what the reward function may draw
        rewards = self.reward([c.texts for c in candidates], prompts=prompts, batch_items=[item])
        self.progress.env_step += len(rewards)
        mean = sum(rewards) / len(rewards)
        for w, l in select_pairs(rewards, args.pair_selection, args.preference_pairs_per_sample):
            records.append({
                "iteration": self.progress.iteration, "item": index, "prompts": prompts,
                "winner_completions": [c.texts[w] for c in candidates],
                "loser_completions": [c.texts[l] for c in candidates],
                "winner_reward": rewards[w], "loser_reward": rewards[l], "candidate_reward_mean": mean,
            })

    def _output_dir(self) -> Path | None:
        """``preference_output_dir``; a non-empty one gets a fresh ``resume-*``/``run-*`` subdirectory."""
        if self.args.preference_output_dir is None:
            return None
        if self._preference_dir is None:
            base = Path(self.args.preference_output_dir)
            if base.is_dir() and any(base.iterdir()):
                base = Path(tempfile.mkdtemp(prefix="resume-" if self._resumed else "run-", dir=base))
            self._preference_dir = base
        return self._preference_dir

    # ---- stage 2: reward model ------------------------------------------------------------------
    def _init_reward_model(self) -> None:
        """A fresh reward model from its source (never warm-started), with its own tokenizer."""
        self.reward_model, self.reward_tokenizer = load_reward_model(
            self.plan, self.placement.reward, freeze_backbone=self.args.reward_freeze_backbone)
        trainable = [p for p in self.reward_model.parameters() if p.requires_grad]
        self.reward_optimizer = adamw(trainable, lr=self.args.reward_learning_rate)

    def score(self, texts: list[str]) -> torch.Tensor:
        """Reward-model scores [B] of joint texts (gradients flow outside ``inference_mode``)."""
        if self.reward_model is None:
            raise RuntimeError("The reward model is not fitted yet; run fit_reward_model() first.")
        encoded = self.reward_tokenizer(texts, truncation=True, max_length=self.args.reward_max_length)
        return self.reward_model.score([torch.tensor(ids) for ids in encoded.input_ids]).float().cpu()

    def fit_reward_model(self, preferences: PreferenceSet | None = None) -> dict:
        """Bradley-Terry fit on the preference pairs; returns loss and train/held-out pair accuracy.

        Train accuracy is the last epoch's, each pair scored just before its own update step, so it
        costs no extra pass over the pairs; held-out accuracy is measured after the fit. In a
        data-parallel job every process holds all the pairs and scores its share of each mini-batch;
        the gradient is averaged over the whole mini-batch, so the fit does not depend on the world size.
        """
        args = self.args
        preferences = preferences or self.preferences
        if preferences is None or not preferences.records:
            raise ValueError("fit_reward_model needs preference pairs; run collect_preferences() first.")
        self.preferences = preferences
        self._seed_item("fit", self.progress.iteration)  # every rank fits the same model on the same pairs
        self._init_reward_model()
        train, held_out = preferences.split(args.reward_eval_fraction, args.seed + self.progress.iteration)
        self.reward_model.train()
        losses = []
        for _ in range(args.reward_num_train_epochs):
            order = list(train)
            random.shuffle(order)
            ranked_right = 0  # in this epoch, each pair measured just before its own update: no extra pass
            for start in range(0, len(order), args.reward_train_batch_size):
                batch = order[start:start + args.reward_train_batch_size]
                mine = batch[self.dist.rank::self.dist.world_size]
                self.reward_optimizer.zero_grad(set_to_none=True)  # nothing left from outside a step is added in
                loss, right = torch.zeros(()), 0
                if mine:
                    margin = self._margins(mine)
                    right = int((margin.detach() > 0).sum())
                    loss = -F.logsigmoid(margin).sum()
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"reward model: non-finite loss ({loss.item()}); lower "
                                                 "reward_learning_rate.")
                    (loss / len(batch)).backward()
                total, right = self.dist.sum([loss.item(), right])
                self.dist.sum_gradients(list(self.reward_model.parameters()))
                self.reward_optimizer.step()
                self.reward_optimizer.zero_grad(set_to_none=True)  # their memory serves the next backward
                ranked_right += int(right)
                losses.append(total / len(batch))
        self.reward_model.eval()
        metrics = {"reward_model/train_loss": sum(losses) / len(losses), "reward_model/train_pairs": len(train),
                   "reward_model/train_accuracy": ranked_right / len(train)}
        if held_out:
            metrics["reward_model/heldout_pairs"] = len(held_out)
            metrics["reward_model/heldout_accuracy"] = self.pair_accuracy(held_out)
        self.reward_metrics = metrics
        self.tracker.log(metrics, self.progress.env_step)
        return metrics

    def _margins(self, records: list[dict]) -> torch.Tensor:
        winners = [joint_text(r["prompts"], r["winner_completions"]) for r in records]
        losers = [joint_text(r["prompts"], r["loser_completions"]) for r in records]
        scores = self.score(winners + losers)
        return scores[: len(records)] - scores[len(records):]

    def pair_accuracy(self, records: list[dict]) -> float:
        """Share of pairs whose winner the reward model scores higher."""
        with torch.inference_mode():
            margins = torch.cat([self._margins(records[i:i + 32]) for i in range(0, len(records), 32)])
        return float((margins > 0).float().mean())

    # ---- stage 3: policy ------------------------------------------------------------------------
    def _train_item(self, item: dict | None, generation: dict, draws=None) -> dict:
        return self.policy._train_item(item, generation, draws)

    def _items_until_update(self) -> int:
        return self.policy._items_until_update()

    def _sample_ahead(self, items, draws, generation) -> None:
        self.policy._sample_ahead(items, draws, generation)

    def _end_epoch(self) -> dict:
        return self.policy._end_epoch()

    def _log_train(self, metrics: dict) -> None:
        # The backend's rewards are the reward model's scores, not the task reward: named apart, so no
        # summary or plot puts them on the task reward's scale. Its last-logged step is what checkpoints keep.
        self.policy._log_train({f"learned/{k}" if k.startswith("turn_") else k: v for k, v in metrics.items()})

    def evaluate(self) -> dict:
        self._link()
        return self.policy.evaluate()

    def _link(self) -> None:
        """The backend shares this trainer's progress, tracker and sampling settings."""
        self.policy.progress = self.progress
        self.policy.tracker = self.tracker
        self.policy._generation = self._generation
        self.policy.run_id = self.run_id
        self.policy.eval_samples = self.eval_samples

    def _initial_progress(self) -> Progress:
        return Progress(stage="collect")

    def train(self, resume_from_checkpoint=None, checkpoint_dir=None, checkpoint_interval=1, checkpoint_steps=None,
              checkpoint_total_limit=None, on_checkpoint=None, stop_after: str | None = None, **generation_kwargs):
        """As :meth:`TrainerBase.train`; ``stop_after="collect"`` or ``"fit"`` stops once that stage is done
        (and checkpointed), so a pipeline can run each stage as its own task."""
        if stop_after not in (None, "collect", "fit"):
            raise ValueError(f"stop_after must be None, 'collect' or 'fit', got {stop_after!r}.")
        self._stop_after = stop_after
        return super().train(resume_from_checkpoint, checkpoint_dir, checkpoint_interval, checkpoint_steps,
                             checkpoint_total_limit, on_checkpoint, **generation_kwargs)

    def _round(self, checkpoint_dir, interval, steps, total_limit) -> bool:
        """Collect, fit, train: each completed stage is a checkpoint boundary. False when told to stop."""
        if self.progress.stage == "collect":
            self.collect_preferences()
            self.progress.stage = "fit"
            self._commit(checkpoint_dir, save=True, total_limit=total_limit)
            if self._stop_after == "collect":
                return False
        if self.progress.stage == "fit":
            self.fit_reward_model()
            self.progress.stage = "policy"
            self._commit(checkpoint_dir, save=True, total_limit=total_limit)
            if self._stop_after == "fit":
                return False
        super()._loop(self._generation, checkpoint_dir, interval, steps, total_limit)
        return True

    def _loop(self, generation, checkpoint_dir, interval, steps, total_limit) -> None:
        self._link()
        self._round(checkpoint_dir, interval, steps, total_limit)

    # ---- state and export -----------------------------------------------------------------------
    def _roles(self) -> dict:
        return {**self.policy._roles(), "reward_model": [self.reward_model] if self.reward_model else []}

    def _optimizer_groups(self) -> dict:
        return {**self.policy._optimizer_groups(),
                "reward_model": [self.reward_optimizer] if self.reward_optimizer else []}

    def _runtime_state(self) -> dict:
        return {"policy": self.policy._runtime_state(),
                "preferences": None if self.preferences is None else self.preferences.records,
                "reward_metrics": self.reward_metrics}

    def _merge_runtime_states(self, states: list[dict], take: list[int]) -> dict:
        return {**states[0], "policy": self.policy._merge_runtime_states([s["policy"] for s in states], take)}

    def _load_runtime_state(self, state: dict) -> None:
        self.policy._load_runtime_state(state["policy"])
        self.preferences = None if state["preferences"] is None else PreferenceSet(list(state["preferences"]))
        self.reward_metrics = dict(state["reward_metrics"])

    def load_checkpoint(self, path) -> dict | None:
        path = Path(path)
        if path.name == METADATA:
            path = path.parent
        try:
            saved_roles = json.loads((path / METADATA).read_text())["fingerprints"]["models"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path / METADATA}: unreadable checkpoint metadata ({exc}).") from exc
        if saved_roles.get("reward_model") and self.reward_model is None:
            self._init_reward_model()  # the checkpoint's weights replace the fresh ones
        identity = super().load_checkpoint(path)
        self._resumed = True
        self._link()
        return identity

    def _export_entries(self) -> list[ExportEntry]:
        entries = self.policy._export_entries()
        if self.reward_model is not None:
            entries.append(ExportEntry("reward_model", self.reward_model.backbone, self.reward_tokenizer,
                                       {"reward_head.pt": self.reward_model.reward_head}))
        return entries

    def _export_info(self) -> dict:
        info = self.policy._export_info()
        if self.reward_model is not None:
            info["reward_model"] = {"path": "reward_model", "source": self.plan.reward_model_source,
                                    "head": "reward_head.pt (Linear(hidden_size, 1) on the last non-padding token)",
                                    "freeze_backbone": self.args.reward_freeze_backbone,
                                    "metrics": self.reward_metrics}
        info["rl_algorithm"] = self.args.rl_algorithm
        return info


class MARLHFIterTrainer(MARLHFTrainer):
    """``num_iterations`` rounds; each reloads the reward model, collects with the current policy, fits, trains."""

    algorithm_name = "MARLHFIter"
    config_class = MARLHFIterConfig

    def _loop(self, generation, checkpoint_dir, interval, steps, total_limit) -> None:
        self._link()
        if self.progress.iteration > self.args.num_iterations:
            raise ValueError(f"The checkpoint is at iteration {self.progress.iteration} but num_iterations="
                             f"{self.args.num_iterations}; num_iterations counts the whole run, so raise it.")
        while self.progress.iteration < self.args.num_iterations:
            if not self._round(checkpoint_dir, interval, steps, total_limit):
                return
            self.tracker.log({"iter/completed_iterations": self.progress.iteration + 1}, self.progress.env_step)
            self.progress.iteration += 1
            if self.progress.iteration < self.args.num_iterations:
                self.progress.stage, self.progress.epoch, self.progress.index = "collect", 0, 0

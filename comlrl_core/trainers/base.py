"""What every trainer shares: constructor setup, the epoch loop with its checkpoint boundaries, evaluation, export.

A subclass provides the algorithm (``_train_item``, ``_end_epoch``, ``evaluate``), the modules and
optimizers it owns (``_roles``, ``_optimizer_groups``), its runtime state, and its export layout.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import capture_rng, restore_rng
from ..distributed import context
from ..entities import EntityPlan, plan_entities
from ..export import ExportEntry, export_models
from ..heap import retained_heap
from ..rewards import RewardFunction
from ..rollout import ROWS_PER_CALL, ItemDraws, sample_items
from ..tracking import Tracker, check_wandb_config
from .checkpointing import CheckpointMixin, Progress, latest_checkpoint
from .data import build_formatters, check_dataset, check_formatters, epoch_items, is_map_style, next_prompts


SAMPLES_SHOWN = 3  # eval items whose completions are kept to show before and after training


def _positive_int(value, name: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}.")


class TrainerBase(CheckpointMixin):
    """Shared trainer machinery; see the module docstring for what subclasses provide."""

    algorithm_name = "base"
    config_class: type = object

    # ---- provided by subclasses -----------------------------------------------------------------
    def _roles(self) -> dict[str, list[torch.nn.Module]]:
        raise NotImplementedError

    def _optimizer_groups(self) -> dict[str, list[torch.optim.Optimizer]]:
        raise NotImplementedError

    def _train_item(self, item: dict | None, generation: dict, draws: ItemDraws | None) -> dict:
        """Roll out ``item``, sampling from ``draws`` (its stream, and maybe its first turn already
        sampled), and update when the buffers are full; returns the step's metrics.

        In a data-parallel job every rank calls this once per global step, ``item=None`` on a rank
        left without one at the end of an epoch: it only joins the collectives.
        """
        raise NotImplementedError

    def _items_until_update(self) -> int:
        """How many more items each rank can roll out before a policy next changes, at least: their
        first turns are sampled together, one call per agent. Every rank calls it at once (it may
        use collectives)."""
        return 1

    def _end_epoch(self) -> dict:
        """Drain what is buffered so the epoch boundary is a clean checkpoint point; returns metrics."""
        return {}

    def _runtime_state(self) -> dict:
        return {}

    def _load_runtime_state(self, state: dict) -> None:
        pass

    _buffer_keys: tuple[str, ...] = ()  # runtime-state entries holding per-rank sample buffers (one list each)

    def _merge_runtime_states(self, states: list[dict], take: list[int]) -> dict:
        """This rank's runtime state when resuming at another world size: the shared parts of
        ``states[0]`` with the buffered samples of the saved ranks ``take`` (possibly none)."""
        merged = dict(states[0])
        for key in self._buffer_keys:
            merged[key] = [sum((states[j][key][b] for j in take), []) for b in range(len(states[0][key]))]
        return merged

    def _export_entries(self) -> list[ExportEntry]:
        raise NotImplementedError

    def _export_info(self) -> dict:
        return {}

    def _initial_progress(self) -> Progress:
        return Progress()

    # ---- shared setup ---------------------------------------------------------------------------
    @classmethod
    def _entity_options(cls, args) -> dict:
        """How this trainer resolves entities: the rule family, critic layout and reward-model options."""
        return {"family": "magrpo"}

    @classmethod
    def check_entities(cls, args=None, *, agent_model=None, agents=None, num_agents=None, tokenizer=None,
                       model_config=None, critic_model=None, critics=None) -> EntityPlan:
        """Check every seed rule for these constructor arguments, reading configs and tokenizers only
        (no weights): what the constructor checks first, callable on its own (the pipeline does)."""
        args = args if args is not None else cls.config_class()
        return plan_entities(owner=cls.__name__, agent_model=agent_model, agents=agents, num_agents=num_agents,
                             config_num_agents=args.num_agents, config_name=type(args).__name__,
                             tokenizer=tokenizer, model_config=model_config, critic_model=critic_model,
                             critics=critics, allow_shared_models=args.allow_shared_models,
                             **cls._entity_options(args))

    def _setup(self, *, args, agent_model, agents, num_agents, tokenizer, model_config, train_dataset, eval_dataset,
               reward_func, reward_processor, formatters, external_transition, wandb_config, eval_logger=None,
               eval_aggregator=None, critic_model=None, critics=None, extra_callbacks: dict | None = None) -> EntityPlan:
        """Validate every constructor argument, resolve the entities (no weights yet), set shared state.

        Returns the plan; the subclass loads its models from it and builds its optimizers.
        """
        owner = type(self).__name__
        args = copy.deepcopy(args) if args is not None else self.config_class()
        if not isinstance(args, self.config_class):
            raise TypeError(f"{owner}: args must be a {self.config_class.__name__}, got {type(args).__name__}.")
        if not callable(reward_func):
            raise TypeError(f"{owner}: reward_func must be a callable, got {type(reward_func).__name__}.")
        if args.num_turns > 1 and external_transition is None:
            raise ValueError(f"{owner}: num_turns={args.num_turns} needs an external_transition that returns the "
                             "next turn's prompts; pass one or set num_turns=1.")
        if external_transition is not None and not callable(external_transition):
            raise TypeError(f"{owner}: external_transition must be callable.")
        if (eval_logger is None) != (eval_aggregator is None):
            raise ValueError(f"{owner}: eval_logger and eval_aggregator go together; pass both or neither.")
        wandb_config = check_wandb_config(wandb_config)
        check_dataset(train_dataset, "train_dataset")
        check_dataset(eval_dataset, "eval_dataset")
        plan = self.check_entities(args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                                   tokenizer=tokenizer, model_config=model_config, critic_model=critic_model,
                                   critics=critics)
        self.num_agents = args.num_agents = plan.num_agents
        self.args = args
        self.reward = RewardFunction(reward_func, self.num_agents, reward_processor)
        self.formatters = build_formatters(formatters, self.num_agents, plan.tokenizers)
        check_formatters(self.formatters, train_dataset, eval_dataset)
        self.external_transition = external_transition
        self.eval_logger, self.eval_aggregator = eval_logger, eval_aggregator
        self.model_name = plan.model_name
        self.sources = [s if isinstance(s, str) else None for s in plan.agent_sources]
        self.tokenizers = plan.tokenizers
        self.dist = context()
        self.device = self.dist.device
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.progress = Progress()
        self.run_id: str | None = None
        self._generation: dict | None = None
        self._on_checkpoint = None
        self._last_log_step = -1
        self.eval_samples: list[dict] = []  # the first and latest evaluations' completions (see evaluate)
        self.eval_reward = self.reward  # preference trainers evaluate with the task reward, not the learned one
        callbacks = {"reward_func": reward_func, "reward_processor": reward_processor,
                     "external_transition": external_transition, "eval_logger": eval_logger,
                     "eval_aggregator": eval_aggregator, "eval_dataset": eval_dataset, **(extra_callbacks or {})}
        if is_map_style(train_dataset):  # iterable datasets resume by position, not by their own state
            callbacks["train_dataset"] = train_dataset
        for i, f in enumerate(self.formatters):
            callbacks[f"formatters.{i}"] = f.func
        self._callbacks = {name: obj for name, obj in callbacks.items() if obj is not None}
        for name, obj in self._callbacks.items():
            if hasattr(obj, "state_dict") and not hasattr(obj, "load_state_dict"):
                raise TypeError(f"{name} provides state_dict() but no load_state_dict(); add it so checkpoints "
                                "can restore it.")
        self.tracker = Tracker(wandb_config if self.dist.is_main else None,
                               {"algorithm": self.algorithm_name, **dataclasses.asdict(args)},
                               verbose=args.verbose and self.dist.is_main)
        return plan

    @property
    def history(self) -> list[dict]:
        """Every logged metrics dict, in order (``step`` is the env step)."""
        return self.tracker.history

    def trainer_class(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    # ---- training loop --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | Path | None = None, checkpoint_dir: str | Path | None = None,
              checkpoint_interval: int = 1, checkpoint_steps: int | None = None,
              checkpoint_total_limit: int | None = None, on_checkpoint: Callable[[Path], None] | None = None,
              **generation_kwargs) -> dict:
        """Train ``num_train_epochs`` epochs in total (a resumed run counts the epochs already done).

        ``checkpoint_dir`` turns on checkpoints: ``checkpoint-N`` at every ``checkpoint_interval``-th
        epoch, every ``checkpoint_steps`` items within an epoch, and at the end.
        ``resume_from_checkpoint`` is a checkpoint directory or ``"latest"`` (the newest valid one in
        ``checkpoint_dir``). ``on_checkpoint(path)`` is called after each checkpoint is published
        (the pipeline uploads it). Extra keyword arguments go to ``generate``. Returns the last metrics.
        Under ``accelerate launch``/``torchrun`` every process calls this with the same arguments: each
        trains on its share of the items, and only rank 0 writes (see ``comlrl_core.distributed``).
        """
        if on_checkpoint is not None and not callable(on_checkpoint):
            raise TypeError("on_checkpoint must be a callable taking the checkpoint path, or None.")
        self._on_checkpoint = on_checkpoint
        _positive_int(checkpoint_interval, "checkpoint_interval")
        _positive_int(checkpoint_steps, "checkpoint_steps", optional=True)
        _positive_int(checkpoint_total_limit, "checkpoint_total_limit", optional=True)
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}.train() requires a train_dataset.")
        generation = self._generation = self._generation_kwargs(generation_kwargs)
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        identity = None
        if resume_from_checkpoint is not None:
            if str(resume_from_checkpoint) == "latest":
                if checkpoint_dir is None:
                    raise ValueError("resume_from_checkpoint='latest' needs checkpoint_dir.")
                resume_from_checkpoint = latest_checkpoint(checkpoint_dir)
            identity = self.load_checkpoint(resume_from_checkpoint)
        else:
            self._seed_everything()
            self.progress = self._initial_progress()
            self.run_id = self.dist.gather(uuid.uuid4().hex)[0]  # rank 0's id names the run on every rank
        if checkpoint_dir is not None:
            self._preflight(checkpoint_dir)
        rng = capture_rng()  # opening a W&B run must not shift the training random streams
        self.tracker.start(identity)
        restore_rng(rng)
        try:
            with retained_heap():
                self._loop(generation, checkpoint_dir, checkpoint_interval, checkpoint_steps, checkpoint_total_limit)
        finally:
            self.tracker.finish()
        return self.history[-1] if self.history else {}

    def _loop(self, generation, checkpoint_dir, interval, steps, total_limit) -> None:
        """Epochs of global steps: each of the ``world_size`` ranks takes one of the next items.

        Each item's rollout draws from its own stream seeded by ``(seed, iteration, epoch, index)``, so
        what is sampled for an item does not depend on the number of processes, on where a run
        resumed, or on which items it was sampled with: the items rolled out before the next policy
        update sample their first turns together (``_next_window``).
        """
        args, world, rank = self.args, self.dist.world_size, self.dist.rank
        if self.progress.epoch > args.num_train_epochs:
            raise ValueError(f"The checkpoint is at epoch {self.progress.epoch} but num_train_epochs="
                             f"{args.num_train_epochs}; num_train_epochs counts the whole run, so raise it.")
        while self.progress.epoch < args.num_train_epochs:
            epoch = self.progress.epoch
            items = epoch_items(self.train_dataset, epoch, args.seed, args.shuffle, self.progress.index)
            groups = iter(lambda: list(itertools.islice(items, world)), [])
            while True:
                started, evaluating = time.perf_counter(), 0.0
                if not (window := self._next_window(groups, epoch, steps, generation)):
                    break
                for position, (group, draws) in enumerate(window, start=1):
                    indices = [index for index, _ in group]
                    if args.eval_interval and any(i % args.eval_interval == 0 for i in indices):
                        began = time.perf_counter()
                        self._log_evaluation()
                        evaluating += time.perf_counter() - began
                    mine = group[rank] if rank < len(group) else None
                    if mine is not None:
                        self._seed_item("train", self.progress.iteration, epoch, mine[0])
                    metrics = self._synced_step(lambda: self._train_item(mine and mine[1], generation, draws))
                    if position == len(window):  # the window's sampling and updates, per global step
                        metrics["seconds_per_step"] = (time.perf_counter() - started - evaluating) / len(window)
                    self._log_train(metrics)
                    done = self.progress.items_done
                    self.progress.index = indices[-1] + 1
                    self.progress.items_done += len(group)
                    if (steps and self.progress.items_done // steps > done // steps
                            and not self._epoch_ends_at(indices[-1])):
                        self._commit(checkpoint_dir, save=True, total_limit=total_limit)
            self._log_train(self._synced_step(self._end_epoch))
            self.progress.epoch, self.progress.index = epoch + 1, 0
            if self.progress.epoch == args.num_train_epochs and args.eval_interval:
                self._log_evaluation()  # the "after" figure, before the last checkpoint: its history holds it
            due = (epoch + 1) % interval == 0 or self.progress.epoch == args.num_train_epochs
            self._commit(checkpoint_dir, save=due, total_limit=total_limit)

    def _log_evaluation(self) -> None:
        """Evaluate and log, unless the models were already evaluated at this step (a run resumed at
        the end of the one before, or a pipeline stage starting where the last one ended)."""
        step = self.progress.env_step
        if self.eval_dataset is None or any(h["step"] == step and any(k.startswith("eval/") for k in h)
                                            for h in self.history[-3:]):
            return
        self.tracker.log(self.evaluate(), step)

    def _next_window(self, groups, epoch: int, steps: int | None,
                     generation: dict) -> list[tuple[list, ItemDraws | None]]:
        """The next global steps whose rollouts one policy samples (``_items_until_update``, cut where
        a mid-epoch checkpoint falls, so no checkpoint is ever taken with items sampled ahead), each
        with this rank's item's draws; the first turns of this rank's items sampled together."""
        window, done, size = [], self.progress.items_done, self._items_until_update()
        for group in groups:
            window.append(group)
            done += len(group)
            if len(window) >= size or (steps and done // steps > (done - len(group)) // steps):
                break
        rank = self.dist.rank
        mine = [group[rank] if rank < len(group) else None for group in window]
        draws = [ItemDraws(self._item_seed("train", self.progress.iteration, epoch, m[0])) if m else None for m in mine]
        present = [(m[1], d) for m, d in zip(mine, draws) if m]
        if len(present) > 1:
            self._sample_ahead([item for item, _ in present], [d for _, d in present], generation)
        return list(zip(window, draws))

    def _sample_ahead(self, items: list[dict], draws: list[ItemDraws], generation: dict) -> None:
        """The first turn of several items in one sampling call per agent, kept in their draws."""
        prompts = [[f(item) for f in self.formatters] for item in items]
        policies = [self._policy(i) for i in range(self.num_agents)]
        k = self.args.num_generations
        sampled = sample_items(policies, self.tokenizers, prompts, k, generation, draws)
        for p, d, completions in zip(prompts, draws, sampled):
            d.ahead = (p, k, completions)

    def _synced_step(self, step: Callable[[], dict]) -> dict:
        """Run one step on every rank; ``env_step`` then counts every rank's environment steps."""
        before = self.progress.env_step
        metrics = step()
        (done,) = self.dist.sum([self.progress.env_step - before])
        self.progress.env_step = before + int(done)
        return metrics

    def _epoch_ends_at(self, index: int) -> bool:
        return hasattr(self.train_dataset, "__len__") and index + 1 == len(self.train_dataset)

    def _seed_everything(self) -> None:
        seed = self.args.seed
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _item_seed(self, *key) -> int:
        """The seed of ``(seed, *key)``: the same on any rank, at any world size."""
        digest = hashlib.sha256(repr((self.args.seed, *key)).encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _seed_item(self, *key) -> None:
        """Seed every global generator from ``(seed, *key)``: the same draws on any rank, at any world size."""
        seed = self._item_seed(*key)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _generation_kwargs(self, extra: dict) -> dict:
        args = self.args
        generation = {
            "do_sample": True,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else 0,  # 0 disables top-k; None would mean 50
            "max_new_tokens": args.max_new_tokens,
        }
        extra = {k: v for k, v in extra.items() if k != "do_sample"}
        reserved = sorted({"num_return_sequences", "input_ids", "attention_mask"} & extra.keys())
        if reserved:
            raise ValueError(f"train() cannot take {reserved}: the trainer sets them.")
        return {**generation, **extra}

    def _minibatches(self, buffer: list) -> list[list]:
        """Per turn, shuffled mini-batches of ``train_batch_size`` samples, padded with empty ones so
        every rank steps through as many as the rank with the most: the global mini-batch is every
        rank's j-th one."""
        batches = []
        for turn in sorted(set().union(*self.dist.gather({s.turn for s in buffer}))):
            group = [s for s in buffer if s.turn == turn]
            random.shuffle(group)
            mine = [group[i:i + self.args.train_batch_size] for i in range(0, len(group), self.args.train_batch_size)]
            batches += mine + [[] for _ in range(self.dist.max(len(mine)) - len(mine))]
        return batches

    def _step(self, optimizer, module, loss: torch.Tensor | None, count: int, what: str) -> None:
        """Backpropagate this rank's loss (a sum over its samples) divided by the ``count`` samples of
        every rank, sum the ranks' gradients (their mean over the global mini-batch), clip, step, and free
        the gradients."""
        optimizer.zero_grad(set_to_none=True)  # nothing left from outside a step is added in
        if loss is not None:
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{what}: non-finite loss ({loss.item()}); lower the learning rates or "
                                         "check the rewards.")
            (loss / count).backward()
        self.dist.sum_gradients(list(module.parameters()))
        if self.args.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # now, so their memory serves the next backward, of any model

    def _policy(self, i: int) -> torch.nn.Module:
        """The causal LM that generates for agent i."""
        return self.agents[i]

    def _log_train(self, metrics: dict) -> None:
        """Log a step's metrics, averaged over the ranks (throughputs summed), at most every ``logging_steps``."""
        step = self.progress.env_step
        if step - self._last_log_step < self.args.logging_steps:
            return
        if self.dist.active:
            per_rank = self.dist.gather(metrics)
            merged = {}
            for key in dict.fromkeys(k for m in per_rank for k in m):
                values = [m[key] for m in per_rank if key in m]
                merged[key] = sum(values) if key.endswith("_per_second") else sum(values) / len(values)
            metrics = merged
        if metrics:
            self._last_log_step = step
            self.tracker.log(metrics, step)

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """One joint trajectory per eval item, each from its own fixed seed, every item's turn sampled
        together (training RNG is untouched)."""
        args = self.args
        if self.eval_dataset is None or args.eval_num_samples == 0:
            return {}
        generation = self._generation or self._generation_kwargs({})
        items = [item for _, item in zip(range(args.eval_num_samples), self._eval_items())]
        rewards = [[] for _ in range(args.num_turns)]
        completions_log = [[[] for _ in items] for _ in range(self.num_agents)]
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(args.seed)  # what a reward function may draw
            draws = [ItemDraws(self._item_seed("eval", n)) for n in range(len(items))]
            prompts = [[f(item) for f in self.formatters] for item in items]
            history = [([[] for _ in self.agents], [[] for _ in self.agents]) for _ in items]
            policies = [self._policy(i) for i in range(self.num_agents)]
            for turn in range(args.num_turns):
                sampled = []
                for start in range(0, len(items), ROWS_PER_CALL):  # every item's turn together
                    sampled += sample_items(policies, self.tokenizers, prompts[start:start + ROWS_PER_CALL], 1,
                                            generation, draws[start:start + ROWS_PER_CALL])
                for n, (item, completions) in enumerate(zip(items, sampled)):
                    texts = [c.texts[0] for c in completions]
                    for i, text in enumerate(texts):
                        completions_log[i][n].append(text)
                    rewards[turn].append(self.eval_reward([[t] for t in texts], prompts=prompts[n],
                                                          batch_items=[item])[0])
                    if turn + 1 < args.num_turns:
                        history[n] = ([h + [p] for h, p in zip(history[n][0], prompts[n])],
                                      [h + [t] for h, t in zip(history[n][1], texts)])
                        prompts[n] = next_prompts(self.external_transition, item, texts, history[n][0],
                                                  history[n][1], self.formatters, args.external_prompt_passthrough)
        self._keep_samples([{"prompt": item.get("prompt") or prompts[n][0],
                             "completions": [completions_log[i][n][0] for i in range(self.num_agents)],
                             "reward": rewards[0][n]} for n, item in enumerate(items[:SAMPLES_SHOWN])])
        metrics = {}
        for turn in range(args.num_turns):
            metrics[f"eval/turn_{turn + 1}/reward_mean"] = sum(rewards[turn]) / len(rewards[turn])
            expected = [sum(args.discount ** (u - turn) * rewards[u][n] for u in range(turn, args.num_turns))
                        for n in range(len(items))]
            metrics[f"eval/turn_{turn + 1}/expected_return"] = sum(expected) / len(expected)
        if self.eval_logger is not None:
            per_item = self.eval_logger(agent_completions_turns=completions_log, batch_items=items,
                                        prompts=[item.get("prompt", "") for item in items])
            for key, value in (self.eval_aggregator(per_item, num_turns=args.num_turns) or {}).items():
                metrics[f"eval/{key}"] = value
        return metrics

    def _keep_samples(self, samples: list[dict]) -> None:
        """Keep the first evaluation's completions and the latest one's: what training changed, to show."""
        record = {"step": self.progress.env_step, "samples": samples}
        self.eval_samples[:] = [self.eval_samples[0], record] if self.eval_samples else [record]  # in place: shared

    def _eval_items(self):
        if is_map_style(self.eval_dataset):
            return (self.eval_dataset[i] for i in range(len(self.eval_dataset)))
        return iter(self.eval_dataset)

    # ---- export ---------------------------------------------------------------------------------
    def save_model(self, output_dir: str | Path) -> Path:
        """Export the trained models (seed layout) with a manifest; W&B runs are left open.

        In a data-parallel job only rank 0 writes; every rank returns once the export is complete.
        """
        info = {
            "trainer_class": self.trainer_class(),
            "algorithm": self.algorithm_name,
            "num_agents": self.num_agents,
            "config": dataclasses.asdict(self.args),
            **self._export_info(),
        }
        if self.dist.is_main:
            export_models(output_dir, self._export_entries(), info)
        self.dist.barrier()
        return Path(output_dir)

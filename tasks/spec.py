"""The typed run spec: everything a pipeline run needs, as JSON, validated before any model loads.

Datasets and callables are given by reference: a dataset spec (a built-in task, a local JSON/JSONL
file, or ``datasets.load_dataset`` arguments) and ``"package.module:function"`` import strings.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from comlrl_core.environments import length_ratio_dataset
from comlrl_core.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_core.trainers.preference import MARLHFConfig, MARLHFIterConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ALGORITHMS = {
    "magrpo": (MAGRPOTrainer, MAGRPOConfig),
    "iac": (IACTrainer, IACConfig),
    "maac": (MAACTrainer, MAACConfig),
    "marlhf": (MARLHFTrainer, MARLHFConfig),
    "marlhf_iter": (MARLHFIterTrainer, MARLHFIterConfig),
}
BUILTIN_DATASETS = {"length_ratio": length_ratio_dataset}


def load_reference(reference: str, field: str) -> Any:
    """Import ``"package.module:attribute"``; the error names the spec field and the fix."""
    if not isinstance(reference, str) or reference.count(":") != 1 or not all(reference.split(":")):
        raise ValueError(f"{field}={reference!r} must be an import string 'package.module:function'.")
    module_name, attribute = reference.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # importing runs the module's code: whatever it raises is this reference's fault
        raise ValueError(f"{field}={reference!r}: cannot import module {module_name!r} ({exc}).") from exc
    try:
        value = getattr(module, attribute)
    except AttributeError as exc:
        raise ValueError(f"{field}={reference!r}: module {module_name!r} has no attribute {attribute!r}.") from exc
    if not callable(value):
        raise ValueError(f"{field}={reference!r} is not callable.")
    return value


class DatasetSpec(BaseModel):
    """One of: ``builtin`` (a shipped task), ``file`` (local .json/.jsonl), or ``path`` for ``load_dataset``."""

    model_config = ConfigDict(extra="forbid")

    builtin: Literal["length_ratio"] | None = None
    size: int = Field(6, ge=1, strict=True)  # strict: true or "6" is a mistake, not a count
    offset: int = Field(0, ge=0, strict=True)
    file: str | None = None
    path: str | None = None
    name: str | None = None
    split: str = "train"
    limit: int | None = Field(None, ge=1, strict=True)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        given = [k for k in ("builtin", "file", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of builtin, file or path (got {given or 'none'}).")
        if self.file is not None and not Path(self.file).expanduser().is_file():
            raise ValueError(f"file={self.file!r} does not exist.")
        return self

    def load(self):
        """The dataset: a list of dicts, or a ``datasets.Dataset``."""
        import datasets

        if self.builtin is not None:
            data = BUILTIN_DATASETS[self.builtin](self.size, self.offset)
        elif self.file is not None:
            data = datasets.load_dataset("json", data_files=str(Path(self.file).expanduser()), split="train")
        else:
            data = datasets.load_dataset(self.path, self.name, split=self.split)
        if self.limit is not None:
            data = data[: self.limit] if isinstance(data, list) else data.select(range(min(self.limit, len(data))))
        return data


class RunSpec(BaseModel):
    """A pipeline run. ``config`` holds the trainer config fields (e.g. ``MAGRPOConfig``);
    ``init_from`` ("latest" or an export key) retrains from an earlier export's agents."""

    model_config = ConfigDict(extra="forbid")

    name: str = "comlrl-run"
    algorithm: Literal["magrpo", "iac", "maac", "marlhf", "marlhf_iter"] = "magrpo"
    agent_model: str | None = None
    agents: list[str] | None = None
    num_agents: int | None = Field(None, ge=1, strict=True)
    tokenizers: list[str] | None = None
    critic_model: str | None = None
    critics: list[str] | None = None
    model_options: dict[str, Any] | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    train_dataset: DatasetSpec = Field(default_factory=lambda: DatasetSpec(builtin="length_ratio"))
    eval_dataset: DatasetSpec | None = None
    reward_func: str = "comlrl_core.environments:length_ratio_reward"
    reward_processor: str | None = None
    formatters: str | list[str] | None = None
    external_transition: str | None = None
    stage_epochs: int = Field(1, ge=1, strict=True)
    checkpoint_steps: int | None = Field(None, ge=1, strict=True)
    num_processes: int = Field(1, ge=1, strict=True)  # >1: each training stage is an `accelerate launch` job
    storage: str = "./comlrl-runs"
    init_from: str | None = None
    wandb: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        from comlrl_core.storage import safe_key

        return safe_key(value)

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        self.trainer_config()  # field names and values, checked by the config class itself
        load_reference(self.reward_func, "reward_func")
        for field in ("reward_processor", "external_transition"):
            if getattr(self, field) is not None:
                load_reference(getattr(self, field), field)
        refs = [self.formatters] if isinstance(self.formatters, str) else (self.formatters or [])
        for i, ref in enumerate(refs):
            load_reference(ref, f"formatters[{i}]" if isinstance(self.formatters, list) else "formatters")
        if self.agent_model is None and self.agents is None:
            raise ValueError("give agent_model (one id or directory for every agent) or agents (one per agent); "
                             "with init_from they are the starting point until a first export exists.")
        if self.algorithm == "magrpo" and (self.critic_model is not None or self.critics is not None):
            # build_trainer would drop them silently: MAGRPOTrainer takes no critic.
            raise ValueError("critic_model and critics must be unset for algorithm='magrpo', which has no critic.")
        if self.init_from not in (None, "latest"):
            from comlrl_core.storage import safe_key

            self.init_from = safe_key(self.init_from)
        return self

    def trainer_config(self, **overrides):
        config_class = ALGORITHMS[self.algorithm][1]
        try:
            return config_class(**{**self.config, **overrides})
        except TypeError as exc:
            raise ValueError(f"config: {exc} (see {config_class.__name__} for the fields).") from exc

    @property
    def digest(self) -> str:
        """Content identity of the spec (canonical JSON)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()

    @property
    def run_key(self) -> str:
        """Where this spec's checkpoints and exports live in storage: ``name/spec-digest``."""
        return f"{self.name}/{self.digest[:16]}"

    def build_trainer(self, initial_agents: list[str] | None = None, **config_overrides):
        """The trainer this spec describes (loads the models); ``initial_agents`` (the directories of
        an earlier export, for retraining) replace ``agent_model``/``agents``."""
        trainer_class, _ = ALGORITHMS[self.algorithm]
        args = self.trainer_config(**config_overrides)
        formatters = self.formatters
        if isinstance(formatters, str):
            formatters = load_reference(formatters, "formatters")
        elif isinstance(formatters, list):
            formatters = [load_reference(f, f"formatters[{i}]") for i, f in enumerate(formatters)]
        kwargs = dict(
            agent_model=None if initial_agents else self.agent_model, agents=initial_agents or self.agents,
            tokenizer=self.load_tokenizers(),
            model_config=self.model_options, train_dataset=self.train_dataset.load(),
            eval_dataset=self.eval_dataset.load() if self.eval_dataset else None,
            reward_func=load_reference(self.reward_func, "reward_func"),
            reward_processor=load_reference(self.reward_processor, "reward_processor") if self.reward_processor else None,
            formatters=formatters,
            external_transition=(load_reference(self.external_transition, "external_transition")
                                 if self.external_transition else None),
            wandb_config=self.wandb, args=args,
        )
        if self.algorithm in ("iac", "maac", "marlhf", "marlhf_iter"):
            kwargs.update(critic_model=self.critic_model, critics=self.critics)
        if self.num_agents is not None:
            kwargs["num_agents"] = self.num_agents
        return trainer_class(**kwargs)

    def load_tokenizers(self):
        """The spec's tokenizers (ids or directories), or None to let the trainer load them."""
        if self.tokenizers is None:
            return None
        from comlrl_core.entities.loading import trusts_remote_code
        from comlrl_core.entities.tokenizers import load_tokenizer

        trust = trusts_remote_code(self.model_options)
        return [load_tokenizer(t, f"tokenizers[{i}]", trust) for i, t in enumerate(self.tokenizers)]

"""The typed run spec: everything a pipeline run needs, as JSON, validated before any model loads.

Datasets and callables are given by reference: a dataset spec (a built-in task, a local JSON/JSONL
file, or ``datasets.load_dataset`` arguments) and ``"package.module:function"`` import strings.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from comlrl_core.credentials import CREDENTIAL_KEYS, NO_URL_CREDENTIALS, find_credentials
from comlrl_core.environments import builtin
from comlrl_core.prompts import PromptTemplate
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


SPEC_FILE_BYTES = 1 << 20  # a run spec is a few kilobytes
SPEC_VALUES = 100_000  # values in a spec once its YAML aliases are expanded
MAX_STAGES = 10_000  # Prefect tasks one flow run plans


def read_spec_file(path: Path) -> dict:
    """A YAML run spec as a mapping, refusing at once what could exhaust memory: a file over 1 MiB,
    nesting too deep to parse, or aliases that expand to more than ``SPEC_VALUES`` values (a
    "billion laughs"; PyYAML shares aliased values, so counting them is cheap, expanding them is not)."""
    size = path.stat().st_size
    if size > SPEC_FILE_BYTES:
        raise ValueError(f"{path} is {size} bytes; a run spec is at most {SPEC_FILE_BYTES} bytes.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).replace("\n", " ")
        raise ValueError(f"{path} is not a readable YAML run spec ({detail}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of run-spec fields.")
    stack, count = [data], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > SPEC_VALUES:
            raise ValueError(f"{path} holds more than {SPEC_VALUES} values once its YAML aliases are expanded; "
                             "a run spec is far smaller. Write the values out instead of nesting aliases.")
        if isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            stack += value
    return data


def read_records(path: Path, field: str) -> list[dict]:
    """A local JSON Lines file (one object per line) or JSON file (a list of objects); every problem
    is named by the spec field, the file and, where known, the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{field}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    by_line = path.suffix == ".jsonl" or text.lstrip().startswith("{")
    if by_line:
        lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    else:
        lines = [(1, text)] if text.strip() else []
    records = []
    for number, line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: {path} line {number + exc.lineno - 1} is not valid JSON ({exc.msg}).") from None
        values = [value] if by_line or not isinstance(value, list) else value
        for item in values:
            if not isinstance(item, dict):
                where = f"line {number}" if by_line else f"item {len(records)}"
                raise ValueError(f"{field}: {path} {where} is a JSON {type(item).__name__}, not an object; "
                                 "each item is an object such as {\"prompt\": ...}.")
            records.append(item)
    if not records:
        raise ValueError(f"{field}: {path} holds no items.")
    return records


ALLOWED_CALLABLES = "COMLRL_ALLOWED_CALLABLES"  # what a deployment's runs may import, beyond the project's own
OWN_CALLABLES = ("comlrl_core.environments:*", "comlrl_core.environments.*:*")


def check_allowed(reference: str, field: str) -> None:
    """In a deployment's flow run, where the spec is a parameter anyone allowed to trigger the
    deployment may set, import only the project's own task callables and the patterns
    (``fnmatch``, comma-separated) the deployment owner lists in ``COMLRL_ALLOWED_CALLABLES``. A
    run of one's own spec outside a deployment may import anything."""
    from prefect.runtime import deployment

    if deployment.id is None:
        return
    allowed = [*OWN_CALLABLES, *(p.strip() for p in os.environ.get(ALLOWED_CALLABLES, "").split(",") if p.strip())]
    if not any(fnmatch.fnmatchcase(reference, pattern) for pattern in allowed):
        raise ValueError(f"{field}={reference!r} is not allowed in a deployment run (allowed: {', '.join(allowed)}); "
                         f"the deployment's owner can add it to {ALLOWED_CALLABLES} in its job variables' env.")


def load_reference(reference: str, field: str) -> Any:
    """Import ``"package.module:attribute"`` (see :func:`check_allowed`); errors name the spec field and the fix."""
    if not isinstance(reference, str) or reference.count(":") != 1 or not all(reference.split(":")):
        raise ValueError(f"{field}={reference!r} must be an import string 'package.module:function'.")
    check_allowed(reference, field)
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
    """One of: ``builtin`` (a shipped task's data: ``split`` "train"/"eval"; the toy ``length_ratio``
    takes ``size``/``offset`` instead), ``file`` (local .json/.jsonl), or ``path`` for ``load_dataset``."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    builtin: str | None = None
    size: int | None = Field(None, ge=1, strict=True)  # strict: true or "6" is a mistake, not a count
    offset: int | None = Field(None, ge=0, strict=True)
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
        if self.builtin is not None:
            builtin(self.builtin)
            if self.builtin != "length_ratio" and (self.size, self.offset) != (None, None):
                raise ValueError(f"builtin={self.builtin!r} has splits, not size/offset: use split "
                                 "('train' or 'eval') and limit.")
        elif (self.size, self.offset) != (None, None):
            raise ValueError("size and offset belong to builtin: length_ratio; use limit to take fewer items.")
        if self.file is not None and not Path(self.file).expanduser().is_file():
            raise ValueError(f"file={self.file!r} does not exist.")
        return self

    def load(self, field: str = "dataset"):
        """The dataset (a list of dicts, or a ``datasets.Dataset``); ``field`` names it in errors."""
        import datasets

        if self.builtin == "length_ratio":  # its "eval" split: the topics after the default train ones
            offset = self.offset if self.offset is not None else 6 if self.split == "eval" else 0
            data = load_reference(builtin(self.builtin).dataset, "builtin")(self.size or 6, offset)
        elif self.builtin is not None:
            data = load_reference(builtin(self.builtin).dataset, "builtin")(self.split)
        elif self.file is not None:
            data = read_records(Path(self.file).expanduser(), f"{field}.file")
        else:
            path = Path(self.path).expanduser()
            script = next(path.glob("*.py"), None) if path.is_dir() else None
            if script is not None:  # a loading script: code this project never runs
                raise ValueError(f"{field}.path={self.path!r} holds a Python loading script ({script.name}), which "
                                 "is never run; give data files (JSON, JSONL, Parquet, CSV) instead.")
            data = datasets.load_dataset(self.path, self.name, split=self.split)
        if self.limit is not None:
            data = data[: self.limit] if isinstance(data, list) else data.select(range(min(self.limit, len(data))))
        return data


class TemplateSpec(BaseModel):
    """A prompt template (see :class:`comlrl_core.prompts.PromptTemplate`), as data."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    user: str
    system: str | None = None
    chat: bool = True

    @model_validator(mode="after")
    def _valid(self) -> TemplateSpec:
        self.template()
        return self

    def template(self) -> PromptTemplate:
        return PromptTemplate(self.user, self.system, self.chat)


_NO_URL_CREDENTIALS = {"pattern": NO_URL_CREDENTIALS}
_NO_SECRET_KEYS = {"propertyNames": {"not": {"enum": sorted(CREDENTIAL_KEYS)}}}


class RunSpec(BaseModel):
    """A pipeline run. ``config`` holds the trainer config fields (e.g. ``MAGRPOConfig``);
    ``init_from`` ("latest" or an export key) retrains from an earlier export's agents."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    # The JSON-schema half of the credential rule (see _no_credentials): a Prefect server checks a
    # deployment's parameters against it, so such a spec is refused before a flow run stores it.
    name: str = "comlrl-run"
    task: str | None = None  # a shipped task: fills in the data, reward and prompt templates not given
    algorithm: Literal["magrpo", "iac", "maac", "marlhf", "marlhf_iter"] = "magrpo"
    agent_model: str | None = Field(None, json_schema_extra=_NO_URL_CREDENTIALS)
    agents: list[str] | None = None
    num_agents: int | None = Field(None, ge=1, strict=True)
    tokenizers: list[str] | None = None
    critic_model: str | None = Field(None, json_schema_extra=_NO_URL_CREDENTIALS)
    critics: list[str] | None = None
    model_options: dict[str, Any] | None = Field(None, json_schema_extra=_NO_SECRET_KEYS)
    config: dict[str, Any] = Field(default_factory=dict, json_schema_extra=_NO_SECRET_KEYS)
    train_dataset: DatasetSpec = Field(default_factory=lambda: DatasetSpec(builtin="length_ratio"))
    eval_dataset: DatasetSpec | None = None
    reward_func: str = "comlrl_core.environments:length_ratio_reward"
    reward_processor: str | None = None
    formatters: str | list[str] | None = None
    prompt_templates: TemplateSpec | list[TemplateSpec] | None = None  # one for every agent, or one per agent
    external_transition: str | None = None
    stage_epochs: int = Field(1, ge=1, strict=True)
    checkpoint_steps: int | None = Field(None, ge=1, strict=True)
    num_processes: int = Field(1, ge=1, strict=True)  # >1: each training stage is an `accelerate launch` job
    storage: str = Field("./comlrl-runs", json_schema_extra=_NO_URL_CREDENTIALS)
    init_from: str | None = Field(None, json_schema_extra=_NO_URL_CREDENTIALS)
    wandb: dict[str, Any] | None = Field(None, json_schema_extra=_NO_SECRET_KEYS)

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        """A spec is stored with its flow run and shown in logs: a secret in it is refused, unechoed."""
        where = find_credentials(data, "")
        if where is not None:
            raise ValueError(f"{where}: a credential in a run spec is refused (the spec is stored with the flow run "
                             "and logged). Use the AWS credential chain or environment, WANDB_API_KEY or `wandb "
                             "login`, or a Prefect Secret block read by the worker.")
        return data

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:
        """``task: writing`` stands for its train/eval splits, reward, prompt templates and (with
        ``num_turns`` > 1 in ``config``) its transition; any of them given in the spec wins."""
        if not isinstance(data, dict) or data.get("task") is None:
            return data
        task = builtin(data["task"]) if isinstance(data["task"], str) else None
        if task is None:
            return data  # the field's own validation reports a task that is not a string
        defaults = {"train_dataset": {"builtin": data["task"], "split": "train"},
                    "eval_dataset": {"builtin": data["task"], "split": "eval", "limit": 16},
                    "reward_func": task.reward}
        if task.prompts is not None and data.get("formatters") is None:
            defaults["prompt_templates"] = [{"user": t.user, "system": t.system, "chat": t.chat} for t in task.prompts]
        turns = (data.get("config") or {}).get("num_turns", 1) if isinstance(data.get("config"), dict) else 1
        if task.transition is not None and turns != 1:
            defaults["external_transition"] = task.transition
        return {**defaults, **data}

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        from comlrl_core.storage import safe_key

        value = safe_key(value)
        for segment in value.split("/"):  # another run named by the prefix keeps these under its name
            if segment.lower() == "latest" or re.fullmatch(r"[0-9a-fA-F]{16}", segment):
                raise ValueError(f"name={value!r}: {segment!r} is reserved (each run keeps its LATEST pointer and its "
                                 "16-hex-digit spec directories under its name, so this name would write into "
                                 "another run's); choose another name.")
        return value

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        self.trainer_config()  # field names and values, checked by the config class itself
        load_reference(self.reward_func, "reward_func")
        for field in ("reward_processor", "external_transition"):
            if getattr(self, field) is not None:
                load_reference(getattr(self, field), field)
        if self.formatters is not None and self.prompt_templates is not None:
            raise ValueError("give formatters (Python callables) or prompt_templates, not both.")
        count = self.num_agents or self.config.get("num_agents") or (len(self.agents) if self.agents else None)
        if isinstance(self.prompt_templates, list) and count and len(self.prompt_templates) != count:
            raise ValueError(f"prompt_templates has {len(self.prompt_templates)} entries for {count} agents; give "
                             "one per agent, or a single template (a mapping) for every agent.")
        refs = [self.formatters] if isinstance(self.formatters, str) else (self.formatters or [])
        for i, ref in enumerate(refs):
            load_reference(ref, f"formatters[{i}]" if isinstance(self.formatters, list) else "formatters")
        if self.agent_model is None and self.agents is None:
            raise ValueError("give agent_model (one id or directory for every agent) or agents (one per agent); "
                             "with init_from they are the starting point until a first export exists.")
        if self.algorithm == "magrpo" and (self.critic_model is not None or self.critics is not None):
            # build_trainer would drop them silently: MAGRPOTrainer takes no critic.
            raise ValueError("critic_model and critics must be unset for algorithm='magrpo', which has no critic.")
        stages = self.planned_stages()
        if stages > MAX_STAGES:
            raise ValueError(f"config.num_train_epochs / stage_epochs (or num_iterations) plan {stages} pipeline "
                             f"stages; at most {MAX_STAGES} fit in a flow run: raise stage_epochs or train less.")
        if self.init_from not in (None, "latest"):
            from comlrl_core.storage import safe_key

            try:
                self.init_from = safe_key(self.init_from)
            except ValueError as exc:
                raise ValueError(f"init_from: {exc}") from None
        return self

    def planned_stages(self) -> int:
        """How many stages the pipeline plans for this spec, counted without listing them."""
        config = self.trainer_config()
        if self.algorithm == "marlhf_iter":
            return 3 * config.num_iterations
        return -(-config.num_train_epochs // self.stage_epochs) + (2 if self.algorithm == "marlhf" else 0)

    def check_storage(self) -> None:
        """Refuse a local ``storage`` that cannot hold the run's directories (a file in the way, or
        no permission to write) on the machine that runs it, before any model loads; an S3 URI is
        checked by its first request."""
        if self.storage.startswith("s3://"):
            return
        path = Path(self.storage).expanduser().absolute()
        existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
        if not existing.is_dir():
            raise ValueError(f"storage={self.storage!r}: {existing} is a file, not a directory; give a directory "
                             "(it is created when missing).")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"storage={self.storage!r}: {existing} is not writable by this user; give a directory "
                             "you can write to.")

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
        kwargs = dict(
            agent_model=None if initial_agents else self.agent_model, agents=initial_agents or self.agents,
            tokenizer=self.load_tokenizers(),
            model_config=self.model_options, train_dataset=self.train_dataset.load("train_dataset"),
            eval_dataset=self.eval_dataset.load("eval_dataset") if self.eval_dataset else None,
            reward_func=load_reference(self.reward_func, "reward_func"),
            reward_processor=load_reference(self.reward_processor, "reward_processor") if self.reward_processor else None,
            formatters=self.formatter_objects(),
            external_transition=(load_reference(self.external_transition, "external_transition")
                                 if self.external_transition else None),
            wandb_config=self.wandb, args=args,
        )
        if self.algorithm in ("iac", "maac", "marlhf", "marlhf_iter"):
            kwargs.update(critic_model=self.critic_model, critics=self.critics)
        if self.num_agents is not None:
            kwargs["num_agents"] = self.num_agents
        return trainer_class(**kwargs)

    def formatter_objects(self):
        """What the trainer's ``formatters`` argument gets: the templates, or the imported callables."""
        if isinstance(self.prompt_templates, TemplateSpec):
            return self.prompt_templates.template()
        if self.prompt_templates is not None:
            return [t.template() for t in self.prompt_templates]
        if isinstance(self.formatters, str):
            return load_reference(self.formatters, "formatters")
        if isinstance(self.formatters, list):
            return [load_reference(f, f"formatters[{i}]") for i, f in enumerate(self.formatters)]
        return None

    def load_tokenizers(self):
        """The spec's tokenizers (ids or directories), or None to let the trainer load them."""
        if self.tokenizers is None:
            return None
        from comlrl_core.entities.loading import trusts_remote_code
        from comlrl_core.entities.tokenizers import load_tokenizer

        trust = trusts_remote_code(self.model_options)
        return [load_tokenizer(t, f"tokenizers[{i}]", trust) for i, t in enumerate(self.tokenizers)]

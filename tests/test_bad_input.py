"""Bad input (issue 8): property-based tests over run specs, trainer configs, trainer arguments and reward functions.

Every bad value must be refused with a ``ValueError``/``TypeError`` (pydantic's ``ValidationError``
is a ``ValueError``) whose message names the field, before any model loads. Trainers are built on
*weightless* copies of the tiny models (config and tokenizer files only), so a check that let a bad
value through to the weights would fail with a different error (an ``OSError``: no weights file).
Reward-function faults can only surface in ``train()``: they must fail on the first call, name
``reward_func`` (or ``reward_processor``), and leave no checkpoint behind.
"""

import dataclasses
import itertools
import math
import shutil
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_core.trainers.preference import MARLHFConfig, MARLHFIterConfig, MARLHFTrainer
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from flows.cli import demo_spec
from tasks.spec import ALGORITHMS, RunSpec


def examples(n: int, seconds: float = 5):
    """Few, deterministic examples (CI-stable); the deadline turns a slow or stuck example into a failure."""
    return settings(max_examples=n, deadline=timedelta(seconds=seconds), derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def refused(build, names):
    """``build()`` must raise a ValueError/TypeError naming one of ``names``; returns the message."""
    try:
        result = build()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert any(name in message for name in names), f"the error does not name {names}: {message}"
        assert "could not load model" not in message, f"refused only when loading weights: {message}"
        return message
    raise AssertionError(f"accepted bad input for {names}: built {type(result).__name__}")


@pytest.fixture(scope="module")
def weightless(tiny_models, tmp_path_factory):
    """Copies of the tiny model dirs without their weights, plus a dir without tokenizer files and an empty dir."""
    root = tmp_path_factory.mktemp("weightless")
    dirs = {name: root / name for name in ("qwen2-tiny", "llama-tiny")}
    for name, target in dirs.items():
        shutil.copytree(tiny_models[name], target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    shutil.copytree(dirs["qwen2-tiny"], root / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer*"))
    (root / "empty").mkdir()
    return {**{k: str(v) for k, v in dirs.items()}, "no-tokenizer": str(root / "no-tokenizer"),
            "empty": str(root / "empty"), "missing": str(root / "does-not-exist")}


# ---- value strategies ----------------------------------------------------------------------------

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
WRONG_TYPES = st.sampled_from(["3", b"3", [], [1], {}, {"a": 1}, object(), (1,)])
NOT_INT = st.one_of(st.booleans(), NON_FINITE, st.floats(0.1, 10).filter(lambda x: x != int(x)), WRONG_TYPES)
NOT_POSITIVE = st.integers(max_value=0)
NOT_NUMBER = st.one_of(st.booleans(), WRONG_TYPES)
NAME = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


def missing_paths(weightless):
    """Local paths that do not exist (or are not model/tokenizer dirs)."""
    return st.one_of(NAME.map(lambda n: f"{weightless['missing']}/{n}"), st.just(weightless["empty"]),
                     NAME.map(lambda n: f"./no-such-dir-{n}"), st.just(""))


# ---- trainer configs: every field of every config class -----------------------------------------

CONFIGS = (MAGRPOConfig, IACConfig, MAACConfig, MARLHFConfig, MARLHFIterConfig)
# Sizes and counts: zero is as wrong as a negative (eval_interval, eval_num_samples and seed may be 0).
ZERO_IS_BAD = {"num_train_epochs", "num_agents", "num_generations", "max_new_tokens", "top_k", "num_turns",
               "rollout_buffer_size", "train_batch_size", "logging_steps", "preference_num_candidates",
               "preference_pairs_per_sample", "reward_num_train_epochs", "reward_train_batch_size",
               "reward_max_length", "value_head_hidden_dim", "critic_value_head_hidden_dim", "num_iterations"}
# Rates and coefficients: > 0 (or >= 0 where zero turns a term off); a threshold may be any finite number.
POSITIVE_FLOATS = {"agent_learning_rate", "critic_learning_rate", "reward_learning_rate", "temperature", "top_p",
                   "max_grad_norm", "value_loss_coef", "value_clip_range"}
SIGNED_FLOATS = {"early_termination_threshold"}
CHOICES = {"joint_mode", "advantage_mode", "critic_type", "pair_selection", "rl_algorithm"}
DEVICE_FIELDS = {"reward_model_device"}  # checked when the trainer resolves devices (see the trainer test)
DEVICE_SETTINGS = {"agent_devices", "critic_devices", "reference_devices"}  # their form is checked by the config
VALID_DEVICE_NAMES = {"cpu", "cuda", "mps", "auto"}


def bad_config_value(field: dataclasses.Field) -> st.SearchStrategy:
    kind, optional = field.type.replace(" | None", ""), field.type.endswith("| None")
    none = st.nothing() if optional else st.none()
    if kind == "int":
        low = NOT_POSITIVE if field.name in ZERO_IS_BAD else st.integers(max_value=-1)
        return st.one_of(low, NOT_INT, none)
    if kind == "float":
        low = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False) if field.name in POSITIVE_FLOATS \
            else st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
        return st.one_of(NON_FINITE, NOT_NUMBER, none, st.nothing() if field.name in SIGNED_FLOATS else low)
    if kind == "bool":
        return st.one_of(st.integers(0, 1), st.sampled_from(["yes", "False", None, []]))
    if field.name in DEVICE_SETTINGS:
        return st.one_of(NAME.filter(lambda n: n not in VALID_DEVICE_NAMES), st.integers(), NON_FINITE,
                         st.sampled_from([True, [], {}, ["gpu0"], ["cpu", 3], ["auto"], "cuda:-1", b"cpu"]))
    if field.name in CHOICES:
        return st.one_of(NAME.map(lambda n: f"no-{n}"), st.integers(), st.sampled_from([None, [], {}, ["mean"]]))
    assert kind == "str", f"{field.name}: no bad values for type {field.type}; add them here"
    return st.one_of(st.just(""), st.integers(), st.sampled_from([[], {}, ["x"]]))


def config_fields():
    return [(cls, f) for cls in CONFIGS for f in dataclasses.fields(cls) if f.name not in DEVICE_FIELDS]


def test_every_config_field_refuses_wrong_types_sizes_and_non_finite_values():
    cases = config_fields()
    count = 0

    @examples(25)
    @given(st.data())
    def check(data):
        nonlocal count
        for cls, field in cases:
            value = data.draw(bad_config_value(field), label=f"{cls.__name__}.{field.name}")
            refused(lambda: cls(**{field.name: value}), [f"{cls.__name__}.{field.name}"])
            count += 1

    check()
    print(f"bad-input: {count} bad config values over {len(cases)} fields of {len(CONFIGS)} config classes "
          "refused naming the field, 0 accepted")
    assert count >= 20 * len(cases)


# ---- trainer arguments, on weightless models ------------------------------------------------------

def small(config_class, **overrides):
    base = dict(num_agents=2, num_train_epochs=1, max_new_tokens=4, num_generations=2, rollout_buffer_size=1,
                verbose=False)
    if config_class is MARLHFConfig:
        base.update(reward_model_device=None, preference_num_candidates=4, preference_pairs_per_sample=2)
    return config_class(**{**base, **overrides})


TRAINERS = {
    "magrpo": (MAGRPOTrainer, MAGRPOConfig, False),  # (class, config class, has critics)
    "iac": (IACTrainer, IACConfig, True),
    "maac": (MAACTrainer, MAACConfig, True),
    "marlhf": (MARLHFTrainer, MARLHFConfig, False),
}


def base_kwargs(kind: str, models: dict) -> dict:
    trainer_class, config_class, critics = TRAINERS[kind]
    kwargs = dict(agent_model=models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                  train_dataset=length_ratio_dataset(2), args=small(config_class))
    if critics:
        kwargs["critic_model"] = models["llama-tiny"]
    return kwargs


# Reward functions with the wrong number of completion parameters for two agents.
WRONG_ARITY = st.sampled_from([lambda a: [0.0] * len(a), lambda a, b, c: [0.0] * len(a), lambda: [0.0]])


@st.composite
def bad_trainer_argument(draw, kind: str, models: dict):
    """``(argument, constructor-argument changes)``: one bad argument, which the error must name."""
    _, config_class, critics = TRAINERS[kind]
    q = models["qwen2-tiny"]
    path = missing_paths(models)
    options = {
        "agent_model": st.one_of(path, st.just(models["no-tokenizer"]), st.integers(), st.sampled_from([[q], 1.5])
                                 ).map(lambda v: {"agent_model": v}),
        "agents": st.one_of(
            st.just([]), st.just(q), st.integers(1, 4).filter(lambda n: n != 2).map(lambda n: [q] * n),
            path.map(lambda p: [q, p]), st.just([q, 3])).map(lambda v: {"agent_model": None, "agents": v}),
        "num_agents": st.one_of(NOT_POSITIVE, NOT_INT, st.integers(3, 6)).map(lambda v: {"num_agents": v}),
        "tokenizer": st.one_of(st.just([]), st.integers(1, 4).filter(lambda n: n != 2).map(lambda n: [q] * n),
                               path, path.map(lambda p: [p, p]), st.just(models["no-tokenizer"]),
                               st.sampled_from([3, [3, 3], {"a": 1}])).map(lambda v: {"tokenizer": v}),
        "reward_func": st.one_of(st.sampled_from([None, "comlrl_core.environments:length_ratio_reward", 3]),
                                 WRONG_ARITY).map(lambda v: {"reward_func": v}),
        "reward_processor": st.sampled_from([3, "abs", [abs]]).map(lambda v: {"reward_processor": v}),
        "formatters": st.one_of(st.just([]), st.integers(1, 4).filter(lambda n: n != 2).map(lambda n: [str] * n),
                                st.sampled_from([3, "prompt", [str, 3]])).map(lambda v: {"formatters": v}),
        "train_dataset": st.one_of(st.sampled_from([[], "text", {"prompt": "x"}, 5, [["prompt"]]]),
                                   st.integers(0, 2).map(lambda i: [{"prompt": "x"}] * i + [7] + [{"prompt": "y"}])
                                   ).map(lambda v: {"train_dataset": v}),
        "eval_dataset": st.sampled_from([[], "text", {"prompt": "x"}, 5, [{"prompt": "x"}, None]]).map(
            lambda v: {"eval_dataset": v}),
        "model_config": st.one_of(NAME.map(lambda n: {f"bogus_{n}": 1}), st.sampled_from(
            [[], "bf16", {"dtype": "float64"}, {"dtype": 3}, {"torch_dtype": []}, {"model_kwargs": 3},
             {"critic_value_head_hidden_dim": 0}])).map(lambda v: {"model_config": v}),
        "wandb_config": st.one_of(NAME.map(lambda n: {f"bogus_{n}": 1}), st.sampled_from([[], "project"])).map(
            lambda v: {"wandb_config": v}),
        "external_transition": st.sampled_from([3, "mod:func"]).map(lambda v: {"external_transition": v}),
        "args": st.sampled_from([{}, "magrpo", small(MAGRPOConfig) if config_class is not MAGRPOConfig
                                 else small(IACConfig)]).map(lambda v: {"args": v}),
    }
    if config_class is not MARLHFConfig:  # preference learning is single-turn
        options["external_transition"] = st.one_of(options["external_transition"], st.just(
            {"args": small(config_class, num_turns=2, num_generations=1 if critics else 2)}))
    if critics:
        options["critic_model"] = st.one_of(path, st.integers()).map(lambda v: {"critic_model": v})
        options["critics"] = st.one_of(
            st.just([]), st.integers(3, 4).map(lambda n: [models["llama-tiny"]] * n), path.map(lambda p: [p, p])
        ).map(lambda v: {"critic_model": None, "critics": v})
    if config_class is MARLHFConfig:
        device = st.one_of(NAME.filter(lambda n: n not in ("cpu", "auto")), NON_FINITE, st.sampled_from([True, -1, "cuda:99"]))
        options["reward_model_device"] = device.map(lambda v: {"args": small(MARLHFConfig, reward_model_device=v)})
        options["reward_model_name"] = path.filter(bool).map(
            lambda p: {"args": small(MARLHFConfig, reward_model_name=p)})
    argument = draw(st.sampled_from(sorted(options)))
    return argument, draw(options[argument])


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_bad_trainer_arguments_are_refused_before_any_weights_load(weightless, kind):
    trainer_class = TRAINERS[kind][0]
    # The valid construction reaches the weights (and fails there): the trick can see a late refusal.
    with pytest.raises(OSError, match="could not load model"):
        trainer_class(**base_kwargs(kind, weightless))
    seen: dict[str, int] = {}

    @examples(80)
    @given(bad_trainer_argument(kind, weightless))
    def check(case):
        argument, changes = case
        refused(lambda: trainer_class(**{**base_kwargs(kind, weightless), **changes}), [argument])
        seen[argument] = seen.get(argument, 0) + 1

    check()
    print(f"bad-input: {trainer_class.__name__}: {sum(seen.values())} bad constructor arguments ({len(seen)} "
          "arguments) refused naming the argument before any weights loaded, 0 accepted")
    assert len(seen) >= 12


# ---- run specs --------------------------------------------------------------------------------------

def spec_data(models: dict, tmp_path: Path, algorithm: str) -> dict:
    data = demo_spec(algorithm, {k: Path(v) for k, v in models.items()}, str(tmp_path / "runs"))
    data["config"].update(num_train_epochs=1, max_new_tokens=4, eval_interval=0)
    return data


@st.composite
def bad_reference(draw):
    """Import strings that cannot give a callable: no module, no attribute, not callable, malformed."""
    name = draw(NAME)
    return draw(st.sampled_from([
        f"no_such_module_{name}:f", f"comlrl_core.no_such_{name}:f", f"comlrl_core.environments:no_{name}",
        "comlrl_core.environments:TOPICS", name, f"{name}:{name}:{name}", f":{name}", f"{name}:", ":",
        f".{name}:f", f"comlrl_core.environments.{name}", f"os.path:{name}",
    ]))


@st.composite
def bad_spec_change(draw, models: dict, algorithm: str):
    """``(names the error must mention, spec changes)``; ``config`` changes are merged into the config."""
    q = models["qwen2-tiny"]
    path = missing_paths(models)
    config_class = ALGORITHMS[algorithm][1]
    fields = {f.name: f for f in dataclasses.fields(config_class) if f.name not in DEVICE_FIELDS}
    options = {
        "algorithm": st.one_of(NAME.map(lambda n: f"no-{n}"), st.integers()).map(lambda v: {"algorithm": v}),
        "name": st.sampled_from(["", "../escape", "a/../../b"]).map(lambda v: {"name": v}),
        "num_agents": st.one_of(  # alone (a coerced True would be one agent), or disagreeing with the config
            st.one_of(NOT_POSITIVE, NOT_INT).map(lambda v: {"num_agents": v, "config": {"num_agents": None}}),
            st.integers(3, 5).map(lambda v: {"num_agents": v})),
        "stage_epochs": st.one_of(NOT_POSITIVE, NOT_INT).map(lambda v: {"stage_epochs": v}),
        "checkpoint_steps": st.one_of(NOT_POSITIVE, NOT_INT).map(lambda v: {"checkpoint_steps": v}),
        "train_dataset": st.one_of(
            st.builds(lambda v: {"builtin": "length_ratio", "size": v}, st.one_of(NOT_POSITIVE, NOT_INT)),
            path.filter(bool).map(lambda p: {"file": p + ".jsonl"}),
            st.sampled_from([{}, {"builtin": "nope"}, {"builtin": "length_ratio", "path": "x"}, "length_ratio", []]),
        ).map(lambda v: {"train_dataset": v}),
        "eval_dataset": st.sampled_from([{}, {"builtin": "length_ratio", "offset": -1}, {"builtin": "length_ratio",
                                         "limit": 0}, [1]]).map(lambda v: {"eval_dataset": v}),
        "reward_func": st.one_of(bad_reference(), st.just("os:getcwd"), st.integers()).map(
            lambda v: {"reward_func": v}),
        "reward_processor": bad_reference().map(lambda v: {"reward_processor": v}),
        "external_transition": bad_reference().map(lambda v: {"external_transition": v}),
        "formatters": st.one_of(bad_reference(), bad_reference().map(lambda r: [r]), st.just([]),
                                st.just(["comlrl_core.environments:length_ratio_reward"] * 3)).map(
            lambda v: {"formatters": v}),
        "agent_model": st.one_of(path, st.just(models["no-tokenizer"]), st.integers(), st.just([q])).map(
            lambda v: {"agent_model": v}),
        "agents": st.one_of(st.just([]), st.just(q), st.integers(1, 4).filter(lambda n: n != 2).map(
            lambda n: [q] * n), path.map(lambda p: [q, p])).map(lambda v: {"agent_model": None, "agents": v}),
        "tokenizers": st.one_of(st.just([]), st.integers(1, 4).filter(lambda n: n != 2).map(lambda n: [q] * n),
                                path.map(lambda p: [p, p]), st.just([models["no-tokenizer"]] * 2), st.just(q)).map(
            lambda v: {"tokenizers": v}),
        "model_options": st.one_of(NAME.map(lambda n: {f"bogus_{n}": 1}), st.sampled_from(
            [{"dtype": "float64"}, {"dtype": 3}, [1]])).map(lambda v: {"model_options": v}),
        "wandb": st.one_of(NAME.map(lambda n: {f"bogus_{n}": 1}), st.just([1])).map(lambda v: {"wandb": v}),
        "unknown field": NAME.map(lambda n: {f"zz_{n}": 1}),
        "config": st.sampled_from(sorted(fields)).flatmap(
            lambda f: bad_config_value(fields[f]).map(lambda v: {"config": {f: v}})),
        "unknown config key": NAME.map(lambda n: {"config": {f"zz_{n}": 1}}),
    }
    if algorithm == "magrpo":
        options["critic_model"] = st.just({"critic_model": models["llama-tiny"]})
    else:
        options["critic_model"] = st.one_of(path, st.integers()).map(lambda v: {"critic_model": v})
        options["critics"] = st.one_of(st.just([]), st.integers(3, 4).map(lambda n: [models["llama-tiny"]] * n),
                                       path.map(lambda p: [p, p])).map(lambda v: {"critic_model": None, "critics": v})
    argument = draw(st.sampled_from(sorted(options)))
    changes = draw(options[argument])
    if argument == "unknown field":
        names = list(changes)
    elif argument in ("config", "unknown config key"):
        names = list(changes["config"])
    else:  # a spec field may be named by the trainer argument it feeds
        names = {"tokenizers": ["tokenizer"], "model_options": ["model_options", "model_config"]}.get(
            argument, [argument])
    return names, changes


@pytest.mark.parametrize("algorithm", ["magrpo", "iac"])
def test_bad_specs_are_refused_naming_the_field_before_any_weights_load(weightless, tmp_path, algorithm):
    base = spec_data(weightless, tmp_path, algorithm)
    with pytest.raises(OSError, match="could not load model"):  # a valid spec reaches the weights
        RunSpec(**base).build_trainer()
    at_spec, at_build = 0, 0

    @examples(100)
    @given(bad_spec_change(weightless, algorithm))
    def check(case):
        nonlocal at_spec, at_build
        names, changes = case
        data = {**base, **changes, "config": {**base["config"], **changes.get("config", {})}}
        try:
            spec = RunSpec(**data)
        except (ValueError, TypeError):
            refused(lambda: RunSpec(**data), names)
            at_spec += 1
            return
        refused(spec.build_trainer, names)  # the trainer's own checks, still before any weights
        at_build += 1

    check()
    print(f"bad-input: {algorithm} specs: {at_spec} refused by the spec, {at_build} by the trainer's checks "
          "before any weights loaded, 0 accepted")
    assert at_spec >= 40 and at_build >= 15


# ---- reward functions that misbehave, during train() ------------------------------------------------

@st.composite
def bad_reward(draw):
    """``(kind, reward_func, reward_processor, the user's own exception type or None)``."""
    kind = draw(st.sampled_from(["raises", "wrong shape", "non-finite", "not numbers", "processor"]))
    if kind == "raises":
        error = draw(st.sampled_from([ValueError, KeyError, ZeroDivisionError, RuntimeError, IndexError]))

        def func(a, b):
            raise error("boom")
        return kind, func, None, error
    if kind == "wrong shape":
        delta = draw(st.sampled_from([-1, 1, 2]))
        return kind, draw(st.sampled_from([
            lambda a, b: [0.5] * (len(a) + delta), lambda a, b: torch.zeros(len(a), 2),
            lambda a, b: np.zeros((len(a) + delta,)), lambda a, b: {i: 0.5 for i in range(len(a))}])), None, None
    if kind == "non-finite":
        value = draw(NON_FINITE)
        wrap = draw(st.sampled_from([list, tuple, np.array, torch.tensor]))
        return kind, lambda a, b: wrap([0.0] * (len(a) - 1) + [value]), None, None
    if kind == "not numbers":
        if draw(st.booleans()):
            value = draw(st.sampled_from(["x", None, "0.5", object()]))
            return kind, lambda a, b: value, None, None
        value = draw(st.sampled_from(["x", None, [1.0, 2.0], {}, object()]))
        return kind, lambda a, b: [value] * len(a), None, None
    processor, error = draw(st.sampled_from([(lambda r: math.nan, None), (lambda r: "high", None),
                                             (lambda r: None, None), (lambda r: r * math.inf, None),
                                             (lambda r: r / 0, ZeroDivisionError)]))
    return kind, length_ratio_reward, processor, error


def rendered(exc: BaseException) -> str:
    """The error as a user sees it: type, message and notes."""
    return "".join(traceback.format_exception_only(exc))


def test_misbehaving_reward_functions_fail_on_the_first_call_and_leave_no_checkpoint(tiny_models, tmp_path):
    counts: dict[str, int] = {}
    runs = itertools.count()

    @examples(40, seconds=30)
    @given(st.sampled_from(sorted(TRAINERS)), bad_reward())
    def check(trainer_kind, case):
        kind, func, processor, raised = case
        calls = []

        def reward(a, b):
            calls.append(len(a))
            return func(a, b)

        kwargs = {**base_kwargs(trainer_kind, tiny_models), "reward_func": reward, "reward_processor": processor}
        trainer = TRAINERS[trainer_kind][0](**kwargs)
        checkpoints = tmp_path / f"run-{next(runs)}"
        with pytest.raises(Exception) as info:
            trainer.train(checkpoint_dir=checkpoints, checkpoint_steps=1)
        exc = info.value
        text = rendered(exc)
        where = Path(traceback.extract_tb(exc.__traceback__)[-1].filename).name
        named = "reward_processor" if processor else "reward_func"
        if raised is not None:  # the user's own error: its type kept, a note naming the function
            assert type(exc) is raised and named in text and where == Path(__file__).name, (where, text)
        else:  # refused by the reward check itself, not deep inside torch
            assert isinstance(exc, (ValueError, TypeError, FloatingPointError)) and named in text, text
            assert where == "rewards.py", (where, text)
        assert len(calls) == 1, f"reward_func called {len(calls)} times before failing"
        leftovers = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
        assert leftovers == [], f"partial output left behind: {leftovers}"
        counts[kind] = counts.get(kind, 0) + 1

    check()
    total = sum(counts.values())
    print(f"bad-input: {total} misbehaving reward functions ({counts}) failed on their first call naming "
          "reward_func/reward_processor, 0 checkpoints left behind")
    assert len(counts) == 5

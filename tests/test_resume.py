"""Training checkpoints: exact resume (epoch and step), refusals, corruption, metadata and W&B identity."""

import json
import shutil

import pytest
import torch

from comlrl_core.checkpoint import CheckpointError, verify_dir
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl_core.utils import read_checkpoint_metadata
from helpers import damage_consistently


class CountingReward:
    """A stateful reward function: its call count is checkpointed and restored."""

    def __init__(self):
        self.calls = 0

    def __call__(self, answers, summaries):
        self.calls += 1
        return length_ratio_reward(answers, summaries)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def make(tiny_models, agent="qwen2-tiny", data=None, reward=None, tokenizer=None, wandb_config=None, **overrides):
    config = dict(num_train_epochs=3, max_new_tokens=6, num_generations=3, agent_learning_rate=1e-2,
                  rollout_buffer_size=2, verbose=False)
    return MAGRPOTrainer(agent_model=tiny_models[agent], num_agents=2, tokenizer=tokenizer,
                         reward_func=reward or length_ratio_reward, wandb_config=wandb_config,
                         train_dataset=data or length_ratio_dataset(3), args=MAGRPOConfig(**{**config, **overrides}))


def weights(trainer):
    return [{k: v.clone() for k, v in a.state_dict().items()} for a in trainer.agents]


def identical(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


@pytest.fixture()
def full_run(tiny_models, tmp_path):
    """An uninterrupted 3-epoch run that checkpoints after every item and every epoch."""
    trainer = make(tiny_models)
    trainer.train(checkpoint_dir=tmp_path / "ck", checkpoint_steps=1)
    return trainer, tmp_path / "ck"


def test_checkpoint_layout_and_metadata(full_run):
    trainer, ck = full_run
    names = sorted(p.name for p in ck.iterdir())
    assert names == sorted(f"checkpoint-{n}" for n in range(1, 10))
    files = sorted(p.relative_to(ck / "checkpoint-3").as_posix() for p in (ck / "checkpoint-3").rglob("*") if p.is_file())
    assert files == ["agents/0.safetensors", "agents/1.safetensors", "checkpoint.json", "manifest.json", "state.pt"]
    meta = read_checkpoint_metadata(ck / "checkpoint-3")
    assert set(meta) == {"version", "trainer_class", "sequence", "run_id", "wandb"}
    assert meta["sequence"] == 3 and meta["wandb"] is None and meta["run_id"] == trainer.run_id
    assert meta["trainer_class"] == "comlrl_core.trainers.reinforce.magrpo.MAGRPOTrainer"
    progress = json.loads((ck / "checkpoint-2" / "checkpoint.json").read_text())["progress"]
    assert progress["epoch"] == 0 and progress["index"] == 2  # a mid-epoch (step) checkpoint


def test_resume_from_every_checkpoint_is_bit_identical(tiny_models, full_run):
    trainer, ck = full_run
    final = weights(trainer)
    rewards = [h.get("turn_1/reward_mean") for h in trainer.history]
    for sequence in range(1, 10):
        resumed = make(tiny_models)
        resumed.train(resume_from_checkpoint=ck / f"checkpoint-{sequence}")
        assert identical(final, weights(resumed)), f"checkpoint-{sequence}"
        assert [h.get("turn_1/reward_mean") for h in resumed.history] == rewards
        assert resumed.run_id == trainer.run_id


def test_resume_writes_on_into_the_same_directory(tiny_models, full_run):
    trainer, ck = full_run
    resumed = make(tiny_models)
    resumed.train(resume_from_checkpoint=ck / "checkpoint-4", checkpoint_dir=ck, checkpoint_steps=1)
    assert identical(weights(trainer), weights(resumed))
    assert read_checkpoint_metadata(ck / "checkpoint-9")["run_id"] == trainer.run_id


def test_totals_count_the_whole_run(tiny_models, full_run, tmp_path):
    trainer, ck = full_run
    same = make(tiny_models)
    same.train(resume_from_checkpoint=ck / "checkpoint-9")  # num_train_epochs equal: nothing to do
    assert identical(weights(trainer), weights(same)) and same.progress.items_done == 9
    more = make(tiny_models, num_train_epochs=4)
    more.train(resume_from_checkpoint=ck / "checkpoint-9", checkpoint_dir=ck)
    assert more.progress.epoch == 4 and (ck / "checkpoint-10").is_dir()
    straight = make(tiny_models, num_train_epochs=4)
    straight.train()
    assert identical(weights(more), weights(straight))  # raising the total == training longer in one go
    fewer = make(tiny_models, num_train_epochs=2)
    with pytest.raises(ValueError, match="num_train_epochs counts the whole run"):
        fewer.train(resume_from_checkpoint=ck / "checkpoint-9")


@pytest.mark.parametrize("change, message", [
    (dict(agent_learning_rate=5e-3), "agent_learning_rate: checkpoint 0.01 != now 0.005"),
    (dict(num_generations=4), "num_generations"),
    (dict(data=length_ratio_dataset(3, offset=1)), "train_dataset"),
    (dict(agent="qwen2-small"), r"agents\[0\] \(architecture"),
    (dict(reward=CountingReward()), "stateful callbacks"),
])
def test_incompatible_resume_is_refused_naming_the_field(tiny_models, full_run, change, message):
    with pytest.raises(CheckpointError, match=message):
        make(tiny_models, **change).train(resume_from_checkpoint=full_run[1] / "checkpoint-3")


def test_changed_tokenizer_is_refused(tiny_models, full_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2-tiny"])
    tokenizer.padding_side = "left"
    with pytest.raises(CheckpointError, match="tokenizer 0"):
        make(tiny_models, tokenizer=tokenizer).train(resume_from_checkpoint=full_run[1] / "checkpoint-3")


def test_portable_fields_may_change(tiny_models, full_run):
    resumed = make(tiny_models, logging_steps=5, eval_interval=0, verbose=True)
    resumed.train(resume_from_checkpoint=full_run[1] / "checkpoint-3")
    assert identical(weights(full_run[0]), weights(resumed))


def test_other_trainer_class_is_refused(tiny_models, full_run):
    class OtherTrainer(MAGRPOTrainer):
        pass

    other = OtherTrainer(agent_model=tiny_models["qwen2-tiny"], reward_func=length_ratio_reward,
                         train_dataset=length_ratio_dataset(3), args=make(tiny_models).args)
    with pytest.raises(CheckpointError, match="was written by .*MAGRPOTrainer, not .*OtherTrainer"):
        other.train(resume_from_checkpoint=full_run[1] / "checkpoint-3")


def test_corrupted_or_truncated_checkpoints_are_refused(tiny_models, full_run, tmp_path):
    ck = full_run[1]
    flipped = tmp_path / "flipped"
    shutil.copytree(ck / "checkpoint-3", flipped)
    data = bytearray((flipped / "agents" / "0.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (flipped / "agents" / "0.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"agents/0\.safetensors"):
        make(tiny_models).train(resume_from_checkpoint=flipped)
    truncated = tmp_path / "truncated"
    shutil.copytree(ck / "checkpoint-3", truncated)
    with open(truncated / "state.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"state\.pt"):
        make(tiny_models).train(resume_from_checkpoint=truncated)


def test_latest_skips_a_corrupt_newest_checkpoint(tiny_models, full_run):
    trainer, ck = full_run
    (ck / "checkpoint-9" / "state.pt").write_bytes(b"garbage")
    resumed = make(tiny_models)
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=ck)
    assert identical(weights(trainer), weights(resumed))  # resumed from checkpoint-8, replayed the rest
    with pytest.raises(ValueError, match="'latest' needs checkpoint_dir"):
        make(tiny_models).train(resume_from_checkpoint="latest")


@pytest.mark.parametrize("how", ["truncated-weights", "foreign-state"])
def test_latest_skips_a_newest_checkpoint_that_verifies_but_does_not_load(tiny_models, full_run, tmp_path, how):
    trainer, ck = full_run
    damage_consistently(ck / "checkpoint-9", how)
    verify_dir(ck / "checkpoint-9")  # its manifest matches its (damaged) files
    with pytest.raises(CheckpointError, match=r"checkpoint-9/(agents/0\.safetensors|state\.pt)"):
        make(tiny_models).train(resume_from_checkpoint=ck / "checkpoint-9")
    resumed = make(tiny_models)
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=ck)
    assert identical(weights(trainer), weights(resumed))  # from checkpoint-8


def test_a_fresh_run_never_overwrites_another_runs_checkpoints(tiny_models, full_run):
    with pytest.raises(FileExistsError, match="of another run"):
        make(tiny_models).train(checkpoint_dir=full_run[1])


def test_interval_and_total_limit(tiny_models, tmp_path):
    trainer = make(tiny_models, num_train_epochs=5)
    trainer.train(checkpoint_dir=tmp_path / "ck", checkpoint_interval=2, checkpoint_total_limit=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint-4", "checkpoint-5"]


def test_no_checkpoint_options_write_nothing(tiny_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make(tiny_models, num_train_epochs=1).train()
    assert list(tmp_path.iterdir()) == []


def test_stateful_callbacks_are_restored(tiny_models, tmp_path):
    reward = CountingReward()
    make(tiny_models, reward=reward).train(checkpoint_dir=tmp_path / "ck")
    assert reward.calls == 9
    resumed_reward = CountingReward()
    make(tiny_models, reward=resumed_reward).train(resume_from_checkpoint=tmp_path / "ck" / "checkpoint-2")
    assert resumed_reward.calls == 9


def test_wandb_offline_identity_survives_resume(tiny_models, tmp_path):
    wandb_config = {"project": "comlrl-tests", "dir": str(tmp_path / "wandb"), "mode": "offline"}
    first = make(tiny_models, wandb_config=wandb_config, num_train_epochs=2)
    first.train(checkpoint_dir=tmp_path / "ck")
    checkpoint = tmp_path / "ck" / "checkpoint-1"
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    assert identity["id"] and identity["project"] == "comlrl-tests"

    # The seed's snippet, as written.
    if identity and "id" not in wandb_config and "resume" not in wandb_config:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    resumed = make(tiny_models, wandb_config=wandb_config, num_train_epochs=3)
    run_ids = []
    original_start = resumed.tracker.start

    def start(identity=None):
        original_start(identity)
        run_ids.append(resumed.tracker.run.id)

    resumed.tracker.start = start
    resumed.train(resume_from_checkpoint=checkpoint)
    assert run_ids == [identity["id"]]
    steps = [h["step"] for h in resumed.history]  # restored history, then the new steps after it
    assert steps == sorted(steps) and steps[-1] == 3 * 3 * 3
    assert resumed.history[0] == first.history[0]
    straight = make(tiny_models, num_train_epochs=3)
    straight.train()
    assert identical(weights(resumed), weights(straight))  # W&B does not disturb the random streams

    explicit = {**wandb_config, "id": "explicit-run", "resume": "allow"}
    chosen = make(tiny_models, wandb_config=explicit, num_train_epochs=3)
    chosen.train(resume_from_checkpoint=checkpoint)
    assert read_checkpoint_metadata(checkpoint)["wandb"]["id"] == identity["id"]


def test_caller_owned_wandb_run_is_left_open(tiny_models, tmp_path):
    import wandb

    run = wandb.init(project="caller", dir=str(tmp_path), mode="offline")
    try:
        trainer = make(tiny_models, num_train_epochs=1)
        trainer.train()
        trainer.save_model(tmp_path / "export")
        assert wandb.run is run
    finally:
        run.finish()

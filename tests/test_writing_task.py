"""The shipped writing task: its data, each reward level on hand-written completions, its transition,
and how a run spec names it."""

import pytest

from comlrl_core.environments import TASKS, writing_dataset, writing_reward, writing_transition
from comlrl_core.environments.writing import writing_levels
from tasks.spec import RunSpec

TOPIC = "how bees communicate"
SUMMARY = "Bees share where flowers are by dancing and by scent, which helps the whole hive find food."
PARAGRAPH = ("Honey bees tell each other where flowers are with a waggle dance. The angle of the dance points "
             "toward the food and its length tells the distance. Scent carried back on their bodies helps the "
             "others find the same flowers, so the whole hive gathers food quickly and wastes little energy "
             "searching on its own.")


def test_the_dataset_is_deterministic_with_disjoint_subjects():
    train, held_out = writing_dataset("train"), writing_dataset("eval")
    assert (len(train), len(held_out)) == (320, 80)
    assert writing_dataset("train") == train
    assert not {item["topic"] for item in train} & {item["topic"] for item in held_out}
    assert all(set(item) == {"topic", "audience", "prompt"} for item in train + held_out)
    assert len({item["topic"] for item in held_out[:16]}) == 16  # a short prefix still spans subjects
    with pytest.raises(ValueError, match="split='test'"):
        writing_dataset("test")


@pytest.mark.parametrize("summary, paragraph, levels", [
    ("", "", (0.0, 0.0, 0.0)),
    (SUMMARY, "", (0.5, 0.0, 0.0)),  # only the summary finished and within its bounds
    (SUMMARY, PARAGRAPH[:-1] + " and then", (0.75, 0.0, 0.0)),  # cut off mid-sentence: not finished
    ("Bees dance.", PARAGRAPH, (0.75, 0.0, 0.0)),  # a summary under 5 words
    (SUMMARY, " ".join(["Bees dance and share scent."] * 16), (0.75, 0.0, 0.0)),  # a paragraph over 70 words
    ("Bees dance and share scent so that the whole hive can find", "Bees", (0.25, 0.0, 0.0)),  # unfinished
])
def test_the_bounds_level(summary, paragraph, levels):
    assert writing_levels(summary, paragraph, TOPIC) == levels


def test_the_ratio_level_is_full_inside_the_band_and_falls_outside():
    bounds, ratio, _ = writing_levels(SUMMARY, PARAGRAPH, TOPIC)  # 17 and 53 words: 3.1 times
    assert (bounds, ratio) == (1.0, 1.0)
    long_summary = SUMMARY[:-1] + " and lets every worker know which flowers are worth the trip today."
    bounds, ratio, quality = writing_levels(long_summary, PARAGRAPH, TOPIC)  # 29 words: over the bounds
    assert bounds == 0.75 and ratio == quality == 0.0
    wordy = "Bees share where flowers are by dancing and by scent, which helps the hive find its food."
    short = " ".join(PARAGRAPH.split()[:30]).rstrip(",") + "."  # 30 / 17 words: 1.76, under the band
    bounds, ratio, quality = writing_levels(wordy, short, TOPIC)
    assert bounds == 1.0 and 0.0 < ratio < 1.0 and quality == 0.0


def test_the_quality_level_rewards_diversity_and_coherence():
    _, _, good = writing_levels(SUMMARY, PARAGRAPH, TOPIC)
    repetitive = " ".join(["The hive is busy and the hive is full."] * 5)
    _, ratio, poor = writing_levels(SUMMARY, repetitive, TOPIC)
    unrelated = ("Trains run on steel rails that guide their wheels along a fixed path across the country. "
                 "Engineers plan every route with care, and signals along the line keep each train at a safe "
                 "distance from the next one, so journeys stay quick, smooth and reliable for every passenger.")
    _, _, off_topic = writing_levels(SUMMARY, unrelated, TOPIC)
    assert ratio == 1.0
    assert 0.0 < poor < off_topic < good <= 1.0
    item = {"topic": TOPIC}
    assert writing_reward([SUMMARY, ""], [PARAGRAPH, ""], batch_items=[item]) == [pytest.approx((2 + good) / 3), 0.0]
    assert all(0.0 <= r <= 1.0 for r in writing_reward([SUMMARY] * 3, [PARAGRAPH, repetitive, unrelated],
                                                       batch_items=[item]))
    # A summary that does not name the topic (bees) loses relevance, however well the paragraph follows it.
    vague = "They share where good things are by moving and by smell, which helps the whole group find food."
    assert writing_levels(vague, PARAGRAPH, TOPIC)[2] < good


def test_the_transition_shows_each_agent_the_others_text():
    prompts = writing_transition(prompt="p", agent_completions=[SUMMARY, PARAGRAPH], num_agents=2,
                                 prompt_history_per_agent=[["a"], ["b"]], response_history_per_agent=[[SUMMARY],
                                                                                                   [PARAGRAPH]])
    assert len(prompts) == 2 and PARAGRAPH in prompts[0] and SUMMARY in prompts[1]
    with pytest.raises(ValueError, match="two agents"):
        writing_transition(prompt="p", agent_completions=["a"] * 3, num_agents=3, prompt_history_per_agent=[],
                           response_history_per_agent=[])


def test_a_spec_names_the_task_and_may_override_its_parts(tiny_models):
    spec = RunSpec(task="writing", agent_model=tiny_models["qwen2-tiny"], config={"num_agents": 2})
    assert spec.reward_func == TASKS["writing"].reward
    assert (spec.train_dataset.split, spec.eval_dataset.split, spec.eval_dataset.limit) == ("train", "eval", 16)
    assert [t.template() for t in spec.prompt_templates] == list(TASKS["writing"].prompts)
    assert spec.external_transition is None
    own = RunSpec(task="writing", agent_model=tiny_models["qwen2-tiny"], config={"num_agents": 2},
                  formatters="comlrl_core.environments:length_ratio_reward")
    assert own.prompt_templates is None  # Python formatters replace the task's templates
    multi = RunSpec(task="writing", agent_model=tiny_models["qwen2-tiny"],
                    config={"num_agents": 2, "num_turns": 2}, eval_dataset=None,
                    prompt_templates={"user": "About {topic}", "chat": False})
    assert multi.external_transition == TASKS["writing"].transition and multi.eval_dataset is None
    assert len(multi.train_dataset.load()) == 320


def test_every_task_evaluates_on_items_it_does_not_train_on(tiny_models):
    for name in TASKS:
        spec = RunSpec(task=name, agent_model=tiny_models["qwen2-tiny"], config={"num_agents": 2})
        train, held_out = spec.train_dataset.load(), spec.eval_dataset.load()
        assert not [item for item in held_out if item in train], name


@pytest.mark.parametrize("changes, message", [
    ({"task": "poetry"}, "no built-in task 'poetry'"),
    ({"prompt_templates": [{"user": "a {topic}"}] * 3}, "3 entries for 2 agents"),
    ({"formatters": "comlrl_core.environments:length_ratio_reward", "prompt_templates": {"user": "a"}}, "not both"),
    ({"train_dataset": {"builtin": "writing", "size": 4}}, "splits, not size"),
    ({"prompt_templates": {"user": "a {topic.x}"}}, "plain item field"),
])
def test_spec_mistakes_name_the_field(tiny_models, changes, message):
    with pytest.raises(ValueError, match=message):
        RunSpec(**{"task": "writing", "agent_model": tiny_models["qwen2-tiny"], "config": {"num_agents": 2},
                   **changes})


def test_the_multi_turn_form_trains_through_the_transition(tiny_models):
    from comlrl_core.environments import writing_dataset
    from comlrl_core.prompts import PromptTemplate
    from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    seen = []

    def transition(**kwargs):
        prompts = writing_transition(**kwargs)
        seen.append(prompts)
        return prompts

    trainer = MAGRPOTrainer(
        agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=writing_reward, external_transition=transition,
        formatters=[PromptTemplate(user="Summarise {topic}.", chat=False), PromptTemplate(user="Explain {topic}.",
                                                                                          chat=False)],
        train_dataset=writing_dataset("train")[:2],
        args=MAGRPOConfig(num_agents=2, num_turns=2, num_train_epochs=1, num_generations=2, max_new_tokens=4,
                          eval_interval=0, verbose=False))
    trainer.train()
    assert any("turn_2/reward_mean" in h for h in trainer.history)
    assert seen and all(p[0].startswith("Your summary was") and p[1].startswith("Your paragraph was") for p in seen)

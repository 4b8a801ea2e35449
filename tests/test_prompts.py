"""Prompts as data: templates over item fields, rendered through each agent's own chat template."""

import shutil

import pytest
from transformers import AutoTokenizer

from comlrl_core.environments import writing_dataset, writing_reward
from comlrl_core.prompts import PromptTemplate
from comlrl_core.rollout import _encode
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INST = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}[assistant]"


@pytest.fixture(scope="module")
def chat_models(tiny_models, tmp_path_factory):
    """Two tiny agents of different vocabularies, each saved with a chat template of its own kind."""
    root = tmp_path_factory.mktemp("chat-models")
    made = {}
    for name, template in (("qwen2-tiny", CHATML), ("llama-other-vocab", INST)):
        target = root / name
        shutil.copytree(tiny_models[name], target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(target)
        made[name] = str(target)
    return made


def _trainer(agents, formatters, **config):
    args = dict(num_agents=2, num_train_epochs=1, num_generations=2, max_new_tokens=4, eval_interval=1,
                eval_num_samples=2, verbose=False)
    return MAGRPOTrainer(agents=agents, reward_func=writing_reward, formatters=formatters,
                         train_dataset=writing_dataset("train")[:2], eval_dataset=writing_dataset("eval")[:2],
                         args=MAGRPOConfig(**{**args, **config}))


def test_each_agent_renders_the_template_through_its_own_chat_template(chat_models):
    agents = [chat_models["qwen2-tiny"], chat_models["llama-other-vocab"]]
    summary = PromptTemplate(user="Summarise {topic}.", system="Be brief, {audience}.")
    trainer = _trainer(agents, [summary, PromptTemplate(user="Explain {topic} to {audience}.")])
    item = writing_dataset("train")[0]
    first, second = (f(item) for f in trainer.formatters)
    assert first == (f"<|im_start|>system\nBe brief, {item['audience']}.<|im_end|>\n"
                     f"<|im_start|>user\nSummarise {item['topic']}.<|im_end|>\n<|im_start|>assistant\n")
    assert second == f"<s>[user] Explain {item['topic']} to {item['audience']}. [assistant]"
    # The template's text already starts with the BOS token: it is not added a second time.
    ids = _encode(trainer.tokenizers[1], second)[0].tolist()
    bos = trainer.tokenizers[1].bos_token_id
    assert ids[0] == bos and ids[1] != bos
    trainer.train()
    assert [len(record["samples"]) for record in trainer.eval_samples] == [2, 2]


def test_a_template_without_chat_is_the_formatted_text(tiny_models):
    template = PromptTemplate(user="Topic: {topic}", chat=False)
    trainer = _trainer([tiny_models["qwen2-tiny"]] * 2, template)
    assert trainer.formatters[1](writing_dataset("train")[0]) == f"Topic: {writing_dataset('train')[0]['topic']}"
    # On later turns the transition's prompt replaces the template's user text.
    assert trainer.formatters[0]({"topic": "x"}, external_prompt="revise it") == "revise it"


@pytest.mark.parametrize("formatters, message", [
    (PromptTemplate(user="About {subject}"), r"reads \['subject'\]"),
    (PromptTemplate(user="About {topic}"), "no chat template"),
])
def test_template_mistakes_fail_before_any_weights_load(tiny_models, formatters, message, monkeypatch):
    import comlrl_core.trainers.reinforce.magrpo as magrpo

    def never(*args, **kwargs):
        raise AssertionError("weights were loaded before the template was checked")

    monkeypatch.setattr(magrpo, "load_agents", never)
    with pytest.raises(ValueError, match=message) as info:
        _trainer([tiny_models["qwen2-tiny"]] * 2, formatters)
    assert "formatters[0]" in str(info.value)


@pytest.mark.parametrize("user, message", [
    ("", "non-empty"), ("{topic.__class__}", "plain item field"), ("{0}", "plain item field"),
    ("{topic[0]}", "plain item field"), ("{topic", "not a valid template"),
])
def test_malformed_templates_are_refused(user, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(user=user)

"""MAAC: decentralised actors with one centralised critic that reads the joint prompt (and actions)."""

from __future__ import annotations

import torch

from ...export import ExportEntry
from .base import ActorCriticTrainerBase
from .config import MAACConfig


def joint_critic_text(prompts: list[str], actions: list[str] | None) -> str:
    """The centralised critic's input: every agent's prompt, plus the joint action for ``critic_type="q"``."""
    text = "\n\n".join(f"[Agent {i}] {p}" for i, p in enumerate(prompts))
    if actions is not None:
        text += "\n\n[Joint Action]\n\n" + "\n\n".join(f"[Agent {i} action]\n{a}" for i, a in enumerate(actions))
    return text


class MAACTrainer(ActorCriticTrainerBase):
    """The critic comes from ``critic_model`` or a one-element ``critics`` and reads agent 0's token ids;
    its head width is ``model_config={"critic_value_head_hidden_dim": ...}``."""

    algorithm_name = "MAAC"
    config_class = MAACConfig

    def _critic_head(self, plan) -> tuple[int | None, str]:
        return plan.model_config.get("critic_value_head_hidden_dim"), "model_config['critic_value_head_hidden_dim']"

    @classmethod
    def _entity_options(cls, args) -> dict:
        return {"family": "actor_critic", "critic_layout": "central"}

    def _critic_inputs(self, prompts, completions):
        k = completions[0].completion_ids.shape[0]
        encode = self.tokenizers[0]
        joint = []
        for j in range(k):
            actions = [c.texts[j] for c in completions] if self.args.critic_type == "q" else None
            ids = encode(joint_critic_text(prompts, actions), truncation=True).input_ids
            joint.append((0, torch.tensor(ids, dtype=torch.long)))
        return [joint for _ in completions]

    def _export_entries(self) -> list[ExportEntry]:
        entries = [ExportEntry(f"agent_{i}", agent, self.tokenizers[i]) for i, agent in enumerate(self.agents)]
        critic = self.critics[0]
        entries.append(ExportEntry("critic", critic.model, self.tokenizers[0], {"value_head.pt": critic.value_head}))
        return entries

    def _export_info(self) -> dict:
        return {"sources": self.sources, "critic_type": self.args.critic_type,
                "layout": {"agents": [f"agent_{i}" for i in range(self.num_agents)], "critics": ["critic"]},
                "value_heads": {"critic": self._head_info(self.critics[0])}}

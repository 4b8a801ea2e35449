"""IAC: independent actor-critic; each agent has its own critic, or a value head on its own backbone."""

from __future__ import annotations

import torch

from ...export import ExportEntry
from .base import ActorCriticTrainerBase
from .config import IACConfig


class IACTrainer(ActorCriticTrainerBase):
    """``use_separate_critic=True``: critics from ``critic_model`` (a copy per agent) or ``critics``;
    ``False``: ``trainer.agents[i].value_head`` sits on the actor and ``critic_model``/``critics`` stay unset."""

    algorithm_name = "IAC"
    config_class = IACConfig

    def _critic_head(self, plan) -> tuple[int | None, str]:
        return self.args.critic_value_head_hidden_dim, "IACConfig.critic_value_head_hidden_dim"

    @classmethod
    def _entity_options(cls, args) -> dict:
        return {"family": "actor_critic", "critic_layout": "separate" if args.use_separate_critic else "shared"}

    def _critic_inputs(self, prompts, completions):
        rows = []
        for i, comp in enumerate(completions):
            per_k = []
            for j in range(comp.completion_ids.shape[0]):
                ids = comp.prompt_ids
                if self.args.critic_type == "q":
                    ids = torch.cat([ids, comp.completion_ids[j][comp.mask[j]]])
                per_k.append((i, ids))
            rows.append(per_k)
        return rows

    def _export_entries(self) -> list[ExportEntry]:
        entries = []
        for i, agent in enumerate(self.agents):
            if self.shared_head:
                entries.append(ExportEntry(f"agent_{i}", agent.model, self.tokenizers[i], {"value_head.pt": agent.value_head}))
            else:
                entries.append(ExportEntry(f"agent_{i}", agent, self.tokenizers[i]))
                critic = self.critics[i]
                entries.append(ExportEntry(f"agent_{i}/critic", critic.model, self.tokenizers[i],
                                           {"value_head.pt": critic.value_head}))
        return entries

    def _export_info(self) -> dict:
        layout = {"agents": [f"agent_{i}" for i in range(self.num_agents)]}
        if not self.shared_head:
            layout["critics"] = [f"agent_{i}/critic" for i in range(self.num_agents)]
        return {"sources": self.sources, "layout": layout, "use_separate_critic": not self.shared_head,
                "critic_type": self.args.critic_type,
                "value_heads": {path: self._head_info(m) for path, m in
                                zip(layout.get("critics", layout["agents"]),
                                    self.critics if not self.shared_head else self.agents)}}

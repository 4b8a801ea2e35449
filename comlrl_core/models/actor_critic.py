"""Value heads and the causal LM that carries one (IAC shared heads, IAC and MAAC critics).

State-dict keys (``value_projection.*``, ``pre_projection.0.*``) and attribute paths
(``wrapper.model``, ``wrapper.value_head``) follow the seed, so a saved ``value_head.pt`` loads
with ``trainer.critics[i].value_head.load_state_dict(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .backbone import hidden_size, last_hidden_state, param_dtype_device


class ValueHead(nn.Module):
    """Scalar value per position: ``Linear(H, 1)``, or ``Linear(H, d) -> Tanh -> Linear(d, 1)``."""

    def __init__(self, input_dim: int, hidden_dim: int | None = None):
        super().__init__()
        if hidden_dim is not None and (isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1):
            raise ValueError(f"value head hidden_dim must be a positive integer or None, got {hidden_dim!r}.")
        self.hidden_dim = hidden_dim
        if hidden_dim:
            self.pre_projection = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh())
            self.value_projection = nn.Linear(hidden_dim, 1)
        else:
            self.pre_projection = None
            self.value_projection = nn.Linear(input_dim, 1)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pre_projection is not None:
            hidden = self.pre_projection(hidden)
        return self.value_projection(hidden).squeeze(-1)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a saved head, naming the config field to set when the architecture differs."""
        saved_hidden = None
        if "pre_projection.0.weight" in state_dict:
            saved_hidden = int(state_dict["pre_projection.0.weight"].shape[0])
        if strict and saved_hidden != self.hidden_dim:
            raise ValueError(
                f"value head architecture mismatch: the saved head has hidden_dim={saved_hidden}, this head has "
                f"hidden_dim={self.hidden_dim}. Build the trainer with the saved size: IACConfig.value_head_hidden_dim "
                "(IAC shared heads), IACConfig.critic_value_head_hidden_dim (IAC separate critics), or "
                "model_config={'critic_value_head_hidden_dim': ...} (MAAC)."
            )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@dataclass
class ActorCriticOutput:
    logits: torch.Tensor | None
    values: torch.Tensor | None
    hidden_states: torch.Tensor


class CausalLMWithValueHead(nn.Module):
    """A causal LM (``.model``) with an optional value head (``.value_head``) on its last hidden state."""

    def __init__(self, base_model: nn.Module, value_head_hidden_dim: int | None = None, attach_value_head: bool = True):
        super().__init__()
        self.model = base_model
        self.value_head = None
        if attach_value_head:
            dtype, device = param_dtype_device(base_model)
            self.value_head = ValueHead(hidden_size(base_model), value_head_hidden_dim).to(device=device, dtype=dtype)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                compute_logits: bool = True, output_values: bool = True) -> ActorCriticOutput:
        """One backbone pass; logits only when asked (a critic needs values, not the vocab projection)."""
        hidden = last_hidden_state(self.model, input_ids, attention_mask)
        logits = self.model.get_output_embeddings()(hidden) if compute_logits else None
        values = None
        if output_values:
            if self.value_head is None:
                raise ValueError("This model has no value head; build it with attach_value_head=True.")
            values = self.value_head(hidden)
        return ActorCriticOutput(logits=logits, values=values, hidden_states=hidden)

    def generate(self, *args, **kwargs):
        return self.model.generate(*args, **kwargs)

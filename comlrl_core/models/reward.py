"""The joint reward model: a causal-LM backbone and a scalar head on the last non-padding token."""

from __future__ import annotations

import torch
from torch import nn

from .backbone import hidden_size, last_hidden_state, last_token_scores, param_dtype_device


class JointRewardModel(nn.Module):
    """Scores a joint multi-agent text; ``freeze_backbone=True`` trains only ``reward_head``."""

    def __init__(self, backbone: nn.Module, freeze_backbone: bool = False):
        super().__init__()
        self.backbone = backbone
        self.freeze_backbone = freeze_backbone
        dtype, device = param_dtype_device(backbone)
        self.reward_head = nn.Linear(hidden_size(backbone), 1).to(device=device, dtype=dtype)
        if freeze_backbone:
            backbone.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores [B]; works for left and right padding (the last position whose mask is 1)."""
        hidden = last_hidden_state(self.backbone, input_ids, attention_mask)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (attention_mask.long() * positions).argmax(dim=1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.reward_head(pooled).squeeze(-1)

    def score(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """Scores [B] of token sequences of any lengths, each as ``forward`` scores it alone (within
        float rounding), with repeats and common prefixes run once (``last_token_scores``)."""
        return last_token_scores(self.backbone, self.reward_head, sequences)

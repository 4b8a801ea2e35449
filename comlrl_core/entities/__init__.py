"""Resolving and loading the training entities: agents, critics, tokenizers, reward models.

One module family for every trainer: :func:`plan_entities` applies the seed's rules before any
weights load; :mod:`.loading` builds the modules from the plan.
"""

from .loading import (
    check_model_config,
    from_pretrained_kwargs,
    frozen_copy,
    load_agents,
    load_critics,
    load_reward_model,
)
from .plan import EntityPlan, Placement, place_entities, plan_entities
from .sources import Source, source_name
from .tokenizers import apply_tokenizer_specials, ensure_pad_token

__all__ = [
    "EntityPlan",
    "Placement",
    "Source",
    "apply_tokenizer_specials",
    "check_model_config",
    "ensure_pad_token",
    "from_pretrained_kwargs",
    "frozen_copy",
    "load_agents",
    "load_critics",
    "load_reward_model",
    "place_entities",
    "plan_entities",
    "source_name",
]

"""The entity plan: every seed rule about agents, critics, tokenizers and reward models, in one place.

Trainers call :func:`plan_entities` first; it checks the arguments, loads tokenizers and configs
(never weights) and returns an :class:`EntityPlan` that :mod:`.loading` turns into modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..devices import AUTO, resolve_devices, resolve_one
from .loading import check_model_config, trusts_remote_code
from .sources import (
    Source,
    _as_list,
    check_distinct_objects,
    check_source,
    resolve_count,
    resolve_sources,
    source_name,
)
from .tokenizers import check_vocab_compatible, resolve_tokenizers

FAMILIES = ("magrpo", "actor_critic")
CRITIC_LAYOUTS = ("none", "shared", "separate", "central")


@dataclass
class EntityPlan:
    """Resolved sources, one per role, plus the loaded tokenizers; no weights yet."""

    owner: str
    num_agents: int
    agent_sources: list[Source]
    tokenizers: list[PreTrainedTokenizerBase]
    critic_layout: str = "none"
    critic_sources: list[Source] = field(default_factory=list)
    reward_model_source: str | None = None
    reward_model_device: torch.device | None = None
    model_config: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str | None:
        """Agent 0's loadable name (the default reward-model and critic source)."""
        return source_name(self.agent_sources[0])


def _count(owner, family, agents_list, num_agents, config_num_agents, config_name) -> int:
    claims = [("num_agents", num_agents)]
    if family == "magrpo" and num_agents is None and agents_list is None:
        claims = [("num_agents (constructor default)", 2)]
    claims.append(("len(agents)", None if agents_list is None else len(agents_list)))
    claims.append((f"{config_name}.num_agents", config_num_agents))
    return resolve_count(claims, default=2, owner=owner)


def _critics(owner, layout, critic_model, critics, count, derive_name, config_name) -> list[Source]:
    """Critic sources for the layout; ``derive_name`` (MARLHF) is the fallback when none is given."""
    if layout in ("none", "shared"):
        if critic_model is not None or critics is not None:
            why = ("use_separate_critic=False: each actor and its critic share one backbone"
                   if layout == "shared" else "this algorithm has no critic")
            raise ValueError(f"{owner}: critic_model and critics must be unset ({why}).")
        return []
    if critic_model is None and critics is None:
        if derive_name is False:
            needs = "MAAC needs a centralised critic" if layout == "central" else "use_separate_critic=True"
            raise ValueError(f"{owner}: Either critic_model or critics must be provided ({needs}).")
        if derive_name is None:
            raise ValueError(
                f"{owner}: the actors are model objects without a loadable name, so no critic can be derived "
                f"from them; set {config_name}.critic_model_name, or pass critic_model or critics."
            )
        critic_model = derive_name
    what = "critic (MAAC has one centralised critic)" if layout == "central" else "agents (one critic each)"
    return resolve_sources("critics", critic_model, critics, 1 if layout == "central" else count,
                           model_label="critic_model", what=what)


def plan_entities(
    *,
    owner: str,
    family: str,
    agent_model: object = None,
    agents: object = None,
    num_agents: int | None = None,
    config_num_agents: int | None = None,
    config_name: str = "config",
    tokenizer: object = None,
    model_config: dict | None = None,
    critic_layout: str = "none",
    critic_model: object = None,
    critics: object = None,
    critic_model_name: str | None = None,
    critic_defaults_to_actor: bool = False,
    reward_model: bool = False,
    reward_model_name: str | None = None,
    reward_model_device: str | None = None,
    allow_shared_models: bool = False,
) -> EntityPlan:
    """Check every seed loading rule and resolve one source and one tokenizer per role.

    ``family`` picks the count and tokenizer rules (``"magrpo"``: the constructor's ``num_agents``
    is authoritative and tokenizers auto-load for ids; ``"actor_critic"``: the config's count is
    authoritative and ``tokenizer`` is required with ``agents``). ``critic_layout`` is ``"none"``,
    ``"shared"`` (value head on the actor), ``"separate"`` (one critic per agent) or ``"central"``
    (one MAAC critic). ``critic_defaults_to_actor`` lets MARLHF fall back to
    ``critic_model_name`` and then agent 0. ``reward_model`` resolves the reward-model source.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")
    if critic_layout not in CRITIC_LAYOUTS:
        raise ValueError(f"critic_layout must be one of {CRITIC_LAYOUTS}, got {critic_layout!r}.")
    model_config = check_model_config(model_config)
    agents_list = None if agents is None else _as_list(agents, "agents")
    count = _count(owner, family, agents_list, num_agents, config_num_agents, config_name)
    agent_sources = resolve_sources("agents", agent_model, agents_list, count, model_label="agent_model", what="agents")
    derive_name = (critic_model_name or source_name(agent_sources[0])) if critic_defaults_to_actor else False
    critic_sources = _critics(owner, critic_layout, critic_model, critics, count, derive_name, config_name)
    check_distinct_objects([("agents", agent_sources), ("critics", critic_sources)], allow_shared_models, owner=owner)

    reward_source = None
    reward_device = None
    if reward_model:
        reward_source = reward_model_name if reward_model_name is not None else source_name(agent_sources[0])
        if reward_source is None:
            raise ValueError(
                f"{owner}: {config_name}.reward_model_name is required when the actors are loaded model objects "
                "without a loadable name (model.name_or_path is empty); pass a Hugging Face id or local directory."
            )
        reward_source = check_source(reward_source, f"{config_name}.reward_model_name")
        reward_device = resolve_one(reward_model_device, f"{config_name}.reward_model_device", start=count)

    trust = trusts_remote_code(model_config)
    tokenizers = resolve_tokenizers(tokenizer, agent_sources, agent_model=agent_model,
                                    agents_given=agents is not None, family=family, owner=owner,
                                    trust_remote_code=trust)
    for i, (tok, source) in enumerate(zip(tokenizers, agent_sources)):
        check_vocab_compatible(tok, source, role=f"agent {i}", tokenizer_label=f"tokenizer {i}",
                               trust_remote_code=trust)
    for i, source in enumerate(critic_sources):
        # A MAAC critic reads the joint input encoded with agent 0's tokenizer.
        check_vocab_compatible(tokenizers[i], source, role=f"critic {i}", tokenizer_label=f"agent {i}'s tokenizer",
                               trust_remote_code=trust)
    return EntityPlan(owner=owner, num_agents=count, agent_sources=agent_sources, tokenizers=tokenizers,
                      critic_layout=critic_layout, critic_sources=critic_sources,
                      reward_model_source=reward_source, reward_model_device=reward_device,
                      model_config=model_config)


@dataclass(frozen=True)
class Placement:
    """The device of every entity: one per agent, per separate critic, per reference model, and the reward model's."""

    agents: list[torch.device]
    critics: list[torch.device]
    references: list[torch.device]
    reward: torch.device | None = None


def place_entities(plan: EntityPlan, args, *, default: torch.device, data_parallel: bool = False) -> Placement:
    """Where each entity of ``plan`` goes, from ``args``' device settings (``agent_devices``,
    ``critic_devices``, ``reference_devices``; the reward model's comes resolved in the plan).

    ``None`` means ``default`` for the agents, the agent's device for its reference and its IAC
    critic, agent 0's for the MAAC critic and the reward model. ``"auto"`` spreads round-robin
    over the visible CUDA devices (the CPU without CUDA): agent i, its reference and its IAC
    critic on ``cuda:i % n``, the MAAC critic on the device after the agents'. Every impossible
    placement is a ``ValueError`` naming the config field; call this before loading weights. In a
    data-parallel job (one process per device) the settings must be None or ``"auto"``: both mean
    ``default``, this process's device, which also holds the reward model.
    """
    name, count = type(args).__name__, plan.num_agents
    specs = {f: getattr(args, f, None) for f in ("agent_devices", "critic_devices", "reference_devices")}
    if data_parallel:
        for setting, spec in specs.items():
            if spec is not None and spec != AUTO:
                raise ValueError(f"{name}.{setting}={spec!r}: in a data-parallel job every process trains on its "
                                 f"own device ({default}); set {setting}=None or 'auto'.")
        specs = dict.fromkeys(specs)
    agents = resolve_devices(specs["agent_devices"], count, f"{name}.agent_devices", default=default)
    spec, setting = specs["critic_devices"], f"{name}.critic_devices"
    if plan.critic_layout in ("none", "shared"):
        if spec is not None:
            why = ("the value heads live on their actors (use_separate_critic=False); place them with agent_devices"
                   if plan.critic_layout == "shared" else "this algorithm has no critic")
            raise ValueError(f"{setting}={spec!r} places nothing: {why}. Set critic_devices=None.")
        critics = []
    elif plan.critic_layout == "separate":
        critics = resolve_devices(spec, count, setting, what="critic", default=agents)
    else:  # MAAC's one centralised critic
        critics = resolve_devices(spec, 1, setting, what="critic", default=agents[:1], start=count)
    references = resolve_devices(specs["reference_devices"], count, f"{name}.reference_devices", default=agents)
    reward = None
    if plan.reward_model_source is not None:  # one process per device: its reward model shares it
        reward = agents[0] if data_parallel else plan.reward_model_device or agents[0]
    return Placement(agents, critics, references, reward)

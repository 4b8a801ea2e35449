"""Turn an :class:`~.plan.EntityPlan` into modules: agents, critics with value heads, the reward model."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from ..models import CausalLMWithValueHead, JointRewardModel
from .sources import Source
from .tokenizers import apply_tokenizer_specials, load_tokenizer

_MODEL_CONFIG_KEYS = {
    "torch_dtype": "dtype of every loaded model (alias of dtype)",
    "dtype": "dtype of every loaded model, e.g. 'bfloat16'",
    "attn_implementation": "attention backend (default 'sdpa'; None keeps the model's default)",
    "trust_remote_code": "run code shipped with a hub model (default False)",
    "model_kwargs": "extra from_pretrained keyword arguments for the actors",
    "critic_model_kwargs": "extra from_pretrained keyword arguments for the critics",
    "reward_model_kwargs": "extra from_pretrained keyword arguments for the reward model",
    "critic_value_head_hidden_dim": "MAAC critic value-head width (None = linear head)",
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


def check_model_config(model_config: dict | None) -> dict:
    """Validate ``model_config`` keys up front; an unknown key is a typo, not something to ignore."""
    if model_config is None:
        return {}
    if not isinstance(model_config, dict):
        raise TypeError(f"model_config must be a dict or None, got {type(model_config).__name__}.")
    unknown = sorted(set(model_config) - set(_MODEL_CONFIG_KEYS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in _MODEL_CONFIG_KEYS.items())
        raise ValueError(f"model_config has unknown keys {unknown}. Known keys: {known}.")
    for key in ("model_kwargs", "critic_model_kwargs", "reward_model_kwargs"):
        if model_config.get(key) is not None and not isinstance(model_config[key], dict):
            raise TypeError(f"model_config[{key!r}] must be a dict of from_pretrained keyword arguments.")
    flags = [("model_config['trust_remote_code']", model_config.get("trust_remote_code", False))]
    for key in ("model_kwargs", "critic_model_kwargs", "reward_model_kwargs"):
        flags.append((f"model_config[{key!r}]['trust_remote_code']",
                      (model_config.get(key) or {}).get("trust_remote_code", False)))
    for label, flag in flags:
        if not isinstance(flag, bool):  # a string such as "false" would otherwise count as consent
            raise TypeError(f"{label}={flag!r} must be True or False: it is the explicit opt-in to run a model's code.")
    for key in ("torch_dtype", "dtype"):
        value = model_config.get(key)
        if not (value is None or isinstance(value, torch.dtype) or (isinstance(value, str) and value in _DTYPES)):
            raise ValueError(f"model_config[{key!r}]={value!r}; use a torch.dtype or one of {sorted(_DTYPES)}.")
    hidden = model_config.get("critic_value_head_hidden_dim")
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
        raise ValueError("model_config['critic_value_head_hidden_dim'] must be a positive integer or None.")
    return dict(model_config)


def from_pretrained_kwargs(model_config: dict, section: str) -> dict:
    """``from_pretrained`` keyword arguments: top-level settings, then the role's section overrides them."""
    kwargs: dict = {"attn_implementation": "sdpa", "trust_remote_code": False}
    for key in ("attn_implementation", "trust_remote_code"):
        if key in model_config:
            kwargs[key] = model_config[key]
    dtype = model_config.get("dtype", model_config.get("torch_dtype"))
    if dtype is not None:
        kwargs["dtype"] = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    kwargs.update(model_config.get(section) or {})
    if "torch_dtype" in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    if kwargs.get("attn_implementation") is None:
        kwargs.pop("attn_implementation")
    return kwargs


def trusts_remote_code(model_config: dict | None) -> bool:
    """The explicit opt-in to run a model's own code; configs and tokenizers follow the models' choice."""
    return (model_config or {}).get("trust_remote_code") is True


def load_models(sources: list[Source], kwargs: dict, label: str) -> list[nn.Module]:
    """Load each string source; a repeated id/dir is read once and deep-copied (independent weights)."""
    loaded: dict[str, nn.Module] = {}
    models = []
    for i, source in enumerate(sources):
        if not isinstance(source, str):
            models.append(source)
            continue
        if source in loaded:
            models.append(copy.deepcopy(loaded[source]))
            continue
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except (OSError, ValueError) as exc:
            raise type(exc)(f"{label}[{i}]: could not load model {source!r}: {exc}") from exc
        except pickle.UnpicklingError:  # torch's own message suggests weights_only=False: never
            files = sorted(str(p) for p in Path(source).expanduser().glob("*.bin")) or [source]
            raise ValueError(f"{label}[{i}]: {', '.join(files)} of model {source!r} holds pickled objects other than "
                             "plain tensors, which are never unpickled: only safetensors or plain-tensor weights "
                             "are loaded. Convert it to safetensors where you trust it.") from None
        except SafetensorError as exc:  # safetensors names neither the file nor the fix
            files = sorted(str(p) for p in Path(source).expanduser().glob("*.safetensors")) or [source]
            raise ValueError(f"{label}[{i}]: the weights of model {source!r} are corrupt or truncated "
                             f"({', '.join(files)}: {exc}); save or download the model again.") from exc
        loaded[source] = model
        models.append(model)
    return models


def _with_head(model: nn.Module, hidden_dim: int | None, field: str) -> CausalLMWithValueHead:
    if isinstance(model, CausalLMWithValueHead):
        head = model.value_head
        if head is None or head.hidden_dim != hidden_dim:
            raise ValueError(
                f"a CausalLMWithValueHead was passed with value head hidden_dim="
                f"{None if head is None else head.hidden_dim}, but {field}={hidden_dim}; set {field} to match."
            )
        return model
    return CausalLMWithValueHead(model, value_head_hidden_dim=hidden_dim)


def load_agents(plan, devices: torch.device | list[torch.device], *, value_head_hidden_dim: int | None = None,
                value_head: bool = False, field: str = "value_head_hidden_dim") -> list[nn.Module]:
    """The actors, agent i on ``devices[i]`` (one device: all there); with ``value_head=True`` each
    carries a value head (IAC shared mode)."""
    if not isinstance(devices, (list, tuple)):
        devices = [devices] * plan.num_agents
    if len(devices) != plan.num_agents:
        raise ValueError(f"load_agents: {len(devices)} devices for {plan.num_agents} agents.")
    models = load_models(plan.agent_sources, from_pretrained_kwargs(plan.model_config, "model_kwargs"), "agents")
    agents = []
    for tokenizer, model, device in zip(plan.tokenizers, models, devices):
        if value_head:
            model = _with_head(model, value_head_hidden_dim, field)
        elif isinstance(model, CausalLMWithValueHead):
            model = model.model
        apply_tokenizer_specials(tokenizer, model)
        agents.append(model.to(device))
    return agents


def frozen_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A frozen ``eval()`` copy of ``module`` on ``device`` (a KL reference model).

    Parameters and buffers are copied straight to ``device``, so a reference placed on another
    device never needs a second copy's memory on the original's; tied weights stay tied.
    """
    memo: dict = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            copied = tensor.detach().to(device, copy=True)
            memo[id(tensor)] = nn.Parameter(copied, requires_grad=False) if isinstance(tensor, nn.Parameter) else copied
    return copy.deepcopy(module, memo).to(device).eval().requires_grad_(False)


def load_critics(plan, devices: list[torch.device], *, value_head_hidden_dim: int | None,
                 field: str) -> list[CausalLMWithValueHead]:
    """The separate critics (one per agent, or MAAC's single one), each with a fresh value head."""
    models = load_models(plan.critic_sources, from_pretrained_kwargs(plan.model_config, "critic_model_kwargs"),
                         "critics")
    critics = []
    for i, (model, device) in enumerate(zip(models, devices)):
        critic = _with_head(model, value_head_hidden_dim, field)
        apply_tokenizer_specials(plan.tokenizers[i], critic)
        critics.append(critic.to(device))
    return critics


def load_reward_model(plan, device: torch.device, *, freeze_backbone: bool) -> tuple[JointRewardModel, PreTrainedTokenizerBase]:
    """The joint reward model on its own tokenizer, on ``plan.reward_model_device`` or ``device``."""
    source = plan.reward_model_source
    tokenizer = load_tokenizer(source, trust_remote_code=trusts_remote_code(plan.model_config))
    backbone = load_models([source], from_pretrained_kwargs(plan.model_config, "reward_model_kwargs"),
                           "reward_model")[0]
    apply_tokenizer_specials(tokenizer, backbone)
    model = JointRewardModel(backbone, freeze_backbone=freeze_backbone)
    return model.to(plan.reward_model_device or device), tokenizer

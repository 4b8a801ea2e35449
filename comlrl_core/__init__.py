"""comlrl_core: the training entities of cooperative multi-LLM reinforcement learning."""

__version__ = "0.1.0"

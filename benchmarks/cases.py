"""The fixed benchmark cases: which trainer, which models, and the settings every case shares.

Pure data (no ``comlrl_core`` import), read by both implementations' runners. A case becomes a JSON
object for a runner with the model names replaced by local directories.
"""

# Settings shared by every case and both implementations.
SETTINGS = {
    "num_agents": 2,
    "num_generations": 4,
    "max_new_tokens": 16,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "learning_rate": 5e-4,
    "critic_learning_rate": 5e-4,
    "rollout_buffer_size": 2,   # samples per optimizer step
    "train_items": 4,       # prompts per epoch (one training step per prompt)
    "epochs": 2,
    "eval_items": 4,        # prompts evaluated before and after training
    "seed": 0,
    "threads": 1,           # torch.set_num_threads: 1 gives stable figures on a 2-core machine
    # MARLHF only: preference collection and the reward-model fit inside train().
    "preference_num_candidates": 8,
    "preference_pairs_per_sample": 8,
    "reward_learning_rate": 1e-4,
    "reward_num_train_epochs": 1,
    "reward_train_batch_size": 4,
}

# name -> trainer and roles; {size} is "tiny" (qwen2-tiny/llama-tiny) or "small" (~10M parameters).
CASES = {
    "magrpo-homogeneous": {"trainer": "magrpo", "agents": ["qwen2", "qwen2"]},
    "magrpo-heterogeneous": {"trainer": "magrpo", "agents": ["qwen2", "llama"]},
    "iac-shared": {"trainer": "iac", "agents": ["qwen2", "qwen2"], "critic_mode": "shared"},
    "iac-separate": {"trainer": "iac", "agents": ["qwen2", "qwen2"], "critic_mode": "separate", "critic": "llama"},
    "maac": {"trainer": "maac", "agents": ["qwen2", "qwen2"], "critic": "llama"},
    "marlhf": {"trainer": "marlhf", "agents": ["qwen2", "qwen2"], "reward_model": "llama"},
}

MODELS = {"tiny": {"qwen2": "qwen2-tiny", "llama": "llama-tiny"},
          "small": {"qwen2": "qwen2-bench", "llama": "llama-bench"}}


def expand(name: str, size: str, model_dirs: dict[str, str]) -> dict:
    """The JSON a runner takes: the case with model directories, and the shared settings."""
    case = dict(CASES[name])
    models = MODELS[size]
    case["agents"] = [model_dirs[models[role]] for role in case["agents"]]
    for role in ("critic", "reward_model"):
        if role in case:
            case[role] = model_dirs[models[case[role]]]
    return {"name": f"{name}/{size}", **case, "settings": SETTINGS}

"""Shared fixtures: tiny local models (built once per session) and an offline environment."""

import os
import tempfile

# Nothing in the tests may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Prefect keeps its database, settings and result files here, never in the user's home.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="comlrl-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

import pytest  # noqa: E402

from comlrl_core.tiny_models import build_tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``{name: directory}`` for every tiny model; directories stand in for hub ids."""
    return {name: str(path) for name, path in build_tiny_models(tmp_path_factory.mktemp("tiny-models")).items()}

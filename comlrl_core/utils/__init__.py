"""Small user-facing helpers; ``read_checkpoint_metadata`` lives here as a stable public import path."""

from comlrl_core.checkpoint import read_checkpoint_metadata

__all__ = ["read_checkpoint_metadata"]

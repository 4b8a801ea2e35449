"""Checkpoint and export I/O: atomic publishing, checksum manifests, safe state files and metadata.

Everything a trainer writes goes through :func:`publish_dir`, and everything it reads back is
either checked against the manifest or loaded without unpickling arbitrary objects.
"""

from .atomic import MANIFEST, CheckpointError, is_staging_name, publish_dir, sha256_file, verify_dir
from .metadata import CHECKPOINT_VERSION, METADATA, read_checkpoint_metadata, write_metadata
from .state import capture_rng, check_tensors, load_state, load_tensors, restore_rng, save_state, save_tensors

__all__ = [
    "CHECKPOINT_VERSION",
    "MANIFEST",
    "METADATA",
    "CheckpointError",
    "capture_rng",
    "check_tensors",
    "is_staging_name",
    "load_state",
    "load_tensors",
    "publish_dir",
    "read_checkpoint_metadata",
    "restore_rng",
    "save_state",
    "save_tensors",
    "sha256_file",
    "verify_dir",
    "write_metadata",
]

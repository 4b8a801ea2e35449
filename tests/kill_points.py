"""Run ``comlrl-pipeline`` and SIGKILL it the N-th time it reaches a named point: ``COMLRL_KILL_AT=point:N``.

``python -m kill_points run SPEC.yaml`` (with ``tests/`` on ``PYTHONPATH``). The points wrap the real
code paths (generation, the optimizer, checkpoint writing, S3 transfers) without changing what
they do, so the process dies exactly where production code would be when the kernel kills it.
"""

import functools
import json
import os
import signal
import sys


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, n: int) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from comlrl_core import rollout
    from comlrl_core.checkpoint import atomic
    from comlrl_core.storage import S3Storage
    from comlrl_core.trainers import checkpointing

    seen = {"count": 0}

    def reached(name: str) -> None:
        if name == point:
            seen["count"] += 1
            if seen["count"] == n:
                _die()

    def after(owner, attr: str, name_of):
        """Wrap ``owner.attr`` so that reaching the point (``name_of(args)``) is counted after the call."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            reached(name_of(*args, **kwargs))
            return result

        setattr(owner, attr, wrapper)

    def before(owner, attr: str, name_of):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            reached(name_of(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)

    def upload_kind(self, path, key, entry):
        return next((f"{kind.strip('/-')}-upload" for kind in ("partial/", "final-", "export-")
                     if f"/{kind}" in key), "other-upload")

    def half_manifest(path, manifest):
        """Die with the manifest half on disk: the worst moment to lose a process while publishing."""
        if point == "manifest-write" and seen["count"] + 1 == n:
            text = json.dumps(manifest)
            with open(path, "w") as f:
                f.write(text[: len(text) // 2])
                f.flush()
                os.fsync(f.fileno())
        reached("manifest-write")
        return original_manifest(path, manifest)

    after(rollout, "generate_ids", lambda *a, **k: "rollout")
    register_optimizer_step_post_hook(lambda *a: reached("optimizer-step"))
    before(checkpointing, "save_state", lambda *a, **k: "checkpoint-write")
    original_manifest = atomic._write_manifest
    atomic._write_manifest = half_manifest
    before(atomic, "_swap_into_place", lambda *a, **k: "publish-rename")
    after(S3Storage, "_upload", upload_kind)
    after(S3Storage, "_fetch", lambda *a, **k: "download")
    before(S3Storage, "put_text", lambda self, key, text: "pointer" if key.endswith("/LATEST") else "text")


if __name__ == "__main__":
    point, _, count = os.environ["COMLRL_KILL_AT"].partition(":")
    install(point, int(count))
    from flows.cli import main

    sys.exit(main(sys.argv[1:]))

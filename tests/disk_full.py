"""Fill a small filesystem while storing directories and writing training checkpoints; print a JSON report.

``python disk_full.py DIR MODEL_DIR [--inject]``: DIR is a small tmpfs (test_storage_faults mounts one in
a user namespace). With ``--inject``, where no tmpfs can be mounted, the disk "fills" by an injected
``OSError(ENOSPC)`` from the third checkpoint write and from any file copy over 1 MiB.
"""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

from comlrl_core.checkpoint import verify_dir
from comlrl_core.checkpoint.atomic import is_staging_name
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.storage import LocalStorage
from comlrl_core.trainers import checkpointing
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def inject_enospc() -> None:
    """Raise ENOSPC where a full disk would: the third checkpoint's tensors, and large copies."""
    calls = {"n": 0}
    save_tensors, copyfile = checkpointing.save_tensors, shutil.copyfile

    def full_save(path, tensors):
        calls["n"] += 1
        if calls["n"] > 4:  # two agents per checkpoint: checkpoints 1 and 2 fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save_tensors(path, tensors)

    def full_copy(src, dst, **kwargs):
        if os.path.getsize(src) > 1 << 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return copyfile(src, dst, **kwargs)

    checkpointing.save_tensors = full_save
    shutil.copyfile = full_copy


def listing(directory: Path) -> dict:
    """Visible directories (each verified) and hidden staging leftovers."""
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    visible = [n for n in names if not is_staging_name(n)]
    for name in visible:
        verify_dir(directory / name)
    return {"visible": visible, "leftovers": [n for n in names if is_staging_name(n)]}


def failure(call) -> dict | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the report carries whatever the user would see
        return {"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "message": str(exc)}
    return None


def main(root: Path, model: str) -> dict:
    report = {}
    source = root.parent / "sources"
    (source / "small").mkdir(parents=True, exist_ok=True)
    (source / "small" / "a.bin").write_bytes(b"a" * 1000)
    (source / "big").mkdir(exist_ok=True)
    (source / "big" / "b.bin").write_bytes(os.urandom(8 << 20))  # more than the filesystem holds
    storage = LocalStorage(root / "store")
    storage.put_dir(source / "small", "export-1")
    report["store_error"] = failure(lambda: storage.put_dir(source / "big", "export-2"))
    report["store"] = listing(root / "store")
    shutil.rmtree(root / "store")

    trainer = MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=length_ratio_reward,
                            train_dataset=length_ratio_dataset(3),
                            args=MAGRPOConfig(num_train_epochs=3, max_new_tokens=6, num_generations=3,
                                              rollout_buffer_size=2, verbose=False))
    report["train_error"] = failure(lambda: trainer.train(checkpoint_dir=root / "ck", checkpoint_steps=1))
    report["checkpoints"] = listing(root / "ck")
    return report


if __name__ == "__main__":
    if "--inject" in sys.argv:
        inject_enospc()
    print("REPORT " + json.dumps(main(Path(sys.argv[1]), sys.argv[2])))

"""Checkpoint I/O on real files: atomic publishing, manifests, safe state files, RNG and metadata."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re

import numpy as np
import pytest
import torch

from comlrl_core.checkpoint import (
    CHECKPOINT_VERSION,
    MANIFEST,
    METADATA,
    CheckpointError,
    capture_rng,
    is_staging_name,
    load_state,
    load_tensors,
    publish_dir,
    restore_rng,
    save_state,
    save_tensors,
    sha256_file,
    verify_dir,
    write_metadata,
)
from comlrl_core.utils import read_checkpoint_metadata

RUN_ID = "0123abcd"


def write_files(files: dict[str, bytes]):
    """A publish_dir callback that writes ``files`` (relpath -> bytes)."""

    def write(staging):
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)

    return write


def published(tmp_path, files=None):
    target = tmp_path / "ckpt"
    publish_dir(target, write_files(files or {"weights.bin": b"w" * 100, "sub/opt.pt": b"optimizer"}))
    return target


# --- atomic publishing -------------------------------------------------------------------------


def test_publish_then_verify(tmp_path):
    files = {"weights.bin": b"w" * 100, "sub/opt.pt": b"optimizer"}
    manifest = publish_dir(tmp_path / "ckpt", write_files(files), extra={"kind": "checkpoint"})

    assert manifest["format"] == 1
    assert manifest["kind"] == "checkpoint"
    assert list(manifest["files"]) == ["sub/opt.pt", "weights.bin"]
    for rel, data in files.items():
        assert manifest["files"][rel] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert verify_dir(tmp_path / "ckpt") == manifest
    assert json.loads((tmp_path / "ckpt" / MANIFEST).read_text()) == manifest
    assert sha256_file(tmp_path / "ckpt" / "weights.bin") == hashlib.sha256(files["weights.bin"]).hexdigest()
    assert os.listdir(tmp_path) == ["ckpt"]


def test_publish_creates_missing_parent(tmp_path):
    publish_dir(tmp_path / "a" / "b" / "ckpt", write_files({"x": b"1"}))
    verify_dir(tmp_path / "a" / "b" / "ckpt")


def test_failed_write_leaves_nothing(tmp_path):
    def write(staging):
        (staging / "weights.bin").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_dir(tmp_path / "ckpt", write)
    assert os.listdir(tmp_path) == []


def test_replace_keeps_old_until_new_is_complete(tmp_path):
    target = published(tmp_path, {"weights.bin": b"old"})

    def write(staging):
        assert (target / "weights.bin").read_bytes() == b"old"
        verify_dir(target)
        (staging / "weights.bin").write_bytes(b"new")

    publish_dir(target, write)
    assert (target / "weights.bin").read_bytes() == b"new"
    verify_dir(target)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_failed_replace_keeps_old(tmp_path):
    target = published(tmp_path, {"weights.bin": b"old"})

    def write(staging):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish_dir(target, write)
    assert (target / "weights.bin").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize(
    "write",
    [
        lambda staging: (staging / MANIFEST).write_text("{}"),
        lambda staging: (staging / "link").symlink_to(staging / "elsewhere"),
    ],
    ids=["manifest-name", "symlink"],
)
def test_publish_refuses_reserved_name_and_symlinks(tmp_path, write):
    with pytest.raises(CheckpointError):
        publish_dir(tmp_path / "ckpt", write)
    assert os.listdir(tmp_path) == []


def test_publish_refuses_reserved_extra_keys(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        publish_dir(tmp_path / "ckpt", write_files({"x": b"1"}), extra={"files": {}})
    assert os.listdir(tmp_path) == []


def test_staging_names():
    assert is_staging_name(".ckpt.staging-0a1b2c3d")
    assert is_staging_name(".step-5.old-ff00")
    assert not is_staging_name("ckpt")
    assert not is_staging_name(".hidden")
    assert not is_staging_name("ckpt.staging-00")


def truncate(target):
    path = target / "weights.bin"
    path.write_bytes(path.read_bytes()[:10])
    return "weights.bin"


def flip_bit(target):
    path = target / "sub" / "opt.pt"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    return "opt.pt"


def delete(target):
    (target / "weights.bin").unlink()
    return "weights.bin"


def add_file(target):
    (target / "sub" / "stray.txt").write_text("hello")
    return "stray.txt"


def drop_manifest(target):
    (target / MANIFEST).unlink()
    return MANIFEST


def garble_manifest(target):
    (target / MANIFEST).write_text("{not json")
    return MANIFEST


@pytest.mark.parametrize("damage", [truncate, flip_bit, delete, add_file, drop_manifest, garble_manifest])
def test_verify_dir_names_the_damaged_file(tmp_path, damage):
    target = published(tmp_path)
    name = damage(target)
    with pytest.raises(CheckpointError, match=name):
        verify_dir(target)


def test_verify_dir_messages(tmp_path):
    target = published(tmp_path)
    flip_bit(target)
    with pytest.raises(CheckpointError, match="checksum mismatch in .*opt.pt: the file is corrupted or truncated"):
        verify_dir(target)
    drop_manifest(target)
    with pytest.raises(CheckpointError, match="not a complete checkpoint/export: manifest.json missing"):
        verify_dir(target)


# --- state files -------------------------------------------------------------------------------


def assert_same_tree(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tree(x, y)
    else:
        assert a == b


def adamw_after_step(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_state_round_trip_with_optimizer(tmp_path):
    model, optimizer = adamw_after_step(0)
    tree = {
        "optimizers": [optimizer.state_dict()],
        "step": 7,
        "misc": (1, 2.5, None, True, "x", [torch.arange(3)]),
        "model": model.state_dict(),
    }
    save_state(tmp_path / "state.pt", tree)
    loaded = load_state(tmp_path / "state.pt")
    assert_same_tree(tree, loaded)

    # The loaded state drives a fresh optimizer exactly like the original one.
    twin, twin_optimizer = adamw_after_step(0)
    twin_optimizer.load_state_dict(loaded["optimizers"][0])
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        opt.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert torch.equal(model.weight, twin.weight)


def test_save_state_names_the_bad_key_path(tmp_path):
    tree = {"optimizers": [{"state": {3: np.zeros(2)}}]}
    expected = "state['optimizers'][0]['state'][3]: numpy.ndarray is not allowed"
    with pytest.raises(TypeError, match=re.escape(expected)):
        save_state(tmp_path / "state.pt", tree)
    assert not (tmp_path / "state.pt").exists()


def test_save_state_rejects_numpy_scalars(tmp_path):
    with pytest.raises(TypeError, match=r"state\['lr'\]: numpy.float64"):
        save_state(tmp_path / "state.pt", {"lr": np.float64(0.1)})


EXECUTED = []


def _record(what):
    EXECUTED.append(what)
    return what


class Payload:
    """Unpickling this runs ``_record``: proof that a loader executed code from the file."""

    def __reduce__(self):
        return (_record, ("code ran",))


def test_load_state_refuses_arbitrary_objects(tmp_path):
    torch.save({"model": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_state(tmp_path / "evil.pt")
    assert EXECUTED == []


def test_load_state_reports_corrupt_file(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="state.pt"):
        load_state(tmp_path / "state.pt")


def test_tensors_round_trip_tied_and_bf16(tmp_path):
    embed = torch.randn(5, 3)
    tensors = {
        "tail": embed[2:],
        "embed": embed,
        "head": embed,
        "transposed": embed.t(),
        "bf16": torch.randn(2, 2, dtype=torch.bfloat16),
        "ints": torch.arange(4, dtype=torch.int64),
    }
    save_tensors(tmp_path / "model.safetensors", tensors)
    loaded = load_tensors(tmp_path / "model.safetensors")
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)
    assert tensors["head"] is embed


def test_load_tensors_reports_corrupt_file(tmp_path):
    save_tensors(tmp_path / "model.safetensors", {"w": torch.ones(4)})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_tensors(tmp_path / "model.safetensors")


def draws():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [np.random.standard_normal()],
        torch.rand(3),
    )


def test_rng_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached second gaussian in both generators
    np.random.standard_normal()
    save_state(tmp_path / "rng.pt", capture_rng())
    first = draws()

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(load_state(tmp_path / "rng.pt"))
    second = draws()

    assert first[0] == second[0]
    assert first[1] == second[1]
    assert torch.equal(first[2], second[2])


def test_restore_rng_refuses_other_gpu_count():
    state = capture_rng()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["cuda"] = [torch.get_rng_state()] * (count + 1)
    with pytest.raises(CheckpointError, match="CUDA generator"):
        restore_rng(state)


# --- metadata ----------------------------------------------------------------------------------


def test_metadata_round_trip_dir_and_file(tmp_path):
    def write(staging):
        write_metadata(
            staging,
            trainer_class="MAGRPOTrainer",
            sequence=3,
            run_id=RUN_ID,
            wandb={"id": "abc123", "project": "p", "entity": "", "name": "ignored"},
            extra={"global_step": 12},
        )
        save_tensors(staging / "model.safetensors", {"w": torch.ones(2)})

    target = tmp_path / "ckpt"
    publish_dir(target, write)
    expected = {
        "version": CHECKPOINT_VERSION,
        "trainer_class": "MAGRPOTrainer",
        "sequence": 3,
        "run_id": RUN_ID,
        "wandb": {"id": "abc123", "project": "p"},
    }
    assert read_checkpoint_metadata(target) == expected
    assert read_checkpoint_metadata(str(target / METADATA)) == expected
    assert json.loads((target / METADATA).read_text())["global_step"] == 12

    # A cheap read: weights are not checked.
    (target / "model.safetensors").write_bytes(b"broken")
    assert read_checkpoint_metadata(target) == expected


def write_raw(tmp_path, body):
    text = body if isinstance(body, str) else json.dumps(body)
    (tmp_path / METADATA).write_text(text)
    return tmp_path


GOOD = {"version": 1, "trainer_class": "IAC", "sequence": 0, "run_id": RUN_ID, "wandb": None}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "Unsupported checkpoint version"),
        ({"version": "1"}, "Unsupported checkpoint version"),
        ({"version": True}, "Unsupported checkpoint version"),
        ({"trainer_class": ""}, "trainer_class"),
        ({"trainer_class": 5}, "trainer_class"),
        ({"sequence": -1}, "sequence"),
        ({"sequence": True}, "sequence"),
        ({"sequence": "3"}, "sequence"),
        ({"run_id": ""}, "run_id"),
        ({"run_id": "not-hex"}, "run_id"),
        ({"run_id": 12}, "run_id"),
        ({"wandb": "abc"}, "wandb"),
        ({"wandb": {}}, "wandb"),
        ({"wandb": {"id": ""}}, "wandb"),
        ({"wandb": {"project": "p"}}, "wandb"),
    ],
)
def test_metadata_field_errors(tmp_path, change, message):
    write_raw(tmp_path, {**GOOD, **change})
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_metadata(tmp_path)


@pytest.mark.parametrize("field", list(GOOD))
def test_metadata_missing_field(tmp_path, field):
    write_raw(tmp_path, {k: v for k, v in GOOD.items() if k != field})
    with pytest.raises(CheckpointError, match=f"missing field.*{field}"):
        read_checkpoint_metadata(tmp_path)


@pytest.mark.parametrize(("body", "message"), [("{oops", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_metadata_bad_file(tmp_path, body, message):
    write_raw(tmp_path, body)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_metadata(tmp_path / METADATA)


def test_metadata_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.json not found: .* is not a training checkpoint"):
        read_checkpoint_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        read_checkpoint_metadata(tmp_path / "nowhere")


def test_write_metadata_validates(tmp_path):
    with pytest.raises(CheckpointError, match="run_id"):
        write_metadata(tmp_path, trainer_class="IAC", sequence=0, run_id="xyz", wandb=None)
    with pytest.raises(ValueError, match="sequence"):
        write_metadata(tmp_path, trainer_class="IAC", sequence=0, run_id=RUN_ID, wandb=None, extra={"sequence": 1})
    assert not (tmp_path / METADATA).exists()


def merge_identity(checkpoint, wandb_config):
    """The documented user snippet, verbatim."""
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity and "id" not in wandb_config and "resume" not in wandb_config:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    return wandb_config


@pytest.mark.parametrize(
    ("wandb", "config", "expected"),
    [
        (
            {"id": "run1", "project": "p"},
            {"project": "p", "tags": ["a"]},
            {"project": "p", "tags": ["a"], "id": "run1", "resume": "allow"},
        ),
        ({"id": "run1"}, {"id": "mine"}, {"id": "mine"}),
        ({"id": "run1"}, {"resume": "never"}, {"resume": "never"}),
        (None, {"project": "p"}, {"project": "p"}),
    ],
)
def test_wandb_merge_snippet(tmp_path, wandb, config, expected):
    write_metadata(tmp_path, trainer_class="IAC", sequence=1, run_id=RUN_ID, wandb=wandb)
    assert merge_identity(tmp_path, config) == expected

"""Small helpers shared by test modules."""

import contextlib
import datetime
import hashlib
import json
import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file


def reward_rise(history: list[dict], key: str = "turn_1/reward_mean") -> tuple[float, float]:
    """Mean ``key`` over the first and the last quarter of the logged training steps."""
    rewards = [h[key] for h in history if key in h]
    quarter = max(len(rewards) // 4, 1)
    return sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter


def spec_for(tiny_models, tmp_path, algorithm="magrpo", **changes):
    """The demo spec, shrunk to a 2-epoch run of one epoch per stage, with ``changes`` applied."""
    from flows.cli import demo_spec
    from tasks.spec import RunSpec

    spec = demo_spec(algorithm, {k: Path(v) for k, v in tiny_models.items()}, str(tmp_path / "runs"))
    spec["config"].update(num_train_epochs=2, max_new_tokens=6, eval_interval=0)
    spec["config"].update(changes.pop("config", {}))
    spec["stage_epochs"] = 1
    spec.update(changes)
    return RunSpec(**spec)


def exported_weights(result: dict) -> dict:
    """Every ``model.safetensors`` under a local export, by relative path, copied into memory (a
    safetensors load maps the file, so a test that later damages it would change these too)."""
    local = Path(result["uri"])
    return {p.relative_to(local).as_posix(): {k: t.clone() for k, t in load_file(p).items()}
            for p in sorted(local.rglob("model.safetensors"))}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])


def damage_consistently(checkpoint: Path, how: str) -> None:
    """Damage a checkpoint so that its manifest still matches: a truncated weights file, or a
    ``state.pt`` holding a pickled object that is not plain training state; then reseal the manifest."""
    if how == "truncated-weights":
        target = checkpoint / "agents" / "0.safetensors"
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        target = checkpoint / "state.pt"
        target.write_bytes(pickle.dumps(datetime.date(2026, 12, 7)))
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    rel = target.relative_to(checkpoint).as_posix()
    manifest["files"][rel] = {**manifest["files"][rel], "size": target.stat().st_size,
                              "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


@contextlib.contextmanager
def s3_server(monkeypatch, bucket: str):
    """A real S3-compatible HTTP server (moto) on loopback, the AWS environment pointing at it, and a bucket."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield f"http://{host}:{port}"
    finally:
        server.stop()

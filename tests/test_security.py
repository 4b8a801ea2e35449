"""Security: no credential in any output, no path outside the run's prefix, no code run on load by default."""

import ast
import asyncio
import json
import os
import pickle
import shutil
import tempfile
import traceback
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prefect.client.orchestration import get_client
from prefect.settings import get_current_settings
from prefect.testing.utilities import prefect_test_harness
from pydantic import ValidationError

from comlrl_core.checkpoint import MANIFEST, CheckpointError, publish_dir, sha256_file, verify_dir
from comlrl_core.environments import length_ratio_dataset, length_ratio_reward
from comlrl_core.storage import LocalStorage, StorageError, open_storage, safe_key
from comlrl_core.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from flows.cli import demo_spec
from flows.pipeline import train_pipeline
from tasks.launch import free_port
from tasks.spec import RunSpec
from tasks.stages import _initial_export, initial_agents

from helpers import s3_server, spec_for

ROOT = Path(__file__).parent.parent
BUCKET = "comlrl-secrets"


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=90):
        yield


# ---- no credentials in any output ------------------------------------------------------------------------

def _sentinels() -> dict[str, str]:
    """Unique fake secrets; moto and offline W&B accept any value."""
    return {"AWS_ACCESS_KEY_ID": f"AKIA{uuid.uuid4().hex[:16].upper()}",
            "AWS_SECRET_ACCESS_KEY": f"sentinelAwsSecret{uuid.uuid4().hex}",
            "WANDB_API_KEY": uuid.uuid4().hex + uuid.uuid4().hex[:8]}


class Scan:
    """Every output checked, by where it came from, and the sentinels found in it."""

    def __init__(self, secrets: dict[str, str]):
        self.secrets = {name: value.encode() for name, value in secrets.items()}
        self.records = 0
        self.hits: list[str] = []

    def text(self, where: str, text: str | bytes) -> None:
        data = text.encode("utf-8", "replace") if isinstance(text, str) else text
        self.records += 1
        self.hits += [f"{name} in {where}" for name, value in self.secrets.items() if value in data]

    def tree(self, root: Path) -> int:
        files = [p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()]
        for path in files:
            self.text(str(path), path.read_bytes())
        return len(files)


async def _prefect_records() -> list[tuple[str, str]]:
    """Every flow run, task run, log and artifact the test API holds, as JSON text."""
    records = []
    async with get_client() as client:
        for kind, read in (("flow run", client.read_flow_runs), ("task run", client.read_task_runs),
                           ("log", client.read_logs), ("artifact", client.read_artifacts)):
            offset = 0
            while page := await read(limit=200, offset=offset):
                records += [(kind, item.model_dump_json()) for item in page]
                offset += len(page)
    return records


def _error_text(exc: BaseException) -> str:
    """The exception as a user sees it: message, chained causes and full traceback."""
    return "".join(traceback.format_exception(exc))


def test_no_credentials_in_any_output(tiny_models, tmp_path, monkeypatch, capfd, caplog, prefect_api):
    secrets = _sentinels()
    scan = Scan(secrets)
    for name, path in {"COMLRL_WORK_DIR": "work", "COMLRL_CACHE_DIR": "cache", "WANDB_DIR": "wandb-env"}.items():
        (tmp_path / path).mkdir()
        monkeypatch.setenv(name, str(tmp_path / path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", secrets["WANDB_API_KEY"])
    with s3_server(monkeypatch, BUCKET) as endpoint:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(name, secrets[name])
        wandb = {"project": "comlrl-secrets", "mode": "offline", "dir": str(tmp_path / "wandb")}
        spec = spec_for(tiny_models, tmp_path, storage=f"s3://{BUCKET}/runs", wandb=wandb, checkpoint_steps=1,
                        config={"num_train_epochs": 1}, train_dataset={"builtin": "length_ratio", "size": 2})
        assert train_pipeline(spec, return_state=True).is_completed()

        # A stage that fails: its exception and traceback, as the flow state hands them back.
        monkeypatch.setenv("COMLRL_FAULT_MARKER", str(tmp_path / "fault"))
        monkeypatch.setenv("COMLRL_FAULT_AT", "1")
        failing = spec.model_copy(update={"reward_func": "pipeline_faults:fail_once"})
        failed = train_pipeline(failing, return_state=True)
        assert failed.is_failed() and (tmp_path / "fault").exists()
        with pytest.raises(RuntimeError, match="injected failure") as stage_error:
            failed.result()
        scan.text("failed stage traceback", _error_text(stage_error.value))

        s3 = boto3.client("s3")
        objects = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
                   for o in page.get("Contents", [])]
        for key in objects:
            reply = s3.get_object(Bucket=BUCKET, Key=key)
            scan.text(f"s3://{BUCKET}/{key}", json.dumps(reply["Metadata"]).encode() + reply["Body"].read())

        # Wrong credentials: moto checks keys once auth is on, and none is known.
        def auth_after(requests: bytes) -> None:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=requests,
                                                          headers={"Content-Type": "text/plain"})).read()

        auth_after(b"0")
        try:
            monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
            with pytest.raises(StorageError, match="InvalidAccessKeyId") as denied:
                open_storage(spec.storage).get_text(f"{spec.name}/LATEST")
        finally:
            auth_after(b"inf")
        scan.text("wrong-credentials StorageError", _error_text(denied.value))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(StorageError, match="after 1 attempts") as unreachable:
        open_storage(spec.storage).put_text("probe", "x")
    scan.text("unreachable-endpoint StorageError", _error_text(unreachable.value))

    control = Scan(secrets)
    control.text("the environment the run saw", json.dumps(dict(os.environ)))
    assert len(control.hits) == len(secrets)  # every sentinel was live, and the scan finds it

    captured = capfd.readouterr()
    scan.text("stdout", captured.out)
    scan.text("stderr", captured.err)
    scan.text("caplog", caplog.text)
    prefect = asyncio.run(_prefect_records())
    for kind, record in prefect:
        scan.text(f"prefect {kind}", record)
    home = Path(get_current_settings().home)
    database = Path(get_current_settings().server.database.connection_url.get_secret_value().split("///", 1)[1])
    local_files = scan.tree(tmp_path) + scan.tree(home) + scan.tree(database.parent)
    wandb_files = list((tmp_path / "wandb").rglob("*.wandb"))
    print(f"\nsecrets: {len(scan.secrets)} sentinels; scanned {scan.records} outputs: {len(objects)} S3 objects, "
          f"{local_files} local files ({len(wandb_files)} W&B run files), {len(prefect)} Prefect records, "
          f"3 error tracebacks; {len(scan.hits)} hits")
    assert objects and wandb_files and any(kind == "log" for kind, _ in prefect)
    assert scan.hits == []


def test_credentials_in_the_endpoint_url_stay_out_of_errors(monkeypatch):
    secret = _sentinels()["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://minio:{secret}@127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises((StorageError, ValueError)) as error:
        open_storage(f"s3://{BUCKET}/runs").get_text("probe")
    assert secret not in _error_text(error.value)


@pytest.mark.parametrize("where, change", [
    ("storage", lambda secret: {"storage": f"s3://AKIAEXAMPLE:{secret}@{BUCKET}/runs"}),
    ("agent_model", lambda secret: {"agent_model": f"https://user:{secret}@models.example/qwen"}),
    ("train_dataset.path", lambda secret: {"train_dataset": {"path": f"https://x:{secret}@data.example/set"}}),
    ("wandb.api_key", lambda secret: {"wandb": {"project": "p", "api_key": secret}}),
    ("model_options.token", lambda secret: {"model_options": {"token": secret}}),
])
def test_a_credential_in_a_spec_is_refused_unechoed_before_a_flow_run_exists(tiny_models, tmp_path, capfd, prefect_api,
                                                                          where, change):
    from flows.cli import main as cli_main

    secret = _sentinels()["AWS_SECRET_ACCESS_KEY"]
    data = {**spec_for(tiny_models, tmp_path).model_dump(mode="json"), **change(secret)}
    with pytest.raises(ValidationError) as refused:
        RunSpec(**data)
    assert where in str(refused.value) and secret not in _error_text(refused.value)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(data))
    def flow_runs() -> int:
        return sum(kind == "flow run" for kind, _ in asyncio.run(_prefect_records()))

    runs_before = flow_runs()
    assert cli_main(["run", str(spec_file)]) == 2
    output = "".join(capfd.readouterr())
    assert where in output and "a credential in a run spec is refused" in output and secret not in output
    assert flow_runs() == runs_before  # no flow run, so no stored parameter


def test_a_credential_in_a_storage_uri_is_refused_unechoed():
    secret = _sentinels()["AWS_SECRET_ACCESS_KEY"]
    with pytest.raises(ValueError, match=r"storage='s3://\*\*\*@bucket/runs' holds credentials") as refused:
        open_storage(f"s3://AKIAEXAMPLE:{secret}@bucket/runs")
    assert secret not in _error_text(refused.value)


# ---- path safety -----------------------------------------------------------------------------------------

HOSTILE = st.one_of(
    st.text(),
    st.lists(st.sampled_from(["..", ".", "", "a", "b-1", "~", "/", "\\", "%2e%2e", "\x00", "..\\", "é", " "]),
             max_size=6).map("/".join),
    st.sampled_from(["/etc/passwd", "../escape", "a/../../b", "a/./b", "//x", "C:\\x", "~/x", "a/\n/b"]),
)


def _inside(root: Path, key: str) -> bool:
    return (root / key).resolve().is_relative_to(root.resolve())


@settings(max_examples=300, deadline=None)
@given(HOSTILE)
def test_safe_key_never_leaves_the_root(key):
    root = Path(tempfile.gettempdir()) / "comlrl-root"
    try:
        normal = safe_key(key)
    except ValueError:
        return
    parts = normal.split("/")
    assert normal and ".." not in parts and "." not in parts and "" not in parts
    assert _inside(root, normal) and safe_key(normal) == normal


@settings(max_examples=100, deadline=None)
@given(HOSTILE)
def test_run_names_are_refused_or_stay_inside_storage(name):
    root = Path(tempfile.gettempdir()) / "comlrl-root"
    base = demo_spec("magrpo", {"qwen2-tiny": Path("q"), "llama-tiny": Path("l")}, str(root))
    try:
        spec = RunSpec(**{**base, "name": name})
    except ValidationError as exc:
        assert "name" in str(exc)
        return
    storage = LocalStorage(root)
    for key in (spec.run_key, f"{spec.name}/LATEST"):
        assert _inside(root, key) and Path(storage.uri(key)).resolve().is_relative_to(root)


@pytest.mark.parametrize("rel", ["../outside.bin", "../../outside.bin", "/tmp/outside.bin", "a/../../outside.bin",
                                 "./a.bin", "a//b.bin"])
def test_a_manifest_naming_files_outside_is_refused(tmp_path, rel):
    root = tmp_path / "store"
    storage = LocalStorage(root)
    publish_dir(root / "run" / "ck", lambda staging: (staging / "w.bin").write_bytes(b"weights"))
    evil = tmp_path / "outside.bin"
    evil.write_bytes(b"payload")  # a real file behind the hostile name, so only the name check can refuse it
    manifest_path = root / "run" / "ck" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][rel] = {"sha256": sha256_file(evil), "size": evil.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="malformed entry"):
        storage.get_dir("run/ck", tmp_path / "download" / "ck")
    with pytest.raises(CheckpointError):
        verify_dir(root / "run" / "ck")
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written anywhere


def test_a_tampered_latest_pointer_cannot_point_the_cache_outside(tmp_path, monkeypatch):
    monkeypatch.setenv("COMLRL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "exports").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    (outside / "agent_0").mkdir(parents=True)
    base = demo_spec("magrpo", {"qwen2-tiny": Path("q"), "llama-tiny": Path("l")}, str(tmp_path / "store"))
    spec = RunSpec(**{**base, "init_from": "latest"})
    storage = open_storage(spec.storage)
    storage.put_text(f"{spec.name}/LATEST", json.dumps({"key": "x", "uri": "x", "digest": "../../elsewhere"}))
    with pytest.raises((ValueError, CheckpointError), match="LATEST"):
        initial_agents(spec, _initial_export(spec, storage))


# ---- safe loading by default -----------------------------------------------------------------------------

def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func), {k.arg: k.value for k in node.keywords}


def test_the_source_never_unpickles_or_trusts_remote_code():
    """``torch.load`` only with ``weights_only=True``; no raw pickle; ``trust_remote_code`` never hard-coded on."""
    files = sorted(p for d in ("comlrl_core", "tasks", "flows") for p in (ROOT / d).rglob("*.py"))
    findings, loads = [], 0
    for path in files:
        for node, name, kwargs in _calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name.endswith("torch.load") or name == "load" and "weights_only" in kwargs:
                loads += 1
                flag = kwargs.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    findings.append(f"{where}: {ast.unparse(node)} without weights_only=True")
            if name in ("pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "dill.load"):
                findings.append(f"{where}: {name}")
            flag = kwargs.get("trust_remote_code")
            if isinstance(flag, ast.Constant) and flag.value is True:
                findings.append(f"{where}: trust_remote_code=True")
        findings += [f"{path.relative_to(ROOT)}: 'trust_remote_code': True" for _ in
                     range(path.read_text().count('"trust_remote_code": True'))]
    print(f"\nsafe loading: {len(files)} source files, {loads} torch.load calls; {len(findings)} findings")
    assert loads >= 1 and findings == []


class _Payload:
    """Unpickling this opens (creates) ``marker``: any code execution on load leaves the file behind."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _checkpoint(tiny_models, tmp_path) -> tuple[Path, MAGRPOTrainer]:
    config = MAGRPOConfig(num_train_epochs=1, max_new_tokens=4, num_generations=2, rollout_buffer_size=1,
                          verbose=False)

    def make():
        return MAGRPOTrainer(agent_model=tiny_models["qwen2-tiny"], num_agents=2, reward_func=length_ratio_reward,
                             train_dataset=length_ratio_dataset(1), args=config)

    make().train(checkpoint_dir=tmp_path / "ck", checkpoint_steps=1)
    return tmp_path / "ck" / "checkpoint-1", make()


def test_a_pickle_planted_in_a_checkpoint_is_refused_without_running(tiny_models, tmp_path):
    live = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Payload(live)))
    assert live.exists()  # the payload does run when unpickled
    marker = tmp_path / "marker"
    checkpoint, trainer = _checkpoint(tiny_models, tmp_path)
    torch.save({"optimizers": _Payload(marker)}, checkpoint / "state.pt")
    manifest = json.loads((checkpoint / MANIFEST).read_text())  # consistent again: only the loader can refuse
    manifest["files"]["state.pt"] = {"sha256": sha256_file(checkpoint / "state.pt"),
                                     "size": (checkpoint / "state.pt").stat().st_size}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    verify_dir(checkpoint)
    with pytest.raises(CheckpointError, match=r"state\.pt.*never unpickled"):
        trainer.load_checkpoint(checkpoint)
    assert not marker.exists()


def _custom_code_model(tiny_models, tmp_path) -> tuple[Path, Path]:
    """A copy of a tiny model whose config maps to a module in its directory that creates a marker on import."""
    model = tmp_path / "custom-model"
    shutil.copytree(tiny_models["qwen2-tiny"], model)
    marker = tmp_path / "remote-code-ran"
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="comlrl-custom", auto_map={"AutoConfig": "custom.CustomConfig",
                                                          "AutoModelForCausalLM": "custom.CustomModel"})
    (model / "config.json").write_text(json.dumps(config))
    # Subclasses, so that loading them (which registers them for auto classes) leaves Qwen2 itself untouched.
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
                                     "class CustomConfig(Qwen2Config):\n    model_type = 'comlrl-custom'\n"
                                     "class CustomModel(Qwen2ForCausalLM):\n    config_class = CustomConfig\n")
    return model, marker


def test_custom_model_code_is_refused_unless_the_spec_opts_in(tiny_models, tmp_path, monkeypatch, prefect_api):
    model, marker = _custom_code_model(tiny_models, tmp_path)
    asked = []  # transformers asks on stdin when the flag is left unset: a "y" there must not count as consent
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    spec = spec_for({**tiny_models, "qwen2-tiny": str(model)}, tmp_path, config={"num_train_epochs": 1})
    assert spec.model_options is None
    with pytest.raises(ValueError, match=r"custom-model.*model_options in a run spec"):
        train_pipeline(spec)
    assert not marker.exists() and asked == []
    with pytest.raises(TypeError, match=r"trust_remote_code.*True or False"):
        MAGRPOTrainer.check_entities(spec.trainer_config(), agent_model=str(model),
                                     model_config={"trust_remote_code": "false"})
    assert not marker.exists()
    MAGRPOTrainer.check_entities(spec.trainer_config(), agent_model=str(model),
                                 model_config={"trust_remote_code": True})
    assert marker.exists()  # the explicit opt-in, and only it, runs the model's code

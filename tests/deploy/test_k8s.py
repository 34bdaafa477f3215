"""deploy/k8s: every built-in object validates against the Kubernetes OpenAPI schema (strict:
unknown fields are errors) with ``kubernetes-validate``, which bundles the schemas (no network);
the KubeRay ``RayCluster`` is checked against the fields its CRD requires, and its pod templates
against the Kubernetes schema; and the objects agree with each other (secrets, selectors,
ports, the head's Service name in ``RAY_ADDRESS``, one image and one Ray version)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBERNETES = "1.30.0"
#: KubeRay names the head's Service after the RayCluster (the operator's ``<name>-head-svc``)
HEAD_SERVICE = "{}-head-svc"


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


# ---- KubeRay ---------------------------------------------------------------------------

def raycluster_problems(doc: dict[str, Any]) -> list[str]:
    """What the RayCluster CRD (ray.io/v1) requires: ``spec.headGroupSpec`` with ``template``
    (and ``rayStartParams``, required before KubeRay 1.4), each ``workerGroupSpecs`` item with
    ``groupName``, ``minReplicas``, ``maxReplicas``, ``rayStartParams`` and ``template``;
    ``rayStartParams`` maps strings to strings; replicas within [min, max]; each pod template a
    valid Kubernetes ``PodTemplateSpec``."""
    problems: list[str] = []
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayCluster":
        return [f"not a ray.io/v1 RayCluster: {doc.get('apiVersion')} {doc.get('kind')}"]
    if not doc.get("metadata", {}).get("name"):
        problems.append("metadata.name is missing")
    spec = doc.get("spec") or {}
    groups: list[tuple[str, dict[str, Any]]] = []
    if "headGroupSpec" not in spec:
        problems.append("spec.headGroupSpec is missing")
    else:
        groups.append(("spec.headGroupSpec", spec["headGroupSpec"]))
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        where = f"spec.workerGroupSpecs[{i}]"
        for field in ("groupName", "minReplicas", "maxReplicas"):
            if field not in group:
                problems.append(f"{where}.{field} is missing")
        counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas") if k in group]
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
            problems.append(f"{where}: replica counts must be non-negative integers")
        elif counts != sorted(counts):
            problems.append(f"{where}: needs minReplicas <= replicas <= maxReplicas")
        groups.append((where, group))
    for where, group in groups:
        params = group.get("rayStartParams")
        if not isinstance(params, dict):
            problems.append(f"{where}.rayStartParams is missing")
        elif any(not isinstance(v, str) for v in params.values()):
            problems.append(f"{where}.rayStartParams: values must be strings (quote numbers)")
        if "template" not in group:
            problems.append(f"{where}.template is missing")
            continue
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                        "template": group["template"]}
        try:
            validate(pod_template)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}.template: {e.message} at {'.'.join(map(str, e.path))}")
    return problems


# ---- tests -----------------------------------------------------------------------------

def test_builtin_objects_validate_strictly() -> None:
    kinds = []
    for doc in documents():
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        validate(doc)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "Deployment", "Secret", "Service", "Service", "StatefulSet"]


def test_the_validator_rejects_a_broken_object() -> None:
    api = copy.deepcopy(next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "pipette-api"))
    api["spec"]["template"]["spec"]["containers"][0]["imagePullPolicies"] = "Always"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(api)
    del api["spec"]["template"]["spec"]["containers"][0]["imagePullPolicies"]
    api["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(api)


def test_the_raycluster_has_what_its_crd_requires() -> None:
    (ray,) = by_kind("RayCluster")
    assert raycluster_problems(ray) == []
    workers = ray["spec"]["workerGroupSpecs"]
    for group in [ray["spec"]["headGroupSpec"], *workers]:  # GPU nodes, all of them (see the manifest)
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"]
        assert any(v["name"] == "shm" for v in group["template"]["spec"]["volumes"])


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda r: r["spec"].pop("headGroupSpec"), "headGroupSpec is missing"),
    (lambda r: r["spec"]["workerGroupSpecs"][0].pop("groupName"), "groupName is missing"),
    (lambda r: r["spec"]["workerGroupSpecs"][0].update(replicas=99), "minReplicas <= replicas"),
    (lambda r: r["spec"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-gpus": 8}), "must be strings"),
    (lambda r: r["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imag="x"), "imag"),
    (lambda r: r["spec"]["workerGroupSpecs"][0].pop("template"), "template is missing"),
])
def test_the_raycluster_check_catches(edit: Any, problem: str) -> None:
    (ray,) = by_kind("RayCluster")
    broken = copy.deepcopy(ray)
    edit(broken)
    assert any(problem in p for p in raycluster_problems(broken)), raycluster_problems(broken)


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for doc in documents():
        spec = doc.get("spec") or {}
        if doc["kind"] in ("Deployment", "StatefulSet"):
            out.append((doc["metadata"]["name"], spec["template"]["spec"]))
        if doc["kind"] == "RayCluster":
            out.append(("ray-head", spec["headGroupSpec"]["template"]["spec"]))
            out += [(g["groupName"], g["template"]["spec"]) for g in spec["workerGroupSpecs"]]
    return out


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_secrets_referenced_exist() -> None:
    (secret,) = by_kind("Secret")
    keys = set(secret["stringData"])
    for name, pod in _pod_specs():
        for c in _containers(pod):
            for value in _env(c).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    ref = value["secretKeyRef"]
                    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, (name, ref)


def test_services_select_pods_and_ports() -> None:
    workloads = [d for d in documents() if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in by_kind("Service"):
        selected = [w for w in workloads
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, svc["metadata"]["name"]
        (workload,) = selected
        assert workload["spec"]["selector"]["matchLabels"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()
        named = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, (svc["metadata"]["name"], port)
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == svc["metadata"]["name"]


def test_the_scheduler_reaches_the_ray_head_and_the_database() -> None:
    (ray,) = by_kind("RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    client_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "client")
    (secret,) = by_kind("Secret")
    db = urlsplit(secret["stringData"]["database-url"])
    (pg_service,) = [s for s in by_kind("Service") if s["metadata"]["name"] == db.hostname]
    assert db.port == pg_service["spec"]["ports"][0]["port"]
    assert db.username == "pipette" and db.path == "/pipette"
    for deployment in by_kind("Deployment"):
        for c in _containers(deployment["spec"]["template"]["spec"]):
            env = _env(c)
            if "RAY_ADDRESS" in env:
                assert env["RAY_ADDRESS"] == f"ray://{HEAD_SERVICE.format(ray['metadata']['name'])}:{client_port}"
    scheduler = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "pipette-scheduler")
    env = _env(scheduler["spec"]["template"]["spec"]["containers"][0])
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"]["secretKeyRef"]["key"] == "ray-auth-token"
    for group in [ray["spec"]["headGroupSpec"], *ray["spec"]["workerGroupSpecs"]]:
        ray_env = _env(group["template"]["spec"]["containers"][0])
        assert ray_env["RAY_AUTH_TOKEN"] == env["RAY_AUTH_TOKEN"] and ray_env["RAY_AUTH_MODE"] == "token"


def test_migrations_run_before_the_api() -> None:
    api = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "pipette-api")
    pod = api["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "service.admin", "migrate"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = container["command"][container["command"].index("--port") + 1]
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]


def test_one_image_and_one_ray_version() -> None:
    images = {c["image"] for name, pod in _pod_specs() if name != "pipette-postgres" for c in _containers(pod)}
    assert len(images) == 1, images
    (ray,) = by_kind("RayCluster")
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    match = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert match and ray["spec"]["rayVersion"] == match.group(1)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
    (image,) = images
    override = kustomization["images"][0]
    assert image == f"{override['name']}:{override['newTag']}"

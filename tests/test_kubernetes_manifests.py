"""deploy/kubernetes/: every manifest is valid against Kubernetes' own schemas (kubernetes-validate, strict:
an unknown or misspelled field fails), and the pod runs flags `engine serve` accepts, on the port its probes
and Service use, with a grace period longer than the server's drain."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import REPO_ROOT

from engine.kv_events import KVEventsConfig

MANIFESTS = sorted(Path(REPO_ROOT, "deploy", "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.30"


def _documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pods_of_leader_worker_set(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's leader and worker templates as Pods: the CRD's own schema is not in Kubernetes',
    but its templates are core PodTemplateSpecs, checked as such (the rest of it by the test below)."""
    template = doc["spec"]["leaderWorkerTemplate"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{role}", **template[key]["metadata"]},
            "spec": template[key]["spec"],
        }
        for role, key in (("leader", "leaderTemplate"), ("worker", "workerTemplate"))
    ]


@pytest.mark.parametrize("doc", _documents(), ids=lambda doc: doc["kind"])
def test_every_manifest_is_valid_kubernetes(doc: dict[str, Any]) -> None:
    if doc["kind"] == "LeaderWorkerSet":
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        for pod in _pods_of_leader_worker_set(doc):
            kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_leader_worker_set_serves_over_ray_from_the_leader() -> None:
    """The multi-node group: the leader starts Ray's head and runs flags `engine serve` accepts (the Ray
    backend), each worker joins the leader's address, the Service selects the leader, and the image the pods
    run installs Ray."""
    import shlex

    from engine.cli import build_parser

    doc = next(d for d in _documents() if d["kind"] == "LeaderWorkerSet")
    template = doc["spec"]["leaderWorkerTemplate"]
    assert template["size"] >= 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _pods_of_leader_worker_set(doc)
    script = leader["spec"]["containers"][0]["args"][0]
    ray_start, serve = (part.strip() for part in script.split("&&"))
    assert ray_start.startswith("ray start --head --port=6379")
    words = shlex.split(serve)
    assert words[:3] == ["exec", "engine", "serve"]
    args = build_parser().parse_args(words[2:])
    assert args.distributed_executor_backend == "ray" and args.data_parallel_size == template["size"]
    assert leader["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    ports = {p["name"]: p["containerPort"] for p in leader["spec"]["containers"][0]["ports"]}
    assert ports["http"] == args.port and ports["ray"] == 6379
    assert worker["spec"]["containers"][0]["args"] == [
        "ray start --address=$(LWS_LEADER_ADDRESS):6379 --num-gpus=1 --block"
    ]
    service = next(
        d for d in _documents() if d["kind"] == "Service" and d["metadata"]["name"] == doc["metadata"]["name"]
    )
    assert service["spec"]["selector"] == {**leader["metadata"]["labels"]}
    dockerfile = Path(REPO_ROOT, "docker", "Dockerfile.cuda").read_text()
    assert "requirements.py --extra ray" in dockerfile


def test_the_validator_catches_a_misspelled_field() -> None:
    deployment = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_pod_runs_flags_engine_serve_accepts() -> None:
    from engine.cli import build_parser

    deployment = next(d for d in _documents() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The image's entry point (docker/Dockerfile.cuda), then the container's args.
    dockerfile = Path(REPO_ROOT, "docker", "Dockerfile.cuda").read_text()
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.MULTILINE)[-1])
    assert entrypoint[:2] == ["engine", "serve"]
    args = build_parser().parse_args([*entrypoint[1:], *container["args"]])
    assert KVEventsConfig.parse(args.kv_events_config).enable_kv_cache_events
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    assert ports["kv-events"] == int(KVEventsConfig.parse(args.kv_events_config).endpoint.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user (docker/README.md)
    service = next(d for d in _documents() if d["kind"] == "Service" and d["metadata"]["name"] == "graph-engine")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"

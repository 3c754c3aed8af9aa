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


@pytest.mark.parametrize("doc", _documents(), ids=lambda doc: doc["kind"])
def test_every_manifest_is_valid_kubernetes(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


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
    service = next(d for d in _documents() if d["kind"] == "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"

"""Rendering Baton's Helm chart offline for the chart tests (helm-python-sdk, no helm binary,
no cluster): the value sets, the render, and lookups into the rendered manifests."""
from __future__ import annotations

import functools
import importlib.util
import json
import pathlib

import pytest

try:
    import helm_python
    import kubernetes_validate
    import yaml
except Exception as e:  # noqa: BLE001 - any import failure means: no way to render here
    pytest.skip(f"the chart tests need helm-python-sdk, kubernetes-validate and pyyaml: {e}",
                allow_module_level=True)

from baton.services.cli.main import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_golden", ROOT / "deploy" / "helm" / "render_golden.py")
render_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_golden)

CHART = render_golden.CHART
RELEASE, NAMESPACE = render_golden.RELEASE, render_golden.NAMESPACE
FULLNAME = f"{RELEASE}-baton"
OLDEST = "1.30"
NEWEST = ".".join(kubernetes_validate.latest_version().split(".")[:2])
CRD_GROUPS = ("monitoring.coreos.com",)
ENGINE_COMPONENTS = ("prefill", "decode", "colocated")

GPU = {"limits": {"nvidia.com/gpu": 1}}
VALUE_SETS: dict[str, dict] = {
    **render_golden.GOLDEN_VALUE_SETS,
    "gpu": {"engine": {"dtype": "bfloat16", "device": "cuda"},
            "prefill": {"resources": GPU}, "decode": {"resources": GPU}},
    "colocated": {"mode": "colocated", "colocated": {"replicas": 2, "resources": GPU},
                  "engine": {"dtype": "bfloat16", "device": "cuda"}, "networkPolicy": {"enabled": True}},
    "colocated-no-router": {"mode": "colocated", "router": {"enabled": False},
                            "networkPolicy": {"enabled": True, "clients": [{"namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]}},
    # Prefills of one GPU, decodes of four (tensor parallel) with a larger /dev/shm for NCCL.
    "tensor-parallel": {"engine": {"dtype": "bfloat16", "device": "cuda"}, "prefill": {"resources": GPU},
                        "decode": {"tensorParallelSize": 4, "shmSizeLimit": "16Gi", "resources": {
                            "limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1, "cpu": "4"}}}},
    "3-prefill-2-decode": {"prefill": {"replicas": 3}, "decode": {"replicas": 2},
                           "router": {"policy": "least_outstanding"},
                           "engine": {"blockSize": 16, "maxNumSeqs": 32, "kvHoldTimeout": 30.5}},
    "operations": {
        "prefill": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
                    "pdb": {"enabled": True, "minAvailable": 1}},
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8, "metrics": [
            {"type": "Pods", "pods": {"metric": {"name": "baton_num_requests_waiting"},
                                      "target": {"type": "AverageValue", "averageValue": "4"}}}]},
                   "pdb": {"enabled": True}},
        "router": {"autoscaling": {"enabled": True}, "pdb": {"enabled": True}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "networkPolicy": {"enabled": True},
        "metrics": {"podAnnotations": True},
        "ucx": {"tcpPortRange": "31000-31063", "netDevices": "eth0"},
        "tracing": {"otlpEndpoint": "http://otel-collector:4317", "samplerArg": 0.25},
    },
    "podmonitor-networkpolicy-any-port": {"podMonitor": {"enabled": True}, "networkPolicy": {"enabled": True}},
    "tls-mtls": {"tls": {"enabled": True, "secretName": "baton-tls", "serverName": "baton.internal"}},
    "tls-server-only": {"tls": {"enabled": True, "secretName": "baton-tls", "serverName": "baton.internal",
                                "mtls": False}},
    "rdma": {"ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1", "rdma": {"enabled": True}},
             "decode": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}}},
    "model-hostpath": {"model": {"pvc": {"claimName": ""}, "hostPath": {"path": "/data/models"}},
                       "engine": {"model": "smollm2-135m-instruct"}},
    "model-init-image": {"model": {"pvc": {"claimName": ""}, "initImage": {"image": "registry.example/models:1",
                                                              "sizeLimit": "2Gi"}}},
    "model-image-volume": {"model": {"pvc": {"claimName": ""}, "image": {"reference": "registry.example/models:1"}}},
    "long-names": {"fullnameOverride": "a-very-long-release-name-for-a-baton-deployment-in-production-x"},
}
# OCI image volumes are in the Kubernetes schema from 1.31 on: that value set is validated against
# 1.31 and the newest version (and 1.30 is checked to reject it).
MIN_VERSION = {"model-image-volume": "1.31"}


# --- rendering ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def chart():
    return helm_python.Chart.load(CHART)


@functools.cache
def _render(values_json: str) -> dict[str, str]:
    return chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)


def render(values: dict) -> dict[str, str]:
    return _render(json.dumps(values, sort_keys=True))


def manifests(values: dict) -> list[dict]:
    docs = []
    for path, text in sorted(render(values).items()):
        if not path.endswith("NOTES.txt"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def by_name(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in of_kind(docs, kind)]}"
    return found[0]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, pod labels, pod spec) of every Deployment's template and every Pod."""
    out = [(d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
           for d in of_kind(docs, "Deployment")]
    return out + [(d["metadata"]["name"], d["metadata"]["labels"], d["spec"]) for d in of_kind(docs, "Pod")]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_ports(spec: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def parse(container: dict):
    """The container's command line as `baton` (the image's entrypoint) parses it."""
    assert "command" not in container, "the image's entrypoint `baton` must stay the command"
    argv = list(container["args"])
    assert all(isinstance(a, str) for a in argv), argv
    return build_parser().parse_args(argv)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def component(labels: dict) -> str:
    return labels["app.kubernetes.io/component"]

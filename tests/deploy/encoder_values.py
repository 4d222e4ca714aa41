"""Value sets of the chart's optional encoder tier (E/P/D) beside the golden one ("encoder-gpu" in
deploy/helm/render_golden.py, and so in helm_render.VALUE_SETS): the chart tests render, lint,
validate and wire them as they do VALUE_SETS."""
from __future__ import annotations

ENCODER = "encoder"

GPU = {"limits": {"nvidia.com/gpu": 1}}
ENCODER_VALUE_SETS: dict[str, dict] = {
    # Colocated servers behind the router read the embeddings: they take UCX from the encoders too.
    "encoder-colocated": {"mode": "colocated", "colocated": {"replicas": 2, "resources": GPU},
                          "engine": {"model": "qwen2.5-vl-3b-instruct", "dtype": "bfloat16", "device": "cuda"},
                          "encoder": {"replicas": 1, "engine": {"device": "cuda:0"}, "resources": GPU},
                          "networkPolicy": {"enabled": True}, "podMonitor": {"enabled": True}},
    # An autoscaled encoder tier (replicas stays 0: the HPA sets them) with a PDB, behind mTLS, over
    # RDMA, traced, with pod annotations for Prometheus (which the encoders, without metrics, skip).
    "encoder-autoscaling-tls-rdma": {
        "encoder": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6},
                    "pdb": {"enabled": True}, "probes": {"startup": {"failureThreshold": 30}},
                    "resources": GPU, "holdTimeoutSeconds": 12.5},
        "tls": {"enabled": True, "secretName": "baton-tls", "serverName": "baton.internal"},
        "ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1", "rdma": {"enabled": True}},
        "tracing": {"otlpEndpoint": "http://otel-collector:4317"},
        "metrics": {"podAnnotations": True},
    },
}


def encoder_on(merged: dict) -> bool:
    """Whether the chart runs an encoder tier for these (merged) values."""
    e = merged.get("encoder") or {}
    return e.get("replicas", 0) > 0 or bool((e.get("autoscaling") or {}).get("enabled"))

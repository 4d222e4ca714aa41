"""Render the Baton chart's golden value sets into tests/golden/ (tests/deploy/test_helm_chart.py
compares fresh renders with them).

    .venv/bin/python deploy/helm/render_golden.py

Each golden is the chart's templates, sorted by path, each after a `# Source: <path>` line
(as `helm template` prints them), with the generated internal token replaced by a placeholder:
it is random on every render (lookup finds no Secret without a cluster).
"""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "baton"
GOLDEN_DIR = ROOT / "tests" / "golden"
RELEASE = "llm"
NAMESPACE = "serving"
TOKEN_PLACEHOLDER = "<random internal token>"

GOLDEN_VALUE_SETS: dict[str, dict] = {
    "default": {},
    # GPU engines, 2 prefill x 3 decode, each prefill on two GPUs (tensor parallel, a larger /dev/shm
    # for NCCL), mTLS from a cert-manager Secret, tracing, a token Secret the operator made.
    "disaggregated-gpu-tls": {
        "model": {"pvc": {"claimName": "llm-models", "subPath": "hf"}, "servedModelName": "smollm2"},
        "engine": {"model": "smollm2-135m-instruct", "dtype": "bfloat16", "device": "cuda", "blockSize": 32,
                   "maxModelLen": 8192, "kvCacheMemoryBytes": 8589934592, "maxNumSeqs": 128},
        "prefill": {"replicas": 2, "engine": {"maxNumBatchedTokens": 8192}, "tensorParallelSize": 2,
                    "resources": {"limits": {"nvidia.com/gpu": 1}}, "shmSizeLimit": "8Gi",
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1}},
                   "nodeSelector": {"nvidia.com/gpu.present": "true"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "router": {"policy": "prefix_affinity", "replicas": 2},
        "tls": {"enabled": True, "secretName": "baton-tls", "serverName": "baton.serving.svc", "mtls": True},
        "internalToken": {"existingSecret": "baton-internal-token"},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4317",
                    "sampler": "parentbased_traceidratio", "samplerArg": "0.1"},
        "ucx": {"tls": "tcp", "tcpPortRange": "30000-30100"},
    },
    # E/P/D: a vision-language model on GPUs behind an encoder tier of two (its own slots, hold
    # timeout and media flags), with NetworkPolicies over a pinned UCX range and a ServiceMonitor
    # (which the encoders, without a metrics port, stay out of).
    "encoder-gpu": {
        "engine": {"model": "qwen2.5-vl-3b-instruct", "dtype": "bfloat16", "device": "cuda"},
        "prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "encoder": {"replicas": 2, "slots": 128, "holdTimeoutSeconds": 45,
                    "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": "2", "memory": "16Gi"}},
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "extraArgs": ["--allowed-media-domains", "images.example.com"]},
        "networkPolicy": {"enabled": True},
        "serviceMonitor": {"enabled": True},
        "ucx": {"tls": "tcp", "tcpPortRange": "30000-30100"},
    },
}

_TOKEN_LINE = re.compile(r"^(\s+[A-Za-z0-9_.-]+: )\"[A-Za-z0-9+/=]+\"$", re.M)


def normalise(path: str, text: str) -> str:
    """The text of one rendered template, with the random internal token replaced."""
    if path.endswith("/internal-token-secret.yaml"):
        text = _TOKEN_LINE.sub(lambda m: f'{m.group(1)}"{TOKEN_PLACEHOLDER}"', text)
    return text


def render_text(rendered: dict[str, str]) -> str:
    """One value set's render ({template path: text}, for RELEASE in NAMESPACE) as a single,
    deterministic text."""
    parts = []
    for path in sorted(rendered, key=lambda p: (p.endswith("NOTES.txt"), p)):  # NOTES last, as helm prints it
        text = rendered[path].strip("\n")
        if text.strip():
            parts.append(f"# Source: {path}\n{normalise(path, text)}\n")
    return "---\n".join(parts)


def golden_path(name: str) -> pathlib.Path:
    return GOLDEN_DIR / f"{name}.yaml"


def main() -> int:
    import helm_python

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    with helm_python.Chart.load(CHART) as chart:
        for name, values in GOLDEN_VALUE_SETS.items():
            path = golden_path(name)
            text = render_text(chart.render(values, name=RELEASE, namespace=NAMESPACE))
            changed = not path.exists() or path.read_text() != text
            path.write_text(text)
            print(f"{'wrote' if changed else 'unchanged'} {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

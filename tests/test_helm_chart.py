"""The Helm chart (deploy/helm/baton): it renders and lints for the value sets that matter, every
built-in manifest is valid Kubernetes (kubernetes-validate, strict), bad values fail naming the
key, every container's command line parses with the real `baton` parser, and the ports, names
and probes the pieces refer to agree. Offline: no helm binary, no cluster."""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import pathlib
import re
import shutil

import pytest

try:
    import helm_python
    import kubernetes_validate
    import yaml
except Exception as e:  # noqa: BLE001 - any import failure means: no way to render here
    pytest.skip(f"the chart tests need helm-python-sdk, kubernetes-validate and pyyaml: {e}",
                allow_module_level=True)

from baton.services.cli import build_parser

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


@functools.lru_cache(maxsize=None)
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


# --- render, lint, validate -------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_and_lints_strict(name):
    values = VALUE_SETS[name]
    chart().validate_schema(values)
    docs = manifests(values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Pod", "ServiceAccount"} <= kinds
    report = helm_python.lint(CHART, values, strict=True, kube_version="1.33.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report
    notes = render(values)["baton/templates/NOTES.txt"]
    assert "baton.v1.TextGeneration/Generate" in notes and "helm test" in notes


@pytest.mark.parametrize("name", VALUE_SETS)
def test_manifests_validate_strict(name):
    versions = [MIN_VERSION.get(name, OLDEST), NEWEST]
    for doc in manifests(VALUE_SETS[name]):
        group = doc["apiVersion"].rpartition("/")[0]
        if group in CRD_GROUPS:
            continue  # kubernetes-validate knows no CRDs: test_monitors_select_metrics_ports checks them
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is not valid for Kubernetes {version}: "
                            f"{path}: {e.message}")


def test_image_volume_needs_kubernetes_1_31():
    """Why model.image is validated from 1.31 on: 1.30's schema has no image volumes."""
    deployment = of_kind(manifests(VALUE_SETS["model-image-volume"]), "Deployment")[0]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert volume["image"] == {"reference": "registry.example/models:1", "pullPolicy": "IfNotPresent"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30", strict=True)


# --- goldens ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", render_golden.GOLDEN_VALUE_SETS)
def test_golden_render(name):
    path = render_golden.golden_path(name)
    fresh = render_golden.render_text(render_golden.GOLDEN_VALUE_SETS[name], chart())
    assert path.exists(), f"{path} is missing: run .venv/bin/python deploy/helm/render_golden.py"
    if fresh != path.read_text():
        import difflib
        diff = "".join(list(difflib.unified_diff(path.read_text().splitlines(True), fresh.splitlines(True),
                                                 str(path), "fresh render"))[:80])
        pytest.fail(f"the chart's render of {name!r} differs from {path.relative_to(ROOT)}; if the change is "
                    f"intended, run .venv/bin/python deploy/helm/render_golden.py and review the diff\n{diff}")


def test_render_is_deterministic_but_the_generated_token_is_random():
    first, second = chart().render({}, name=RELEASE, namespace=NAMESPACE), \
        chart().render({}, name=RELEASE, namespace=NAMESPACE)
    secret = "baton/templates/internal-token-secret.yaml"
    assert first[secret] != second[secret]
    for path in first:
        assert render_golden.normalise(path, first[path]) == render_golden.normalise(path, second[path]), path
    doc = yaml.safe_load(first[secret])
    assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    import base64
    assert re.fullmatch(r"[A-Za-z0-9]{32}", base64.b64decode(doc["data"]["token"]).decode())


def test_existing_token_secret_is_used_and_none_is_made():
    docs = manifests({"internalToken": {"existingSecret": "mine", "key": "tok"}})
    assert not of_kind(docs, "Secret")
    for name, _, spec in pod_specs(docs):
        for c in spec["containers"]:
            env = env_of(c)
            if name.endswith("-test"):
                assert "BATON_INTERNAL_TOKEN" not in env
            else:
                assert env["BATON_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "tok"}


# --- bad values -------------------------------------------------------------------------------


BAD_VALUES = {
    "negative replicas": ({"prefill": {"replicas": -1}}, ["/prefill/replicas"]),
    "zero replicas of a running tier": ({"decode": {"replicas": 0}}, ["decode.replicas"]),
    "unknown policy": ({"router": {"policy": "random"}}, ["/router/policy"]),
    "two model sources": ({"model": {"hostPath": {"path": "/data"}}},
                          ["/model/pvc/claimName", "/model/hostPath/path"]),
    "no model source": ({"model": {"pvc": {"claimName": ""}}}, ["/model/pvc/claimName", "oneOf"]),
    "block size mismatch": ({"prefill": {"engine": {"blockSize": 16}}, "decode": {"engine": {"blockSize": 32}}},
                            ["prefill.engine.blockSize", "decode.engine.blockSize"]),
    "dtype mismatch": ({"engine": {"dtype": "bfloat16"}, "decode": {"engine": {"dtype": "float16"}}},
                       ["prefill.engine.dtype", "decode.engine.dtype"]),
    "model mismatch": ({"prefill": {"engine": {"model": "a"}}, "decode": {"engine": {"model": "b"}}},
                       ["prefill.engine.model", "decode.engine.model"]),
    "non-integer port": ({"ports": {"grpc": "50051"}}, ["/ports/grpc"]),
    "fractional port": ({"metrics": {"port": 9090.5}}, ["/metrics/port"]),
    "port out of range": ({"ports": {"http": 70000}}, ["/ports/http"]),
    "unknown mode": ({"mode": "both"}, ["/mode"]),
    "TLS without a Secret": ({"tls": {"enabled": True, "serverName": "x"}}, ["tls.secretName"]),
    "TLS without a server name": ({"tls": {"enabled": True, "secretName": "x"}}, ["tls.serverName"]),
    "no router in disaggregated mode": ({"router": {"enabled": False}}, ["router.enabled", "mode"]),
    "autoscaling bounds": ({"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
                           ["decode.autoscaling.minReplicas", "decode.autoscaling.maxReplicas"]),
    "bad UCX port range": ({"ucx": {"tcpPortRange": "30000:30100"}}, ["/ucx/tcpPortRange"]),
    "reversed UCX port range": ({"ucx": {"tcpPortRange": "30100-30000"}}, ["ucx.tcpPortRange"]),
    "monitors twice": ({"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
                       ["serviceMonitor.enabled", "podMonitor.enabled"]),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_rejected_naming_the_key(case):
    values, names = BAD_VALUES[case]
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as info:
        chart().render(values, name=RELEASE, namespace=NAMESPACE)
    for name in names:
        assert name in str(info.value), f"{case}: {name!r} is not named in: {info.value}"


def test_model_pvc_null_also_switches_the_source():
    """Helm drops nulls before checking the schema on install, upgrade and template (not in
    `helm lint`, hence the documented way: empty model.pvc.claimName)."""
    docs = manifests({"model": {"pvc": None, "hostPath": {"path": "/data/models"}}})
    for _, labels, spec in pod_specs(docs):
        if component(labels) != "test":
            (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
            assert volume == {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}}


def test_templates_check_the_model_source_too(tmp_path):
    """The schema's oneOf has a twin in the templates (for tools that skip schema validation)."""
    unchecked = tmp_path / "baton"
    shutil.copytree(CHART, unchecked)
    (unchecked / "values.schema.json").unlink()
    with helm_python.Chart.load(unchecked) as c:
        for values, named in (({"model": {"hostPath": {"path": "/data"}}}, "set: model.pvc, model.hostPath"),
                              ({"model": {"pvc": {"claimName": ""}}}, "set: none")):
            with pytest.raises(helm_python.HelmRenderError) as info:
                c.render(values, name=RELEASE, namespace=NAMESPACE)
            assert "exactly one of model.pvc, model.hostPath, model.image, model.initImage" in str(info.value)
            assert named in str(info.value)


# --- command lines and the ports, names and probes around them -----------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_command_lines_parse_and_agree_with_ports_and_services(name):
    values = VALUE_SETS[name]
    merged = chart().merge_values(values)
    docs = manifests(values)
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    colocated = merged["mode"] == "colocated"
    router_on = not colocated or merged["router"]["enabled"]
    (public,) = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    headless = {component(s["metadata"]["labels"]): s for s in services.values()
                if s["spec"].get("clusterIP") == "None"}
    assert set(headless) == ({"colocated"} if colocated else {"prefill", "decode"})
    for s in headless.values():
        assert s["spec"]["publishNotReadyAddresses"] is False

    seen_roles = set()
    for pod_name, labels, spec in pod_specs(docs):
        (container,) = spec["containers"]
        args = parse(container)
        ports = container_ports(spec)
        if args.command == "check-stack":
            check_hook(args, merged, headless, public)
            check_tls_args(args, container, spec, merged)
            continue
        assert args.command == "serve"
        role = args.role
        seen_roles.add(role)
        assert component(labels) == {"both": "colocated"}.get(role, role)
        assert args.host == "0.0.0.0"
        assert args.port == ports["grpc"] == merged["ports"]["grpc"]
        assert args.metrics_port == ports["metrics"] == merged["metrics"]["port"]
        if role in ("router", "both"):
            assert args.http_port == ports["http"] == merged["ports"]["http"]
        else:
            assert args.http_port is None and "http" not in ports
        assert args.model == "/models" or args.model.startswith("/models/")
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True and mounts["/models"]["name"] == "model"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container[probe]:  # `baton health` over TLS, parsed by the real CLI too
                command = container[probe]["exec"]["command"]
                health = build_parser().parse_args(command[1:])
                assert command[0] == "baton" and health.command == "health"
                assert host_port(health.target) == ("127.0.0.1", ports["grpc"]), (pod_name, probe)
                assert health.tls_server_name == merged["tls"]["serverName"]
                assert (health.tls_cert_file is not None) == bool(merged["tls"]["mtls"])
            else:
                handler = container[probe].get("grpc") or container[probe].get("tcpSocket")
                assert handler["port"] == ports["grpc"], (pod_name, probe)
            if merged["tls"]["enabled"]:
                assert "grpc" not in container[probe], "Kubernetes' gRPC probes cannot do TLS"
                # Ready only once the model is loaded: the health service over TLS, not a TCP connect.
                assert probe != "readinessProbe" or "exec" in container[probe], pod_name
        if role == "router":
            backends = {"decode": args.decode, "prefill": args.prefill}
            for tier, addresses in backends.items():
                target = "colocated" if colocated and tier == "decode" else tier
                if colocated and tier == "prefill":
                    assert addresses is None
                    continue
                (address,) = addresses
                host, port = host_port(address)
                assert host == headless[target]["metadata"]["name"]
                svc_port = next(p for p in headless[target]["spec"]["ports"] if p["name"] == "grpc")
                # The router dials pod IPs at this port: the Service port must be the container's.
                assert port == svc_port["port"] and svc_port["targetPort"] == "grpc"
            assert args.policy == merged["router"]["policy"]
        else:
            env = env_of(container)
            assert args.advertise_host == "$(POD_IP)"
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
            assert shm["emptyDir"]["medium"] == "Memory"
        check_tls_args(args, container, spec, merged)
    assert seen_roles == ({"router"} if router_on else set()) | ({"both"} if colocated else {"prefill", "decode"})

    # Every Service port leads to a container port of the same number on the pods it selects.
    for s in services.values():
        selected = [(labels, spec) for _, labels, spec in pod_specs(docs) if selects(s["spec"]["selector"], labels)
                    and component(labels) != "test"]
        assert selected, f"Service {s['metadata']['name']} selects no pod"
        for p in s["spec"]["ports"]:
            for _, spec in selected:
                assert container_ports(spec)[p["targetPort"]] == p["port"], (s["metadata"]["name"], p)
    assert component(public["spec"]["selector"]) == ("router" if router_on else "colocated")
    assert {p["name"] for p in public["spec"]["ports"]} == {"grpc", "http", "metrics"}

    check_network_policies(docs, merged)


def check_hook(args, merged, headless, public):
    host, port = host_port(args.target)
    assert host == public["metadata"]["name"] and port == next(p["port"] for p in public["spec"]["ports"]
                                                              if p["name"] == "grpc")
    expected = {"decode_metrics": "colocated" if merged["mode"] == "colocated" else "decode"}
    if merged["mode"] == "disaggregated":
        expected["prefill_metrics"] = "prefill"
    else:
        assert args.prefill_metrics == []
    for attr, tier in expected.items():
        (address,) = getattr(args, attr)
        host, port = host_port(address)
        svc = headless[tier]
        assert host == svc["metadata"]["name"]
        assert port == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "metrics")


def check_tls_args(args, container, spec, merged):
    tls = merged["tls"]
    files = [args.tls_cert_file, args.tls_key_file, args.tls_ca_file]
    if not tls["enabled"]:
        assert files == [None, None, None] and args.tls_server_name is None
        return
    assert args.tls_server_name == tls["serverName"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == tls["secretName"]
    serving = args.command == "serve"
    wanted = {"tls_cert_file": "tls.crt", "tls_key_file": "tls.key", "tls_ca_file": "ca.crt"}
    for attr, file in wanted.items():
        given = getattr(args, attr)
        on = tls["mtls"] or (serving and attr != "tls_ca_file")
        assert given == (f"{mount['mountPath']}/{file}" if on else None), (attr, given)
    roots = env_of(container).get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
    if tls["mtls"]:
        assert roots is None
    else:
        assert roots["value"] == f"{mount['mountPath']}/ca.crt"


def check_network_policies(docs, merged):
    policies = of_kind(docs, "NetworkPolicy")
    if not merged["networkPolicy"]["enabled"]:
        assert not policies
        return
    pods = [(labels, spec) for _, labels, spec in pod_specs(docs) if component(labels) != "test"]
    covered = set()
    for policy in policies:
        selected = [(labels, spec) for labels, spec in pods
                    if selects(policy["spec"]["podSelector"]["matchLabels"], labels)]
        assert selected
        for labels, spec in selected:
            covered.add(component(labels))
            ports = container_ports(spec)
            ucx = env_of(spec["containers"][0]).get("UCX_TCP_PORT_RANGE")
            for rule in policy["spec"]["ingress"]:
                for p in rule.get("ports", []):
                    if "endPort" in p:
                        assert ucx and ucx["value"] == f"{p['port']}-{p['endPort']}"
                    else:
                        assert p["port"] in ports.values(), (policy["metadata"]["name"], p, ports)
            if component(labels) in ENGINE_COMPONENTS:
                # The engines' gRPC port (and UCX) only from this release's pods.
                for rule in policy["spec"]["ingress"]:
                    numbers = {p["port"] for p in rule.get("ports", [])}
                    if not rule.get("ports") or ports["grpc"] in numbers:
                        is_public = component(labels) == "colocated" and not merged["router"]["enabled"]
                        if not is_public:
                            assert rule["from"] == [{"podSelector": {"matchLabels": {
                                "app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": RELEASE}}}]
                if component(labels) != "colocated" and not merged["ucx"]["tcpPortRange"]:
                    assert any("ports" not in r for r in policy["spec"]["ingress"])  # UCX's ephemeral ports
    assert covered == {component(labels) for labels, _ in pods}


def test_monitors_select_metrics_ports():
    """ServiceMonitor/PodMonitor are CRDs kubernetes-validate cannot check: check their shape and
    that they select the chart's metrics ports."""
    for name, kind in (("operations", "ServiceMonitor"), ("podmonitor-networkpolicy-any-port", "PodMonitor")):
        docs = manifests(VALUE_SETS[name])
        (monitor,) = of_kind(docs, kind)
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["name"] == FULLNAME
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        selector = monitor["spec"]["selector"]
        assert set(selector) <= {"matchLabels", "matchExpressions"}
        if kind == "ServiceMonitor":
            assert monitor["metadata"]["labels"]["release"] == "prometheus"
            (endpoint,) = monitor["spec"]["endpoints"]
            targets = [s for s in of_kind(docs, "Service") if selects(selector["matchLabels"], s["metadata"]["labels"])]
            assert {component(s["metadata"]["labels"]) for s in targets} == {"router", "prefill", "decode"}
            for s in targets:
                assert endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        else:
            (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
            (expression,) = selector["matchExpressions"]
            targets = [(labels, spec) for _, labels, spec in pod_specs(docs)
                       if selects(selector["matchLabels"], labels) and component(labels) in expression["values"]]
            assert {component(labels) for labels, _ in targets} == {"router", "prefill", "decode"}
            for _, spec in targets:
                assert endpoint["port"] in container_ports(spec)
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


# --- the rest of the issue's requirements ------------------------------------------------------


def test_security_context_and_writable_volumes():
    for name in ("default", "rdma", "model-init-image"):
        merged = chart().merge_values(VALUE_SETS[name])
        for pod_name, labels, spec in pod_specs(manifests(VALUE_SETS[name])):
            pod_sc = spec["securityContext"]
            assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001
            assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
            if component(labels) == "test":
                assert spec["restartPolicy"] == "Never"
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                rdma = merged["ucx"]["rdma"]["enabled"] and component(labels) in ENGINE_COMPONENTS \
                    and c in spec["containers"]
                assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma else []), (pod_name, c["name"])
                if rdma:
                    for resource, n in merged["ucx"]["rdma"]["resources"].items():
                        assert c["resources"]["limits"][resource] == n == c["resources"]["requests"][resource]
            main = spec["containers"][0]
            mounts = {m["mountPath"] for m in main["volumeMounts"]}
            assert {"/tmp", "/home/baton/.cache"} <= mounts
            if component(labels) in ENGINE_COMPONENTS:
                assert "/dev/shm" in mounts


def test_engine_flags_gpu_and_tier_overrides():
    values = {"engine": {"dtype": "bfloat16", "device": "cuda", "maxModelLen": 4096, "blockSize": 32,
                         "numKvBlocks": 2048, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096,
                         "extraArgs": ["--no-prefix-caching"]},
              "decode": {"engine": {"maxNumSeqs": 256, "kvCacheMemoryBytes": 21474836480},
                         "resources": {"limits": {"nvidia.com/gpu": 2}}},
              "model": {"servedModelName": "smol"}}
    docs = manifests(values)
    parsed = {d["metadata"]["name"]: (parse(d["spec"]["template"]["spec"]["containers"][0]), d)
              for d in of_kind(docs, "Deployment")}
    prefill, _ = parsed[f"{FULLNAME}-prefill"]
    decode, decode_doc = parsed[f"{FULLNAME}-decode"]
    router, _ = parsed[f"{FULLNAME}-router"]
    for a in (prefill, decode):
        assert (a.dtype, a.device, a.max_model_len, a.block_size) == ("bfloat16", "cuda", 4096, 32)
        assert a.no_prefix_caching and a.served_model_name == "smol"
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (64, 256)
    assert (prefill.kv_cache_memory_bytes, decode.kv_cache_memory_bytes) == (None, 21474836480)
    assert router.block_size == 32 and router.served_model_name == "smol"
    limits = decode_doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 2}


def test_startup_probe_allows_slow_model_loads():
    for _, labels, spec in pod_specs(manifests({})):
        if component(labels) in ENGINE_COMPONENTS:
            probe = spec["containers"][0]["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] >= 600
            assert "grpc" in probe and "grpc" in spec["containers"][0]["livenessProbe"]
        if component(labels) != "test":
            assert "grpc" in spec["containers"][0]["readinessProbe"]


def test_names_are_capped_and_overridable():
    long_release = "r" * 50
    rendered = chart().render({}, name=long_release, namespace=NAMESPACE)
    docs = [d for p, t in rendered.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    for d in docs:
        name = d["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-") and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    docs = manifests({"fullnameOverride": "stack"})
    assert {d["metadata"]["name"] for d in of_kind(docs, "Service")} == {"stack", "stack-prefill", "stack-decode"}
    assert {d["metadata"]["name"] for d in of_kind(docs, "Deployment")} == {
        "stack-router", "stack-prefill", "stack-decode"}
    docs = manifests({"nameOverride": "llm"})  # the release name contains it: the release name alone
    assert {d["metadata"]["name"] for d in of_kind(docs, "Service")} == {"llm", "llm-prefill", "llm-decode"}


def test_hpa_replaces_replicas_and_pdbs_select_their_tier():
    docs = manifests(VALUE_SETS["operations"])
    hpas = {h["metadata"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    assert set(hpas) == set(deployments)
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in deployments[name]["spec"]
    assert hpas[f"{FULLNAME}-decode"]["spec"]["minReplicas"] == 2
    assert [m["type"] for m in hpas[f"{FULLNAME}-decode"]["spec"]["metrics"]] == ["Resource", "Pods"]
    pdbs = of_kind(docs, "PodDisruptionBudget")
    assert len(pdbs) == 3
    for pdb in pdbs:
        (target,) = [d for d in deployments.values()
                     if selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
        assert target["metadata"]["name"] == pdb["metadata"]["name"]
    assert by_name(docs, "PodDisruptionBudget", f"{FULLNAME}-prefill")["spec"] == {
        "minAvailable": 1, "selector": by_name(docs, "PodDisruptionBudget", f"{FULLNAME}-prefill")["spec"]["selector"]}


def test_tracing_and_ucx_env():
    docs = manifests(VALUE_SETS["operations"])
    for _, labels, spec in pod_specs(docs):
        env = env_of(spec["containers"][0])
        if component(labels) == "test":
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
            continue
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
        assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        names = list(env)
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")  # $(POD_NAME) expands
        if component(labels) in ENGINE_COMPONENTS:
            assert env["UCX_TCP_PORT_RANGE"]["value"] == "31000-31063"
            assert env["UCX_NET_DEVICES"]["value"] == "eth0"
        else:
            assert "UCX_TCP_PORT_RANGE" not in env


def test_prometheus_pod_annotations():
    for name, on in (("operations", True), ("default", False)):
        for d in of_kind(manifests(VALUE_SETS[name]), "Deployment"):
            annotations = d["spec"]["template"]["metadata"].get("annotations", {})
            ports = container_ports(d["spec"]["template"]["spec"])
            if on:
                assert annotations["prometheus.io/scrape"] == "true"
                assert annotations["prometheus.io/port"] == str(ports["metrics"])
            else:
                assert "prometheus.io/scrape" not in annotations


def test_model_sources():
    for name, check in (
            ("default", lambda v: v["persistentVolumeClaim"] == {"claimName": "baton-models", "readOnly": True}),
            ("model-hostpath", lambda v: v["hostPath"] == {"path": "/data/models", "type": "Directory"}),
            ("model-init-image", lambda v: v["emptyDir"] == {"sizeLimit": "2Gi"}),
            ("model-image-volume", lambda v: v["image"]["reference"] == "registry.example/models:1")):
        for _, labels, spec in pod_specs(manifests(VALUE_SETS[name])):
            if component(labels) == "test":
                assert all(v["name"] != "model" for v in spec["volumes"])
                continue
            (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
            assert check(volume), (name, volume)
            if name == "model-init-image":
                (init,) = spec["initContainers"]
                assert init["image"] == "registry.example/models:1"
                # The emptyDir is mounted away from /models, which would hide the image's /models.
                assert init["command"] == ["cp", "-a", "/models/.", "/model-copy/"]
                assert init["volumeMounts"] == [{"name": "model", "mountPath": "/model-copy"}]
            else:
                assert "initContainers" not in spec
    (deployment, *_) = of_kind(manifests(VALUE_SETS["disaggregated-gpu-tls"]), "Deployment")
    mount = next(m for m in deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hf"}


def test_values_merge_keeps_defaults():
    merged = chart().merge_values(copy.deepcopy(VALUE_SETS["gpu"]))
    assert merged["image"]["repository"] == "localhost/baton" and merged["router"]["policy"] == "round_robin"
    assert merged["engine"]["dtype"] == "bfloat16" and merged["prefill"]["replicas"] == 1

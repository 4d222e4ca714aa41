"""The Helm chart's pieces fit together: every container's command line (and exec probe)
parses with the real `baton` parser, and the ports, names, probes, policies and monitors the
pieces refer to agree; security, scheduling and environment values land where they should."""
from __future__ import annotations

import copy
import json
import re

import pytest
from encoder_values import ENCODER, ENCODER_VALUE_SETS, encoder_on
from helm_render import (
    ENGINE_COMPONENTS,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    build_parser,
    by_name,
    chart,
    component,
    container_ports,
    env_of,
    host_port,
    manifests,
    of_kind,
    parse,
    pod_specs,
    render,
    render_golden,
    selects,
    yaml,
)

from baton.services.rpc.names import ROUTER_LIVENESS

# --- command lines and the ports, names and probes around them -----------------------------------


ALL_VALUE_SETS = {**VALUE_SETS, **ENCODER_VALUE_SETS}


@pytest.mark.parametrize("name", ALL_VALUE_SETS)
def test_command_lines_parse_and_agree_with_ports_and_services(name):
    values = ALL_VALUE_SETS[name]
    merged = chart().merge_values(values)
    docs = manifests(values)
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    colocated = merged["mode"] == "colocated"
    router_on = not colocated or merged["router"]["enabled"]
    encoder = encoder_on(merged)
    (public,) = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    headless = {component(s["metadata"]["labels"]): s for s in services.values()
                if s["spec"].get("clusterIP") == "None"}
    # Replicas of the router find each other (for Abort) through a headless Service of their own,
    # not-ready ones too: a draining replica still carries streams.
    replicated = router_on and (merged["router"]["replicas"] > 1 or merged["router"]["autoscaling"]["enabled"])
    peers = headless.pop("router", None)
    assert (peers is not None) == replicated
    if peers is not None:
        assert peers["spec"]["publishNotReadyAddresses"] is True
    assert set(headless) == ({"colocated"} if colocated else {"prefill", "decode"}) | ({ENCODER} if encoder else set())
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
        if role == ENCODER:  # an encoder has no metrics port
            assert args.metrics_port is None and "metrics" not in ports
        else:
            assert args.metrics_port == ports["metrics"] == merged["metrics"]["port"]
        if role in ("router", "both"):
            assert args.http_port == ports["http"] == merged["ports"]["http"]
        else:
            assert args.http_port is None and "http" not in ports
        if role != ENCODER:  # streams over frames: the router's to the engines, a client's to the router
            assert args.frames_port == ports["frames"] == merged["ports"]["frames"]
        else:
            assert "frames" not in ports
        assert args.model == "/models" or args.model.startswith("/models/")
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True and mounts["/models"]["name"] == "model"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container[probe]:  # `baton health` over TLS, parsed by the real CLI too
                command = container[probe]["exec"]["command"]
                health = build_parser().parse_args(command[1:])
                assert command[0] == "baton" and health.command == "health"
                assert host_port(health.target) == ("127.0.0.1", ports["grpc"]), (pod_name, probe)
                service = health.service
                assert health.tls_server_name == merged["tls"]["serverName"]
                assert (health.tls_cert_file is not None) == bool(merged["tls"]["mtls"])
            else:
                handler = container[probe].get("grpc") or container[probe].get("tcpSocket")
                assert handler["port"] == ports["grpc"], (pod_name, probe)
                service = handler.get("service", "")
            # The router's liveness is its own process; its readiness, a reachable decode.
            live = role == "router" and probe != "readinessProbe"
            assert service == (ROUTER_LIVENESS if live else ""), (pod_name, probe)
            if merged["tls"]["enabled"]:
                assert "grpc" not in container[probe], "Kubernetes' gRPC probes cannot do TLS"
                # Ready only once the model is loaded: the health service over TLS, not a TCP connect.
                assert probe != "readinessProbe" or "exec" in container[probe], pod_name
        if role == "router":
            backends = {"decode": args.decode, "prefill": args.prefill, ENCODER: args.encoder}
            for tier, addresses in backends.items():
                target = "colocated" if colocated and tier == "decode" else tier
                if (colocated and tier == "prefill") or (tier == ENCODER and not encoder):
                    assert addresses is None
                    continue
                (address,) = addresses
                host, port = host_port(address)
                assert host == headless[target]["metadata"]["name"]
                svc_port = next(p for p in headless[target]["spec"]["ports"] if p["name"] == "grpc")
                # The router dials pod IPs at this port: the Service port must be the container's.
                assert port == svc_port["port"] and svc_port["targetPort"] == "grpc"
            assert args.policy == merged["router"]["policy"]
            assert args.router_peers == ([f"{peers['metadata']['name']}:{args.port}"] if replicated else None)
        else:
            env = env_of(container)
            assert args.advertise_host == "$(POD_IP)"
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            shm = [v for v in spec["volumes"] if v["name"] == "shm"]
            if role == ENCODER:  # one process, no NCCL: no /dev/shm of its own
                assert not shm and "/dev/shm" not in {m["mountPath"] for m in container["volumeMounts"]}
            else:
                assert shm[0]["emptyDir"]["medium"] == "Memory"
        check_tls_args(args, container, spec, merged)
    assert seen_roles == ({"router"} if router_on else set()) | ({"both"} if colocated else {"prefill", "decode"}) \
        | ({ENCODER} if encoder else set())

    # Every Service port leads to a container port of the same number on the pods it selects.
    for s in services.values():
        selected = [(labels, spec) for _, labels, spec in pod_specs(docs) if selects(s["spec"]["selector"], labels)
                    and component(labels) != "test"]
        assert selected, f"Service {s['metadata']['name']} selects no pod"
        for p in s["spec"]["ports"]:
            for _, spec in selected:
                assert container_ports(spec)[p["targetPort"]] == p["port"], (s["metadata"]["name"], p)
    assert component(public["spec"]["selector"]) == ("router" if router_on else "colocated")
    # (the public frames port: the same number the pods' ModelInfo tells a multiplexing client)
    assert {p["name"] for p in public["spec"]["ports"]} == {"grpc", "frames", "http", "metrics"}

    check_network_policies(docs, merged, public)


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


def check_network_policies(docs, merged, public):
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
            routed = merged["mode"] != "colocated" or merged["router"]["enabled"]
            if component(labels) == component(public["spec"]["selector"]):  # clients reach frames as gRPC
                assert any(not r.get("ports") or {ports["grpc"], ports["frames"]} <= {p["port"] for p in r["ports"]}
                           for r in policy["spec"]["ingress"]), policy["metadata"]["name"]
            if routed and component(labels) in ENGINE_COMPONENTS:  # the router reaches the engines' frames port
                assert any(not r.get("ports") or ports["frames"] in {p["port"] for p in r["ports"]}
                           for r in policy["spec"]["ingress"]), policy["metadata"]["name"]
            if component(labels) in (*ENGINE_COMPONENTS, ENCODER):
                # The engines' and encoders' gRPC port (and UCX) only from this release's pods.
                for rule in policy["spec"]["ingress"]:
                    numbers = {p["port"] for p in rule.get("ports", [])}
                    if not rule.get("ports") or ports["grpc"] in numbers:
                        is_public = component(labels) == "colocated" and not merged["router"]["enabled"]
                        if not is_public:
                            assert rule["from"] == [{"podSelector": {"matchLabels": {
                                "app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": RELEASE}}}]
                # UCX's ephemeral ports, or its range: between prefill and decode, and from the
                # encoders to the servers that read the embeddings (prefill, or colocated).
                ucx_tier = component(labels) != "colocated" or encoder_on(merged)
                if ucx_tier and not merged["ucx"]["tcpPortRange"]:
                    assert any("ports" not in r for r in policy["spec"]["ingress"])
                elif ucx_tier:
                    assert any("endPort" in p for r in policy["spec"]["ingress"] for p in r.get("ports", []))
                else:
                    assert all("ports" in r for r in policy["spec"]["ingress"])
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
              "decode": {"engine": {"maxNumSeqs": 256, "kvCacheMemoryBytes": 21474836480, "kvOffloadingSize": 32,
                                    "preemptionMode": "swap"},
                         "resources": {"limits": {"nvidia.com/gpu": 2}}},
              "prefill": {"engine": {"gpuMemoryUtilization": 0.45}},
              "model": {"servedModelName": "smol"}}
    docs = manifests(values)
    parsed = {d["metadata"]["name"]: (parse(d["spec"]["template"]["spec"]["containers"][0]), d)
              for d in of_kind(docs, "Deployment")}
    prefill, _ = parsed[f"{FULLNAME}-prefill"]
    decode, decode_doc = parsed[f"{FULLNAME}-decode"]
    router, _ = parsed[f"{FULLNAME}-router"]
    for a in (prefill, decode):
        assert (a.dtype, a.device, a.max_model_len, a.block_size) == ("bfloat16", "cuda", 4096, 32)
        assert a.enable_prefix_caching is False and a.served_model_name == "smol"
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (64, 256)
    assert (prefill.kv_cache_memory_bytes, decode.kv_cache_memory_bytes) == (None, 21474836480)
    assert (prefill.gpu_memory_utilization, decode.gpu_memory_utilization) == (0.45, None)
    assert (prefill.kv_offloading_size, decode.kv_offloading_size) == (None, 32.0)
    assert (prefill.preemption_mode, decode.preemption_mode) == (None, "swap")
    assert router.block_size == 32 and router.served_model_name == "smol"
    limits = decode_doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 2}


def test_speculative_config_goes_to_both_tiers_with_its_model_under_models():
    values = {"engine": {"speculativeConfig": {"method": "eagle3", "model": "heads/eagle3/",
                                               "num_speculative_tokens": 4}},
              "decode": {"engine": {"speculativeConfig": {"num_speculative_tokens": 2}}}}
    parsed = {d["metadata"]["name"]: parse(d["spec"]["template"]["spec"]["containers"][0])
              for d in of_kind(manifests(values), "Deployment")}
    for tier, k in (("prefill", 4), ("decode", 2)):
        assert json.loads(parsed[f"{FULLNAME}-{tier}"].speculative_config) == {
            "method": "eagle3", "model": "/models/heads/eagle3", "num_speculative_tokens": k}


def test_tensor_parallel_size_sets_the_flag_the_gpus_per_pod_and_shm():
    docs = manifests(VALUE_SETS["tensor-parallel"])
    pods = {component(labels): spec for _, labels, spec in pod_specs(docs)}
    prefill, decode = (pods[tier]["containers"][0] for tier in ("prefill", "decode"))
    assert (parse(prefill).tensor_parallel_size, parse(decode).tensor_parallel_size) == (None, 4)
    # A GPU count in a tier's resources is per rank; other resources are the pod's.
    assert prefill["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert decode["resources"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"nvidia.com/gpu": 4, "cpu": "4"}}
    for tier, size in (("prefill", "1Gi"), ("decode", "16Gi")):  # NCCL's buffers: /dev/shm in memory
        (shm,) = [v for v in pods[tier]["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
        assert {"name": "shm", "mountPath": "/dev/shm"} in pods[tier]["containers"][0]["volumeMounts"]
    # Colocated servers take it too, for any <vendor>/gpu; prefill's and decode's sizes do not matter there.
    docs = manifests({"mode": "colocated", "colocated": {"tensorParallelSize": 2, "resources": {
        "limits": {"amd.com/gpu": 1, "memory": "64Gi"}}}, "prefill": {"tensorParallelSize": 3}})
    (colocated,) = [spec["containers"][0] for _, labels, spec in pod_specs(docs) if component(labels) == "colocated"]
    assert parse(colocated).tensor_parallel_size == 2
    assert colocated["resources"] == {"limits": {"amd.com/gpu": 2, "memory": "64Gi"}}
    # By default no engine is given the flag (the engine's own default, 1).
    for _, labels, spec in pod_specs(manifests({})):
        if component(labels) != "test":
            assert parse(spec["containers"][0]).tensor_parallel_size is None


def test_lora_values_become_flags_on_both_engine_tiers():
    values = {"engine": {"maxLoras": 4, "maxLoraRank": 32, "loraModules": {"sql": "adapters/sql/", "chat": "chat"}}}
    docs = manifests(values)
    for name in (f"{FULLNAME}-prefill", f"{FULLNAME}-decode"):
        a = parse(by_name(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0])
        assert (a.max_loras, a.max_lora_rank) == (4, 32)
        assert a.lora_modules == ["chat=/models/chat", "sql=/models/adapters/sql"]


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


# --- the encoder tier (E/P/D) ------------------------------------------------------------------


def _containers(docs: list[dict]) -> dict[str, dict]:
    return {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(docs)}


def test_encoder_tier_is_off_by_default_and_changes_nothing():
    """encoder.replicas 0 (the default): no encoder object, the router without --encoder, and the
    whole render the same as without encoder values at all."""
    merged = chart().merge_values({})
    assert merged["encoder"]["replicas"] == 0 and not encoder_on(merged)
    docs = manifests({})
    assert all(d["metadata"]["labels"].get("app.kubernetes.io/component") != ENCODER for d in docs)
    assert parse(_containers(docs)["router"]).encoder is None
    assert not render({})["baton/templates/encoder.yaml"].strip()
    idle = {"encoder": {"replicas": 0, "slots": 8, "resources": {"limits": {"nvidia.com/gpu": 1}},
                        "extraArgs": ["--allowed-media-domains", "x.example"]}}
    assert render_golden.render_text(render(idle)) == render_golden.render_text(render({}))


def test_encoder_tier_flags_service_and_router():
    values = VALUE_SETS["encoder-gpu"]
    docs = manifests(values)
    name = f"{FULLNAME}-encoder"
    deployment = by_name(docs, "Deployment", name)
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = parse(container)
    assert (args.command, args.role, args.host, args.port) == ("serve", "encoder", "0.0.0.0", 50051)
    assert (args.model, args.dtype, args.device) == ("/models/qwen2.5-vl-3b-instruct", "bfloat16", "cuda")
    assert (args.encoder_slots, args.encoder_hold_timeout) == (128, 45.0)
    assert args.allowed_media_domains == ["images.example.com"] and args.advertise_host == "$(POD_IP)"
    assert args.metrics_port is None and args.http_port is None
    assert container_ports(spec) == {"grpc": 50051}
    env = env_of(container)
    assert env["BATON_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-internal-token",
                                                                         "key": "token"}
    assert env["UCX_TCP_PORT_RANGE"]["value"] == "30000-30100" and env["UCX_TLS"]["value"] == "tcp"
    assert container["resources"] == values["encoder"]["resources"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == values["encoder"]["tolerations"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the gRPC health service, ""
        assert container[probe]["grpc"] == {"port": 50051}
    # Discovery: a headless Service of the ready encoders, the router's --encoder; no metrics anywhere.
    service = by_name(docs, "Service", name)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    assert selects(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert not selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    router = parse(_containers(docs)["router"])
    assert router.encoder == [f"{name}:50051"]
    assert router.prefill == [f"{FULLNAME}-prefill:50051"] and router.decode == [f"{FULLNAME}-decode:50051"]
    assert "Encoder tier (E/P/D): 2 encoder server(s)" in render(values)["baton/templates/NOTES.txt"]


def test_encoder_takes_the_model_dtype_and_device_of_the_tier_that_reads_it():
    """The encoder's model, dtype and device follow the prefill's (colocated: the colocated
    servers') engine settings, encoder.engine overriding them; no other engine setting reaches it."""
    values = {"engine": {"model": "vlm", "dtype": "float16", "maxModelLen": 4096, "extraArgs": ["--no-prefix-caching"]},
              "prefill": {"engine": {"device": "cuda"}},
              "encoder": {"replicas": 1, "engine": {"dtype": "bfloat16"}},
              "model": {"servedModelName": "vlm-chat"}}
    encoder = parse(_containers(manifests(values))[ENCODER])
    assert (encoder.model, encoder.dtype, encoder.device) == ("/models/vlm", "bfloat16", "cuda")
    assert encoder.served_model_name == "vlm-chat"
    assert encoder.max_model_len is None and encoder.enable_prefix_caching is None
    assert (encoder.encoder_slots, encoder.encoder_hold_timeout) == (64, 30.0)  # null: the engine's defaults
    docs = manifests(ENCODER_VALUE_SETS["encoder-colocated"])
    containers = _containers(docs)
    encoder, router = parse(containers[ENCODER]), parse(containers["router"])
    assert (encoder.model, encoder.dtype, encoder.device) == ("/models/qwen2.5-vl-3b-instruct", "bfloat16", "cuda:0")
    assert router.encoder == [f"{FULLNAME}-encoder:50051"] and router.prefill is None
    assert router.decode == [f"{FULLNAME}-colocated:50051"]


def test_encoder_autoscaling_pdb_tls_rdma_and_probes():
    docs = manifests(ENCODER_VALUE_SETS["encoder-autoscaling-tls-rdma"])
    name = f"{FULLNAME}-encoder"
    deployment = by_name(docs, "Deployment", name)
    assert "replicas" not in deployment["spec"]  # the HPA's
    hpa = by_name(docs, "HorizontalPodAutoscaler", name)
    assert hpa["spec"]["scaleTargetRef"]["name"] == name
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    pdb = by_name(docs, "PodDisruptionBudget", name)
    assert selects(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    # Prefills read the embeddings over UCX: RDMA devices and IPC_LOCK as on the engines.
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 1}
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert env_of(container)["UCX_NET_DEVICES"]["value"] == "mlx5_0:1"
    assert env_of(container)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector:4317"
    assert parse(container).encoder_hold_timeout == 12.5
    # No metrics port: no Prometheus annotations (the other tiers have them).
    assert "prometheus.io/scrape" not in pod["metadata"].get("annotations", {})
    prefill = by_name(docs, "Deployment", f"{FULLNAME}-prefill")["spec"]["template"]["metadata"]
    assert prefill["annotations"]["prometheus.io/scrape"] == "true"
    # TLS: `baton health` over TLS, the startup probe's override kept.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][:2] == ["baton", "health"]
    assert container["startupProbe"]["failureThreshold"] == 30
    assert container["livenessProbe"]["failureThreshold"] == 3


def test_encoder_names_are_capped():
    rendered = chart().render({"encoder": {"replicas": 1}}, name="r" * 60, namespace=NAMESPACE)
    docs = [d for p, t in rendered.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    names = {d["metadata"]["name"] for d in docs
             if d["metadata"]["labels"].get("app.kubernetes.io/component") == ENCODER}
    assert names and all(len(n) <= 63 and n.endswith("-encoder") for n in names), names

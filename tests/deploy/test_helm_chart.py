"""The Helm chart (deploy/helm/baton) renders and lints for the value sets that matter, every
built-in manifest is valid Kubernetes (kubernetes-validate, strict), golden renders stay as
reviewed, and bad values fail naming the key. Offline: no helm binary, no cluster."""
from __future__ import annotations

import re
import shutil

import pytest
from encoder_values import ENCODER_VALUE_SETS
from helm_render import (
    CHART,
    CRD_GROUPS,
    MIN_VERSION,
    NAMESPACE,
    NEWEST,
    OLDEST,
    RELEASE,
    ROOT,
    VALUE_SETS,
    chart,
    component,
    env_of,
    helm_python,
    kubernetes_validate,
    manifests,
    of_kind,
    parse,
    pod_specs,
    render,
    render_golden,
    yaml,
)

# --- render, lint, validate -------------------------------------------------------------------

ALL_VALUE_SETS = {**VALUE_SETS, **ENCODER_VALUE_SETS}


@pytest.mark.parametrize("name", ALL_VALUE_SETS)
def test_renders_and_lints_strict(name):
    values = ALL_VALUE_SETS[name]
    chart().validate_schema(values)
    docs = manifests(values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Pod", "ServiceAccount"} <= kinds
    report = helm_python.lint(CHART, values, strict=True, kube_version="1.33.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report
    notes = render(values)["baton/templates/NOTES.txt"]
    assert "baton.v1.TextGeneration/Generate" in notes and "helm test" in notes


@pytest.mark.parametrize("name", ALL_VALUE_SETS)
def test_manifests_validate_strict(name):
    versions = [MIN_VERSION.get(name, OLDEST), NEWEST]
    for doc in manifests(ALL_VALUE_SETS[name]):
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
    fresh = render_golden.render_text(render(render_golden.GOLDEN_VALUE_SETS[name]))
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
    "GPU share above 1": ({"decode": {"engine": {"gpuMemoryUtilization": 1.5}}},
                          ["/decode/engine/gpuMemoryUtilization"]),
    "negative host KV tier": ({"engine": {"kvOffloadingSize": -1}}, ["/engine/kvOffloadingSize"]),
    "unknown preemption mode": ({"decode": {"engine": {"preemptionMode": "evict"}}},
                                ["/decode/engine/preemptionMode"]),
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
    "tensor parallel sizes that cannot pass KV": (
        {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}},
        ["prefill.tensorParallelSize (2) and decode.tensorParallelSize (3): KV blocks move from prefill to decode "
         "ranks only when one size divides the other"]),
    "no tensor parallel rank": ({"decode": {"tensorParallelSize": 0}}, ["/decode/tensorParallelSize"]),
    "unknown speculative method": ({"engine": {"speculativeConfig": {"method": "medusa"}}},
                                   ["/engine/speculativeConfig/method"]),
    "negative encoder replicas": ({"encoder": {"replicas": -1}}, ["/encoder/replicas"]),
    "encoder replicas not an integer": ({"encoder": {"replicas": "two"}}, ["/encoder/replicas"]),
    "no encoder slot": ({"encoder": {"replicas": 1, "slots": 0}}, ["/encoder/slots"]),
    "encoder hold timeout of zero": ({"encoder": {"replicas": 1, "holdTimeoutSeconds": 0}},
                                     ["/encoder/holdTimeoutSeconds"]),
    "an engine setting the encoder does not take": ({"encoder": {"engine": {"maxModelLen": 4096}}},
                                                    ["/encoder/engine"]),
    "an encoder without a router": ({"mode": "colocated", "router": {"enabled": False}, "encoder": {"replicas": 1}},
                                    ["encoder.replicas", "router.enabled"]),
    "encoder autoscaling bounds": ({"encoder": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}},
                                   ["encoder.autoscaling.minReplicas", "encoder.autoscaling.maxReplicas"]),
    "a head on the decode only": (
        {"decode": {"engine": {"speculativeConfig": {"method": "eagle3", "model": "h"}}}},
        ["prefill.engine.speculativeConfig.method", "decode.engine.speculativeConfig.method"]),
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




def test_templates_check_tensor_parallel_sizes_too(tmp_path):
    """Without the schema, a size below 1 still fails naming the key (and never reaches the
    divisibility check's modulo)."""
    unchecked = tmp_path / "baton"
    shutil.copytree(CHART, unchecked)
    (unchecked / "values.schema.json").unlink()
    with helm_python.Chart.load(unchecked) as c:
        with pytest.raises(helm_python.HelmRenderError) as info:
            c.render({"decode": {"tensorParallelSize": 0}}, name=RELEASE, namespace=NAMESPACE)
    assert "decode.tensorParallelSize: must be at least 1 (got 0)" in str(info.value)


def test_two_quantizations_of_one_model_pair_when_a_tier_names_the_other():
    """A bf16 prefill before an FP8 decode: the models may differ once a tier's acceptKvFrom names
    the other's (a folder under /models, or a fingerprint, passed as it is)."""
    fingerprint = "0123456789abcdef0123456789abcdef"
    docs = manifests({"prefill": {"engine": {"model": "llama-bf16"}},
                      "decode": {"engine": {"model": "llama-fp8", "acceptKvFrom": ["llama-bf16/", fingerprint]}}})
    tiers = {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(docs)}
    assert parse(tiers["decode"]).accept_kv_from == ["/models/llama-bf16", fingerprint]
    assert parse(tiers["prefill"]).accept_kv_from is None
    with pytest.raises(helm_python.HelmRenderError, match="name the other in acceptKvFrom"):
        manifests({"prefill": {"engine": {"model": "llama-bf16"}},
                   "decode": {"engine": {"model": "llama-fp8", "acceptKvFrom": ["llama-other"]}}})


def test_each_tier_takes_its_own_kv_cache_dtype():
    """An FP8 decode behind a prefill of the compute dtype: the decode converts the blocks as
    they land, so the tiers may differ; a dtype the engine does not know fails the schema."""
    docs = manifests({"decode": {"engine": {"kvCacheDtype": "fp8"}}})
    tiers = {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(docs)}
    assert parse(tiers["decode"]).kv_cache_dtype == "fp8"
    assert parse(tiers["prefill"]).kv_cache_dtype is None
    with pytest.raises(helm_python.HelmValuesError, match="kvCacheDtype"):
        manifests({"engine": {"kvCacheDtype": "int8"}})


def test_stream_interval_reaches_the_engines():
    """engine.streamInterval becomes --stream-interval (per tier through its engine block); zero
    fails the schema naming it."""
    docs = manifests({"decode": {"engine": {"streamInterval": 8}}})
    tiers = {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(docs)}
    assert parse(tiers["decode"]).stream_interval == 8
    assert parse(tiers["prefill"]).stream_interval == 1
    with pytest.raises(helm_python.HelmValuesError, match="streamInterval"):
        manifests({"engine": {"streamInterval": 0}})


def test_router_workers_become_the_flag():
    docs = manifests({"router": {"workers": 4}})
    tiers = {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(docs)}
    assert parse(tiers["router"]).router_workers == 4
    default = {component(labels): spec["containers"][0] for _, labels, spec in pod_specs(manifests({}))}
    assert parse(default["router"]).router_workers is None
    with pytest.raises(helm_python.HelmValuesError, match="workers"):
        manifests({"router": {"workers": 0}})


def test_templates_check_encoder_replicas_too(tmp_path):
    """Without the schema, negative encoder replicas still fail naming the key (not a silent "off")."""
    unchecked = tmp_path / "baton"
    shutil.copytree(CHART, unchecked)
    (unchecked / "values.schema.json").unlink()
    with helm_python.Chart.load(unchecked) as c:
        with pytest.raises(helm_python.HelmRenderError) as info:
            c.render({"encoder": {"replicas": -1}}, name=RELEASE, namespace=NAMESPACE)
    assert "encoder.replicas: must be 0 (no encoder tier) or more (got -1)" in str(info.value)


def test_encoder_values_are_typed():
    """The encoder tier's keys are in the schema: its defaults pass, its numbers are typed."""
    merged = chart().merge_values({})
    keys = ("replicas", "slots", "holdTimeoutSeconds", "engine", "extraArgs")  # (merging drops the nulls)
    assert {k: merged["encoder"].get(k) for k in keys} == {
        "replicas": 0, "slots": None, "holdTimeoutSeconds": None, "engine": {}, "extraArgs": []}
    chart().validate_schema({"encoder": {"replicas": 3, "slots": 16, "holdTimeoutSeconds": 7.5,
                                         "engine": {"model": "vlm", "dtype": "bfloat16", "device": "cuda:1"}}})
    for bad in ({"replicas": 1.5}, {"slots": "64"}, {"holdTimeoutSeconds": "30s"}, {"engine": {"device": "tpu"}},
                {"extraArgs": "--x"}, {"shmSizeLimit": "1Gi"}):
        with pytest.raises(helm_python.HelmValuesError) as info:
            chart().validate_schema({"encoder": bad})
        assert "/encoder" in str(info.value), (bad, str(info.value))

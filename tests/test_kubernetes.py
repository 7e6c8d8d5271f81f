"""The Kubernetes manifests (docs/operators/kubernetes/, and its inference-pool/ variant) against the Kubernetes
schemas (kubernetes-validate, strict: an unknown field fails; the InferencePool against its CRD's schema, a copy in
tests/data/crds/, made as strict), and what they hand Tandem against Tandem's own checks: the gateway's config is
a valid config, the engine's and the picker's arguments parse to valid arguments, the pool selects the engine pods
the picker's config names."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pytest
import yaml

from engine.config import EngineArgs, add_engine_cli_args, engine_args_from_cli
from gateway.config.compile import load_config_text

kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")
HERE = Path(__file__).resolve().parents[1] / "docs" / "operators" / "kubernetes"
POOL = HERE / "inference-pool"
CRDS = Path(__file__).resolve().parent / "data" / "crds"
K8S_VERSION = "1.33.0"


def documents(base: Path = HERE) -> list[dict]:
    """The resources of the kustomization in ``base``, following directory resources (an overlay's ``../``)."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        path = (base / name).resolve()
        docs += documents(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str, name: str, base: Path = HERE) -> dict:
    return next(d for d in documents(base) if d["kind"] == kind and d["metadata"]["name"] == name)


def strict(schema: dict) -> dict:
    """``schema`` with every object that lists its properties closed to others (as the API server's strict field
    validation refuses an unknown field)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)

    close(schema)
    return schema


def crd_validator(kind: str):
    """A validator of ``kind`` objects from its CRD in tests/data/crds/ (its served version's schema)."""
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            version = next(v for v in crd["spec"]["versions"] if v.get("served"))
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["apiVersion"]["enum"] = [f"{crd['spec']['group']}/{version['name']}"]
            return jsonschema.Draft7Validator(schema)
    raise LookupError(f"no CRD of {kind} in {CRDS}")


def validate(d: dict) -> None:
    """``d`` against the Kubernetes schemas, or its CRD's; raises naming the field."""
    if d["apiVersion"].startswith("inference.networking.k8s.io/"):
        crd_validator(d["kind"]).validate(d)
    else:
        kv.validate(d, K8S_VERSION, strict=True)


def test_every_resource_is_valid_kubernetes():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap",
                                         "HorizontalPodAutoscaler"}
    pool = documents(POOL)
    assert {d["kind"] for d in pool} - {d["kind"] for d in docs} == {"InferencePool"}
    for d in pool:              # the base and the variant's own resources
        validate(d)


def test_a_wrong_inference_pool_field_is_caught():
    bad = by_kind("InferencePool", "tandem-engines", POOL)
    bad["spec"]["endpointPickerRef"]["prot"] = {"number": 9002}
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = by_kind("InferencePool", "tandem-engines", POOL)
    del bad["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_the_pool_selects_the_engine_pods_and_its_picker_is_tandem_on_the_gateway_config():
    pool = by_kind("InferencePool", "tandem-engines", POOL)["spec"]
    engine = by_kind("StatefulSet", "tandem-engine", POOL)["spec"]["template"]
    labels = engine["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for p in engine["spec"]["containers"][0]["ports"] if p["name"] == "http"}
    assert [p["number"] for p in pool["targetPorts"]] == sorted(ports)
    ref = pool["endpointPickerRef"]
    service = by_kind("Service", ref["name"], POOL)["spec"]
    picker = by_kind("Deployment", ref["name"], POOL)["spec"]["template"]["spec"]
    assert service["selector"].items() <= by_kind("Deployment", ref["name"], POOL)["spec"]["template"][
        "metadata"]["labels"].items()
    grpc_port = next(p for p in service["ports"] if p["port"] == ref["port"]["number"])
    container = picker["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    from gateway.commands import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(container["command"][1:])
    assert args.command == "serve" and args.picker_port == named[grpc_port["targetPort"]]
    assert container["readinessProbe"]["grpc"] == {"port": args.picker_health_port, "service": "readiness"}
    mount = next(m for m in container["volumeMounts"] if args.config.startswith(m["mountPath"]))
    volume = next(v for v in picker["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "tandem-gateway"     # the config the gateway test checks names the pods


def test_redis_keeps_what_only_it_holds_and_refuses_writes_before_its_memory_limit():
    """A soak trial: the shipped Redis ran unpersisted with a 512Mi limit and no maxmemory, so its keys (~0.35 MB
    a 1,000 requests: the ledger, stored Responses) would get it OOM-killed, and it came back empty: the usage
    history, stored responses and rollouts lost. It is persisted on a volume and capped below its limit."""
    redis = by_kind("StatefulSet", "tandem-redis")["spec"]
    container = redis["template"]["spec"]["containers"][0]
    args = dict(zip(container["args"][::2], container["args"][1::2]))
    assert args["--appendonly"] == "yes" and args["--maxmemory-policy"] == "noeviction"
    mount = container["volumeMounts"][0]
    assert args["--dir"] == mount["mountPath"] and mount["name"] == redis["volumeClaimTemplates"][0]["metadata"]["name"]
    cap, limit = args["--maxmemory"], container["resources"]["limits"]["memory"]
    assert cap.endswith("mb") and limit.endswith("Gi") and int(cap[:-2]) * 2**20 < 0.85 * int(limit[:-2]) * 2**30


def test_a_wrong_field_is_caught():
    bad = by_kind("StatefulSet", "tandem-engine")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_the_gateway_config_is_a_valid_tandem_config_routing_to_the_engine_pods():
    text = by_kind("ConfigMap", "tandem-gateway")["data"]["config.yaml"]
    compiled = load_config_text(text)
    engine = by_kind("StatefulSet", "tandem-engine")
    hosts = {f"tandem-engine-{i}.{engine['spec']['serviceName']}" for i in range(engine["spec"]["replicas"])}
    urls = {b.base_url for b in compiled.config.backends.values()}
    assert {u.split("//")[1].split(":")[0] for u in urls} == hosts
    gateway = by_kind("Deployment", "tandem-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health/ready"


@pytest.mark.parametrize("kind, name, base", [("Deployment", "tandem-gateway", HERE),
                                              ("Deployment", "tandem-picker", POOL)])
def test_the_gateway_pods_would_bind_with_the_environment_they_get(kind, name, base):
    """``tandem serve`` refuses a non-loopback bind without a virtual key (``bind_refusal``): each pod serving the
    gateway's ConfigMap gets the keys it names from its Secret, so it starts; without them it would exit 2."""
    from gateway.commands import register
    from gateway.http.server import bind_refusal

    container = by_kind(kind, name, base)["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(container["command"][1:])
    text = by_kind("ConfigMap", "tandem-gateway", base)["data"]["config.yaml"]
    env = {e["name"]: "secret-value" for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    compiled = load_config_text(text, environ=env)
    host = args.host or compiled.config.server.host
    assert host == "0.0.0.0" and bind_refusal(compiled, host, args.insecure) is None
    refusal = bind_refusal(load_config_text(text, environ={}), host, args.insecure)
    # the keys are configured, their variables unset: said so (a CLI trial read "no virtual API keys are configured")
    unset = [k.env for k in compiled.config.auth.keys if k.env]
    assert "refusing to bind" in refusal and unset and all(name in refusal for name in unset), refusal


def test_the_engine_arguments_are_valid_engine_arguments():
    container = by_kind("StatefulSet", "tandem-engine")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["tandem", "engine", "serve"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    add_engine_cli_args(parser)
    args = parser.parse_args(container["args"])
    engine_args = engine_args_from_cli(args)
    assert isinstance(engine_args, EngineArgs) and engine_args.kv_events_config
    assert any(a.startswith("--tensor-parallel-size=") for a in container["args"])
    assert engine_args.tensor_parallel_size == args.tensor_parallel_size >= 1
    ports = {p["containerPort"] for p in container["ports"]}
    assert args.port in ports and {5557, 5558} <= ports

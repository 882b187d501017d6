"""deploy/kubernetes/: both overlays render (tests/deploy/kustomize.py, the same as `kubectl kustomize`),
every core resource is valid against Kubernetes' own schemas (kubernetes-validate, strict), and the pieces
fit together: probes on the server's endpoints, the drain inside the grace period, engine options kvforge
accepts, selectors that select, the autoscaler's metric served by the adapter rule."""
import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kustomize import build, strategic_merge
from kvforge.config import EngineConfig
from kvforge.server.cli import add_serve_parser

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs it")

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
#: not the bare overlay names: a test with the keyword "gpu" is skipped without a CUDA device (tests/conftest.py)
OVERLAY_IDS = [f"overlay-{o}" for o in OVERLAYS]
#: the Kubernetes release the schemas are checked against (the newest kubernetes-validate ships)
K8S_VERSION = kubernetes_validate.utils.latest_version()
#: resources of CRDs, not in Kubernetes' schemas: checked by the tests below instead
CRD_KINDS = {"ServiceMonitor"}


def rendered(overlay: str) -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["metadata"]["name"]): r for r in build(KUBE / "overlays" / overlay)}


def one(resources: dict, kind: str) -> dict:
    (resource,) = [r for (k, _), r in resources.items() if k == kind]
    return resource


def serve_args(args: list[str]) -> argparse.Namespace:
    """``args`` parsed by the real ``kvforge serve`` parser (SystemExit on an unknown flag)."""
    parser = argparse.ArgumentParser(prog="kvforge")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *args])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_core_resource_is_valid_against_the_kubernetes_schemas(overlay):
    resources = rendered(overlay)
    kinds = {kind for kind, _ in resources}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ServiceMonitor"} <= kinds
    for (kind, name), resource in resources.items():
        if kind in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {kind}/{name}: {exc.message} at {'.'.join(map(str, exc.path))}")


def test_the_validator_rejects_a_misspelt_field():
    """The schema test can fail: a probe field with a typo is refused in strict mode."""
    deployment = one(rendered("cpu"), "Deployment")
    bad = strategic_merge(deployment, {"spec": {"template": {"spec": {"containers": [
        {"name": "kvforge", "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSecond": 5}}]}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: nothing to compare with")
@pytest.mark.parametrize("directory", ["base", "overlays/cpu", "overlays/gpu"])
def test_the_renderer_matches_kubectl_kustomize(directory):
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / directory)], capture_output=True, text=True, check=True)
    expected = {(r["kind"], r["metadata"]["name"]): r for r in yaml.safe_load_all(out.stdout) if r}
    got = {(r["kind"], r["metadata"]["name"]): r for r in build(KUBE / directory)}
    assert got == expected


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_the_probes_use_health_for_liveness_and_ready_for_readiness(overlay):
    pod = one(rendered(overlay), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}  # the image's entrypoint: --port 8000
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: p["httpGet"]["path"] for k, p in probes.items()} == {
        "startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
    assert all(p["httpGet"]["port"] == "http" for p in probes.values())
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading takes minutes"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_the_grace_period_outlasts_the_pre_stop_sleep_and_the_drain(overlay):
    pod = one(rendered(overlay), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_args(container["args"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + args.shutdown_timeout + 10


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_shm_is_a_memory_empty_dir_and_the_config_map_is_mounted_where_args_point(overlay):
    resources = rendered(overlay)
    pod = one(resources, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    config_path = Path(serve_args(container["args"]).config)
    config_map = volumes[mounts[str(config_path.parent)]]["configMap"]["name"]
    assert config_path.name in resources[("ConfigMap", config_map)]["data"]
    assert "/cache" in mounts, "HF_HOME of the images"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_the_engine_options_are_ones_kvforge_accepts(overlay, tmp_path):
    """The ConfigMap's kvforge.yaml through EngineConfig.create, as `kvforge serve --config` reads it."""
    config_map = one(rendered(overlay), "ConfigMap")
    path = tmp_path / "kvforge.yaml"
    path.write_text(config_map["data"]["kvforge.yaml"])
    config = EngineConfig.create(path)
    options = yaml.safe_load(path.read_text())
    assert {k: getattr(config, k) for k in options} == options
    if overlay == "gpu":
        assert {"model", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs",
                "max_num_batched_tokens", "block_size", "swap_space", "enable_prefix_caching"} <= set(options)
    else:
        assert config.device == "cpu" and config.model is None, "the CPU image's baked-in default model"


def test_the_gpu_overlay_asks_for_as_many_gpus_as_tensor_parallel_ranks():
    resources = rendered("gpu")
    options = yaml.safe_load(one(resources, "ConfigMap")["data"]["kvforge.yaml"])
    pod = one(resources, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].endswith(":cuda")
    limits = container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == options.get("tensor_parallel_size", 1)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_the_cpu_overlay_runs_the_cpu_image_with_cpu_and_memory_requests():
    (container,) = one(rendered("cpu"), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(":cpu")
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_service_pdb_and_service_monitor_select_the_pods(overlay):
    resources = rendered(overlay)
    deployment = one(resources, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one(resources, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitor = one(resources, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"
    assert service_ports["http"]["targetPort"] == "http"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_the_autoscaler_scales_the_deployment_on_the_adapter_rules_metric(overlay):
    resources = rendered(overlay)
    hpa = one(resources, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) in resources
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] in adapter_metric_names()
    assert hpa["spec"]["minReplicas"] >= 2, "one replica left while the other restarts"


def adapter_metric_names() -> set[str]:
    """The custom-metrics names the example adapter rules serve (seriesQuery's metric renamed by name.as)."""
    config_map = yaml.safe_load((KUBE / "prometheus-adapter" / "adapter-config.yaml").read_text())
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    names = set()
    for rule in yaml.safe_load(config_map["data"]["config.yaml"])["rules"]:
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
        assert series in documented_metrics(), f"{series}: not a kvforge metric (docs/server.md)"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        names.add(re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series))
    return names


def documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "server.md").read_text()
    return set(re.findall(r"^\| `(kvforge:[a-z0-9_]+)` \|", text, flags=re.M))

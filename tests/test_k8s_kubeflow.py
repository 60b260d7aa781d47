"""fulltune as a Kubeflow Trainer runtime: the ClusterTrainingRuntime (k8s/kubeflow) a platform team installs once,
the TrainJob (k8s/kubeflow/example) that names it and says only what to train and on what, and the metrics
component (k8s/components/metrics) that lets Prometheus scrape rank 0.

Both render with kubectl's kustomize and validate against Kubeflow Trainer v2.3.0's API models (every key known);
the pod the Trainer makes of them validates against Kubernetes 1.33 (strict), is locked down as the Job is, parses
into the job the TrainJob asked for, and keeps the exit-code contract of the namespaced runtime.
"""

from __future__ import annotations

import os
import re

import kubernetes_validate
import pytest
import yaml
from deploy_files import COMPLETION_INDEX, REPO, dockerfile, entrypoint, image_env, node_job, one, render, unknown_fields
from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

from trainer.core import settings
from trainer.telemetry import kubeflow

KUBERNETES_VERSION = "1.33.0"


@pytest.fixture(scope="module")
def runtime():
    (obj,) = render(REPO / "k8s" / "kubeflow")
    return obj


@pytest.fixture(scope="module")
def example():
    return render(REPO / "k8s" / "kubeflow" / "example")


@pytest.fixture(scope="module")
def made(runtime, example):
    """The node Job (and JobSet spec) the Trainer makes of the example TrainJob on the runtime."""
    return node_job(one(example, "TrainJob"), runtime)


def _container(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def test_the_runtime_and_the_trainjob_validate_against_the_trainer_v2_3_models_with_every_key_known(runtime, example):
    assert runtime["kind"] == "ClusterTrainingRuntime" and runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert "namespace" not in runtime["metadata"]  # cluster-scoped: one for every namespace
    trainjob = one(example, "TrainJob")
    for obj, model in ((runtime, TrainerV1alpha1ClusterTrainingRuntime), (trainjob, TrainerV1alpha1TrainJob)):
        assert unknown_fields(model, obj) == [], obj["kind"]
        assert model.from_dict(obj).to_dict() == obj, obj["kind"]  # nothing dropped or converted on the way
    assert runtime["spec"]["mlPolicy"]["torch"] == {} and runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    image = _container({"spec": runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]})["image"]
    assert image == "fulltune:0.1.0"  # what `docker build -t fulltune:0.1.0 .` makes, until an `images:` entry sets the user's (tests/test_k8s.py)


def test_the_trainjob_names_the_cluster_runtime_and_sets_only_ft_variables_and_resources(example):
    trainjob = one(example, "TrainJob")
    assert set(trainjob["spec"]) == {"runtimeRef", "trainer"}
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": "fulltune"}
    assert set(trainjob["spec"]["trainer"]) == {"env", "resourcesPerNode"}
    assert all(variable["name"].startswith("FT_") and set(variable) == {"name", "value"} for variable in trainjob["spec"]["trainer"]["env"])
    settings.load({v["name"]: v["value"] for v in trainjob["spec"]["trainer"]["env"]} | {"FT_PLATFORM": "none"})  # valid values


def test_the_pod_the_trainer_makes_validates_and_is_locked_down_as_the_job_is(made):
    job, _ = made
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)  # raises on any unknown or bad field
    base = one(render(REPO / "k8s" / "overlays" / "generic"), "Job")
    pod, base_pod = job["spec"]["template"]["spec"], base["spec"]["template"]["spec"]
    container, base_container = _container(job), _container(base)
    assert pod["securityContext"] == base_pod["securityContext"]  # non-root as the image's user, seccomp, fsGroup
    assert container["securityContext"] == base_container["securityContext"]  # read-only root, no privilege, no capabilities
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    image_user = [a for k, a in dockerfile() if k == "USER"][-1]
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == image_user
    for field in ("automountServiceAccountToken", "enableServiceLinks", "terminationGracePeriodSeconds", "tolerations"):
        assert pod[field] == base_pod[field], field
    assert container["terminationMessagePolicy"] == base_container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["command"] == entrypoint(dockerfile())  # the image's own: tini, then entrypoint.py, which keeps the exit codes
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory" and "emptyDir" in mounts["/tmp"]
    assert mounts["/output"]["persistentVolumeClaim"]["claimName"] == "fulltune-output"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"] == "1"  # the TrainJob's


def _pod_env(job, index, injected):
    """Pod `index`'s environment as the kubelet builds it: the image's ENV, then `env` in order, field references
    resolved and $(VAR) expanded from the variables before it (the Secrets, all optional, absent); `injected`: what
    the Trainer's controller adds (its status server's three variables)."""
    labels = {**job["spec"]["template"]["metadata"]["labels"], COMPLETION_INDEX: str(index)}
    annotations = {COMPLETION_INDEX: str(index)}
    env = dict(image_env(dockerfile()))
    for variable in [*_container(job)["env"], *({"name": k, "value": v} for k, v in injected.items())]:
        if "value" in variable:
            env[variable["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), variable["value"])
        elif "fieldRef" in variable["valueFrom"]:
            kind, key = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", variable["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            env[variable["name"]] = (labels if kind == "labels" else annotations)[key]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["optional"], variable["name"]
    env["HOSTNAME"] = f"{job['metadata']['name']}-{index}"
    return env


def test_each_trainjob_gets_its_own_folder_and_the_pod_serves_metrics_where_its_port_and_annotations_say(made, example):
    job, _ = made
    trainjob = one(example, "TrainJob")
    status = {kubeflow.URL: "https://kubeflow-trainer-controller-manager.kubeflow.svc:8082/status",  # what the controller injects
              kubeflow.CA_CERT: "/var/run/secrets/kubeflow/trainer/ca.crt", kubeflow.TOKEN: "/var/run/secrets/kubeflow/trainer/token"}
    parsed = settings.load(_pod_env(job, 0, status))
    assert parsed.output_dir == f"/output/{trainjob['metadata']['name']}"  # resumed by the same TrainJob, apart from the others
    assert (parsed.model, parsed.dataset, parsed.max_steps) == ("Qwen/Qwen3-4B", "trl-lib/Capybara", 50)
    assert (parsed.num_nodes, parsed.node_rank, parsed.platform) == (1, 0, "none")
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= parsed.stop_deadline_seconds + 30
    (port,) = [p["containerPort"] for p in _container(job)["ports"] if p.get("name") == "metrics"]
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert parsed.metrics_port == port == int(annotations["prometheus.io/port"]) and annotations["prometheus.io/scrape"] == "true"
    assert parsed.metrics_port != parsed.master_port


def test_the_cluster_runtime_keeps_the_exit_code_contract_of_the_namespaced_runtime(runtime):
    namespaced = one(render(REPO / "k8s" / "overlays" / "trainjob"), "TrainingRuntime")

    def policies(obj):
        spec = obj["spec"]["template"]["spec"]
        (replicated,) = spec["replicatedJobs"]
        job = replicated["template"]["spec"]
        return spec["failurePolicy"], job["podFailurePolicy"], job["backoffLimit"], job["podReplacementPolicy"], job["template"]["spec"]["restartPolicy"]

    assert policies(runtime) == policies(namespaced)  # tests/test_k8s_scale.py walks each exit code through them
    assert runtime["spec"]["template"]["spec"]["network"] == namespaced["spec"]["template"]["spec"]["network"]


@pytest.fixture(scope="module")
def with_metrics(tmp_path_factory):
    """The generic overlay with the metrics component, composed as the component's comment shows."""
    folder = tmp_path_factory.mktemp("metrics")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "k8s" / "overlays" / "generic", folder)],
        "components": [os.path.relpath(REPO / "k8s" / "components" / "metrics", folder)],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(folder)


def test_the_metrics_component_lets_prometheus_scrape_rank_0_of_the_job_and_of_the_trainjob_and_nothing_else(with_metrics, made):
    monitor, policy = one(with_metrics, "PodMonitor"), one([o for o in with_metrics if o["metadata"]["name"] == "fulltune-allow-scrape"], "NetworkPolicy")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == "fulltune"
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    job = one(with_metrics, "Job")
    settings_port = int(one(with_metrics, "ConfigMap")["data"]["FT_METRICS_PORT"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for pod_job in (job, made[0]):  # the Job's pod, the TrainJob's node pod
        labels = pod_job["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (port,) = [p["containerPort"] for p in _container(pod_job)["ports"] if p.get("name") == endpoint["port"]]
        assert port == settings_port == int(pod_job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    (keep,) = endpoint["relabelings"]
    label = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", COMPLETION_INDEX)  # Prometheus turns every other character into _
    assert keep["action"] == "keep" and keep["sourceLabels"] == [label]
    kept = [index for index in ("", "0", "1", "10") if re.fullmatch(keep["regex"], index)]  # Prometheus anchors its regexes
    assert kept == ["", "0"]  # a one-pod Job (no index) and node 0; the other nodes serve nothing
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": settings_port}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]

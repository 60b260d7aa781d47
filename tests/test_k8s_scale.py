"""Scaling out on Kubernetes: the 8-GPU overlay, the two-node Indexed Job and the two-node TrainJob.

Every overlay renders and validates (core kinds against Kubernetes 1.33 strict, the TrainJob and its runtime
against the kubeflow-trainer-api models, every key checked), passes checkov, and does what a user would notice:
each pod's environment, with what Kubernetes or the Trainer adds to it, parses into its own node of one job;
the failure policies keep the exit-code contract; the nodes can reach each other and nobody else can.
"""

import copy
import json
import os
import re
import subprocess

import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    COMPLETION_INDEX,
    REPO,
    SCALE_OVERLAYS,
    TRAINER_PORT,
    dockerfile,
    entrypoint,
    image_env,
    node_job,
    one,
    pod_failure_rule,
    render,
    tool,
    unknown_fields,
)
from kubeflow_trainer_api.models import TrainerV1alpha1TrainingRuntime, TrainerV1alpha1TrainJob

from trainer.core import cluster, config, settings

KUBERNETES_VERSION = "1.33.0"
TRAINER_KINDS = {"TrainJob": TrainerV1alpha1TrainJob, "TrainingRuntime": TrainerV1alpha1TrainingRuntime}


@pytest.fixture(scope="module")
def rendered():
    return {overlay: render(REPO / "k8s" / "overlays" / overlay) for overlay in SCALE_OVERLAYS}


@pytest.fixture(scope="module")
def one_gpu_job():
    """The 1-GPU Job the 8-GPU overlay builds on."""
    return one(render(REPO / "k8s" / "overlays" / "generic"), "Job")


@pytest.fixture(scope="module")
def with_kueue(tmp_path_factory):
    """Each overlay with the optional Kueue component, composed the way the overlays' comments show."""
    composed = {}
    for overlay in SCALE_OVERLAYS:
        folder = tmp_path_factory.mktemp(f"kueue-{overlay}")
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(REPO / "k8s" / "overlays" / overlay, folder)],
            "components": [os.path.relpath(REPO / "k8s" / "components" / "kueue", folder)],
        }
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        composed[overlay] = render(folder)
    return composed


# -- What the Trainer makes of the TrainJob -------------------------------------------------------

def trainjob_node_job(objects):
    """The node Job and the JobSet spec that Kubeflow Trainer makes from the rendered TrainJob (deploy_files.node_job)."""
    trainjob, runtime = one(objects, "TrainJob"), one(objects, "TrainingRuntime")
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref.get("apiGroup"), ref.get("kind"), ref["name"]) == ("trainer.kubeflow.org", "TrainingRuntime", runtime["metadata"]["name"])
    assert runtime["metadata"]["namespace"] == trainjob["metadata"]["namespace"]  # a TrainingRuntime serves TrainJobs of its own namespace
    return node_job(trainjob, runtime)


@pytest.fixture(scope="module")
def trainjob_made(rendered):
    return trainjob_node_job(rendered["trainjob"])


def _jobs(rendered, trainjob_made):
    """Every overlay's Job: the 8-GPU one, the Indexed Job and the node Job the TrainJob makes."""
    return {"8-gpu": one(rendered["8-gpu"], "Job"), "indexed-job": one(rendered["indexed-job"], "Job"), "trainjob": trainjob_made[0]}


def _container(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _configmap(objects):
    return one(objects, "ConfigMap")["data"]


def _pod_labels(job, index):
    """Pod `index`'s labels: its template's, and those the Job controller adds."""
    name = job["metadata"]["name"]
    return {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name, "job-name": name, COMPLETION_INDEX: str(index)}


def _pod_env(objects, job, index):
    """The environment pod `index` of `job` starts with, as Kubernetes builds it: the image's ENV, then the
    ConfigMaps (envFrom), then `env` (field references resolved for this pod; the Secrets, all optional, absent),
    then what the Job controller adds to an Indexed Job's containers (JOB_COMPLETION_INDEX) and the host name."""
    container = _container(job)
    env = dict(image_env(dockerfile()))
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])  # a KeyError: the reference misses the generated name
    annotations = {COMPLETION_INDEX: str(index)}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        elif "fieldRef" in variable["valueFrom"]:
            (annotation,) = re.fullmatch(r"metadata\.annotations\['(.+)'\]", variable["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            env[variable["name"]] = annotations[annotation]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["optional"], variable["name"]
    if job["spec"].get("completionMode") == "Indexed":
        env.setdefault("JOB_COMPLETION_INDEX", str(index))
    env["HOSTNAME"] = f"{job['metadata']['name']}-{index}"
    return env


# -- Rendering and validation ----------------------------------------------------------------------


def test_each_overlay_renders_its_workload_the_settings_the_volume_and_its_network_policies(rendered):
    kinds = {overlay: sorted(o["kind"] for o in objects) for overlay, objects in rendered.items()}
    assert kinds == {
        "8-gpu": ["ConfigMap", "Job", "NetworkPolicy", "PersistentVolumeClaim"],
        "indexed-job": ["ConfigMap", "Job", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "Service"],
        "trainjob": ["ConfigMap", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "TrainJob", "TrainingRuntime"],
    }
    for objects in rendered.values():
        assert {o["metadata"]["namespace"] for o in objects} == {"fulltune"}
        assert {o["metadata"]["labels"]["app.kubernetes.io/name"] for o in objects} == {"fulltune"}


def test_every_core_object_and_the_job_a_trainjob_makes_validate_against_kubernetes_1_33_in_strict_mode(rendered, with_kueue, trainjob_made):
    checked = 0
    for objects in [*rendered.values(), *with_kueue.values(), [trainjob_made[0]]]:
        for obj in objects:
            if obj["kind"] not in TRAINER_KINDS:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises on any unknown or bad field
                checked += 1
    assert checked == 2 * (4 + 6 + 4) + 1


def test_the_trainjob_and_its_runtime_validate_against_the_trainer_api_models_with_every_key_known(rendered, with_kueue):
    for objects in (rendered["trainjob"], with_kueue["trainjob"]):
        for kind, model in TRAINER_KINDS.items():
            obj = one(objects, kind)
            assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
            assert unknown_fields(model, obj) == [], kind
            assert model.from_dict(obj).to_dict() == obj, kind  # nothing dropped or converted on the way


def test_the_trainer_api_models_ignore_unknown_fields_so_every_key_is_checked_against_them(rendered):
    """kubeflow-trainer-api 2.3.0's `from_dict` keeps what it knows and drops the rest: a misspelled field (or one
    the API does not have, such as a container's resources in a runtime patch) would pass it and silently be lost."""
    trainjob = copy.deepcopy(one(rendered["trainjob"], "TrainJob"))
    trainjob["spec"]["trainer"]["numProcsPerNode"] = 8
    patch = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    patch["template"]["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
    parsed = TrainerV1alpha1TrainJob.from_dict(trainjob)  # no error
    assert "numProcsPerNode" not in parsed.to_dict()["spec"]["trainer"]
    assert unknown_fields(TrainerV1alpha1TrainJob, trainjob) == [
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec.containers[0].resources",
        "spec.trainer.numProcsPerNode",
    ]


@pytest.fixture(scope="module")
def checkov_reports(rendered, with_kueue, trainjob_made, tmp_path_factory):
    """One checkov run over every rendered overlay (checkov skips the TrainJob and its runtime, kinds it does not
    know) and over the Job the TrainJob makes, which carries the TrainJob's skip annotations."""
    folder = tmp_path_factory.mktemp("checkov")
    files = []
    for name, objects in [*rendered.items(), *((f"{o}-kueue", objs) for o, objs in with_kueue.items()), ("trainjob-node-job", [trainjob_made[0]])]:
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(objects))
        files.append(str(folder / f"{name}.yaml"))
    command = [tool("checkov"), "--framework", "kubernetes", "--skip-download", "--output", "json"]
    result = subprocess.run([*command, *(arg for f in files for arg in ("--file", f))], capture_output=True, text=True, timeout=300)
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_reports_no_failed_check_and_every_skip_gives_its_reason(checkov_reports):
    (report,) = checkov_reports
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert failed == []
    assert report["summary"]["parsing_errors"] == 0
    skipped = report["results"]["skipped_checks"]
    assert skipped and all(len(check["check_result"].get("suppress_comment", "")) > 20 for check in skipped)
    assert {check["check_id"] for check in skipped} == {"CKV_K8S_43", "CKV_K8S_35"}
    scanned = {check["file_path"].rsplit("/", 1)[-1] for check in report["results"]["passed_checks"]}
    assert "trainjob-node-job.yaml" in scanned and report["summary"]["passed"] > 150


# -- One machine, eight GPUs -----------------------------------------------------------------------


def test_8_gpu_overlay_requests_a_whole_8_gpu_machine_and_its_settings_parse_to_8_processes(rendered, one_gpu_job):
    job = one(rendered["8-gpu"], "Job")
    resources = _container(job)["resources"]
    gpus = int(resources["requests"]["nvidia.com/gpu"])
    assert gpus == int(resources["limits"]["nvidia.com/gpu"]) == 8
    parsed = settings.load(_pod_env(rendered["8-gpu"], job, 0))
    assert parsed.num_processes == gpus and parsed.num_nodes == 1
    job_config = config.build(parsed, cuda=True, bf16_supported=True)
    assert job_config.world_size == 8  # torchrun starts eight processes on this one node
    # Each process gets what the 1-GPU job's one process gets (the 8-gpu overlay's comments say why).
    single = _container(one_gpu_job)["resources"]
    for kind in ("requests", "limits"):
        assert _quantity(resources[kind]["memory"]) == 8 * _quantity(single[kind]["memory"])
        assert int(resources[kind]["cpu"]) == 8 * int(single[kind]["cpu"])
    (shm,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert _quantity("16Gi") < _quantity(shm["emptyDir"]["sizeLimit"]) < _quantity(resources["limits"]["memory"])


def _quantity(text):
    units = {"Gi": 2**30, "Ti": 2**40}
    return int(text[:-2]) * units[text[-2:]]


def test_8_gpu_overlay_keeps_the_exit_code_policy_of_the_1_gpu_job(rendered, one_gpu_job):
    job = one(rendered["8-gpu"], "Job")
    assert job["spec"]["podFailurePolicy"] == one_gpu_job["spec"]["podFailurePolicy"]
    assert _job_action(job, 2) == _job_action(job, 4) == "FailJob"
    assert _job_action(job, 75) == _job_action(job, 76) == _job_action(job, 137, {("DisruptionTarget", "True")}) == "Ignore"
    assert _job_action(job, 1) == _job_action(job, 3) == "Count"
    assert job["spec"]["backoffLimit"] >= 1


def _job_action(job, exit_code=None, conditions=(), container="trainer"):
    matched = pod_failure_rule(job, container, exit_code, conditions)
    return matched[1]["action"] if matched else "Count"


# -- Two machines: what each pod makes of its environment -----------------------------------------


def _same_job_on_every_node(parsed):
    """The check every rank makes at start (trainer/core/ranks.py): all FT_* settings equal but the node's own two."""
    import dataclasses

    shared = [dataclasses.replace(s, node_rank=0, termination_message_path="") for s in parsed]
    return all(s == shared[0] for s in shared)


def test_each_indexed_job_pod_parses_into_its_own_node_of_one_two_node_job(rendered):
    objects = rendered["indexed-job"]
    job = one(objects, "Job")
    parsed = []
    for index in range(job["spec"]["completions"]):
        env = _pod_env(objects, job, index)
        assert cluster.detect(env)[0] == "indexed-job"
        s = settings.load(env)
        assert (s.num_nodes, s.node_rank, s.num_processes, s.master_port) == (job["spec"]["completions"], index, 8, 29500)
        assert s.num_nodes == 2 and s.master_addr == "fulltune-0.fulltune-nodes"
        parsed.append(s)
    assert _same_job_on_every_node(parsed)
    assert config.build(parsed[0], cuda=True, bf16_supported=True).world_size == 16


def test_indexed_job_names_node_0_by_its_host_name_in_the_headless_service(rendered):
    objects = rendered["indexed-job"]
    job, service = one(objects, "Job"), one(objects, "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    host, domain = settings.load(_pod_env(objects, job, 1)).master_addr.split(".")
    assert host == f"{job['metadata']['name']}-0"  # an Indexed Job's pod i has the host name <job>-i
    assert domain == pod["subdomain"] == service["metadata"]["name"]  # <host>.<subdomain> resolves through this Service
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= _pod_labels(job, 0).items()
    assert pod["enableServiceLinks"] is False


def test_each_trainjob_pod_parses_into_its_own_node_of_one_two_node_job(rendered, trainjob_made):
    objects = rendered["trainjob"]
    job, jobset = trainjob_made
    trainjob = one(objects, "TrainJob")
    parsed = []
    for index in range(trainjob["spec"]["trainer"]["numNodes"]):
        env = _pod_env(objects, job, index)
        assert env["FT_OUTPUT_DIR"] == "/output"  # the ConfigMap reached the pod (kustomize renamed the reference too)
        assert cluster.detect(env)[0] == "kubeflow-trainer"
        s = settings.load(env)
        assert (s.num_nodes, s.node_rank, s.num_processes, s.master_port) == (job["spec"]["completions"], index, 8, TRAINER_PORT)
        assert s.num_nodes == 2
        host, domain = s.master_addr.split(".")
        assert host == f"{job['metadata']['name']}-0" and domain == job["spec"]["template"]["spec"]["subdomain"]
        parsed.append(s)
    assert _same_job_on_every_node(parsed)
    assert jobset["network"]["enableDNSHostnames"] is True and jobset["network"]["publishNotReadyAddresses"] is True


def test_trainjob_runs_the_images_own_entrypoint_and_the_rendered_image(rendered, trainjob_made):
    trainjob, runtime = one(rendered["trainjob"], "TrainJob"), one(rendered["trainjob"], "TrainingRuntime")
    assert trainjob["spec"]["trainer"]["command"] == entrypoint(dockerfile())  # tini as PID 1, entrypoint.py under it
    image = _container(trainjob_made[0])["image"]
    assert image == _container(one(rendered["8-gpu"], "Job"))["image"] == "fulltune:0.1.0"  # until the overlay sets it (test_k8s.py)
    (runtime_container,) = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert runtime_container["image"] == image


# -- Two machines: failures ------------------------------------------------------------------------


def test_indexed_job_retries_each_node_and_keeps_the_exit_code_contract(rendered):
    job = one(rendered["indexed-job"], "Job")
    assert {_job_action(job, code) for code in (2, 4, 5, 6, 9)} == {"FailJob"}  # the whole Job, both nodes, at once
    assert _job_action(job, 75) == _job_action(job, 76) == _job_action(job, 137, {("DisruptionTarget", "True")}) == "Ignore"
    assert _job_action(job, 1) == _job_action(job, 137) == _job_action(job, 7) == "Count"  # 7: node 0 found the volume leased by another job
    # Registration failed on node 0 while node 1 finished: node 0 alone could never rendezvous again, so the Job
    # fails at once; applied again, both nodes start and only register.
    assert _job_action(job, 3) == "FailJob"
    spec = job["spec"]
    assert spec["backoffLimitPerIndex"] >= 1 and spec["maxFailedIndexes"] == 0  # a node out of retries fails the Job
    assert "backoffLimit" not in spec  # then Kubernetes counts per node only
    assert spec["activeDeadlineSeconds"] > 0


def test_every_job_meets_the_api_servers_rules_that_the_schema_does_not_hold(rendered, trainjob_made):
    """Kubernetes 1.33's validation of a Job beyond its OpenAPI schema (pkg/apis/batch/validation), for the fields used."""
    for overlay, job in _jobs(rendered, trainjob_made).items():
        spec = job["spec"]
        rules = spec["podFailurePolicy"]["rules"]
        assert len(rules) <= 20
        for rule in rules:
            assert ("onExitCodes" in rule) != ("onPodConditions" in rule), overlay
            if "onExitCodes" in rule:
                values = rule["onExitCodes"]["values"]
                assert values == sorted(set(values)) and 0 not in values, (overlay, values)  # ordered, unique, no 0 with In
                assert rule["onExitCodes"]["containerName"] == _container(job)["name"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed", overlay  # podFailurePolicy's
        if "backoffLimitPerIndex" in spec:
            assert spec["completionMode"] == "Indexed" and 0 <= spec["maxFailedIndexes"] <= spec["completions"]
        if spec.get("completionMode") == "Indexed":
            assert spec["completions"] == spec["parallelism"], overlay  # every node at once: they wait for each other


def _jobset_action(job, jobset, exit_code=None, conditions=()):
    """What happens to the whole TrainJob when one node's pod fails this way: the node Job's podFailurePolicy, then
    the JobSet failurePolicy's first matching rule (RestartJobSet, counted, when none matches)."""
    matched = pod_failure_rule(job, "node", exit_code, conditions)
    action = matched[1]["action"] if matched else "Count"
    assert action in ("FailJob", "Count")  # with backoffLimit 0 a failed pod always fails its Job
    if action == "FailJob":
        index, rule = matched
        pod = f"{job['metadata']['namespace']}/{job['metadata']['name']}-1-x7k2p"
        reason = "PodFailurePolicy"  # the Job controller's messages, word for word
        message = (
            f"Container node for pod {pod} failed with exit code {exit_code} matching FailJob rule at index {index}"
            if "onExitCodes" in rule
            else f"Pod {pod} has condition DisruptionTarget matching FailJob rule at index {index}"
        )
    else:
        assert job["spec"]["backoffLimit"] == 0
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    for rule in jobset["failurePolicy"]["rules"]:
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("onJobFailureMessagePatterns") and not any(re.search(p, message) for p in rule["onJobFailureMessagePatterns"]):
            continue
        return rule["action"]
    return "RestartJobSet"


def test_trainjob_failure_policy_keeps_the_exit_code_contract_for_all_nodes_at_once(rendered, trainjob_made):
    job, jobset = trainjob_made
    assert _jobset_action(job, jobset, 2) == _jobset_action(job, jobset, 4) == _jobset_action(job, jobset, 5) == _jobset_action(job, jobset, 6) == "FailJobSet"
    assert _jobset_action(job, jobset, 9) == "FailJobSet"  # a benchmark fell past FT_EVAL_MAX_REGRESSION
    stopped = [_jobset_action(job, jobset, code) for code in (75, 76)]
    disrupted = _jobset_action(job, jobset, 137, {("DisruptionTarget", "True")})
    assert stopped == ["RestartJobSetAndIgnoreMaxRestarts"] * 2 and disrupted == "RestartJobSetAndIgnoreMaxRestarts"
    assert _jobset_action(job, jobset, 1) == _jobset_action(job, jobset, 3) == _jobset_action(job, jobset, 137) == "RestartJobSet"
    assert _jobset_action(job, jobset, 7) == "RestartJobSet"  # another job holds the volume's lease: counted restarts, then fail
    assert _jobset_action(job, jobset, 77) == "RestartJobSet"  # stuck (FT_STUCK_EXIT=true): counted restarts
    policy = jobset["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert policy["restartStrategy"] == "BlockingRecreate"  # no new pod while an old one may still be writing the volume
    for rule in policy["rules"]:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])  # JobSet's rule for rule names
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # not JobSet's default OnFailure
    assert one(rendered["trainjob"], "TrainJob")["spec"]["activeDeadlineSeconds"] > 0  # bounds the uncounted restarts


def test_grace_period_covers_the_stop_deadline_on_every_overlay(rendered, trainjob_made):
    for overlay, job in _jobs(rendered, trainjob_made).items():
        grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= int(_configmap(rendered[overlay])["FT_STOP_DEADLINE_SECONDS"]) + 30, overlay


# -- Pods, volume and network ----------------------------------------------------------------------


def test_every_pod_is_locked_down_and_mounts_shared_memory_scratch_and_the_volume(rendered, trainjob_made):
    image_user = [a for k, a in dockerfile() if k == "USER"][-1]
    for overlay, job in _jobs(rendered, trainjob_made).items():
        pod, container = job["spec"]["template"]["spec"], _container(job)
        assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == image_user, overlay
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"] == "8"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory" and "emptyDir" in mounts["/tmp"]
        claim = mounts[_configmap(rendered[overlay])["FT_OUTPUT_DIR"]]["persistentVolumeClaim"]["claimName"]
        assert claim == one(rendered[overlay], "PersistentVolumeClaim")["metadata"]["name"], overlay


def test_several_nodes_share_one_read_write_many_volume_and_one_node_keeps_its_own_disk(rendered):
    access = {overlay: one(objects, "PersistentVolumeClaim")["spec"]["accessModes"] for overlay, objects in rendered.items()}
    assert access == {"8-gpu": ["ReadWriteOnce"], "indexed-job": ["ReadWriteMany"], "trainjob": ["ReadWriteMany"]}


def _selects(selector, labels):
    assert set(selector) <= {"matchLabels"}  # all these policies use
    return selector.get("matchLabels", {}).items() <= labels.items()


def _ingress_allowed(policies, source, target, port):
    """Whether NetworkPolicies in one namespace let a pod labelled `source` open a TCP connection to `target`:port."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], target) and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "from" in rule and not any(_selects(peer["podSelector"], source) for peer in rule["from"]):
                continue
            ports = rule.get("ports")
            if ports and not any(p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
                continue
            return True
    return False


def test_the_nodes_reach_each_other_on_the_rendezvous_port_and_nccls_ports_and_nobody_else_gets_in(rendered, trainjob_made):
    for overlay, job in _jobs(rendered, trainjob_made).items():
        if overlay == "8-gpu":
            continue
        policies = [o for o in rendered[overlay] if o["kind"] == "NetworkPolicy"]
        node0, node1 = _pod_labels(job, 0), _pod_labels(job, 1)
        rendezvous = settings.load(_pod_env(rendered[overlay], job, 1)).master_port
        for port in (rendezvous, 40123):  # 40123: a port from the kernel's ephemeral range, where NCCL listens
            assert _ingress_allowed(policies, node1, node0, port) and _ingress_allowed(policies, node0, node1, port), (overlay, port)
        # Another fulltune job's pod in the namespace, or any other pod: refused, as by the base's policy alone.
        other_job = {"app.kubernetes.io/name": "fulltune", "batch.kubernetes.io/job-name": "another", "jobset.sigs.k8s.io/jobset-name": "another"}
        for source in (other_job, {"app": "anything"}):
            assert not _ingress_allowed(policies, source, node0, rendezvous), (overlay, source)
        assert not _ingress_allowed(policies, node1, node0, 22)  # privileged ports stay closed


def test_kueue_component_queues_every_overlay_and_creates_it_suspended(with_kueue, rendered):
    for overlay, objects in with_kueue.items():
        (workload,) = [o for o in objects if o["kind"] in ("Job", "TrainJob")]
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], overlay
        assert workload["spec"]["suspend"] is True
        (plain,) = [o for o in rendered[overlay] if o["kind"] == workload["kind"]]
        if overlay == "indexed-job":  # queued as rendered: the component adds nothing more
            assert plain == workload
        else:
            assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"] and "suspend" not in plain["spec"]


def test_the_indexed_jobs_two_pods_are_admitted_together_by_kueue_as_rendered(rendered):
    """Without gang admission one pod could start and wait at the rendezvous for one that is still pending (no second free
    8-GPU node): Kueue admits a Job's pods together, and the overlay is queued and created suspended as it renders."""
    job = one(rendered["indexed-job"], "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-h100"
    assert job["spec"]["suspend"] is True and job["spec"]["parallelism"] == job["spec"]["completions"] == 2



def test_scaling_out_guide_applies_each_overlay_and_names_files_that_exist():
    guide = (REPO / "docs" / "gpus.md").read_text()
    section = guide.split("\n### Scaling out on Kubernetes\n", 1)[1].split("\n### ", 1)[0]
    assert 'kubectl apply -k "k8s/overlays/$OVERLAY"' in section
    choices = re.search(r"\nOVERLAY=\S+ +# (.+)\n", section).group(1)
    assert set(re.findall(r"[\w-]+", choices)) - {"or"} == set(SCALE_OVERLAYS)
    for path in re.findall(r"k8s/(?:overlays|components)/[\w-]+", section):
        assert (REPO / path / "kustomization.yaml").exists(), path

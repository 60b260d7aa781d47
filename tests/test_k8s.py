"""The Kubernetes Job: every overlay renders, validates against Kubernetes 1.33 (strict) and passes
checkov, and the rendered pod runs entrypoint.py the way the kubelet would."""

import json
import os
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from deploy_files import OVERLAYS, REPO, SCALE_OVERLAYS, dockerfile, entrypoint, image_env, one, pod_failure_rule, render, tool

from trainer.core import settings

KUBERNETES_VERSION = "1.33.0"


@pytest.fixture(scope="module")
def rendered():
    return {overlay: render(REPO / "k8s" / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def with_kueue(tmp_path_factory):
    """The generic overlay with the optional Kueue component, composed the way the README shows."""
    folder = tmp_path_factory.mktemp("kueue")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "k8s" / "overlays" / "generic", folder)],
        "components": [os.path.relpath(REPO / "k8s" / "components" / "kueue", folder)],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(folder)


def _job(objects):
    return one(objects, "Job")


def _container(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _settings_env(objects):
    return one(objects, "ConfigMap")["data"]


def test_every_overlay_renders_a_job_its_configmap_its_volume_and_a_network_policy(rendered):
    for overlay, objects in rendered.items():
        assert sorted(o["kind"] for o in objects) == ["ConfigMap", "Job", "NetworkPolicy", "PersistentVolumeClaim"], overlay
        assert {o["metadata"]["namespace"] for o in objects} == {"fulltune"}


def test_every_rendered_object_validates_against_kubernetes_1_33_in_strict_mode(rendered, with_kueue):
    secret = yaml.safe_load((REPO / "k8s" / "base" / "secret.example.yaml").read_text())
    for objects in [*rendered.values(), with_kueue, [secret]]:
        for obj in objects:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises on any unknown or bad field


def test_the_example_secret_holds_placeholders_only_and_is_never_applied():
    secret = yaml.safe_load((REPO / "k8s" / "base" / "secret.example.yaml").read_text())
    assert all(value.startswith("replace-with-") for value in secret["stringData"].values())
    base = yaml.safe_load((REPO / "k8s" / "base" / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in base["resources"]


@pytest.fixture(scope="module")
def checkov_reports(rendered, with_kueue, tmp_path_factory):
    """One checkov run over the Dockerfile and every rendered manifest (checkov takes seconds to start)."""
    folder = tmp_path_factory.mktemp("checkov")
    files = [str(REPO / "Dockerfile"), str(REPO / "k8s" / "base" / "secret.example.yaml")]
    for name, objects in [*rendered.items(), ("generic-kueue", with_kueue)]:
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(objects))
        files.append(str(folder / f"{name}.yaml"))
    command = [tool("checkov"), "--framework", "kubernetes", "dockerfile", "--skip-download", "--output", "json"]
    result = subprocess.run([*command, *(arg for f in files for arg in ("--file", f))], capture_output=True, text=True, timeout=300)
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_reports_no_failed_check_and_every_skip_gives_its_reason(checkov_reports):
    scanned = {}
    for report in checkov_reports:
        failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
        assert failed == [], f"{report['check_type']}: {failed}"
        assert report["summary"]["parsing_errors"] == 0
        for check in report["results"]["skipped_checks"]:
            assert len(check["check_result"].get("suppress_comment", "")) > 20, check["check_id"]
        scanned[report["check_type"]] = report["summary"]["passed"]
    assert scanned.keys() == {"kubernetes", "dockerfile"} and min(scanned.values()) > 50, scanned


def _policy_action(job, exit_code=None, conditions=()):
    """What the Job controller does with a failed pod: the first matching podFailurePolicy rule, else Count."""
    matched = pod_failure_rule(job, "trainer", exit_code, conditions)
    return matched[1]["action"] if matched else "Count"


def test_pod_failure_policy_fails_at_once_on_bad_config_and_does_not_count_preemption(rendered):
    for objects in rendered.values():
        job = _job(objects)
        assert _policy_action(job, 2) == "FailJob"  # bad config or data: a retry cannot help
        assert _policy_action(job, 4) == "FailJob"  # out of GPU memory with these settings
        assert _policy_action(job, 5) == "FailJob"  # diverged: the same settings diverge again
        assert _policy_action(job, 6) == "FailJob"  # volume full: it will not empty itself
        assert _policy_action(job, 9) == "FailJob"  # a benchmark fell past FT_EVAL_MAX_REGRESSION: the same settings exit 9 again
        assert _policy_action(job, 75) == "Ignore"  # checkpoint committed after SIGTERM: resume, uncounted
        assert _policy_action(job, 76) == "Ignore"  # save cut short: resume from the previous checkpoint
        assert _policy_action(job, 137, {("DisruptionTarget", "True")}) == "Ignore"  # drained or preempted node
        assert _policy_action(job, 1) == "Count"
        assert _policy_action(job, 3) == "Count"  # registration failed: the retry only registers
        assert _policy_action(job, 8) == "Count"  # the mirror or the hub did not get the model: the retry only uploads
        assert _policy_action(job, 7) == "Count"  # another job holds the volume's lease: a few retries with back-off, then fail naming it
        assert _policy_action(job, 77) == "Count"  # stuck (FT_STUCK_EXIT=true): retried, resuming, maybe on another node


def test_every_code_the_exit_table_says_a_retry_cannot_help_fails_the_job_at_once(rendered):
    """The README's exit-code table (trainer/core/errors.py EXIT_SUMMARY) is the contract the manifests carry out: each code
    whose retry column says "no" or waits on a person ("after freeing space") fails the Job; no other code does."""
    from trainer.core.errors import EXIT_SUMMARY

    hopeless = {code for code, (_, retry) in EXIT_SUMMARY.items() if retry.startswith(("no", "after"))}
    assert {2, 4, 5, 6, 9} <= hopeless
    for objects in rendered.values():
        job = _job(objects)
        assert {code for code in EXIT_SUMMARY if code and _policy_action(job, code) == "FailJob"} == hopeless
        spec = job["spec"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0 and spec["ttlSecondsAfterFinished"] > 0
        assert spec["podReplacementPolicy"] == "Failed"


def test_grace_period_covers_the_stop_deadline_and_the_final_save(rendered):
    for objects in rendered.values():
        grace = _job(objects)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        deadline = int(_settings_env(objects)["FT_STOP_DEADLINE_SECONDS"])
        assert grace >= deadline + 30, (grace, deadline)


def test_the_volume_and_the_stop_deadline_hold_what_plan_says_the_reference_job_writes(rendered):
    """`entrypoint.py plan`'s sizes for the job the manifests run (Qwen3-4B, bf16-mixed on an H100, its settings.env): the
    claim holds every checkpoint at once, the final model and the download; the deadline holds one checkpoint's write at the
    speed the manifests plan for (200 MB/s); the comments say the same numbers."""
    from trainer.model import plan_command

    for overlay, objects in rendered.items():
        env = _settings_env(objects)
        values = {k: v for k, v in env.items() if k.startswith("FT_")} | {"FT_MODEL": str(REPO / "bench" / "qwen3-4b-config.json")}
        plan, _ = plan_command.report(settings.load(values), "h100-80gb")
        assert plan["checkpoint_gb"] == 48.3, overlay
        claim = one(objects, "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"]
        assert claim.endswith("Gi") and int(claim[:-2]) * 2**30 >= plan["volume_gb"] * 1e9 * 1.15, (overlay, claim, plan["volume_gb"])  # 15 % room
        assert int(env["FT_STOP_DEADLINE_SECONDS"]) >= plan["write_seconds"] * 1.15, (overlay, plan["write_seconds"])
    for path in ("k8s/base/job.yaml", "k8s/base/pvc.yaml", "k8s/base/settings.env", "k8s/kubeflow/cluster-training-runtime.yaml"):
        assert "48.3 GB" in (REPO / path).read_text(), path
    assert "~241 s" in (REPO / "k8s/base/job.yaml").read_text() and "209 GB" in (REPO / "k8s/base/pvc.yaml").read_text()


def test_pod_is_locked_down_and_gets_one_gpu_shared_memory_and_the_volume(rendered):
    image_user = [a for k, a in dockerfile() if k == "USER"][-1]
    for objects in rendered.values():
        pod = _job(objects)["spec"]["template"]["spec"]
        container = _container(_job(objects))
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == image_user
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1" == container["resources"]["requests"]["nvidia.com/gpu"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert "emptyDir" in mounts["/tmp"]  # caches on a read-only root (see the Dockerfile's ENV)
        claim = mounts[_settings_env(objects)["FT_OUTPUT_DIR"]]["persistentVolumeClaim"]["claimName"]
        assert claim == one(objects, "PersistentVolumeClaim")["metadata"]["name"]
        env = container["env"]
        assert {e["name"] for e in env} >= {"HF_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"}
        assert all(e["valueFrom"]["secretKeyRef"]["optional"] for e in env)


def test_each_overlay_selects_h100_nodes_its_own_way(rendered):
    def pod(overlay):
        return _job(rendered[overlay])["spec"]["template"]["spec"]

    def affinity(overlay):
        (term,) = pod(overlay)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        return expression["key"], expression["values"]

    key, products = affinity("generic")
    assert key == "nvidia.com/gpu.product" and all(p.startswith("NVIDIA-H100") for p in products)
    assert pod("gke")["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    key, types = affinity("eks")
    assert key == "node.kubernetes.io/instance-type" and all(t.startswith("p5.") for t in types)


def test_kueue_component_adds_the_queue_label_and_creates_the_job_suspended(with_kueue, rendered):
    job = _job(with_kueue)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    assert job["spec"]["suspend"] is True
    assert "kueue.x-k8s.io/queue-name" not in _job(rendered["generic"])["metadata"]["labels"]


def test_configmap_holds_only_known_settings_with_valid_values(rendered):
    for objects in rendered.values():
        env = _settings_env(objects)
        unknown = [name for name in env if name.startswith("FT_") and name not in settings.BY_ENV_NAME]
        assert unknown == []
        settings.load(env)  # raises ConfigError (exit 2) on a bad value


# -- The contract: the rendered pod, run here -----------------------------------------------------

BASE_IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _as_the_pod_runs(objects, tmp_path, configmap_changes=None):
    """The pod's command and environment as the kubelet builds them, with its volumes moved under tmp_path.

    Environment: the image's ENV, then the ConfigMap (envFrom), then `env` (Secrets absent: all optional),
    then what the kubelet adds.  The demo preset stands in for the reference model and data, which this
    offline machine cannot download: FT_MODEL and FT_DATASET are dropped and FT_PRESET=demo is added.
    """
    container = _container(_job(objects))
    instructions = dockerfile()
    workdir = [a for k, a in instructions if k == "WORKDIR"][-1]
    mounts = {m["mountPath"]: str(tmp_path / m["name"]) for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"}
    mounts[workdir] = str(REPO)
    mounts["/opt/venv/bin"] = os.path.dirname(sys.executable)

    def remap(value):
        for path, local in mounts.items():
            if value == path or value.startswith(path + "/"):
                return local + value[len(path) :]
        return value

    env = dict(image_env(instructions))
    env["PATH"] = env["PATH"].replace("$PATH", BASE_IMAGE_PATH)
    configmap = {**_settings_env(objects), **(configmap_changes or {})}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == one(objects, "ConfigMap")["metadata"]["name"]
        env.update(configmap)
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["optional"], variable["name"]  # no Secret here
    env.update({"HOSTNAME": "fulltune-x7k2p", "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    env = {name: ":".join(remap(p) for p in value.split(":")) if name == "PATH" else remap(value) for name, value in env.items()}
    for name in ("FT_MODEL", "FT_DATASET"):
        env.pop(name)
    env.update({"FT_PRESET": "demo", "HF_HUB_OFFLINE": "1"})
    env["FT_TERMINATION_MESSAGE_PATH"] = str(tmp_path / "termination-log")  # the kubelet's /dev/termination-log
    env.update({k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")})  # this machine's CPU workaround
    for local in mounts.values():
        os.makedirs(local, exist_ok=True)

    command = container.get("command") or entrypoint(instructions)
    assert command[:2] == ["/usr/bin/tini", "--"]  # tini only forwards signals and reaps; run what it runs
    command = [shutil.which(command[2], path=env["PATH"]), *(remap(a) for a in command[3:])] + container.get("args", [])
    return command, env, mounts[workdir]


@pytest.mark.slow
def test_the_rendered_pod_runs_the_demo_job_to_the_end(rendered, tmp_path):
    command, env, cwd = _as_the_pod_runs(rendered["generic"], tmp_path, {"FT_MAX_STEPS": "20"})  # the pod's contract, not the demo's learning
    assert command[0].startswith(os.path.dirname(sys.executable))
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    volume = tmp_path / "output"  # the PersistentVolumeClaim's mount
    assert (volume / "final" / "model" / "config.json").exists()
    assert sorted(p.name for p in (volume / "checkpoints").glob("checkpoint-*"))  # a retry resumes from these
    assert (volume / "mlflow").is_dir()  # no MLFLOW_TRACKING_URI in the ConfigMap: the store is on the volume


def test_a_bad_value_in_the_configmap_exits_2_and_the_job_fails_without_retrying(rendered, tmp_path):
    command, env, cwd = _as_the_pod_runs(rendered["generic"], tmp_path, {"FT_MAX_STEPS": "0"})
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "FT_MAX_STEPS" in (tmp_path / "termination-log").read_text()
    assert _policy_action(_job(rendered["generic"]), result.returncode) == "FailJob"


# -- The user's image, set the documented ways ------------------------------------------------------

USER_IMAGE = "registry.example.org/team/fulltune:2.3.4"


def _documented_kubectl_edit() -> str:
    """The shell lines docs/deployment.md gives for setting the image with kubectl alone: the heredoc that adds an
    `images:` entry to the overlay's kustomization.yaml (docs/gpus.md#scaling-out-on-kubernetes gives the same lines)."""
    blocks = []
    for page in ("deployment.md", "gpus.md"):
        text = (REPO / "docs" / page).read_text()
        start = text.index('cat >> "k8s/overlays/$OVERLAY/kustomization.yaml" <<EOF')
        blocks.append(text[start : text.index("\nEOF\n", start) + len("\nEOF\n")])
    assert blocks[0] == blocks[1]
    return blocks[0]


def _kustomize_edit_set_image(folder, argument: str) -> None:
    """`kustomize edit set image ARGUMENT` run in `folder`: the standalone binary where it is installed, else the entry
    it writes (kustomize v5's `edit set image`: `NAME=NEWNAME:TAG` sets newName and newTag, `NAME=NEWNAME@DIGEST`
    newName and digest, replacing an entry of that name)."""
    if binary := shutil.which("kustomize"):
        subprocess.run([binary, "edit", "set", "image", argument], cwd=folder, check=True, timeout=60)
        return
    name, _, new = argument.partition("=")
    if "@" in new:
        new_name, _, digest = new.partition("@")
        entry = {"name": name, "newName": new_name, "digest": digest}
    else:
        new_name, _, tag = new.rpartition(":") if ":" in new.rsplit("/", 1)[-1] else (new, "", "")
        entry = {"name": name, "newName": new_name, **({"newTag": tag} if tag else {})}
    path = folder / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization["images"] = [i for i in kustomization.get("images", []) if i["name"] != name] + [entry]
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))


def _images(objects) -> dict[str, set[str]]:
    """Every container image the rendered objects name (a TrainJob's `trainer.image` too), by kind."""
    found: dict[str, set[str]] = {}

    def walk(kind, node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "image" and isinstance(value, str):
                    found.setdefault(kind, set()).add(value)
                walk(kind, value)
        elif isinstance(node, list):
            for item in node:
                walk(kind, item)

    for obj in objects:
        walk(obj["kind"], obj)
    return found


WITH_IMAGES = {overlay: {"Job"} for overlay in OVERLAYS + SCALE_OVERLAYS} | {"trainjob": {"TrainJob", "TrainingRuntime"}}


@pytest.mark.parametrize("way", ["kubectl", "kustomize edit", "kustomize edit, by digest"])
@pytest.mark.parametrize("overlay", OVERLAYS + SCALE_OVERLAYS)
def test_the_image_set_in_any_overlay_the_documented_ways_is_the_image_of_every_resource(overlay, way, tmp_path):
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    folder = tmp_path / "k8s" / "overlays" / overlay
    image = USER_IMAGE
    if way == "kubectl":
        subprocess.run(["bash", "-euc", _documented_kubectl_edit()], cwd=tmp_path, env={"IMAGE": image, "OVERLAY": overlay, "PATH": os.environ["PATH"]},
                       check=True, timeout=60)
    else:
        if way.endswith("digest"):
            image = "registry.example.org/team/fulltune@sha256:" + "0123456789abcdef" * 4
        _kustomize_edit_set_image(folder, f"fulltune={image}")
    images = _images(render(folder))
    assert images.keys() == WITH_IMAGES[overlay], images
    assert all(names == {image} for names in images.values()), images


@pytest.mark.parametrize("way", ["kubectl", "kustomize edit"])
def test_the_image_set_for_the_cluster_runtime_the_documented_ways_is_the_runtimes_image(way, tmp_path):
    """k8s/kubeflow, applied by itself (docs/deployment.md#install-the-runtime): the lines the page gives, run as they
    are, or the entry `kustomize edit set image` writes, set the ClusterTrainingRuntime's image."""
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    folder = tmp_path / "k8s" / "kubeflow"
    assert _images(render(folder)) == {"ClusterTrainingRuntime": {"fulltune:0.1.0"}}  # until an entry sets the user's
    if way == "kubectl":
        text = (REPO / "docs" / "deployment.md").read_text()
        start = text.index("cat >> k8s/kubeflow/kustomization.yaml <<EOF")
        lines = text[start : text.index("\nEOF\n", start) + len("\nEOF\n")]
        subprocess.run(["bash", "-euc", lines], cwd=tmp_path, env={"IMAGE": USER_IMAGE, "PATH": os.environ["PATH"]}, check=True, timeout=60)
    else:
        _kustomize_edit_set_image(folder, f"fulltune={USER_IMAGE}")
    assert _images(render(folder)) == {"ClusterTrainingRuntime": {USER_IMAGE}}

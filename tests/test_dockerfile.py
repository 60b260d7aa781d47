"""The image, checked without a Docker engine: hadolint, and what the Dockerfile installs, copies and runs."""

import ast
import fnmatch
import re
import shlex
import subprocess
import sys

from deploy_files import REPO, dockerfile, entrypoint, image_env, tool


def test_hadolint_reports_nothing():
    result = subprocess.run([tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def _base_image(build_args: dict[str, str] | None = None) -> str:
    """The FROM line's image, with the build arguments declared before it (their defaults, or `build_args`)."""
    instructions = dockerfile()
    (index,) = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    values = {name: default for name, default in _build_args(instructions[:index]).items() if default is not None} | (build_args or {})
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], instructions[index][1])


def test_base_image_is_an_nvidia_cuda_image_pinned_to_a_release():
    image, _, tag = _base_image().partition(":")
    assert image == "nvidia/cuda"
    assert re.fullmatch(r"\d+\.\d+\.\d+-(base|runtime)-ubuntu\d+\.\d+", tag), tag  # a full CUDA version, not "latest"
    assert tag == "13.0.3-base-ubuntu24.04"  # torch 2.13.0's PyPI wheel is the CUDA 13.0 build (cuda-toolkit==13.0.3)


def _documented_builds() -> list[list[str]]:
    """Every `docker build` command docs/gpus.md shows with a --build-arg."""
    page = (REPO / "docs" / "gpus.md").read_text()
    return [shlex.split(line.strip()) for line in page.splitlines() if line.strip().startswith("docker build") and "--build-arg" in line]


def _check_torch_agrees(tmp_path, cuda_version: str, torch_cuda: str) -> subprocess.CompletedProcess:
    """The torch layer's check that torch's CUDA is the base image's, run by sh with a stand-in torch of that CUDA."""
    fake = tmp_path / f"torch-{torch_cuda}" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(f"__version__ = '2.13.0'\nclass version:\n    cuda = {torch_cuda!r}\n")
    (line,) = [part.strip() for keyword, arguments in dockerfile() if keyword == "RUN" for part in arguments.split("&&") if "the base image is CUDA" in part]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fake.parent), "CUDA_VERSION": cuda_version}
    return subprocess.run(["sh", "-c", line.replace("python -c", f"{shlex.quote(sys.executable)} -c", 1)], env=env, capture_output=True, text=True, timeout=60)


def test_the_documented_cuda_12_build_is_what_the_dockerfile_reads_and_a_mismatched_pair_fails_the_build(tmp_path):
    """R535-R570 drivers cannot run CUDA 13 without forward compatibility: the page names a CUDA 12 build, whose build
    arguments must be ARGs of the Dockerfile, a base image tag of the same form, and a torch index of the same CUDA."""
    builds = _documented_builds()
    assert builds, "docs/gpus.md shows no docker build with --build-arg"
    declared = _build_args(dockerfile())
    for command in builds:
        args = dict(command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "--build-arg")
        assert set(args) <= set(declared), f"{sorted(set(args) - set(declared))} are not ARGs of the Dockerfile"
        base = _base_image(args)
        assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-base-ubuntu24\.04", base), base
        major_minor = args["CUDA_VERSION"].rsplit(".", 1)[0]
        assert args["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/cu{major_minor.replace('.', '')}"
        assert "--index-url" in _torch_pip_arguments(tmp_path / major_minor, {"TORCH_INDEX_URL": args["TORCH_INDEX_URL"]})
        assert _check_torch_agrees(tmp_path, args["CUDA_VERSION"], major_minor).returncode == 0
        mismatched = _check_torch_agrees(tmp_path, args["CUDA_VERSION"], "13.0")  # the base changed, TORCH_INDEX_URL forgotten
        assert mismatched.returncode == 1 and f"is built for CUDA 13.0, the base image is CUDA {major_minor}" in mismatched.stderr, mismatched.stderr
    assert _check_torch_agrees(tmp_path, "13.0.3", "13.0").returncode == 0  # the default pair
    assert " ".join(builds[0]) in " ".join(" ".join(line.split()) for line in (REPO / "Dockerfile").read_text().splitlines())  # the Dockerfile says it too


def _pins() -> dict[str, str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in (line.split("#")[0].strip() for line in lines) if line)


def test_image_installs_exactly_requirements_txt_with_torch_as_a_cuda_build():
    instructions = dockerfile()
    args = _build_args(instructions)
    assert args["TORCH_VERSION"] == _pins()["torch"]  # the Dockerfile's torch layer and requirements.txt agree
    assert _pip_installs(instructions) == [
        'pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"',
        "pip install --no-cache-dir -r /app/requirements.txt -c /app/requirements.lock",
    ]
    runs = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "torch.version.cuda" in runs  # the build fails if a CPU-only torch was installed
    assert "pip check" in runs


def _build_args(instructions) -> dict[str, str | None]:
    """ARG NAME=default as {NAME: default}; None for an ARG without a default."""
    args = {}
    for keyword, arguments in instructions:
        if keyword == "ARG":
            name, equals, default = arguments.partition("=")
            args[name] = default if equals else None
    return args


def _pip_installs(instructions) -> list[str]:
    return [part.strip() for keyword, arguments in instructions if keyword == "RUN" for part in arguments.split("&&") if "pip install" in part]


def _torch_pip_arguments(tmp_path, build_args: dict[str, str]) -> list[str]:
    """The arguments pip receives from the torch layer's RUN line, run by sh with a stand-in pip."""
    fake = tmp_path / "bin" / "pip"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    defaults = {name: default for name, default in _build_args(dockerfile()).items() if default is not None}
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", **defaults, **build_args}  # Docker exports every ARG with a value to RUN
    (line,) = [line for line in _pip_installs(dockerfile()) if "torch==" in line]
    result = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.splitlines()


def test_torch_comes_from_pips_configured_index_unless_torch_index_url_is_given(tmp_path):
    # A mirror or proxy set in pip.conf or PIP_INDEX_URL must apply: no index host is named by default.
    assert _torch_pip_arguments(tmp_path / "default", {}) == ["install", "--no-cache-dir", f"torch=={_pins()['torch']}"]
    url = "https://download.pytorch.org/whl/cu126"
    assert _torch_pip_arguments(tmp_path / "cu126", {"TORCH_INDEX_URL": url}) == ["install", "--no-cache-dir", "--index-url", url, f"torch=={_pins()['torch']}"]


def test_layers_go_from_system_packages_to_torch_to_requirements_to_code():
    instructions = dockerfile()

    def index(predicate):
        return next(i for i, instruction in enumerate(instructions) if predicate(*instruction))

    apt = index(lambda k, a: k == "RUN" and "apt-get install" in a)
    torch = index(lambda k, a: k == "RUN" and "torch==" in a)
    copy_requirements = index(lambda k, a: k == "COPY" and a.startswith("requirements.txt"))
    requirements = index(lambda k, a: k == "RUN" and "-r /app/requirements.txt" in a)
    code = index(lambda k, a: k == "COPY" and "trainer" in a)
    assert apt < torch < copy_requirements < requirements < code


def _local_modules(path, seen):
    """Files of this repository that `path` imports, transitively (entrypoint.py -> trainer.*)."""
    if path in seen:
        return
    seen.add(path)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name.split(".")[0] != "trainer":
                continue
            candidate = REPO.joinpath(*name.split("."))
            for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if file.exists():
                    _local_modules(file, seen)


def _dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matches the path or any parent folder."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        patterns = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        suffixes = ["/".join(parts[i:]) for i in range(len(parts))] if pattern.startswith("**/") else candidates
        if any(fnmatch.fnmatchcase(c, p) for c in candidates + suffixes for p in patterns):
            ignored = not negate
    return ignored


def test_image_copies_every_file_entrypoint_py_imports_and_nothing_else():
    needed = set()
    for start in (REPO / "entrypoint.py", REPO / "trainer" / "__main__.py"):  # `python -m trainer` is the child
        _local_modules(start, needed)
    needed = {str(p.relative_to(REPO)) for p in needed} | {"trainer/__init__.py"}
    sources = [arguments.split()[:-1] for keyword, arguments in dockerfile() if keyword == "COPY"]
    copied = [s.rstrip("/") for group in sources for s in group]
    for file in sorted(needed):
        assert any(file == c or file.startswith(c + "/") for c in copied), f"{file} is imported but not copied"
        assert not _dockerignored(file), f"{file} is excluded by .dockerignore"
    for outside in ("tests/test_dockerfile.py", ".venv/bin/python", "k8s/base/job.yaml", "trainer/__pycache__/job.cpython-311.pyc"):
        assert _dockerignored(outside), f"{outside} would be sent to the build"


def test_image_runs_as_a_numeric_non_root_user_with_tini_as_pid_1():
    instructions = dockerfile()
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    assert users[-1] == "10001:10001"  # numeric, so Kubernetes' runAsNonRoot can verify it
    assert [k for k, _ in instructions].index("USER") > max(i for i, (k, _) in enumerate(instructions) if k in ("RUN", "COPY"))
    workdir = [arguments for keyword, arguments in instructions if keyword == "WORKDIR"][-1]
    assert entrypoint(instructions) == ["/usr/bin/tini", "--", "python", f"{workdir}/entrypoint.py"]
    assert "CMD" not in [k for k, _ in instructions]  # `docker run IMAGE train` (SageMaker) must not replace the command
    assert any(k == "RUN" and " tini" in a and "apt-get install" in a for k, a in instructions)


def test_every_cache_is_on_tmp_or_the_output_volume_for_a_read_only_root():
    env = image_env(dockerfile())
    caches = ["HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "MPLCONFIGDIR"]
    for name in caches:
        assert env[name].split("/")[1] in ("tmp", "output"), f"{name}={env[name]} is on the read-only root"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].startswith("/opt/venv/bin:")


def test_the_cuda_allocator_grows_its_segments_in_place_in_the_image():
    """Padding-free passes change size every step: with fixed segments reserved minus allocated grows (docs/memory-plan.md)."""
    assert image_env(dockerfile())["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_image_installs_a_c_compiler_and_pythons_headers_for_tritons_jit_without_recommends():
    (install,) = [part.strip() for keyword, arguments in dockerfile() if keyword == "RUN" for part in arguments.split("&&") if "apt-get install" in part]
    packages = install.split()
    assert "--no-install-recommends" in packages
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(packages), packages  # tests/test_container.py compiles against Python.h in the image

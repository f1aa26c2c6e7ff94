"""The deployment files parse, and name the settings the code reads."""

from __future__ import annotations

import subprocess
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
    assert "#SBATCH --requeue" in text and "scontrol requeue" in text and "trap requeue USR1 TERM" in text
    assert '--job.run_dir "$3/island-$1"' in text and "run_train.sh" in text and "ISHOST=1" in text


@pytest.mark.parametrize("name", ["lighthouse.yaml", "island.yaml"])
def test_skypilot_tasks_have_the_fields_skypilot_reads(name):
    task = yaml.safe_load((DEPLOY / "skypilot" / name).read_text())
    assert {"name", "resources", "setup", "run"} <= set(task)
    assert isinstance(task["run"], str) and "make setup" in task["setup"]
    if name == "island.yaml":
        assert "--fault_tolerance.replica_id" in task["run"] and "run_train.sh" in task["run"]
        assert {"ISLAND", "ISLANDS", "TORCHFT_LIGHTHOUSE"} <= set(task["envs"])


def test_container_files_install_the_pinned_torch_and_the_project():
    docker = (DEPLOY / "container" / "Dockerfile").read_text()
    apptainer = (DEPLOY / "container" / "archipelago.def").read_text()
    for text in (docker, apptainer):
        assert "TORCH_VERSION=2.13.0" in text and "pip install --no-cache-dir -e ." in text
    assert "USER archipelago" in docker and "Bootstrap: docker" in apptainer
    for copied in ("archipelago", "configs", "run_train.sh", "pyproject.toml"):
        assert (ROOT / copied).exists() and copied in docker and copied in apptainer

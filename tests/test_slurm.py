"""deploy/slurm for real: a one-node SLURM cluster started by the test (slurmctld + slurmd,
Debian's slurm-wlm, run as root), a lighthouse job and two island jobs of different sizes
that end with equal global weights, one of them requeued mid-run (the USR1 its script
traps, as ahead of a time limit) and healed from the other.

Needs root and slurm-wlm (`make test-deploy` installs it); marked `deploy`, so `make test`
leaves it out. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import records
from test_island import _free_port

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "deploy" / "slurm"

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(shutil.which("slurmctld") is None or shutil.which("sbatch") is None,
                       reason="needs Debian's slurm-wlm (make test-deploy installs it)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs jobs as their user: needs root here"),
]

CONF = """\
ClusterName=archipelago-test
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """slurmctld and slurmd of a one-node cluster in `folder`, with the client environment.

    The node claims 4 CPUs on this 2-core machine (config_overrides) so that the lighthouse
    and both islands (one CPU each) run at the same time, as on three clusters.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        for sub in ("state", "spool"):
            (folder / sub).mkdir(parents=True)
        conf = folder / "slurm.conf"
        conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], ctld_port=_free_port(),
                                    d_port=_free_port(), dir=folder))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        self.daemons: list[subprocess.Popen] = []
        for daemon in ("slurmctld", "slurmd"):
            log = open(folder / f"{daemon}.out", "w")  # noqa: SIM115 - closed by the daemon's exit
            self.daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=self.env, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True))
            time.sleep(1.0)  # slurmd registers with a running slurmctld
        self.wait_for(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T"), 60, "the node to come up idle")

    def run(self, *args: str) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{args}: {done.stderr}"
        return done.stdout

    def submit(self, script: Path, *args: str, export: dict[str, str], options: tuple[str, ...] = ()) -> str:
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in export.items())])
        return self.run("sbatch", "--parsable", f"--chdir={ROOT}", f"--output={self.folder}/%x-%j.out",
                        f"--export={exports}", *options, str(script), *args).strip()

    def job(self, job_id: str) -> dict[str, str]:
        fields = self.run("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait_for(self, ready, timeout: float, what: str) -> None:  # noqa: ANN001 - a predicate
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("*.out")))

    def close(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        time.sleep(2.0)  # the jobs' processes get their signals while slurmd still runs
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)
                    daemon.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    one = Cluster(tmp_path / "slurm")
    try:
        yield one
    finally:
        one.close()


def _checkpointed(island_dir: Path) -> bool:
    return (island_dir / "checkpoints" / "latest").exists()


@pytest.mark.timeout(900)
def test_lighthouse_and_two_island_jobs_of_different_sizes_end_equal_after_a_requeue(cluster, tmp_path):
    shared = tmp_path / "fed"
    from archipelago.federation.trust import write_secret

    key_file = tmp_path / "fed.key"
    write_secret(str(key_file))  # the jobs refuse to start without a federation key (mode 600)
    common = {"ARCHIPELAGO_SHARED": str(shared), "LOCAL_ADDR": "127.0.0.1", "ISLANDS": "2",
              "CONFIG_FILE": "configs/llama3/federation.toml", "OMP_NUM_THREADS": "1",
              "ARCHIPELAGO_FEDERATION_KEY_FILE": str(key_file)}
    lighthouse = cluster.submit(SLURM / "lighthouse.sbatch", export={**common, "LIGHTHOUSE_PORT": str(_free_port())})
    url = shared / "lighthouse.url"
    cluster.wait_for(url.exists, 60, "the lighthouse job to write its URL")
    host, port = url.read_text().strip().removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1"  # LOCAL_ADDR, not every interface

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, int(port))) == 0
    cluster.wait_for(listening, 60, "the lighthouse to listen")

    # Island 0: 2 ranks, island 1: 1 rank; 10-step rounds, a checkpoint every 10 steps.
    train = ("--training.steps", "80", "--data.seq_len", "64", "--training.val_every", "0",
             "--checkpoint.interval", "10", "--metrics.no_tensorboard")
    jobs = [cluster.submit(SLURM / "island.sbatch", *train, export={
        **common, "ISLAND": str(k), "NGPU": str(2 - k), "MASTER_PORT": str(_free_port())}) for k in (0, 1)]
    island = [shared / f"island-{k}" for k in (0, 1)]

    # Island 1 checkpoints, then gets the USR1 that SLURM sends ahead of a time limit: its
    # script requeues the job. SLURM holds a requeued job two minutes; release it now.
    cluster.wait_for(lambda: _checkpointed(island[1]), 300, "island 1's first checkpoint")
    cluster.run("scancel", "--batch", "--signal=USR1", jobs[1])
    def requeued() -> bool:
        job = cluster.job(jobs[1])
        return job.get("Restarts") == "1" and job["JobState"] == "PENDING"
    cluster.wait_for(requeued, 120, "island 1 to be requeued")
    cluster.run("scontrol", "update", f"JobId={jobs[1]}", "StartTime=now")

    for job in jobs:
        cluster.wait_for(lambda job=job: cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING",
                                                                                "COMPLETING", "REQUEUED"),
                         600, f"island job {job} to end")
    for job in jobs:
        assert cluster.job(job)["JobState"] == "COMPLETED", cluster.logs()
    assert cluster.job(lighthouse)["JobState"] == "RUNNING"  # it serves until cancelled

    # Sizes as submitted: 2 ranks and 1 rank.
    joined = [[r for r in records(d) if r.get("event") == "join"] for d in island]
    assert [j[0].get("ranks") for j in joined] == [2, 1], joined
    # The requeued island resumed from its own checkpoint and healed from island 0.
    resumed = [r["step"] for r in records(island[1]) if r.get("event") == "resume"]
    assert resumed and resumed[0] >= 10, resumed
    healed = [r for r in records(island[1]) if r.get("event") == "outer_step" and r.get("healed")]
    assert healed and healed[0]["committed"], "the requeued island did not heal from island 0"
    leave = [[r for r in records(d) if r.get("event") == "leave"][-1] for d in island]
    assert leave[0]["step"] == leave[1]["step"] == 80
    assert leave[0]["global_hash"] == leave[1]["global_hash"], leave
    assert "requeueing job" in (cluster.folder / f"archipelago-island-{jobs[1]}.out").read_text()

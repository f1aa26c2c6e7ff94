"""A fake island for launcher tests: writes island metrics records, trains nothing.

Run by `archipelago local` in place of `archipelago train` through the
ARCHIPELAGO_LOCAL_ISLAND_CMD test hook, with the same arguments. Standard library only,
so it starts in milliseconds. Behaviour:

- one step record every FAKE_ISLAND_STEP_S seconds (0.2) up to --training.steps (20), an
  outer_step record every 5 steps with a global_hash that depends only on the outer step
  (so every island agrees), val_loss every 5 steps;
- --nproc N starts N-1 "rank" children in sessions of their own, as torchrun does, so a
  launcher that kills only its own child leaves them behind;
- a restarted island resumes after the last step in its metrics.jsonl (its "checkpoint");
- FAKE_ISLAND_FAIL=K:CODE@STEP makes island K write failure.json and exit CODE at STEP.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SYNC_EVERY = 5


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """Value of `--name VALUE` or `--name=VALUE` (the last one wins, as in the real parser)."""
    value = default
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **record}) + "\n")


def last_step(path: Path) -> int:
    if not path.is_file():
        return 0
    steps = [r["step"] for r in map(json.loads, path.read_text().splitlines())
             if "event" not in r and "loss" in r]
    return max(steps, default=0)


def start_ranks(nproc: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, __file__, "--rank-child"], start_new_session=True)
            for _ in range(nproc - 1)]


def stop(children: list[subprocess.Popen], code: int) -> None:
    for child in children:
        child.kill()
        child.wait()
    sys.exit(code)


def main(argv: list[str]) -> None:
    if argv == ["--rank-child"]:
        time.sleep(120)  # a rank: only ever ends by being killed
        return
    run_dir = Path(option(argv, "--job.run_dir"))
    island = int(option(argv, "--fault_tolerance.replica_id"))
    group = int(option(argv, "--fault_tolerance.group_size"))
    steps = int(option(argv, "--training.steps", "20"))
    step_s = float(os.environ.get("FAKE_ISLAND_STEP_S", "0.2"))
    fail_island, _, fail = os.environ.get("FAKE_ISLAND_FAIL", "-1:0@0").partition(":")
    fail_code, fail_step = (int(x) for x in fail.split("@"))
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    seen_env = {k: os.environ.get(k) for k in ("TORCHFT_LIGHTHOUSE", "ARCHIPELAGO_ISLAND_TOKEN", "OMP_NUM_THREADS")}
    with open(run_dir / "starts.jsonl", "a") as f:
        f.write(json.dumps({"argv": argv, "pid": os.getpid(), "env": seen_env}) + "\n")
    children = start_ranks(int(option(argv, "--nproc", "1")))
    start = last_step(metrics)
    if start:
        log(metrics, {"event": "resume", "step": start})
    log(metrics, {"event": "join", "replica_id": island})
    print(f"island {island} starting at step {start + 1}", flush=True)
    t0 = time.time()
    for step in range(start + 1, steps + 1):
        time.sleep(step_s)
        if island == int(fail_island) and step == fail_step:
            (run_dir / "failure.json").write_text(json.dumps(
                {"exit_code": fail_code, "message": f"error: fake failure at step {step}", "rank": "0"}))
            print(f"island {island} failing at step {step}", file=sys.stderr, flush=True)
            stop(children, fail_code)
        record = {"step": step, "loss": 5.0 / (1 + 0.1 * step), "lr": 1e-3, "grad_norm": 1.0,
                  "tokens": 512 * step, "tokens_per_s": 2560.0, "mfu": None, "elapsed_s": time.time() - t0}
        if step % SYNC_EVERY == 0:
            record["val_loss"] = 5.5 / (1 + 0.1 * step)
        log(metrics, record)
        print(f"step {step} loss {record['loss']:.3f}", flush=True)
        if step % SYNC_EVERY == 0:
            outer = step // SYNC_EVERY
            log(metrics, {"event": "outer_step", "step": step, "outer_step": outer, "committed": True,
                          "participants": group, "contributors": group, "fragment": 0,
                          "healed": bool(start) and step - start <= SYNC_EVERY, "bytes_sent": 1000,
                          "global_hash": hashlib.sha256(f"outer-{outer}".encode()).hexdigest()[:16]})
    stop(children, 0)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Stale rows in decoupled rounds: corrections tried against the discount alone.

The quality simulator (archipelago/quality_simulator.py) trains llama3 `debug` islands in one
process with configs/llama3/federation.toml (sync_steps 10, plain averaging, token
weighting) and no averaged moments. Two cases, on one seed (the tuning seed: a variant
that does not beat the discount there is not carried to report seeds):

A  two equal islands whose every exchange overlaps the next round (staleness 1), equal
   tokens; baseline in the same run: the synchronous round.
T  a thin island: three islands, two members that wait for their cheap exchange (their
   rows are fresh) and one whose row reaches a member two rounds after its hand-off, every
   other round, and enters folded into that member's row, three outer steps after the
   weights it started from (staleness 3; `handoff_delays` [0, 0, 2]), equal wall-clock
   (--steps ticks);
   baselines: the two members alone, and all three synchronous (as if its link were fast).

Variants, each applied to a row with staleness >= 1 as it enters an outer step, or, for a
thin island's row, as its carrier folds it in (the platform's rule, `staleness_exponent`,
applies to all of them):

* `heloco`: per parameter tensor, the cosine c between the row and a reference direction:
  kept when c >= 0.2, its anti-aligned part shrunk when c < 0, turned partly towards the
  reference in between, each scaled by a confidence |row| / (|row| + |ref|) (HeLoCo, arXiv
  2606.00271). Its reference is the outer momentum; the configs run without one (it cost
  4-13%, docs/quality.md), so the reference is the last outer update (`ref_beta` 0) or an
  average of them (0.9).
* `project`: per tensor, the part of the row along the global weights' displacement since
  the row's base is removed (the progress the federation already made that way).
* `lookahead`: the island continues from its rebased weights minus gamma times the last
  outer update (a guess at the other islands' rows still travelling).
* `outer_lr`: a larger outer step for the late rows.
* `rate`: a row weighs its island's tokens per round, not the tokens of every round it
  covers (a thin row otherwise takes half of its round's step).
* `cancel`: the sum is divided by the discounted weights (the discount then only shifts
  the shares between rows).
* `arrival`: no row is late at all (`fault_tolerance.arrival_steps`): an overlapped
  exchange's outer step is applied as soon as it arrives, `arrival` inner steps into the
  next round, and every island that handed off moves to the new global weights plus its
  progress since (what Streaming DiLoCo's overlap does, with the progress kept whole); its
  next row then starts from that step (staleness 0), and only its first `arrival` inner
  steps were trained from the island's own weights.

    python bench/stale_corrections.py --workers 2          # 32 minutes on the 2-core machine
    python bench/stale_corrections.py --workers 2 --only A --steps 240 --names synchronous,discount,heloco \
        --out bench/results/stale-corrections-240-cpu.json   # does a longer run shrink the cost? 10 minutes

Prints one table, ratio to the case's decoupled baseline first; `--out` gets the runs with
machine, threads and commit, and `--log` each run as it finishes (reused with --resume).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, where_measured, write_json  # noqa: E402
from rounds_quality import COMMON, FT, drain  # noqa: E402

THIN = {"link_ticks": [1, 1, 16], "handoff_delays": [0, 0, 2]}
RUNS: list[tuple[str, str, dict[str, Any]]] = [  # (case, name, settings)
    ("A", "synchronous", {"mode": "synchronous"}),
    ("A", "discount a=0", {"exponent": 0}),
    ("A", "heloco (last update)", {"exponent": 0, "heloco": 0.0}),
    ("A", "project", {"exponent": 0, "project": 1.0}),
    ("A", "lookahead 0.5", {"exponent": 0, "lookahead": 0.5}),
    ("A", "outer_lr 1.3", {"exponent": 0, "outer_lr": 1.3}),
    ("A", "arrival after 1 step", {"exponent": 0, "arrival": 1}),
    ("A", "arrival after 2 steps", {"exponent": 0, "arrival": 2}),
    ("A", "arrival after 3 steps", {"exponent": 0, "arrival": 3}),
    ("A", "arrival after 5 steps", {"exponent": 0, "arrival": 5}),
    ("T", "members alone (synchronous)", {"mode": "synchronous", "islands": 2, "thin": False}),
    ("T", "all three synchronous", {"mode": "synchronous", "islands": 3, "thin": False}),
    ("T", "discount a=0.5", {"exponent": 0.5}),
    ("T", "discount a=1", {"exponent": 1}),
    ("T", "heloco (last update) a=0.5", {"exponent": 0.5, "heloco": 0.0}),
    ("T", "heloco (average 0.9) a=0.5", {"exponent": 0.5, "heloco": 0.9}),
    ("T", "project a=0.5", {"exponent": 0.5, "project": 1.0}),
    ("T", "rate a=0.5", {"exponent": 0.5, "rate": True}),
    ("T", "rate a=0", {"exponent": 0, "rate": True}),
    ("T", "cancel a=1", {"exponent": 1, "cancel": True}),
]
BASELINE = {"A": "discount a=0", "T": "discount a=0.5"}


def heloco(row: Any, ref: Any, sizes: list[int], counts: dict[str, int], c_ok: float = 0.2) -> Any:
    """The row corrected tensor by tensor against `ref` (see the module doc; k_s, beta_max,
    kappa 1, k_d 0.5); `counts` gets how many blocks were kept, shrunk and turned."""
    out, at = row.clone(), 0
    for n in sizes:
        d, m = row[at:at + n], ref[at:at + n]
        dn, mn = d.norm(), m.norm()
        if dn > 0 and mn > 0:
            u, v = d / dn, m / mn
            c, conf = float(u @ v), float(dn / (dn + mn))
            kind = "kept" if c >= c_ok else "shrunk" if c < 0 else "turned"
            counts[kind] = counts.get(kind, 0) + 1
            if c < 0:
                out[at:at + n] = d - min(-c * conf, 1.0) * c * dn * v
            elif c < c_ok:
                turn = min(0.5 * (c_ok - c) * conf, 1.0)
                w = (1 - turn) * u + turn * v
                out[at:at + n] = dn * w / w.norm().clamp_min(1e-12)
        at += n
    return out


def project(row: Any, displacement: Any, sizes: list[int]) -> Any:
    """The row without its positive part along `displacement`, tensor by tensor."""
    out, at = row.clone(), 0
    for n in sizes:
        d, m = row[at:at + n], displacement[at:at + n]
        along = float(d @ m) / max(float(m @ m), 1e-30)
        if along > 0:
            out[at:at + n] = d - along * m
        at += n
    return out


def corrected_rounds(simulation: Any, s: dict[str, Any]) -> type:
    """simulation._Decoupled with the variant `s`: the same rounds, late rows changed as
    they enter."""

    class Corrected(simulation._Decoupled):  # type: ignore[name-defined,misc]
        made: list[Any] = []

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.history = {0: self.core.globals[0].detach().clone()}  # global weights per outer step
            self.reference: Any = None
            self.sizes = [p.numel() for p in self.islands[0].fragments[0]]
            self.counts: dict[str, int] = {}   # heloco: blocks kept, shrunk, turned
            self.cosines: list[float] = []     # each late row against the last outer update
            if s.get("cancel"):  # each row's share of the divisor is its discounted weight
                weight = self.core.weight

                def discounted_divisor(*a: Any, **kw: Any) -> tuple[float, float]:
                    summed, _ = weight(*a, **kw)
                    return summed, summed

                self.core.weight = discounted_divisor
            Corrected.made.append(self)

        def round_boundary(self) -> None:
            super().round_boundary()
            gamma = s.get("lookahead", 0.0)
            if gamma and self.reference is not None:  # the islands that just handed off move on
                for k, d in enumerate(self.delays):
                    if self.boundary % max(d, 1) == 0:
                        weights = self.bases[k] - gamma * self.reference
                        self.islands[k].write(0, weights)
                        self.bases[k] = weights.clone()

        def correct(self, h: Any) -> None:
            """The variant applied to a row (an island's own, or an upload) entering late."""
            if self.step - h.base_step < 1:
                return
            now = self.core.globals[0].detach()
            if self.reference is not None and s.get("heloco", 0.0) == 0.0:
                self.cosines.append(float(h.values.float() @ self.reference
                                          / (h.values.float().norm() * self.reference.norm()).clamp_min(1e-30)))
            if "heloco" in s and self.reference is not None:
                h.values = heloco(h.values.float(), self.reference, self.sizes, self.counts).to(h.values.dtype)
            if "project" in s:
                h.values = project(h.values.float(), self.history[h.base_step] - now, self.sizes)
            if s.get("rate"):
                h.tokens = h.tokens / max(self.delays[h.island], 1)

        def carried(self, upload: Any) -> Any:  # a thin island's row, as its carrier folds it in
            self.correct(upload)
            return super().carried(upload)

        def enter_due(self, everything: bool = False) -> None:
            now = self.core.globals[0].detach()
            for h in self.in_flight:
                if (everything or h.entry == self.boundary) and h.own and not h.carried:
                    self.correct(h)
            before, step = now.clone(), self.step
            super().enter_due(everything)
            if self.step > step:
                self.history[self.step] = self.core.globals[0].detach().clone()
                update = before - self.core.globals[0].detach()
                beta = s.get("heloco") or 0.0
                self.reference = update if self.reference is None else beta * self.reference + (1 - beta) * update

    return Corrected


def run_one(case: str, name: str, s: dict[str, Any], steps: int, seed: int, threads: int) -> dict[str, Any]:
    import torch

    import archipelago.quality_simulator as simulation
    from archipelago.config import load_config

    torch.set_num_threads(threads)
    mode = s.get("mode", "decoupled")
    over = [f"{FT}round_mode={mode}"]
    if mode == "decoupled":
        over += [f"{FT}staleness_exponent={s['exponent']}", f"{FT}overlap_threshold=0",
                 f"{FT}outer_lr={s.get('outer_lr', 1.0)}", f"{FT}arrival_steps={s.get('arrival', 0)}"]
    cfg = load_config(["--config", str(REPO / "configs/llama3/federation.toml"), *COMMON, *over,
                       "--training.steps", str(steps), "--training.seed", str(seed)])
    sim: dict[str, Any] = {}
    if case == "T":
        sim = {"wall_ticks": steps, **(THIN if s.get("thin", True) else {})}
    islands = s.get("islands", 3 if case == "T" else 2)
    Corrected = corrected_rounds(simulation, s)
    began, original = time.perf_counter(), simulation._Decoupled
    simulation._Decoupled = Corrected
    try:
        result = simulation.simulate(cfg, islands, eval_windows=256, eval_every=0, drain=False, **sim)
    finally:
        simulation._Decoupled = original
    row = {"case": case, "name": name, "settings": s, "seed": seed, "steps": steps, "islands": islands,
           "val_loss": result.final.val_loss, "tokens": result.final.tokens,
           "staleness": sorted(set(result.staleness))}
    if Corrected.made:
        made = Corrected.made[0]
        cos = sorted(made.cosines)
        row.update(heloco_blocks=made.counts, cosine_with_last_update=[cos[0], cos[len(cos) // 2], cos[-1]] if cos
                   else None)
        row.update(drain(cfg, made, 256))
    row["seconds"] = time.perf_counter() - began
    return row


def wanted(name: str, names: str) -> bool:
    return not names or any(part.strip() and part.strip() in name for part in names.split(","))


def _worker(job: tuple[Any, ...]) -> dict[str, Any]:
    return run_one(*job)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="inner steps (A), ticks (T) (default 120)")
    p.add_argument("--seed", type=int, default=100, help="the tuning seed (default 100)")
    p.add_argument("--workers", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--only", default="A,T", help="cases, comma-separated (default A,T)")
    p.add_argument("--names", default="", help="only the variants whose name contains one of these, "
                   "comma-separated (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/stale-corrections-cpu.json")
    p.add_argument("--log", type=Path, default=None, help="one JSON line per run (default: --out with .runs.jsonl)")
    p.add_argument("--resume", action="store_true", help="reuse the runs --log holds")
    a = p.parse_args()
    a.log = a.log or a.out.with_suffix(".runs.jsonl")
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    meta = where_measured(threads_per_run=a.threads, workers=a.workers)
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    if a.resume and a.log.is_file():
        for r in map(json.loads, a.log.read_text().splitlines()):
            done[(r["case"], r["name"], r["seed"], r["steps"])] = r
    cases = {c.strip().upper() for c in a.only.split(",")}
    jobs = [(c, n, s, a.steps, a.seed, a.threads) for c, n, s in RUNS
            if c in cases and (c, n, a.seed, a.steps) not in done and wanted(n, a.names)]
    rows = [r for (c, n, *_), r in done.items() if c in cases and wanted(n, a.names)]
    began = time.monotonic()
    with mp.get_context("spawn").Pool(a.workers) as pool:
        for row in pool.imap_unordered(_worker, jobs):
            with a.log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{time.monotonic() - began:5.0f}s] {row['case']} {row['name']}: {row['val_loss']:.4f}", flush=True)
            rows.append(row)
    print(f"\nllama3 debug, seed {a.seed}, {a.steps} steps; val loss of island 0 at the end (drained: the global "
          "weights once the rows in flight entered)\n")
    print("| val loss / case's discount baseline | val loss | drained | staleness | case | variant |")
    print("|---:|---:|---:|---|---|---|")
    order = {(c, n): i for i, (c, n, _) in enumerate(RUNS)}
    for r in sorted(rows, key=lambda r: order.get((r["case"], r["name"]), 99)):
        base = next((b["val_loss"] for b in rows if b["case"] == r["case"] and b["name"] == BASELINE[r["case"]]), None)
        drained = f"{r['val_loss_drained']:.4f}" if "val_loss_drained" in r else "-"
        print(f"| {r['val_loss'] / base if base else float('nan'):.4f} | {r['val_loss']:.4f} | {drained} "
              f"| {r['staleness'] or '-'} | {r['case']} | {r['name']} |")
    write_json(a.out, {"meta": {**meta, "wall_s": time.monotonic() - began, "steps": a.steps, "seed": a.seed},
                       "runs": rows})


if __name__ == "__main__":
    main()

"""Sweep outer-loop settings with the in-process simulator (archipelago/quality_simulator.py).

Each setting trains N 1-rank islands in one process, in lockstep, with the federation's
exact outer step (a test checks it bit for bit against `archipelago local`), over several
seeds, and is compared in the same run with two baselines at equal inner steps: one island
alone (the same wall-clock) and DDP (one island of N emulated ranks with N times the batch:
the same tokens). Any model family runs (`--config configs/resnet/federation.toml`, ...).
Every run evaluates on the same held-out windows, whatever its batch size. Runs go to a
pool of worker processes; on a GPU many fit side by side.

`--grid sim.NAME=VALUE` passes an option to `simulate()` instead of the config, or turns on
one of the experiments below (EXPERIMENTS: outer-momentum and round-length warm-ups,
averaged BatchNorm statistics, means over the senders, dense final rounds, index-free
masks drawn from the round's number, averaged or factored moments, training on from the
residue; two options go in one --set, e.g.
`--set sim.final_dense_rounds=1 sim.final_outer_lr_pct=50`):
`sim.slow_period=3` emulates the heterogeneous case (time-paced rounds, the last island 3x
slower, token-weighted), whose baseline at equal wall-clock is one island alone for the
fast island's steps (1.5x `--steps` for two islands:
`--steps 300 --baselines single --no-federations`).

    python bench/outer_sweep.py --steps 400 --seeds 0 1 2 \\
        --grid fault_tolerance.outer_lr=0.7,1.0 fault_tolerance.outer_momentum=0,0.9
    python bench/outer_sweep.py --device cuda --workers 12 --mixed-precision fp32 ...

Prints each run's held-out loss as it is evaluated (every `training.val_every` steps), then a table
(ratio to DDP first), and appends one JSON line per run to --out, with the CPU class that ran
it (`cpu`: runs of the same code and seed agree to the last digit only on one class).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
# Grid keys that only federations take (baselines are built without them).
FEDERATION_KEYS = ("fault_tolerance.", "sim.")


def grid_settings(grids: list[list[str]]) -> list[list[str]]:
    """Each group `key=v1,v2 key2=w1` -> every combination, as `--key=value` override lists."""
    settings: list[list[str]] = []
    for group in grids:
        for combo in _product(group):
            if combo not in settings:
                settings.append(combo)
    return settings


def _product(grid: list[str]) -> list[list[str]]:
    axes = []
    for item in grid:
        key, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--grid {item!r}: expected section.key=value[,value...]")
        axes.append([(key, v) for v in values.split(",")])
    return [[_flag(k, v) for k, v in combo] for combo in itertools.product(*axes)] if axes else []


def _flag(key: str, value: str) -> str:
    """`--key=value`; a boolean is a bare flag (`--section.key` / `--section.no_key`)."""
    if value.lower() in ("true", "false"):
        section, _, name = key.rpartition(".")
        return f"--{section}.{name}" if value.lower() == "true" else f"--{section}.no_{name}"
    return f"--{key}={value}"


def setting_name(overrides: list[str]) -> str:
    return " ".join(o[2:].split(".", 1)[-1] for o in overrides) or "defaults"


def build_jobs(args: argparse.Namespace) -> list[dict]:
    common = [f"--training.steps={args.steps}", f"--training.batch_size={args.batch_size}",
              f"--training.mixed_precision={args.mixed_precision}", *args.set]
    # Baselines take every combination of the grid's keys outside [fault_tolerance]
    # (an inner learning rate, say), so each federation has its own at the same settings.
    inner: list[list[str]] = []
    for group in args.grid or [[]]:
        for combo in _product([g for g in group if not g.startswith(FEDERATION_KEYS)]) or [[]]:
            if combo not in inner:
                inner.append(combo)
    baselines = []
    for combo in inner:
        tag = setting_name(combo) if combo else ""
        baselines += [("single", tag, 1, [*common, "--fault_tolerance.no_enable", *combo]),
                      ("ddp", tag, 1, [*common, "--fault_tolerance.no_enable", *combo,
                                       f"--training.batch_size={args.batch_size * args.islands}"])]
    federations = []
    for g in grid_settings(args.grid) or [[]]:
        tag = setting_name([o for o in g if not o[2:].startswith(FEDERATION_KEYS)])
        federations.append(("federation", tag if tag != "defaults" else "", args.islands,
                            [*common, "--fault_tolerance.enable", *g]))
    baselines = [b for b in baselines if b[0] in args.baselines and not args.no_baselines]
    if args.no_federations:
        federations = []
    # Seed-major: a sweep cut short by --time-limit still has every setting at some seeds.
    # DDP emulates one rank per island, each with its own share of the batch (and its own
    # BatchNorm statistics, averaged before an evaluation, as a DDP island does).
    return [{"setting": f"{kind} {setting_name(o[len(common) + 1:])}".strip() if kind == "federation"
             else f"{kind} {tag}".strip(), "kind": kind, "inner": tag, "islands": n, "overrides": o, "seed": seed,
             "ranks": args.islands if kind == "ddp" else 1}
            for seed in args.seeds for kind, tag, n, o in baselines + federations]


# Experiments the platform does not have, applied to the simulator's outer loop here
# (`--grid sim.NAME=VALUE`): the outer momentum growing linearly from 0 to
# `outer_momentum` over `momentum_warmup_rounds` rounds; the first `sync_warmup_rounds` K
# rounds lasting 1, 2, 4, ... inner steps; every outer step also setting every island's
# BatchNorm running statistics to their mean (`average_running_stats` 1); each coordinate of
# a sparse exchange averaged over the islands that sent it instead of over all of them
# (`contributor_mean` 1: a value only one of two islands chose enters whole, not halved);
# the last `final_dense_rounds` K rounds sending each island's pseudo-gradient with its whole
# top-k residue in fp32 (what error feedback still holds back is otherwise lost when training
# ends; counted in `bytes_sent`), with the outer rate `final_outer_lr_pct` / 100 in them
# (0: the config's); and top-k's chunks sending `shared_mask_k` values each at coordinates
# every island draws alike from the round's number (a generator seeded by it), not their
# largest, so that no indices cross: `bytes_sent` counts the scales and codes alone, and the
# bytes of top-k at 5% of 256 buy 21% of each chunk at 2 bits and 48% at 1 bit (the error
# feedback, decay and quantizer are top-k's); with `average_optimizer_state`, `average_moment`
# 1 averages only AdamW's first moment (`exp_avg`) and 2 only its second (`exp_avg_sq`), each
# island keeping its own other one (`bytes_sent` counts the one row sent); with each island's
# own moments, `factored_moment` shares AdamW's second moment through its row and column
# means alone (a matrix's r + c values in fp32 instead of r x c; vectors whole): 1 rescales
# each island's own second moment so that its factored form (row means x column means /
# mean) becomes the islands' averaged one, 2 replaces it by that averaged factored form
# (Adafactor's estimate); `keep_residue` lets every island continue each round from the
# global weights minus its own decayed top-k residue (the progress it trained but did not
# send, which otherwise waits in the residue while the island restarts from the global
# weights) and clears the residue, so that the next pseudo-gradient carries it as error
# feedback would: the global weights stay the islands' common ones, each island's own
# differ from them by what it holds back; at the end 1 sets every island to the global
# weights minus the islands' mean residue, sent in bf16 (one more row an island, counted),
# 2 leaves island 0 its own weights (nothing more sent). (Denser first rounds, once
# `early_topk_k` / `early_topk_rounds` here, are the config's `fault_tolerance.topk_early_fraction`
# and `topk_early_rounds` now: `sim.early_topk_k=20 sim.early_topk_rounds=20` with chunks of
# 1,024 is `fault_tolerance.topk_early_fraction=0.02 fault_tolerance.topk_early_rounds=20`.)
EXPERIMENTS = ("momentum_warmup_rounds", "sync_warmup_rounds", "average_running_stats", "contributor_mean",
               "final_dense_rounds", "final_outer_lr_pct", "shared_mask_k", "average_moment", "factored_moment",
               "keep_residue")


def shared_mask_codec(codec, k: int, fragment: int):  # noqa: ANN001, ANN201 - a TopKCodec in, one out
    """`shared_mask_k`: `codec` (top-k) sending `k` values a chunk at coordinates drawn from
    the round's number, which every island knows, so the receivers rebuild the indices."""
    import torch

    from archipelago.federation.codecs import TopKCodec

    class SharedMaskCodec(TopKCodec):
        rounds = 0  # encodes so far: one a round on every island, so all draw the same masks

        def _choose(self, chunks: torch.Tensor) -> torch.Tensor:
            self.rounds += 1
            draw = torch.Generator().manual_seed(1_000_003 * self.rounds + fragment)
            keys = torch.rand(self.chunks, self.chunk, generator=draw)
            return keys.topk(self.k, dim=1).indices.sort(dim=1).values.to(chunks.device)

        def payload_bytes(self) -> int:  # top-k's payload, less its indices: receivers draw them too
            scales, _, codes = self._sizes()
            return scales + codes

    assert isinstance(codec, TopKCodec) and 0 < k <= codec.chunk
    shared = SharedMaskCodec(codec.numel, k / codec.chunk, codec.bits, codec.chunk, codec.exchange, codec.decay)
    assert shared.k == k
    return shared


def share_factored_moments(islands: list, fragment: int, weights: list[float], mode: int) -> int:
    """`factored_moment`: every island's second moment of `fragment` moved to the islands'
    weighted mean of its row and column means (`mode` 1: rescaled, 2: replaced; vectors
    averaged whole); returns the values one island sends."""
    import torch

    total, sent = sum(weights), 0
    for k in range(len(islands[0].fragments[fragment])):
        moments = [i.optimizer.state[i.fragments[fragment][k]]["exp_avg_sq"] for i in islands]
        if moments[0].dim() < 2:
            mean = sum(w * v for w, v in zip(weights, moments)) / total
            for v in moments:
                v.copy_(mean)
            sent += mean.numel()
            continue
        flats = [v.view(v.shape[0], -1) for v in moments]
        rows = [f.mean(1) for f in flats]
        cols = [f.mean(0) for f in flats]
        row = sum(w * r for w, r in zip(weights, rows)) / total
        col = sum(w * c for w, c in zip(weights, cols)) / total
        shared = torch.outer(row, col) / row.mean().clamp_min(1e-30)
        for f, r, c in zip(flats, rows, cols):
            if mode == 1:
                own = torch.outer(r, c) / r.mean().clamp_min(1e-30)
                f.mul_(shared / own.clamp_min(1e-30))
            else:
                f.copy_(shared)
        sent += row.numel() + col.numel()
    return sent


def keep_residues(islands: list, fragment: int, decay: float, final: bool) -> int:
    """`keep_residue`: after an outer step that set every island to the global weights,
    each island continues from them minus its decayed residue, which it clears (the next
    pseudo-gradient holds it); `final`: every island takes the global weights minus the
    islands' mean residue in bf16 instead. Returns the bytes that sent."""
    import torch

    from archipelago.federation.exchange import Framing

    residues = [island.codecs[fragment].error for island in islands]
    if final:
        mean = sum(r.to(torch.bfloat16).float() for r in residues) / len(residues)
        for island in islands:
            island.write(fragment, island.flat(fragment) - mean.to(island.flat(fragment).device))
        return len(islands) * Framing().row_bytes(2 * mean.numel())
    for island, residue in zip(islands, residues):
        island.write(fragment, island.flat(fragment) - decay * residue.to(island.flat(fragment).device))
        residue.zero_()
    return 0


def experimental_outer(simulation, experiments: dict[str, int]) -> type:
    """The simulator's synchronous outer loop with `experiments` (see EXPERIMENTS)."""
    import torch

    from archipelago.federation.exchange import Framing
    from archipelago.federation.inner_state import WIRE_DTYPES

    momentum_warmup = experiments.get("momentum_warmup_rounds", 0)
    sync_warmup = experiments.get("sync_warmup_rounds", 0)
    average_stats = bool(experiments.get("average_running_stats", 0))
    contributor_mean = bool(experiments.get("contributor_mean", 0))
    final_dense = experiments.get("final_dense_rounds", 0)
    final_lr = experiments.get("final_outer_lr_pct", 0) / 100
    shared_mask = experiments.get("shared_mask_k", 0)
    only_moment = experiments.get("average_moment", 0)
    factored = experiments.get("factored_moment", 0)
    keep_residue = experiments.get("keep_residue", 0)

    class Experimental(simulation._Outer):
        def __init__(self, cfg, islands) -> None:
            super().__init__(cfg, islands)
            if sync_warmup and (self.ft.num_fragments > 1 or self.ft.fragment_sync_delay):
                raise ValueError("sync_warmup_rounds: one fragment without fragment_sync_delay only")
            if contributor_mean:
                self.core.merge = contributor_merge  # type: ignore[method-assign]
            if final_dense and (self.ft.num_fragments > 1 or self.ft.fragment_sync_delay
                                or self.ft.average_optimizer_state):
                raise ValueError("final_dense_rounds: one fragment, no fragment_sync_delay, own moments only")
            if only_moment and not (self.ft.average_optimizer_state and only_moment in (1, 2)):
                raise ValueError("average_moment: 1 (first) or 2 (second), with average_optimizer_state")
            if factored and (self.ft.average_optimizer_state or factored not in (1, 2)
                             or "exp_avg_sq" not in simulation.state_keys(islands[0].optimizer)):
                raise ValueError("factored_moment: 1 (rescale) or 2 (replace), AdamW, own moments")
            if keep_residue and (keep_residue not in (1, 2) or self.ft.codec != "topk" or self.ft.num_fragments > 1
                                 or self.ft.fragment_sync_delay or final_dense):
                raise ValueError("keep_residue: 1 (a final mean) or 2 (island 0's own), topk, one fragment, "
                                 "no fragment_sync_delay or final_dense_rounds")
            if keep_residue == 1 and cfg.training.steps % self.per_fragment:
                raise ValueError("keep_residue=1: training.steps a multiple of sync_steps (the last round flushes)")
            if shared_mask and self.ft.topk_early_rounds:
                raise ValueError("shared_mask_k draws its own k values a chunk: set topk_early_rounds = 0")
            self.performed = 0
            if shared_mask:
                for island in islands:
                    island.codecs = [shared_mask_codec(c, shared_mask, f) for f, c in enumerate(island.codecs)]
            # Rounds before the dense ones (the simulator's plain clock: every round is full).
            self.sparse_rounds = cfg.training.steps // self.per_fragment - final_dense
            self.prepared = 0

        def round_length(self) -> int:
            if self.step < sync_warmup:
                return min(2 ** self.step, self.per_fragment)
            return self.per_fragment

        def dense(self) -> bool:
            return bool(final_dense) and self.prepared > self.sparse_rounds

        @torch.no_grad()
        def prepare(self) -> None:
            self.prepared += 1
            if not self.dense():
                sent = self.bytes_sent
                super().prepare()
                if only_moment:  # one of the two moments crossed: their row is half as long
                    size = WIRE_DTYPES[self.ft.moments_dtype].itemsize
                    self.bytes_sent -= len(self.islands) * size * self.pending[1].numel()
                    assert self.bytes_sent > sent
                return None
            fragment = self.core.fragment(self.step)
            values, weights, self.round_tokens = [], [], []
            for island in self.islands:
                pseudo = self.core.pseudo_gradient(fragment, island.flat(fragment))
                codec = island.codecs[fragment]
                if getattr(codec, "error", None) is not None and codec.error.numel():  # top-k's residue
                    pseudo += codec.decay * codec.error.to(pseudo.device)
                    codec.error.zero_()
                weight, _ = self.core.weight(island.fragment_tokens[fragment], contributes=True)
                self.round_tokens.append(island.fragment_tokens[fragment])
                island.fragment_tokens[fragment] = 0
                values.append(pseudo)
                weights.append(weight)
                self.bytes_sent += Framing().row_bytes(4 * pseudo.numel())
            self.pending = (fragment, self.core.merge(values, weights), sum(weights))

        @torch.no_grad()
        def perform(self) -> None:
            if final_lr and self.dense():
                for group in self.core.outer[self.pending[0]].param_groups:
                    group["lr"] = final_lr
            if momentum_warmup:
                ramp = min(1.0, self.step / momentum_warmup)
                for group in self.core.outer[self.pending[0]].param_groups:
                    group["momentum"] = self.ft.outer_momentum * ramp
            kept = [island.moments(self.pending[0]) for island in self.islands] if only_moment else []
            super().perform()
            for island, own in zip(self.islands, kept):  # the moment not averaged: the island's own
                averaged = island.moments(self.pending[0])
                averaged[2 - only_moment] = own[2 - only_moment]
                island.write_moments(self.pending[0], averaged)
            self.performed += 1
            if keep_residue:
                self.bytes_sent += keep_residues(self.islands, self.pending[0], self.ft.topk_error_decay,
                                                 final=self.performed == self.sparse_rounds and keep_residue == 1)
            if factored:
                values = share_factored_moments(self.islands, self.pending[0], [float(t) for t in self.round_tokens],
                                                factored)
                self.bytes_sent += len(self.islands) * Framing().row_bytes(4 * values)
            if average_stats:
                stats = [simulation.running_stats(island.model) for island in self.islands]
                for k in range(len(stats[0]) if stats else 0):
                    mean = torch.stack([s[k].float() for s in stats]).mean(0)
                    for s in stats:
                        s[k].copy_(mean)

    return Experimental


def contributor_merge(values: list, weights: list[float]):  # noqa: ANN201 - a tensor
    """`contributor_mean`: the weighted sum of the rows, each coordinate scaled by all the
    weights over the weights of the islands whose row is nonzero there, so that the outer
    step's division by all the weights leaves each coordinate's mean over its senders."""
    import torch

    total = sum(w * v for w, v in zip(weights, values))
    cover = sum(w * (v != 0).float() for w, v in zip(weights, values))
    return torch.where(cover > 0, total * (sum(weights) / cover.clamp_min(1e-30)), total)


def run_job(job: dict, config: str, device: str, threads: int, eval_windows: int) -> dict:
    import torch

    import archipelago.quality_simulator as simulation
    from archipelago.config import load_toml, parse_overrides, validate

    torch.set_num_threads(threads)
    # `--sim.NAME=VALUE` entries are simulate() options or experiments, the rest config overrides.
    options = {o[6:].split("=")[0]: int(o.split("=")[1]) for o in job["overrides"] if o.startswith("--sim.")}
    experiments = {k: options.pop(k) for k in EXPERIMENTS if k in options}
    overrides = [o for o in job["overrides"] if not o.startswith("--sim.")]
    cfg = parse_overrides(load_toml(config), [*overrides, f"--training.seed={job['seed']}"])
    validate(cfg)
    began, original = time.perf_counter(), simulation._Outer

    def progress(message: str) -> None:  # each held-out evaluation, so a long run shows it is moving
        print(f"  [{time.perf_counter() - began:6.0f}s] {job['setting']} seed {job['seed']}: {message}", flush=True)

    if experiments:
        simulation._Outer = experimental_outer(simulation, experiments)
    try:
        result = simulation.simulate(cfg, job["islands"], device=device, eval_windows=eval_windows,
                                     ranks=job.get("ranks", 1), log=progress, **options)
    finally:
        simulation._Outer = original
    return {**job, "val_loss": result.final.val_loss, "tokens": result.final.tokens,
            "bytes_sent": result.bytes_sent, "inner_steps": result.inner_steps,
            "params": sum(p.numel() for p in result.models[0].parameters()) if result.models else None,
            "seconds": time.perf_counter() - began,
            "curve": [[p.step, p.tokens, p.val_loss] for p in result.points]}


def _worker(args: tuple) -> dict:
    return run_job(*args)


def ddp_bytes_per_token(rows: list[dict], params: int | None, inner: str = "") -> float | None:
    """What DDP's ring all-reduce of fp32 gradients over 2 ranks sends per token, both
    ranks together: 2 x 4 bytes x parameters per step, over the tokens of a step, from the
    DDP row of the same inner settings. None without one, without a parameter count (rows
    carry `params` since it was added, else --params), or for more than 2 ranks: a
    federation's `bytes_sent` counts each island's row once, what it sends to its one peer
    only when there are two islands."""
    for r in rows:
        count = r.get("params") or params
        if r["kind"] == "ddp" and r["inner"] == inner and count and r.get("inner_steps") and r.get("ranks") == 2:
            return 2 * 4 * count / (r["tokens"] / max(r["inner_steps"]))
    return None


def summarize(rows: list[dict], params: int | None = None) -> list[dict]:
    """Mean over seeds of each setting's val loss, and of its ratio to the baselines of
    the same seed and inner settings (paired: the seed moves every run the same way);
    bytes across islands per token, and DDP's per token over that (two islands)."""
    base = {(r["kind"], r["inner"], r["seed"]): r["val_loss"] for r in rows if r["kind"] != "federation"}
    best_ddp = {}
    for (kind, _inner, seed), loss in base.items():
        if kind == "ddp":
            best_ddp[seed] = min(loss, best_ddp.get(seed, loss))
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["setting"], []).append(r)
    table = []
    for name, runs in by.items():
        losses = [r["val_loss"] for r in runs]

        def ratio(kind: str, runs: list[dict] = runs) -> float:
            pairs = [r["val_loss"] / base[(kind, r["inner"], r["seed"])] for r in runs
                     if (kind, r["inner"], r["seed"]) in base]
            return statistics.mean(pairs) if pairs else float("nan")

        vs_best = [r["val_loss"] / best_ddp[r["seed"]] for r in runs if r["seed"] in best_ddp]
        per_token = statistics.mean(r.get("bytes_sent", 0) / r["tokens"] for r in runs)
        ddp_bytes = ddp_bytes_per_token(rows, params, runs[0]["inner"])
        table.append({"setting": name, "val_loss": statistics.mean(losses), "spread": max(losses) - min(losses),
                      "bytes_per_token": per_token,
                      "ddp_bytes_ratio": ddp_bytes / per_token if ddp_bytes and per_token else float("nan"),
                      "seeds": len(runs), "tokens": runs[0]["tokens"], "vs_ddp": ratio("ddp"),
                      "vs_single": ratio("single"),
                      "vs_best_ddp": statistics.mean(vs_best) if vs_best else float("nan")})
    return sorted(table, key=lambda t: t["vs_best_ddp"])


def print_table(table: list[dict]) -> None:
    print("\n| val loss / DDP (same inner settings) | / best DDP | / single island | val loss (mean) "
          "| spread (max-min) | seeds | tokens | bytes/token | DDP's bytes / these | setting |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for t in table:
        ratios = " | ".join("-" if math.isnan(t[k]) else f"{t[k]:.4f}" for k in ("vs_ddp", "vs_best_ddp", "vs_single"))
        fewer = "-" if math.isnan(t["ddp_bytes_ratio"]) else f"{t['ddp_bytes_ratio']:,.0f}"
        print(f"| {ratios} | {t['val_loss']:.4f} | {t['spread']:.4f} | {t['seeds']} | {t['tokens']:,} "
              f"| {t['bytes_per_token']:,.1f} | {fewer} | {t['setting']} |")


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # leaves the Pool's with-block, which terminates the workers


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama3/federation.toml"))
    p.add_argument("--islands", type=int, default=2)
    p.add_argument("--steps", type=int, default=400, help="inner steps per island")
    p.add_argument("--batch-size", type=int, default=8, help="per island; DDP gets islands x this")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--grid", nargs="*", action="append", default=[],
                   help="section.key=v1,v2 ... (every combination); repeat for more groups")
    p.add_argument("--set", nargs="*", default=[], help="--section.key=value overrides for every run")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--baselines", nargs="+", choices=["single", "ddp"], default=["single", "ddp"],
                   help="which baselines to run (default both)")
    p.add_argument("--no-federations", action="store_true", help="run the baselines only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16", "auto"])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / workers)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of seq_len tokens (or images)")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per run here")
    p.add_argument("--time-limit", type=float, default=0, help="start no run after this many seconds")
    p.add_argument("--summarize", type=Path, nargs="+", default=None,
                   help="run nothing: print the table of earlier --out files")
    p.add_argument("--params", type=int, default=None,
                   help="with --summarize: the model's parameter count, for files whose rows do not carry it "
                        "(DDP's bytes per token)")
    args = p.parse_args()
    if args.summarize:
        rows = [json.loads(line) for path in args.summarize for line in path.read_text().splitlines() if line]
        print_table(summarize(rows, args.params))
        return
    args.set = [s if s.startswith("--") else f"--{s}" for s in args.set]
    jobs = build_jobs(args)
    threads = args.threads or max(1, (mp.cpu_count() // args.workers))
    began = time.monotonic()
    rows = []
    # Each row names its CPU class: only runs of one class pair to the last digit. Imported
    # here: the harness loads torch, which --help and --summarize do without.
    from harness import cpu_model

    cpu = cpu_model() if args.device == "cpu" else args.device
    print(f"{len(jobs)} runs on {args.device} ({cpu}) with {args.workers} worker(s)", flush=True)
    with mp.get_context("spawn").Pool(args.workers) as pool:
        pending = [(j, args.config, args.device, threads, args.eval_windows) for j in jobs]
        for row in pool.imap_unordered(_worker, pending):
            row["cpu"] = cpu
            rows.append(row)
            print(f"[{time.monotonic() - began:6.0f}s] {row['setting']} seed {row['seed']}: "
                  f"{row['val_loss']:.4f} ({row['seconds']:.0f}s)", flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if args.time_limit and time.monotonic() - began > args.time_limit:
                pool.terminate()
                print("time limit reached: stopping", flush=True)
                break
    print_table(summarize(rows))


if __name__ == "__main__":
    main()

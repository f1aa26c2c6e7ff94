"""Model quality at equal tokens: federations against one island and against DDP.

Every setting runs the real platform (`archipelago train` / `archipelago local`) on the
same config, for several seeds, and is compared in the same run with two baselines:

* single: one 1-rank island alone, `--steps` steps of `--batch-size` sequences: what one
  island trains in the wall-clock time a federation island spends on the same steps;
* ddp: one island of 2 ranks, per-step gradient all-reduce (`data_parallel = "ddp"`), the
  islands' combined batch: the same tokens as a 2-island federation, the expensive way.

Settings: diloco (2 x 1 rank, the config's outer step: sync_steps 10 with the islands'
AdamW moments averaged), own-moments (the defaults before: sync_steps 20, each island
keeping its own moments), adam-federation-batch / adam-own-batch (the config with
`fault_tolerance.adam_federation_batch` on / off), reference-outer (the reference
platform's outer Nesterov SGD, lr 0.7, momentum 0.9, sync_steps 20), diloco-3 (3 x 1 rank:
1.5x DDP's tokens, so compared with one island only), int8, topk (20% of 256, 2 bits),
topk-5pct-1bit (the sparser top-k before), sparseloco (2% at 2 bits, error feedback decayed by
0.95, 30-step rounds, own moments; -muon: with Muon inside, MuLoCo's inner optimizer;
-5pct-20: 5% in 20-step rounds, -5pct-20-keep: the same, each island training on from its own
unsent residue (topk_keep_residue), -5pct-20-muon with Muon inside; their ratios are over single-muon and
ddp-muon, the baselines with Muon inside, where the run has them; -1pct-50: 1% of chunks of 1,024 in
50-step rounds, about 10,000x fewer bytes than DDP; -1pct-50-keep: the same with topk_keep_residue;
-1pct-50-keep-early: that with 2% (20 of 1,024) in the first 20 rounds, topk_early_fraction),
four islands (diloco-4, sparseloco-5pct-20-4, sparseloco-20pct-20-4: 20% in 20-step rounds, about
300x fewer bytes) against DDP of four ranks
(ddp-4), streaming int8 (2 fragments, tau 1) and
streaming-int8-no-overlap (tau 0), sync_steps 5 / 50 / 100, and het-1:3 (a 2-rank and
a 1-rank island, the 1-rank one emulated 3x slower, time-paced rounds as long as the
diloco run's median round, token-weighted): the same token budget, unequal steps. Its
single-island baseline at equal wall-clock is the fast island alone for as many steps as
it ran in the federation (`single-fast`, measured per seed).

Ratios are paired: each seed's value over the baseline's at the same seed, then the
mean over seeds (the seed moves every run the same way: init and data order). Every run
evaluates the same held-out windows (--eval-windows, 256 unless told, from window
--eval-offset on, 0 unless told; val_batches x batch_size), at the end and every quarter.
Bytes are what the runs hand to the cross-island (cross-rank) collectives, as the
outer-step meter counts them (`bytes_sent`); for DDP, 4 bytes per parameter per rank per
step (its fp32 gradient all-reduce). Prints a table (ratio first), `--out` writes JSON
(one object per setting, and where it was measured), `--plot` a PNG of validation loss
against tokens.

    python bench/quality.py [--steps 200] [--seeds 0 1 2] [--settings single ddp diloco ...]
    python bench/quality.py --flavor small --device cuda     # on a GPU machine
    python bench/quality.py --work-dir DIR --resume         # go on after an interruption
    python bench/quality.py --preset compute-optimal --out FILE   # docs/quality.md's 20-tokens-per-parameter table

Bytes per token are against DDP's of the same seed where the run has one, else against
DDP's count on the run's own batches (two ranks, one fp32 all-reduce per step).

Defaults take about 2 hours on a 2-core CPU (13 settings x 3 seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402
    REPO,
    num,
    outer_steps,
    read_jsonl,
    read_summary,
    run_job,
    run_main,
    where_measured,
    work_root,
)

from archipelago.metrics.report import final_validation  # noqa: E402

EVAL_WINDOWS = 256
STREAM = ("--fault_tolerance.codec", "int8", "--fault_tolerance.num_fragments", "2",
          "--fault_tolerance.fragment_sync_delay", "1")
# The same fragments without the one-step overlap, which is what costs (docs/quality.md section 11).
STREAM_NO_OVERLAP = (*STREAM[:-1], "0")
# The defaults before: a round every 20 steps, each island keeping its own AdamW moments.
OWN_MOMENTS = ("--fault_tolerance.sync_steps", "20", "--fault_tolerance.no_average_optimizer_state")
# SparseLoCo-style rounds: 2% of each chunk of 256 at 2 bits, the error-feedback
# residue decayed by 0.95 a round, 30-step rounds, each island keeping its own moments (averaged
# moments would be two fp32 model-sized rows a round: about 300x these rows' bytes).
SPARSELOCO = ("--fault_tolerance.codec", "topk", "--fault_tolerance.topk_fraction", "0.02",
              "--fault_tolerance.topk_bits", "2", "--fault_tolerance.topk_error_decay", "0.95",
              "--fault_tolerance.sync_steps", "30", "--fault_tolerance.no_average_optimizer_state")


def sparse_rounds(fraction: str, sync_steps: str, *more: str) -> tuple[str, ...]:
    """SPARSELOCO's rounds with another density and round length (the later option wins),
    and any further options."""
    return (*SPARSELOCO, "--fault_tolerance.topk_fraction", fraction, "--fault_tolerance.sync_steps", sync_steps,
            *more)


# Each island training on from its own unsent progress (fault_tolerance.topk_keep_residue).
KEEP_RESIDUE = ("--fault_tolerance.topk_keep_residue",)
# About 10,000x fewer bytes than DDP: 1% of each chunk of 1,024 (k = 10; wider chunks
# spread the two bf16 scales over more values) in 50-step rounds.
ONE_PCT_50 = sparse_rounds("0.01", "50", "--fault_tolerance.topk_chunk_size", "1024")
# Denser first rounds, where the rounds trail DDP most: 2% of each chunk (20 of 1,024) in
# the first 20 rounds, then the setting's fraction (about 1/10,355 of DDP's bytes with ONE_PCT_50).
EARLY_DENSER = ("--fault_tolerance.topk_early_fraction", "0.02", "--fault_tolerance.topk_early_rounds", "20")


# One island of several ranks, all-reducing gradients every step.
DDP = ("--parallelism.data_parallel", "ddp")
# MuLoCo's inner optimizer: Muon for the hidden matrices, AdamW for the rest (optimizer.name).
MUON = ("--optimizer.name", "muon")
# Muon's own gain is not the federation's: a federation with Muon inside is compared with the
# baselines with Muon inside where the run has them, else with AdamW's.
AGAINST_MUON = {"singles": ("single-muon", "single"), "ddps": ("ddp-muon", "ddp")}


@dataclass(frozen=True)
class Setting:
    name: str
    islands: str = "1,1"         # --islands of `archipelago local`; "" = one `archipelago train`
    ranks: int = 1               # ranks of the one island (train only)
    batch_factor: int = 1        # the island's batch = batch_factor x --batch-size
    args: tuple[str, ...] = ()
    slowdown: str = ""           # --slowdown of `archipelago local`
    island_options: str = ""     # --island-options of `archipelago local` (ISLAND:OPTIONS)
    time_paced: bool = False
    # The baselines its ratios are over, the first this run measured: one island at equal
    # wall-clock, and DDP at equal tokens (none where no DDP trains this setting's tokens).
    singles: tuple[str, ...] = ("single",)
    ddps: tuple[str, ...] = ("ddp",)


SETTINGS = {s.name: s for s in (
    Setting("single", islands="", ddps=()),
    Setting("ddp", islands="", ranks=2, batch_factor=2, args=DDP),
    # The baselines with Muon inside, for the federations with Muon inside: Muon's gain is not
    # the federation's when DDP and one island can have it too.
    Setting("single-muon", islands="", args=MUON, ddps=()),
    Setting("ddp-muon", islands="", ranks=2, batch_factor=2, args=(*DDP, *MUON)),
    Setting("diloco"),
    Setting("reference-outer", args=(*OWN_MOMENTS, "--fault_tolerance.outer_lr", "0.7",
                                     "--fault_tolerance.outer_momentum", "0.9")),
    Setting("own-moments", args=OWN_MOMENTS),
    Setting("adam-federation-batch", args=("--fault_tolerance.adam_federation_batch",)),
    Setting("adam-own-batch", args=("--fault_tolerance.no_adam_federation_batch",)),
    Setting("diloco-3", islands="1,1,1", ddps=()),
    Setting("het-1:3", islands="2,1", slowdown="1,3", time_paced=True, singles=("single-fast",)),
    Setting("single-fast", islands="", ranks=2, ddps=()),
    Setting("int8", args=("--fault_tolerance.codec", "int8")),
    Setting("topk", args=("--fault_tolerance.codec", "topk")),
    Setting("topk-5pct-1bit", args=("--fault_tolerance.codec", "topk", "--fault_tolerance.topk_fraction", "0.05",
                                    "--fault_tolerance.topk_bits", "1")),
    Setting("sparseloco", args=SPARSELOCO),
    Setting("sparseloco-muon", args=(*SPARSELOCO, *MUON), **AGAINST_MUON),
    Setting("sparseloco-5pct-20", args=sparse_rounds("0.05", "20")),
    Setting("sparseloco-5pct-20-muon", args=sparse_rounds("0.05", "20", *MUON), **AGAINST_MUON),
    # The same rounds, each island training on from its own unsent progress: the same bytes.
    Setting("sparseloco-5pct-20-keep", args=sparse_rounds("0.05", "20", *KEEP_RESIDUE)),
    Setting("sparseloco-1pct-50", args=ONE_PCT_50),
    # At 1% a round most of an island's progress waits unsent, which it then keeps training on.
    Setting("sparseloco-1pct-50-keep", args=(*ONE_PCT_50, *KEEP_RESIDUE)),
    Setting("sparseloco-1pct-50-keep-early", args=(*ONE_PCT_50, *KEEP_RESIDUE, *EARLY_DENSER)),
    # Four islands, against DDP of four ranks (the same tokens).
    Setting("ddp-4", islands="", ranks=4, batch_factor=4, args=DDP,
            ddps=("ddp-4",)),
    Setting("diloco-4", islands="1,1,1,1", ddps=("ddp-4",)),
    Setting("sparseloco-5pct-20-4", islands="1,1,1,1", args=sparse_rounds("0.05", "20"), ddps=("ddp-4",)),
    # Four islands at about 300x fewer bytes: with four islands the 5% rounds end 2% behind
    # DDP at any outer rate; 20% of each chunk closes most of it (docs/quality.md).
    Setting("sparseloco-20pct-20-4", islands="1,1,1,1", args=sparse_rounds("0.2", "20"), ddps=("ddp-4",)),
    Setting("streaming-int8", args=STREAM),
    Setting("streaming-int8-no-overlap", args=STREAM_NO_OVERLAP),
    Setting("sync-5", args=("--fault_tolerance.sync_steps", "5")),
    Setting("sync-50", args=("--fault_tolerance.sync_steps", "50")),
    Setting("sync-100", args=("--fault_tolerance.sync_steps", "100")),
    # diloco with island 1 computing through DaCe (docs/backends.md): against diloco, what an
    # unlike backend costs in held-out loss (the products differ from eager's in their last bits).
    Setting("diloco-dace", island_options="1:--training.backend dace --training.mixed_precision fp32"),
)}


@dataclass
class Run:
    setting: str
    seed: int
    val_loss: float
    tokens: int
    bytes_sent: int
    steps: list[int] = field(default_factory=list)   # inner steps per island
    params: int = 0                                 # the model's parameters (DDP's bytes without a DDP run)
    curve: list[list[float]] = field(default_factory=list)  # [tokens, val loss]


# ------------------------------------------------------------------ commands


def model_name(args: argparse.Namespace) -> str:
    from archipelago.config import load_toml

    return load_toml(args.config).model.name


def sync_steps_of(args: argparse.Namespace, s: Setting) -> int:
    from archipelago.config import load_toml

    if "--fault_tolerance.sync_steps" in s.args:
        return int(s.args[s.args.index("--fault_tolerance.sync_steps") + 1])
    return load_toml(args.config).fault_tolerance.sync_steps


def eval_every(args: argparse.Namespace, s: Setting, steps: int) -> int:
    """About 4 evaluations per run, at round ends (global weights) where rounds are steps."""
    sync = 1 if not s.islands or s.time_paced else sync_steps_of(args, s)
    return sync * max(1, steps // (4 * sync))


def base_args(args: argparse.Namespace, seed: int, steps: int, batch: int, every: int) -> list[str]:
    return ["--config", str(args.config), "--model.flavor", args.flavor, "--training.device", args.device,
            "--training.seed", str(seed), "--training.steps", str(steps), "--training.batch_size", str(batch),
            "--training.val_every", str(every), "--training.val_batches", str(max(1, args.eval_windows // batch)),
            "--training.val_offset", str(args.eval_offset),
            "--checkpoint.no_enable", "--metrics.no_tensorboard", "--metrics.progress", "plain",
            "--metrics.log_every", str(every)]


def ranks_here(args: argparse.Namespace, s: Setting) -> int:
    """The ranks a one-island setting runs with. On a machine with fewer GPUs than a DDP
    setting's ranks (NCCL takes one GPU per rank) DDP runs as one rank with the whole batch:
    the same mean gradient of the same sequences, up to summation order; its bytes stay its
    ranks'."""
    if s.ranks > 1 and args.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < s.ranks:
            if DDP[0] not in s.args:  # only a DDP setting's ranks can run as one
                raise SystemExit(f"{s.name} needs {s.ranks} GPUs (one per rank); this machine has "
                                 f"{torch.cuda.device_count()}: leave it out of --settings")
            return 1
    return s.ranks


def command(args: argparse.Namespace, s: Setting, seed: int, run_dir: Path, steps: int,
            round_s: float | None) -> list[str]:
    cli = [sys.executable, "-m", "archipelago.launch.cli"]
    common = [*base_args(args, seed, steps, args.batch_size * s.batch_factor, eval_every(args, s, steps)),
              "--job.run_dir", str(run_dir), *s.args]
    if s.name in args.lr:  # each setting at the peak learning rate tuned for it
        common += ["--optimizer.lr", args.lr[s.name]]
    if s.name in args.outer_lr and s.islands:  # and a federation at its tuned outer rate
        common += ["--fault_tolerance.outer_lr", args.outer_lr[s.name]]
    if not s.islands:
        return [*cli, "train", "--nproc", str(ranks_here(args, s)), *common]
    cmd = [*cli, "local", "--islands", s.islands, "--no-table", *common]
    if s.slowdown:
        cmd += ["--slowdown", s.slowdown]
    if s.island_options:
        cmd += ["--island-options", s.island_options]
    if s.time_paced:
        cmd += ["--fault_tolerance.round_pacing", "time", "--fault_tolerance.round_seconds", f"{round_s:.2f}"]
    return cmd


# ------------------------------------------------------------------ results


def island_dirs(run_dir: Path) -> list[Path]:
    found = sorted(run_dir.glob("island-*"), key=lambda p: int(p.name.split("-")[1]))
    return found or [run_dir]


def curve(run_dir: Path) -> list[list[float]]:
    """[tokens of the whole run, val loss] at every evaluation of island 0. A federation's
    tokens are those it had trained at island 0's last outer step before the evaluation
    (exact when evaluations fall on round ends, as they do under step pacing here)."""
    first = read_jsonl(island_dirs(run_dir)[0] / "metrics.jsonl")
    rounds = [(r["step"], r.get("federation_tokens", 0)) for r in first
              if r.get("event") == "outer_step" and r.get("committed")]
    points = []
    for r in first:
        if "event" in r or not isinstance(r.get("val_loss"), (int, float)):
            continue
        if rounds:
            tokens = max((t for step, t in rounds if step <= r["step"]), default=0)
        else:
            tokens = r.get("tokens", 0)
        points.append([tokens, r["val_loss"]])
    return points


def collect(s: Setting, seed: int, run_dir: Path, params: int, args: argparse.Namespace, steps: int) -> Run:
    final = final_validation(run_dir)
    islands = island_dirs(run_dir)
    if s.islands:
        sent = sum(r.get("bytes_sent", 0) for d in islands for r in outer_steps(d))
        inner = [max((r["step"] for r in read_jsonl(d / "metrics.jsonl") if "event" not in r and "step" in r),
                     default=0) for d in islands]
    else:  # DDP: one fp32 gradient all-reduce per step on every rank (none for one rank)
        sent = 4 * params * s.ranks * steps if s.ranks > 1 else 0
        inner = [final["step"]]
    return Run(s.name, seed, final["val_loss"], final["tokens"], sent, inner, params, curve(run_dir))


def params_of(run_dir: Path) -> int:
    """The model's parameter count, from the first island that wrote its summary."""
    for d in island_dirs(run_dir):
        summary = read_summary(d)
        if summary:
            return int(summary.get("params", 0))
    return 0


def median_round_s(run_dir: Path) -> float | None:
    """The median compute seconds of island 0's rounds (its join round left out)."""
    rounds = [r["compute_s"] for r in outer_steps(run_dir / "island-0")[1:] if r.get("compute_s")]
    return statistics.median(rounds) if rounds else None


# ------------------------------------------------------------------ summary

def baselines(name: str, measured: set[str]) -> tuple[str | None, str | None]:
    """The one-island and DDP settings a setting's ratios are over: the first of its
    candidates (Setting.singles, Setting.ddps) that this run measured."""
    s = SETTINGS[name]
    return (next((b for b in s.singles if b in measured), None),
            next((b for b in s.ddps if b in measured), None))


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.setting, []).append(r)
    base = {(r.setting, r.seed): r for r in runs}

    def paired(runs_: list[Run], ref: str | None, value) -> float | None:  # noqa: ANN001 - a getter
        pairs = [value(r) / value(base[(ref, r.seed)]) for r in runs_
                 if (ref, r.seed) in base and value(base[(ref, r.seed)])]
        return statistics.fmean(pairs) if pairs else None

    table = []
    for name, group in by.items():
        single, ddp = baselines(name, set(by))
        losses = [r.val_loss for r in group]
        table.append({
            "setting": name, "tokens": int(statistics.fmean(r.tokens for r in group)),
            "val_loss": statistics.fmean(losses), "val_loss_spread": max(losses) - min(losses),
            "val_loss_ratio_vs_ddp": paired(group, ddp, lambda r: r.val_loss),
            "val_loss_ratio_vs_single": paired(group, single, lambda r: r.val_loss),
            "baselines": {"ddp": ddp, "single": single},
            "bytes_per_token_ratio_vs_ddp": bytes_ratio(group, paired(group, ddp, bytes_per_token)),
            "seeds": [r.seed for r in group], "val_losses": losses,
            "inner_steps": [r.steps for r in group], "bytes_sent": [r.bytes_sent for r in group],
            "curves": [r.curve for r in group],
        })
    return table


def bytes_per_token(r: Run) -> float:
    return r.bytes_sent / max(r.tokens, 1)


def ddp_bytes_per_token(r: Run) -> float:
    """What DDP sends per token on the run's batches: one fp32 gradient all-reduce of every
    parameter per rank and step, a rank's step being one island step's tokens (or one of a
    one-island run's ranks' steps)."""
    setting = SETTINGS[r.setting]
    steps = sum(r.steps) * (1 if setting.islands else setting.ranks)
    return 4 * r.params * steps / r.tokens if r.params and r.tokens and steps else 0.0


def bytes_ratio(group: list[Run], measured: float | None) -> float | None:
    """Bytes per token over DDP's: against the DDP run of the same seed where there is one,
    else against DDP's count on the run's own batches; 0 for a run that sends nothing."""
    if measured is not None or not group:
        return measured
    if all(r.bytes_sent == 0 for r in group):
        return 0.0
    ratios = [bytes_per_token(r) / ddp_bytes_per_token(r) for r in group if ddp_bytes_per_token(r)]
    return statistics.fmean(ratios) if ratios else None


def bytes_cell(ratio: float | None) -> str:
    """A bytes ratio as the table shows it: four decimals, or 1/N below a hundredth."""
    if ratio is None or ratio == 0 or ratio >= 0.01:
        return num(ratio, ".4f")
    return f"1/{1 / ratio:,.0f}"


def print_table(table: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{model_name(args)} {args.flavor}, {args.steps} inner steps per island of {args.batch_size} sequences "
          f"(ddp: {2 * args.batch_size}), seeds {' '.join(map(str, args.seeds))}; ratios paired by seed; "
          f"het-1:3 compared with single-fast (its fast island alone, as long)\n")
    print("| val loss / DDP's | val loss / single island's | bytes per token / DDP's | val loss (mean) "
          "| spread (max-min) | tokens | inner steps per island (seed 0) | setting |")
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for t in table:
        print(f"| {num(t['val_loss_ratio_vs_ddp'], '.4f')} | {num(t['val_loss_ratio_vs_single'], '.4f')} "
              f"| {bytes_cell(t['bytes_per_token_ratio_vs_ddp'])} | {t['val_loss']:.4f} "
              f"| {t['val_loss_spread']:.4f} | {t['tokens']:,} | {'/'.join(map(str, t['inner_steps'][0]))} "
              f"| {t['setting']}{against(t)} |")


def against(row: dict[str, Any]) -> str:
    """' (against ddp-muon, single-muon)' where a row's ratios are over other baselines than
    its settings' usual ones (AdamW's DDP and one island)."""
    named = row.get("baselines", {})
    usual = {"ddp": (None, "ddp"), "single": (None, "single", "single-fast")}
    if all(named.get(k) in allowed for k, allowed in usual.items()):
        return ""
    return " (against " + ", ".join(b for b in (named.get("ddp"), named.get("single")) if b) + ")"


def plot(table: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for t in table:
        points = [p for p in zip(*t["curves"])]  # one tuple of [tokens, loss] per evaluation, over seeds
        xs = [statistics.fmean(q[0] for q in pts) for pts in points]
        ys = [statistics.fmean(q[1] for q in pts) for pts in points]
        style = "--" if t["setting"].startswith(("single", "ddp")) else "-"
        ax.plot(xs[1:], ys[1:], style, marker="o", markersize=3, label=t["setting"])  # step 0 is the same for all
    ax.set_xlabel("tokens trained (all islands)")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ main


# `--preset compute-optimal`: docs/quality.md's compute-optimal table in one command (20 tokens
# per parameter, report seeds on report windows, each setting at the rate tuned on seed 100).
PRESETS: dict[str, dict[str, Any]] = {
    "compute-optimal": {
        "config": REPO / "configs/llama3/compute-optimal.toml", "flavor": "tiny", "steps": 4300, "batch_size": 16,
        "eval_windows": 512, "eval_offset": 512, "seeds": [0, 1, 2],
        "settings": ["single", "ddp", "diloco", "sparseloco-5pct-20-keep", "sparseloco-1pct-50-keep",
                     "sparseloco-1pct-50-keep-early"],
        "lr": ["ddp=5e-3", "diloco=5e-3", "single=3e-3", "sparseloco-5pct-20-keep=3e-3",
               "sparseloco-1pct-50-keep=3e-3", "sparseloco-1pct-50-keep-early=3e-3"],
        "outer_lr": ["sparseloco-5pct-20-keep=2.0", "sparseloco-1pct-50-keep=2.0",
                     "sparseloco-1pct-50-keep-early=2.0"],
    },
}


def per_setting(p: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, str]:
    """SETTING=VALUE items as {setting: value}; a usage error names the bad ones."""
    pairs = [item.partition("=") for item in items]
    bad = [item for item, (name, eq, value) in zip(items, pairs) if not eq or name not in SETTINGS or not value]
    if bad:
        p.error(f"{flag} {' '.join(bad)}: expected SETTING=VALUE with SETTING one of {', '.join(SETTINGS)}")
    return {name: value for name, _, value in pairs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="defaults for a whole table (compute-optimal: docs/quality.md's 20-tokens-per-parameter "
                        "table, about an hour per setting and seed here); options given as well override it")
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/federation.toml")
    p.add_argument("--flavor", default="debug", help="the config's model flavor (llama3 small on a GPU machine)")
    p.add_argument("--device", default="cpu", help="training.device of every run")
    p.add_argument("--steps", type=int, default=200, help="inner steps per island (demo: 200)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island per step")
    p.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS,
                   help="held-out sequences (images) every run evaluates (val_batches = this / batch size)")
    p.add_argument("--eval-offset", type=int, default=0,
                   help="held-out windows skipped before those evaluated: tune on one slice (0), report on another")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--lr", nargs="+", default=[], metavar="SETTING=LR",
                   help="a setting's peak learning rate instead of the config's (each setting at its own "
                        "tuned rate: --lr ddp=5e-3 diloco=5e-3 single=3e-3)")
    p.add_argument("--outer-lr", nargs="+", default=[], metavar="SETTING=LR",
                   help="a federation's outer learning rate instead of the config's (--outer-lr sparseloco=1.5)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    p.add_argument("--work-dir", type=Path, default=None, help="run directories (default: a new /tmp folder)")
    p.add_argument("--resume", action="store_true",
                   help="reuse runs that finished in --work-dir (an interrupted benchmark goes on where it stopped)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write validation loss vs tokens as PNG here")
    preset, _ = p.parse_known_args(argv)
    if preset.preset:
        p.set_defaults(**PRESETS[preset.preset])
    args = p.parse_args(argv)
    args.lr = per_setting(p, "--lr", args.lr)
    args.outer_lr = per_setting(p, "--outer-lr", args.outer_lr)
    if "het-1:3" in args.settings and "single-fast" not in args.settings:
        args.settings.append("single-fast")  # het-1:3's baseline at equal wall-clock
    return args


def finished(run_dir: Path) -> bool:
    """Every island of the run wrote its summary: the run ended and its results are complete."""
    return run_dir.is_dir() and all((d / "summary.json").is_file() for d in island_dirs(run_dir))


def run_one(args: argparse.Namespace, root: Path, s: Setting, seed: int, steps: int,
            round_s: float | None) -> tuple[Run, Path]:
    run_dir = root / f"{s.name.replace(':', 'x')}-seed{seed}"
    if args.resume and finished(run_dir):
        run = collect(s, seed, run_dir, params_of(run_dir), args, steps)
        print(f"  {s.name} seed {seed}: val loss {run.val_loss:.4f} (finished earlier, reused)", flush=True)
        return run, run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted run: start it again from nothing
    cmd = command(args, s, seed, run_dir, steps, round_s)
    done = run_job(cmd, root / f"{run_dir.name}.log", args.timeout, None)
    if done.exit_code != 0:
        raise RuntimeError(f"{s.name} seed {seed}: exit code {done.exit_code}; see {root / f'{run_dir.name}.log'}")
    run = collect(s, seed, run_dir, params_of(run_dir), args, steps)
    print(f"  {s.name} seed {seed}: val loss {run.val_loss:.4f}, {run.tokens:,} tokens, "
          f"steps {run.steps} ({done.wall_s:.0f} s)", flush=True)
    return run, run_dir


def main() -> None:
    args = parse_args()
    root = work_root(args.work_dir, "bench-quality-")
    began = time.monotonic()
    runs: list[Run] = []
    order = [n for n in SETTINGS if n in args.settings]  # diloco before het-1:3 before single-fast
    for seed in args.seeds:
        round_s, fast_steps = None, args.steps
        for name in order:
            s = SETTINGS[name]
            if s.time_paced and round_s is None:
                round_s = 5.0  # no diloco run to match: a short round
            steps = fast_steps if name == "single-fast" else args.steps
            run, run_dir = run_one(args, root, s, seed, steps, round_s)
            runs.append(run)
            if name == "diloco":
                round_s = median_round_s(run_dir)
            if name == "het-1:3":
                fast_steps = run.steps[0]
    table = summarize(runs)
    print_table(table, args)
    print(f"\n{len(runs)} runs in {time.monotonic() - began:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = where_measured(flavor=args.flavor, steps=args.steps, batch_size=args.batch_size, seeds=args.seeds,
                              device=args.device, config=str(args.config), eval_windows=args.eval_windows,
                              eval_offset=args.eval_offset, lr=args.lr or None,
                              outer_lr=args.outer_lr or None)
        args.out.write_text(json.dumps({"meta": meta, "settings": table}, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        plot(table, args.plot, f"{model_name(args)} {args.flavor}: validation loss vs tokens ({len(args.seeds)} seeds)")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    run_main(main)

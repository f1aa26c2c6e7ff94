"""DiLoCo across islands in one process: the same model, data, inner and outer optimizers.

`simulate(cfg, islands)` trains `islands` 1-rank islands in lockstep in this process
and runs the outer step between them exactly as a federation of 1-rank islands does
(round schedule and fragments, token weights, codecs with error feedback, the outer
optimizer, `fragment_update_alpha`, `average_optimizer_state` and its `moments_dtype`,
`adam_federation_batch`), with no lighthouse, sockets or subprocesses. It is what makes a sweep over outer settings
affordable: one run is one process, seconds on a GPU, and many run side by side. A test
checks it against the real federation. Any model family trains here: the task
(tasks.py) supplies the data, the model, the loss (a mixture of experts' balancing loss
included) and the held-out metrics, as it does for the trainer.

With `islands = 1`, fault tolerance off and `ranks = N`, it is the DDP baseline: one
model, the batch cut into N ranks' shares, the gradients averaged, and each emulated rank
keeping its own BatchNorm running statistics, averaged before an evaluation (what a DDP
island of N ranks does; for models without BatchNorm it equals one rank with the whole
batch, up to rounding).

The outer loops between the islands (synchronous and decoupled rounds) are in
simulated_rounds.py; bench scripts that vary them replace `_Outer` or `_Decoupled` here.

Left out on purpose: faults and healing, time pacing, the guard (honest islands
never trip it), multi-rank islands in a federation (an island's pseudo-gradient does not
depend on how it is sharded).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from archipelago.config import Config
from archipelago.federation.codecs import Codec
from archipelago.federation.fragments import split_fragments
from archipelago.federation.inner_state import state_keys
from archipelago.island.optim import build_lr_scheduler, build_optimizer, set_schedule_position
from archipelago.island.parallelize import compute_dtype
from archipelago.simulated_rounds import Decoupled as _Decoupled  # bench scripts replace them here
from archipelago.simulated_rounds import Outer as _Outer
from archipelago.simulated_rounds import decoupled_delays
from archipelago.tasks import Task, build_task


@dataclass
class SimPoint:
    """One evaluation: after `step` inner steps of every island, `tokens` in all."""

    step: int
    tokens: int
    val_loss: float
    metrics: dict[str, float] = field(default_factory=dict)  # the task's: val_loss, val_accuracy, ...


@dataclass
class SimResult:
    points: list[SimPoint] = field(default_factory=list)
    bytes_sent: int = 0  # payload bytes all islands handed to the exchange (as the meter counts)
    inner_steps: list[int] = field(default_factory=list)  # each island's inner steps
    models: list[nn.Module] = field(default_factory=list)  # the islands' models at the end
    staleness: list[int] = field(default_factory=list)  # decoupled rounds: of every contribution that entered
    dropped: int = 0  # decoupled rounds: contributions left out as too stale

    @property
    def final(self) -> SimPoint:
        return self.points[-1]


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The model's floating-point buffers (BatchNorm's running mean and variance), in order."""
    return [b for b in model.buffers() if b.is_floating_point()]


class _Island:
    """One island: its model, inner optimizer, schedule and data shard. With `ranks` > 1 it
    emulates a DDP island of that many ranks (see the module docstring)."""

    def __init__(self, cfg: Config, task: Task, model: nn.Module, index: int, count: int,
                 device: torch.device, ranks: int = 1) -> None:
        t = cfg.training
        self.model, self.task = model, task
        ft = cfg.fault_tolerance
        scaled = ft.enable and ft.adam_federation_batch
        self.optimizer = build_optimizer(model, cfg.optimizer, device, batch_scaled=scaled)
        if scaled:  # equal islands: the federation's batch is `count` times the island's
            self.optimizer.batch_ratio = float(count)  # type: ignore[attr-defined]
        self.scheduler = build_lr_scheduler(self.optimizer, t.steps, cfg.lr_scheduler)
        quiet: Callable[[str], None] = lambda _m: None  # noqa: E731
        self.loaders = [task.train_loader(r, ranks, index, count, quiet) for r in range(ranks)]
        # Each emulated rank's own running statistics (rank 0's live in the model).
        self.rank_stats = [[b.clone() for b in running_stats(model)] for _ in range(ranks - 1)]
        self.device, self.max_norm = device, t.max_norm
        self.dtype = compute_dtype(t.mixed_precision, device)
        n = cfg.fault_tolerance.num_fragments if cfg.fault_tolerance.semi_sync_method == "diloco" else 1
        self.fragments = split_fragments(model, n)
        self.fragment_tokens = [0] * n
        self.codecs: list[Codec] = []
        self.steps = 0

    def autocast(self):  # noqa: ANN201 - a context manager
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train_step(self) -> None:
        """One inner step, as the trainer's `train_step` (one micro-batch per rank)."""
        self.steps += 1
        ranks = len(self.loaders)
        for r, loader in enumerate(self.loaders):
            x, y = (t.to(self.device) for t in loader.next_batch())
            self._swap_stats(r)
            with self.autocast():
                outputs = self.model(x)
                loss = self.task.loss(outputs, y)
            aux = self.task.auxiliary_loss(self.model)
            loss = loss if aux is None else loss + aux
            (loss if ranks == 1 else loss / ranks).backward()  # DDP averages the ranks' gradients
            self._swap_stats(r)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm or float("inf"), foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @torch.no_grad()
    def _swap_stats(self, rank: int) -> None:
        """Exchange the model's running statistics with emulated rank `rank`'s (0: no-op)."""
        if rank == 0:
            return
        for live, kept in zip(running_stats(self.model), self.rank_stats[rank - 1]):
            held = live.clone()
            live.copy_(kept)
            kept.copy_(held)

    @torch.no_grad()
    def average_rank_stats(self) -> None:
        """Every emulated rank's running statistics set to their mean (the trainer's
        `average_buffers` before an evaluation)."""
        if not self.rank_stats:
            return
        for k, live in enumerate(running_stats(self.model)):
            mean = torch.stack([live.float(), *(s[k].float() for s in self.rank_stats)]).mean(0)
            for t in (live, *(s[k] for s in self.rank_stats)):
                t.copy_(mean)

    def flat(self, fragment: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.fragments[fragment]])

    def moments(self, fragment: int) -> list[torch.Tensor]:
        """The fragment's optimizer moments, one flat vector per state key."""
        return [torch.cat([self.optimizer.state[p][key].reshape(-1).float() for p in self.fragments[fragment]])
                for key in state_keys(self.optimizer)]

    def write_moments(self, fragment: int, flats: list[torch.Tensor]) -> None:
        for key, flat in zip(state_keys(self.optimizer), flats):
            _unflatten_into([self.optimizer.state[p][key] for p in self.fragments[fragment]], flat)

    def write(self, fragment: int, flat: torch.Tensor) -> None:
        _unflatten_into(self.fragments[fragment], flat)


@torch.no_grad()
def _unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of `flat` into `tensors`, in order."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _initial_model(cfg: Config, vocab_size: int, device: torch.device) -> nn.Module:
    """The trainer's initialisation of a language model: built on meta, initialised on CPU
    from the seed (kept for the tests' reference weights; `simulate` asks the task)."""
    from archipelago.models import build_model, get_model_args

    args = get_model_args(cfg.model.name, cfg.model.flavor, vocab_size=vocab_size)
    torch.manual_seed(cfg.training.seed)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=cfg.training.seed)
    return model.to(device)


def evaluation_task(cfg: Config, windows: int) -> Task:
    """The task evaluating `windows` held-out windows (images), from `training.val_offset`
    on, in batches of 32, whatever the run's batch size, so every run of a comparison sees
    the same ones."""
    batch = min(windows, 32)
    t = replace(cfg.training, batch_size=batch, val_batches=max(1, windows // batch))
    return build_task(replace(cfg, training=t))


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The task's held-out metrics of `model` (`val_loss` first) on `task`'s validation batches."""
    model.eval()
    sums: torch.Tensor | None = None
    for x, y in task.validation_batches(0, 1):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            outputs = model(x)
        batch = task.eval_sums(outputs, y).cpu()
        sums = batch if sums is None else sums + batch
    model.train()
    assert sums is not None, "no held-out batches"
    return task.eval_metrics(sums)


def simulate(cfg: Config, islands: int, device: str | torch.device = "cpu", eval_windows: int = 256,
             eval_every: int | None = None, log: Callable[[str], None] | None = None, ranks: int = 1,
             slow_period: int = 0, link_ticks: Sequence[int] | None = None,
             wall_ticks: int = 0, handoff_delays: Sequence[int] | None = None, drain: bool = True) -> SimResult:
    """Train `islands` islands of `cfg` for `cfg.training.steps` inner steps each.

    With `fault_tolerance.enable` they meet in outer steps; without it (one island) this
    is plain training, and with `ranks` > 1 a DDP island of that many ranks. Evaluates
    island 0 every `eval_every` steps (default `training.val_every`) and at the end, on
    `eval_windows` held-out windows (images).
    `slow_period` P > 1 emulates time-paced rounds with a slow last island, deterministically:
    a round lasts `sync_steps` ticks, the other islands step at every tick and the last one
    at every P-th (P times slower), contributions are weighted by the tokens each trained,
    every island's learning-rate schedule follows the federation's progress (its tokens over
    one island's tokens per step x islands), and training stops at the first round end at
    which the federation has trained `islands x training.steps` steps' tokens, as a
    time-paced federation stops at its token budget. Evaluation points count ticks.
    `link_ticks[i]`: the ticks island i's exchange takes over its link. A synchronous round
    then idles every island for the slowest one's ticks after each round; in decoupled rounds
    (`fault_tolerance.round_mode`) the exchange is waited for only when it is short
    (`overlap_threshold`), else it overlaps the next round, and a thin island's the next
    ceil(link_ticks[i] / sync_steps) rounds (`decoupled_delays`; `handoff_delays` gives the
    delays directly, 0 = synchronous, with no waiting). `wall_ticks` T > 0 stops at tick
    T instead of a token budget (equal wall-clock), every schedule following the ticks.
    `drain` (decoupled rounds): the contributions still in flight at the end enter before
    the last evaluation, as the platform's islands let them in (False: left out).
    """
    device = torch.device(device)
    t = cfg.training
    if ranks > 1 and (islands > 1 or cfg.fault_tolerance.enable):
        raise ValueError("ranks > 1 emulates a DDP island: one island, fault tolerance off")
    if t.batch_size % ranks:
        raise ValueError(f"training.batch_size {t.batch_size} does not split over {ranks} ranks")
    if slow_period > 1 and (islands < 2 or not cfg.fault_tolerance.enable or cfg.fault_tolerance.num_fragments > 1):
        raise ValueError("slow_period emulates a slow island of a federation: 2+ islands, one fragment")
    task = build_task(cfg)
    task.prepare(log=lambda _m: None)
    judge = evaluation_task(cfg, eval_windows)
    judge.prepare(log=lambda _m: None)
    first = task.build_model().module.to(device)
    models = [first] + [copy.deepcopy(first) for _ in range(islands - 1)]  # init_sync: one start
    crew = [_Island(cfg, task, m, i, islands, device, ranks) for i, m in enumerate(models)]
    ft = cfg.fault_tolerance
    links = list(link_ticks or [0] * islands)
    outer: _Outer | _Decoupled | None = None
    pause = max(links)  # a synchronous round waits for its slowest exchange
    if ft.enable and ft.round_mode == "decoupled":
        delays, pause = decoupled_delays(links, ft.sync_steps, ft.overlap_threshold)
        if handoff_delays is not None:
            delays, pause = list(handoff_delays), 0
        outer = _Decoupled(cfg, crew, delays)
    elif ft.enable:
        outer = _Outer(cfg, crew)
    tokens_per_step = t.batch_size * task.tokens_per_sample
    every = t.val_every if eval_every is None else eval_every
    result = SimResult()

    def point(step: int) -> None:
        crew[0].average_rank_stats()
        metrics = evaluate(crew[0].model, judge, device, crew[0].dtype)
        trained = sum(island.steps for island in crew) * tokens_per_step
        result.points.append(SimPoint(step, trained, metrics["val_loss"], metrics))
        if log is not None:
            log(f"step {step}: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items()))

    def last_point(step: int) -> None:
        if drain and isinstance(outer, _Decoupled):
            outer.finish()
        point(step)

    point(0)
    if slow_period > 1 or wall_ticks or any(links):
        assert outer is not None, "a clock of ticks needs a federation"
        _train_ticks(crew, outer, t.steps, max(slow_period, 1), tokens_per_step, every, point, last_point, pause,
                     wall_ticks)
    else:
        for step in range(1, t.steps + 1):
            for island in crew:
                island.train_step()
            if outer is not None:
                outer.after_inner_step([tokens_per_step] * islands)
            if step == t.steps:
                last_point(step)
            elif every and step % every == 0:
                point(step)
    result.bytes_sent = outer.bytes_sent if outer is not None else 0
    if isinstance(outer, _Decoupled):
        result.staleness, result.dropped = outer.staleness, outer.dropped
    result.inner_steps = [island.steps for island in crew]
    result.models = [island.model for island in crew]
    return result


def _train_ticks(crew: list[_Island], outer: _Outer | _Decoupled, steps: int, period: int, tokens_per_step: int,
                 every: int, point: Callable[[int], None], last_point: Callable[[int], None], pause: int = 0,
                 wall_ticks: int = 0) -> None:
    """`simulate`'s clock: ticks until the federation's token budget (or tick `wall_ticks`),
    the last island stepping every `period`-th tick, every island idle for `pause` ticks
    after each round (a synchronous exchange); schedules follow the federation's progress
    (or the ticks)."""
    budget = steps * len(crew)  # in island-steps, as the platform's token budget
    tick = idle = 0
    while True:
        tick += 1
        trained = [0] * len(crew)
        if idle:
            idle -= 1
        else:
            for i, island in enumerate(crew):
                if i < len(crew) - 1 or tick % period == 0:
                    island.train_step()
                    trained[i] = tokens_per_step
            progress = (steps * tick / wall_ticks if wall_ticks
                        else sum(island.steps for island in crew) / len(crew))
            for island in crew:
                set_schedule_position(island.scheduler, min(steps, progress))  # capped at the budget
            outer.after_inner_step(trained)
            if outer.local_step == 0:  # a round just ended
                idle = pause
        ended = outer.local_step == 0 and not idle
        done = tick >= wall_ticks if wall_ticks else ended and sum(island.steps for island in crew) >= budget
        if done:
            last_point(tick)
            return
        if every and tick % every == 0:
            point(tick)

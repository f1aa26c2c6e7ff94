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

Left out on purpose: faults and healing, time pacing, the guard (honest islands
never trip it), multi-rank islands in a federation (an island's pseudo-gradient does not
depend on how it is sharded).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from archipelago.config import Config
from archipelago.federation.codecs import Codec, build_codec, effective_codec
from archipelago.federation.exchange import Framing, summed_as_received
from archipelago.federation.fragments import split_fragments
from archipelago.federation.inner_state import WIRE_DTYPES, state_keys
from archipelago.federation.outer_core import Carried, OuterCore
from archipelago.island.optim import build_lr_scheduler, build_optimizer, set_schedule_position
from archipelago.island.parallelize import compute_dtype
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


def _wire(island: _Island, fragment: int, pseudo: torch.Tensor, codec_name: str) -> tuple[torch.Tensor, int]:
    """The pseudo-gradient as every receiver decodes it, and its row's bytes (tokens and
    weight, then the payload)."""
    payload = 4 * pseudo.numel()
    if codec_name != "fp32":
        codec = island.codecs[fragment]
        pseudo = codec.decode(codec.encode(pseudo))
        payload = codec.payload_bytes()
    return pseudo, Framing().row_bytes(payload)


def _as_received(codec_name: str, island: _Island, fragment: int, total: torch.Tensor,
                 participants: int) -> torch.Tensor:
    """An exchange's weighted sum as every island receives it (`exchange.summed_as_received`:
    the reduce-scatter rounds each summed segment again)."""
    if codec_name == "fp32":
        return total
    return summed_as_received(island.codecs[fragment], total, participants)


class _Outer:
    """The outer loop between the simulated islands (OuterLoop's semantics, in lockstep)."""

    def __init__(self, cfg: Config, islands: list[_Island]) -> None:
        self.ft, self.islands = cfg.fault_tolerance, islands
        n = len(islands[0].fragments)
        self.core = OuterCore(self.ft, [islands[0].flat(f) for f in range(n)])
        self.globals = self.core.globals
        self.codec = effective_codec(self.ft)
        if self.codec == "auto":
            raise ValueError("codec = \"auto\" chooses by the link between islands, which this in-process "
                             "simulator has none of: give the codec to compare (fp32, bf16, int8 or topk)")
        for island in islands:
            island.codecs = [build_codec(self.ft, g.numel()) for g in self.globals]
        self.per_fragment = self.ft.sync_steps // n
        # The platform's join round is outer step 1 (it synchronises fragment 0, with nothing
        # in it), so its first round of training synchronises fragment 1 % fragments: count it.
        self.local_step, self.step = 0, 1
        self.pending: tuple[int, torch.Tensor, float] = (0, torch.zeros(0), 0.0)  # set by prepare()
        self.pending_moments: list[torch.Tensor] = []  # average_optimizer_state: weighted sums
        self.round_tokens: list[int] = []  # each island's tokens in the round prepare() took
        self.bytes_sent = 0

    def after_inner_step(self, tokens: Sequence[int]) -> None:
        """One tick of the round's clock, `tokens[i]` trained by island i in it."""
        for island, trained in zip(self.islands, tokens):
            island.fragment_tokens = [t + trained for t in island.fragment_tokens]
        self.local_step += 1
        length = self.round_length()
        if self.local_step == length - self.ft.fragment_sync_delay:
            self.prepare()
        if self.local_step == length:
            self.local_step = 0
            self.perform()

    def round_length(self) -> int:
        """Inner steps in the current round (bench/outer_sweep.py's experiments vary it)."""
        return self.per_fragment

    def prepare(self) -> None:
        """Each island's weighted pseudo-gradient, encoded and decoded, summed in island order."""
        fragment = self.core.fragment(self.step)
        values, weights, self.round_tokens = [], [], []
        for island in self.islands:
            pseudo = self.core.pseudo_gradient(fragment, island.flat(fragment))
            weight, _ = self.core.weight(island.fragment_tokens[fragment], contributes=True)
            self.round_tokens.append(island.fragment_tokens[fragment])
            island.fragment_tokens[fragment] = 0
            decoded, sent = _wire(island, fragment, pseudo, self.codec)
            self.bytes_sent += sent
            values.append(decoded)
            weights.append(weight)
            if self.ft.average_optimizer_state:  # rounded to the wire's type, as every receiver sees them
                wire = WIRE_DTYPES[self.ft.moments_dtype]
                moments = [m.to(wire).float() * weight for m in island.moments(fragment)]
                self.pending_moments = (moments if island is self.islands[0] else
                                        [a + b for a, b in zip(self.pending_moments, moments)])
                size = torch.finfo(wire).bits // 8 * sum(m.numel() for m in moments)
                self.bytes_sent += Framing().row_bytes(size)  # their row
        total = _as_received(self.codec, self.islands[0], fragment, self.core.merge(values, weights), len(self.islands))
        self.pending = (fragment, total, sum(weights))

    @torch.no_grad()
    def perform(self) -> None:
        fragment, total, weights = self.pending
        self.core.apply(fragment, total, weights)
        self.step += 1
        for island in self.islands:
            island.write(fragment, self.core.island_weights(fragment, island.flat(fragment)))
        if self.ft.average_optimizer_state and weights > 0:
            for island in self.islands:
                island.write_moments(fragment, [m / weights for m in self.pending_moments])
        if self.ft.adam_federation_batch:  # the federation's tokens per own token, as the platform's
            for island, own in zip(self.islands, self.round_tokens):
                if own:
                    island.optimizer.batch_ratio = max(1.0, sum(self.round_tokens) / own)  # type: ignore[attr-defined]


@dataclass(eq=False)  # compared by identity (its tensors have no truth value)
class _HandOff:
    """A pseudo-gradient handed off and not yet entered (decoupled rounds); a thin island's
    upload until the member carrying it folds it into its own row (`carried`)."""

    entry: int          # the round boundary at which it enters an outer step (an upload: reaches its carrier)
    island: int
    values: torch.Tensor
    tokens: float
    base_step: int      # the outer steps applied when the island took its base weights
    raw: torch.Tensor   # its pseudo-gradient before the codec (the island's own progress)
    carried: list[_HandOff] = field(default_factory=list)  # thin islands' uploads folded into this row
    own: bool = True    # False: a row sent only to carry uploads (the end of the run)


class _Decoupled:
    """Decoupled rounds between the simulated islands (fault_tolerance.round_mode = "decoupled").

    At every round boundary (each `sync_steps` ticks), in this order: each island whose cycle
    ends hands off its pseudo-gradient (its base weights - its weights), to enter `delays[i]`
    boundaries later (0: at once, as in a synchronous round; 1: the exchange overlaps the next
    round); the contributions due enter one outer step, each discounted by its staleness (the
    outer steps applied since its base); the islands that handed off continue from the new
    global weights minus their own pseudo-gradients still in flight (`OuterCore.rebased`:
    their own progress is not lost while it travels; `eager` False drops it until it
    enters). With every delay 0 this is the synchronous round, bit for bit. With
    `arrival_steps` N > 0 an overlapping exchange (delay 1) enters N inner steps into the next
    round instead, and the islands whose rows entered move to the new global weights plus
    their progress since the hand-off: their next rows start from that outer step.

    A thin island (delay d > 1) is no member of the exchange: every d rounds it uploads its
    row (encoded with its own codec) to a member, the first island with delay 0 or 1, where it
    arrives d rounds later (its link's time); that member folds every upload that has arrived
    into its next row (`OuterCore.fold`, each upload discounted by its own staleness) before
    encoding it, so the upload enters d rounds after it was handed off with a carrier that
    waits for its exchange (delay 0), d + 1 with one whose exchange overlaps the next round.
    At the end of the run uploads still travelling go in one last row of their carrier. The
    quality simulator leaves out that a thin island's download of the global weights also
    takes time (the scale simulator charges it).
    """

    def __init__(self, cfg: Config, islands: list[_Island], delays: Sequence[int], eager: bool = True) -> None:
        self.ft, self.islands, self.delays, self.eager = cfg.fault_tolerance, islands, list(delays), eager
        self.arrival = self.ft.arrival_steps
        if not 0 <= self.arrival < self.ft.sync_steps:
            raise ValueError(f"arrival_steps {self.arrival}: from 0 (the next round's end) to sync_steps - 1")
        if len(islands[0].fragments) != 1:
            raise ValueError("decoupled rounds synchronise the whole model at once: num_fragments = 1")
        if self.ft.average_optimizer_state or self.ft.adam_federation_batch:
            raise ValueError("decoupled rounds exchange pseudo-gradients only: set average_optimizer_state and "
                             "adam_federation_batch to false (compare against a synchronous run without them)")
        members = [k for k, d in enumerate(self.delays) if d <= 1]
        if not members:
            raise ValueError("every island has a thin link (delay > 1): at least one member must carry their rows")
        self.carrier = members[0]
        self.core = OuterCore(self.ft, [islands[0].flat(0)])
        self.codec = effective_codec(self.ft)
        if self.codec == "auto":
            raise ValueError("codec = \"auto\" needs links between islands: give the codec to compare")
        for island in islands:
            island.codecs = [build_codec(self.ft, self.core.globals[0].numel())]
        self.bases = [self.core.globals[0].detach().clone() for _ in islands]  # the weights each started from
        self.base_steps = [0] * len(islands)
        self.tokens = [0] * len(islands)
        self.in_flight: list[_HandOff] = []
        self.uploads: list[_HandOff] = []  # thin islands' rows not yet folded into a member's
        self.local_step, self.boundary, self.step, self.bytes_sent = 0, 0, 0, 0
        self.staleness: list[int] = []  # of every contribution that entered
        self.dropped = 0                # contributions staler than max_staleness

    def after_inner_step(self, tokens: Sequence[int]) -> None:
        for k, trained in enumerate(tokens):
            self.tokens[k] += trained
        self.local_step += 1
        if self.local_step == self.arrival:
            self.arrive()
        if self.local_step == self.ft.sync_steps:
            self.local_step = 0
            self.round_boundary()

    def arrive(self) -> None:
        """`arrival_steps` inner steps into a round: the members' rows handed off at its start enter
        now, and each island whose own row entered moves to the new global weights plus its
        progress since the hand-off (its next row starts from this outer step)."""
        due = [h for h in self.in_flight if h.entry == self.boundary + 1]
        if not due:
            return
        self.boundary += 1  # enter_due takes the rows due at a boundary
        self.enter_due()
        self.boundary -= 1
        for k in sorted({h.island for h in due if h.own}):
            new = self.core.rebased(0, self.own_in_flight(k))
            self.islands[k].write(0, self.islands[k].flat(0) - self.bases[k] + new)
            self.bases[k], self.base_steps[k] = new.clone(), self.step

    def round_boundary(self) -> None:
        self.boundary += 1
        handing = [k for k, d in enumerate(self.delays) if self.boundary % max(d, 1) == 0]
        for k in handing:
            if self.delays[k] > 1:
                self.upload(k)
        for k in handing:  # waited for: enters now
            if self.delays[k] == 0:
                self.hand_off(k)
        self.enter_due()
        for k in handing:  # overlaps the next round; its staleness is known once this step is
            if self.delays[k] == 1:
                self.hand_off(k)
        for k in handing:  # the new global weights, plus its own progress not in them yet
            weights = self.core.rebased(0, self.own_in_flight(k) if self.eager else [])
            self.islands[k].write(0, weights)
            self.bases[k] = weights.clone()
            self.base_steps[k] = self.step

    def upload(self, k: int) -> None:
        """A thin island's row, encoded with its own codec, on its way to its carrier."""
        pseudo = self.core.pseudo_gradient(0, self.islands[k].flat(0), base=self.bases[k])
        values, sent = _wire(self.islands[k], 0, pseudo, self.codec)
        self.bytes_sent += sent
        self.uploads.append(_HandOff(self.boundary + self.delays[k], k, values, self.tokens[k],
                                     self.base_steps[k], pseudo))
        self.tokens[k] = 0

    def hand_off(self, k: int, own: bool = True) -> None:
        """A member's row, with the uploads that reached it folded in, into the exchange."""
        pseudo = (self.core.pseudo_gradient(0, self.islands[k].flat(0), base=self.bases[k]) if own
                  else torch.zeros_like(self.core.globals[0].detach()))
        tokens, base_step = (self.tokens[k], self.base_steps[k]) if own else (0, self.step)
        arrived = [u for u in self.uploads if k == self.carrier and (not own or u.entry <= self.boundary)]
        self.uploads = [u for u in self.uploads if u not in arrived]
        row, folded = self.core.fold(pseudo, tokens, self.step - base_step, [self.carried(u) for u in arrived])
        values, sent = _wire(self.islands[k], 0, row, self.codec)
        self.bytes_sent += sent
        entry = self.boundary + (min(self.delays[k], 1) if own else 1)
        self.in_flight.append(_HandOff(entry, k, values, folded, base_step, pseudo, arrived, own))
        if own:
            self.tokens[k] = 0

    def carried(self, upload: _HandOff) -> Carried:
        """An upload as its carrier folds it in now (its staleness when the row enters)."""
        return Carried(upload.values, upload.tokens, self.step - upload.base_step)

    def carry_the_rest(self) -> None:
        """Uploads still travelling at the end go in one last row of their carrier."""
        if self.uploads:
            self.hand_off(self.carrier, own=False)

    def own_in_flight(self, k: int) -> list[torch.Tensor]:
        """Island k's pseudo-gradients that have not entered yet (handed off, uploaded, carried)."""
        rows = [h for h in self.in_flight if h.island == k and h.own] + [u for u in self.uploads if u.island == k]
        rows += [c for h in self.in_flight for c in h.carried if c.island == k]
        return [h.raw for h in rows]

    def finish(self) -> None:
        """The end of the run (the platform's `OuterLoop.finish_rounds`): the uploads still
        travelling are carried in, everything in flight enters one outer step, and every
        island takes the global weights."""
        self.carry_the_rest()
        self.enter_due(everything=True)
        for island in self.islands:
            island.write(0, self.core.globals[0].detach().clone())

    def enter_due(self, everything: bool = False) -> None:
        due = sorted((h for h in self.in_flight if everything or h.entry == self.boundary), key=lambda h: h.island)
        self.in_flight = [h for h in self.in_flight if not (everything or h.entry == self.boundary)]
        values, weights, divisor = [], [], 0.0
        for h in due:
            weight, undiscounted = self.core.weight(h.tokens, True, staleness=self.step - h.base_step)
            self.count_entered(h, entered=weight > 0)
            if not weight:
                continue
            values.append(h.values)
            weights.append(weight)
            divisor += undiscounted
        if not values:
            return
        members = sum(d <= 1 for d in self.delays)  # a thin island's row is carried by a member
        total = _as_received(self.codec, self.islands[0], 0, self.core.merge(values, weights), members)
        if self.core.apply(0, total, divisor):
            self.step += 1

    def count_entered(self, h: _HandOff, entered: bool) -> None:
        """Record the staleness of each contribution in `h` (its own, those it carried), or
        count it dropped."""
        rows = ([h] if h.own else []) + h.carried
        for row in rows:
            staleness = self.step - row.base_step
            if entered and self.core.discount(staleness) > 0 and (row.tokens > 0 or row is h):
                self.staleness.append(staleness)
            else:
                self.dropped += 1


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


def decoupled_delays(link_ticks: Sequence[int], round_ticks: int, threshold: float) -> tuple[list[int], int]:
    """Decoupled rounds in ticks: (each island's hand-off delay in rounds, the ticks every
    island waits after a round). Islands whose exchange fits in a round are members: when
    the slowest member's exchange takes at most `threshold` of the round they wait for it
    (delay 0, as a synchronous round), else it overlaps the next round (delay 1). A thin
    island's exchange spans ceil(ticks / round) rounds (its delay and its cycle)."""
    members = [t for t in link_ticks if t <= round_ticks]
    slowest = max(members, default=0)
    waits = threshold > 0 and slowest <= threshold * round_ticks  # 0: always overlap
    delays = [(0 if waits else 1) if t <= round_ticks else math.ceil(t / round_ticks) for t in link_ticks]
    return delays, slowest if waits else 0


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

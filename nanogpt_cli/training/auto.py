"""--preset auto: a run sized to a dataset, a time and this device. A short timed probe measures the device at a few
candidate shapes; fixed rules (below, and in benchmarks/README.md, "How auto sizes a run") turn the dataset's
figures, the time and the probe's speeds into the model's shape, the batch, the learning rates and the schedule.

    choice = choose(DataFigures.of(meta), budget_s=1200, speeds=probe(...)); choice.values  # config values
    choose(figures, 120, {2: 41_000.0, 4: 22_000.0})   # deterministic given the probe's figures (tokens/s by depth)

The probe is the only part that measures anything; `choose` is a pure function of its inputs, so the rules are
tested without timing. Values the user gives stay theirs: the rules read them (a given --n-layer sets the width
that follows from it) and the table marks them "given".
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanogpt_cli.config import PRESETS
from nanogpt_cli.errors import NanoGPTError

AUTO = "auto"
# the depths auto chooses among; width, heads and context follow from the depth (width_for, context_for)
DEPTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24)
HEAD_DIM = 64
# the block and optimizer choices of cpu-fast, tuned on this CPU (benchmarks/README.md, "How the CPU presets were
# tuned"): Muon on the block matrices, QK-norm, squared ReLU, soft-capped logits, zero-initialised projections, an
# untied embedding at its own rate, and a warmup-stable-decay schedule decaying over its last 70 %
RECIPE: dict[str, Any] = {
    k: PRESETS["cpu-fast"][k]
    for k in (
        "qk_norm",
        "mlp",
        "logit_softcap",
        "zero_init_proj",
        "tie_embeddings",
        "optimizer",
        "muon_lr",
        "muon_momentum",
        "lr_schedule",
        "wsd_decay_frac",
        "beta2",
        "eval_first",
    )
}
# the share of --max-time left for training after the evaluations and the first, slow updates
TRAINING_SHARE = 0.92
# updates a run aims at: more are worth more than larger batches at these sizes, until the batch is too small to
# keep the device busy or to give a useful gradient (MIN_ROWS, MIN_BATCH_TOKENS)
TARGET_UPDATES = 1000
# windows an update holds at least: on a CPU 16, as both CPU presets train (cpu-speedrun 16 x 64, cpu-fast 16 x 128);
# a 2-minute run on Russian text with 4 x 128 tokens an update lost 3.3 % to cpu-speedrun's 16 x 64
MIN_ROWS = {"cpu": 16, "cuda": 4, "mps": 4}
MIN_BATCH_TOKENS = {"cpu": 1024, "cuda": 512, "mps": 512}  # cpu-speedrun's 1,024 on a CPU
MIN_CONTEXT = 64
# passes over the train split a run plans at most: repeated tokens are worth nearly fresh ones up to about 4 passes and
# little after (Muennighoff et al., 2023, "Scaling Data-Constrained Language Models"); a 10-minute run on a 99k-token
# split read it 17.7 times and ended worse than a 2-minute one (val loss lowest after ~7 passes, rising after)
MAX_PASSES = 4
# where the time holds more than MAX_PASSES, a larger model makes use of it, down to this many tokens per block
# parameter: on that Russian split at 2 minutes (4 passes), 6x192 (0.14 per parameter) and 4x128 (0.5) beat 2x128 (1.0)
# by 2 %
MIN_DATA_RATIO = 0.1
# the tokens of one micro-batch, at most (more are accumulated): memory, and no speed gained beyond on a CPU
MICRO_TOKENS = {"cpu": 16_384, "cuda": 131_072, "mps": 32_768}
PROBE_DEPTHS = {"cpu": (2, 4, 8), "cuda": (4, 8, 16), "mps": (2, 4, 8)}
PROBE_SECONDS = 1.5  # at most, per shape, after one warm-up update
SPEEDS_ENV = "NANOGPT_AUTO_SPEEDS"  # `train --nproc`: the launcher's probe, for the processes it starts


def width_for(depth: int) -> int:
    """The residual width of a depth: 32 per layer, rounded up to a multiple of the head size, at least 128 (nanochat
    keeps 64 per layer at GPT-2 scale; on the CPU, cpu-fast's sweep found 2 and 3 layers of 128 best in its time and
    wider or deeper ones worse: benchmarks/README.md)."""
    return max(2 * HEAD_DIM, -(-32 * depth // HEAD_DIM) * HEAD_DIM)


def context_for(width: int, doc_tokens: float) -> int:
    """The context: the power of two that holds a mean document, from 64 up to the width's power of two (a
    narrow model gains little from long contexts, whose attention it pays for), at most 1,024."""
    cap = min(1024, 1 << int(math.log2(width)))
    want = 1 << max(6, math.ceil(math.log2(max(doc_tokens, 1))))
    return max(64, min(want, cap))


def tokens_per_parameter(budget_s: float) -> float:
    """The training tokens per non-embedding parameter to aim at. cpu-fast's sweep (about 2 minutes of this CPU) was
    best at 3.4-7 (3 layers of 128 on 2M tokens, 2 layers on 2.7M; 6 layers at 0.8 were worse): 5 at 2 minutes,
    rising with the time as (minutes / 2) ** 0.3 to Chinchilla's 20 at about 3.5 hours, and no further."""
    minutes = max(budget_s / 60, 0.1)
    return min(20.0, max(2.0, 5.0 * (minutes / 2) ** 0.3))


def flops_per_token(depth: int, width: int, vocab: int, context: int) -> float:
    """Training FLOPs per token of the recipe's model: 6 per weight of the blocks (12 width^2 a layer) and of the
    untied head, plus attention's 12 * width * context a layer (GPT.flops_per_token's count)."""
    return 6.0 * (12 * depth * width * width + vocab * width) + 12.0 * depth * width * context


@dataclass
class DataFigures:
    """What auto reads of a prepared dataset."""

    train_tokens: int
    vocab_size: int
    doc_tokens: float  # a document's mean length in tokens
    name: str = ""

    @classmethod
    def of(cls, meta: dict[str, Any]) -> DataFigures:
        tokens = meta["train_tokens"] + meta.get("val_tokens", 0)
        docs = max(1, meta.get("documents") or 1)
        return cls(meta["train_tokens"], meta["vocab_size"], tokens / docs, meta.get("name", ""))


@dataclass
class Row:
    """One line of auto's table: a setting, its value and why."""

    name: str  # the config field
    value: Any
    why: str
    given: bool = False


@dataclass
class AutoChoice:
    values: dict[str, Any]  # config values (the given ones are the user's, unchanged)
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    expected_updates: int = 0
    speeds: dict[int, float] = field(default_factory=dict)  # the probe's tokens/s by depth

    def record(self) -> dict[str, Any]:
        """What config.json keeps of it: which values auto chose, and the probe's figures."""
        return {
            "chosen": sorted(r.name for r in self.rows if not r.given),
            "expected_updates": self.expected_updates,
            "speeds": {str(k): v for k, v in self.speeds.items()},
        }

    def launch_env(self) -> dict[str, str]:
        """What the processes that `train --nproc` starts need in their environment to plan this very run: the
        probe's figures, measured once here (choose is a pure function of them and of what every process reads)."""
        return {SPEEDS_ENV: json.dumps({str(k): v for k, v in self.speeds.items()})}


def speed_at(depth: int, speeds: dict[int, float], vocab: int, doc_tokens: float) -> float:
    """Tokens/s of a depth: measured, or from the FLOP rate of the probed shapes nearest in size (the rate of a
    shape between two probed ones interpolated in log-size, outside them the nearest one's)."""
    if depth in speeds:
        return speeds[depth]

    def size(d: int) -> float:
        w = width_for(d)
        return flops_per_token(d, w, vocab, context_for(w, doc_tokens))

    rates = sorted((size(d), speeds[d] * size(d)) for d in speeds)
    x = size(depth)
    if x <= rates[0][0]:
        rate = rates[0][1]
    elif x >= rates[-1][0]:
        rate = rates[-1][1]
    else:
        for (x0, r0), (x1, r1) in zip(rates, rates[1:]):
            if x0 <= x <= x1:
                t = math.log(x / x0) / math.log(x1 / x0)
                rate = math.exp(math.log(r0) * (1 - t) + math.log(r1) * t)
                break
    return rate / x


class _Rows(list):
    """auto's table as it is built: each value the given one where the user gave it."""

    def __init__(self, given: dict[str, Any]):
        super().__init__()
        self.given = given

    def add(self, name: str, value: Any, why: str) -> Any:
        mine = name in self.given
        self.append(Row(name, self.given[name] if mine else value, "given" if mine else why, mine))
        return self[-1].value


def choose(
    data: DataFigures,
    budget_s: float,
    speeds: dict[int, float],
    given: dict[str, Any] | None = None,
    device: str = "cpu",
    world_size: int = 1,
) -> AutoChoice:
    """The run's values from the dataset's figures, the time (seconds of training), the probe's tokens/s by depth
    (of one process: on CUDA each process has its GPU and the speeds add up; on a CPU they share the cores), the
    values given (kept, and read by the rules) and the processes of the run (the batch counts them all)."""
    if not speeds:
        raise NanoGPTError("--preset auto needs the probe's speed of at least one shape")
    rows = _Rows(dict(given or {}))
    processes = world_size if device == "cuda" else 1
    usable = budget_s * TRAINING_SHARE
    depth, width = _shape(rows, data, budget_s, speeds, processes * usable)
    plain = flops_per_token(depth, width_for(depth), data.vocab_size, context_for(width_for(depth), data.doc_tokens))

    def time_tokens(context: int) -> float:
        """The tokens the time holds at the shape as given (a given width or context changes its speed)."""
        tokens = speed_at(depth, speeds, data.vocab_size, data.doc_tokens) * processes * usable
        return tokens * plain / flops_per_token(depth, width, data.vocab_size, context)

    context, batch_tokens = _batch(rows, data, width, time_tokens, device, world_size)
    tokens = time_tokens(context)
    most = MAX_PASSES * data.train_tokens  # the tokens worth reading in any time (MAX_PASSES)
    planned = min(tokens, most if "max_iters" not in rows.given else rows.given["max_iters"] * batch_tokens)
    updates = max(1, int(planned / batch_tokens))
    _schedule(rows, width, updates, device, planned / max(1, data.train_tokens))
    # a cap far above the estimate where the time limits the run: a probe on a busy machine can read a half or a third
    # of the speed the run gets, and a run that reached its --max-iters first would end before its time; never more
    # than MAX_PASSES over the data, where the schedule then ends (it follows the step or the clock, the further)
    cap = max(1, math.ceil(most / batch_tokens))
    if tokens > most:
        why = f"{MAX_PASSES} passes over the {data.train_tokens:,} training tokens, before the clock (more overfit)"
    else:
        why = f"a cap: the clock ends the run near {updates:,} updates, the schedule with it"
    max_iters = rows.add("max_iters", min(10 * updates, cap), why)
    for name in RECIPE:
        if name in rows.given:
            rows.add(name, None, "")
    values = {**{k: v for k, v in RECIPE.items() if k not in rows.given}, **{r.name: r.value for r in rows}}
    notes = vocabulary_notes(data.vocab_size, depth, width, budget_s)
    if tokens > most and max_iters * batch_tokens <= most + batch_tokens:
        notes.append(
            f"the time holds ~{tokens / data.train_tokens:,.1f} passes over the {data.train_tokens:,} training "
            f"tokens; the run stops after {MAX_PASSES} (~{updates:,} updates), before --max-time: more data, not more "
            "time, would make a better model"
        )
    return AutoChoice(values, list(rows), notes, updates, dict(speeds))


def _shape(
    rows: _Rows, data: DataFigures, budget_s: float, speeds: dict[int, float], seconds: float
) -> tuple[int, int]:
    """Depth, width and heads: (depth, width). The depth is the one whose tokens in the time per parameter come
    nearest the budget's ratio; where the time holds more than MAX_PASSES over the data, the largest that reads them
    all in the time, down to MIN_DATA_RATIO tokens per parameter (the spare time goes to size)."""
    ratio = tokens_per_parameter(budget_s)
    most = MAX_PASSES * data.train_tokens

    def tokens_of(depth: int) -> float:
        speed = speed_at(depth, speeds, data.vocab_size, data.doc_tokens)
        return min(speed * seconds, most)

    def params_of(depth: int) -> int:  # the blocks' (the head's cost is in the probe's speed)
        w = rows.given.get("n_embd") or width_for(depth)
        return 12 * depth * w * w

    best = min(DEPTHS, key=lambda d: abs(math.log(tokens_of(d) / params_of(d) / ratio)))
    speed = speed_at(best, speeds, data.vocab_size, data.doc_tokens)
    read = f"~{tokens_of(best) / 1e6:,.1f}M tokens in the time at {speed:,.0f} tokens/s"
    why = f"{read}: {tokens_of(best) / params_of(best):,.1f} per block parameter, nearest the {ratio:.1f} aimed at"
    fits = [d for d in DEPTHS if speed_at(d, speeds, data.vocab_size, data.doc_tokens) * seconds >= most]
    larger = [d for d in fits if d > best and most / params_of(d) >= MIN_DATA_RATIO]
    if speed * seconds >= most and larger:
        best = max(larger)
        why = (
            f"the largest that reads {MAX_PASSES} passes over the data ({most / 1e6:,.1f}M tokens) in the time, at "
            f"least {MIN_DATA_RATIO} per block parameter ({most / params_of(best):,.2f}): the time holds more"
        )
    depth = rows.add("n_layer", best, why)
    width = rows.add("n_embd", width_for(depth), "32 per layer, a multiple of 64, at least 128")
    heads = rows.add("n_head", max(1, width // HEAD_DIM), f"heads of {HEAD_DIM}")
    assert heads >= 1
    return depth, width


def _batch(
    rows: _Rows, data: DataFigures, width: int, time_tokens: Callable[[int], float], device: str, world_size: int
) -> tuple[int, int]:
    """The context and the batch: tokens per update for about TARGET_UPDATES updates in the time (at most MAX_PASSES
    over the data), a power of two, at least MIN_BATCH_TOKENS and MIN_ROWS windows (the context halved, to MIN_CONTEXT
    at least, to hold them), in micro-batches of at most MICRO_TOKENS, a multiple of the processes. Returns (context,
    tokens an update)."""
    min_rows = MIN_ROWS.get(device, MIN_ROWS["cuda"])
    nominal = context_for(width, data.doc_tokens)
    want = max(
        MIN_BATCH_TOKENS.get(device, MIN_BATCH_TOKENS["cuda"]),
        2 ** round(math.log2(max(min(time_tokens(nominal), MAX_PASSES * data.train_tokens) / TARGET_UPDATES, 1))),
    )
    context = nominal
    while context > MIN_CONTEXT and want // context < min_rows:
        context //= 2
    cap = min(1024, 1 << int(math.log2(width)))
    why = f"documents average {data.doc_tokens:,.0f} tokens; at most {cap} for this width"
    if context < nominal:
        why += f"; {min_rows} windows in an update of {want:,} tokens"
    context = rows.add("block_size", context, why)
    batch_rows = max(min_rows, want // context)
    micro_cap = max(1, MICRO_TOKENS.get(device, MICRO_TOKENS["cpu"]) // context)
    accumulation = rows.given.get("gradient_accumulation_steps") or -(-batch_rows // micro_cap)
    accumulation = -(-accumulation // world_size) * world_size  # every process runs the same share
    micro = rows.given.get("batch_size") or max(1, batch_rows // accumulation)
    batch_tokens = micro * accumulation * context
    updates = max(1, int(min(time_tokens(context), MAX_PASSES * data.train_tokens) / batch_tokens))
    rows.add(
        "batch_size", micro, f"{batch_tokens:,} tokens an update (all processes), ~{updates:,} updates in the time"
    )
    processes = f", a multiple of the {world_size} processes" if world_size > 1 else ""
    rows.add(
        "gradient_accumulation_steps",
        accumulation,
        f"micro-batches of at most {micro_cap * context:,} tokens" + processes,
    )
    return context, batch_tokens


def _schedule(rows: _Rows, width: int, updates: int, device: str, passes: float) -> None:
    """Learning rates (cpu-fast's sweep at width 128, scaled by 1/sqrt(width) for AdamW as nanochat scales them;
    Muon's is width-free), warm-ups, evaluations and dropout."""
    scale = math.sqrt(128 / width)
    rows.add("learning_rate", round(2e-3 * scale, 6), "AdamW (the head): 2e-3 at width 128, times sqrt(128 / width)")
    rows.add("embedding_lr", round(0.06 * scale, 5), "the embedding: 0.06 at width 128, times sqrt(128 / width)")
    rows.add("min_lr", round(1e-4 * scale, 7), "a twentieth of the peak")
    rows.add("warmup_iters", min(500, max(10, updates // 20)), "5 % of the updates")
    rows.add("muon_momentum_warmup", min(300, max(10, updates // 8)), "12 % of the updates")
    rows.add("eval_interval", max(1, updates // 4), "four evaluations, the last at the end")
    rows.add("eval_iters", 10 if device == "cpu" else 20, "batches per evaluation")
    why = f"the data is read ~{passes:,.1f} times; up to {MAX_PASSES} passes, each is about as good as fresh text"
    rows.add("dropout", 0.0, why)


def vocabulary_notes(vocab: int, depth: int, width: int, budget_s: float) -> list[str]:
    """A note where the LM head takes most of each update's compute at the chosen size: a vocabulary too large for
    the time (nothing is refused: the user may want that tokenizer)."""
    head = vocab * width / (12 * depth * width * width + vocab * width)
    if head < 0.5 or vocab < 8192:
        return []
    return [
        f"the {vocab:,}-token vocabulary's head is {head:.0%} of each update's compute at this size "
        f"({depth} layers of {width}); in {budget_s / 60:g} minutes a smaller vocabulary (a BPE of a few thousand "
        "tokens from `nanogpt tokenizer train`; `nanogpt prepare SOURCE --compare` counts them) leaves more of the "
        "time to the blocks"
    ]


# --- the probe: the device's speed at a few shapes ---


@dataclass
class Probed:
    """One shape the probe timed (an event the display shows as it comes)."""

    n_layer: int
    n_embd: int
    block_size: int
    rows: int
    tokens_per_s: float
    seconds: float


def probe(
    data: DataFigures,
    device_name: str = "auto",
    dtype_name: str = "auto",
    on_probe: Callable[[Probed], None] | None = None,
    depths: tuple[int, ...] | None = None,
    seconds: float = PROBE_SECONDS,
    budget_s: float | None = None,
) -> dict[int, float]:
    """Tokens/s of training updates (forward, backward, the recipe's optimizer) on random tokens at a few depths,
    smallest first, each timed for about `seconds` after a warm-up update. It stops early where the rules, given
    the speeds so far and budget_s, would choose a depth below the next one (a larger shape would not be used)."""
    from nanogpt_cli.device import resolve_device

    device = resolve_device(device_name)
    depths = depths or PROBE_DEPTHS.get(device.type, PROBE_DEPTHS["cpu"])
    speeds: dict[int, float] = {}
    for depth in depths:
        probed = _time_shape(data, depth, device_name, dtype_name, seconds)
        speeds[depth] = probed.tokens_per_s
        if on_probe is not None:
            on_probe(probed)
        later = [d for d in depths if d > depth]
        if budget_s is not None and later and choose(data, budget_s, speeds).values["n_layer"] < later[0]:
            break
    return speeds


def _time_shape(data: DataFigures, depth: int, device_name: str, dtype_name: str, seconds: float) -> Probed:
    """The trainer's update (trainer.optimizer_step, one micro-batch) of the recipe's model of `depth`, timed."""
    import torch

    from nanogpt_cli.config import Dtype, build_configs
    from nanogpt_cli.device import autocast_for, resolve_device, resolve_dtype
    from nanogpt_cli.model import GPT
    from nanogpt_cli.training.optim import make_optimizer

    device = resolve_device(device_name)
    width = width_for(depth)
    context = context_for(width, data.doc_tokens)
    rows = max(MIN_ROWS.get(device.type, MIN_ROWS["cuda"]), MICRO_TOKENS["cpu"] // 4 // context)
    values = dict(RECIPE, n_layer=depth, n_embd=width, n_head=max(1, width // HEAD_DIM), block_size=context)
    model_cfg, train_cfg = build_configs(dict(values, vocab_size=data.vocab_size, device=device_name))
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    optimizer = make_optimizer(model, train_cfg, device)
    dtype = resolve_dtype(Dtype(dtype_name), device, model_cfg, rows, context)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    x = torch.randint(0, data.vocab_size, (rows, context + 1), generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    ctx = autocast_for(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def update():
        with ctx:
            _, loss = model(x[:, :-1], x[:, 1:], keep_logits=False)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        sync()

    update()  # warm-up: allocations, kernels chosen
    started, steps = time.perf_counter(), 0
    while steps < 2 or (time.perf_counter() - started < seconds and steps < 50):
        update()
        steps += 1
    spent = time.perf_counter() - started
    return Probed(depth, width, context, rows, rows * context * steps / spent, spent)


def wants_auto(preset: str | None, values: dict[str, Any], init_from: str | None, resume: bool) -> bool:
    """--preset auto, or no preset with --max-time and no model shape (a fresh run from scratch)."""
    if preset == AUTO and init_from is not None and not resume:
        raise NanoGPTError(
            f"--preset auto sizes a new model, and --init-from {init_from} brings its own; drop --preset auto (or "
            "give the training values you want)"
        )
    if preset == AUTO:
        return True
    shape = {"n_layer", "n_embd", "n_head", "block_size"}
    return (
        preset is None
        and not resume
        and init_from is None
        and values.get("max_time") is not None
        and not (shape & set(values))
    )


def plan_auto(
    meta: dict[str, Any],
    values: dict[str, Any],
    world_size: int,
    on_probe: Callable[[Probed], None] | None = None,
    speeds: dict[int, float] | None = None,
) -> AutoChoice:
    """auto's values for a fresh run on the dataset `meta` with the given `values` (parsed): the probe (unless its
    speeds are given, or the launcher handed them down, or under torchrun rank 0 runs it), then the rules."""
    from nanogpt_cli.config import parse_value
    from nanogpt_cli.device import resolve_device
    from nanogpt_cli.training.distributed import launched_size

    if values.get("max_time") is None:
        raise NanoGPTError("--preset auto sizes the run to a time: give --max-time too (e.g. --max-time 20m)")
    given = {k: parse_value(k, v) for k, v in values.items()}
    data = DataFigures.of(meta)
    device = resolve_device(given.get("device", "auto"))
    if speeds is None:
        dtype = given.get("dtype", "auto")

        def measure() -> dict[int, float]:
            return probe(
                data, given.get("device", "auto"), getattr(dtype, "value", dtype), on_probe, budget_s=given["max_time"]
            )

        speeds = handed_speeds() or (measure() if launched_size() <= 1 else main_rank_speeds(measure, device.type))
    return choose(data, float(given["max_time"]), speeds, given, device.type, world_size)


def handed_speeds() -> dict[int, float] | None:
    """In a process that `train --nproc` started: the probe its launcher ran (every process plans the same run)."""
    handed = os.environ.get(SPEEDS_ENV)
    return {int(k): float(v) for k, v in json.loads(handed).items()} if handed else None


def main_rank_speeds(measure: Callable[[], dict[int, float]], device: str) -> dict[int, float]:
    """Under torchrun: rank 0 probes and every rank plans from its figures. They are one process's; on a CPU the
    others share the cores out (torchrun gives each its share of threads), so the machine's speed is theirs summed,
    as it is on CUDA, where choose counts each process's GPU."""
    from nanogpt_cli.training.distributed import from_main_before_joining, launched_size

    speeds = json.loads(from_main_before_joining("auto-speeds", lambda: json.dumps(measure())))
    scale = launched_size() if device != "cuda" else 1
    return {int(k): float(v) * scale for k, v in speeds.items()}

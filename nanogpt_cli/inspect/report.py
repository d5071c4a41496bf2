"""The report card of a run: report.md in the run folder (and its figures in report.json), written at the end of every
training or fine-tuning invocation, finished, stopped or ended by the clock; `nanogpt report` prints it or compares
runs side by side.

    figures = write_report(RunDir("checkpoints/shk"), result)   # after Trainer.fit()
    rows = compare([RunDir("checkpoints/a"), RunDir("checkpoints/b")])

Everything comes from the run folder (its config, state, metrics and weights, read through RunDir); the TrainResult
of the invocation that just ended adds its speed and MFU, and how it ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanogpt_cli.config import flag, show_value
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.runs.rundir import RunDir

# the settings the report lists (the whole config is in config.json)
SHOWN = (
    "n_layer",
    "n_embd",
    "n_head",
    "block_size",
    "vocab_size",
    "batch_size",
    "gradient_accumulation_steps",
    "seq_len",
    "max_iters",
    "max_time",
    "optimizer",
    "learning_rate",
    "embedding_lr",
    "muon_lr",
    "min_lr",
    "lr_schedule",
    "warmup_iters",
    "dropout",
    "weight_decay",
    "device",
    "dtype",
)
# fixed prompts, so that two runs on the same data show samples of the same starts; the val split's first tokens
# are added to them
PROMPTS = ("The ", "\n")
SAMPLE_TOKENS = 48
BYTES_SAMPLE_TOKENS = 100_000  # the val tokens decoded to count bytes per token (bits per byte)

# DPO's and GRPO's own figures: (label, where: "val" the last evaluation's, "train" the last progress line's, key)
POLICY_SCORES = {
    "dpo": (
        ("val DPO loss", "val", "val_loss"),
        ("val preference accuracy", "val", "val_accuracy"),
        ("train DPO loss (last step logged)", "train", "loss"),
        ("train reward margin (chosen - rejected)", "train", "margin"),
        ("train reward, chosen", "train", "reward_chosen"),
        ("train reward, rejected", "train", "reward_rejected"),
    ),
    "grpo": (
        ("val reward (greedy)", "val", "val_reward"),
        ("train reward (sampled, last step logged)", "train", "reward"),
        ("train KL to the reference", "train", "kl"),
        ("train completion length (tokens)", "train", "length"),
    ),
}

ENDINGS = {
    None: "finished",
    "max_time": "ended by the clock",
    "stop_at": "stopped at --stop-at",
    "SIGINT": "stopped early (Ctrl-C)",
    "SIGTERM": "stopped early (SIGTERM)",
    "running": "still training",
}


def gather(run: RunDir, result=None, tasks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report's figures from the run folder, and from `result` (the events.TrainResult of the invocation that
    just ended, None for a report made later from the folder alone)."""
    config = run.read_config()
    model, train, dataset = config["model"], config["train"], config.get("dataset") or {}
    state = run.read_trainer() if run.has_trainer_state() else None
    records, _ = run.read_metrics()
    objective = (config.get("finetune") or {}).get("objective")
    scored = "val_reward" if objective == "grpo" else "val_loss"
    evals = [r for r in records if r.get("kind", "eval") == "eval" and scored in r]
    steps_logged = [r for r in records if r.get("kind") == "train"]
    chosen = set((config.get("auto") or {}).get("chosen") or [])
    settings = {
        name: {"value": (model | train).get(name), "by": "auto" if name in chosen else ""}
        for name in SHOWN
        if (model | train).get(name) is not None
    }
    step = result.step if result is not None else (state.step if state else 0)
    ending = result.stopped if result is not None else _ending_from_folder(state, train)
    speed = result.tokens_per_s if result is not None else (steps_logged[-1]["tokens_per_s"] if steps_logged else None)
    last = evals[-1] if evals else None
    figures: dict[str, Any] = {
        "run": str(run.path),
        "ending": ending,
        "status": ENDINGS.get(ending, str(ending)),
        "step": step,
        "dataset": train.get("data"),
        "source": dataset.get("source"),
        "tokenizer": (dataset.get("tokenizer") or {}).get("name"),
        "vocab_size": dataset.get("vocab_size"),
        "train_tokens": dataset.get("train_tokens"),
        "val_tokens": dataset.get("val_tokens"),
        "documents": dataset.get("documents"),
        "finetune": (config.get("finetune") or {}).get("method"),
        "settings": settings,
        "objective": objective,
        "tokens": getattr(result, "tokens", None) or (state.tokens if state else 0),
        "time_s": result.elapsed_s if result is not None and objective not in POLICY_SCORES else _state_time(state),
        "tokens_per_s": speed,
        "ms_per_iter": result.ms_per_iter if result is not None else None,
        "mfu": getattr(result, "mfu", None),
        "val_loss": last.get("val_loss") if last else None,
        "train_loss": last.get("train_loss") if last else None,
        "eval_step": last["step"] if last else None,
        "best_val_loss": state.best_val_loss if state else None,
        "tasks": tasks or [],
    }
    if objective in POLICY_SCORES:  # DPO's loss is not a language model's, GRPO's best is a reward: their own table
        logged = steps_logged[-1] if steps_logged else {}
        figures["scores"] = [
            {"label": label, "value": ((last or {}) if where == "val" else logged).get(key)}
            for label, where, key in POLICY_SCORES[objective]
        ]
        best = state.best_val_loss if state else None
        if best is not None:
            label = "best val DPO loss" if objective == "dpo" else "best val reward"
            figures["scores"].append({"label": label, "value": best if objective == "dpo" else -best})
        figures["best_val_loss"] = figures["train_loss"] = None
        if objective == "grpo":
            figures["val_loss"] = None
    return figures


def _state_time(state) -> float | None:
    """The run's time as its folder has it (every invocation's training, evaluations and saves)."""
    return state.elapsed_s if state else None


def _ending_from_folder(state, train: dict[str, Any]) -> str | None:
    if state is None:
        return "SIGINT"  # nothing saved: a run stopped before its first save
    if state.max_time_spent is not None:
        return "max_time"
    return None if state.step >= train.get("max_iters", 0) else "SIGINT"


def bits_per_byte(loss: float | None, bytes_per_token: float | None) -> float | None:
    """A loss in nats per token as bits per byte of text: comparable between tokenizers."""
    if loss is None or not bytes_per_token:
        return None
    return loss / math.log(2) / bytes_per_token


def bytes_per_token(tokenizer, data_dir: Path, name: str) -> float | None:
    """The UTF-8 bytes a token of the dataset's val split stands for, over its first tokens (None: no dataset)."""
    from nanogpt_cli.data import open_split
    from nanogpt_cli.inference.evaluate import text_bytes

    try:
        ids = open_split(data_dir, name, "val").shard(0)[:BYTES_SAMPLE_TOKENS]
    except (NanoGPTError, OSError, ValueError):
        return None
    if not len(ids):
        return None
    return text_bytes(tokenizer, ids) / len(ids)


def add_model_figures(figures: dict[str, Any], run: RunDir, samples: bool = True) -> None:
    """What needs the weights: bits per byte (the tokenizer), the model's size and FLOPs, and a few samples."""
    from nanogpt_cli.config import Dtype
    from nanogpt_cli.inference.sample import Sampler, SampleSettings
    from nanogpt_cli.interop.loading import load_for_inference

    config = run.read_config()
    try:
        model = load_for_inference(str(run.path), last=True, device="cpu", dtype=Dtype.float32)
    except NanoGPTError as e:
        figures["samples_note"] = f"no samples: {e}"
        return
    train = config["train"]
    text = not figures.get("scores")  # DPO's pairs and GRPO's prompts are no token stream to count bytes over
    if text:
        per_token = bytes_per_token(model.tokenizer, Path(train.get("data_dir", "data")), train.get("data", ""))
        figures["bytes_per_token"] = per_token
        for key in ("val_loss", "best_val_loss", "train_loss"):
            figures[key.replace("loss", "bpb")] = bits_per_byte(figures.get(key), per_token)
    module = model.model
    figures["params"] = module.num_params()
    figures["params_total"] = sum(p.numel() for p in module.parameters())
    seq_len = train.get("seq_len") or module.config.block_size
    if figures.get("tokens_per_s"):
        figures["flops_per_s"] = module.flops_per_token(seq_len) * figures["tokens_per_s"]
    if not samples:
        figures["samples_note"] = figures.get("samples_note") or "no samples: " + (
            "the run was stopped by a signal, which asks for an end within seconds"
            if figures.get("ending") in ("SIGINT", "SIGTERM")
            else "none were asked for"
        )
        return
    prompts = list(PROMPTS)
    try:
        first = model.tokenizer.decode(open_val_head(train, 8) if text else first_val_prompt(train))
        if first.strip():
            prompts.insert(0, first)
    except (NanoGPTError, OSError, ValueError):
        pass
    figures["samples"] = []
    sampler, settings = Sampler(model), SampleSettings(max_new_tokens=SAMPLE_TOKENS, temperature=0.8, top_k=50)
    for prompt in prompts:
        try:
            out = sampler.generate(prompt, settings)
        except NanoGPTError:  # a prompt this tokenizer cannot write (a char vocabulary without "T")
            continue
        figures["samples"].append({"prompt": prompt, "text": out.text})


def first_val_prompt(train: dict[str, Any]) -> list[int]:
    """The first val row's prompt of a preference dataset (the chosen reply's unmasked start) or a prompts one."""
    from nanogpt_cli.data.preference import read_split

    rows = read_split(train.get("data_dir", "data"), train["data"], "val")
    if not rows:
        return []
    row = rows[0]
    return row["ids"] if "ids" in row else [t for t, m in zip(row["chosen"], row["chosen_mask"]) if not m]


def open_val_head(train: dict[str, Any], n: int) -> list[int]:
    from nanogpt_cli.data import open_split

    tokens = open_split(Path(train.get("data_dir", "data")), train["data"], "val")
    return [int(t) for t in tokens.shard(0)[:n]]


def render(f: dict[str, Any]) -> str:
    """report.md from the figures."""
    name = Path(f["run"]).name
    lines = [f"# Report: {name}", ""]
    ending = f["status"]
    if f["ending"] == "max_time":
        ending += f" (--max-time {show_value(f['settings'].get('max_time', {}).get('value'))} s spent)"
    lines += [f"{ending} at step {f['step']:,}.", ""]
    if f.get("notes"):
        lines += [f"- {n}" for n in f["notes"]] + [""]
    lines += ["## Data", "", "| | |", "|---|---|"]
    lines.append(f"| dataset | {f['dataset']}" + (f" (from {f['source']})" if f.get("source") else "") + " |")
    lines.append(f"| tokenizer | {f['tokenizer']}, {f['vocab_size'] or 0:,} tokens |")
    if f.get("train_tokens") is not None:
        lines.append(
            f"| tokens | {f['train_tokens']:,} train, {f['val_tokens']:,} val, {f['documents'] or 0:,} documents |"
        )
    if f.get("bytes_per_token"):
        lines.append(f"| bytes per token | {f['bytes_per_token']:.2f} (val split) |")
    lines += ["", "## Model and settings", ""]
    if f.get("params") is not None:
        lines += [f"{f['params']:,} parameters besides the embeddings ({f['params_total']:,} in all).", ""]
    if f.get("finetune"):
        lines += [f"A fine-tune ({f['finetune']}).", ""]
    lines += ["| setting | value | chosen by |", "|---|---|---|"]
    for key, s in f["settings"].items():
        lines.append(f"| --{flag(key)} | {show_value(s['value'])} | {s['by']} |")
    lines += ["", "## Time and speed", "", "| | |", "|---|---|"]
    if f.get("time_s") is not None:
        lines.append(f"| time | {f['time_s']:,.1f} s |")
    lines.append(f"| tokens | {f['tokens']:,}" + _epochs(f) + " |")
    if f.get("tokens_per_s"):
        speed = f"{f['tokens_per_s']:,.0f} tokens/s"
        if f.get("ms_per_iter"):
            speed += f", {f['ms_per_iter']:.1f} ms/update"
        lines.append(f"| speed | {speed} |")
    if f.get("flops_per_s"):
        lines.append(f"| model FLOPs | {f['flops_per_s'] / 1e9:,.2f} GFLOP/s |")
    mfu = f"{f['mfu']:.1%}" if f.get("mfu") is not None else "not known (no peak FLOP/s known for this device)"
    lines.append(f"| MFU | {mfu} |")
    lines += _losses(f)
    lines.append(f"![loss curves]({f['plot']})" if f.get("plot") else f"Loss curves not drawn: {f.get('plot_note')}.")
    lines.append("")
    if f.get("samples"):
        lines += ["## Samples", ""]
        for s in f["samples"]:
            lines += [f"Prompt {s['prompt']!r}:", "", "```text", s["prompt"] + s["text"], "```", ""]
    elif f.get("samples_note"):
        lines += ["## Samples", "", f["samples_note"], ""]
    if f.get("tasks") or f.get("tasks_note"):
        lines += ["## Tasks", ""]
        if f.get("tasks"):
            lines += ["| task | metric | value | stderr |", "|---|---|---|---|"]
            for t in f["tasks"]:
                lines.append(f"| {t['task']} | {t['metric']} | {t['value']:.4f} | {_num(t.get('stderr'))} |")
        if f.get("tasks_note"):
            lines.append(f["tasks_note"])
        lines.append("")
    return "\n".join(lines)


def _losses(f: dict[str, Any]) -> list[str]:
    """The loss section: a language model's losses in nats and bits per byte, or DPO's and GRPO's own figures."""
    at = f" (val: step {f['eval_step']:,})" if f.get("eval_step") is not None else ""
    if f.get("scores"):
        lines = ["", f"## Scores{at}", "", "| | |", "|---|---|"]
        return lines + [f"| {s['label']} | {_num(s['value'])} |" for s in f["scores"]] + [""]
    lines = ["", "## Loss", "", "| | loss (nats/token) | bits per byte |", "|---|---|---|"]
    for label, key in (
        (f"val, step {f['eval_step']:,}" if f.get("eval_step") is not None else "val", "val_loss"),
        ("best val", "best_val_loss"),
        ("train (last evaluation)", "train_loss"),
    ):
        loss, bpb = f.get(key), f.get(key.replace("loss", "bpb"))
        lines.append(f"| {label} | {_num(loss)} | {_num(bpb)} |")
    return lines + [""]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _epochs(f: dict[str, Any]) -> str:
    if not f.get("train_tokens"):
        return ""
    return f" ({f['tokens'] / f['train_tokens']:,.2f} passes over the train split)"


def write_report(
    run: RunDir,
    result=None,
    *,
    eval_tasks: list[str] | None = None,
    samples: bool = True,
    plot: str | None = None,
    plot_note: str | None = None,
    on_status: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """report.md and report.json of the run, from its folder and the invocation's result; eval_tasks: lm-eval tasks
    scored at the end (their failure is a line of the report, the run is kept). plot: the loss curves' file name
    beside it (None: not drawn, plot_note says why). Returns the figures."""
    figures = gather(run, result)
    stopped = result is not None and result.stopped in ("SIGINT", "SIGTERM")  # it must end within seconds
    if on_status and samples and not stopped:
        on_status("writing the report: samples")
    add_model_figures(figures, run, samples=samples and not stopped)
    figures["plot"], figures["plot_note"] = plot, plot_note
    if eval_tasks and stopped:
        figures["tasks_note"] = f"The tasks were not scored: the run was stopped by {result.stopped}."
    elif eval_tasks:
        if on_status:
            on_status(f"writing the report: scoring {', '.join(eval_tasks)}")
        try:
            figures["tasks"] = score_tasks(run, eval_tasks)
        except NanoGPTError as e:
            figures["tasks_note"] = f"The tasks were not scored: {e}"
    run.write_report(render(figures), figures)
    return figures


def score_tasks(run: RunDir, tasks: list[str]) -> list[dict[str, Any]]:
    """The run's scores on lm-eval tasks, through `eval tasks`' machinery (its last weights)."""
    from nanogpt_cli.inference.lm_eval_model import NanoGPTLM
    from nanogpt_cli.inference.tasks import evaluate_tasks

    lm = NanoGPTLM(str(run.path), last=True, device="cpu", dtype="float32", batch_size=16)
    results = evaluate_tasks(lm, tasks)
    return [
        {"task": s.task.strip(), "metric": s.metric, "value": s.value, "stderr": s.stderr}
        for s in results.scores
        if isinstance(s.value, (int, float))
    ]


def report_of(run: RunDir) -> tuple[str, dict[str, Any]]:
    """A run's report card: the one written at its end, or (a run from before reports, or one still running) made
    now from its folder, without samples."""
    if not run.has_run():
        raise NanoGPTError(f"{run} is not a run folder ({run.no_run_reason()})")
    kept = run.read_report()
    if kept is not None:
        return kept
    figures = gather(run)
    if run.running():
        figures["ending"] = "running"
        figures["status"] = ENDINGS["running"]
    add_model_figures(figures, run, samples=False)
    figures["plot"] = run.loss_plot_path.name if run.loss_plot_path.is_file() else None
    figures["plot_note"] = None if figures["plot"] else "the run has no loss.png"
    return render(figures), figures


def compare(runs: list[RunDir]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Runs side by side: their names, and one row per figure (label, a value per run)."""
    figures = [report_of(r)[1] for r in runs]
    names = [r.path.name for r in runs]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, get: Callable[[dict[str, Any]], str]) -> None:
        rows.append((label, [get(f) for f in figures]))

    row("ended", lambda f: f"{f['status']}, step {f['step']:,}")
    row("dataset", lambda f: str(f["dataset"]))
    row("tokenizer", lambda f: f"{f['tokenizer']} ({f['vocab_size'] or 0:,})")
    row("parameters", lambda f: f"{f['params']:,}" if f.get("params") is not None else "-")
    keys = [k for k in SHOWN if any(k in f["settings"] for f in figures)]
    for key in keys:
        row(
            f"--{flag(key)}",
            lambda f, k=key: (
                show_value(f["settings"][k]["value"]) + (" (auto)" if f["settings"][k]["by"] == "auto" else "")
                if k in f["settings"]
                else "-"
            ),
        )
    row("time", lambda f: f"{f['time_s']:,.1f} s" if f.get("time_s") is not None else "-")
    row("tokens", lambda f: f"{f['tokens']:,}")
    row("tokens/s", lambda f: f"{f['tokens_per_s']:,.0f}" if f.get("tokens_per_s") else "-")
    row("MFU", lambda f: f"{f['mfu']:.1%}" if f.get("mfu") is not None else "-")
    for label, key in (("val loss", "val_loss"), ("best val loss", "best_val_loss")):
        row(label, lambda f, k=key: _num(f.get(k)))
    for label, key in (("val bits/byte", "val_bpb"), ("best val bits/byte", "best_val_bpb")):
        row(label, lambda f, k=key: _num(f.get(k)))
    labels = list(dict.fromkeys(s["label"] for f in figures for s in f.get("scores") or []))
    for label in labels:
        row(label, lambda f, k=label: next((_num(s["value"]) for s in f.get("scores") or [] if s["label"] == k), "-"))
    scored = sorted({(t["task"], t["metric"]) for f in figures for t in f.get("tasks") or []})
    for task, metric in scored:
        row(
            f"{task} {metric}",
            lambda f, t=task, m=metric: next(
                (f"{s['value']:.4f}" for s in f.get("tasks") or [] if (s["task"], s["metric"]) == (t, m)), "-"
            ),
        )
    return names, rows

"""The grammar mask's cost per decode step: engine steps with every row following a JSON schema against the same
rows free, at batch 1 and 16, on the GPT-2 vocabulary (50,257 tokens) and a char one.

    python benchmarks/bench_structured.py                 # 4x128 model, batch 1 and 16, 60 steps, best of 5
    python benchmarks/bench_structured.py --batch 1 4 16 --steps 100

Also prints the one-off costs: compiling a vocabulary for llguidance and compiling a schema. Random weights,
temperature 1, each row drawing from its own seeded generator (the same seeds free and masked); the masked rows
write JSON whose strings and array run on past the measured steps. The mask's own work is timed inside the
step (each row's allowed tokens from llguidance, the bool rows, the masked fill, taking the picked tokens):
on shared cores that is steadier than the difference of two step times.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.inference import grammar  # noqa: E402
from nanogpt_cli.inference.engine import Engine, SamplingParams  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402


def schema(max_length: int | None) -> dict:
    """An enum, then strings in an array long enough that no row ends inside the measured steps."""
    string = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    return {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tags": {"type": "array", "items": string, "minItems": 200},
        },
        "required": ["kind", "tags"],
        "additionalProperties": False,
    }


SCHEMAS = {"strings <= 40": schema(40), "free strings": schema(None)}


class Clock:
    """Seconds spent in the mask's own work, summed."""

    spent = 0.0


class TimedEngine(Engine):
    def _masked(self, logits):
        t0 = time.perf_counter()
        try:
            return super()._masked(logits)
        finally:
            Clock.spent += time.perf_counter() - t0


class TimedConstraint(grammar.Constraint):
    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        super().accept(token)
        Clock.spent += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        t0 = time.perf_counter()
        try:
            return grammar.Constraint.done.fget(self)
        finally:
            Clock.spent += time.perf_counter() - t0


def steps_ms(model, tokenizer, batch: int, steps: int, masked: bool, compiled: str | None) -> tuple[float, float]:
    """ms per engine step (pick + advance) of `batch` rows after a few warm-up steps, and ms of it in the mask's
    work (the rows' allowed tokens, the masked fill, taking the picked tokens)."""
    engine = TimedEngine(model, max_batch=batch, vocab_size=tokenizer.vocab_size)
    masks = [TimedConstraint(tokenizer, compiled) if masked else None for _ in range(batch)]
    prompt = tokenizer.encode("a")
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    engine.add_many([prompt] * batch, SamplingParams(temperature=1.0), steps + 10, generators, (), masks)
    for _ in range(5):
        engine.step()
    Clock.spent, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        engine.step()
    assert engine.active == batch, "a row ended inside the measured steps"
    return (time.perf_counter() - t0) / steps * 1e3, Clock.spent / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizers = {
        "gpt2 (50,257)": build_tokenizer("gpt2"),
        "char (95)": build_tokenizer("char", ["".join(chr(c) for c in range(32, 127))]),
    }
    once = []
    rows = []
    for name, tok in tokenizers.items():
        t0 = time.perf_counter()
        grammar.vocabulary(tok)
        vocab_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        grammar.Constraint(tok, grammar.compile_grammar("json_schema", SCHEMAS["strings <= 40"], tok))
        once.append([name, f"{vocab_s * 1e3:.0f}", f"{(time.perf_counter() - t0) * 1e3:.1f}"])
        cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=4, n_head=4, n_embd=128)
        model = GPT(cfg).eval()
        for (kind, value), batch in itertools.product(SCHEMAS.items(), args.batch):
            compiled = grammar.compile_grammar("json_schema", value, tok)
            free, masked = [], []
            for _ in range(args.repeats):  # interleaved, best of each: the cores are shared
                free.append(steps_ms(model, tok, batch, args.steps, False, compiled))
                masked.append(steps_ms(model, tok, batch, args.steps, True, compiled))
            f, (m, spent) = min(free)[0], min(masked, key=lambda x: x[1])
            rows.append([name, kind, batch, f"{f:.3f}", f"{m:.3f}", f"{spent:.3f}", f"{spent / batch * 1e3:.0f}"])
    table("one-off costs", ["vocabulary", "compile vocabulary (ms)", "compile schema + matcher (ms)"], once)
    header = ["vocabulary", "schema", "rows", "free ms/step", "masked ms/step", "of it the mask (ms)", "mask us/row"]
    table("4x128 model, temperature 1, one thread", header, rows)
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

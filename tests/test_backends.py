"""Decode backends (inference/backends/): every backend held to the torch backend, the model's own forward, by one
conformance matrix; what each consumer of a GPTConfig declares it computes; choosing a backend and refusing one.

The matrix: every backend x float32, bf16, int8, int4 x six blocks (Llama with grouped-query attention, Qwen3's
QK-norm, Gemma 3's sliding windows, post-norms and soft-capped logits, GPT-NeoX's parallel residual and partial
rotary, our default block, GPT-2's learned positions and biases) x batches of 1, 3 and 8 rows, each row at its
own position. The rows' prompts end exactly at the sliding window's ring (8 tokens), just across it, and at the
context's end (32), where the engine's cache restarts. float32: the greedy tokens equal torch's; bf16, int8, int4:
every step's logits within TOLERANCE of torch's on the same weights (torch then runs the same quantized modules,
through their forward). In bf16, int8 and int4 the cpu backend runs every block through its fused step.
"""

import dataclasses
import subprocess
import sys

import pytest
import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends import BACKENDS, choose, decode_words
from nanogpt_cli.inference.backends.cpu import FUSED
from nanogpt_cli.inference.backends.quantize import quantize_model
from nanogpt_cli.inference.backends.reference import TORCH
from nanogpt_cli.inference.engine import Engine, KVCache, SamplingParams
from nanogpt_cli.interop.families import FAMILIES
from nanogpt_cli.model import GPT

SHAPE = dict(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
ARCHS = {
    "llama-gqa": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2),
    "qwen3": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, qk_norm=True),
    "gemma3": dict(
        norm="rmsnorm",
        mlp="geglu",
        n_kv_head=2,
        qk_norm=True,
        embed_scale=True,
        norm_offset=True,
        post_norms=True,
        sliding_window=8,
        window_pattern="LG",
        rope_local_theta=1000.0,
        logit_softcap=20.0,
    ),
    "gpt-neox": dict(norm="layernorm", mlp="gelu", parallel_residual=True, rotary_dim=8, bias=True),
    "default": dict(),
    "gpt2": dict(norm="layernorm", mlp="gelu_tanh", pos_encoding="learned", bias=True),
}
# largest |logit - torch's| allowed, as a fraction of the logits' spread (their std, ~1.3-2.5 here): bf16 rounds
# every op's output where our fused step keeps float32 inside a block (measured up to 0.09). int8 (measured up to
# 0.16) and int4 (0.57): our kernels round their input rows to int8 in blocks of 32, from the fused step's float32
# values there and from bf16 ones op by op; int4's cpu backend also reads a copy of the head in the blocks' 4 bits
# (quantize_head) where torch reads the float head
TOLERANCE = {"bf16": 0.15, "int8": 0.3, "int4": 0.9}
PROMPTS = [8, 11, 26, 1, 9, 17, 5, 24]  # at the ring (8), across it, and 6 steps short of the context (32)
STEPS = 6


def model_for(arch: str, dtype: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, **ARCHS[arch])).eval()
    with torch.no_grad():  # weights large enough that the logits spread (~1) and greedy picks are not near-ties
        for p in model.parameters():
            p.normal_(0.0, 0.15 if p.dim() > 1 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    if dtype != "float32":
        model.cast(torch.bfloat16)
    if dtype in ("int8", "int4"):
        quantize_model(model, dtype, 32)
    return model


def step_logits(model: GPT, name: str, batch: int, tokens: torch.Tensor) -> torch.Tensor:
    """Every step's logits (STEPS, batch, V) of one backend: each row prefilled alone with its own prompt, then
    STEPS steps of all rows together, each at its own position, fed the same tokens."""
    backend = choose(model, name)
    plan = backend.prepare(model, model.config.vocab_size)
    cache = KVCache(model, batch)
    out = []
    with torch.inference_mode():
        for r in range(batch):
            backend.prefill(plan, tokens[r : r + 1, : PROMPTS[r]], cache.view(r, r + 1))
        for s in range(STEPS):
            idx = torch.stack([tokens[r, PROMPTS[r] + s] for r in range(batch)])
            out.append(backend.step(plan, idx, cache, batch).float())
    return torch.stack(out)


def greedy_tokens(model: GPT, name: str, batch: int) -> list[list[int]]:
    """Each row's greedy tokens through the engine (prefill, steps, and the cache's restart at the context's end)."""
    torch.manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,)).tolist() for n in PROMPTS[:batch]]
    engine = Engine(model, max_batch=batch, backend=name)
    ids = engine.add_many(prompts, SamplingParams(temperature=0.0), STEPS + 2)
    out = {i: [] for i in ids}
    for t in engine.run():
        out[t.row].append(t.token)
    return [out[i] for i in ids]


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_backend_decodes_what_the_torch_backend_decodes(arch, dtype):
    model = model_for(arch, dtype)
    for backend in BACKENDS:
        if backend.name == "torch":
            continue
        for batch in (1, 3, 8):
            if dtype == "float32":
                assert greedy_tokens(model, backend.name, batch) == greedy_tokens(model, "torch", batch), batch
                continue
            seeded = torch.Generator().manual_seed(batch)
            tokens = torch.randint(0, SHAPE["vocab_size"], (batch, SHAPE["block_size"]), generator=seeded)
            ref = step_logits(model, "torch", batch, tokens)
            spread = ref.std().item()
            assert spread > 1.0  # logits that spread: their greedy picks are not near-ties
            err = (step_logits(model, backend.name, batch, tokens) - ref).abs().max().item()
            assert err <= TOLERANCE[dtype] * spread, (backend.name, batch, err / spread)


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_backend_scores_a_rows_next_tokens_as_the_torch_backends_steps_do(arch, dtype):
    """backend.score (speculative decoding's check): 3 rows at their own positions take 4 tokens each in one call,
    against the torch backend's 4 steps; caches that keep every position (KVCache(ring=False)), as a speculative
    engine's do."""
    model = model_for(arch, dtype)
    batch, T = 3, 4
    tokens = torch.randint(0, SHAPE["vocab_size"], (batch, SHAPE["block_size"]), generator=torch.Generator())
    out = {}
    with torch.inference_mode():
        new = torch.stack([tokens[r, PROMPTS[r] : PROMPTS[r] + T] for r in range(batch)])  # (batch, T)
        for backend in [TORCH, *BACKENDS]:  # the torch backend's steps first
            name = "steps" if "steps" not in out else backend.name
            plan = backend.prepare(model, model.config.vocab_size)
            cache = KVCache(model, batch, ring=False)
            for r in range(batch):
                backend.prefill(plan, tokens[r : r + 1, : PROMPTS[r]], cache.view(r, r + 1))
            if name == "steps":
                steps = [backend.step(plan, new[:, j], cache, batch).float() for j in range(T)]
                out[name] = torch.stack(steps, dim=1)  # (batch, T, V)
            else:
                if backend.name == "cpu" and dtype != "float32":  # the fused step checks them, windows and all
                    assert plan.fused is not None
                out[name] = backend.score(plan, new, cache.view(0, batch)).float()
            assert cache.pos[:batch] == [PROMPTS[r] + T for r in range(batch)]
    spread = out["steps"].std().item()
    for backend in BACKENDS:
        err = (out[backend.name] - out["steps"]).abs().max().item()
        assert err <= (TOLERANCE.get(dtype, 1e-4)) * spread, (backend.name, err / spread)


def test_the_fused_step_runs_where_its_declaration_holds_and_the_matrix_reaches_it():
    """Every block of the matrix in bf16 goes through the one-call step; a head size our attention loop does not
    take is refused in one sentence."""
    from nanogpt_cli.inference.backends import native

    for arch in ARCHS:
        assert FUSED.refusal(GPTConfig(**SHAPE, **ARCHS[arch])) is None, arch
        model = model_for(arch, "bf16")
        assert (choose(model).prepare(model, 96).fused is not None) == native.available(), arch
    why = FUSED.refusal(GPTConfig(**{**SHAPE, "n_embd": 96}, **ARCHS["gpt-neox"]))
    assert why == (
        "the cpu backend's fused step does not compute a head size of 24: it needs a head size that is a multiple "
        "of 16, up to 512"
    )


def test_every_consumer_of_a_config_classifies_every_field():
    """A new GPTConfig field fails here until each backend, the fused step, each Hugging Face family and each
    llama.cpp architecture the GGUF writer exports to (a family's layout, and the plain block's) says which of its
    values it computes."""
    consumers = [b.features for b in BACKENDS] + [FUSED] + [f.features for f in FAMILIES.values()]
    consumers += [f.gguf.features for f in FAMILIES.values() if f.gguf]
    consumers += [f.gguf_plain[2].features for f in FAMILIES.values() if f.gguf_plain]
    missing = {c.consumer: c.unclassified() for c in consumers if c.unclassified()}
    assert not missing, missing
    stray = {c.consumer: set(c.takes) - {f.name for f in dataclasses.fields(GPTConfig)} for c in consumers}
    assert not any(stray.values()), stray


def test_the_engine_takes_the_first_backend_that_fits_and_a_forced_one_that_does_not_is_one_sentence():
    model = model_for("default", "float32")
    assert Engine(model).backend.name == "cpu"
    assert Engine(model, backend="torch").backend.name == "torch"
    wide = model_for("default", "float32").double()  # float64: not one the cpu backend decodes
    assert Engine(wide).backend.name == "torch"
    with pytest.raises(NanoGPTError, match="^--backend cpu does not fit this model: the cpu backend decodes float32"):
        Engine(wide, backend="cpu")
    with pytest.raises(NanoGPTError, match="^--backend must be one of cpu, torch, got 'cuda'$"):
        Engine(model, backend="cuda")
    model.decode_backend = "torch"  # what load_for_inference(backend=...) leaves for every engine on the model
    assert Engine(model).backend.name == "torch"
    assert (
        decode_words(GPTConfig(**SHAPE, **ARCHS["qwen3"]))
        == "cpu, each step of the blocks in one call (bf16, int8, int4)"
    )
    assert decode_words(GPTConfig(**SHAPE, **ARCHS["gemma3"])) == decode_words(GPTConfig(**SHAPE))
    words = decode_words(GPTConfig(**{**SHAPE, "n_embd": 96}, **ARCHS["gemma3"]))
    assert words == "cpu, op by op (its fused step needs a head size that is a multiple of 16, up to 512)"


@pytest.mark.slow
def test_importing_the_backends_installs_no_optimizer_hook():
    """The form cache counts optimizer steps only once it has built a form: a process that trains and never
    decodes carries no hook of ours."""
    code = (
        "import torch.optim.optimizer as o; import nanogpt_cli.inference.engine, nanogpt_cli.inference.backends; "
        "n = len(o._global_optimizer_post_hooks); "
        "from nanogpt_cli.model import GPT; from nanogpt_cli.config import GPTConfig; "
        "from nanogpt_cli.inference.engine import Engine; "
        "Engine(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()); "
        "print(n, len(o._global_optimizer_post_hooks))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "1"]


@pytest.mark.slow
def test_sample_with_a_backend_forced_and_info_saying_which_decodes(trained_run):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    args = ["sample", "--checkpoint", str(trained_run), "--max-new-tokens", "5", "--temperature", "0", "--seed", "1"]
    from nanogpt_cli.inference.backends import native

    native.available()  # built (and its one note taken) before, so that neither output carries the build's note
    native.take_note()
    texts = []
    for backend in ("cpu", "torch"):
        result = CliRunner().invoke(app, [*args, "--dtype", "float32", "--backend", backend])
        assert result.exit_code == 0, result.output
        texts.append(result.output)
    assert texts[0] == texts[1]  # float32 greedy: the same text from either backend
    result = CliRunner().invoke(app, [*args, "--backend", "gpu"])
    assert result.exit_code == 1 and "--backend must be one of cpu, torch, got 'gpu'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    info = CliRunner().invoke(app, ["info", str(trained_run)])
    assert info.exit_code == 0 and "decode backend" in info.output and "blocks in one call" in info.output

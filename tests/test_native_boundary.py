"""The boundary to our C kernels (inference/backends/native.py, native.cpp): every wrong call a ValueError naming
the argument, the shared structs' layout checked field by field, no state shared between two engines decoding at once, a
seeded fuzz of shapes against the op-by-op step, the whole of it under AddressSanitizer and UBSan, and the build
told in one note (the CLI's `info --system`)."""

import copy
import ctypes
import dataclasses
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanogpt_cli.inference.backends import native
from nanogpt_cli.inference.backends.cpu import CPUBackend, decode_plan, decode_step, head_logits
from nanogpt_cli.inference.backends.quantize import QuantizedLinear, quantize_int4, quantize_int8, quantize_model
from nanogpt_cli.inference.engine import Engine, KVCache, SamplingParams
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import ByteTokenizer
from conftest import kernel_reference, tiny_config

pytestmark = pytest.mark.skipif(not native.available(), reason=f"our kernels do not run here: {native.status()}")
ROOT = str(Path(native.__file__).resolve().parents[3])  # subprocesses import this very package


def llama(dtype: torch.dtype, kind: str | None, seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    shape = dict(n_embd=128, n_head=4, n_kv_head=2, norm="rmsnorm", mlp="swiglu", block_size=32, qkv_bias=True)
    model = GPT(tiny_config(**{**shape, **kw})).eval().cast(dtype)
    return quantize_model(model, kind, 32) if kind else model


# --- wrong calls ----------------------------------------------------------------------------------------------


def product():
    torch.manual_seed(0)
    w = (torch.randn(10, 64) * 0.1).bfloat16()
    return native.pack(w, torch.randn(10))


X = torch.randn(3, 64)
LINEAR_CALLS = {  # argument named -> (x, res, y, threads)
    "x": [
        (X.double(), None, torch.empty(3, 10), 1),  # dtype
        (torch.randn(3, 32), None, torch.empty(3, 10), 1),  # inputs
        (torch.randn(1, 3, 64), None, torch.empty(3, 10), 1),  # not rows
        (torch.randn(0, 64), None, torch.empty(0, 10), 1),  # no rows
        (torch.randn(64, 3).t(), None, torch.empty(3, 10), 1),  # not contiguous
        (X.to("meta"), None, torch.empty(3, 10), 1),  # not on the CPU
        ([[0.0] * 64] * 3, None, torch.empty(3, 10), 1),  # not a tensor
    ],
    "res": [(X, torch.randn(3, 9), torch.empty(3, 10), 1), (X, torch.randn(3, 10).bfloat16(), torch.empty(3, 10), 1)],
    "y": [(X, None, torch.empty(2, 10), 1), (X, None, torch.empty(3, 10).bfloat16(), 1)],
    "threads": [(X, None, torch.empty(3, 10), 0), (X, None, torch.empty(3, 10), 1.5)],
}


@pytest.mark.parametrize("name, call", [(n, c) for n, calls in LINEAR_CALLS.items() for c in calls])
def test_a_wrong_product_call_is_a_value_error_naming_the_argument(name, call):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        native.linear(product(), *call)


def test_a_packed_weight_is_checked_against_the_layout_the_kernel_reads():
    w = native.tiles(torch.randn(8, 64).bfloat16(), native.CHUNK)
    with pytest.raises(ValueError, match="^w must hold 1024 values"):
        native.Packed(native.BF16, w, 16, 64)  # 16 rows said, 8 held: the kernel would read past the end
    with pytest.raises(ValueError, match="^w must be torch.bfloat16"):
        native.Packed(native.BF16, w.float(), 8, 64)
    with pytest.raises(ValueError, match="^bias must have shape"):
        native.Packed(native.BF16, w, 8, 64, bias=torch.randn(7))
    q = torch.zeros(16, 64, dtype=torch.int8)  # one tile of int8's 16 rows
    with pytest.raises(ValueError, match="^scale must be a tensor"):
        native.Packed(native.INT8, q, 8, 64, scale=None)
    with pytest.raises(ValueError, match=r"^K \(48\)"):
        native.Packed(native.BF16, w, 8, 48)
    with pytest.raises(ValueError, match=r"^K \(64\) and group \(0\)"):  # no division by zero on either side
        native.Packed(native.INT4, torch.zeros(256, dtype=torch.uint8), 8, 64, scale=None, zero=None, group=0)


def fused(model: GPT):
    plan = decode_plan(model)
    assert plan.fused is not None
    return plan.fused


def test_a_wrong_fused_step_call_is_a_value_error_naming_the_argument():
    step = fused(llama(torch.bfloat16, None, n_layer=2))
    blocks, cache = step.blocks, KVCache(step.model, 3)
    caches = native.Caches(blocks, cache.k, cache.v)
    x, pos = torch.randn(2, 128).bfloat16(), torch.tensor([0, 5])

    def wrong(name, **change):
        args = dict(blocks=blocks, caches=caches, x=x, pos=pos, threads=1, timers=torch.zeros(3, dtype=torch.float64))
        with pytest.raises(ValueError, match=rf"^{name} must"):
            native.decode(**{**args, **change})

    wrong("x", x=torch.randn(2, 96).bfloat16())
    wrong("x", x=torch.randn(4, 128).bfloat16())  # more rows than the cache
    wrong("x", x=x.half())
    wrong("pos", pos=pos.int())
    wrong("pos", pos=torch.tensor([0]))
    wrong("pos", pos=torch.tensor([0, 32]))  # past the cache: the C side's own check, named here
    wrong("pos", pos=torch.tensor([-1, 0]))
    wrong("timers", timers=torch.zeros(3))
    wrong("threads", threads=0)
    wrong("caches", caches=native.Caches(fused(llama(torch.bfloat16, None, n_layer=2)).blocks, cache.k, cache.v))
    with pytest.raises(ValueError, match=r"^ks\[1\] must have shape"):
        native.Caches(blocks, [cache.k[0], cache.k[1][:, :1].contiguous()], cache.v)
    with pytest.raises(ValueError, match=r"^vs\[0\] must be torch.bfloat16"):
        native.Caches(blocks, cache.k, [v.float() for v in cache.v])
    with pytest.raises(ValueError, match="^ks and vs must hold 2 layers"):
        native.Caches(blocks, cache.k[:1], cache.v)
    unset = native.Blocks(2, 128, 4, 2, 32, blocks.H, 32)
    wrong("blocks", blocks=unset, caches=caches)
    good = step.blocks.keep[0]

    def wrong_layer(match: str, **change):
        with pytest.raises(ValueError, match=match):
            unset.layer(0, dataclasses.replace(good, **change))

    wrong_layer("^proj must map 128 inputs to 128 outputs, got 128 to 256", proj=good.qkv)  # qkv in proj's place
    wrong_layer(r"^cos must have shape \(32, any\), got \(31, 32\)", cos=good.cos[:31])
    wrong_layer("^cos must have an even number of columns from 2 to 32, got 33", cos=torch.zeros(32, 33))
    wrong_layer("^cos must be a tensor, got list", cos=good.cos.tolist())
    wrong_layer("^q_norm and k_norm must be given together", q_norm=native.NormWeights(torch.ones(32), None, 1e-5))
    wrong_layer(r"^ln2.gain must have shape \(128\)", ln2=native.NormWeights(torch.ones(32), None, 1e-5))
    wrong_layer(r"^post1.bias must have shape \(128\)", post1=native.NormWeights(torch.ones(128), torch.ones(3), 1e-5))
    wrong_layer("^ln1 must be a native.NormWeights, got NoneType", ln1=None)
    wrong_layer("^act must be one of swiglu, geglu, gelu, gelu_tanh, relu2, got 'tanh'", act="tanh")
    wrong_layer("^fc must map 128 inputs to 384 outputs", act="gelu")  # a gated product where a plain one goes
    wrong_layer("^window must be an int from 0 to 32, got 33", window=33)
    with pytest.raises(ValueError, match="^hs"):
        native.Blocks(2, 128, 4, 2, 24, 64, 32)  # heads of 24: not whole registers of 16


def test_a_layers_tensors_cannot_be_swapped_under_the_structs_that_point_at_them():
    """The Block structs hold the raw pointers of a Layer's tensors, its norms' included: a norm's gain replaced
    after the layer is set would free the memory the next step reads."""
    blocks = fused(llama(torch.bfloat16, None, n_layer=1, qk_norm=True)).blocks
    layer = blocks.keep[0]
    for obj, name in ((layer, "cos"), (layer.ln1, "gain"), (layer.q_norm, "gain"), (layer.ln2, "bias")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, torch.ones(1))


def test_a_wrong_fused_step_call_with_caches_made_before_a_layers_window_changed():
    """A ring layer's cache holds its window's slots: with the layer set again as a whole-context one, the step
    would index the ring as if it held the context (past its end from position 8 on)."""
    model = llama(torch.bfloat16, None, n_layer=2, sliding_window=8)
    step, cache = fused(model), KVCache(model, 1)
    caches = native.Caches(step.blocks, cache.k, cache.v)
    step.blocks.layer(0, dataclasses.replace(step.blocks.keep[0], window=0))
    with pytest.raises(ValueError, match="^caches must be a native.Caches made for these blocks as they are now"):
        native.decode(step.blocks, caches, torch.randn(1, 128).bfloat16(), torch.tensor([0]), 1)


def test_drafted_rows_sharing_a_cache_row_get_exactly_the_fused_steps_values_past_a_window():
    """A speculative check (cpu backend's score): each row's next tokens as rows of one fused call sharing its cache
    row, in caches that keep every position (KVCache(ring=False)); windowed layers of 8 see the window's last keys
    in place, from positions before the window to well past it: exactly the fused steps' values, and the op-by-op
    steps' within bf16's rounding. A ring cache refuses shared rows (a later key would overwrite one)."""
    model = llama(torch.bfloat16, None, n_layer=2, sliding_window=8, window_pattern="LG")
    plan = decode_plan(model)
    assert plan.fused is not None
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    spans = [(0, 3), (3, 10), (10, 14), (14, 20)]  # several positions before, across and past the window
    with torch.inference_mode():
        steps = []
        for p in (plan, plan._replace(fused=None)):
            cache = KVCache(model, 2, ring=False)
            steps.append(torch.stack([decode_step(p, tokens[:, j], cache) for j in range(20)], dim=1).float())
        cache = KVCache(model, 2, ring=False)
        scored = torch.cat([CPUBackend().score(plan, tokens[:, a:b], cache.view(0, 2)) for a, b in spans], dim=1)
        assert cache.pos[:2] == [20, 20]
        fused_steps, by_op = steps
        assert torch.equal(scored.float(), fused_steps)
        assert (scored.float() - by_op).abs().max().item() <= 0.02 * by_op.abs().max().item()
        ring = KVCache(model, 1)
        caches = native.Caches(plan.fused.blocks, ring.k, ring.v)
        x, pos, rows = torch.randn(2, 128).bfloat16(), torch.tensor([0, 1]), torch.tensor([0, 0])
        with pytest.raises(ValueError, match="^rows may share a cache row only in a cache without rings"):
            native.decode(plan.fused.blocks, caches, x, pos, 1, rows=rows)


def test_the_shared_structs_are_checked_field_by_field():
    lib = native.library()[0]
    assert native.check_library(lib) is None
    rows = native.layout(lib)
    for kind, mirror in native.MIRRORS.items():  # every field of every mirror, and only those, in the table
        assert [r[1] for r in rows if r[0] == kind and r[1]] == [f[0] for f in mirror._fields_]

    class Swapped(ctypes.Structure):  # two fields of one size in the other order: the total size agrees
        _fields_ = [(n, t) for n, t in native.Linear._fields_ if n not in ("N", "K")]
        _fields_[6:6] = [("K", ctypes.c_int64), ("N", ctypes.c_int64)]

    class Shorter(ctypes.Structure):
        _fields_ = native.Linear._fields_[:-1]

    mirrors = dict(native.MIRRORS)
    try:
        native.MIRRORS["Linear"] = Swapped
        assert native.check_library(lib) == "Linear.N at 48 (8 bytes), its mirror at 56 (8 bytes)"
        native.MIRRORS["Linear"] = Shorter
        assert native.check_library(lib) == "Linear is 72 bytes, its mirror 64"
    finally:
        native.MIRRORS.update(mirrors)
        native.check_library(lib)


# --- no shared state --------------------------------------------------------------------------------------------


def greedy(model: GPT, prompts: list[list[int]], n: int) -> tuple[list[list[int]], torch.Tensor]:
    engine = Engine(model, max_batch=len(prompts))
    ids = engine.add_many(prompts, SamplingParams(temperature=0.0), n)
    out = {i: [] for i in ids}
    for t in engine.run():
        out[t.row].append(t.token)
    return [out[i] for i in ids], engine.plan.fused.timers


def test_two_engines_decoding_in_two_threads_each_get_the_tokens_they_get_alone():
    models = [llama(torch.bfloat16, None, seed=1), llama(torch.float32, "int8", seed=2, qk_norm=True)]
    prompts = [[[3, 1, 4, 1, 5], [9, 2, 6]], [[2, 7, 1, 8, 2, 8, 1], [8, 2, 8]]]
    alone = [greedy(m, p, 24)[0] for m, p in zip(models, prompts)]
    got: dict = {}

    def work(i):
        got[i] = [greedy(models[i], prompts[i], 24) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for tokens, timers in got[i]:
            assert tokens == alone[i]
            products, attention, total = timers.tolist()  # each step's clock counts its own calls only
            assert 0 < products < total and 0 < attention < total


# --- fuzz -------------------------------------------------------------------------------------------------------


def test_the_fused_steps_attention_split_over_threads_gets_what_one_thread_gets():
    """Enough held keys that ng_decode splits the attention's rows and key heads over two threads, each with its
    own scores, on a ring layer and a whole-context one: the same residual stream and caches, bit for bit, as one
    thread (the suite's one thread never splits)."""
    model = llama(torch.float32, "int8", n_layer=2, block_size=512, sliding_window=400, window_pattern="LG")
    step, idx = fused(model), torch.randint(0, 61, (3, 500))
    x, pos = torch.randn(3, 128), torch.tensor([499, 450, 420])
    outs = []
    with torch.inference_mode():
        for threads in (1, 2):
            cache = KVCache(model, 3)
            model.hidden_states(idx, cache=cache.view(0, 3))
            y = x.clone()
            native.decode(step.blocks, native.Caches(step.blocks, cache.k, cache.v), y, pos, threads)
            outs.append([y, *cache.k, *cache.v])
    for one, two in zip(*outs):
        assert torch.equal(one, two)


def test_a_seeded_fuzz_of_product_shapes_against_torch():
    rng, start, cases = random.Random(47), time.perf_counter(), 0
    while cases < 60 and time.perf_counter() - start < 3:
        kind, dtype = rng.choice(["bf16", "int8", "int4"]), rng.choice([torch.float32, torch.bfloat16])
        group = rng.choice([32, 64, 128]) if kind == "int4" else 32
        K = rng.randint(1, 6) * max(64 if kind == "int4" else 32, group)
        N, B = rng.randint(1, 40), rng.randint(1, 9)
        torch.manual_seed(cases)
        w, x = torch.randn(N, K) * 0.05, torch.randn(B, K).to(dtype)
        bias = torch.randn(N) if rng.random() < 0.5 else None
        res = torch.randn(B, N).to(dtype) if rng.random() < 0.5 else None
        if kind == "bf16":
            kernel, ref = native.pack(w.bfloat16(), bias), x.float() @ w.bfloat16().float().T
        else:
            if kind == "int8":
                q = QuantizedLinear.int8(*quantize_int8(w), bias=bias)
            else:
                q = QuantizedLinear.int4(*quantize_int4(w, group), group, bias=bias)
            kernel, ref = q.kernel(), kernel_reference(q, x)
        got = kernel(x, res).float()
        expected = ref + (0 if bias is None else bias) + (0 if res is None else res.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (got - expected).abs().max().item() <= tol * expected.abs().max().item() + 1e-6, (kind, N, K, B)
        cases += 1
    assert cases >= 20


def in_torch(model: GPT) -> GPT:
    """The model with each quantized projection an nn.Linear of its dequantized weights: every product torch's."""
    ref = copy.deepcopy(model)
    for module in list(ref.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantizedLinear):
                dtype = ref.transformer.wte.weight.dtype
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight.data = child.dequantize(torch.float32).to(dtype)
                if child.bias is not None:
                    linear.bias.data = child.bias.detach().to(dtype)
                setattr(module, name, linear.to(dtype))
    return ref


def prefilled(model: GPT, idx: torch.Tensor, pos: list[int]) -> KVCache:
    """A cache of idx's rows but the last token, each row then set back to a position of its own."""
    B, T = idx.shape
    cache = KVCache(model, B)
    model.hidden_states(idx[:, : T - 1], cache=cache.view(0, B))
    cache.pos = list(pos)
    return cache


def block_choices(rng: random.Random, hs: int, S: int) -> dict:
    """A block's features drawn at random: its norm, activation, residual, positions, rotary share, windows."""
    kw = dict(
        norm=rng.choice(["rmsnorm", "layernorm"]), mlp=rng.choice(["swiglu", "geglu", "gelu", "gelu_tanh", "relu2"])
    )
    kw |= dict(qk_norm=rng.random() < 0.3, bias=rng.random() < 0.4, parallel_residual=rng.random() < 0.3)
    kw |= dict(post_norms=rng.random() < 0.3, pos_encoding=rng.choice(["rope", "rope", "learned", "sinusoidal"]))
    kw["norm_offset"] = kw["norm"] == "rmsnorm" and rng.random() < 0.3
    if kw["pos_encoding"] == "rope" and rng.random() < 0.4:
        kw["rotary_dim"] = 2 * rng.randint(1, hs // 2)
    if rng.random() < 0.4:
        kw["sliding_window"] = rng.randint(1, S)
        kw["window_pattern"] = rng.choice([None, "LG", "GL"])
        if kw["pos_encoding"] == "rope" and rng.random() < 0.5:
            kw["rope_local_theta"] = 1000.0
    return kw


def test_a_seeded_fuzz_of_fused_step_shapes_against_torch_and_the_step_op_by_op():
    """Widths, heads and groups of query heads per key head, batch 1-9, positions up to the context, int4
    groups, and the blocks' features (norms, activations, residuals, positions, rotary shares, windows): the
    fused step's last hidden state against the model's own forward in torch (quantized weights dequantized), and
    its logits against the decoding form's step op by op."""
    rng, start, cases = random.Random(7), time.perf_counter(), 0
    while cases < 12 and time.perf_counter() - start < 5:
        hs, nkv, group = rng.choice([16, 32, 48, 64]), rng.choice([1, 2]), rng.choice([1, 2, 3])
        nh = nkv * group
        if (nh * hs) % 64:  # the width in whole int4 pairs of chunks (and int8's chunks)
            continue
        dtype, kind = rng.choice([(torch.bfloat16, None), (torch.float32, "int8"), (torch.bfloat16, "int4")])
        S, B = rng.randint(8, 40), rng.randint(1, 9)
        kw = dict(n_embd=nh * hs, n_head=nh, n_kv_head=nkv, block_size=S, n_layer=rng.randint(1, 2))
        kw |= block_choices(rng, hs, S)
        torch.manual_seed(cases)
        model = GPT(tiny_config(**kw)).eval().cast(dtype)
        if kind:
            model = quantize_model(model, kind, rng.choice([32, 64]))
        plan = decode_plan(model)
        assert plan.fused is not None, kw
        pos = [rng.randint(0, S - 1) for _ in range(B)]
        pos[rng.randrange(B)] = S - 1  # one row at the context's last position
        idx = torch.randint(0, 61, (B, S))
        token = idx[torch.arange(B), pos]

        with torch.inference_mode():
            cache = prefilled(model, idx, pos)
            fused = plan.ops.ln_f(plan.fused(token, cache, B)).float()  # (B, C)
            fused_logits = head_logits(plan, fused.to(dtype)).float()
            by_op = decode_step(plan._replace(fused=None), token, prefilled(model, idx, pos)).float()
            ref = in_torch(model)
            own = ref.hidden_states(token.view(B, 1), prefilled(ref, idx, pos).view(0, B))[:, 0].float()
        # bf16: torch rounds each op's output to bf16 where the fused step keeps float32; int8 and int4: the
        # fused step rounds the activations to int8 in blocks of 32 where torch's forward (the weights
        # dequantized) does not (int4 up to 0.058 measured over 40 seeds, most with post-norms, which bring a
        # small projection's rounding to the residual stream's scale)
        tol = 0.08 if kind else 0.03
        assert (fused - own).abs().max().item() <= tol * own.abs().max().item(), (kw, kind, pos)
        assert (fused_logits - by_op).abs().max().item() <= tol * by_op.abs().max().item(), (kw, kind, pos)
        cases += 1
    assert cases >= 6


# --- sanitized --------------------------------------------------------------------------------------------------


def runtime(name: str) -> str | None:
    cxx = native.compiler()
    if cxx is None:
        return None
    found = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


@pytest.mark.slow
def test_every_kernel_and_fused_step_shape_runs_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """native.cpp built with -fsanitize=address,undefined in a fresh cache; python is not built with ASan, so its
    runtime is preloaded. The product and fused-step tests, the fuzz, the wrong calls and the threads run in it."""
    asan = runtime("libasan.so")
    if asan is None:
        pytest.skip("the compiler has no AddressSanitizer runtime")
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path),
        "PYTHONPATH": path,
        "NANOGPT_NATIVE_FLAGS": "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O0",
        "LD_PRELOAD": asan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=99",  # python's own allocations are not ours
        "UBSAN_OPTIONS": "print_stacktrace=1:exitcode=99",
    }
    here = Path(__file__).parent
    tests = "each_kernel or exactly or fused_step_equals or fuzz or wrong or threads or field_by_field or dequantized"
    select = ["-k", tests]
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *select]
    done = subprocess.run(
        [*args, str(here / "test_native.py"), str(here / "test_native_boundary.py")],
        env=env, capture_output=True, text=True, cwd=here, timeout=300,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert "Sanitizer" not in report and "runtime error" not in report, report[-4000:]
    assert done.returncode == 0, report[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-500:]
    built = list((tmp_path / "nanogpt" / "native").glob("native-*.so"))
    assert len(built) == 1
    nm = subprocess.run(["nm", "-D", str(built[0])], capture_output=True, text=True).stdout
    assert "__asan" in nm and "__ubsan" in nm  # the library the tests ran is the sanitized one


# --- the build, told ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_first_build_is_one_note_and_a_failed_build_one_line_and_info_system_shows_them(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": ROOT, "COLUMNS": "200"}

    def info(**extra):
        args = [sys.executable, "-m", "nanogpt_cli", "info", "--system"]
        done = subprocess.run(args, env={**env, **extra}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    weights = tmp_path / "tiny.safetensors"  # a model decoded by --backend torch builds nothing and says nothing
    ckpt.save_model(weights, GPT(tiny_config(vocab_size=256)), {"tokenizer": ByteTokenizer().describe(), "step": 0})
    args = [sys.executable, "-m", "nanogpt_cli", "sample", "--checkpoint", str(weights), "--backend", "torch"]
    done = subprocess.run([*args, "--max-new-tokens", "2"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "kernels" not in done.stderr, done.stderr
    assert not (tmp_path / "nanogpt" / "native").exists()
    out, err = info()
    assert err.count("note:") == 1 and "note: built our decode kernels for " in err, err
    assert f"(kept in {tmp_path / 'nanogpt' / 'native'})" in err
    assert "decode kernels   ours (" in out and str(tmp_path / "nanogpt" / "native" / "native-") in out
    for key in ("torch", "threads", "cpu features", "devices"):
        assert f"{key} " in out
    out, err = info()  # built already: nothing to tell
    assert err == "", err
    bad = tmp_path / "bad-cxx"
    bad.write_text("#!/bin/sh\necho 'native.cpp:1:10: fatal error: immintrin.h: No such file' >&2\nexit 1\n")
    bad.chmod(0o755)
    out, err = info(CXX=str(bad))
    line = "note: our decode kernels did not compile (native.cpp:1:10: fatal error: immintrin.h: No such file); "
    assert err == line + "torch's kernels run\n", err
    assert "the kernels did not compile here" in out and "kernels kept in  " in out

"""The CUDA paths that a CPU can show: one contiguous copy per batch, no per-step host syncs (fp16 included)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from nanogpt_cli.data.batches import Batches
from nanogpt_cli.training.distributed import ProcessGroup
from nanogpt_cli.training.trainer import train
from conftest import tiny_plan


def test_a_batch_is_one_contiguous_block_pinned_for_cuda(char_data):
    data_dir, name = char_data
    batches = Batches(data_dir, name, block_size=8, batch_size=4, device=torch.device("cpu"), seed=0)
    starts = batches.draw("train")
    windows = torch.from_numpy(batches.splits["train"].read(starts, 9).astype(np.int64))
    assert windows.is_contiguous() and windows.shape == (4, 9)  # one block: one copy
    if torch.cuda.is_available():  # pinning needs an accelerator: there the block is pinned and copied whole
        gpu = Batches(data_dir, name, block_size=8, batch_size=4, device=torch.device("cuda"), seed=0)
        x, y = gpu.load("train", starts)
        assert torch.equal(x.cpu(), windows[:, :-1]) and torch.equal(y.cpu(), windows[:, 1:])
    x, y = batches.load("train", starts)
    assert torch.equal(x, windows[:, :-1]) and torch.equal(y, windows[:, 1:])
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the inputs shifted by one


class CountItems(TorchFunctionMode):
    """Counts Tensor.item() calls (each one makes the host wait for the device) without replacing anything."""

    def __init__(self):
        super().__init__()
        self.items = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item:
            self.items += 1
        return func(*args, **(kwargs or {}))


def items_in_a_run(data_dir, name, run_dir, world, **flags) -> int:
    plan = tiny_plan(data_dir, name, run_dir, eval_interval=10**6, log_interval=10, warmup_iters=0, **flags)
    with CountItems() as counter:
        train(plan, world=world)
    return counter.items


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_distributed_loop_waits_for_the_device_per_log_line_not_per_update(char_data, tmp_path, dtype):
    data_dir, name = char_data
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        world = ProcessGroup(torch.device("cpu"), rank=0, local_rank=0, size=1)
        short = items_in_a_run(data_dir, name, tmp_path / "a", world, max_iters=10, dtype=dtype)
        long = items_in_a_run(data_dir, name, tmp_path / "b", world, max_iters=20, dtype=dtype)
    finally:
        dist.destroy_process_group()
    assert short > 0  # the counter sees the loop's reads (the log line's loss, the agreed stop flag)
    per_log_line = long - short  # ten more updates: one more progress line and check, not ten more syncs
    assert 0 < per_log_line < 10, (short, long)


def test_rope_keeps_q_and_k_in_the_autocast_dtype():
    from nanogpt_cli.model import apply_rope, rope_tables

    cos, sin = rope_tables(torch.arange(8), head_size=16, theta=10000.0)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert apply_rope(x, cos, sin).dtype == torch.bfloat16
    expected = apply_rope(x.float(), cos, sin)
    assert torch.allclose(apply_rope(x, cos, sin).float(), expected, atol=0.05)  # rotated alike, in bf16


def test_a_model_cast_to_bf16_keeps_fp32_rope_tables():
    from nanogpt_cli.model import GPT
    from conftest import tiny_config

    torch.manual_seed(0)
    model = GPT(tiny_config(pos_encoding="rope"))
    idx = torch.randint(0, model.config.vocab_size, (1, 8))
    reference = model(idx)[0]
    model.cast(torch.bfloat16)
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    logits = model(idx)[0]
    assert logits.dtype == torch.bfloat16 and (logits.float() - reference).abs().max() < 0.1


def padded_twin(model, padded_vocab: int):
    """The same model with its vocabulary padded; the padding rows are made the most likely tokens, so any
    place that let them through would show."""
    from dataclasses import replace

    from nanogpt_cli.model import GPT

    twin = GPT(replace(model.config, vocab_size=padded_vocab))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    V = model.config.vocab_size
    for key in ("transformer.wte.weight", "lm_head.weight"):
        big = twin.state_dict()[key].clone()
        big[:V] = state[key]
        big[V:] = state[key][:1] * 50  # far above every real row's logit
        state[key] = big
    twin.load_state_dict(state)
    return twin.eval()


def test_a_padded_vocabulary_samples_and_scores_exactly_as_the_unpadded_one():
    from nanogpt_cli.inference.engine import Engine, SamplingParams
    from nanogpt_cli.inference.evaluate import score_tokens
    from nanogpt_cli.model import GPT
    from conftest import tiny_config

    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=100)).eval()
    padded = padded_twin(model, 128)

    def sample(m, vocab_size):
        engine = Engine(m, max_batch=1, vocab_size=vocab_size)
        engine.add_many([[1, 2, 3]], SamplingParams(temperature=1.0), 12, [torch.Generator().manual_seed(7)])
        return [t.token for t in engine.run()]

    assert sample(padded, 100) == sample(model, 100)
    tokens = torch.randint(0, 100, (40,))
    nll, n = score_tokens(model, tokens, None, 4)
    padded_nll, padded_n = score_tokens(padded, tokens, None, 4, vocab_size=100)
    assert n == padded_n and abs(nll - padded_nll) < 1e-3 * n
    assert score_tokens(padded, tokens, None, 4)[0] > nll + n  # unmasked, the padding would take the mass


def test_gpt2_runs_get_a_vocabulary_padded_to_a_multiple_of_64():
    from nanogpt_cli.training.plan import padded_vocab_size

    assert padded_vocab_size({"tokenizer": {"name": "gpt2"}, "vocab_size": 50257}) == 50304
    assert padded_vocab_size({"tokenizer": {"name": "char"}, "vocab_size": 65}) == 65

"""The engine's decoding form (decode_plan: packed and transposed weight copies) is built once per model and shared
by every engine on it, and built again after any change to the weights, the modules or the training mode: a new
engine always decodes the model as it is now."""

import copy

import torch

from nanogpt_cli.inference.backends import native
from nanogpt_cli.inference.backends.cpu import decode_plan
from nanogpt_cli.inference.backends.quantize import quantize_model
from nanogpt_cli.inference.engine import Engine, SamplingParams
from nanogpt_cli.model import GPT
from conftest import tiny_config as tiny

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 14, 15, 9, 2, 6]


def model_of(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(norm="rmsnorm", mlp="swiglu")).eval().to(dtype)


def first_logits(model: GPT) -> torch.Tensor:
    """The next-token logits after PROMPT, from a new engine's prefill and one decode step."""
    engine = Engine(model, max_batch=1)
    engine.add(PROMPT, GREEDY, 4)
    engine.step()
    return engine.logits.clone()


def test_two_engines_on_one_bf16_model_share_one_plan_and_its_copies():
    model = model_of(torch.bfloat16)
    a, b = Engine(model), Engine(model)
    assert a.plan is b.plan and a.plan.ops.blocks[0] is b.plan.ops.blocks[0]  # the blocks' copies bound once
    if native.available():  # the head in our kernel's tiled layout, one copy for both engines
        assert a.plan.head_native is not None and a.plan.head_native is b.plan.head_native
    elif torch.ops.mkldnn._is_mkldnn_bf16_supported():  # the head in oneDNN's layout
        assert a.plan.head_packed is not None and a.plan.head_packed is b.plan.head_packed
    assert decode_plan(model, 40) is not a.plan  # another vocabulary cut: another plan


def test_an_optimizer_step_gives_the_next_engine_the_new_weights():
    model = model_of()
    before = first_logits(model)
    plan = decode_plan(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # writes without bumping _version
    idx = torch.tensor([PROMPT])
    _, loss = model(idx, targets=idx)
    loss.backward()
    optimizer.step()
    model.eval()
    after = first_logits(model)
    assert decode_plan(model) is not plan
    assert (after - before).abs().max() > 1e-3  # the step shows ...
    fresh = GPT(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(after, first_logits(fresh), atol=1e-6, rtol=0)  # ... as in a model built anew


def test_copy_into_the_weights_new_data_load_state_dict_and_the_training_mode_each_rebuild_the_plan():
    model, other = model_of(torch.bfloat16), model_of(torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    expected = first_logits(other)
    plan = decode_plan(model)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.copy_(other.transformer.h[0].mlp.c_fc.weight)
    rebuilt = decode_plan(model)
    assert rebuilt is not plan
    model.transformer.h[1].mlp.c_fc.weight.data = other.transformer.h[1].mlp.c_fc.weight.detach().clone()
    assert decode_plan(model) is not rebuilt  # a new storage under the same parameter, at the same version
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(first_logits(model), expected, atol=0, rtol=0)
    plan = decode_plan(model)
    model.train()
    assert decode_plan(model) is not plan
    model.eval()


def test_replaced_modules_and_copies_of_the_model_get_their_own_plan():
    model = model_of()
    plan = decode_plan(model)
    twin = copy.deepcopy(model)  # starts without a plan: the original's copies are not the twin's weights
    assert decode_plan(twin) is not plan and decode_plan(model) is plan
    torch.testing.assert_close(first_logits(twin), first_logits(model), atol=0, rtol=0)
    model.to(torch.bfloat16)  # the same parameters, their data cast in place
    cast = decode_plan(model)
    assert cast is not plan and cast.head.dtype == torch.bfloat16
    torch.testing.assert_close(first_logits(model), first_logits(twin.to(torch.bfloat16)), atol=0, rtol=0)
    quantize_model(model, "int8")
    quantized = decode_plan(model)
    assert quantized is not cast
    torch.testing.assert_close(first_logits(model), first_logits(quantize_model(twin, "int8")), atol=0, rtol=0)
    assert decode_plan(model) is quantized

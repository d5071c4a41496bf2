"""Exports of fine-tuned runs, checked with the libraries users load them with: a LoRA run as a PEFT adapter on
the Hugging Face export of its base (peft.PeftModel) equals our model and the --merge export, for GPT-2, Llama
and GPT-NeoX shaped runs; the exports keep the chat template (transformers, gguf)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from nanogpt_cli.data.chat import DEFAULT_TEMPLATE, ChatTemplate
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.export import export
from nanogpt_cli.lora import LoRAConfig
from nanogpt_cli.tokenizer import build_tokenizer
from nanogpt_cli.training.finetune import plan_finetune
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import Trainer
from conftest import tiny_plan

pytestmark = pytest.mark.slow  # transformers and peft load every model

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse abc."},
        {"role": "assistant", "content": "cba"},
    ],
]
SHAPES = {  # our flags -> the stock architecture they export as
    "gpt2": dict(pos_encoding="learned", mlp="gelu_tanh", bias=True),
    "llama": dict(norm="rmsnorm", mlp="swiglu", bias=True, tie_embeddings=False),
    "neox": dict(bias=True),
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from nanogpt_cli.data.chat import prepare_chat

    root = tmp_path_factory.mktemp("chat")
    src = root / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) for i in range(40)) + "\n")
    prepare_chat(str(src), "chats", data_dir=str(root / "data"), tokenizer="byte")
    return root / "data", "chats"


def lora_run(chat_data, root, shape: str):
    """A base of this shape trained a few steps, and a LoRA fine-tune on every projection of it."""
    data_dir, name = chat_data
    base = root / "base"
    Trainer(tiny_plan(data_dir, name, base, max_iters=2, eval_interval=2, eval_iters=1, **SHAPES[shape])).fit()
    values = dict(data=name, data_dir=str(data_dir), dtype="float32", device="cpu", max_iters=4, eval_interval=4)
    values.update(eval_iters=1, batch_size=4, warmup_iters=0, learning_rate=3e-2)
    lora = LoRAConfig(r=4, alpha=8, dropout=0.1, targets=("all",))
    job = plan_finetune(RunRequest(values, out=root / "lora", init_from=str(base)), lora=lora)
    Trainer(job.plan, trainable=job.trainable).fit()
    return base, root / "lora"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_peft_adapter_equals_our_lora_model_and_the_merged_export(chat_data, tmp_path, shape):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from nanogpt_cli.interop.loading import load_lora
    from nanogpt_cli.interop.source import parse_source

    base, run = lora_run(chat_data, tmp_path, shape)
    export(base, "hf", tmp_path / "base-hf")
    result = export(run, "peft", tmp_path / "adapter", base=tmp_path / "base-hf")
    export(run, "hf", tmp_path / "merged", merge=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert result.format == "peft" and config["fan_in_fan_out"] == (shape == "gpt2")
    assert all(".h." in t or ".layers." in t for t in config["target_modules"])  # exact paths, no bare suffix

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf")
        tuned = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    ours, _ = load_lora(parse_source(run / "model.safetensors"), merge=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = tuned(idx).logits
        ours_logits = ours.eval()(idx)[0]
        assert torch.allclose(theirs, ours_logits, atol=1e-5, rtol=0)
        assert torch.allclose(theirs, merged(idx).logits, atol=1e-5, rtol=0)
    with torch.no_grad(), tuned.disable_adapter():  # and the adapter matters: the base alone differs
        assert not torch.allclose(theirs, tuned(idx).logits, atol=1e-4)


def test_lora_exports_need_merge_or_peft_and_the_right_base(chat_data, tmp_path):
    base, run = lora_run(chat_data, tmp_path, "gpt2")
    with pytest.raises(NanoGPTError, match="export it with --merge"):
        export(run, "hf", tmp_path / "x")
    with pytest.raises(NanoGPTError, match="needs --base: the Hugging Face export of the run.s base"):
        export(run, "peft", tmp_path / "x")
    with pytest.raises(NanoGPTError, match="holds whole weights"):
        export(base, "hf", tmp_path / "x", merge=True)
    other = tmp_path / "other"
    Trainer(tiny_plan(*chat_data, other, max_iters=1, eval_interval=1, eval_iters=1, **SHAPES["gpt2"])).fit()
    export(other, "hf", tmp_path / "other-hf")
    with pytest.raises(NanoGPTError, match="does not hold this run.s base weights"):
        export(run, "peft", tmp_path / "x", base=tmp_path / "other-hf")
    assert not (tmp_path / "x").exists()


def test_hf_export_renders_the_runs_chats_and_stops_at_the_turn_end(chat_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, run = lora_run(chat_data, tmp_path, "llama")
    export(run, "hf", tmp_path / "merged", merge=True)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    byte = build_tokenizer("byte")
    for messages in CONVERSATIONS:  # with and without a system turn
        ids, mask = ChatTemplate(DEFAULT_TEMPLATE).tokens_and_mask(messages, byte)
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids.tolist() and out["assistant_masks"] == mask.tolist()
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert generation["stop_strings"] == ["<|endoftext|>"]  # several byte tokens: a stop string, not an id


def test_gguf_export_has_the_chat_template(chat_data, tmp_path):
    gguf = pytest.importorskip("gguf")
    _, run = lora_run(chat_data, tmp_path, "gpt2")
    export(run, "gguf", tmp_path / "chat.gguf", merge=True)
    reader = gguf.GGUFReader(str(tmp_path / "chat.gguf"))
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    assert "{% generation" not in template and "endgeneration" not in template and "message['role']" in template

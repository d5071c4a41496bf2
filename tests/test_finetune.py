"""Fine-tuning: LoRA adapters on a frozen base (step 0 is the base, only adapters train, merged equals base +
adapters, exact resume), full fine-tuning, the masked loss's guard and trained-token speed, the record a run keeps
(base hash, chat template), and the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.lora import LoRAConfig, adapters, add_lora, merge_lora, parse_targets
from nanogpt_cli.model import GPT
from nanogpt_cli.training.finetune import plan_finetune
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import Trainer
from conftest import tiny_config, tiny_plan

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse abc."},
        {"role": "assistant", "content": "cba"},
    ],
]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A byte-level chat dataset: (data_dir, name)."""
    from nanogpt_cli.data.chat import prepare_chat

    root = tmp_path_factory.mktemp("chat")
    src = root / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) for i in range(40)) + "\n")
    prepare_chat(str(src), "chats", data_dir=str(root / "data"), tokenizer="byte")
    return root / "data", "chats"


@pytest.fixture(scope="module")
def base_run(chat_data, tmp_path_factory):
    """A tiny byte model trained a few steps: the base the fine-tunes start from."""
    data_dir, name = chat_data
    run = tmp_path_factory.mktemp("base") / "base"
    Trainer(tiny_plan(data_dir, name, run, max_iters=4, eval_interval=4, eval_iters=1, block_size=32)).fit()
    return run


def finetune_run(chat_data, base_run, out, lora=None, **flags):
    data_dir, name = chat_data
    values = dict(data=name, data_dir=str(data_dir), dtype="float32", device="cpu", max_iters=6, eval_interval=3)
    values.update(eval_iters=1, batch_size=4, warmup_iters=0, learning_rate=1e-2, log_interval=1, **flags)
    job = plan_finetune(RunRequest(values, out=out, init_from=str(base_run)), lora=lora)
    return job, Trainer(job.plan, trainable=job.trainable)


def test_lora_at_step_zero_is_the_base_exactly():
    torch.manual_seed(0)
    model = GPT(tiny_config(bias=True))
    idx = torch.randint(0, 61, (2, 16))
    before = model(idx)[0]
    params = add_lora(model, LoRAConfig(r=4, targets=("all",)))
    assert len(params) == 2 * 4 * 2  # A and B, four projections, two blocks
    assert torch.equal(model(idx)[0], before)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n in dict(model.named_parameters()) if n.endswith(("lora_A", "lora_B"))
    ]


def test_merged_weights_give_the_logits_of_base_plus_adapters():
    torch.manual_seed(0)
    model = GPT(tiny_config(mlp="swiglu", norm="rmsnorm"))
    add_lora(model, LoRAConfig(r=2, alpha=8, targets=("attn", "mlp")))
    with torch.no_grad():
        for layer in adapters(model).values():
            layer.lora_B.normal_(0, 0.1)
    model.eval()
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        adapted = model(idx)[0]
        merged = merge_lora(model)(idx)[0]
    assert not adapters(model) and not torch.equal(adapted, GPT(tiny_config())(idx)[0])
    assert torch.allclose(adapted, merged, atol=1e-5)


def lora_step_grads(model, idx, dtype):
    """The loss and the adapters' gradients of one step under autocast to dtype."""
    with torch.autocast("cpu", dtype):
        loss = model(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied", [True, False])
def test_a_frozen_base_held_in_bf16_computes_what_autocast_over_fp32_did(tied):
    import copy

    from nanogpt_cli.lora import hold_frozen

    torch.manual_seed(0)
    model = GPT(tiny_config(mlp="swiglu", norm="rmsnorm", tie_embeddings=tied, n_kv_head=2))
    add_lora(model, LoRAConfig(r=2, targets=("attn", "mlp.c_fc")))
    with torch.no_grad():
        for layer in adapters(model).values():
            layer.lora_B.normal_(0, 0.1)  # B = 0 would leave A without a gradient
    held = copy.deepcopy(model)
    assert hold_frozen(held, torch.bfloat16) == 2 * 4 + 1  # the four projections of each of two blocks, and the head
    assert held.lm_head.weight.dtype == torch.bfloat16 and held.lm_head.weight is not held.transformer.wte.weight
    assert held.transformer.wte.weight.dtype == torch.float32  # the lookup as exact as before
    assert all(p.dtype == torch.float32 for n, p in held.named_parameters() if p.requires_grad)
    assert held.transformer.h[0].mlp.c_proj.weight.dtype == torch.bfloat16
    idx = torch.randint(0, 61, (2, 16))
    loss, grads = lora_step_grads(model, idx, torch.bfloat16)
    held_loss, held_grads = lora_step_grads(held, idx, torch.bfloat16)
    assert torch.equal(loss, held_loss) and grads.keys() == held_grads.keys()
    assert all(torch.equal(grads[n], held_grads[n]) for n in grads)  # bit for bit
    assert hold_frozen(held, torch.bfloat16) == 0  # nothing left to cast


def test_hold_frozen_leaves_a_model_that_trains_every_weight_alone():
    from nanogpt_cli.lora import hold_frozen

    model = GPT(tiny_config())
    assert hold_frozen(model, torch.bfloat16) == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_targets_and_bad_lora_values():
    assert parse_targets(["attn,mlp.c_fc"]) == ("attn.c_attn", "attn.c_proj", "mlp.c_fc")
    with pytest.raises(NanoGPTError, match="unknown projection 'q_proj'"):
        LoRAConfig(targets=("q_proj",))
    with pytest.raises(NanoGPTError, match="--lora-r must be a positive integer"):
        LoRAConfig(r=0)


def test_lora_sets_a_presets_muon_and_embedding_lr_aside(chat_data, tmp_path):
    data_dir, name = chat_data
    base = tmp_path / "untied"
    Trainer(tiny_plan(data_dir, name, base, max_iters=2, eval_iters=1, block_size=32, tie_embeddings=False)).fit()
    values = dict(preset="cpu-fast", data=name, data_dir=str(data_dir))
    job = plan_finetune(RunRequest(values, out=tmp_path / "a", init_from=str(base)), lora=LoRAConfig(r=2))
    assert job.plan.train.optimizer == "adamw" and job.plan.train.embedding_lr is None
    assert "the preset's --optimizer muon and --embedding-lr 0.06 set aside" in job.plan.notes[-1]
    with pytest.raises(NanoGPTError, match="LoRA keeps the token embedding frozen"):
        plan_finetune(
            RunRequest({**values, "embedding_lr": 0.01}, out=tmp_path / "b", init_from=str(base)), lora=LoRAConfig(r=2)
        )
    full = plan_finetune(RunRequest({**values, "embedding_lr": 0.01}, out=tmp_path / "c", init_from=str(base)))
    assert full.plan.train.optimizer == "muon" and full.plan.train.embedding_lr == 0.01  # full fine-tuning keeps both


def test_lora_run_trains_only_adapters_and_saves_them_with_its_base(chat_data, base_run, tmp_path):
    from nanogpt_cli.interop.loading import load_lora, load_model
    from nanogpt_cli.interop.source import parse_source
    from nanogpt_cli.runs.checkpoint import read_metadata

    job, trainer = finetune_run(chat_data, base_run, tmp_path / "lora", LoRAConfig(r=4, targets=("attn", "mlp")))
    trainer.fit()
    saved = load_file(str(tmp_path / "lora" / "model.safetensors"))
    assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved)  # the adapters only
    optimizer = load_file(str(tmp_path / "lora" / "optimizer.safetensors"))
    assert {k.split(".")[1] for k in optimizer} == {str(i) for i in range(len(saved))}  # their state only
    meta = read_metadata(tmp_path / "lora" / "model.safetensors")
    base, _ = load_model(base_run)
    assert meta["base"]["sha256"] == job.plan.finetune["weights"]["base"]["sha256"]
    assert meta["chat_template"].startswith("{% set eos_token = '<|endoftext|>' %}")  # byte: no end token
    model, plain = load_lora(parse_source(tmp_path / "lora" / "model.safetensors"), merge=False)
    for name, t in base.state_dict().items():  # the base did not move
        assert torch.equal(model.state_dict()[name], t) and torch.equal(plain.state_dict()[name], t)
    assert all(layer.lora_B.abs().sum() > 0 for layer in adapters(model).values())  # the adapters did
    # sample, serve and eval load the run as one model: base + merged adapters
    merged, _ = load_model(tmp_path / "lora")
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(merged.eval()(idx)[0], model.eval()(idx)[0], atol=1e-5)


def test_a_bf16_lora_run_holds_its_base_in_bf16_trains_and_merges(chat_data, base_run, tmp_path):
    from nanogpt_cli.interop.loading import load_lora, load_model
    from nanogpt_cli.interop.source import parse_source
    from nanogpt_cli.training.events import NoDisplay

    class Losses(NoDisplay):
        def __init__(self):
            self.losses = []

        def on_eval(self, event):
            self.losses.append(event.train_loss)

    lora = LoRAConfig(r=4, targets=("attn", "mlp"))
    job, _ = finetune_run(chat_data, base_run, tmp_path / "bf16", lora, dtype="bfloat16", max_iters=16)
    shown = Losses()
    trainer = Trainer(job.plan, shown, trainable=job.trainable)
    trainer.fit()
    model = trainer.parts.model
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16  # held, not cast every step
    assert model.transformer.wte.weight.dtype == torch.float32
    assert len(shown.losses) > 2 and shown.losses[-1] < shown.losses[0] - 0.05  # it trains: on fixed batches
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert saved and all(t.dtype == torch.float32 for t in saved.values())  # the adapters as they trained
    adapted, _ = load_lora(parse_source(tmp_path / "bf16" / "model.safetensors"), merge=False)
    merged, _ = load_model(tmp_path / "bf16")  # on the float32 base the run recorded
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(merged.eval()(idx)[0], adapted.eval()(idx)[0], atol=1e-5)


def test_lora_resume_is_exact(chat_data, base_run, tmp_path):
    lora = LoRAConfig(r=2, dropout=0.1)
    finetune_run(chat_data, base_run, tmp_path / "once", lora)[1].fit()
    finetune_run(chat_data, base_run, tmp_path / "twice", lora, stop_at=3)[1].fit()
    data_dir, name = chat_data
    job = plan_finetune(RunRequest({"data": name, "data_dir": str(data_dir)}, out=tmp_path / "twice", resume=True))
    assert job.lora == lora and job.plan.init_weights is not None
    Trainer(job.plan, trainable=job.trainable).fit()
    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("once", "twice"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(NanoGPTError, match="--lora-r"):
        again = {"data": name, "data_dir": str(data_dir)}
        plan_finetune(RunRequest(again, out=tmp_path / "twice", resume=True), lora=LoRAConfig(r=3))


def test_lora_refuses_a_changed_base(chat_data, base_run, tmp_path):
    import shutil

    from nanogpt_cli.interop.loading import load_model

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    finetune_run(chat_data, base, tmp_path / "lora", LoRAConfig(r=2), max_iters=2, eval_interval=2)[1].fit()
    Trainer(tiny_plan(*chat_data, tmp_path / "other", max_iters=1, eval_interval=1, eval_iters=1, block_size=32)).fit()
    shutil.copy(tmp_path / "other" / "best.safetensors", base / "best.safetensors")
    with pytest.raises(NanoGPTError, match="other base weights"):
        load_model(tmp_path / "lora")


def test_full_finetune_trains_every_weight_and_keeps_the_template(chat_data, base_run, tmp_path):
    from nanogpt_cli.interop.loading import load_model
    from nanogpt_cli.runs.checkpoint import read_metadata

    job, trainer = finetune_run(chat_data, base_run, tmp_path / "full")
    assert job.lora is None and job.trainable is None
    trainer.fit()
    tuned, _ = load_model(tmp_path / "full")
    base, _ = load_model(base_run)
    assert all(not torch.equal(tuned.state_dict()[k], t) for k, t in base.state_dict().items() if t.dim() == 2)
    meta = read_metadata(tmp_path / "full" / "model.safetensors")
    assert "chat_template" in meta and "lora" not in meta
    assert json.loads((tmp_path / "full" / "config.json").read_text())["finetune"]["method"] == "full"


def test_a_batch_with_no_trained_target_has_zero_loss_not_nan():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    x = torch.randint(0, 61, (2, 16))
    _, loss = model(x, torch.full((2, 16), -1))
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_speed_counts_the_trained_tokens_of_a_chat_dataset(chat_data, base_run, tmp_path):
    from nanogpt_cli.data.batches import Batches
    from nanogpt_cli.training.events import NoDisplay

    class Lines(NoDisplay):
        def __init__(self):
            self.steps = []

        def on_step(self, event):
            self.steps.append(event)

    job, _ = finetune_run(chat_data, base_run, tmp_path / "speed", LoRAConfig(r=2))
    shown = Lines()
    result = Trainer(job.plan, shown, trainable=job.trainable).fit()
    # the same stream of training batches, drawn again: how many targets each update trained on
    cfg, data_dir = job.plan.train, chat_data[0]
    again = Batches(data_dir, cfg.data, job.plan.model.block_size, cfg.batch_size, torch.device("cpu"), cfg.seed)
    trained = [int((again.get_batch("train")[1] != -1).sum()) for _ in range(cfg.max_iters)]
    assert 0 < max(trained) < cfg.batch_size * job.plan.model.block_size  # a batch of prompts only trains on none
    for event, n in zip(shown.steps, trained):  # a line per update (--log-interval 1)
        assert event.tokens_per_s * event.ms_per_iter / 1000 == pytest.approx(n, rel=1e-6)
    assert result.tokens_per_s * result.ms_per_iter / 1000 == pytest.approx(sum(trained) / len(trained), rel=1e-6)


def test_cli_finetune(chat_data, base_run, tmp_path):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.interop.loading import load_model

    data_dir, name = chat_data
    common = ["--data", name, "--data-dir", str(data_dir), "--device", "cpu", "--dtype", "float32", "-q"]
    runner = CliRunner()
    missing = runner.invoke(app, ["finetune", *common, "--out", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "finetune needs --init-from" in missing.output
    out = str(tmp_path / "lora")
    args = ["finetune", "--init-from", str(base_run), *common, "--out", out, "--lora-r", "2", "--eval-iters", "1"]
    ok = runner.invoke(app, [*args, "--max-iters", "2", "--eval-interval", "2", "--stop-at", "1"])
    assert ok.exit_code == 0, ok.output
    resumed = runner.invoke(app, ["train", "--out", out, "--resume"])  # train resumes a LoRA run too
    assert resumed.exit_code == 0, resumed.output
    # its start lines say LoRA, with the parameters that train: the adapters the run saves
    adapters = load_file(str(tmp_path / "lora" / "model.safetensors"))
    trainable = sum(t.numel() for n, t in adapters.items() if "lora_" in n)
    total = sum(p.numel() for p in load_model(base_run)[0].parameters()) + trainable
    assert (
        f"fine-tune: supervised, LoRA r 2, alpha 16 on attn.c_attn; {trainable:,} trainable params "
        f"({trainable / total:.2%} of {total:,}), the base frozen"
    ) in resumed.output
    assert json.loads((tmp_path / "lora" / "trainer.json").read_text())["step"] == 2
    info = runner.invoke(app, ["info", out, "--json"])
    assert json.loads(info.output)["finetune"].startswith("LoRA r 2, alpha 16, dropout 0 on attn.c_attn; adapters")
    # train --init-from on a chat dataset is the same full fine-tune, and says that finetune has LoRA
    common = [a for a in common if a != "-q"]
    full = ["train", "--init-from", str(base_run), *common, "--out", str(tmp_path / "full"), "--eval-iters", "1"]
    trained = runner.invoke(app, [*full, "--max-iters", "1", "--eval-interval", "1"])
    assert trained.exit_code == 0, trained.output
    assert f"fine-tune: supervised, full; every weight trains ({total - trainable:,} params)" in trained.output
    assert "`nanogpt finetune` does the same" in trained.output
    assert json.loads((tmp_path / "full" / "config.json").read_text())["finetune"]["method"] == "full"


def test_hf_base_offline_is_one_sentence(chat_data, tmp_path, no_network, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the switch and the cache's place once, when first imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    data_dir, name = chat_data
    with pytest.raises(NanoGPTError, match="hf:gpt2 is not in the Hugging Face cache .* HF_HUB_OFFLINE") as e:
        plan_finetune(RunRequest({"data": name, "data_dir": str(data_dir)}, out=tmp_path / "x", init_from="hf:gpt2"))
    assert "\n" not in str(e.value)


def test_sample_and_serve_format_chats_with_the_runs_template(chat_data, base_run, tmp_path):
    from nanogpt_cli.data.chat import ChatTemplate as PrepareTemplate
    from nanogpt_cli.interop.loading import load_for_inference
    from nanogpt_cli.serve.chat import ChatTemplate

    finetune_run(chat_data, base_run, tmp_path / "lora", LoRAConfig(r=2), max_iters=1, eval_interval=1)[1].fit()
    loaded = load_for_inference(tmp_path / "lora", device="cpu")
    template = ChatTemplate.for_meta(loaded.meta)  # what serve (and chat) format conversations with
    assert template.name == "checkpoint" and template.stop == ["<|endoftext|>"]  # byte: the end is a stop text
    messages = CONVERSATIONS[1]
    prepared = PrepareTemplate().render(messages, add_generation_prompt=False)
    assert template.render(messages, add_generation_prompt=False) == prepared
    assert template.render(messages[:2]).endswith("<|endoftext|>assistant:")


def test_evaluation_batches_of_a_chat_dataset_each_score_a_trained_target(tmp_path):
    from nanogpt_cli.data.batches import Batches
    from nanogpt_cli.data.chat import prepare_chat

    src = tmp_path / "long.jsonl"  # long prompts, one-letter replies: most 17-token windows are prompt only
    row = {"messages": [{"role": "user", "content": "tell me " * 20}, {"role": "assistant", "content": "k"}]}
    src.write_text("\n".join(json.dumps(row) for _ in range(12)) + "\n")
    prepare_chat(str(src), "long", data_dir=str(tmp_path / "data"), tokenizer="byte")
    batches = Batches(tmp_path / "data", "long", 16, 1, torch.device("cpu"), seed=0)
    g = torch.Generator().manual_seed(0)
    assert any(not (batches.get_batch("train", g)[1] != -1).any() for _ in range(20))  # plain draws: some score none
    assert all((y != -1).any() for _, y in batches.fixed_batches("train", 20, seed=1))


def test_no_loss_mask_trains_on_every_token_of_the_conversations(chat_data):
    from nanogpt_cli.data.batches import Batches

    data_dir, name = chat_data
    masked, every = (Batches(data_dir, name, 64, 4, torch.device("cpu"), 0, loss_mask=m) for m in (True, False))
    starts = masked.draw("train")
    (x, y), (x2, y2) = masked.load("train", starts), every.load("train", starts)
    assert torch.equal(x, x2) and (y2 != -1).sum() > (y != -1).sum() > 0
    assert [int((row != -1).sum()) for row in y2] == [n - 1 for _, _, n in starts]  # all but the padding


def test_a_lora_run_is_a_base_too(chat_data, base_run, tmp_path):
    from nanogpt_cli.interop.loading import load_model

    finetune_run(chat_data, base_run, tmp_path / "first", LoRAConfig(r=2), max_iters=2, eval_interval=2)[1].fit()
    job, trainer = finetune_run(chat_data, tmp_path / "first", tmp_path / "second", LoRAConfig(r=2), stop_at=1)
    merged, _ = load_model(tmp_path / "first")
    assert all(torch.equal(job.plan.init_model.state_dict()[k], t) for k, t in merged.state_dict().items())
    trainer.fit()
    assert job.plan.init_model is None  # copied into the run's model, then let go: not held twice
    data_dir, name = chat_data
    again = plan_finetune(RunRequest({"data": name, "data_dir": str(data_dir)}, out=tmp_path / "second", resume=True))
    Trainer(again.plan, trainable=again.trainable).fit()  # its base (the first run, merged) loads and checks out
    assert load_model(tmp_path / "second")[1]["step"] == 6


def test_seq_len_trains_on_windows_of_that_length_and_the_model_keeps_its_context(chat_data, base_run, tmp_path):
    """--seq-len 16 on a base whose context is 32: every batch trained and evaluated on is 16 tokens long, the tokens
    counted are those, and the run's model keeps the context of 32."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app
    from nanogpt_cli.interop.loading import load_model
    from nanogpt_cli.training.events import NoDisplay

    class Start(NoDisplay):
        def on_start(self, event):
            self.started = event

    job, _ = finetune_run(chat_data, base_run, tmp_path / "short", LoRAConfig(r=2), seq_len=16, max_iters=3)
    shown = Start()
    trainer = Trainer(job.plan, shown, trainable=job.trainable)
    result = trainer.fit()
    parts, B = trainer.parts, job.plan.train.batch_size
    assert parts.batches.get_batch("train")[0].shape == (B, 16)
    assert {tuple(x.shape) for split in parts.eval_sets.values() for x, _ in split} == {(B, 16)}
    assert shown.started.tokens_per_iter == B * 16 and result.tokens == 3 * B * 16
    assert parts.flops_per_token == parts.model.flops_per_token(16) < parts.model.flops_per_token()
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    assert config["train"]["seq_len"] == 16 and config["model"]["block_size"] == 32
    merged, _ = load_model(tmp_path / "short")
    assert merged.config.block_size == 32
    runner = CliRunner()
    shown = json.loads(runner.invoke(app, ["info", str(tmp_path / "short"), "--json"]).output)
    assert shown["seq_len"] == 16 and shown["model"]["block_size"] == 32
    table = runner.invoke(app, ["info", str(tmp_path / "short")]).output
    assert re.search(r"training sequences\s*│\s*16 tokens \(--seq-len\)", table), table


def test_seq_len_longer_than_the_context_is_one_sentence(chat_data, base_run, tmp_path):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    with pytest.raises(NanoGPTError, match=r"--seq-len 64 is longer than the context of .* \(--block-size 32\)") as e:
        finetune_run(chat_data, base_run, tmp_path / "long", seq_len=64)
    assert "\n" not in str(e.value) and not (tmp_path / "long").exists()
    data_dir, name = chat_data  # a new model: its own --block-size is the context
    args = ["train", "--preset", "tiny", "--data", name, "--data-dir", str(data_dir), "--out", str(tmp_path / "new")]
    r = CliRunner().invoke(app, [*args, "--seq-len", "33"])
    assert r.exit_code == 1 and "--seq-len 33 is longer than the model's context (--block-size 32)" in r.output
    r = CliRunner().invoke(app, [*args, "--seq-len", "0"])
    assert r.exit_code == 1 and "--seq-len must be a positive integer, got 0" in r.output


def test_resume_keeps_the_seq_len_and_announces_a_change(chat_data, base_run, tmp_path):
    out = tmp_path / "run"
    finetune_run(chat_data, base_run, out, LoRAConfig(r=2), seq_len=16, stop_at=2)[1].fit()
    data_dir, name = chat_data
    values = {"data": name, "data_dir": str(data_dir)}
    job = plan_finetune(RunRequest(values, out=out, resume=True))
    assert job.plan.seq_len == 16 and not job.plan.changes  # the run's own, unless given
    trainer = Trainer(job.plan, trainable=job.trainable)
    result = trainer.fit()
    assert trainer.parts.batches.get_batch("train")[0].shape[1] == 16 and result.tokens == 6 * 4 * 16
    longer = plan_finetune(RunRequest({**values, "max_iters": 8, "seq_len": 32}, out=out, resume=True))
    assert longer.plan.seq_len == 32 and "--seq-len 16 -> 32 from step 6" in map(str, longer.plan.changes)
    with pytest.raises(NanoGPTError, match=r"--seq-len 40 is longer than the context of .* \(--block-size 32\)"):
        plan_finetune(RunRequest({**values, "max_iters": 8, "seq_len": 40}, out=out, resume=True))


def test_a_run_at_the_whole_context_is_unchanged_by_naming_it(chat_data, base_run, tmp_path):
    """--seq-len the context is the default's run: the same windows, and on resume no change to announce."""
    job, _ = finetune_run(chat_data, base_run, tmp_path / "a", max_iters=2, eval_interval=2)
    named, _ = finetune_run(chat_data, base_run, tmp_path / "b", max_iters=2, eval_interval=2, seq_len=32)
    assert job.plan.train.seq_len is None and job.plan.seq_len == named.plan.seq_len == 32
    Trainer(job.plan).fit()
    data_dir, name = chat_data
    values = {"data": name, "data_dir": str(data_dir), "max_iters": 3, "seq_len": 32}
    again = plan_finetune(RunRequest(values, out=tmp_path / "a", resume=True))
    assert [str(c) for c in again.plan.changes] == ["--max-iters 2 -> 3 from step 2"]


def test_a_setting_of_another_method_is_refused_before_anything_loads(tmp_path):
    """finetune --method sft with a DPO or GRPO setting: one sentence naming it, nothing written (the settings of
    each method are declared once, api.METHOD_SETTINGS)."""
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    for method, flag in (("sft", "--beta"), ("dpo", "--group-size"), ("grpo", "--rpo-alpha")):
        result = CliRunner().invoke(
            app, ["finetune", "--init-from", "missing", "--data", "x", "--method", method, flag, "2"]
            + ["--out", str(tmp_path / "run")],
        )  # fmt: skip
        assert result.exit_code == 1 and f"{flag} has no effect with --method {method}; drop it" in result.output
    assert not (tmp_path / "run").exists()

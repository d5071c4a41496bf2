"""Chat rows -> ids + loss mask, and parity with transformers' apply_chat_template on our gpt2 vocabulary."""

import json

import numpy as np
import pytest

from nanogpt_cli.data.chat import conversation, read_chat_lines
from nanogpt_cli.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import build_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse abc."},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "And xyz?"},
        {"role": "assistant", "content": "zyx, done.\nBye"},
    ],
]
NEWLINES = (  # newlines after the tags, which transformers' trim_blocks drops
    "{% for m in messages %}\n{{ m['role'] }}:\n{% if m['role'] == 'assistant' %}\n"
    "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n{% else %}\n{{ m['content'] }}\n"
    "{% endif %}\n{% endfor %}"
)
CUSTOM = (
    "{% for m in messages %}{{ '### ' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}"
    "{% endif %}{% endfor %}"
)


def test_mask_covers_assistant_content_and_its_end_token():
    tok = build_tokenizer("gpt2")
    ids, mask = ChatTemplate().tokens_and_mask(CONVERSATIONS[0], tok)
    assert len(ids) == len(mask)
    assert tok.decode(ids[mask == 1]) == " 5<|endoftext|>"
    assert ids[-1] == tok.eot_id and mask[-1] == 1
    assert tok.decode(ids[mask == 0]) == "user: What is 2+3?<|endoftext|>assistant:"


CHATML_NO_BLOCKS = (  # a model's own template, as most are: no {% generation %} blocks
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_without_generation_blocks_trains_on_each_reply_and_its_end():
    tok = build_tokenizer("byte")
    ids, mask = ChatTemplate(CHATML_NO_BLOCKS).tokens_and_mask(CONVERSATIONS[1], tok)
    trained = [tok.decode(ids[a:b].tolist()) for a, b in _runs(mask)]
    assert trained == ["cba<|im_end|>\n", "zyx, done.\nBye<|im_end|>\n"]
    assert tok.decode(ids.tolist()) == ChatTemplate(CHATML_NO_BLOCKS).render(CONVERSATIONS[1], False)
    # a template whose turns render differently once the conversation goes on cannot be split: one sentence
    shifting = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if not add_generation_prompt %}!{% endif %}"
    with pytest.raises(NanoGPTError, match="generation %} blocks"):
        ChatTemplate(shifting).tokens_and_mask(CONVERSATIONS[1], tok)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_byte_tokenizer_spells_the_end_marker():
    tok = build_tokenizer("byte")
    ids, mask = ChatTemplate().tokens_and_mask(CONVERSATIONS[0], tok)
    assert bytes(ids[mask == 1].tolist()) == b" 5<|endoftext|>"


@pytest.mark.parametrize("template", [DEFAULT_TEMPLATE, CUSTOM, NEWLINES])
def test_transformers_renders_the_same_ids_and_mask(template):
    transformers = pytest.importorskip("transformers")
    from nanogpt_cli.interop.hf import tokenizers_object

    ours = build_tokenizer("gpt2")
    backend, eot = tokenizers_object(ours.describe())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eot, chat_template=template)
    for messages in CONVERSATIONS:
        ids, mask = ChatTemplate(template).tokens_and_mask(messages, ours)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids.tolist()
        assert out["assistant_masks"] == mask.tolist()


def test_row_formats():
    assert conversation({"prompt": "p", "completion": "c"}) == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "c"},
    ]
    assert conversation({"instruction": "do", "input": "x", "output": "y"})[0]["content"] == "do\n\nx"


def test_bad_rows_are_counted_by_line_and_strict_stops_at_the_first():
    lines = [
        json.dumps({"messages": CONVERSATIONS[0]}),
        "{nope",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
    ]
    rows = read_chat_lines(lines)
    assert len(rows.conversations) == 1
    assert [n for n, _ in rows.bad] == [2, 3, 4, 5, 6]
    assert "robot" in rows.bad[2][1] and "no assistant" in rows.bad[3][1]
    with pytest.raises(NanoGPTError, match="line 2"):
        read_chat_lines(lines, strict=True)


def test_bad_template_is_one_sentence():
    with pytest.raises(NanoGPTError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert np.all(ChatTemplate().tokens_and_mask(CONVERSATIONS[1], build_tokenizer("gpt2"))[1][:3] == 0)


def test_prepare_chat_writes_mask_shards_listed_in_meta(tmp_path):
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.data.reader import open_split

    src = tmp_path / "chats.jsonl"
    rows = [{"messages": CONVERSATIONS[i % 2]} for i in range(9)] + [{"prompt": "a", "completion": "b"}, {"x": 1}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = prepare_chat(str(src), "chats", data_dir=str(tmp_path / "data"))
    assert result.conversations == 10 and [n for n, _ in result.bad] == [11]
    meta = json.loads((result.path / "meta.json").read_text())
    assert meta["chat_template"] == DEFAULT_TEMPLATE and meta["bad_rows"] == 1
    shard = meta["shards"]["train"][0]
    ids = np.fromfile(result.path / shard["file"], dtype=meta["dtype"])
    mask = np.fromfile(result.path / shard["mask"], dtype=np.uint8)
    assert len(ids) == len(mask) == meta["train_tokens"] and 0 < mask.sum() < len(mask)
    assert sum(open_split(tmp_path / "data", "chats", "train").counts) == meta["train_tokens"]


@pytest.mark.parametrize("tokenizer", ["gpt2", "char"])
def test_cli_prepare_format_chat(tmp_path, tokenizer):
    import subprocess
    import sys

    src = tmp_path / "chats.jsonl"
    src.write_text(
        "\n".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) for i in range(6))
        + '\n{"messages": [{"role": "user", "content": "no answer"}]}\n'
    )
    cmd = [
        sys.executable,
        "-m",
        "nanogpt_cli",
        "prepare",
        str(src),
        "--name",
        "c",
        "--format",
        "chat",
        "--data-dir",
        str(tmp_path / "data"),
        "--tokenizer",
        tokenizer,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "skipped line 7: the conversation has no assistant turn" in out.stdout
    assert json.loads((tmp_path / "data" / "c" / "meta.json").read_text())["masks"] is True
    strict = subprocess.run(cmd + ["--strict"], capture_output=True, text=True)
    assert strict.returncode == 1 and "line 7" in strict.stderr


def _chat_dataset(tmp_path, ones: bool = False):
    from nanogpt_cli.data.chat import prepare_chat

    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) for i in range(40)) + "\n")
    result = prepare_chat(str(src), "chats", data_dir=str(tmp_path / "data"), tokenizer="byte")
    if ones:
        meta = json.loads((result.path / "meta.json").read_text())
        for shards in meta["shards"].values():
            for s in shards:
                np.ones(s["tokens"], dtype=np.uint8).tofile(result.path / s["mask"])
    return tmp_path / "data"


def test_masked_targets_get_no_gradient(tmp_path):
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.data.batches import Batches
    from nanogpt_cli.model import GPT
    from nanogpt_cli.training.trainer import next_token_loss

    data = _chat_dataset(tmp_path)
    batches = Batches(data, "chats", 32, 4, torch.device("cpu"), seed=0)
    x, y = batches.get_batch("train")
    assert (y == -1).any() and (y != -1).any()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dropout=0.0))

    def grads(targets):
        model.zero_grad()
        next_token_loss(model, x, targets).backward()
        return [p.grad.clone() for p in model.parameters()]

    # the targets under mask 0, whatever they are, change nothing: a copy with other ids there gives equal grads
    other = y.clone()
    other[y == -1] = (x[y == -1] + 7) % 256  # made-up targets where the mask is 0 ...
    masked_again = other.masked_fill(y == -1, -1)  # ... masked as the reader masks them
    for a, b in zip(grads(y), grads(masked_again)):
        assert torch.equal(a, b)
    # and the mask matters: the unmasked targets give other gradients
    assert any(not torch.equal(a, b) for a, b in zip(grads(y), grads(other)))
    logits, loss = model(x, y)
    keep = y != -1
    expect = torch.nn.functional.cross_entropy(logits[keep].float(), y[keep])
    assert torch.allclose(loss, expect)


def test_all_ones_mask_reads_like_plain_tokens(tmp_path):
    import torch

    from nanogpt_cli.data.batches import Batches

    data = _chat_dataset(tmp_path, ones=True)
    masked = Batches(data, "chats", 32, 4, torch.device("cpu"), seed=0)
    x, y = masked.get_batch("train")
    meta_path = data / "chats" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["masks"] = False
    meta_path.write_text(json.dumps(meta))
    plain = Batches(data, "chats", 32, 4, torch.device("cpu"), seed=0)
    x2, y2 = plain.get_batch("train")
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # every target of the packed conversations counts; only the padding after them does not
    starts = masked.draw("train", torch.Generator().manual_seed(0))
    x, y = masked.load("train", starts)
    assert [int((row != -1).sum()) for row in y] == [n - 1 for _, _, n in starts]


def test_windows_pack_whole_conversations_and_cut_long_ones_with_their_mask(tmp_path):
    import torch

    from nanogpt_cli.data.batches import Batches
    from nanogpt_cli.data.reader import pack_windows

    # lengths 5, 3, 9, 2 in windows of 8: 5 + 3 fit together; 9 is cut into 8 and the 2 after its overlap token,
    # and the next conversation joins that last piece
    assert pack_windows(np.array([5, 3, 9, 2]), [19], 8).tolist() == [[0, 0, 8], [0, 8, 8], [0, 15, 4]]
    assert pack_windows(np.array([20]), [20], 8).tolist() == [[0, 0, 8], [0, 7, 8], [0, 14, 6]]  # each target once
    assert pack_windows(np.array([5, 3]), [6, 2], 8).tolist() == [[0, 0, 6], [1, 0, 2]]  # windows stay in a shard
    data = _chat_dataset(tmp_path)
    batches = Batches(data, "chats", 256, 8, torch.device("cpu"), seed=0)  # the longest conversation fits
    x, y = batches.get_batch("train")
    assert all(n > 160 for _, _, n in batches.packed["train"][:-1].tolist())  # each window holds several
    starts = [bytes(row[:5].tolist()) for row in x]
    assert all(s.startswith((b"user:", b"syste")) for s in starts)  # every window begins a conversation
    # a context shorter than the longest conversation: it is cut into windows, each target trained once, with its mask
    long = Batches(data, "chats", 16, 4, torch.device("cpu"), seed=0)
    meta = json.loads((data / "chats" / "meta.json").read_text())
    lengths = np.fromfile(data / "chats" / meta["conversations"]["train"]["file"], dtype=np.uint32)
    assert lengths.max() > 17
    windows = long.packed["train"]
    assert sum(n - 1 for _, _, n in windows.tolist()) == meta["train_tokens"] - len(lengths)
    ids = np.fromfile(data / "chats" / meta["shards"]["train"][0]["file"], dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(data / "chats" / meta["shards"]["train"][0]["mask"], dtype=np.uint8)
    x, y = long.load("train", [tuple(w) for w in windows.tolist()[:4]])
    for row, (_, offset, n) in zip(y, windows.tolist()[:4]):
        expect = np.where(mask[offset + 1 : offset + n] == 1, ids[offset + 1 : offset + n], -1)
        assert row[: n - 1].tolist() == expect.tolist() and (row[n - 1 :] == -1).all()


@pytest.mark.slow
@pytest.mark.parametrize("template", [DEFAULT_TEMPLATE, CUSTOM])
def test_hf_export_of_a_chat_run_renders_our_ids_and_mask(tmp_path, template):
    """A model exported with the template its run recorded: AutoTokenizer on the export reproduces prepare's ids
    and mask, and generation stops at the token that ends a reply."""
    transformers = pytest.importorskip("transformers")
    from nanogpt_cli.interop.export import export_hf
    from nanogpt_cli.model import GPT
    from conftest import tiny_config

    ours = build_tokenizer("gpt2")
    export_hf(GPT(tiny_config(vocab_size=50257)), ours.describe(), tmp_path / "export", chat_template=template)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for messages in CONVERSATIONS:  # with and without a system turn
        ids, mask = ChatTemplate(template).tokens_and_mask(messages, ours)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids.tolist() and out["assistant_masks"] == mask.tolist()
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["eos_token_id"] in (ours.eot_id, [ours.eot_id])

"""Preference and prompt datasets: TRL's shapes read back, masks that cover only each completion, bad rows counted
with their line numbers."""

from __future__ import annotations

import json

import pytest

from nanogpt_cli.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from nanogpt_cli.data.preference import encode_pair, preference_pair, prepare_rows, read_split
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import build_tokenizer

USER = [{"role": "user", "content": "count abc"}]
RIGHT, WRONG = [{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]
SHAPES = {
    "standard": {"prompt": "count abc =", "chosen": " 3", "rejected": " 4"},
    "conversational": {"prompt": USER, "chosen": RIGHT, "rejected": WRONG},
    "implicit prompt": {"chosen": USER + RIGHT, "rejected": USER + WRONG},
    "string prompt, messages": {"prompt": "count abc", "chosen": RIGHT, "rejected": WRONG},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_trl_shapes_round_trip_and_masks_cover_only_each_completion(shape):
    tok = build_tokenizer("byte")
    template = ChatTemplate(DEFAULT_TEMPLATE)
    pair = preference_pair(SHAPES[shape])
    out = encode_pair(pair, template, tok)
    for name, reply in (("chosen", "3"), ("rejected", "4")):
        ids, mask = out[name], out[f"{name}_mask"]
        assert len(ids) == len(mask)
        text = tok.decode(ids)
        assert "count abc" in text  # the prompt, then the completion
        masked = tok.decode([t for t, m in zip(ids, mask) if m])
        assert masked.strip().startswith(reply)  # the completion's tokens, no prompt token
        assert "count" not in masked
        first = mask.index(1)
        assert all(mask[first:]) and not any(mask[:first])  # one run of ones, at the end
    if shape == "standard":
        assert tok.decode(out["chosen"]) == "count abc = 3"
    if shape != "standard":  # rendered with the template: the same ids as a chat conversation would get
        ids, _ = template.tokens_and_mask(USER + RIGHT, tok)
        assert out["chosen"] == ids.tolist()
    assert out["chosen"][: out["chosen_mask"].index(1)] == out["rejected"][: out["rejected_mask"].index(1)]


def test_prepare_writes_both_splits_and_counts_bad_rows_by_line(tmp_path):
    lines = [json.dumps(SHAPES["conversational"])] * 3 + [
        "{not json",
        json.dumps({"prompt": "x", "chosen": "y"}),
        json.dumps({"prompt": USER, "chosen": USER, "rejected": WRONG}),
        "",
        json.dumps(SHAPES["standard"]),
    ]
    src = tmp_path / "pairs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    result = prepare_rows(str(src), "p", kind="preference", tokenizer="byte", data_dir=str(tmp_path), val_fraction=0.25)
    assert [n for n, _ in result.bad] == [4, 5, 6]
    assert "'chosen' has no assistant message" in result.bad[2][1]
    assert (result.rows, result.train_rows, result.val_rows) == (4, 3, 1)
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["format"] == "preference" and meta["bad_rows"] == 3 and meta["stop"] == ["<|endoftext|>"]
    assert len(read_split(tmp_path, "p", "train")) == 3
    with pytest.raises(NanoGPTError, match="line 4"):
        prepare_rows(str(src), "q", kind="preference", tokenizer="byte", data_dir=str(tmp_path), strict=True)
    with pytest.raises(NanoGPTError, match="--format"):
        prepare_rows(str(src), "q", kind="ranking", tokenizer="byte", data_dir=str(tmp_path))

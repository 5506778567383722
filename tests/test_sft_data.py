"""Instruction-tuning data (issue 38): `dstrain prepare --chat` against TRL's SFTTrainer preprocessing (the referee),
against masks built by hand from the assistant contents' token spans, and the one-line refusals of bad input."""

from __future__ import annotations

import json
import re

import datasets
import numpy as np
import pytest
from chat_fixtures import (
    CONVERSATIONS,
    END_OF_TURN,
    PROMPT_COMPLETIONS,
    QWEN25,
    TEMPLATES,
    save_chat_tokenizer,
    template_tokenizer,
    write_jsonl,
)

from dstrain.data.chat import encode_messages, encode_prompt_completion
from dstrain.data.dataset import PreparedTokens, build_dataset, collate
from dstrain.data.prepare import prepare
from dstrain.errors import DstrainError

HELD_OUT = [  # shapes the referee sees that the fixtures' other tests do not: a system turn, three answers
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Is a tuple mutable?"},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "And a list?"},
        {"role": "assistant", "content": "Yes, a list is."},
        {"role": "user", "content": "Which one is hashable?"},
        {"role": "assistant", "content": "The tuple, when its items are."},
    ]
]


def prepared(tmp_path, rows: list[dict], template: str = "chatml-generation", **options):
    """`dstrain prepare --chat` of ``rows`` with ``template``'s tokenizer; (folder, its documents and masks)."""
    tokenizer = save_chat_tokenizer(tmp_path / f"tok-{template}", template)
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / f"out-{template}"
    prepare(str(source), str(out), tokenizer=str(tokenizer), chat=True, num_proc=1, progress=False, **options)
    tokens = PreparedTokens(out)
    docs = [tokens.document(d).tolist() for d in range(tokens.num_docs)]
    return out, docs, [tokens.document_mask(d).astype(bool).tolist() for d in range(tokens.num_docs)]


def trl_learned(rows: list[dict], tokenizer, **config) -> list[tuple[list[int], list[bool]]]:
    """(input_ids, learned positions) of each row as TRL's SFTTrainer prepares it (labels not -100)."""
    pytest.importorskip(
        "trl", reason="TRL, the referee, is the test-only extra .[referee] (requirements.txt installs it)"
    )
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    args = SFTConfig(output_dir=config.pop("output_dir"), report_to=[], use_cpu=True, max_length=None, **config)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    return [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in trainer.train_dataset]


def test_conversations_match_trl_assistant_only_loss(tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS + HELD_OUT]
    _, docs, masks = prepared(tmp_path, rows)
    referee = trl_learned(rows, template_tokenizer("chatml-generation"), assistant_only_loss=True, output_dir=tmp_path)
    assert [ids for ids, _ in referee] == docs
    assert [learned for _, learned in referee] == masks
    assert all(any(m) and not all(m) for m in masks)


@pytest.mark.parametrize("kind", ["plain", "conversational"])
def test_prompt_completion_matches_trl_completion_only_loss(tmp_path, kind):
    if kind == "plain":
        rows = [dict(example) for example in PROMPT_COMPLETIONS]
    else:
        rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS + HELD_OUT]
    _, docs, masks = prepared(tmp_path, rows, "chatml")
    tokenizer = template_tokenizer("chatml")
    referee = trl_learned(rows, tokenizer, completion_only_loss=True, output_dir=tmp_path)
    assert [ids for ids, _ in referee] == docs
    assert [learned for _, learned in referee] == masks


def hand_built_mask(tokenizer, template: str, eot: str, conversation: list[dict]) -> tuple[list[int], list[bool]]:
    """The expected mask, built without the code under test: each assistant content's characters in the rendered
    conversation (found in order) and the end-of-turn token right after it, mapped to tokens by their offsets."""
    text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    learned_chars, cursor = [], 0
    for message in conversation:
        if message["role"] != "assistant":
            cursor = text.index(message["content"], cursor) + len(message["content"])
            continue
        start = text.index(message["content"], cursor)
        end = start + len(message["content"])
        assert text[end : end + len(eot)] == eot
        learned_chars.append((start, end + len(eot)))
        cursor = end
    learned = [any(a <= s and e <= b for a, b in learned_chars) for s, e in encoding["offset_mapping"]]
    return encoding["input_ids"], learned


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_masks_match_the_assistant_contents_token_spans(name):
    tokenizer = template_tokenizer(name)
    for conversation in CONVERSATIONS + HELD_OUT:
        ids, mask = encode_messages(tokenizer, TEMPLATES[name], conversation)
        expected_ids, expected = hand_built_mask(tokenizer, TEMPLATES[name], END_OF_TURN[name], conversation)
        assert ids == expected_ids == tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]
        assert mask.astype(bool).tolist() == expected


def test_prepare_without_markers_reports_the_mask_and_packs_whole_conversations(tmp_path):
    out, docs, masks = prepared(tmp_path, [{"messages": c} for c in CONVERSATIONS * 30], "qwen2.5")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat"]["mask_from"].startswith("prefix renders")
    assert manifest["chat"]["learned_tokens"] == sum(sum(m) for m in masks)
    seq_len = 64
    data = build_dataset([(str(out), 1.0)], "train", seq_len, 3, None, 0.05)
    whole = {tuple(d) for d in docs}
    for i in range(len(data)):
        sample = data[i]
        starts = np.flatnonzero(sample["position_ids"] == 0)  # a piece starts where positions restart
        bounds = list(zip(starts, [*starts[1:], seq_len + 1]))
        pieces = [sample["tokens"][a:b].tolist() for a, b in bounds]
        padding = [not sample["loss_mask"][a:b].any() and tuple(p) not in whole for p, (a, b) in zip(pieces, bounds)]
        # every piece is a whole conversation, one cut to seq_len + 1 tokens, or the sample's padding at its end
        assert all(tuple(p) in whole or len(p) == seq_len + 1 or pad for p, pad in zip(pieces, padding))
        assert not any(padding[:-1])
    batch = collate([data[0], data[1]])
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}], "unknown role 'bot'"),
        ([{"role": "user", "content": " "}, {"role": "assistant", "content": "yo"}], "empty content"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
            "the chat template refuses it: Conversation roles must alternate",
        ),
    ],
)
def test_bad_conversations_are_refused_in_one_line(tmp_path, messages, fragment):
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": messages}]
    with pytest.raises(DstrainError) as error:
        prepared(tmp_path, rows, "qwen2.5")
    assert fragment in str(error.value) and "row 1" in str(error.value) and "\n" not in str(error.value)
    assert not list((tmp_path / "out-qwen2.5").glob("shard_*"))  # refused before a shard was written


def test_a_tokenizer_without_a_template_names_chat_template(tmp_path):
    tokenizer = template_tokenizer("chatml")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "tok")
    source = write_jsonl(tmp_path / "rows.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DstrainError, match="has no chat_template; pass one with --chat-template"):
        prepare(str(source), str(tmp_path / "out"), tokenizer=str(tmp_path / "tok"), chat=True, progress=False)
    (tmp_path / "t.jinja").write_text(QWEN25)  # the override renders it
    manifest = prepare(
        str(source), str(tmp_path / "out"), tokenizer=str(tmp_path / "tok"), chat=True, progress=False,
        chat_template=str(tmp_path / "t.jinja"), num_proc=1,
    )  # fmt: skip
    assert manifest["chat"]["template_file"] == str(tmp_path / "t.jinja")


def test_a_plain_pair_learns_the_completion_and_eos():
    tokenizer = template_tokenizer("chatml")
    ids, mask = encode_prompt_completion(tokenizer, None, "The capital of France is", " Paris.")
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == " Paris." + tokenizer.eos_token


def test_packing_changes_no_tokens_loss(tmp_path):
    """A packed sample (document masking, positions restarting at each conversation) gives each learned token the
    loss it has in a sample of its conversation alone (padded), fp32 within 1e-6."""
    import torch

    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT

    out, _, _ = prepared(tmp_path, [{"messages": c} for c in (CONVERSATIONS + HELD_OUT) * 8], "llama3")
    seq_len = 160
    data = build_dataset([(str(out), 1.0)], "train", seq_len, 5, None, 0.1)
    config = GPTConfig(
        flavour="llama", vocab_size=400, max_seq_len=seq_len, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
        doc_masking=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()

    def token_losses(sample: dict) -> torch.Tensor:
        batch = collate([sample])
        with torch.no_grad():
            logits = model(batch["input_ids"], batch["position_ids"])
        return torch.nn.functional.cross_entropy(logits[0], batch["labels"][0], ignore_index=-100, reduction="none")

    compared = 0
    for i in range(len(data)):
        sample = data[i]
        packed = token_losses(sample)
        starts = [int(s) for s in np.flatnonzero(sample["position_ids"] == 0)] + [seq_len + 1]
        for a, b in zip(starts, starts[1:]):
            alone = {k: sample[k][a:b] for k in ("tokens", "loss_mask")}
            pad = seq_len + 1 - alone["tokens"].size
            alone = {
                "tokens": np.concatenate([alone["tokens"], np.zeros(pad, np.int64)]),
                "loss_mask": np.concatenate([alone["loss_mask"], np.zeros(pad, np.uint8)]),
                "position_ids": np.arange(seq_len),
            }
            learned = np.flatnonzero(alone["loss_mask"][1:])  # label positions, within the piece
            torch.testing.assert_close(packed[a + learned], token_losses(alone)[learned], rtol=0, atol=1e-6)
            compared += learned.size
    assert len(data) >= 2 and compared > 100


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_end_of_turn_is_the_templates_special_token(name):
    from dstrain.data.chat import end_of_turn_ids

    tokenizer = template_tokenizer(name)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    assert end_of_turn_ids(tokenizer) == [eot]  # the fixtures' EOS is their end of turn, as Qwen's and Llama's are
    tokenizer.eos_token = "<|endoftext|>"
    assert end_of_turn_ids(tokenizer) == [eot, tokenizer.eos_token_id]


def test_sft_recipes_and_chat_folders_go_together(tmp_path, corpus):
    """A --chat folder under a recipe without data.sft, and an SFT recipe without a --chat folder: one line each."""
    import yaml

    from dstrain.config import load_recipe
    from dstrain.train.run import fingerprint_of_checked_data

    chat, _, _ = prepared(tmp_path, [{"messages": c} for c in CONVERSATIONS], "chatml")
    for folder, sft, masking, fragment in (
        (chat, False, None, "was prepared with --chat (conversations with a loss mask) but data.sft is false"),
        (corpus, True, None, "data.sft is true but no data.sources folder was prepared with --chat"),
        (chat, True, False, "model.doc_masking is false but data.sources"),  # issue 46: packed whole, always masked
    ):
        path = tmp_path / f"sft-{sft}-{masking}.yaml"
        model = {"flavour": "llama", "n_layer": 1, "n_head": 2, "d_model": 32}
        if masking is not None:
            model["doc_masking"] = masking
        data = {"sources": [{"path": str(folder)}], "seq_len": 32, "sft": sft}
        path.write_text(
            yaml.safe_dump({"name": "x", "model": model, "data": data, "train": {"steps": 1, "global_batch": 2}})
        )
        with pytest.raises(DstrainError, match=re.escape(fragment)) as error:
            fingerprint_of_checked_data(load_recipe(path), str(path))
        assert str(path) in str(error.value) and "\n" not in str(error.value)
    model = {"flavour": "llama", "n_layer": 1, "n_head": 2, "d_model": 32}
    data = {"sources": [{"path": str(chat)}], "seq_len": 32, "sft": True}
    path.write_text(
        yaml.safe_dump({"name": "x", "model": model, "data": data, "train": {"steps": 1, "global_batch": 2}})
    )
    assert load_recipe(path).model.doc_masking  # the default under data.sft


def test_a_changed_mask_is_refused_like_a_changed_shard(tmp_path):
    from dstrain.data.manifest import check_shards, read_manifest

    out, _, _ = prepared(tmp_path, [{"messages": c} for c in CONVERSATIONS], "chatml")
    check_shards(out, read_manifest(out))
    mask = out / "shard_00000.mask.bin"
    content = bytearray(mask.read_bytes())
    content[len(content) // 2] ^= 1  # one token's learned bit flipped, the size unchanged
    mask.write_bytes(bytes(content))
    with pytest.raises(DstrainError, match="shard_00000.mask.bin: its content differs"):
        check_shards(out, read_manifest(out))


def test_two_tasks_and_their_merge_make_the_one_process_folder(tmp_path):
    rows = [{"messages": c} for c in (CONVERSATIONS + HELD_OUT) * 5]
    one, docs, masks = prepared(tmp_path, rows, "llama3")
    merged = tmp_path / "merged"
    for index in range(2):
        prepare(
            str(tmp_path / "rows.jsonl"), str(merged), tokenizer=str(tmp_path / "tok-llama3"), chat=True,
            num_proc=1, progress=False, num_tasks=2, task_index=index,
        )  # fmt: skip
    tokens = PreparedTokens(merged)
    assert [tokens.document(d).tolist() for d in range(tokens.num_docs)] == docs
    assert [tokens.document_mask(d).astype(bool).tolist() for d in range(tokens.num_docs)] == masks
    ours, theirs = (json.loads((f / "manifest.json").read_text())["chat"] for f in (one, merged))
    assert ours == theirs


def test_chat_mixed_with_text_learns_every_text_token(tmp_path):
    """A mixture of a --chat folder and text prepared with the same tokenizer: text samples learn all their tokens."""
    from dstrain.data.prepare import prepare as prepare_text

    tokenizer = save_chat_tokenizer(tmp_path / "tok", "chatml")
    text = prepare_text(
        str(corpus_text(tmp_path)), str(tmp_path / "text"), tokenizer=str(tokenizer), num_proc=1, progress=False
    )
    assert "chat" not in text
    source = write_jsonl(tmp_path / "rows.jsonl", [{"messages": c} for c in CONVERSATIONS * 20])
    prepare(str(source), str(tmp_path / "chat"), tokenizer=str(tokenizer), chat=True, num_proc=1, progress=False)
    data = build_dataset([(str(tmp_path / "chat"), 1.0), (str(tmp_path / "text"), 1.0)], "train", 32, 1, 40, 0.05)
    kinds = [bool("loss_mask" in data[i]) for i in range(40)]
    assert 10 < sum(kinds) < 30
    batch = collate([data[i] for i in range(40)])
    for i, chat in enumerate(kinds):
        assert (batch["labels"][i] == -100).any() == chat


def corpus_text(tmp_path):
    from data_fixtures import corpus_file

    return corpus_file(tmp_path, n_docs=60)


def test_a_killed_chat_prepare_resumes_to_the_same_folder(tmp_path):
    rows = [{"messages": c} for c in (CONVERSATIONS + HELD_OUT) * 10]
    out, docs, masks = prepared(tmp_path, rows, "chatml", shard_tokens=400)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    (out / "manifest.json").unlink()  # killed while shard 1's mask was being written: its files are not published
    for name in ("shard_00001.bin", "shard_00001.idx", "shard_00001.mask.idx"):
        (out / name).unlink()
    kept = (out / "shard_00002.mask.bin").stat().st_mtime_ns
    source, tokenizer = tmp_path / "rows.jsonl", tmp_path / "tok-chatml"
    again = prepare(str(source), str(out), tokenizer=str(tokenizer), chat=True, num_proc=1, progress=False,
                    shard_tokens=400)  # fmt: skip
    assert again == manifest and (out / "shard_00002.mask.bin").stat().st_mtime_ns == kept
    tokens = PreparedTokens(out)
    assert [tokens.document_mask(d).astype(bool).tolist() for d in range(tokens.num_docs)] == masks

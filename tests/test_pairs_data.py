"""Preference pairs (issue 46): `dstrain prepare --chat` of TRL's preference format against TRL's DPOTrainer
preprocessing (the referee: its prompt, chosen and rejected token ids), the manifest's pairs record, and the one-line
refusals of bad pairs."""

from __future__ import annotations

import math
import re

import datasets
import numpy as np
import pytest
from chat_fixtures import CONVERSATIONS, PROMPT_COMPLETIONS, save_chat_tokenizer, template_tokenizer, write_jsonl

from dstrain.data.dataset import PreparedTokens
from dstrain.data.manifest import read_manifest
from dstrain.data.prepare import prepare
from dstrain.errors import DstrainError

REJECTED_TEXT = [" London.", " five, as every child knows."]


def conversational_rows(implicit: bool) -> list[dict]:
    """Each conversation's last answer chosen, the next conversation's last answer rejected (a mismatched answer)."""
    rows = []
    for i, conversation in enumerate(CONVERSATIONS):
        other = CONVERSATIONS[(i + 1) % len(CONVERSATIONS)][-1]
        prompt, chosen, rejected = conversation[:-1], conversation[-1:], [other]
        rows.append(
            {"chosen": prompt + chosen, "rejected": prompt + rejected}
            if implicit
            else {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        )
    return rows


def text_rows(implicit: bool) -> list[dict]:
    rows = []
    for example, rejected in zip(PROMPT_COMPLETIONS, REJECTED_TEXT):
        prompt, chosen = example["prompt"], example["completion"]
        rows.append(
            {"chosen": prompt + chosen, "rejected": prompt + rejected}
            if implicit
            else {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        )
    return rows


def prepared_pairs(tmp_path, rows: list[dict], template: str = "chatml") -> tuple:
    tokenizer = save_chat_tokenizer(tmp_path / f"tok-{template}", template)
    out = tmp_path / "pairs"
    prepare(
        str(write_jsonl(tmp_path / "pairs.jsonl", rows)), str(out), tokenizer=str(tokenizer), chat=True, num_proc=1,
        progress=False,
    )  # fmt: skip
    tokens = PreparedTokens(out)
    docs = [tokens.document(d).tolist() for d in range(tokens.num_docs)]
    return out, docs, [tokens.document_mask(d).astype(bool).tolist() for d in range(tokens.num_docs)]


def trl_pairs(rows: list[dict], tokenizer, output_dir) -> list[dict]:
    """Each row as TRL's DPOTrainer prepares it: prompt_ids, chosen_ids, rejected_ids."""
    pytest.importorskip("trl", reason="TRL, the referee, is the test-only extra .[referee] (requirements.txt has it)")
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    args = DPOConfig(output_dir=str(output_dir), report_to=[], use_cpu=True, max_length=None)
    trainer = DPOTrainer(
        model=LlamaForCausalLM(config), ref_model=LlamaForCausalLM(config), args=args,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
    )  # fmt: skip
    return list(trainer.train_dataset)


@pytest.mark.parametrize("kind", ["conversational", "plain"])
@pytest.mark.parametrize("prompt", ["explicit", "implicit"])
def test_pairs_match_trl_dpo_preprocessing(tmp_path, kind, prompt):
    rows = (conversational_rows if kind == "conversational" else text_rows)(prompt == "implicit")
    out, docs, masks = prepared_pairs(tmp_path, rows)
    referee = trl_pairs(rows, template_tokenizer("chatml"), tmp_path / "trl")
    assert len(docs) == 2 * len(rows)
    for k, row in enumerate(referee):
        for side, doc in (("chosen_ids", 2 * k), ("rejected_ids", 2 * k + 1)):  # neighbours, chosen first
            assert docs[doc] == row["prompt_ids"] + row[side]
            assert masks[doc] == [False] * len(row["prompt_ids"]) + [True] * len(row[side])
    manifest = read_manifest(out)
    assert manifest.chat.format == "preference"
    pairs = [len(docs[2 * k]) + len(docs[2 * k + 1]) for k in range(len(rows))]
    assert manifest.pairs.pairs == len(rows) and manifest.pairs.longest == max(pairs)
    assert manifest.pairs.longer_than["128"] == sum(n > 129 for n in pairs)


USER = {"role": "user", "content": "Which one?"}
BAD_PAIRS = [
    ([{"prompt": "Pick", "chosen": " a"}], "has a 'chosen' column but no 'rejected' column"),
    ([{"prompt": "Pick", "chosen": " a", "rejected": " a"}], "row 0: chosen equals rejected"),
    ([{"prompt": "Pick", "chosen": " a", "rejected": " "}], "row 0: rejected is empty"),
    ([{"chosen": "Pick a", "rejected": "Pick a or b"}], "row 0: the chosen completion is empty"),
    ([{"chosen": "Yes", "rejected": "No"}], "row 0: chosen and rejected share no common beginning"),
    (
        [{"chosen": [USER, {"role": "assistant", "content": "A."}], "rejected": [{"role": "user", "content": "B?"}]}],
        "row 0: chosen and rejected share no first turn",
    ),
    (
        [
            {
                "chosen": [USER, {"role": "assistant", "content": "A."}, {"role": "user", "content": "Sure?"}],
                "rejected": [USER, {"role": "assistant", "content": "A."}, {"role": "user", "content": "Why?"}],
            }
        ],
        "row 0: the implicit prompt (the turns chosen and rejected share) is not followed by an assistant answer",
    ),
]


@pytest.mark.parametrize("rows, fragment", BAD_PAIRS, ids=[f"bad{i}" for i in range(len(BAD_PAIRS))])
def test_bad_pairs_are_refused_in_one_line_before_any_shard(tmp_path, rows, fragment):
    with pytest.raises(DstrainError, match=re.escape(fragment)) as error:
        prepared_pairs(tmp_path, rows)
    assert "\n" not in str(error.value)
    assert not list((tmp_path / "pairs").glob("shard_*"))


def test_a_pair_folder_is_refused_by_training_and_by_eval_without_a_reference(tmp_path, capsys, corpus):
    """Pairs train only under a preference objective (an SFT recipe would learn the rejected answers too), and the
    preference objective only on pairs, with a reference where its loss needs one."""
    import yaml

    from dstrain.commands.cli import main as cli
    from dstrain.data.manifest import read_manifest
    from dstrain.recipe_file import load_recipe
    from dstrain.train.preflight import fingerprint_of_checked_data

    out, _, _ = prepared_pairs(tmp_path, conversational_rows(implicit=False))
    path = tmp_path / "sft.yaml"
    model = {"flavour": "llama", "n_layer": 1, "n_head": 2, "d_model": 32}
    data = {"sources": [{"path": str(out)}], "seq_len": 32, "sft": True}
    path.write_text(
        yaml.safe_dump({"name": "x", "model": model, "data": data, "train": {"steps": 1, "global_batch": 2}})
    )
    with pytest.raises(DstrainError, match=re.escape(f"{path}: data.sources {out} holds preference pairs")) as error:
        fingerprint_of_checked_data(load_recipe(path), str(path), [read_manifest(out)])
    assert "\n" not in str(error.value)
    # the reverse: preference: over a text folder; and a preference loss with a reference but no init_from
    text = {**data, "sources": [{"path": str(corpus)}], "sft": False}
    path.write_text(yaml.safe_dump({"name": "x", "model": model, "data": text, "train": {"steps": 1, "global_batch": 2},
                                    "preference": {"beta": 0.1}}))  # fmt: skip
    with pytest.raises(DstrainError, match=re.escape(f"{path}: preference: is set but data.sources is not one pair")):
        fingerprint_of_checked_data(load_recipe(path), str(path), [read_manifest(corpus)])
    path.write_text(yaml.safe_dump({"name": "x", "model": model, "data": data, "train": {"steps": 1, "global_batch": 2},
                                    "preference": {"loss": "ipo"}}))  # fmt: skip
    with pytest.raises(DstrainError, match=re.escape(f"{path}: preference.loss ipo needs a reference model")):
        fingerprint_of_checked_data(load_recipe(path), str(path), [read_manifest(out)])
    hf = tmp_path / "hf"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(hf)
    capsys.readouterr()
    assert cli(["eval", str(hf), "--data", str(out)]) == 2
    assert f"--data {out} holds preference pairs: name the reference model with --reference" in capsys.readouterr().err


def test_packed_pairs_give_each_completions_log_prob_sum_alone(tmp_path):
    """Pairs packed whole, several to a sample, chosen before rejected; a dstrain GPT with document masking over the
    packed micro-batch gives each completion's log-prob sum (and token count) that transformers' forward of that side
    alone gives, its sides found in the shards (fp32, 1e-5)."""
    import torch

    from dstrain.data.dataset import build_dataset, collate
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model
    from dstrain.train.objectives.preference.losses import completion_logps

    rows = conversational_rows(implicit=False) * 3 + text_rows(implicit=True) * 3
    out, docs, masks = prepared_pairs(tmp_path, rows)
    data = build_dataset([(str(out), 1.0)], "train", 320, 7, None, 0.2)
    samples = [data[i] for i in range(len(data))]
    assert max(int(s["documents"].max()) for s in samples) >= 3  # at least two pairs share a sample
    vocab = -(-read_manifest(out).vocab_size // 64) * 64
    config = GPTConfig(flavour="llama", vocab_size=vocab, max_seq_len=320, n_layer=2, n_head=4, n_kv_head=2,
                       d_model=64, doc_masking=True)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    hf = to_hf_model(config, model.state_dict())
    batch = collate(samples)
    with torch.no_grad():
        ours = completion_logps(model(batch["input_ids"], batch["position_ids"]), batch["labels"], batch["documents"])
    expected, counts = [], []
    for sample in samples:
        for piece in range(0, int(sample["documents"].max()) + 1, 2):
            chosen = sample["tokens"][sample["documents"] == piece].tolist()
            doc = docs.index(chosen)
            assert doc % 2 == 0 and sample["tokens"][sample["documents"] == piece + 1].tolist() == docs[doc + 1]
            for side in (doc, doc + 1):
                ids, learned = torch.tensor(docs[side]), torch.tensor(masks[side][1:])
                with torch.no_grad():
                    logps = torch.log_softmax(hf(input_ids=ids[None, :-1]).logits[0].float(), -1)
                expected.append(logps.gather(1, ids[1:, None])[:, 0][learned].sum().item())
                counts.append(int(learned.sum()))
    np.testing.assert_allclose(torch.stack([ours.chosen, ours.rejected], 1).flatten().numpy(), expected, rtol=1e-5)
    assert torch.stack([ours.chosen_tokens, ours.rejected_tokens], 1).flatten().tolist() == counts
    assert len(expected) == 2 * ours.chosen.numel() and ours.chosen.numel() >= 8


def scoring_setup(out):
    """Both splits of a pair folder at 320 tokens, and a random 2-block Llama to score them."""
    import torch

    from dstrain.data.dataset import build_dataset
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT

    sets = [build_dataset([(str(out), 1.0)], split, 320, 7, None, 0.2) for split in ("train", "valid")]
    config = GPTConfig(flavour="llama", vocab_size=-(-read_manifest(out).vocab_size // 64) * 64, max_seq_len=320,
                       n_layer=2, n_head=4, n_kv_head=2, d_model=64, doc_masking=True)  # fmt: skip
    torch.manual_seed(0)
    return sets, GPT(config).eval()


def test_reference_scores_are_each_side_alone_kept_reused_and_checked(tmp_path):
    """The reference pass over both splits scores every pair once, equal to transformers' forward of each side alone
    (fp32, 1e-5); kept beside the shards under a key of the weights, the data and the packing; reused (not
    computed again); other weights make another key; a changed file is refused in one line."""
    import torch

    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model
    from dstrain.train.objectives.preference.losses import completion_logps
    from dstrain.train.objectives.preference.reference_scores import (
        reference_scores,
        score_pairs,
        scores_key,
        weights_hash,
    )

    rows = conversational_rows(implicit=True) * 2 + text_rows(implicit=False) * 2
    out, docs, masks = prepared_pairs(tmp_path, rows)
    sets, model = scoring_setup(out)
    config = model.config
    key, parts = scores_key(weights_hash(model.state_dict()), read_manifest(out).hash, 320, "truncate")
    calls = []

    def forward(batch):
        return completion_logps(model(batch["input_ids"], batch["position_ids"]), batch["labels"], batch["documents"])

    def compute(partial):
        calls.append(1)
        return score_pairs(forward, sets, len(rows), 3, 0, 1, torch.device("cpu"), partial)

    scores = reference_scores(out, key, parts, compute)
    assert scores.shape == (len(rows), 4) and not np.isnan(scores).any()  # every pair of both splits, once
    hf = to_hf_model(config, model.state_dict())
    for pair in range(len(rows)):
        for side in (0, 1):
            ids, learned = torch.tensor(docs[2 * pair + side]), torch.tensor(masks[2 * pair + side][1:])
            with torch.no_grad():
                logps = torch.log_softmax(hf(input_ids=ids[None, :-1]).logits[0].float(), -1)
            expected = logps.gather(1, ids[1:, None])[:, 0][learned].sum().item()
            np.testing.assert_allclose(scores[pair, side], expected, rtol=1e-5)
            assert scores[pair, 2 + side] == int(learned.sum())
    assert np.array_equal(reference_scores(out, key, parts, compute), scores) and len(calls) == 1  # reused
    torch.manual_seed(1)
    assert weights_hash(GPT(config).state_dict()) != parts["weights"]
    npy = out / "reference_scores" / f"{key}.npy"
    content = bytearray(npy.read_bytes())
    content[-3] ^= 1
    npy.write_bytes(bytes(content))
    with pytest.raises(DstrainError, match=re.escape(f"{npy}: the reference scores differ")) as error:
        reference_scores(out, key, parts, compute)
    assert "\n" not in str(error.value) and len(calls) == 1


def test_an_interrupted_reference_pass_goes_on_where_it_stopped_to_the_same_scores(tmp_path):
    """Lost after 3 of its micro-batches, the pass keeps what it scored; the next pass scores only the rest, and its
    scores are the uninterrupted pass's bit for bit; the partial files are gone once the scores are kept."""
    import torch

    from dstrain.train.objectives.preference.losses import completion_logps
    from dstrain.train.objectives.preference.reference_scores import reference_scores, score_pairs

    rows = conversational_rows(implicit=True) * 3 + text_rows(implicit=False) * 3
    out, _, _ = prepared_pairs(tmp_path, rows)
    sets, model = scoring_setup(out)
    forwards, lost = [], False

    def forward(batch):
        if len(forwards) == 3 and lost:
            raise RuntimeError("the node was lost")
        forwards.append(batch["input_ids"].shape[0])
        return completion_logps(model(batch["input_ids"], batch["position_ids"]), batch["labels"], batch["documents"])

    def compute(partial):
        return score_pairs(forward, sets, len(rows), 1, 0, 1, torch.device("cpu"), partial, save_every_s=0)

    whole = score_pairs(forward, sets, len(rows), 1, 0, 1, torch.device("cpu"))
    batches, forwards, lost = len(forwards), [], True
    assert batches > 4
    with pytest.raises(RuntimeError, match="the node was lost"):
        reference_scores(out, "key", {}, compute)
    assert [p.name for p in (out / "reference_scores").iterdir()] == [".key.partial-1x1.npz"]
    forwards, lost = [], False
    resumed = reference_scores(out, "key", {}, compute)
    assert len(forwards) == batches - 3  # the rest only
    assert np.array_equal(resumed, whole, equal_nan=True) and not np.isnan(resumed).all()
    assert sorted(p.name for p in (out / "reference_scores").iterdir()) == ["key.json", "key.npy"]


def test_two_tasks_and_their_merge_make_the_one_process_pair_folder(tmp_path):
    rows = conversational_rows(implicit=False) * 3 + text_rows(implicit=True) * 2
    one, docs, masks = prepared_pairs(tmp_path, rows)
    merged = tmp_path / "merged"
    for index in range(2):
        prepare(
            str(tmp_path / "pairs.jsonl"), str(merged), tokenizer=str(tmp_path / "tok-chatml"), chat=True, num_proc=1,
            progress=False, num_tasks=2, task_index=index,
        )  # fmt: skip
    tokens = PreparedTokens(merged)
    assert [tokens.document(d).tolist() for d in range(tokens.num_docs)] == docs
    assert [tokens.document_mask(d).astype(bool).tolist() for d in range(tokens.num_docs)] == masks
    assert read_manifest(merged).pairs == read_manifest(one).pairs


def test_eval_of_a_pair_folder_gives_the_loss_and_reward_accuracy_of_each_side_alone(tmp_path, capsys):
    """`dstrain eval POLICY --data PAIRS --reference REF` (two Hugging Face folders): the sigmoid loss and reward
    accuracy over the split's pairs equal those of transformers' forwards of each side alone (loss within 1e-5
    absolute); the reference's scores kept once and reused; the policy as its own reference gives ln 2 and no pair
    preferred."""
    import json

    import torch

    from dstrain.commands.cli import main as cli
    from dstrain.data.index import split_documents
    from dstrain.model.config import GPTConfig
    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import to_hf_model

    rows = conversational_rows(implicit=False) * 3 + text_rows(implicit=True) * 3
    out, docs, masks = prepared_pairs(tmp_path, rows)
    config = GPTConfig(flavour="llama", vocab_size=-(-read_manifest(out).vocab_size // 64) * 64, max_seq_len=320,
                       n_layer=2, n_head=4, n_kv_head=2, d_model=64)  # fmt: skip
    models = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        models[name] = to_hf_model(config, GPT(config).state_dict())
        models[name].save_pretrained(tmp_path / name)

    def side_logps(model, doc):
        ids, learned = torch.tensor(docs[doc]), torch.tensor(masks[doc][1:])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids[None, :-1]).logits[0].float(), -1)
        return logps.gather(1, ids[1:, None])[:, 0][learned].sum().item()

    split = split_documents(len(rows), "train", 0.2, 7).tolist()
    margins = []
    for pair in split:
        chosen, rejected = (side_logps(models["policy"], 2 * pair + s) - side_logps(models["reference"], 2 * pair + s)
                            for s in (0, 1))  # fmt: skip
        margins.append(0.5 * (chosen - rejected))
    argv = ["eval", str(tmp_path / "policy"), "--data", str(out), "--split", "train", "--seq-len", "320", "--seed",
            "7", "--valid-fraction", "0.2", "--beta", "0.5", "--micro-batch", "3"]  # fmt: skip
    capsys.readouterr()
    assert cli([*argv, "--reference", str(tmp_path / "reference")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pairs"] == len(split)
    expected = float(np.mean([math.log1p(math.exp(-m)) for m in margins]))
    assert result["loss"] == pytest.approx(expected, abs=1e-5)
    assert result["rewards/accuracies"] == pytest.approx(np.mean([m > 0 for m in margins]))
    assert result["rewards/margins"] == pytest.approx(np.mean(margins), abs=1e-5)
    assert len(list((out / "reference_scores").glob("*.npy"))) == 1
    assert cli([*argv, "--reference", str(tmp_path / "policy")]) == 0
    itself = json.loads(capsys.readouterr().out)
    assert itself["loss"] == pytest.approx(math.log(2), abs=1e-7) and itself["rewards/accuracies"] == 0
    assert len(list((out / "reference_scores").glob("*.npy"))) == 2  # one per reference's weights
    assert cli([*argv, "--reference", str(tmp_path / "reference")]) == 0  # the kept scores, reused
    assert json.loads(capsys.readouterr().out)["loss"] == result["loss"]

"""The downstream-task scorer (dstrain.tasks): formats, tokens, metrics and bad input in one process; and
lm-evaluation-harness as the referee, item by item, on small exported random models (the `harness` kind)."""

from __future__ import annotations

import json

import pytest
from task_fixtures import exported_model, tokenizer, write_task_file

from dstrain.run_dir import RunDir

FORMATS = ("hellaswag", "arc", "piqa", "winogrande", "lambada")
# Our GPT vs transformers' model of the same weights, fp32, summed over a continuation: measured <= 2.2e-5.
LL_ATOL = 1e-4


def task(name, fmt, path, **fields):
    from dstrain.config import TaskConfig

    return TaskConfig(name=name, format=fmt, path=str(path), **fields)


def test_hellaswag_follows_lm_evals_preprocessing():
    from dstrain.tasks.formats import hellaswag

    doc = {"activity_label": "Baking", "ctx_a": "A man mixes flour.", "ctx_b": "then he [title]", "label": "2"}
    item = hellaswag({**doc, "endings": [" adds  eggs. ", "[step] bakes it.", "sings", "x"]})
    assert item.requests[0] == ("Baking: A man mixes flour. Then he. ", " adds eggs.")  # " [title]" -> ". "
    assert item.choices == ("adds eggs.", " bakes it.", "sings", "x") and item.gold == 2


def test_winogrande_scores_the_rest_of_the_sentence_after_each_option():
    from dstrain.tasks.formats import winogrande

    item = winogrande(
        {"sentence": "Ann gave Bo a gift because _ was kind.", "option1": "Ann", "option2": "Bo", "answer": "2"}
    )
    assert item.requests == (
        ("Ann gave Bo a gift because Ann", " was kind."),
        ("Ann gave Bo a gift because Bo", " was kind."),
    )
    assert item.gold == 1 and not item.normalised


def test_arc_finds_numeric_answer_keys_and_lambada_splits_the_last_word():
    from dstrain.tasks.formats import arc, lambada

    item = arc({"question": "Which?", "choices": {"text": ["a", "b c"], "label": ["1", "2"]}, "answerKey": "2"})
    question = "Question: Which?\nAnswer:"
    assert item.requests == ((question, " a"), (question, " b c")) and item.gold == 1
    assert lambada({"text": "he opened the door"}).requests == (("he opened the", " door"),)


def test_tokens_frame_the_text_as_the_family_does_and_move_trailing_spaces():
    from dstrain.tasks.scoring import encode_pair

    for bos in (False, True):
        tok = tokenizer(bos)
        context, continuation = encode_pair(tok, "the cat sat ", "on the mat")
        whole = tok.encode("the cat sat on the mat")
        assert context + continuation == whole  # " on" is one token, not " " + "on"
        assert (whole[0] == tok.bos_token_id) == bos
        assert context == tok.encode("the cat sat")
        empty_context, tokens = encode_pair(tok, "", " dog")
        assert empty_context == [tok.bos_token_id if bos else tok.eos_token_id]
        assert tokens == tok.encode(" dog", add_special_tokens=False)


def test_metrics_take_the_first_maximum_and_normalise_by_characters():
    from dstrain.tasks.formats import Item
    from dstrain.tasks.scoring import task_metrics

    items = [
        Item((("q", " a"), ("q", " bbbb")), gold=1, choices=("a", "bbbb")),  # acc wrong, acc_norm right
        Item((("q", " a"), ("q", " b")), gold=0, choices=("a", "b")),  # a tie: the first wins, as np.argmax
    ]
    lls = [-2.0, -4.0, -1.0, -1.0]
    expected = {"task/t/acc": 0.5, "task/t/acc_norm": 1.0, "task/t/samples": 2}
    assert task_metrics("t", items, lls, [False] * 4) == expected
    greedy = [Item((("he opened the", " door"),), 0, ("door",), kind="greedy", normalised=False)] * 2
    assert task_metrics("l", greedy, [-1.0, -1.0], [True, False]) == {"task/l/acc": 0.5, "task/l/samples": 2}


def test_items_load_in_file_order_up_to_limit(tmp_path):
    from dstrain.tasks.formats import FORMATS as CONVERTERS
    from dstrain.tasks.loading import load_items

    path = write_task_file(tmp_path, "piqa", 6)
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert load_items(task("p", "piqa", path, limit=4)) == [CONVERTERS["piqa"](d) for d in docs[:4]]
    assert len(load_items(task("p", "piqa", path, limit=None))) == 6


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "r.yaml: task 'p': no file {path}; set path to a .jsonl file or a Hugging Face dataset id"),
        ('{"goal": "g"}\nnot json\n', "r.yaml: task 'p': {path} line 2 is not JSON"),
        ('{"goal": "g", "sol1": "a"}\n', "task 'p': {path} item 1 is not in the piqa format (KeyError: 'sol2')"),
        ('{"goal": "g", "sol1": "a", "sol2": "b", "label": 5}\n', "item 1: its answer is not one of its 2 choices"),
        ("\n", "r.yaml: task 'p': {path} holds no items"),
    ],
)
def test_a_bad_task_file_is_one_line_naming_it(tmp_path, content, expected):
    from dstrain.errors import DstrainError, naming_files
    from dstrain.tasks.loading import load_items

    path = tmp_path / "piqa.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DstrainError) as error, naming_files(tasks="r.yaml"):  # as the check phase names it
        load_items(task("p", "piqa", path))
    assert expected.format(path=path) in str(error.value) and "\n" not in str(error.value)


def test_recipe_tasks_are_typed_and_named_once(tmp_path, corpus):
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe

    from train_helpers import small_recipe

    entry = {"name": "piqa", "format": "piqa", "path": "piqa.jsonl", "limit": 8}
    recipe = load_recipe(small_recipe(tmp_path, corpus, train={"tasks": [entry]}))
    assert recipe.train.tasks[0].limit == 8 and recipe.train.tasks[0].split == "validation"
    for tasks, message in (
        ([{**entry, "format": "mmlu"}], "train.tasks[0].format='mmlu' is not one of"),
        ([entry, entry], "train.tasks names 'piqa' twice"),
        ([{**entry, "limit": 0}], "train.tasks[0].limit"),
    ):
        with pytest.raises(DstrainError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_recipe(small_recipe(tmp_path, corpus, name="bad", train={"tasks": tasks}))


@pytest.fixture(scope="module")
def referee(tmp_path_factory):
    """lm-eval's hf model and our scorer on a random GPT-2 (no BOS) and a random Llama (BOS-framed) export, 12 items
    of each format: {flavour: (lm-eval's result, {task: our (log-likelihoods, greedy flags)}, our metrics)}."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra .[harness]")
    from ranks import run_ranks

    tmp = tmp_path_factory.mktemp("referee")
    tasks = [task(f, f, write_task_file(tmp, f, 14), limit=12) for f in FORMATS]
    results = {}
    for flavour in ("gpt2", "llama"):
        folder = exported_model(tmp / flavour, flavour)
        from dstrain.tasks.harness import run_harness

        ours = run_ranks(1, score_folder, str(folder), tasks)[0]
        results[flavour] = (run_harness(str(folder), tasks, batch_size=4, device="cpu"), *ours)
    return results


def score_folder(folder: str, tasks) -> tuple[dict, dict]:
    """Rank target: our scorer on a Hugging Face folder, per request, and `dstrain eval --tasks`' metrics."""
    import torch
    import transformers

    from dstrain.model.gpt import GPT
    from dstrain.model.hf.convert import from_hf
    from dstrain.tasks import scoring
    from dstrain.tasks.loading import load_tasks
    from dstrain.train.process import distributed

    distributed.init()
    config, state = from_hf(folder)
    model = GPT(config).eval()
    model.load_state_dict(state)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    layout = scoring.Layout(replica=0, replicas=1, micro=4, max_len=config.max_seq_len, device=torch.device("cpu"))

    def forward(inputs, targets):
        return scoring.continuation_stats(model(inputs), targets)

    prepared = scoring.prepare(load_tasks(tasks), tok, config.max_seq_len)
    with torch.no_grad():
        per_request = {t.name: scoring.score(t.rows, forward, layout) for t in prepared}
        metrics = scoring.evaluate(prepared, forward, layout)
    return per_request, metrics


@pytest.mark.harness
@pytest.mark.parametrize("flavour", ("gpt2", "llama"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_lm_eval_agrees_item_by_item(referee, flavour, fmt):
    """Same requests (lm-eval's own task definitions build theirs), same log-likelihoods to 1e-4, same greedy flags,
    same accuracies."""
    theirs, ours, metrics = referee[flavour]
    requests = [r for item in theirs["items"][fmt] for r in item]
    lls, greedy = ours[fmt]
    assert len(requests) == len(lls) >= 12
    for (_, _, ll, is_greedy), our_ll, our_greedy in zip(requests, lls, greedy):
        assert our_ll == pytest.approx(ll, abs=LL_ATOL) and our_greedy == is_greedy
    for key in ("acc", "acc_norm", "samples"):
        assert metrics.get(f"task/{fmt}/{key}") == theirs.get(f"task/{fmt}/{key}")
    assert theirs[f"task/{fmt}/samples"] == 12


@pytest.mark.harness
def test_lm_eval_builds_the_requests_we_build(referee, tmp_path):
    """The (context, continuation) strings lm-eval made from the same documents are ours, for every format."""
    from task_fixtures import task_docs

    from dstrain.tasks.formats import FORMATS as CONVERTERS

    theirs = referee["gpt2"][0]["items"]
    for fmt in FORMATS:
        ours = [list(CONVERTERS[fmt](doc).requests) for doc in task_docs(fmt, 14)[:12]]
        assert [[(c, x) for c, x, *_ in item] for item in theirs[fmt]] == ours


VALID = {"split": "valid", "loss": 5.0, "ppl": 148.4, "samples": 8, "tasks_s": 1.25, "duration_s": 2.0}
TASKS_AT = {
    2: {"task/piqa/acc": 0.5, "task/piqa/acc_norm": 0.25, "task/piqa/samples": 4, "task/lambada/acc": 0.0},
    4: {"task/piqa/acc": 0.75, "task/piqa/acc_norm": 0.5, "task/piqa/samples": 4, "task/lambada/acc": 0.25},
}


def write_run(run_dir):
    run_dir.mkdir()
    lines = [{"step": s, "loss": 5.0, "lr": 1e-3} for s in (1, 2, 3, 4)]
    lines += [{"step": s, **VALID, **numbers} for s, numbers in TASKS_AT.items()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))


def test_the_eval_line_names_each_tasks_accuracies(tmp_path, capsys):
    from dstrain.metrics import MetricsLog

    MetricsLog(RunDir(tmp_path), True, 4).print_eval({"step": 4, **VALID, **TASKS_AT[4]})
    assert capsys.readouterr().out.splitlines()[-1] == (
        "eval step 4 | valid loss 5.0000 | ppl 148.40 | piqa acc 0.750 norm 0.500 | lambada acc 0.250 | tasks 1.2s"
    )


def test_tasks_png_beside_loss_png_and_the_compare_row(tmp_path):
    from dstrain.commands.compare_runs import read_run
    from dstrain.train.plot import read_task_curves, try_plot_run

    write_run(tmp_path / "zero1")
    assert try_plot_run(RunDir(tmp_path / "zero1")) == tmp_path / "zero1" / "loss.png"
    assert (tmp_path / "zero1" / "tasks.png").stat().st_size > 0
    assert read_task_curves(tmp_path / "zero1" / "metrics.jsonl") == {
        "piqa/acc": [(2, 0.5), (4, 0.75)],
        "piqa/acc_norm": [(2, 0.25), (4, 0.5)],
        "lambada/acc": [(2, 0.0), (4, 0.25)],
    }
    assert read_run(tmp_path / "zero1").tasks == "piqa 0.750/0.500, lambada 0.250"


def test_requests_are_padded_to_their_own_bucket():
    """A request's shape depends on its own length only (so its numbers do not depend on its neighbours or on the
    number of replicas); multiples of the SP size, within the model's length."""
    import torch

    from dstrain.tasks.scoring import BUCKET, Layout, lengths

    rows = [([1] * n, 1) for n in (2, BUCKET + 1, BUCKET + 2, 3 * BUCKET, 10 * BUCKET)]
    layout = Layout(replica=0, replicas=2, micro=4, max_len=4 * BUCKET, device=torch.device("cpu"))
    assert lengths(rows, layout) == {BUCKET: [0, 1], 2 * BUCKET: [2], 3 * BUCKET: [3], 4 * BUCKET: [4]}
    sp3 = Layout(replica=0, replicas=1, micro=4, max_len=100, device=torch.device("cpu"), multiple_of=3)
    step = -(-BUCKET // 3) * 3  # the bucket rounded up to a multiple of 3, up to 99 = 100 - 100 % 3
    assert lengths(rows, sp3) == {step: [0, 1, 2], 99: [3, 4]}


def test_dstrain_eval_refuses_bad_task_arguments_in_one_line(tmp_path, capsys):
    from dstrain.commands.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "tasks.yaml").write_text("- {name: p, format: piqa, path: p.jsonl, limt: 3}\n")
    cases = [
        (["eval", hf, "--harness"], "--harness scores downstream tasks: add --tasks [YAML]"),
        (["eval", hf, "--tasks"], f"--tasks alone: {hf} is not a run with train.tasks; pass --tasks FILE.yaml"),
        (["eval", hf, "--tasks", tmp_path / "none.yaml"], "none.yaml: no such file"),
        (["eval", hf, "--tasks", tmp_path / "tasks.yaml"], "unknown key tasks[0].limt; did you mean tasks[0].limit?"),
    ]
    for argv, message in cases:
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and err[-1].startswith("dstrain: error: "), err

"""DeepSeek's architecture under every strategy it takes (2 gloo ranks, fp32, 10 steps each): latent attention (MLA,
with doc masking) gives ZeRO-1's losses and pre-clip gradient norms under ZeRO-3, two pipeline stages and Ulysses
sequence parallelism; MLA + DeepSeekMoE (sigmoid scores, groups, a shared expert, a dense first block, the
loss-free balancing bias moving every step) gives EP1's under EP2, bias included, and so does GLM-4.5's form (the
same MoE with grouped-query attention, q/k/v biases, q/k norms and partial RoPE). AutoTP is refused by name."""

import pytest
from test_moe import run_all

from ranks import run_ranks
from train_helpers import read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

RTOL = 1e-5  # the same fp32 sums in another order (ZeRO-3's partitions, EP2's joined expert matmuls)
MLA = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}
MLA_MODEL = {"n_kv_head": None, "doc_masking": True, "mla": MLA}
DEEPSEEK_MOE = {
    "num_experts": 4,
    "top_k": 2,
    "scoring": "sigmoid",
    "router_fp32": True,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.0,
    "dense_layers": [0],
    "aux_loss_coef": 0.0,
    "bias_update_rate": 0.01,
}
MLA_LAYOUTS = {"mla_zero1": "zero1", "mla_zero3": "zero3", "mla_pp2": "pp2_zero1", "mla_sp2": "sp2_zero1"}
MOE_LAYOUTS = {"deepseek_ep1": "zero1", "deepseek_ep2": "ep2_zero1"}
# GLM-4.5's form: DeepSeek's router with grouped-query attention, q/k/v biases, q/k norms, half of each head rotated
GLM_MODEL = {"family": "glm4_moe", "qkv_bias": True, "qk_norm": "head", "partial_rotary_factor": 0.5}
GLM_LAYOUTS = {"glm_ep1": "zero1", "glm_ep2": "ep2_zero1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("deepseek")
    mla = small_recipe(tmp, corpus, name="mla", model=MLA_MODEL)
    deepseek = small_recipe(tmp, corpus, name="deepseek", model={**MLA_MODEL, "moe": DEEPSEEK_MOE})
    glm = small_recipe(tmp, corpus, name="glm", model={**GLM_MODEL, "moe": DEEPSEEK_MOE})
    d = {name: tmp / name for name in [*MLA_LAYOUTS, *MOE_LAYOUTS, *GLM_LAYOUTS]}
    calls = [("train", [train_argv(mla, config, d[name])]) for name, config in MLA_LAYOUTS.items()]
    calls += [("train", [train_argv(deepseek, config, d[name])]) for name, config in MOE_LAYOUTS.items()]
    calls += [("train", [train_argv(glm, config, d[name])]) for name, config in GLM_LAYOUTS.items()]
    assert run_ranks(2, run_all, calls) == [[0] * len(calls)] * 2
    return d


def train_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "split" not in r]


@pytest.mark.parametrize(
    "run, reference",
    [
        ("mla_zero3", "mla_zero1"),
        ("mla_pp2", "mla_zero1"),
        ("mla_sp2", "mla_zero1"),
        ("deepseek_ep2", "deepseek_ep1"),
        ("glm_ep2", "glm_ep1"),
    ],
)
def test_latent_attention_and_deepseek_moe_give_the_same_losses_and_gradients(runs, run, reference):
    ours, theirs = train_records(runs[run]), train_records(runs[reference])
    assert len(ours) == len(theirs) == 10
    keys = ["loss"] if run == "mla_pp2" else ["loss", "grad_norm"]  # DeepSpeed's pipeline engine reports none
    if run.startswith(("deepseek", "glm")):
        keys += ["moe_layer1_bias_min", "moe_layer1_bias_max", "moe_layer1_share_max"]
    for key in keys:
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=RTOL), key
    assert theirs[-1]["loss"] < theirs[0]["loss"] - 0.3


def test_the_balancing_bias_moves_by_the_rate_each_step(runs):
    records = train_records(runs["deepseek_ep2"])
    spread = [r["moe_layer1_bias_max"] - r["moe_layer1_bias_min"] for r in records]
    assert records[0]["moe_layer1_bias_max"] == pytest.approx(0.01) or records[0]["moe_layer1_bias_min"] == -0.01
    assert max(spread) <= 2 * 0.01 * 10 + 1e-9 and spread[-1] > 0  # never more than the rate per step


def test_tensor_parallel_latent_attention_is_refused_by_name(tmp_path, corpus):
    from dstrain.errors import DstrainError
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve

    from train_helpers import ROOT

    recipe = load_recipe(small_recipe(tmp_path, corpus, name="mla", model=MLA_MODEL))
    config = ROOT / "ds_configs" / "tp2_zero1.json"
    with pytest.raises(DstrainError, match="tensor_parallel with model.mla is not supported.*kv_a_proj_with_mqa"):
        resolve(recipe, "mla.yaml", load_ds_config(config), str(config), 2)

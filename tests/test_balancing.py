"""DeepSeek-V3's loss-free balancing (train/features/balancing.py) against a plain re-implementation of the paper's
words
(section 2.1.2: "decrease the bias term by gamma if its corresponding expert is overloaded and increase it by gamma
if its corresponding expert is underloaded"), with the load summed over micro-batches and ranks."""

import pytest
import torch

from ranks import run_ranks

pytestmark = pytest.mark.distributed

RATE = 0.05
STEPS, MICRO_BATCHES = 3, 2


def paper_update(bias: list[float], load: list[float], rate: float) -> list[float]:
    mean = sum(load) / len(load)
    return [b - rate if n > mean else b + rate if n < mean else b for b, n in zip(bias, load)]


def train_steps_with_balancing() -> tuple[list, list]:
    """Rank target: a tiny MLA + DeepSeekMoE model, forwards on this rank's own tokens, the component's hooks as the
    loop calls them; returns (this rank's loads per step and MoE layer, the buffers' biases after each step)."""
    import deepspeed

    from dstrain.model.config import GPTConfig, MLAConfig, MoEConfig
    from dstrain.model.gpt import GPT
    from dstrain.train.features.balancing import LossFreeBalancing
    from dstrain.train.step.components import StepOutcome

    deepspeed.init_distributed(dist_backend="gloo")
    moe = MoEConfig(num_experts=8, top_k=2, scoring="sigmoid", n_group=4, topk_group=2, bias_update_rate=RATE)
    mla = MLAConfig(kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    config = GPTConfig(flavour="llama", vocab_size=64, n_layer=2, n_head=2, d_model=32, moe=moe, mla=mla)
    torch.manual_seed(0)
    model = GPT(config).train()
    own = [torch.distributed.new_group([r]) for r in range(torch.distributed.get_world_size())]
    for block in model.blocks:  # experts on every rank (EP1): each rank's tokens stay on it, no engine needed
        block.mlp.moe.deepspeed_moe._set_ep_group(own[torch.distributed.get_rank()])
    rule = LossFreeBalancing(model, config, "cpu")
    rule.on_train_start()
    tokens = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    loads, biases = [], []
    for step in range(1, STEPS + 1):
        rule.on_phase("step", step)
        step_loads = [torch.zeros(8, dtype=torch.float64) for _ in rule.routers]
        for _ in range(MICRO_BATCHES):
            model(torch.randint(0, 64, (2, 16), generator=tokens))
            rule.objective(torch.zeros(()))
            for total, router in zip(step_loads, rule.routers):
                total += router.counts
        rule.on_step_end(StepOutcome(step, 0.0, 0.0, False))
        loads.append([t.tolist() for t in step_loads])
        biases.append([r.e_score_correction_bias.tolist() for r in rule.routers])
    return loads, biases


def test_bias_moves_as_the_paper_says_with_the_load_of_every_rank():
    results = run_ranks(2, train_steps_with_balancing)
    (loads0, biases0), (loads1, biases1) = results
    assert biases0 == biases1  # every rank holds the same bias
    expected = [[0.0] * 8, [0.0] * 8]
    for step in range(STEPS):
        for layer in range(2):
            load = [a + b for a, b in zip(loads0[step][layer], loads1[step][layer])]
            assert sum(load) == 2 * 2 * MICRO_BATCHES * 2 * 16  # top 2 of every token of both ranks
            expected[layer] = paper_update(expected[layer], load, RATE)
            assert biases0[step][layer] == pytest.approx(expected[layer], abs=1e-6)
    assert any(b != 0 for b in biases0[-1][0])  # the rule acted


def test_the_fp32_bias_is_kept_in_the_client_state_and_written_back_into_the_buffers():
    """A resumed run's component takes the saved fp32 biases (not the buffers, which a bf16 engine rounds) and writes
    them into its routers; a run that saved none starts from the buffers as loaded."""
    from dstrain.model.config import GPTConfig, MoEConfig
    from dstrain.model.gpt import GPT
    from dstrain.train.features.balancing import LossFreeBalancing

    moe = MoEConfig(num_experts=4, top_k=2, scoring="sigmoid", bias_update_rate=RATE)
    config = GPTConfig(flavour="llama", vocab_size=64, n_layer=2, n_head=2, d_model=32, moe=moe)
    saved = torch.tensor([0.125, -0.0625, 1e-4, 0.0])
    model = GPT(config)
    rule = LossFreeBalancing(model, config, "cpu")
    rule.load_state_dict({"biases": [saved, -saved]})
    rule.on_train_start()
    assert [r.e_score_correction_bias.tolist() for r in rule.routers] == [saved.tolist(), (-saved).tolist()]
    assert torch.equal(rule.state_dict()["biases"][1], -saved)
    fresh = GPT(config)
    fresh.blocks[0].mlp.router.e_score_correction_bias.fill_(0.5)  # as a checkpoint's module state left it
    again = LossFreeBalancing(fresh, config, "cpu")
    again.load_state_dict(None)
    again.on_train_start()
    assert again.state_dict()["biases"][0].tolist() == [0.5] * 4

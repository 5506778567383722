"""The RL step (dstrain.train.objectives.online_rl) on DeepSpeed engines of 2 gloo ranks: ZeRO-0, 1, 2 and 3 (parameters
partitioned, gathered once for the rollout) and accumulation 1 vs 2 sample the same completions and give the same
losses and pre-clip gradient norms (fp32, 1e-5) over two iterations on one rollout (the second clipped against the
first, with the KL term to the initial weights); all-equal rewards give exactly zero update; a failing reward is
named with its prompt."""

from __future__ import annotations

import pytest
import torch

from dstrain.errors import DstrainError
from dstrain.model.config import GPTConfig
from dstrain.objectives.rl_config import RewardConfig, RLConfig
from dstrain.objectives.rl_rewards import Reward, load_rewards, score
from dstrain.train.objectives.online_rl.rollout import Prompt

from ranks import run_ranks

CONFIG = GPTConfig(flavour="llama", vocab_size=64, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                   d_ff=64, init_std=0.2)  # fmt: skip
PROMPTS = [Prompt(i, [3 + i, 7, 11 + 2 * i][: 1 + i % 3], f"p{i}", {"target": i % 2}) for i in range(4)]


def even_share(prompts, completions, completion_ids, target, **_):
    """The share of a completion's tokens whose parity is the prompt's target."""
    return [sum(t % 2 == want for t in ids) / max(len(ids), 1) for ids, want in zip(completion_ids, target)]


def constant(prompts, completions, **_):
    return [0.5] * len(completions)


def rl_config(**overrides) -> RLConfig:
    base = dict(prompts="unused", rewards=[RewardConfig("test:even_share")], group_size=4, prompts_per_step=4,
                max_new_tokens=6, temperature=1.0, loss_type="grpo", iterations=2, epsilon=0.05, beta=0.0)  # fmt: skip
    return RLConfig(**{**base, **overrides})


def train_layouts(layouts: list[tuple[int, int]], cfg: RLConfig, function) -> list:
    """(losses, grad norms, the step's rewards, completions of rank 0, how far the weights moved) per layout."""
    import deepspeed

    from dstrain.model.gpt import GPT
    from dstrain.train.engine import grad_norm
    from dstrain.train.objectives.online_rl.rollout import rollout
    from dstrain.train.objectives.online_rl.step import RLStep

    results = []
    for stage, accum in layouts:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        start = [p.detach().clone() for p in model.parameters()]
        micro = cfg.completions_per_step // (2 * accum)
        ds = {"train_batch_size": micro * accum * 2, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accum, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
        grad_norm.install(engine)  # ZeRO-0's pre-clip norm, as the trainer's engine keeps it
        rank = torch.distributed.get_rank()
        rewards = [Reward("test", 1.0, function)]
        out = rollout(engine.module, PROMPTS, cfg, 5, 1, rewards, str, [1], 0, stage, rank, 2)
        reference = None
        if cfg.beta:  # the KL term's reference: the initial weights, whole on each rank
            torch.manual_seed(0)
            reference = GPT(CONFIG).requires_grad_(False)
        steps = RLStep(engine, cfg, micro, accum, 2, reference).steps(out)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else _nothing():
            moved = max((p.detach() - s).abs().max().item() for p, s in zip(engine.module.parameters(), start))
        completions = [out.decoded.completion(r) for r in range(out.decoded.tokens.shape[0])]
        results.append(([s.loss for s in steps], [s.grad_norm for s in steps], out.weighted.tolist(), completions,
                        moved))  # fmt: skip
    return results


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_zero_stages_and_accumulation_give_the_same_rl_steps():
    layouts = [(0, 1), (1, 2), (2, 1), (3, 2)]
    by_rank = run_ranks(2, train_layouts, layouts, rl_config(beta=0.04), even_share)  # with the KL term
    base_losses, base_norms, base_rewards, _, _ = by_rank[0][0]
    assert len(set(base_rewards)) > 1  # rewards vary: the step has a gradient
    for rank_results in by_rank:
        for (stage, accum), (losses, norms, rewards, completions, _) in zip(layouts, rank_results):
            assert rewards == base_rewards, (stage, accum)  # the same samples, whoever drew them
            assert completions == rank_results[0][3]
            assert losses == pytest.approx(base_losses, abs=1e-5), (stage, accum)
            assert norms == pytest.approx(base_norms, abs=1e-5), (stage, accum)
    assert by_rank[0][0][3] != by_rank[1][0][3]  # the ranks decode different shares


def test_equal_rewards_give_exactly_zero_update():
    """Every group's rewards equal: loss 0, gradient norm 0, and the weights unchanged bit for bit (lr 1e-2, AdamW
    with weight decay 0 in the ds_config above)."""
    by_rank = run_ranks(2, train_layouts, [(0, 1), (3, 2)], rl_config(), constant)
    for rank_results in by_rank:
        for losses, norms, _, _, moved in rank_results:
            assert losses == [0.0, 0.0] and norms == [0.0, 0.0] and moved == 0.0


def test_reward_faults_are_named_with_the_prompt():
    def nan_on_third(prompts, completions, **_):
        return [float("nan") if i == 2 else 1.0 for i in range(len(completions))]

    def raises_on_p7(prompts, completions, **_):
        if "p7" in prompts:
            raise ValueError("no answer")
        return [1.0] * len(completions)

    args = (["p5", "p6", "p7"], ["a", "b", "c"], [[1], [2], [3]], {}, [5, 6, 7])
    with pytest.raises(DstrainError, match=r"reward t:nan returned nan for a completion of prompt 7"):
        score([Reward("t:nan", 1.0, nan_on_third)], *args)
    with pytest.raises(DstrainError, match=r"reward t:raise raised ValueError: no answer \(on prompt 7\)"):
        score([Reward("t:raise", 1.0, raises_on_p7)], *args)
    with pytest.raises(DstrainError, match=r"returned 1 values for 3 completions \(prompts 5..7\)"):
        score([Reward("t:short", 1.0, lambda **_: [1.0])], *args)


def test_a_reward_path_that_does_not_resolve_is_refused():
    assert load_rewards([RewardConfig("test_rl_step:even_share")])[0].function is even_share
    for path, message in [("nowhere.module:f", r"rl.rewards\[0\].function: cannot import nowhere.module"),
                          ("test_rl_step:missing", "has no function missing"),
                          ("test_rl_step", "is not an import path")]:  # fmt: skip
        with pytest.raises(DstrainError, match=message):
            load_rewards([RewardConfig(path)])

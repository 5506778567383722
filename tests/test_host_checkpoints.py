"""Activation checkpoints held in host memory (ds_config ``activation_checkpointing.cpu_checkpointing``,
dstrain.train.engine.host_checkpoints) on CPU ranks (gloo, fp32): bit-equal losses and pre-clip gradient norms with and
without it, under ZeRO-1 and under Ulysses SP2 with ZeRO-3; and the DeepSpeed defect it works around."""

from __future__ import annotations

import pytest

import train_helpers
from ranks import run_ranks
from train_helpers import ds_config, read_metrics, small_recipe, train_argv

pytestmark = pytest.mark.distributed

HOST = {"partition_activations": False, "cpu_checkpointing": True}
DEVICE = {"partition_activations": False, "cpu_checkpointing": False}


def train_held_on_host(args: list[str]) -> tuple[int, bool]:
    """Rank target: train, and say whether DeepSpeed's checkpointing held the inputs on the host."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    return train_helpers.train(args), checkpointing.CPU_CHECKPOINT


def run_all(calls: list) -> list:
    return [train_held_on_host(args) for args in calls]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus):
    tmp = tmp_path_factory.mktemp("host_checkpoints")
    recipe = small_recipe(tmp, tiny_corpus, model={"doc_masking": True})
    names = {}
    for base in ("zero1", "sp2_zero3"):
        for where, section in (("device", DEVICE), ("host", HOST)):
            names[f"{base}_{where}"] = ds_config(tmp, base, activation_checkpointing=section)
    calls = [train_argv(recipe, config, tmp / name) for name, config in names.items()]
    results = run_ranks(2, run_all, calls)
    assert results[0] == results[1] == [(0, name.endswith("host")) for name in names]
    return {name: [r for r in read_metrics(tmp / name) if "split" not in r] for name in names}


@pytest.mark.parametrize("base", ["zero1", "sp2_zero3"])
def test_host_held_checkpoints_give_bit_equal_losses_and_grad_norms(runs, base):
    device, host = runs[f"{base}_device"], runs[f"{base}_host"]
    assert len(host) == len(device) == 10
    assert [r["loss"] for r in host] == [r["loss"] for r in device]
    assert [r["grad_norm"] for r in host] == [r["grad_norm"] for r in device]


def deepspeed_checkpoint_in_cpu() -> str:
    """Rank target: one block checkpointed by DeepSpeed alone with checkpoint_in_cpu, its backward's outcome."""
    import deepspeed
    import torch

    from dstrain.train.process import distributed

    distributed.init()
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=True)
    block = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True) * 2  # a block's input: the output of what came before
    try:
        deepspeed.checkpointing.checkpoint(block, x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "ok"


@pytest.mark.deepspeed_defect("cpu_checkpointing empties a host-resident input before keeping it")
def test_deepspeed_cpu_checkpointing_loses_host_resident_inputs():
    """DeepSpeed 0.19.8 keeps the emptied argument as the saved copy when the copy to the host is the argument
    itself; when this fails, remove dstrain.train.engine.host_checkpoints._cpu_activations_for_backward."""
    assert "at least 1D" in run_ranks(1, deepspeed_checkpoint_in_cpu)[0]

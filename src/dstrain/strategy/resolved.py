"""The resolved strategy (dstrain.strategy.resolve makes it): the ds_config DeepSpeed receives, dstrain's own
sections beside it, the topology, the batch split and offload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dstrain.monitors.settings import MONITOR_BLOCKS
from dstrain.precision import Precision
from dstrain.strategy.topology import Topology

# The ds_config sections dstrain reads and DeepSpeed is not given: "expert_parallel" is the size of the classic MoE
# layer (dstrain.strategy.parallel; given to DeepSpeed it would turn on AutoEP, which finds no layer of its own here);
# the monitor blocks are dstrain's to write (dstrain.monitors, at the optimizer step: DeepSpeed's own writers would
# log its events at the sample count, a second x-axis).
OWN_SECTIONS = ("expert_parallel", *MONITOR_BLOCKS)


def precision_of(ds_config: dict) -> Precision:
    """ "fp16", "bf16" or "fp32", as DeepSpeed reads a ds_config's switches (resolve also checks them)."""
    if ds_config.get("fp16", {}).get("enabled", False):
        return "fp16"
    return "bf16" if ds_config.get("bf16", {}).get("enabled", False) else "fp32"


def offload_of(ds_config: dict, key: str) -> str | None:
    """Where zero_optimization.<key> ("offload_optimizer" / "offload_param") puts its state: "cpu", "nvme" or None."""
    device = ds_config.get("zero_optimization", {}).get(key, {}).get("device", "none")
    return None if device == "none" else device


@dataclass(frozen=True)
class Strategy:
    """A ds_config resolved against a recipe and a world size (dstrain.strategy.resolve.resolve)."""

    # Complete, with no "auto" left: exactly what deepspeed.initialize (and zero.Init) receives, never edited after
    # resolution (a resume that loads a converted checkpoint gets a new Strategy: checkpoint.reshard.prepare_resume).
    deepspeed_config: dict
    # The ds_config's sections dstrain reads itself and DeepSpeed is not given (OWN_SECTIONS).
    own_sections: dict
    source: str  # the ds_config file it came from
    topology: Topology  # ZeRO stage, precision, parallel sizes (ds_config "tensor_parallel.autotp_size",
    # "pipeline.stages", "expert_parallel.autoep_size", "sequence_parallel_size"; data-parallel: what is left)
    micro_batch: int  # samples per rank per forward/backward
    grad_accum: int  # micro-batches per optimizer step on each rank
    offload_optimizer: str | None  # "cpu", "nvme" or None
    offload_param: str | None
    # the loss in this many sequence tiles of each rank's slice (ds_config "tiling.loss", "auto" when absent:
    # dstrain.strategy.tiling); Range: 1 (off) .. seq_len / sp, a divisor
    loss_tiles: int = 1
    mlp_tiles: int = 1  # each MLP in this many sequence tiles (ds_config "tiling.mlp"); Range: 1 (off), a divisor

    @property
    def resolved_ds_config(self) -> dict:
        """The resolved ds_config as a file holds it (the run folder's ds_config.json, a ds_config `plan` writes):
        what DeepSpeed receives and dstrain's own sections."""
        return {**self.deepspeed_config, **self.own_sections}

    @property
    def name(self) -> str:
        return Path(self.source).stem

    def ep_rank(self, rank: int) -> int:
        """The index of global `rank` in its expert-parallel group: DeepSpeed groups consecutive ranks
        (deepspeed.utils.groups._create_expert_and_data_parallel, data-before-expert-parallel off)."""
        return rank % self.ep_size

    # The topology's fields, read through the strategy.
    @property
    def zero_stage(self) -> int:
        return self.topology.zero_stage

    @property
    def precision(self) -> Precision:
        return self.topology.precision

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    @property
    def pp_stages(self) -> int:
        return self.topology.pp_stages

    @property
    def ep_size(self) -> int:
        return self.topology.ep_size

    @property
    def sp_size(self) -> int:
        return self.topology.sp_size

    @property
    def zero_partitions(self) -> int:
        """Ranks ZeRO partitions the model states over: the data-parallel replicas, and under sequence parallelism
        their SP ranks too (DeepSpeed's sequence-data-parallel group)."""
        return self.dp_size * self.sp_size

    @property
    def pipe_schedule(self) -> str:
        return self.topology.pipe_schedule

    @property
    def pipe_checkpoint_interval(self) -> int:
        """A pipeline's activation_checkpoint_interval as given (0: none), else 1 where the ds_config has an
        activation_checkpointing section (every block, as for the plain model); the two together are refused."""
        pipeline = self.deepspeed_config.get("pipeline", {})
        return pipeline.get("activation_checkpoint_interval", int("activation_checkpointing" in self.deepspeed_config))

    @property
    def activation_checkpointing(self) -> bool:
        """Blocks recompute their activations in the backward: the ds_config's activation_checkpointing section,
        or a pipeline's activation_checkpoint_interval."""
        return "activation_checkpointing" in self.deepspeed_config or (
            self.pp_stages > 1 and self.pipe_checkpoint_interval > 0
        )

    @property
    def host_checkpoints(self) -> bool:
        """Each checkpointed block input is held in host memory (activation_checkpointing.cpu_checkpointing:
        dstrain.train.engine.host_checkpoints)."""
        return bool(self.deepspeed_config.get("activation_checkpointing", {}).get("cpu_checkpointing", False))

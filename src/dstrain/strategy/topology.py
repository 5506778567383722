"""How a run is laid out (ZeRO stage, precision, parallel sizes, pipeline schedule): what each checkpoint records,
what a resume compares, what reports show. dstrain.strategy.resolve derives it from a ds_config; a live engine
gives it back (``from_engine``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dstrain.precision import Precision


@dataclass(frozen=True)
class Topology:
    """How a run is laid out: what each checkpoint records, what a resume compares, what reports show."""

    world_size: int
    zero_stage: int
    dp_size: int  # data-parallel replicas: world / (tp x pp x sp)
    tp_size: int  # AutoTP degree
    pp_stages: int  # pipeline stages
    precision: Precision
    ep_size: int = 1  # expert-parallel degree: each MoE layer's experts split over this many ranks
    sp_size: int = 1  # sequence-parallel (Ulysses) degree
    pipe_schedule: str = "1f1b"  # or "dualpipev": each rank holds two stages, so its files hold other layers

    @classmethod
    def from_engine(cls, engine) -> Topology:
        import torch
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import groups

        world = torch.distributed.get_world_size()
        tp_size = max(1, int(engine.autotp_size() or 1))
        pp_stages = int(getattr(engine, "num_stages", 1))
        sp_size = int(groups._get_sequence_parallel_world_size())
        return cls(
            world_size=world,
            zero_stage=int(engine.zero_optimization_stage()),
            # engine.dp_world_size is None under an SP mpu (DeepSpeed 0.19.8): the replicas are what is left.
            dp_size=world // (tp_size * pp_stages * sp_size),
            tp_size=tp_size,
            pp_stages=pp_stages,
            precision="bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
            ep_size=max([m.ep_size for m in engine.module.modules() if isinstance(m, MoE)], default=1),
            sp_size=sp_size,
            pipe_schedule="dualpipev" if type(engine).__name__ == "DualPipeVEngine" else "1f1b",
        )

    @classmethod
    def from_record(cls, record: dict) -> Topology:
        """From a checkpoint's record (``to_record``)."""
        return cls(**record)

    def to_record(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [
            f"ZeRO-{self.zero_stage} {self.precision}",
            f"{self.world_size} rank{'s' if self.world_size > 1 else ''}",
        ]
        if self.tp_size > 1:
            parts.append(f"tensor-parallel {self.tp_size}")
        if self.pp_stages > 1:
            parts.append(f"{self.pp_stages} pipeline stages" + (" (DualPipeV)" * (self.pipe_schedule == "dualpipev")))
        if self.ep_size > 1:
            parts.append(f"expert-parallel {self.ep_size}")
        if self.sp_size > 1:
            parts.append(f"sequence-parallel {self.sp_size}")
        return ", ".join(parts)

"""What a memory estimate is made of: one Part per thing a rank holds, and the Estimate that adds them up per place
(device, cpu, nvme) and phase of a step; `dstrain estimate --json` prints an Estimate. dstrain.plan.memory makes
them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dstrain.precision import Precision

GIB = 2**30
PHASES = ("backward", "step")  # of a training step; an objective's pass before step 1 adds "reference"


@dataclass
class Part:
    group: str  # parameters | gradients | optimizer states | activations | buffers
    name: str
    where: str  # device | cpu | nvme
    backward: int  # bytes per rank during the last backward of a step
    step: int  # bytes per rank during the optimizer step
    formula: str
    reference: int = 0  # bytes per rank during the objective's pass before step 1 (preference's reference pass)


@dataclass
class Estimate:
    recipe: str
    ds_config: str
    nodes: int
    gpus_per_node: int
    zero_stage: int
    precision: Precision
    micro_batch: int
    grad_accum: int
    dp_size: int
    tp_size: int
    pp_stages: int
    offload_optimizer: str | None
    offload_param: str | None
    params_total: int
    params_per_rank: int
    device_memory: int  # bytes
    reserve: int  # bytes kept free for the CUDA context, communicator buffers and fragmentation
    parts: list[Part] = field(default_factory=list)
    deepspeed_reference: dict | None = None  # DeepSpeed's own estimator, for comparison
    ep_size: int = 1  # expert-parallel size: each rank holds 1/ep_size of every MoE layer's experts
    params_active: int | None = None  # MoE: parameters a token runs through (router and top_k experts per layer)
    sp_size: int = 1  # sequence-parallel degree
    reference_pass: bool = False  # the objective's pass before step 1 is a phase (Part.reference; reference_memory)

    @property
    def phases(self) -> tuple[str, ...]:
        return PHASES + (("reference",) if self.reference_pass else ())

    def total(self, where: str, phase: str, groups: tuple[str, ...] | None = None) -> int:
        return sum(getattr(p, phase) for p in self.parts if p.where == where and (groups is None or p.group in groups))

    def peak(self, where: str = "device") -> int:
        return max(self.total(where, phase) for phase in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: self.total("device", phase))

    def model_states(self, phase: str | None = None) -> int:
        """Parameters, gradients and optimizer states of one rank, wherever they live (peak over phases)."""
        groups = ("parameters", "gradients", "optimizer states")
        phases = [phase] if phase else PHASES
        return max(sum(self.total(w, ph, groups) for w in ("device", "cpu", "nvme")) for ph in phases)

    @property
    def fits(self) -> bool:
        return self.peak("device") + self.reserve <= self.device_memory

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(
            peak_phase=self.peak_phase,
            device_peak=self.peak("device"),
            fits=self.fits,
            cpu_per_node=self.peak("cpu") * self.gpus_per_node,
            nvme_per_node=self.peak("nvme") * self.gpus_per_node,
            model_states=self.model_states(),
        )
        if self.reference_pass:
            data.update(reference_device=self.total("device", "reference"))
            data.update(reference_cpu=self.total("cpu", "reference"))
        return data

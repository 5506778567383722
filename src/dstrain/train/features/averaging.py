"""Weight averaging (recipe ``train.averaging``): an EMA of the weights and/or the mean of the last N sampled states.

Each rank averages, in fp32, exactly the weights it holds: the whole model under ZeRO-0/1/2, its partition
(``param.ds_tensor``) under ZeRO-3, its stage's layers under a pipeline, its shards under AutoTP. Nothing is
gathered to update, save or evaluate the average, so it costs per rank 4 bytes x (1 for the EMA + N for last-N) x
the parameters the rank holds (``dstrain estimate``'s "weight average" part), plus, during an evaluation of the
average, a copy of the live weights in their dtype and (last-N) one fp32 mean.

- EMA: ``ema = lerp(ema, w, 1 - d)`` after every step past ``start_step`` (the first such step sets ``ema = w``),
  with ``d = 0.5 ** (global_batch x seq_len / ema_half_life_tokens)``: the same half-life in tokens at any batch size.
- last-N: the states at the last N steps that are multiples of ``last_n_every`` (past ``start_step``), kept as a
  window of fp32 copies (oldest first); the average is their sum in that order, divided by how many there are.

Why not torch.optim.swa_utils.AveragedModel: it deep-copies a whole module and averages ``module.parameters()``,
which under ZeRO-3 are empty placeholders (the weights live in ``ds_tensor`` partitions), and keeps the copy in the
parameters' dtype (bf16 in a bf16 run). Its EMA step (``get_ema_multi_avg_fn``) is used as it is, on our fp32 lists.

Each checkpoint holds one file per rank, ``averaged_weights.rank<r>.pt`` (written and checksummed with the tag's
other files by dstrain.checkpoint.store, read through safe_load), so that a resume continues the average bit for
bit. A resume on another layout reads it when every rank held the whole model in both (ZeRO-0/1/2 without
pipeline, tensor or expert parallelism, any data-parallel size); any other change of layout is refused in one line.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from dstrain.checkpoint import safe_load
from dstrain.checkpoint.averaged import FILE, KINDS, window_mean
from dstrain.config import AveragingConfig
from dstrain.errors import DstrainError
from dstrain.strategy.topology import Topology
from dstrain.train.step.components import Component, StepOutcome, Verdict
from dstrain.train.step.handle import RunHandle


def held_parameters(engine) -> tuple[list[str], list[torch.Tensor], list[tuple[int, ...]]]:
    """(names, the tensor of each that this rank holds, each parameter's whole shape), in module order."""
    names, tensors, shapes = [], [], []
    for name, param in engine.module.named_parameters():
        partition = getattr(param, "ds_tensor", None)  # ZeRO-3: this rank's flat slice
        names.append(name)
        tensors.append(param.data if partition is None else partition.data)
        shapes.append(tuple(getattr(param, "ds_shape", param.shape)))
    return names, tensors, shapes


def layer_keys(engine) -> list[tuple[int, str]] | None:
    """Under a pipeline, (layer index, name in its layer file) of each held parameter, as PipelineModule saves
    them (dstrain.checkpoint.consolidate reads those files); None otherwise."""
    layers = getattr(engine.module, "forward_funcs", None)
    if layers is None:
        return None
    where: dict[int, tuple[int, str]] = {}
    for index, layer in enumerate(layers, start=engine.module._local_start):  # as PipelineModule.ckpt_layer_path
        if isinstance(layer, torch.nn.Module):
            for own, param in layer.named_parameters():
                where.setdefault(id(param), (index, own))
    return [where[id(param)] for _, param in engine.module.named_parameters()]


def layout_of(t: Topology) -> dict:
    """What decides which tensors a rank holds: two runs of equal layouts hold the same slices on each rank."""
    return {"world_size": t.world_size, "partitioned": t.zero_stage == 3, "pp_stages": t.pp_stages,
            "tp_size": t.tp_size, "ep_size": t.ep_size}  # fmt: skip


def readable(saved: dict, now: dict) -> bool:
    """Whether an average saved under layout ``saved`` can be read onto ``now`` (rank 0's file when the two differ,
    where every rank held the whole model in both)."""
    return saved == now or (holds_whole_model(saved) and holds_whole_model(now))


def check_resume(tag_dir: Path, config: AveragingConfig, strategy) -> None:
    """Before any work (``strategy``: the resolved ds_config): a resume whose saved average this layout cannot read
    is refused in one line, before a conversion for the new layout is made."""
    files = sorted(tag_dir.glob(FILE.format(0)))
    if not config.enabled or not files:
        return
    saved = safe_load.load(files[0], mmap=True)["layout"]  # the tensors stay on disk, unread
    if not readable(saved, layout_of(strategy.topology)):
        raise DstrainError(refusal(tag_dir, saved, layout_of(strategy.topology)))


def holds_whole_model(layout: dict) -> bool:
    return not layout["partitioned"] and layout["pp_stages"] == layout["tp_size"] == layout["ep_size"] == 1


def split_name(kind: str, kinds: list[str]) -> str:
    """The metrics split of an average: valid/averaged, or valid/averaged/<kind> when the recipe asks for both."""
    return "valid/averaged" if len(kinds) == 1 else f"valid/averaged/{kind}"


def configured_kinds(config: AveragingConfig) -> list[str]:
    return [k for k, on in zip(KINDS, (config.ema_half_life_tokens is not None, config.last_n is not None)) if on]


def ema_decay(config: AveragingConfig, tokens_per_step: int) -> float | None:
    """The EMA's decay per optimizer step: its half-life in tokens, whatever the batch."""
    half_life = config.ema_half_life_tokens
    return None if half_life is None else math.pow(0.5, tokens_per_step / half_life)


class WeightAverager(Component):
    def __init__(self, config: AveragingConfig, engine, tokens_per_step: int):
        self.config, self.engine, self.rank = config, engine, torch.distributed.get_rank()
        self.kinds = configured_kinds(config)
        self.names, _, self.shapes = held_parameters(engine)
        self.layout = layout_of(Topology.from_engine(engine))
        self.decay = ema_decay(config, tokens_per_step)
        self.ema: list[torch.Tensor] | None = None
        self.ema_updates = 0
        self.window: list[tuple[int, list[torch.Tensor]]] = []  # (step, fp32 state), oldest first

    @property
    def live(self) -> list[torch.Tensor]:
        """Looked up afresh each time: ZeRO-1/2 re-point ``param.data`` into their flat buffers after each step."""
        return held_parameters(self.engine)[1]

    @classmethod
    def build(cls, config: AveragingConfig, engine, tokens_per_step: int, strategy) -> WeightAverager | None:
        """``strategy``: the resolved ds_config (dstrain.strategy.resolve.Strategy), for its refusal; train.averaging
        off: None."""
        if not config.enabled:
            return None
        if strategy.offload_param == "nvme":
            raise DstrainError(
                f"{strategy.source}: zero_optimization.offload_param swaps parameter partitions out to NVMe, and "
                f"train.averaging reads them after every step; offload parameters to cpu, or turn train.averaging off"
            )
        return cls(config, engine, tokens_per_step)

    # --- as the trainer's component ---------------------------------------------------------------------------------
    def on_step_end(self, outcome: StepOutcome) -> Verdict:
        self.update(outcome.step)
        return Verdict.GO_ON

    def eval_records(self, evaluate) -> list[dict]:
        return self.evaluate(evaluate)

    def load_files(self, tag_dir: Path) -> None:
        self.load(tag_dir)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (counted from 1)."""
        if step <= self.config.start_step:
            return
        current = [t.detach().float() for t in self.live]  # no copy where the weights are fp32 already
        if self.decay is not None:
            if self.ema is None:
                self.ema = [c.clone() for c in current]
            else:
                get_ema_multi_avg_fn(self.decay)(self.ema, current, None)
            self.ema_updates += 1
        n = self.config.last_n
        if n is not None and step % self.config.last_n_every == 0:
            reused = self.window.pop(0)[1] if len(self.window) >= n else [torch.empty_like(c) for c in current]
            torch._foreach_copy_(reused, current)
            self.window.append((step, reused))

    def ready(self) -> list[str]:
        """The averages that exist yet (an EMA after its first update, a window after its first sample)."""
        return [k for k in self.kinds if (self.ema is not None if k == "ema" else bool(self.window))]

    @torch.no_grad()
    def averaged(self, kind: str) -> list[torch.Tensor]:
        if kind == "ema":
            assert self.ema is not None
            return self.ema
        return window_mean([state for _, state in self.window])

    # --- evaluation -------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self, kind: str):
        """Inside, the module computes with the average (rounded to the weights' dtype); after, with the live
        weights again, bit for bit."""
        with torch.no_grad():
            live = [t.clone() for t in self.live]
        self._overwrite_held(self.averaged(kind))
        try:
            yield
        finally:
            self._overwrite_held(live)

    @torch.no_grad()
    def _overwrite_held(self, values: list[torch.Tensor]) -> None:
        """Under ZeRO-3 inside DeepSpeed's own hooks around a change of the partitions (those its checkpoint load
        uses): every gathered parameter released first, the persistent ones (kept whole on every rank) gathered
        again from the new partitions after."""
        optimizer = self.engine.optimizer
        partitioned = hasattr(optimizer, "checkpoint_event_prologue")
        if partitioned:
            optimizer.checkpoint_event_prologue()
        torch._foreach_copy_(self.live, values)
        if partitioned:
            optimizer.checkpoint_event_epilogue()

    def evaluate(self, evaluate) -> list[dict]:
        """The total valid record of each average, ``evaluate`` (Trainer.evaluate) run with it swapped in."""
        records = []
        for kind in self.ready():
            with self.swapped_in(kind):
                record = evaluate()[-1]
            records.append({**record, "split": split_name(kind, self.kinds)})
        return records

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "layout": self.layout,
            "names": self.names,
            "layer_keys": layer_keys(self.engine),
            "shapes": [list(s) for s in self.shapes],
            "ema": self.ema,
            "ema_updates": self.ema_updates,
            "window_steps": [step for step, _ in self.window],
            "window": [state for _, state in self.window],
        }

    def rank_files(self) -> dict:
        """{file name: state} that this rank adds to a checkpoint (dstrain.checkpoint.store.save's rank_files)."""
        return {FILE.format(self.rank): self.state_dict()}

    def load(self, tag_dir: Path) -> None:
        """Continue the average saved in ``tag_dir`` (one line if it cannot be read onto this layout); a checkpoint
        saved with averaging off starts it afresh."""
        files = sorted(tag_dir.glob(FILE.format("*")))
        self.ema, self.ema_updates, self.window = None, 0, []
        if not files:
            if self.rank == 0:
                print(f"{tag_dir} holds no weight average (train.averaging was off): it starts at this step")
            return
        state = read_state(tag_dir, 0)  # every layout has a rank 0, and every rank file records the layout
        if state["layout"] == self.layout:
            state = state if self.rank == 0 else read_state(tag_dir, self.rank)
        elif not readable(state["layout"], self.layout):
            raise DstrainError(refusal(tag_dir, state["layout"], self.layout))
        # else every rank held the whole model, before and now: rank 0's average is everyone's
        if state["names"] != self.names or [tuple(s) for s in state["shapes"]] != self.shapes:
            raise DstrainError(
                f"{tag_dir / FILE.format(self.rank)}: its weight average is of other parameters than this model's; "
                f"resume with the recipe's model as it was saved"
            )
        device = self.live[0].device
        if state["ema"] is not None and self.decay is not None:
            self.ema, self.ema_updates = [t.to(device) for t in state["ema"]], state["ema_updates"]
        if self.config.last_n is not None:
            kept = list(zip(state["window_steps"], state["window"]))[-self.config.last_n :]
            self.window = [(step, [t.to(device) for t in tensors]) for step, tensors in kept]


def read_state(tag_dir: Path, rank: int) -> dict:
    path = tag_dir / FILE.format(rank)
    if not path.is_file():
        raise DstrainError(f"{path} is missing; resume from a checkpoint saved on this many ranks")
    return safe_load.load(path)


def refusal(tag_dir: Path, saved: dict, now: dict) -> str:
    def describe(layout: dict) -> str:
        return (
            f"{layout['world_size']} ranks, {'ZeRO-3 partitions' if layout['partitioned'] else 'whole parameters'}, "
            f"pp {layout['pp_stages']}, tp {layout['tp_size']}, ep {layout['ep_size']}"
        )

    return (
        f"{tag_dir}: its weight average (train.averaging) is held per rank as {describe(saved)}, and dstrain does not "
        f"reshard it onto {describe(now)}; resume on the saved layout, or in a new run_dir with init_from"
    )


def build(run: RunHandle) -> WeightAverager | None:
    return WeightAverager.build(run.recipe.train.averaging, run.engine, run.tokens_per_step, run.strategy)

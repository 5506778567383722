"""dstrain's own ds_config section ``"tiling": {"loss": n | "auto", "mlp": m}`` (applied by
dstrain.train.engine.tiling):
how many sequence tiles the loss and each MLP run in, checked against the recipe before anything runs.

The loss is chunked by default where its logits are large ("auto", also when the key is absent): a micro-batch's
loss holds three fp32 (tokens x vocabulary) tensors at the start of its backward (the saved log-probabilities,
nll_loss's gradient and log_softmax's), 12·T·V bytes per rank. When that exceeds ``AUTO_CHUNK_ABOVE`` (8 GiB, a
tenth of an 80 GiB device), "auto" cuts each rank's slice of the sequence into the fewest equal tiles whose working
set fits ``LOSS_TILE_BYTES`` (1 GiB); below it the loss runs whole (1 tile). Bytes, not a share of the device, so
that ``dstrain estimate`` and the run resolve the same count wherever they run. Chunking costs no FLOPs (the head's
gradients are formed in the loss's forward, dstrain.model.chunked_loss), but it holds the head's gradient in fp32
from the loss's forward on ((4 + a)·V·d), which a small loss need not pay; ``dstrain plan`` weighs both, and
writes 1 or the count of chunks (chunking wherever the logits exceed one chunk) for the faster, then the smaller,
of the layouts that fit.
"""

from __future__ import annotations

import math

from dstrain.config import Recipe
from dstrain.errors import DstrainError
from dstrain.objectives.registry import objective_of

AUTO_CHUNK_ABOVE = 8 * 2**30  # "auto" chunks the loss when its whole fp32 logits working set (12·T·V) exceeds this
LOSS_TILE_BYTES = 2**30  # "auto": the most one tile's working set may then take
LOGITS_WORKING_SET = 12  # bytes per token and vocabulary entry: three fp32 T x V tensors at the backward's start


def logits_bytes(micro_batch: int, seq_per_rank: int, vocab_size: int) -> int:
    """The untiled loss's fp32 working set of one micro-batch on one rank (12·T·V)."""
    return LOGITS_WORKING_SET * micro_batch * seq_per_rank * vocab_size


def auto_loss_tiles(micro_batch: int, seq_per_rank: int, vocab_size: int, above: int = AUTO_CHUNK_ABOVE) -> int:
    """1 (whole) up to ``above`` bytes of the whole loss's working set, else the fewest tiles dividing
    ``seq_per_rank`` whose working set fits LOSS_TILE_BYTES. dstrain plan passes LOSS_TILE_BYTES (dstrain.plan.layouts:
    it chunks wherever the logits exceed one chunk and the memory model finds the peak lower)."""
    whole = logits_bytes(micro_batch, seq_per_rank, vocab_size)
    if whole <= above:
        return 1
    needed = math.ceil(whole / LOSS_TILE_BYTES)
    return next(n for n in range(max(needed, 1), seq_per_rank + 1) if seq_per_rank % n == 0)


def check_tiling(
    config: dict, recipe: Recipe, ds_file: str, micro_batch: int, sp_size: int, pp_stages: int
) -> tuple[int, int]:
    """(loss tiles, MLP tiles), 1 = off; ``config["tiling"]["loss"]`` is set to the count "auto" chose, so that the
    run's resolved ds_config records it."""
    section = config.get("tiling", {})
    unknown = sorted(set(section) - {"loss", "mlp"}) if isinstance(section, dict) else ["(not an object)"]
    if unknown:
        raise DstrainError(f'{ds_file}: unknown key "tiling.{unknown[0]}"; the tiling section takes "loss" and "mlp"')
    seq = recipe.data.seq_len // sp_size  # each sequence-parallel rank tiles its own slice
    loss = section.get("loss", "auto")
    whole_logits = objective_of(recipe).refuses.get("loss_tiling")  # why the objective takes whole logits
    if whole_logits and loss not in ("auto", 1):
        raise DstrainError(f"{ds_file}: tiling.loss={loss!r} {whole_logits}")
    if loss == "auto":
        loss = 1 if whole_logits else auto_loss_tiles(micro_batch, seq, recipe.model.vocab_size)
        if "tiling" in config:
            config["tiling"]["loss"] = loss
    tiles = [loss, section.get("mlp", 1)]
    for key, value in zip(("loss", "mlp"), tiles):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= seq:
            choice = ' or "auto"' if key == "loss" else ""
            raise DstrainError(
                f"{ds_file}: tiling.{key}={value!r}; use a number of sequence tiles from 1 (off) to the {seq} tokens "
                f"of a rank's sequence{choice}"
            )
        if seq % value:
            near = [n for n in range(1, seq + 1) if seq % n == 0]
            below, above = max(n for n in near if n < value), min(n for n in near if n > value)
            raise DstrainError(
                f"{ds_file}: tiling.{key}={value} does not divide the {seq} tokens of a rank's sequence "
                f"(data.seq_len / sequence_parallel_size); use {below} or {above}"
            )
    if recipe.model.moe is not None and tiles[1] > 1:  # DeepSpeed's TiledMLP reruns the MoE layer without its router
        raise DstrainError(  # losses' graph (their gradient would be lost, as under a plain recompute: model/moe.py)
            f"{ds_file}: tiling.mlp with model.moe is not supported (the router's losses would lose their gradient); "
            f"remove tiling.mlp, or use activation_checkpointing"
        )
    if pp_stages > 1 and tiles[1] > 1:  # the pipeline's last stage chunks the loss (model/pipe.py), not the MLPs
        raise DstrainError(
            f"{ds_file}: tiling.mlp with pipeline.stages > 1 is not supported (the stages' blocks are not tiled); "
            f"remove tiling.mlp"
        )
    return tiles[0], tiles[1]

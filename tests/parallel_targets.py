"""The rank targets of tests/test_parallel.py: what its ranks run beside training (logits of checkpoints under each
layout, what DeepSpeed leaves behind)."""

import torch

import train_helpers

POSITIONS = [*range(12), *range(20)]  # two documents in one sample: doc masking passes (hidden, position_ids)


def run_all(calls: list) -> list:
    """Rank target: call each (function name, args) of this module or train_helpers in turn, in one process group."""
    return [(globals().get(name) or getattr(train_helpers, name))(*args) for name, args in calls]


def pipeline_grid_left_behind() -> str:
    """Just after a pipeline run: what DeepSpeed left in its module-global groups.mpu."""
    from deepspeed.utils import groups

    return type(groups.mpu).__name__


def engine_for(run_dir, config_file):
    """A fresh engine for a finished run's recipe under ``config_file``, its newest checkpoint's weights loaded."""
    from dstrain.recipe_file import load_recipe
    from dstrain.strategy.resolve import load_ds_config, resolve
    from dstrain.train.engine.build import build_engine, build_model

    recipe = load_recipe(f"{run_dir}/recipe.yaml")
    strategy = resolve(
        recipe, "recipe.yaml", load_ds_config(config_file), config_file, torch.distributed.get_world_size()
    )
    engine = build_engine(recipe, strategy, build_model(recipe, strategy))
    engine.load_checkpoint(f"{run_dir}/checkpoints", load_module_only=True)
    return engine


def sample_inputs(vocab_size: int):
    tokens = torch.randint(0, vocab_size, (4, len(POSITIONS) + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], torch.tensor([POSITIONS] * 4), tokens[:, 1:]


def pipeline_round_trip_logits(run_dir, config_file):
    """Logits of the pipeline run's checkpoint loaded by DeepSpeed, then of the same checkpoint converted to a
    plain state dict and loaded back into the stages (last stage; None elsewhere)."""
    from dstrain.checkpoint.consolidate import load_into_pipeline, read_checkpoint

    engine = engine_for(run_dir, config_file)
    config, state = read_checkpoint(run_dir)
    input_ids, position_ids, labels = sample_inputs(config.vocab_size)

    def logits():
        _, out = engine.eval_batch(
            iter([((input_ids, position_ids), labels)]),
            num_micro_batches=1,
            return_logits=True,
            reduce_output=None,
            bcast_loss=False,
        )
        return out

    native = logits()
    load_into_pipeline(engine.module, state, config)
    return tuple(None if out is None else out.numpy() for out in (native, logits()))


def tensor_parallel_logits(run_dir, config_file):
    """Logits of the TP run's checkpoint, loaded into a TP engine."""
    engine = engine_for(run_dir, config_file)
    input_ids, position_ids, _ = sample_inputs(engine.module.config.vocab_size)
    engine.eval()
    with torch.no_grad():
        return engine(input_ids, position_ids).numpy()


def pipeline_eval_with_monitor(folder) -> str:
    """What PipelineEngine.eval_batch(reduce_output=None) does when the ds_config enables a monitor."""
    import deepspeed

    from dstrain.model.config import GPTConfig
    from dstrain.model.pipe import build_pipeline

    config = GPTConfig(flavour="llama", vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    ds = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "csv_monitor": {"enabled": True, "output_path": str(folder), "job_name": "monitor"},
    }
    model = build_pipeline(config, seed=0, stages=1)  # two one-stage pipelines: no collective to hang on
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    tokens = torch.randint(0, 64, (1, 9))
    try:
        engine.eval_batch(
            iter([(tokens[:, :-1], tokens[:, 1:])]), num_micro_batches=1, reduce_output=None, bcast_loss=False
        )
    except Exception as e:  # noqa: BLE001  (the defect's type is what we report)
        return type(e).__name__
    return "ok"

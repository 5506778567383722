"""Each published checkpoint of every ``train.export_every`` steps as a Hugging Face folder, run_dir/hf/<tag>/
(what ``dstrain export RUN --tag <tag>`` writes: config.json, fp32 model.safetensors, the run's tokenizer). Rank 0
writes it from the published tag's files, while the other ranks wait at the next step's all-reduce."""

from __future__ import annotations

from dstrain.run_dir import step_of
from dstrain.train.step.components import Component
from dstrain.train.step.handle import RunHandle


class HFExport(Component):
    def __init__(self, every: int, run: RunHandle) -> None:
        self.every, self.run = every, run

    def on_checkpoint_published(self, tag: str) -> None:
        if not self.run.is_rank0 or step_of(tag) % self.every:
            return
        from dstrain.checkpoint.hf_folder import write_hf_folder
        from dstrain.data.tokenizer import load_run_tokenizer

        files = self.run.files
        out = files.hf_export(tag)
        if out.exists():  # a resumed run publishing the same step again (a spike rollback's re-save)
            return
        tokenizer = load_run_tokenizer(files.root)
        model, _, _ = write_hf_folder(self.run.recipe, files.checkpoints / tag, tokenizer, out, "fp32")
        self.run.log.write({"step": step_of(tag), "event": "hf_export", "tag": tag, "folder": str(out)})
        self.run.log.note(f"{out}: {type(model).__name__} of {tag}")


def build(run: RunHandle) -> HFExport | None:
    every = run.recipe.train.export_every
    return HFExport(every, run) if every else None

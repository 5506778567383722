"""The training loop: step, eval, log, checkpoint, and stop cleanly on a signal.

Everything a step consumes is a function of ``consumed_samples``: the k-th optimizer
step reads global batch k whatever the world size, micro-batch or accumulation, so a
resumed run and a run under another strategy see exactly the same samples.

Pipeline engines run a whole optimizer step in `engine.train_batch(micro_batches)` and
evaluate through `engine.eval_batch`; every other engine (ZeRO, AutoTP) is driven micro-batch
by micro-batch. The data-parallel rank comes from DeepSpeed's own groups
(`dstrain.train.engine.build.data_parallel_rank`): the ranks of one tensor-parallel group or of one
pipeline read the same samples.

The loop names no optional feature: it calls its components (dstrain.train.step.components) at fixed points, and
dstrain.train.features.builders assembles them.
"""

from __future__ import annotations

import time

import torch

from dstrain.checkpoint import store
from dstrain.checkpoint.background import BackgroundSaves
from dstrain.checkpoint.record import ClientState, Identity
from dstrain.config import Recipe, recipe_changes, to_dict
from dstrain.data.sampler import micro_batches
from dstrain.devices import device_peak
from dstrain.errors import DstrainError
from dstrain.metrics import IntervalClock, MetricsLog, largest_peak_memory_of_all_ranks
from dstrain.metrics_records import evaluation_summary, perplexity
from dstrain.model.counts import describe_params, flops_per_token
from dstrain.run_dir import RunDir
from dstrain.train.engine.build import apply_recipe_to_optimizer, data_parallel_rank
from dstrain.train.features import builders as features
from dstrain.train.objectives.select import forward_and_step
from dstrain.train.process.stop import StopSignal
from dstrain.train.step.components import Components, Progress, StepOutcome, StepSums, Verdict
from dstrain.train.step.evaluator import Evaluator
from dstrain.train.step.step_hooks import StepHooks


class Trainer:
    def __init__(
        self,
        recipe,
        strategy,
        engine,
        train_data,
        valid_sets,
        files: RunDir,
        data_fingerprint,
        identity: Identity | None = None,
        hooks: StepHooks | None = None,
    ):
        """``valid_sets``: (name, weight, dataset) per data source (``dstrain.data.dataset.build_valid_sets``);
        ``hooks``: a test's faults (dstrain.train.step.step_hooks.StepHooks)."""
        self.recipe, self.strategy, self.engine = recipe, strategy, engine
        self.train_data, self.valid_sets = train_data, valid_sets
        # Only DeepSpeed's groups know the pipeline/TP layout, so the data-parallel rank comes from them.
        self.files, self.dp_rank = files, data_parallel_rank(engine, strategy)
        self.data_fingerprint, self.identity = data_fingerprint, identity
        self.device = engine.device
        self.rank = torch.distributed.get_rank()
        self.is_rank0 = self.rank == 0
        self.world = torch.distributed.get_world_size()
        self.progress = Progress()
        self.tokens_per_step = recipe.train.global_batch * recipe.data.seq_len
        self.flops_per_token = flops_per_token(recipe.model, recipe.data.seq_len)
        self.peak_tflops, self.peak_line = device_peak(strategy.precision)
        self.clock = IntervalClock()
        self.log = MetricsLog(files, self.is_rank0, recipe.total_steps, getattr(engine, "monitor", None))
        self.saves = BackgroundSaves(engine, self.files.checkpoints, recipe.train.keep_last, self.identity)
        self.hooks = hooks or StepHooks()
        self.components = Components([])  # the steps' view of them, filled below
        forward, step = forward_and_step(recipe)
        self.forward = forward.of_engine(recipe, strategy, engine, self.progress, self.hooks)
        self.steps = step(recipe, strategy, engine, self.forward, self.components)
        self.evaluator = Evaluator(
            self.forward, self.dp_rank, strategy.dp_size, strategy.micro_batch, recipe.model.max_seq_len
        )
        self.components.members = features.assemble(self)

    # --- data -------------------------------------------------------------------------
    def _batches(self):
        indices = micro_batches(
            self.progress.consumed_samples,
            self.recipe.train.global_batch,
            self.strategy.micro_batch,
            self.dp_rank,
            self.strategy.dp_size,
        )
        n = len(self.train_data)  # a skipped window moves the stream on: past its planned end, it wraps
        for samples in indices:
            samples = [i % n for i in samples]
            yield self.hooks.train_batch(samples, self.forward.to_device(samples, self.train_data))

    # --- one optimizer step ------------------------------------------------------------
    def train_step(self, batches) -> torch.Tensor:
        """Forward/backward over this rank's micro-batches of one global batch; returns the mean loss."""
        loss = self.steps.train_step(batches)
        self.hooks.stepped(self.progress.step + 1)
        return loss

    @torch.no_grad()
    def evaluate(self) -> list[dict]:
        """One record per source when there are several (split ``valid/<source>``), then the ``valid`` record:
        the sources' losses averaged by their data.sources weights. ``train.eval_samples`` applies per source."""
        self.engine.eval()
        sources = [e.loss for e in self.evaluator.sources(self.valid_sets, self.recipe.train.eval_samples)]
        self.evaluator.end()
        self.engine.train()
        step = self.progress.step
        records = [
            {"step": step, "split": f"valid/{s.name}", "loss": s.loss, "ppl": perplexity(s.loss), "samples": s.samples}
            for s in sources
            if len(sources) > 1
        ]
        return [*records, {"step": step, "split": "valid", **evaluation_summary(sources)}]

    # --- checkpoints ------------------------------------------------------------------
    def save(self, background: bool = False) -> str | None:
        """A checkpoint of this step, its tag once published; ``background``: snapshot now, write while training goes
        on (None: published at a later step's all-reduce, or by finish_pending_save)."""
        client_state = ClientState(
            consumed_samples=self.progress.consumed_samples,
            rng=store.rng_state(),
            recipe=to_dict(self.recipe),
            data_fingerprint=self.data_fingerprint,
            world_size=self.world,
            strategy=self.strategy.name,
            components=self.components.state_dict(),
        )
        if background:
            self.saves.start(self.progress.step, client_state, self.components.rank_files())
            return None
        where, keep = self.files.checkpoints, self.recipe.train.keep_last
        tag = store.save(
            self.engine, where, self.progress.step, client_state, keep, self.identity, self.components.rank_files()
        )
        self.components.on_checkpoint_published(tag)
        return tag

    def finish_pending_save(self) -> None:
        """Wait for the background write in flight, if any, and publish it."""
        if (tag := self.saves.wait()) is not None:
            self.components.on_checkpoint_published(tag)

    def restore(self, tag: str) -> ClientState:
        """Model, optimizer, schedule, RNG, data position and the components' state of checkpoint ``tag``; its client
        state."""
        state = store.load(self.engine, self.files.checkpoints, tag)
        if state.data_fingerprint != self.data_fingerprint:
            raise DstrainError(
                f"{self.files.checkpoints / tag} was trained on other data; use a new run_dir or restore data.sources"
            )
        self.progress.step = self.engine.global_steps
        self.progress.consumed_samples = state.consumed_samples
        store.set_rng_state(state.rng)
        self.components.load_files(self.files.checkpoints / tag)
        apply_recipe_to_optimizer(self.engine, self.recipe)
        self.components.load_state_dict(state.components)
        return state

    def resume(self, tag: str) -> None:
        state = self.restore(tag)
        changed = recipe_changes(state.recipe, to_dict(self.recipe))
        if self.is_rank0:
            print(
                f"resumed from {tag}: step {self.progress.step}, {self.progress.consumed_samples} samples consumed",
                flush=True,
            )
            if changed:
                print(
                    "the recipe changed since the checkpoint, the current one applies: "
                    + ", ".join(f"{k} {old} → {new}" for k, (old, new) in changed.items()),
                    flush=True,
                )
        self.log.write({"step": self.progress.step, "event": "resume", "tag": tag, "changed": changed})

    # --- the loop ---------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.recipe.train
        total = self.recipe.total_steps
        stop = StopSignal()
        batches = self._batches()
        start_step = self.progress.step
        interval_loss, interval_steps, interval_learned = 0.0, 0, 0
        if self.is_rank0:
            print(describe_params(self.recipe.model) + trained_line(self.recipe), self.peak_line, sep="\n", flush=True)
        self.components.on_train_start()
        self.clock = IntervalClock()
        status = "completed"
        while self.progress.step < total:
            self.components.on_phase("step", self.progress.step + 1)
            lr = self._lr_of_next_step()
            outcome = self._step_of_all_ranks(batches, stop)
            verdict = self.components.on_step_end(outcome)
            if verdict is Verdict.UNDONE:  # a rollback: the stream goes on from elsewhere
                batches, interval_loss, interval_steps, interval_learned = self._batches(), 0.0, 0, 0
                if outcome.stop_requested:
                    status = "interrupted"
                    break
                continue
            interval_loss += outcome.loss
            interval_steps += 1
            interval_learned += self.steps.learned_tokens
            if self.progress.step % t.log_interval == 0 or self.progress.step == total:
                record = self._train_record_of_all_ranks(
                    interval_loss / interval_steps, lr, interval_steps, self.clock.lap()
                )
                record["learned_tokens"] = interval_learned / interval_steps
                self.log.write(record)
                self.log.print_step(record, start_step)
                interval_loss, interval_steps, interval_learned = 0.0, 0, 0
            if t.eval_interval and self.progress.step % t.eval_interval == 0 and self.progress.step < total:
                if self._eval_and_log() is Verdict.STOP:
                    verdict = Verdict.STOP
            if outcome.stop_requested:
                status = "interrupted"
                break
            if verdict is Verdict.STOP:  # a component ended the run (early stopping): as a finished one, evaluated
                status = "stopped"
                break
            if t.checkpoint_interval and self.progress.step % t.checkpoint_interval == 0 and self.progress.step < total:
                with self.clock.paused("checkpoint"):
                    self.components.on_phase("checkpoint", self.progress.step)
                    self.save(background=t.async_checkpoint)
        self.components.on_phase("end", self.progress.step)
        if status == "completed" or (status == "stopped" and self.progress.last_eval.get("step") != self.progress.step):
            self._eval_and_log()
        self.finish_pending_save()
        self.save()
        self.log.close()
        self.components.close()
        stop.release()
        return {"status": status, "step": self.progress.step, "final_eval": self.progress.last_eval}

    def _lr_of_next_step(self) -> float:
        """The schedule's lr, times the components' factor (the spike guard's during a lowered stretch). The scheduler
        sets each group's lr afresh from its base after every step, so the factor applies to this step alone."""
        scale = self.components.lr_scale(self.progress.step + 1)
        if scale != 1.0:
            for group in self.engine.optimizer.param_groups:
                group["lr"] *= scale
        return self.engine.get_lr()[0]

    def _step_of_all_ranks(self, batches, stop: StopSignal) -> StepOutcome:
        """One optimizer step, then its one all-reduce (StepSums): the mean loss, the gradient norm, any rank's stop,
        and whether each rank's background checkpoint write is done (published when all are)."""
        loss = self.train_step(batches)
        self.progress.step += 1
        self.progress.consumed_samples += self.recipe.train.global_batch
        grad_norm = self.engine.get_global_grad_norm()
        mine = StepSums(
            loss=loss,
            grad_norm=0.0 if grad_norm is None else float(grad_norm),
            stop_requested=float(stop.received is not None),
            save_done=float(self.saves.done()),
        )
        self.components.on_mark("the step's all-reduce")
        sums = mine.all_reduce(self.device)
        if self.saves.in_flight and sums.save_done == self.world:
            self.components.on_checkpoint_published(self.saves.publish())
        return StepOutcome(
            step=self.progress.step,
            loss=self.steps.step_loss(float(sums.loss), self.world),
            grad_norm=sums.grad_norm / self.world,
            stop_requested=sums.stop_requested > 0,
        )

    def _eval_and_log(self) -> Verdict:
        self.components.on_phase("eval", self.progress.step)
        start = time.perf_counter()
        with self.clock.paused("eval"):
            records = self.evaluate()
            records[-1].update(self.components.valid_record_fields())  # e.g. downstream tasks' accuracies
        records[-1]["duration_s"] = time.perf_counter() - start
        self.progress.last_eval = records[-1]
        with self.clock.paused("eval"):  # records of their own, e.g. the average's valid loss (split valid/averaged)
            records += self.components.eval_records(self.evaluate)
        for record in records:
            self.log.write(record)
            self.log.print_eval(record)
        return self.components.on_eval_end(records)

    def _train_record_of_all_ranks(self, loss: float, lr: float, steps: int, seconds: dict) -> dict:
        """A collective (every rank calls it: the memory peak is the largest of all ranks). ``seconds``: the
        interval's ``IntervalClock.lap()``; throughput counts its training time only."""
        tokens_per_s = steps * self.tokens_per_step / max(seconds["train_s"], 1e-9)
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        grad_norm = self.engine.get_global_grad_norm()
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.strategy.precision == "fp16" else None
        return {
            "step": self.progress.step,
            "consumed_samples": self.progress.consumed_samples,
            "consumed_tokens": self.progress.consumed_samples * self.recipe.data.seq_len,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "loss_scale": None if scale is None else float(scale),
            "skipped_steps": int(self.engine.skipped_steps),
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": None if self.peak_tflops is None else tflops / self.peak_tflops,
            "mem_peak_bytes": largest_peak_memory_of_all_ranks(self.device),
            "elapsed_s": time.time() - self.log.start,
            **seconds,
            **self.components.train_record_fields(self.progress, steps),
        }


def trained_line(recipe: Recipe) -> str:
    """With a lora: section, how many of the parameters train (the adapters and modules_to_save)."""
    if recipe.lora is None:
        return ""
    from dstrain.adapters.config import adapter_params

    trained = adapter_params(recipe.lora, recipe.model)
    return f"; training {trained / 1e6:,.3f}M of them (LoRA rank {recipe.lora.rank}, the rest frozen)"

"""The training loop: step, eval, log, checkpoint, and stop cleanly on a signal.

Everything a step consumes is a function of ``consumed_samples``: the k-th optimizer
step reads global batch k whatever the world size, micro-batch or accumulation, so a
resumed run and a run under another strategy see exactly the same samples.

Pipeline engines run a whole optimizer step in `engine.train_batch(micro_batches)` and
evaluate through `engine.eval_batch`; every other engine (ZeRO, AutoTP) is driven micro-batch
by micro-batch. The data-parallel rank comes from DeepSpeed's own groups
(`dstrain.train.engine.data_parallel_rank`): the ranks of one tensor-parallel group or of one
pipeline read the same samples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from deepspeed.accelerator import get_accelerator

from dstrain.checkpoint import store
from dstrain.checkpoint.background import BackgroundSaves
from dstrain.checkpoint.record import ClientState
from dstrain.config import recipe_changes, to_dict
from dstrain.data.sampler import micro_batches
from dstrain.errors import DstrainError
from dstrain.metrics import (
    IntervalClock,
    MetricsLog,
    SourceLoss,
    device_peak,
    evaluation_summary,
    largest_peak_memory_of_all_ranks,
    perplexity,
)
from dstrain.model.config import describe_params, flops_per_token
from dstrain.run_dir import RunDir, step_of
from dstrain.train import mixture
from dstrain.train.averaging import WeightAverager
from dstrain.train.engine import apply_recipe_to_optimizer, data_parallel_rank
from dstrain.train.fatal_steps import FatalStepCheck
from dstrain.train.moe_metrics import MoEMeter
from dstrain.train.spike_guard import SpikeGuard
from dstrain.train.steps import StepHooks, StepRunner
from dstrain.train.stop import StopSignal
from dstrain.train.task_eval import TaskEvaluator
from dstrain.train.watchdog import NoWatchdog, Watchdog


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    consumed_samples: int = 0  # samples of the train stream consumed, = step x global batch
    last_eval: dict = field(default_factory=dict)


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
        identity=None,
        tasks=(),
        hooks: StepHooks | None = None,
    ):
        """``valid_sets``: (name, weight, dataset) per data source (``dstrain.data.dataset.build_valid_sets``);
        ``tasks``: the recipe's train.tasks, prepared (``dstrain.tasks.scoring.prepare``); ``hooks``: a test's
        faults (dstrain.train.steps.StepHooks)."""
        self.recipe, self.strategy, self.engine = recipe, strategy, engine
        self.train_data, self.valid_sets = train_data, valid_sets
        # Only DeepSpeed's groups know the pipeline/TP layout, so the data-parallel rank comes from them.
        self.files, self.dp_rank = files, data_parallel_rank(engine, strategy)
        self.data_fingerprint, self.identity = data_fingerprint, identity or {}
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
        self.moe = MoEMeter(engine.module, recipe.model, self.device)
        self.saves = BackgroundSaves(engine, self.files.checkpoints, recipe.train.keep_last, self.identity)
        self.guard = SpikeGuard(recipe.train.spike_guard) if recipe.train.spike_guard.enabled else None
        backend = get_accelerator().communication_backend_name()
        watch = recipe.train.watchdog
        self.watch = Watchdog(watch, files, self.rank, self.world, backend) if watch.enabled else NoWatchdog()
        self.hooks = hooks or StepHooks()
        self.steps = StepRunner(recipe, strategy, engine, self.progress, self.hooks, self.moe, self.watch)
        self.tasks = TaskEvaluator(self, list(tasks)) if tasks else None
        self.averager = WeightAverager.build(recipe.train.averaging, engine, self.tokens_per_step, strategy)

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
            yield self.hooks.train_batch(samples, self.steps.to_device(samples, self.train_data))

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
        sources = [SourceLoss(name, weight, *self._mean_loss(data)) for name, weight, data in self.valid_sets]
        self.steps.end_eval()
        self.engine.train()
        step = self.progress.step
        records = [
            {"step": step, "split": f"valid/{s.name}", "loss": s.loss, "ppl": perplexity(s.loss), "samples": s.samples}
            for s in sources
            if len(sources) > 1
        ]
        return [*records, {"step": step, "split": "valid", **evaluation_summary(sources)}]

    def _mean_loss(self, data) -> tuple[float, int]:
        """Token-weighted mean loss over the first ``train.eval_samples`` samples of ``data``, and their count."""
        n = len(data)
        if self.recipe.train.eval_samples is not None:
            n = min(n, self.recipe.train.eval_samples)
        mine = list(range(self.dp_rank, n, self.strategy.dp_size))
        sums = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss x tokens, tokens
        micro = self.strategy.micro_batch
        chunks = [mine[start : start + micro] for start in range(0, len(mine), micro)]
        # Every rank makes the same number of forward calls (ZeRO-3 gathers and the pipeline's eval_batch barrier
        # are collectives); a replica with fewer samples repeats its last chunk and ignores the result.
        calls = math.ceil(math.ceil(n / self.strategy.dp_size) / micro)
        for i in range(calls):
            batch = self.steps.to_device(chunks[min(i, len(chunks) - 1)] if chunks else [0], data)
            loss = self.steps.eval_loss(batch)
            if loss is not None and i < len(chunks):
                sums += self.steps.eval_sums(loss, int((batch["labels"] != -100).sum()))
        # Model-parallel replicas add equal shares to both sums (TP), or only the last stage adds (pipeline).
        torch.distributed.all_reduce(sums)
        return (sums[0] / sums[1]).item(), n

    # --- checkpoints ------------------------------------------------------------------
    def save(self, background: bool = False) -> None:
        """A checkpoint of this step; ``background``: snapshot now, write while training goes on."""
        client_state = ClientState(
            consumed_samples=self.progress.consumed_samples,
            rng=store.rng_state(),
            recipe=to_dict(self.recipe),
            data_fingerprint=self.data_fingerprint,
            world_size=self.world,
            strategy=self.strategy.name,
            spike_guard=None if self.guard is None else self.guard.state_dict(),
        ).to_saved()
        if background:
            self.saves.start(self.progress.step, client_state, self.averager.rank_files())
            return
        where, keep = self.files.checkpoints, self.recipe.train.keep_last
        store.save(
            self.engine, where, self.progress.step, client_state, keep, self.identity, self.averager.rank_files()
        )

    def finish_pending_save(self) -> None:
        """Wait for the background write in flight, if any, and publish it."""
        self.saves.wait()

    def restore(self, tag: str) -> ClientState:
        """Model, optimizer, schedule, RNG, data position and spike guard of checkpoint ``tag``; its client state."""
        state = ClientState.from_saved(store.load(self.engine, self.files.checkpoints, tag))
        if state.data_fingerprint != self.data_fingerprint:
            raise DstrainError(
                f"{self.files.checkpoints / tag} was trained on other data; use a new run_dir or restore data.sources"
            )
        self.progress.step = self.engine.global_steps
        self.progress.consumed_samples = state.consumed_samples
        store.set_rng_state(state.rng)
        self.averager.load(self.files.checkpoints / tag)
        apply_recipe_to_optimizer(self.engine, self.recipe)
        if self.guard is not None:
            self.guard.load_state_dict(state.spike_guard)
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

    def roll_back(self, value: float, limit: float) -> bool:
        """Every rank: reload the newest complete checkpoint, skip the data since it, log the event (True); with no
        checkpoint yet, log the event and go on (False); after too many spikes, stop with one line.
        The trainer has just taken the spiking step (dstrain.train.spike_guard describes the rollback)."""
        assert self.guard is not None
        guard = self.guard
        config = guard.config
        spike_step, spike_samples = self.progress.step, self.progress.consumed_samples
        median = limit / config.factor
        checkpoints = self.files.checkpoints
        self.watch.begin("rollback", spike_step)
        self.finish_pending_save()  # a background write of an earlier step publishes first
        if guard.too_many(spike_step):
            raise DstrainError(
                f"{config.metric} spike at step {spike_step} ({value:.4g} > {config.factor:g} x median {median:.4g}): "
                f"more than train.spike_guard.max_rollbacks={config.max_rollbacks} within {config.rollback_window} "
                f"steps; stopping, the checkpoints in {checkpoints} are kept; lower optim.lr or inspect the data"
            )
        # One decision for all ranks: rank 0's reading of the checkpoint folder.
        found = [store.newest_complete(checkpoints) if self.is_rank0 else None]
        torch.distributed.broadcast_object_list(found, src=0)
        tag = found[0]
        event = {"event": "spike", "spike_step": spike_step, "metric": config.metric, "value": value}
        event.update(median=median, threshold=limit, rolled_back_to=tag)
        if tag is None:
            self.log.write({"step": spike_step, **event, "skipped_samples": None})
            self.log.note(f"{config.metric} spike at step {spike_step} ({value:.4g} > {limit:.4g}); no checkpoint yet")
            return False
        spikes, skipped = guard.spikes, guard.skipped
        state = self.restore(tag)  # weights, optimizer, schedule, RNG, consumed_samples and the guard of `tag`
        first = state.consumed_samples
        guard.spikes, guard.skipped = spikes, [*skipped, [first, spike_samples]]
        guard.lr_until = self.progress.step + config.lr_steps
        self.progress.consumed_samples = spike_samples
        self.log.drop_after(self.progress.step)
        assert step_of(tag) == self.progress.step
        self.save()  # the same step again, now holding the skip: a requeued job never reads the window
        # Logged once it is durable: a job killed after this line never trains on the window again.
        self.log.write({"step": self.progress.step, **event, "skipped_samples": [first, spike_samples]})
        batches = (spike_samples - first) // self.recipe.train.global_batch
        self.log.note(
            f"{config.metric} spike at step {spike_step} ({value:.4g} > {config.factor:g} x median {median:.4g}): "
            f"rolled back to {tag}, skipping samples {first}-{spike_samples - 1} "
            f"({batches} global batch{'es' if batches > 1 else ''})"
            + (f", lr x {config.lr_factor:g} until step {guard.lr_until}" if config.lr_steps else "")
        )
        return True

    # --- the loop ---------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.recipe.train
        total = self.recipe.total_steps
        stop = StopSignal()
        batches = self._batches()
        start_step = self.progress.step
        interval_loss, interval_steps, interval_learned = 0.0, 0, 0
        if self.is_rank0:
            print(describe_params(self.recipe.model), self.peak_line, sep="\n", flush=True)
            mixture.print_stages(self.recipe, self.train_data)
        self.clock = IntervalClock()
        health = FatalStepCheck(self.engine, t, self.strategy.precision, self.files.checkpoints)
        status = "completed"
        self.watch.start()
        while self.progress.step < total:
            self.watch.begin("step", self.progress.step + 1)
            lr = self._lr_of_next_step()
            step_loss, metric, stop_requested = self._step_of_all_ranks(batches, stop)
            # fp16: an overflow's inf is the loss scaler's business, not a spike.
            watched = math.isfinite(metric) or self.strategy.precision != "fp16"
            limit = self.guard.observe(metric) if self.guard is not None and watched else None
            if limit is not None and self.roll_back(metric, limit):
                batches, interval_loss, interval_steps, interval_learned = self._batches(), 0.0, 0, 0
                if stop_requested:
                    status = "interrupted"
                    break
                continue
            health.check(self.progress.step, step_loss)
            interval_loss += step_loss
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
                self._eval_and_log()
            if stop_requested:
                status = "interrupted"
                break
            if t.checkpoint_interval and self.progress.step % t.checkpoint_interval == 0 and self.progress.step < total:
                with self.clock.paused("checkpoint"):
                    self.watch.begin("checkpoint", self.progress.step)
                    self.save(background=t.async_checkpoint)
        self.watch.begin("end", self.progress.step)
        if status == "completed":
            self._eval_and_log()
        self.finish_pending_save()
        self.save()
        self.log.close()
        self.watch.stop()
        stop.release()
        return {"status": status, "step": self.progress.step, "final_eval": self.progress.last_eval}

    def _lr_of_next_step(self) -> float:
        """The schedule's lr, times the spike guard's factor during a lowered stretch. The scheduler sets each
        group's lr afresh from its base after every step, so the factor applies to this step alone."""
        scale = 1.0 if self.guard is None else self.guard.lr_scale(self.progress.step + 1)
        if scale != 1.0:
            for group in self.engine.optimizer.param_groups:
                group["lr"] *= scale
        return self.engine.get_lr()[0]

    def _step_of_all_ranks(self, batches, stop: StopSignal) -> tuple[float, float, bool]:
        """One optimizer step, then its one all-reduce: (mean loss, the spike guard's metric, any rank's stop); it
        also carries whether each rank's background checkpoint write is done, and publishes it when all are."""
        loss = self.train_step(batches)
        self.progress.step += 1
        self.progress.consumed_samples += self.recipe.train.global_batch
        self.averager.update(self.progress.step)
        grad_norm = self.engine.get_global_grad_norm() if self.guard is not None else None
        flags = torch.tensor(
            [0.0, 0.0 if grad_norm is None else float(grad_norm), float(stop.received is not None), self.saves.done()],
            device=self.device,
        )
        flags[0] = loss
        self.watch.mark("the step's all-reduce")
        torch.distributed.all_reduce(flags)
        step_loss = self.steps.step_loss(flags[0].item(), self.world)
        if self.saves.in_flight and flags[3].item() == self.world:
            self.saves.publish()
        metric = flags[1].item() / self.world if self.recipe.train.spike_guard.metric == "grad_norm" else step_loss
        return step_loss, metric, flags[2].item() > 0

    def _eval_and_log(self) -> None:
        self.watch.begin("eval", self.progress.step)
        start = time.perf_counter()
        with self.clock.paused("eval"):
            records = self.evaluate()
            if self.tasks is not None:  # downstream accuracies join the valid record
                next(r for r in records if r["split"] == "valid").update(self.tasks.evaluate())
        records[-1]["duration_s"] = time.perf_counter() - start
        self.progress.last_eval = records[-1]
        with self.clock.paused("eval"):  # the average's valid loss: split valid/averaged (dstrain.train.averaging)
            records += self.averager.evaluate(self.evaluate)
        for record in records:
            self.log.write(record)
            self.log.print_eval(record)

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
            **(self.moe.record() if self.moe.enabled else {}),
            **mixture.realised(self.recipe, self.train_data, self.progress.consumed_samples, steps, self.is_rank0),
        }

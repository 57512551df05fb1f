"""The training loop, read top to bottom: sample -> reward -> batch -> learn -> log, evaluate, checkpoint.

`Trainer` opens its run as `gspo serve` does (gspo.run.start: the folder, the policy, the step, the logger,
checkpoints), builds what training alone needs (examples, rewards, the sampler: gspo.training.build and
gspo.training.samplers) and keeps what lives across steps; `train_step` (the sampler's rollouts) and
`train_on_groups` (the user's trajectories) both become `Sample`s and go through `_learn`:
gspo.learning.step's `learn_from_samples`, which `gspo serve` calls too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gspo.config import Config, ConfigError, load_config, validate
from gspo.core.seeds import evaluation_seed, sample_seed, step_seed
from gspo.learning.batch import Sample
from gspo.learning.policy import UpdateSpec
from gspo.learning.step import learn_from_samples
from gspo.parallel.collectives import all_gather_cat, all_reduce_sum, raise_together
from gspo.parallel.group import barrier, is_main, rank, rank_slice, shutdown, world_size
from gspo.rollout.data import Example, PromptStream, format_prompt, jsonl_lines
from gspo.rollout.openai import ServerError
from gspo.rollout.rewards import RewardError
from gspo.rollout.samplers import HFSampler, Sampler
from gspo.rollout.trajectories import TrajectoryGroup, trajectory_samples
from gspo.run import lock
from gspo.run.build import generating
from gspo.run.checkpoint import checkpoint_step, latest_checkpoint, load_trainer_state, rng_state
from gspo.run.own_runs import record
from gspo.run.resume import resume_config
from gspo.run.start import open_folder, run_attribute, start_run
from gspo.run.trust import (
    check_run_folder_config,
    continue_command,
    users_code_files,
    users_reaches,
)
from gspo.training import evaluation
from gspo.training.build import (
    RewardFunctions,
    build_examples,
    check_examples,
    check_sizes,
    check_train_arguments,
    data_task,
    resolve_rewards,
    sampler_is_current,
    write_data,
)
from gspo.training.pipeline import Drawn, Pipeline, Request, draw, sampling_side
from gspo.training.samplers import setup_sampler
from gspo.training.stalls import StallWatch


def skip_notice(config: Config, spec: UpdateSpec) -> str:
    """The terminal's first line, in words a newcomer reads: whether the completions that teach nothing
    (all of their group scored the same) are left out of the updates, and the key that says so."""
    if spec.skip_zero_advantage:
        state = "skipped in the updates, which changes no weight and saves their time"
    elif config.train.skip_zero_advantage == "auto":
        state = "trained anyway: the KL term (train.beta > 0) depends on every one"
    else:
        state = "trained anyway"
    return (
        "gspo: completions that scored the same as the rest of their group teach nothing; they are "
        f"{state} (train.skip_zero_advantage)"
    )


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says what the run kept and how to continue it."""


class Trainer:
    """A run: its config and folder, the policy, the sampler, the prompt stream, the step counter, the logger.

    ``reward_functions``: Python callables that replace config.rewards, by name or a list named by their
    own names (the first is the eval accuracy; each weighs config.rewards[name] where the config names it,
    else 1.0). ``data``: the task's rows in memory (a `datasets.Dataset` or a list of dicts, read with
    task.prompt_field and task.answer_fields) instead of task.data_path; the run keeps them in
    RUN/data.jsonl, which its config names, so that `--resume` and `gspo eval RUN` read the same rows.
    ``sampler``: a `Sampler` of your own (e.g. an OpenAIBackend with weight sync) instead of rollout.engine's.
    ``force``: resume even when ``config`` changes keys the checkpoint was trained with (gspo.run.resume).
    ``from_step``: resume the checkpoint of that step instead of the latest (one that is damaged: an
    earlier one).
    """

    def __init__(
        self,
        config: Config,
        *,
        reward_functions: RewardFunctions | None = None,
        data: Any = None,
        resume: str | Path | None = None,
        sampler: Sampler | None = None,
        force: bool = False,
        from_step: int | None = None,
    ) -> None:
        validate(config)  # a config built in Python: what relates its keys (each key is checked when set)
        # the folder locked and a resume checked before any reward file is imported
        folder = open_folder(config, resume, force=force, from_step=from_step)
        given = None
        if data is not None:  # the rows, and the config that reads them back from the run folder
            given, config = data_task(config, data, folder.path, resumed=resume is not None)
        self.rewards = resolve_rewards(config, reward_functions)
        # a stopped run's message names them again: config.yaml holds their names, no built-in's
        self._python_rewards = [name for name, _, _ in self.rewards] if reward_functions else []
        if reward_functions:  # config.yaml names the rewards this run uses (eval and resume look there)
            config = dataclasses.replace(config, rewards={name: weight for name, _, weight in self.rewards})
        self.train_examples, self.eval_examples = build_examples(config, given)
        check_examples(self.rewards, self.train_examples + self.eval_examples)
        rows = jsonl_lines(given, config.task.prompt_field) if given is not None else None
        self.home = start_run(config, folder)  # the folder claimed now that the inputs are checked
        if rows is not None and is_main():
            write_data(self.run_dir, rows)
        check_sizes(config, self.tokenizer, self.policy.model, self.train_examples, self.eval_examples)
        lag = config.rollout.lag
        # lag > 0: the sampling side draws from its own copy of the weights, in a thread of its own
        sampling = sampling_side(config, self.policy) if lag > 0 else self.policy
        tokenizer = copy.deepcopy(self.tokenizer) if lag > 0 else self.tokenizer  # one per thread
        self.sampler = sampler or setup_sampler(config, sampling, tokenizer, self.run_dir)
        probe = self.train_examples[:4]
        self.spec = self.home.spec_for(
            exact=lambda: sampler_is_current(config, self.sampler, self.policy, probe), stale=lag > 0
        )
        self._warned_mismatch = False
        if self._show_progress():  # which, once; the metrics say how many (skipped_samples_frac)
            tqdm.write(skip_notice(config, self.spec))
        self.stream = PromptStream(self.train_examples, config.rollout.prompts_per_step, seed=config.seed)
        restored = self.home.restore()  # after the sampler: what building it drew is not replayed
        if "stream" in restored:
            try:
                self.stream.load_state_dict(restored["stream"])
            except ValueError as error:
                raise ConfigError(f"{folder.checkpoint}: {error}") from None
        self.pipeline = Pipeline(
            lag,
            self.stream,
            self._request,
            functools.partial(draw, self.sampler, self.rewards, config.rollout),
            worker_model=sampling.model if lag > 0 else None,
            sync=lambda model, version: self.sampler.sync_weights(model, tokenizer, version),
            last_step=config.train.steps,
            kept=[Drawn.from_state(state) for state in restored.get("ahead", [])],
        )

    # ---- what the run holds (its home: gspo.run.start.Run) ----------------------------------------
    config = run_attribute("config", via="home")
    run_dir = run_attribute("path", via="home")
    device = run_attribute("device", via="home")
    policy = run_attribute("policy", via="home")
    tokenizer = run_attribute("tokenizer", via="home")
    logger = run_attribute("logger", via="home")  # opened by Run.restore in __init__
    resumed = run_attribute("resumed", via="home")
    step = run_attribute("step", via="home", settable=True)  # rollout batches (or trajectory steps) trained

    def prompts(self, examples: list[Example]) -> list[str]:
        return [
            format_prompt(self.tokenizer, ex.prompt, system_prompt=self.config.task.system_prompt)
            for ex in examples
        ]

    # ---- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One rollout batch from the sampling side, then its updates; the batch `rollout.lag` steps ahead is
        then drawn from the new weights."""
        samples, metrics = self.sample()
        metrics = self._learn(samples, metrics)
        self.pipeline.updated(self.policy.model, self.step)
        return metrics

    def _request(self, step: int, version: int) -> Request:
        """What drawing the batch of ``step`` from ``version`` needs: this rank's prompts (whole groups) and
        the batch's own sampling seed."""
        examples = rank_slice(self.stream.next_batch())
        seed = sample_seed(self.config.seed, step, rank())
        return Request(step, version, examples, self.prompts(examples), seed)

    def sample(self) -> tuple[list[Sample], dict[str, float]]:
        """This rank's share of the next rollout batch (G completions of each prompt, scored by the rewards,
        drawn `rollout.lag` steps ago), its metrics reduced over ranks and its samples logged."""
        t0 = time.perf_counter()
        drawn = self.pipeline.next(self.step + 1)
        failure = RewardError(drawn.failure) if drawn.failure is not None else None
        raise_together(failure)  # all ranks stop together, so they can checkpoint together
        staleness = [self.step - s.version for s in drawn.samples]
        if staleness and not 0 <= max(staleness) <= self.config.rollout.lag:  # the schedule's guarantee
            raise RuntimeError(
                f"step {self.step + 1}: a sample of version {min(s.version for s in drawn.samples)}"
            )
        metrics = {
            "time_rollout": time.perf_counter() - t0,  # what the loop waited (the drawing, with lag 0)
            "generation_tokens": all_reduce_sum(drawn.generation_tokens),  # through the model
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": float(max(staleness, default=0)),
        }
        if self.config.rollout.lag > 0:  # the sampling side's own time, overlapping the updates
            metrics["time_sampling_overlapped"] = drawn.seconds
        per_reward = {
            f"reward/{name}": float(all_gather_cat(torch.tensor(values)).mean())
            for name, values in drawn.per_function.items()
        }
        group_size = self.config.rollout.group_size
        rows = [
            {
                "step": drawn.step,
                "prompt": drawn.prompts[i // group_size],
                "completion": text,
                "reward": s.reward,
            }
            for i, (text, s) in enumerate(zip(drawn.completions, drawn.samples, strict=True))
        ]
        self.logger.log_samples(drawn.step, rows)  # the step these samples train (logged with its metrics)
        return drawn.samples, {**per_reward, **metrics}

    def train_on_groups(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One step of updates on the user's own trajectory groups (gspo.rollout.trajectories), as `run`
        does a step: the metrics logged, a checkpoint every checkpoint.every steps; `finish` ends the run.

        Their engine is not the trainer's model: with train.old_logprobs=auto the old policy's log-probs
        are recomputed (the trajectories' own sampler log-probs, if any, give the mismatch metrics)."""
        need = self.config.train.old_logprobs == "sampler"
        samples = trajectory_samples(self.tokenizer, groups, need_sampler_logprobs=need)
        metrics = self._learn(samples, {}, self.home.spec_for(exact=False))  # another engine drew them
        self.logger.log(self.step, metrics)
        every = self.config.checkpoint.every
        if every and self.step % every == 0:
            self.checkpoint()
        return metrics

    def _learn(
        self, samples: list[Sample], metrics: dict[str, float], spec: UpdateSpec | None = None
    ) -> dict[str, float]:
        """Samples -> batch -> old-policy log-probs and updates (gspo.learning.step), then the sampler
        takes the new weights."""
        spec = spec or self.spec
        self.home.wait()  # a checkpoint written in the background reads the weights this step changes
        metrics = {**metrics, "lr": self.policy.scheduler.get_last_lr()[0]}
        metrics |= learn_from_samples(self.policy, spec, samples, seed=step_seed(self.config.seed, self.step))
        if spec.old_logprobs == "sampler" and metrics["num_trained"] > 0:
            self._check_mismatch(metrics)
        self.step += 1
        if self.config.rollout.lag == 0:  # else the sampling side syncs its own copy (Pipeline.updated)
            self.sampler.sync_weights(self.policy.model, self.tokenizer, self.step)
        return metrics

    def _check_mismatch(self, metrics: dict[str, float]) -> None:
        """Warn once when the sampler's log-probs, used as the old policy's, are off by more than GSPO's
        clip band for more than 1% of the sequences (measured on the first minibatch)."""
        outside = metrics.get("sampler_seq_outside_clip_frac", 0.0)
        if outside > 0.01 and not self._warned_mismatch:
            self._warned_mismatch = True
            warnings.warn(
                f"step {self.step + 1}: the sampler's log-probs differ from the trainer's by more than GSPO's clip "
                f"band for {outside:.0%} of the sequences, and they serve as the old policy's: set "
                "train.old_logprobs=recompute (docs/sampler_mismatch.md)",
                stacklevel=2,
            )

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the held-out split, scored by the run's rewards (gspo.training.evaluation),
        drawn with a seed of their own (gspo.core.seeds.evaluation_seed): how often a run evaluates changes
        nothing it trains on."""
        sampler = HFSampler(
            self.policy.model, self.tokenizer, self.config.eval.batch_size, lambda: generating(self.policy)
        )
        return evaluation.evaluate(
            sampler,
            self.eval_examples,
            self.rewards,
            max_new_tokens=self.config.eval.max_new_tokens,
            system_prompt=self.config.task.system_prompt,
            seed=evaluation_seed(self.config.seed, self.step),
        ).metrics

    # ---- the loop -----------------------------------------------------------------------------------
    def checkpoint(self, rng: dict[str, Any] | None = None, *, background: bool = False) -> Path | None:
        """A checkpoint of this step with ``rng`` (default: now), the batches drawn ahead and the prompt
        stream's position (gspo.training.pipeline.Pipeline.state) as the state a resumed run continues from.
        ``background``: written while the next batch is drawn (gspo.run.start.Run.save); returns None."""
        state = self.pipeline.state(self.step)
        return self.home.save(rng=rng, stream=state["stream"], ahead=state["ahead"], background=background)

    def train(self) -> dict[str, Any]:
        """`run`, under the name TRL's trainers use."""
        return self.run()

    def run(self) -> dict[str, Any]:
        """Train to train.steps, evaluating and checkpointing on the way, then `finish`. A reward function's
        error, or Ctrl-C, stops the run with what it kept: the run folder and its latest checkpoint, which
        `--resume` continues."""
        try:
            return self._run_steps()
        except RewardError as error:
            # an evaluation failed after this step's update: keep it (its train metrics are logged). Not
            # under torchrun, where the other ranks may not have raised and would not join the save.
            if world_size() == 1 and self.step > 0 and self.home.saved_step != self.step:
                self.checkpoint()
            command = self._continue(name_code=True)  # the user is editing the reward code
            raise RewardError(f"{error}; {self._kept('fix the reward function, then', command)}") from error
        except ServerError as error:  # the sampling server: down, dead, or refusing the weights
            raise ServerError(f"{error}; {self._kept('continue it with', self._continue())}") from error
        except KeyboardInterrupt as error:
            raise RunInterrupted(
                f"interrupted; {self._kept('continue it with', self._continue())}"
            ) from error
        finally:
            self.pipeline.close()

    def _continue(self, *, name_code: bool = False) -> str:
        return continue_command(
            self.config, self.run_dir, python_rewards=self._python_rewards, name_code=name_code
        )

    def _kept(self, then: str, command: str) -> str:
        """What a stopped run kept, and the command that continues it."""
        with contextlib.suppress(Exception):  # a checkpoint in flight: done, or not the latest
            self.home.wait()
        latest = latest_checkpoint(self.run_dir)
        if latest is None:
            return f"{self.run_dir} holds no checkpoint yet: {then} `{command}`, which starts it again"
        return f"the run is kept up to step {checkpoint_step(latest)} ({latest}): {then} `{command}`"

    def _run_steps(self) -> dict[str, Any]:
        cfg = self.config
        if self.step == 0 and not self.resumed:
            # no checkpoint at step 0: it would be the initial model, which a run stopped before its first
            # checkpoint starts from again anyway (gspo.run.folder), to the same results
            self._log_eval()
        stalls = StallWatch(cfg.train.warn_after_flat_steps, cfg.rollout.prompts_per_step)
        show = self._show_progress()
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not show, desc="gspo", unit="step")
        while self.step < cfg.train.steps:
            start_rng, started = rng_state(), self.step
            try:
                metrics = self.train_step()
            except (RewardError, ServerError):
                self.home.wait()  # a checkpoint in flight completes first
                if self.step != started:  # the engine did not take the update (a weight sync): keep it
                    self.checkpoint()
                    raise
                # nothing was updated in this step: record its start so `--resume` redoes it exactly
                latest = latest_checkpoint(self.run_dir)
                if latest is None or load_trainer_state(latest)["step"] != self.step:
                    self.checkpoint(rng=start_rng)
                raise
            self.logger.log(self.step, metrics)
            for warning in stalls.update(self.step, metrics):
                if is_main():
                    tqdm.write(f"warning: {warning}", file=sys.stderr)
            shown = {
                "reward": f"{metrics['reward_mean']:.3f}",
                "clip": f"{metrics.get('clip_frac_token', 0.0):.3f}",
                "gen": f"{metrics['time_rollout']:.1f}s",
                "old": f"{metrics['time_old_logprobs']:.1f}s",
                "upd": f"{metrics['time_update']:.1f}s",
                **stalls.postfix(),
            }
            bar.update(1)
            bar.set_postfix(**shown)
            if self._progress_lines():  # piped, under nohup, in an IDE: a line per rollout batch
                fields = ", ".join(f"{key} {value}" for key, value in shown.items())
                print(f"step {self.step}/{cfg.train.steps}: {fields}", file=sys.stderr, flush=True)
            last = self.step == cfg.train.steps
            if last or (cfg.eval.every and self.step % cfg.eval.every == 0):
                self._log_eval()
            if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                self.checkpoint(background=True)  # written as the next batch is drawn
        bar.close()
        return self.finish()

    def _show_progress(self) -> bool:
        """The progress bar: interactive runs only (a terminal)."""
        return self.config.progress and is_main() and sys.stderr.isatty()

    def _progress_lines(self) -> bool:
        """Progress as plain lines, one per rollout batch and evaluation: runs without a terminal (piped,
        under nohup, in an IDE), unless progress=false."""
        return self.config.progress and is_main() and not sys.stderr.isatty()

    def _log_eval(self) -> None:
        if not self.eval_examples:  # task.num_eval=0: nothing held out, nothing to measure
            return
        result = self.evaluate()
        self.logger.log(self.step, result, kind="eval")
        line = (
            f"step {self.step}: eval accuracy {result['accuracy']:.3f} (reward {result['reward_mean']:.3f})"
        )
        if self._show_progress():
            tqdm.write(line)
        elif self._progress_lines():
            print(line, file=sys.stderr, flush=True)

    def finish(self) -> dict[str, Any]:
        """End the run as `gspo train` does: a checkpoint of the last step (unless it has one), the metrics
        closed, plots/*.png and summary.md written, the run folder's lock released. Returns the run folder, the first and last eval
        accuracy (None without evaluations) and the summary's path; every rank calls it."""
        self.home.wait()
        if self.home.saved_step != self.step:
            self.checkpoint()
        self.pipeline.close()
        if not is_main():  # rank 0 plots and summarises
            self.logger.close()
            return {"run_dir": str(self.run_dir), "eval_accuracy_first": None, "eval_accuracy_last": None}
        from gspo.run.metrics import read_metrics
        from gspo.training.plots import write_summary

        evals = [r for r in read_metrics(self.run_dir) if r["kind"] == "eval"]
        try:
            from gspo.training.plots import plot_run

            plot_run(self.run_dir)
        except ImportError as error:  # plots are optional; the metrics are on disk
            print(f"plots skipped: {error}")
        summary = write_summary(self.run_dir)
        first, last = (evals[0]["accuracy"], evals[-1]["accuracy"]) if evals else (None, None)
        self.logger.close(
            {
                "steps": self.step,
                "eval_accuracy_first": first,
                "eval_accuracy_last": last,
                "summary_md": summary,
            }
        )
        self.home.release()  # written in full: another process may continue it now
        return {
            "run_dir": str(self.run_dir),
            "eval_accuracy_first": first,
            "eval_accuracy_last": last,
            "summary": summary,
        }


def train(
    config: Config | str | Path | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    reward_functions: RewardFunctions | None = None,
    data: Any = None,
    resume: str | Path | None = None,
    force: bool = False,
    trust_run_folder: bool = False,
    from_step: int | None = None,
) -> dict[str, Any]:
    """Run GSPO training; returns the run folder and the first/last eval accuracy.

    ``resume``: continue that run folder (its config.yaml plus ``overrides``; ``force`` allows changes
    beyond gspo.run.resume.RESUMABLE). Reward code, servers and outside paths its config names are used
    only when ``overrides`` name them again, or ``reward_functions`` replaces the rewards, or the user started this run in this folder with those files and values, unchanged
    (gspo.run.own_runs), or ``trust_run_folder`` (gspo.run.trust). The code files and values the user
    names are recorded as theirs for this run. ``from_step``: resume that step's checkpoint instead of the
    latest. ``reward_functions`` and ``data``: as `Trainer`'s.

    >>> from gspo import train, load_config
    >>> result = train(load_config("configs/tiny.yaml"), reward_functions=[my_reward])  # doctest: +SKIP
    """
    check_train_arguments(config, overrides)
    if resume is not None:
        config = resume_config(resume, overrides, force=force)
        check_run_folder_config(
            config,
            overrides,
            folder=Path(resume),
            trust_run_folder=trust_run_folder,
            # reward_functions replace the config's rewards: its reward files are never imported
            rewards_replaced=bool(reward_functions),
        )
    elif config is None or isinstance(config, (str, Path)):
        config = load_config(config, overrides)
    trainer = None
    try:
        trainer = Trainer(
            config,
            reward_functions=reward_functions,
            data=data,
            resume=resume,
            force=force,
            from_step=from_step,
        )
        files = users_code_files(trainer.config, overrides, resumed=resume is not None)
        named = users_reaches(trainer.config, overrides, resumed=resume is not None)
        if is_main() and (refusal := record(trainer.run_dir, files, named)):
            print(
                f"note: this run is not recorded as yours ({refusal}): --resume and gspo eval of it will ask "
                "you to name its code, servers and paths again",
                file=sys.stderr,
            )
        result = trainer.run()
        # every rank done with the group before any rank destroys it: a gloo rank torn down while a peer
        # still finishes its run aborted once in about a dozen torchrun runs here ("terminate called without an
        # active exception"); on an error the ranks raise together and skip this
        barrier()
        return result
    finally:
        # also after an error (the folder is as complete as it gets), or a Trainer that failed to start
        folder = trainer.run_dir if trainer is not None else resume or config.output_dir
        if folder is not None:
            lock.release(folder)
        shutdown()  # only if the Trainer created the process group

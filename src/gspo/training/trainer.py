"""The training loop, read top to bottom: sample -> reward -> batch -> learn -> log, evaluate, checkpoint.

`Trainer` opens its run as `gspo serve` does (gspo.run.start: the folder, the policy, the step, the logger,
checkpoints), builds what training alone needs (its examples and rewards: gspo.training.inputs) and asks the
sampling side for each step's rollout batch (gspo.sampling.schedule, however far ahead it samples);
`train_step` (the sampler's rollouts) and `train_on_groups` (the user's trajectories) both become `Sample`s
and go through `_learn`: gspo.learning.step's `learn_from_samples`, which `gspo serve` calls too.
`gspo.training.launch.train` is the Python API's and `gspo train`'s front door around it.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gspo.config import Config, validate
from gspo.core.samples import Sample
from gspo.core.seeds import step_seed
from gspo.learning.policy import UpdateSpec
from gspo.learning.step import learn_from_samples
from gspo.parallel.group import is_main, world_size
from gspo.rewards.calling import RewardError
from gspo.rollout.samplers import Sampler, ServerError
from gspo.rollout.trajectories import TrajectoryGroup, trajectory_samples
from gspo.run.checkpoint import rng_state
from gspo.run.start import open_folder, run_attribute, start_run
from gspo.sampling.schedule import Schedule, training_side
from gspo.training.evaluation import evaluate_policy
from gspo.training.inputs import RewardFunctions, check_sizes, task_inputs, write_data
from gspo.training.progress import Progress, report, skip_notice


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says what the run kept and how to continue it."""


class Trainer:
    """A run: its config and folder, the policy, the sampling side and its schedule, the step counter, the
    logger.

    ``reward_functions``: Python callables that replace config.rewards, by name or a list named by their
    own names (the first is the eval accuracy; each weighs config.rewards[name] where the config names it,
    else 1.0). ``data``: the task's rows in memory (a `datasets.Dataset` or a list of dicts, read with
    task.prompt_field and task.answer_fields) instead of task.data_path; the run keeps them in
    RUN/data.jsonl, which its config names, so that `--resume` and `gspo eval RUN` read the same rows.
    ``sampler``: a `Sampler` of your own (e.g. an OpenAIBackend with weight sync) instead of rollout.engine's.
    ``force``: resume even when ``config`` changes keys the checkpoint was trained with (gspo.run.resume).
    ``from_step``: resume the checkpoint of that step instead of the latest (one that is damaged: an
    earlier one).
    ``eval_data``: held-out rows in memory (as ``data``), the run's evaluation problems instead of
    task.num_eval of the task's (RUN/eval_data.jsonl, which task.eval_data_path names). ``on_log``: functions
    called with (step, kind, metrics) after each line is logged, kind "train" or "eval" (TRL's callbacks'
    on_log, gspo.trl).
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
        eval_data: Any = None,
        on_log: Sequence[Callable[[int, str, dict[str, float]], Any]] = (),
    ) -> None:
        # each step takes what the one before it made: its order is in its arguments
        validate(config)  # a config built in Python: what relates its keys (each key is checked when set)
        folder = open_folder(config, resume, force=force, from_step=from_step)  # locked, resume checked
        inputs = task_inputs(
            config, folder, reward_functions, data, resumed=resume is not None, eval_data=eval_data
        )
        self.rewards, self.train_examples, self.eval_examples = inputs.rewards, inputs.train, inputs.held_out
        # a stopped run's message names them again: config.yaml holds their names, no built-in's
        self._python_rewards = self.rewards.names if reward_functions else []
        self.home = start_run(inputs.config, folder)  # the folder claimed: the inputs are checked
        write_data(self.home, inputs.rows, inputs.eval_rows)
        self.on_log = list(on_log)
        check_sizes(self.config, self.tokenizer, self.policy.model, self.train_examples, self.eval_examples)
        side = training_side(self.home, sampler)
        probe = self.train_examples[:4]
        exact = functools.cache(lambda: side.current(self.config, self.policy, probe))
        self.spec = self.home.spec_for(exact=exact, stale=side.beside)
        # a batch all of whose samples the current weights drew (staleness 0: the first, beside the updates)
        self._fresh_spec = self.home.spec_for(exact=exact, stale=False) if side.beside else self.spec
        self._warned_mismatch = False
        self.progress = Progress(self.config, 0)
        if self.progress.shows_bar():  # which, once; the metrics say how many (skipped_samples_frac)
            self.progress.note(skip_notice(self.config, self.spec))
        restored = self.home.restore()  # after the sampler: what building it drew is not replayed
        self.rollouts = Schedule.resume(
            self.config, side, self.train_examples, self.rewards, self.tokenizer, restored, self.home.workers
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

    @property
    def sampler(self) -> Sampler:
        """What draws the rollouts (the sampling side's: gspo.sampling.side)."""
        return self.rollouts.side.sampler

    # ---- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One rollout batch from the sampling side, its updates, and the new weights handed over to it."""
        samples, metrics = self.sample()
        metrics = self._learn(samples, metrics)
        self.rollouts.updated(self.policy.model, self.step)
        return metrics

    def sample(self) -> tuple[list[Sample], dict[str, float]]:
        """This rank's share of the next rollout batch (G completions of each prompt, scored by the rewards),
        its metrics reduced over ranks and its samples logged."""
        drawn, metrics = self.rollouts.take(self.step + 1)
        self.logger.log_samples(drawn.step, drawn.rows(self.config.rollout.group_size))
        return drawn.samples, metrics

    def train_on_groups(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One step of updates on the user's own trajectory groups (gspo.rollout.trajectories), as `run`
        does a step: the metrics logged, a checkpoint every checkpoint.every steps; `finish` ends the run.

        Their engine is not the trainer's model: with train.old_logprobs=auto the old policy's log-probs
        are recomputed (the trajectories' own sampler log-probs, if any, give the mismatch metrics)."""
        need = self.config.train.old_logprobs == "sampler"
        samples = trajectory_samples(self.tokenizer, groups, need_sampler_logprobs=need)
        metrics = self._learn(samples, {}, self.home.spec_for(exact=False))  # another engine drew them
        self.rollouts.updated(self.policy.model, self.step)
        self._log(metrics)
        every = self.config.checkpoint.every
        if every and self.step % every == 0:
            self.checkpoint()
        return metrics

    def _learn(
        self, samples: list[Sample], metrics: dict[str, float], spec: UpdateSpec | None = None
    ) -> dict[str, float]:
        """Samples -> batch -> old-policy log-probs and updates (gspo.learning.step); Ctrl-C waits for the
        step's last update (`_whole_step`), so a stopped run keeps every step it finished."""
        if spec is None:  # no proximal pass for samples the current weights drew: their log-probs are its own
            spec = self.spec if any(s.version < self.step for s in samples) else self._fresh_spec
        self.home.wait()  # a checkpoint written in the background reads the weights this step changes
        metrics = {**metrics, "lr": self.policy.scheduler.get_last_lr()[0]}
        with _whole_step():
            metrics |= learn_from_samples(
                self.policy, spec, samples, seed=step_seed(self.config.seed, self.step)
            )
            self.step += 1
        if spec.old_logprobs == "sampler" and metrics["num_trained"] > 0:
            self._check_mismatch(metrics)
        return metrics

    def _check_mismatch(self, metrics: dict[str, float]) -> None:
        """Warn once when the sampler's log-probs, used as the old policy's, are off by more than GSPO's
        clip band for more than 1% of the sequences (measured on the first minibatch)."""
        outside = metrics.get("sampler_seq_outside_clip_frac", 0.0)
        if outside > 0.01 and not self._warned_mismatch:
            self._warned_mismatch = True
            warnings.warn(
                f"step {self.step}: the sampler's log-probs differ from the trainer's by more than GSPO's clip "
                f"band for {outside:.0%} of the sequences, and they serve as the old policy's: set "
                "train.old_logprobs=recompute (docs/sampler_mismatch.md)",
                stacklevel=2,
            )

    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the held-out split, scored by the run's rewards (gspo.training.evaluation)."""
        return evaluate_policy(
            self.policy,
            self.tokenizer,
            self.config,
            self.eval_examples,
            self.rewards,
            self.step,
            workers=self.home.workers,
        )

    # ---- the loop -----------------------------------------------------------------------------------
    def checkpoint(self, rng: dict[str, Any] | None = None, *, background: bool = False) -> Path | None:
        """A checkpoint of this step with ``rng`` (default: now), the batches drawn ahead and the prompt
        stream's position (gspo.sampling.schedule.Schedule.state) as the state a resumed run continues from.
        ``background``: written while the next batch is drawn (gspo.run.start.Run.save); returns None."""
        return self.home.save(rng=rng, background=background, **self.rollouts.state(self.step))

    def train(self) -> dict[str, Any]:
        """`run`, under the name TRL's trainers use."""
        return self.run()

    def run(self) -> dict[str, Any]:
        """Train to train.steps, evaluating and checkpointing on the way, then `finish`. A reward function's
        error, the sampling server's, or Ctrl-C stops the run with what it kept: the run folder and a
        checkpoint of every step it finished, which `--resume` continues."""
        try:
            return self._run_steps()
        except RewardError as error:
            raise RewardError(
                f"{error}; {self._stopped('fix the reward function, then', code=True)}"
            ) from error
        except ServerError as error:  # the sampling server: down, dead, or refusing the weights
            raise ServerError(f"{error}; {self._stopped('continue it with')}") from error
        except KeyboardInterrupt as error:
            raise RunInterrupted(f"interrupted; {self._stopped('continue it with')}") from error
        finally:
            self.rollouts.close()
            self.home.close()  # the run's threads: a checkpoint being written ends first

    def _stopped(self, then: str, *, code: bool = False) -> str:
        """Keep the steps a stopped run finished (one process: under torchrun the other ranks may not have
        stopped, and would not join a save), and say what it kept and how to continue it (``code``: naming
        the reward code again, which the user is editing)."""
        with contextlib.suppress(Exception):  # a checkpoint in flight: done, or not the latest
            self.home.wait()
        if world_size() == 1 and self.step > 0 and self.home.saved_step != self.step:
            with contextlib.suppress(Exception):  # kept as far as it can be; the error that stopped it stands
                self.checkpoint()
        return self.home.kept(then, code=code, python_rewards=self._python_rewards)

    def _run_steps(self) -> dict[str, Any]:
        cfg = self.config
        if self.step == 0 and not self.resumed:
            # no checkpoint at step 0: it would be the initial model, which a run stopped before its first
            # checkpoint starts from again anyway (gspo.run.folder), to the same results
            self._log_eval()
        self.progress = Progress(cfg, self.step)
        while self.step < cfg.train.steps:
            start_rng, started = rng_state(), self.step
            try:
                metrics = self.train_step()
            except (RewardError, ServerError):
                self.home.wait()  # a checkpoint in flight completes first
                if self.step > 0 and self.home.saved_step != self.step:
                    # updated (the engine did not take the new weights): keep the step; else record its start,
                    # so that `--resume` redoes it exactly (never step 0: the initial model, which a resume
                    # without a checkpoint starts from again, to the same results)
                    self.checkpoint(rng=None if self.step != started else start_rng)
                raise
            self._log(metrics)
            self.progress.step(self.step, metrics, self.rollouts.agreed_answer)
            last = self.step == cfg.train.steps
            if last or (cfg.eval.every and self.step % cfg.eval.every == 0):
                self._log_eval()
            if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                self.checkpoint(background=True)  # written as the next batch is drawn
        self.progress.close()
        return self.finish()

    def _log(self, metrics: dict[str, float], kind: str = "train") -> None:
        """A line of metrics.jsonl (and the trackers'), then the `on_log` functions."""
        self.logger.log(self.step, metrics, kind=kind)
        for hook in self.on_log:
            hook(self.step, kind, dict(metrics))

    def _log_eval(self) -> None:
        if not self.eval_examples:  # task.num_eval=0: nothing held out, nothing to measure
            return
        result = self.evaluate()
        self._log(result, kind="eval")
        self.progress.evaluated(self.step, result)

    def finish(self) -> dict[str, Any]:
        """End the run as `gspo train` does: a checkpoint of the last step (unless it has one), the metrics
        closed, plots/*.png and summary.md written, the run folder's lock released. Returns the run folder,
        the first and last eval accuracy (None without evaluations) and the summary's path; every rank
        calls it."""
        self.home.wait()
        if self.home.saved_step != self.step:
            self.checkpoint()
        self.rollouts.close()
        if not is_main():  # rank 0 plots and summarises
            self.logger.close()
            return {"run_dir": str(self.run_dir), "eval_accuracy_first": None, "eval_accuracy_last": None}
        result = report(self.run_dir)
        self.logger.close({"steps": self.step, **result, "summary_md": result["summary"]})
        self.home.release()  # written in full: another process may continue it now
        return {"run_dir": str(self.run_dir), **result}


@contextlib.contextmanager
def _whole_step() -> Iterator[None]:
    """Ctrl-C (SIGINT) during a step's updates takes effect when they end, so the weights are never left
    half-way through a step; a second Ctrl-C stops at once. Only the main thread can catch signals: a run
    in another thread (a notebook's worker, a test's) is interrupted as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[bool] = []

    def defer(signum: int, frame: Any) -> None:
        if pending:  # the second Ctrl-C
            raise KeyboardInterrupt
        pending.append(True)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt

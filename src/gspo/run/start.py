"""Opening a run, once for `gspo train` and `gspo serve`: the folder checked and locked (`open_folder`), then
the run started in it (`start_run`): config saved, seeds set, the policy built (a checkpoint's weights when
resuming), and `Run.restore` puts back the rest of a checkpoint (optimizer, schedule, random streams, step)
and opens the metrics log. `Run.save` writes a checkpoint; `Run.spec_for` resolves train.old_logprobs.

    folder = open_folder(config, resume)      # nothing written for a new run
    ...                                       # the front door's own checks (rewards, data)
    run = start_run(config, folder)           # the folder claimed, the policy built
    ...                                       # what may draw random numbers (a sampler)
    extra = run.restore()                     # the checkpoint's state; run.step, run.logger
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from gspo.config import Config, save_config, to_dict, validate_launch, validate_setup
from gspo.core.seeds import seed_everything
from gspo.files import FolderIdentity, check_still_there, folder_identity, run_path
from gspo.learning.policy import Policy, UpdateSpec, update_choices, with_correction
from gspo.parallel.collectives import raise_together
from gspo.parallel.group import barrier, init_from_env, is_main, resolve_device, seed_rank, world_size
from gspo.parallel.state import rank_states
from gspo.run import lock
from gspo.run.build import choose_layout, setup_model, setup_objective, setup_policy
from gspo.run.checkpoint import checkpoint_step, latest_checkpoint, rng_state, save_policy
from gspo.run.folder import setup_run_dir, start_fresh
from gspo.run.metrics import MetricsLogger, SilentLogger
from gspo.run.resume import restore_state
from gspo.run.trackers import check_installed
from gspo.run.trust import continue_command
from gspo.workers import Workers


@dataclass(frozen=True)
class Folder:
    """A run folder checked for a run: locked when resuming, only checked for a new run (`start_run` claims
    it)."""

    path: Path
    checkpoint: Path | None
    """The complete checkpoint the run resumes; None: the run starts at step 0."""
    device: torch.device
    command: str
    """The command that continues the run (`gspo train`, `gspo serve`), for messages."""


def open_folder(
    config: Config,
    resume: str | Path | None = None,
    *,
    force: bool = False,
    from_step: int | None = None,
    command: str = "gspo train",
) -> Folder:
    """The run's device (under torchrun, the process group joined), the launch checked against ``config``,
    its folder checked (resuming: its checkpoint found, checked against ``config`` and the folder locked:
    gspo.run.folder), its objective registered and its trackers' packages present. A refused run writes
    nothing."""
    device = resolve_device(config.device)
    init_from_env(config.distributed, device)  # under torchrun: join the process group
    validate_launch(config, num_processes=world_size())  # what the launch refuses: before anything is written
    path, checkpoint = setup_run_dir(config, resume, force=force, from_step=from_step, command=command)
    setup_objective(config)
    if is_main():  # a tracker's missing package stops the run before the model loads
        check_installed(config.report_to)
    return Folder(path, checkpoint, device, command)


@dataclass
class Run:
    """A started run: its config and folder, the policy and tokenizer, the update spec, the step, the logger."""

    config: Config
    """The resolved config, as saved in the folder's config.yaml."""
    folder: Folder
    """Where it lives, the checkpoint it resumed, its device."""
    policy: Policy
    """The model and what updates it (gspo.learning.policy)."""
    tokenizer: Any
    """The policy's tokenizer (and chat template)."""
    spec: UpdateSpec
    """The run's update spec, train.old_logprobs as configured ("auto" unresolved: `spec_for`)."""
    # what changes as the run goes: the updates done (rollout batches, or the server's train calls), the
    # latest checkpoint's step (None before the first), and the metrics log (opened by `restore`)
    step: int = field(default=0)
    saved_step: int | None = field(default=None)
    logger: MetricsLogger | SilentLogger | None = field(default=None, repr=False)
    identity: FolderIdentity | None = field(default=None, repr=False)
    """The run folder's, on the rank that writes (None elsewhere): a checkpoint is not written into
    another folder that came to have its path (`save`)."""
    workers: Workers = field(default_factory=lambda: Workers("run"), repr=False)
    """Every thread, pool and event loop the run starts (gspo.workers): its stages, the rewards' loop, the
    checkpoint writer; closed when the run ends (`close`)."""
    _writing: concurrent.futures.Future[None] | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def device(self) -> torch.device:
        return self.folder.device

    @property
    def resumed(self) -> bool:
        return self.folder.checkpoint is not None

    def spec_for(self, *, exact: bool | Callable[[], bool], stale: bool = False) -> UpdateSpec:
        """The spec with train.old_logprobs and train.sampler_correction resolved (gspo.learning.policy
        .update_choices): ``exact``, whether the samples' log-probs are the current weights' own (a callable
        is asked only if needed); ``stale``, whether some were drawn by an older version."""
        mode, correction = update_choices(self.config, self.policy.compute_dtype, exact=exact, stale=stale)
        return with_correction(self.config, self.spec, mode, correction)

    def restore(self) -> dict[str, Any]:
        """Put back the checkpoint the run resumes (optimizer, schedule, this rank's random streams, the
        step), then open the metrics log at that step; returns what else the checkpoint holds (the prompt
        stream, the server's version). A new run: step 0, {}. Called once, after building anything that
        draws random numbers (a sampler), so a resumed run draws as the uninterrupted one."""
        extra: dict[str, Any] = {}
        if self.folder.checkpoint is not None:
            self.step, extra = restore_state(self.folder.checkpoint, self.policy, self.config)
            self.saved_step = self.step
        resume_step = self.step if self.resumed else None
        failure = None
        try:  # rank 0's alone (its trackers, trackers.json): every rank stops with its error, or none
            self.logger = (
                MetricsLogger(
                    self.path,
                    report_to=self.config.report_to,
                    config=to_dict(self.config),
                    project=self.config.project,
                    resume_step=resume_step,
                    completions_per_step=self.config.completions_per_step,
                    workers=self.workers,
                )
                if is_main()
                else SilentLogger()
            )
        except Exception as error:
            failure = error
        raise_together(failure)
        return extra

    def save(
        self,
        step: int | None = None,
        *,
        rng: dict[str, Any] | None = None,
        background: bool = False,
        **extra: Any,
    ) -> Path | None:
        """A checkpoint of the run at ``step`` (default: the run's) with ``rng`` (default: now) and ``extra``
        (the prompt stream, the server's version); every rank calls it, and each rank's random streams and
        stream position go into it. Returns the latest checkpoint's path once all ranks are done.

        ``background`` (one process): written by the run's checkpoint stage (a thread of its workers) while
        the run samples its next batch, which only reads the weights; `wait` waits for it, and comes before
        anything changes them (an update). Until it is renamed into place it is not the latest checkpoint
        (gspo.run.checkpoint). Returns None then."""
        self.wait()  # one write at a time
        self._check_folder()
        step = self.step if step is None else step
        rng = rng if rng is not None else rng_state()
        if world_size() > 1:  # every rank's own random streams and data position
            extra["ranks"] = rank_states({"rng": rng, **extra})
        write = functools.partial(
            save_policy, self.path, step, self.policy, self.tokenizer, self.config, rng=rng
        )
        self.saved_step = step
        if background and world_size() == 1:
            self._writing = self.workers.stage("checkpoint").submit(lambda: write(**extra))
            return None
        try:
            write(**extra)
        except OSError as error:
            self._check_folder(error)
            raise
        barrier()  # complete before any rank goes on
        return latest_checkpoint(self.path)

    def _check_folder(self, cause: BaseException | None = None) -> None:
        """RunFolderGone when the run folder was removed, moved or replaced (gspo.files)."""
        if self.identity is not None:
            check_still_there(self.path, self.identity, cause)

    def wait(self) -> None:
        """Wait for a checkpoint written in the background (`save`), raising what it raised."""
        writing, self._writing = self._writing, None
        if writing is None:
            return
        error = writing.exception()
        if isinstance(error, OSError):  # a folder removed under the write: said as such
            self._check_folder(error)
        if error is not None:
            raise error

    def close(self) -> None:
        """The run's threads stop (gspo.workers.Workers.close), a checkpoint being written first."""
        try:
            self.wait()
        finally:
            self.workers.close()

    def kept(self, then: str, *, code: bool = False, python_rewards: Sequence[str] = ()) -> str:
        """What a stopped run kept, and the command that continues it (gspo.run.trust.continue_command:
        ``code``, naming the reward code again, which the user is editing; ``python_rewards``, the names of
        the Python functions given as rewards, which only a Python call can give again)."""
        command = continue_command(self.config, self.path, python_rewards=python_rewards, name_code=code)
        latest = latest_checkpoint(self.path)
        if latest is None:
            return f"{self.path} holds no checkpoint yet: {then} `{command}`, which starts it again"
        return f"the run is kept up to step {checkpoint_step(latest)} ({latest}): {then} `{command}`"

    def release(self) -> None:
        """Let another process continue the run: its folder is written in full."""
        self.wait()
        lock.release(self.path)


def run_attribute(name: str, *, via: str, settable: bool = False) -> Any:
    """A property of a front door (`Trainer`, the server's `TrainService`) that reads, and if ``settable``
    writes, attribute ``name`` of the `Run` it holds as ``via``: its familiar names, and one copy of each."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, via), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, via), name, value)

    return property(get, put if settable else None, doc=f"The run's {name} (gspo.run.start.Run).")


def start_run(
    config: Config, folder: Folder, *, prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None
) -> Run:
    """Start the run in ``folder``: a new folder claimed (created, locked, marked as gspo's), the config
    saved, the seeds set, the model loaded (a checkpoint's weights when resuming) and moved to the device
    (then ``prepare``d), the layout chosen and the policy built around it (optimizer, schedule, wrapper).
    Under torchrun each rank then takes its own sampling streams. `Run.restore` does the rest."""
    if folder.checkpoint is None:
        start_fresh(folder.path, command=folder.command)  # created and locked now that the inputs are checked
    if is_main():
        save_config(config, run_path(folder.path, "config.yaml"))
    transformers.utils.logging.disable_progress_bar()  # one progress bar or request log: ours
    seed_everything(config.seed)
    model, tokenizer = setup_model(config, folder.checkpoint)
    model = model.to(folder.device)
    if prepare is not None:
        model = prepare(model)
    layout = choose_layout(config, model, tokenizer.pad_token_id)  # the plain model, before wrapping
    policy = setup_policy(config, model, folder.device, resumed=folder.checkpoint is not None)
    validate_setup(config, num_processes=world_size(), is_moe=policy.moe)
    if world_size() > 1:
        seed_rank(config.seed)  # each rank samples its own completions
    spec = UpdateSpec.from_config(config, layout=layout, pad_id=tokenizer.pad_token_id)
    identity = folder_identity(folder.path) if is_main() else None
    return Run(config, folder, policy, tokenizer, spec, identity=identity)

"""`train`: the Python API's front door to a run, and `gspo train`'s: the config (a file, a Config, or a run
folder's to resume under the trust rules of gspo.run.trust), the `Trainer`, the user's code and servers
recorded as theirs (gspo.run.own_runs), and the run folder's lock released whatever happens."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gspo.config import Config, load_config
from gspo.parallel.group import barrier, is_main, shutdown
from gspo.run import lock
from gspo.run.own_runs import record
from gspo.run.resume import resume_config
from gspo.run.trust import check_run_folder_config, users_code_files, users_reaches
from gspo.training.inputs import RewardFunctions, check_train_arguments
from gspo.training.trainer import Trainer


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
    eval_data: Any = None,
    on_log: Sequence[Callable[[int, str, dict[str, float]], Any]] = (),
) -> dict[str, Any]:
    """Run GSPO training; returns the run folder and the first/last eval accuracy.

    ``resume``: continue that run folder (its config.yaml plus ``overrides``; ``force`` allows changes
    beyond gspo.run.resume.RESUMABLE). Reward code, servers and outside paths its config names are used
    only when ``overrides`` name them again, or ``reward_functions`` replaces the rewards, or the user
    started this run in this folder with those files and values, unchanged (gspo.run.own_runs), or
    ``trust_run_folder`` (gspo.run.trust). The code files and values the user names are recorded as theirs
    for this run. ``from_step``: resume that step's checkpoint instead of the latest. ``reward_functions``,
    ``data``, ``eval_data`` and ``on_log``: as `Trainer`'s.

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
            eval_data=eval_data,
            on_log=on_log,
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

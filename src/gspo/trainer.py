"""The training loop, read top to bottom: rollout -> reward -> advantages -> K minibatch updates -> log/checkpoint.

One rollout batch ("step") samples G completions for each of P prompts, scores them with the reward
functions, and computes group-relative advantages. `gspo.updates.learn` then computes the old-policy
log-probs once and makes `minibatches_per_rollout` optimizer updates; only the first is on-policy, which
is where GSPO and GRPO differ. The Trainer holds what lives across steps (model, optimizer, data stream,
logger) and also evaluates, checkpoints and resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from gspo import distributed, moe, updates
from gspo.advantages import group_advantages
from gspo.batching import MicroBatch, Sequence, packing_is_exact
from gspo.checkpoint import latest_checkpoint, load_trainer_state, rng_state, save_checkpoint, set_rng_state
from gspo.config import Config, ConfigError, load_config, save_config, validate_world
from gspo.data import TASKS, Example, PromptStream, arithmetic_task, format_prompt, load_examples, split_eval
from gspo.metrics import MetricsLogger
from gspo.models import add_lora, is_lora, load_model
from gspo.rewards import RewardError, RewardFunction, compute_rewards, resolve_reward
from gspo.rollout import Rollouts, generate
from gspo.updates import score

if TYPE_CHECKING:
    from gspo.trajectories import TrajectoryGroup

OBJECTIVE_DEFAULTS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
"""Paper defaults (eps_low, eps_high) per objective (GSPO paper, section 5.1)."""


def build_examples(config: Config) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems of the configured task; deterministic for `task.seed`."""
    try:
        return _build_examples(config)
    except ValueError as error:  # too many problems asked for, eval split too large, ...
        raise ConfigError(f"task: {error} (see task.num_train, task.num_eval)") from error


def _build_examples(config: Config) -> tuple[list[Example], list[Example]]:
    task = config.task
    if task.name == "file":
        examples = load_examples(
            task.data_path, prompt_field=task.prompt_field, answer_fields=tuple(task.answer_fields)
        )
    elif task.name == "arithmetic":
        examples = arithmetic_task(
            task.num_train + task.num_eval, operand_min=task.operand_min, operand_max=task.operand_max,
            operations=task.operations, num_operands=task.num_operands, seed=task.seed,
        )  # fmt: skip
    elif task.name in TASKS:
        examples = TASKS[task.name](task.num_train + task.num_eval, seed=task.seed)
    else:
        raise ConfigError(f"task.name={task.name!r} is not one of {sorted(TASKS)} or 'file'")
    return split_eval(examples, task.num_eval, seed=task.seed)


def resolve_rewards(
    config: Config, custom: Mapping[str, RewardFunction] | None
) -> list[tuple[str, RewardFunction, float]]:
    """(name, function, weight) for each configured reward; `custom` callables override or add names."""
    custom = dict(custom or {})
    weights = dict(config.rewards)
    for name in custom:
        weights.setdefault(name, 1.0)
    return [
        (name, custom[name] if name in custom else resolve_reward(name), w) for name, w in weights.items()
    ]


def _fields(examples: list[Example]) -> dict[str, list[Any]]:
    keys = examples[0].fields.keys() if examples else []
    return {k: [ex.fields[k] for ex in examples] for k in keys}


def _schedule(config: Config, total_updates: int) -> Callable[[int], float]:
    warmup, cosine = config.train.warmup_updates, config.train.schedule == "cosine"

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if not cosine:
            return 1.0
        progress = (update - warmup) / max(1, total_updates - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Trainer:
    """Holds what lives across steps (model, optimizer, data stream, logger); `run()` is the flat loop."""

    def __init__(
        self,
        config: Config,
        *,
        reward_functions: Mapping[str, RewardFunction] | None = None,
        resume: str | Path | None = None,
    ) -> None:
        self.config = config
        self.device = distributed.resolve_device(config.device)
        distributed.init_from_env(config.distributed, self.device)  # under torchrun: join the process group
        validate_world(config, distributed.world_size())
        self.rewards = resolve_rewards(config, reward_functions)
        self.train_examples, self.eval_examples = build_examples(config)
        checkpoint = None
        if resume is not None:
            self.run_dir = Path(resume)
            checkpoint = latest_checkpoint(self.run_dir)
            if checkpoint is None:
                raise FileNotFoundError(
                    f"no complete checkpoint in {self.run_dir}/checkpoints: start a new run instead"
                )
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            # rank 0's name: the ranks' clocks may straddle a second
            self.run_dir = Path(
                distributed.broadcast_object(config.output_dir or f"runs/{config.train.objective}-{stamp}")
            )
            if latest_checkpoint(self.run_dir) is not None:
                raise FileExistsError(
                    f"{self.run_dir} already holds a run: continue it with `gspo train --resume {self.run_dir}` "
                    "or choose another output_dir"
                )
            if distributed.is_main():
                self.run_dir.mkdir(parents=True, exist_ok=True)
        if distributed.is_main():
            save_config(config, self.run_dir / "config.yaml")

        transformers.utils.logging.disable_progress_bar()  # one progress bar: ours
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)
        model, self.tokenizer = self._load_policy(checkpoint)
        self.model = model.to(self.device)
        self.reference = (
            self._load_reference(resumed=checkpoint is not None) if config.train.beta > 0 else None
        )
        self.pad_id = self.tokenizer.pad_token_id
        self.packed = self._choose_packing()  # before wrapping: the probe runs the plain fp32 model
        # under torchrun: the model wrapped by DDP or FSDP2 for log-probs with grad; in one process the
        # model itself, or its autocast scorer with train.mixed_precision
        self.compute_dtype = distributed.compute_dtype(config.train.mixed_precision, self.device)
        self.scorer = distributed.wrap_model(self.model, config.distributed, self.device, self.compute_dtype)
        if distributed.world_size() > 1:
            distributed.seed_rank(config.seed)  # each rank samples its own completions
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.train.lr,
            betas=tuple(config.train.adam_betas),
            weight_decay=config.train.weight_decay,
            fused=True,  # one fused kernel per parameter: several times faster than the default loop on CPU
        )
        total_updates = config.train.steps * config.train.minibatches_per_rollout
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(config, total_updates))
        self.stream = PromptStream(self.train_examples, config.rollout.prompts_per_step, seed=config.seed)
        self.step = 0
        if checkpoint is not None:
            state = load_trainer_state(checkpoint)
            distributed.load_optimizer_state(self.scorer, self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            mine = distributed.resume_rank_state(state)  # this rank's RNG streams and data position
            self.stream.load_state_dict(mine["stream"])
            set_rng_state(mine["rng"])
            self.step = state["step"]
        self.logger = (
            MetricsLogger(
                self.run_dir, tensorboard=config.tensorboard, resume_step=self.step if checkpoint else None
            )
            if distributed.is_main()
            else distributed.SilentLogger()
        )
        eps = OBJECTIVE_DEFAULTS[config.train.objective]
        self.eps_low = config.train.eps_low if config.train.eps_low is not None else eps[0]
        self.eps_high = config.train.eps_high if config.train.eps_high is not None else eps[1]
        self.is_moe = moe.is_moe(self.model)  # MoE: routing volatility is logged, Routing Replay possible
        if config.train.routing_replay and not self.is_moe:
            raise ConfigError(
                "train.routing_replay needs a Mixture-of-Experts model with top-k routers (e.g. Qwen3-MoE); "
                f"{type(self.model).__name__} has none"
            )

    # ---- models -------------------------------------------------------------------------------------
    def _load_policy(self, checkpoint: Path | None) -> tuple[Any, Any]:
        """The policy (loaded on the CPU) and its tokenizer; the caller moves it to the device."""
        config = self.config
        if checkpoint is not None and config.lora.rank == 0:
            saved = dataclasses.replace(config.model, path=str(checkpoint / "model"), tiny=None)
            return load_model(saved, seed=config.seed)
        model, tokenizer = load_model(config.model, seed=config.seed)
        if config.lora.rank > 0:
            if checkpoint is not None:
                import peft

                model = peft.PeftModel.from_pretrained(model, checkpoint / "model", is_trainable=True)
                model.eval()
            else:
                model = add_lora(model, config.lora)
        return model, tokenizer

    def _load_reference(self, *, resumed: bool) -> torch.nn.Module | None:
        """The initial policy, frozen (KL anchor); None with LoRA, whose base model is the reference."""
        if is_lora(self.model):
            return None
        if resumed:  # the policy has moved: rebuild the initial weights
            reference, _ = load_model(self.config.model, seed=self.config.seed)
        else:
            reference = copy.deepcopy(self.model)
        reference.requires_grad_(False)
        return reference.to(self.device)

    def autocast(self) -> torch.autocast:
        """train.mixed_precision for passes that do not go through the scorer (generation, reference,
        MoE expert choices), so every pass computes like the policy's log-probs."""
        dtype = self.compute_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def reference_score(self, mb: MicroBatch) -> torch.Tensor:
        """log pi_ref of a micro-batch's tokens (the KL anchor), computed like the policy's."""
        if self.reference is not None:
            with self.autocast():
                return score(self.reference, mb, self.config)
        with self.model.disable_adapter(), self.autocast():
            return score(self.model, mb, self.config)

    def _choose_packing(self) -> bool:
        mode = self.config.train.packing
        if mode != "auto":
            return mode == "packed"
        vocab = self.model.get_input_embeddings().num_embeddings
        with torch.no_grad():
            exact = packing_is_exact(
                lambda mb: score(self.model, mb.to(self.device), self.config).cpu(), vocab, self.pad_id
            )
        if not exact:
            warnings.warn(
                "this model's attention mixes packed sequences (it ignores restarting position_ids): "
                "training on padded rows instead (set train.packing=padded to skip this probe)",
                stacklevel=2,
            )
        return exact

    # ---- one step -----------------------------------------------------------------------------------
    def prompts(self, examples: list[Example]) -> list[str]:
        return [
            format_prompt(self.tokenizer, ex.prompt, system_prompt=self.config.task.system_prompt)
            for ex in examples
        ]

    def rollout(self, examples: list[Example]) -> tuple[Rollouts, list[Example]]:
        cfg = self.config.rollout
        with distributed.full_parameters(self.scorer), self.autocast():
            rollouts = generate(
                self.model, self.tokenizer, self.prompts(examples), group_size=cfg.group_size,
                max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                batch_size=cfg.generation_batch_size,
            )  # fmt: skip
        return rollouts, [ex for ex in examples for _ in range(cfg.group_size)]

    def minibatches(self, sequences: list[Sequence]) -> list[tuple[list[int], list[MicroBatch]]]:
        """Shuffle (seeded by step) and split into minibatches, each laid out in micro-batches."""
        return updates.minibatches(self, sequences)

    def update(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One optimizer update on a minibatch (gspo.updates.update)."""
        return updates.update(self, *args, **kwargs)

    def train_step(self) -> dict[str, float]:
        cfg = self.config
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        examples = distributed.rank_slice(self.stream.next_batch())  # this rank's prompts, whole groups
        rollouts, sample_examples = self.rollout(examples)
        times["time_rollout"] = time.perf_counter() - t0

        prompts = [p for p in self.prompts(examples) for _ in range(cfg.rollout.group_size)]
        failure = None
        try:
            rewards, per_function = compute_rewards(
                self.rewards, prompts, rollouts.completions, _fields(sample_examples)
            )
        except RewardError as error:
            failure = error
        distributed.raise_together(failure)  # all ranks stop together, so they can checkpoint together
        # every rank sees the whole batch's rewards: advantages and reward metrics are one process's
        rewards = distributed.all_gather_cat(rewards)
        per_function = {name: distributed.all_gather_cat(v) for name, v in per_function.items()}
        advantages, zero_std = group_advantages(
            rewards, cfg.rollout.group_size, scale=cfg.train.advantage_scale
        )
        first = distributed.rank() * len(rollouts)  # this rank's first sample in the whole batch
        advantages = advantages[first : first + len(rollouts)]
        keep = [
            i for i in range(len(rollouts))
            if not (cfg.train.filter_zero_std_groups and bool(zero_std[(first + i) // cfg.rollout.group_size]))
        ]  # fmt: skip
        lengths = distributed.all_gather_list([len(c) for c in rollouts.completion_ids])
        truncated = distributed.all_gather_list(rollouts.truncated)
        logged: dict[str, float] = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            **{f"reward/{name}": float(v.mean()) for name, v in per_function.items()},
            "zero_std_groups": float(zero_std.sum()),
            "completion_len_mean": sum(lengths) / len(lengths),
            "truncated_frac": sum(truncated) / len(truncated),
            "lr": self.scheduler.get_last_lr()[0],
        }
        if cfg.train.filter_zero_std_groups and bool(zero_std.all()):  # nothing to learn on any rank
            self.step += 1
            return {**logged, **times, "time_old_logprobs": 0.0, "time_update": 0.0}

        sequences = [
            Sequence(
                rollouts.prompt_ids[i], rollouts.completion_ids[i],
                [not (cfg.rollout.mask_truncated and rollouts.truncated[i])] * len(rollouts.completion_ids[i]),
            )
            for i in keep
        ]  # fmt: skip
        learned = self.learn(sequences, advantages[keep], [rollouts.sampler_logprobs[i] for i in keep])
        self.step += 1
        return {**logged, **learned, **times}

    def learn(
        self,
        sequences: list[Sequence],
        advantages: torch.Tensor | list[list[float]],
        sampler_logprobs: list[list[float]],
    ) -> dict[str, float]:
        """Old-policy log-probs, then `minibatches_per_rollout` updates on scored sequences (gspo.updates)."""
        return updates.learn(self, sequences, advantages, sampler_logprobs)

    def train_on_groups(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """GSPO updates on the user's own trajectory groups, as one step (see gspo.trajectories)."""
        from gspo.trajectories import train_on_groups

        return train_on_groups(self, groups)

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy completions on the held-out split; accuracy = mean of the first reward function."""
        examples = self.eval_examples[distributed.rank() :: distributed.world_size()]  # this rank's share
        prompts = self.prompts(examples)
        with distributed.full_parameters(self.scorer), self.autocast():
            rollouts = generate(
                self.model, self.tokenizer, prompts, group_size=1, max_new_tokens=self.config.eval.max_new_tokens,
                greedy=True, batch_size=self.config.eval.batch_size,
            )  # fmt: skip
        total, per_function = compute_rewards(self.rewards, prompts, rollouts.completions, _fields(examples))
        total = distributed.all_gather_varlen(total)
        per_function = {name: distributed.all_gather_varlen(v) for name, v in per_function.items()}
        lengths = distributed.all_gather_list([len(c) for c in rollouts.completion_ids])
        first = self.rewards[0][0]
        return {
            "accuracy": float(per_function[first].mean()),
            "reward_mean": float(total.mean()),
            "completion_len_mean": sum(lengths) / len(lengths),
        }

    # ---- the loop -----------------------------------------------------------------------------------
    def checkpoint(self, rng: dict[str, Any] | None = None, stream: dict[str, Any] | None = None) -> Path:
        state = {
            "optimizer": distributed.optimizer_state(self.scorer, self.optimizer),  # FSDP2: gathered
            "scheduler": self.scheduler.state_dict(),
            "stream": stream if stream is not None else self.stream.state_dict(),
            "rng": rng if rng is not None else rng_state(),
        }
        if distributed.world_size() > 1:  # every rank's own RNG streams and data position
            state["ranks"] = distributed.rank_states(state["rng"], state["stream"])
        model = distributed.savable_model(self.scorer, self.model)  # FSDP2: full weights on rank 0
        if distributed.is_main():
            save_checkpoint(
                self.run_dir,
                self.step,
                model=model,
                tokenizer=self.tokenizer,
                state=state,
                keep=self.config.checkpoint.keep,
            )
        distributed.barrier()  # complete before any rank goes on
        return latest_checkpoint(self.run_dir)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        if self.step == 0:
            self._log_eval()
            self.checkpoint()  # step 0: a resumable point exists before any update
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            disable=not (cfg.progress and distributed.is_main()),
            desc="gspo",
            unit="step",
        )
        while self.step < cfg.train.steps:
            start_rng, start_stream = rng_state(), self.stream.state_dict()
            try:
                metrics = self.train_step()
            except RewardError:
                # nothing was updated in this step: record its start so `--resume` redoes it exactly
                latest = latest_checkpoint(self.run_dir)
                if latest is None or load_trainer_state(latest)["step"] != self.step:
                    self.checkpoint(rng=start_rng, stream=start_stream)
                raise
            self.logger.log(self.step, metrics)
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward_mean']:.3f}", clip=f"{metrics.get('clip_frac_token', 0.0):.3f}",
                gen=f"{metrics['time_rollout']:.1f}s", old=f"{metrics['time_old_logprobs']:.1f}s",
                upd=f"{metrics['time_update']:.1f}s",
            )  # fmt: skip
            last = self.step == cfg.train.steps
            if last or (cfg.eval.every and self.step % cfg.eval.every == 0):
                self._log_eval(bar)
            if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                self.checkpoint()
        bar.close()
        self.logger.close()
        if not distributed.is_main():  # rank 0 plots and summarises
            return {"run_dir": str(self.run_dir), "eval_accuracy_first": None, "eval_accuracy_last": None}
        return self._finish()

    def _log_eval(self, bar: Any = None) -> dict[str, float]:
        result = self.evaluate()
        self.logger.log(self.step, result, kind="eval")
        if self.config.progress and distributed.is_main():
            tqdm.write(
                f"step {self.step}: eval accuracy {result['accuracy']:.3f} (reward {result['reward_mean']:.3f})"
            )
        return result

    def _finish(self) -> dict[str, Any]:
        from gspo.metrics import read_metrics
        from gspo.plots import write_summary

        evals = [r for r in read_metrics(self.run_dir) if r["kind"] == "eval"]
        try:
            from gspo.plots import plot_run

            plot_run(self.run_dir)
        except ImportError as error:  # plots are optional; the metrics are on disk
            print(f"plots skipped: {error}")
        summary = write_summary(self.run_dir)
        first, last = (evals[0]["accuracy"], evals[-1]["accuracy"]) if evals else (None, None)
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
    reward_functions: Mapping[str, RewardFunction] | None = None,
    resume: str | Path | None = None,
) -> dict[str, Any]:
    """Run GSPO training; returns the run folder and the first/last eval accuracy.

    >>> from gspo import train, load_config
    >>> result = train(load_config("configs/tiny.yaml"), reward_functions={"mine": my_reward})  # doctest: +SKIP
    """
    if resume is not None:
        config = load_config(Path(resume) / "config.yaml", overrides)
    elif config is None or isinstance(config, (str, Path)):
        config = load_config(config, overrides)
    try:
        return Trainer(config, reward_functions=reward_functions, resume=resume).run()
    finally:
        distributed.shutdown()  # only if the Trainer created the process group

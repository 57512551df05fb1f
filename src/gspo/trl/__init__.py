"""TRL's GRPOTrainer and GRPOConfig over gspo: TRL's quick start runs with one change, its import.

    from gspo.trl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len,
                          args=GRPOConfig(output_dir="Qwen2-0.5B-GRPO"), train_dataset=dataset)
    trainer.train()

GRPOConfig takes TRL's names for what gspo has (gspo.config.trl translates each: the loss pair, the batch
names, the counts, the sampling keys), takes and ignores those that change nothing here (saying why in
gspo.config.trl), and refuses by name, saying what to use instead, a value gspo has no setting for; each
value is checked against its annotation and range as it is set, one line naming a value that works.
`gspo={...}` takes gspo's own keys as `Config`'s keyword arguments, applied last. A name left out has
TRL's default, but for the loss: importance_sampling_level="sequence" and loss_type="grpo", TRL's GSPO
recipe, with the paper's clip range (epsilon and epsilon_high unset).

GRPOTrainer trains `train_dataset` through gspo's `train`, into the run folder output_dir. Reward
functions get TRL's keywords where they take them: `prompts` (the dataset's own), `completions` (texts, or
`[{"role": "assistant", "content": ...}]` for a conversational dataset), `completion_ids`, `trainer_state`,
`log_metric(name, value)`, `log_extra` and every other column; plain or `async def`, returning None for a
sample they do not score (gspo.trl.rewards). A reward model is a folder (or a hub id in the local Hugging
Face cache) in reward_funcs, gspo's reward_model; `gspo={"rewards": {...}}` adds gspo's named rewards
(built-ins, reward_model, judge) to the functions. `eval_dataset`, `callbacks` (TrainerCallback),
`trainer.state`, `trainer.model`, a model object as `model=`, `train(resume_from_checkpoint=...)` and its
TrainOutput work as TRL's do (gspo.trl.grpo_trainer).

Departures from TRL, each for a reason gspo states elsewhere:
- a text prompt is the user message of the model's chat template (TRL feeds it to the model as written);
  max_prompt_length cuts nothing (a prompt too long for the context is refused at start-up);
- the run length is max_steps, else num_train_epochs over train_dataset's rows, in rollout batches;
  TRL's counts (max_steps, save_steps, eval_steps, checkpoint-N, global_step) are optimizer updates, and
  gspo's steps rollout batches of steps_per_generation / gradient_accumulation_steps updates each;
  trainer_state.global_step is the updates before the rollout batch a reward scores (0 at an evaluation);
- sampling takes temperature, top_p and a length alone (generation_kwargs' other keys, top_k, min_p and
  repetition_penalty are refused); dropout is off always (disable_dropout changes nothing);
- evaluation is greedy, the first reward's mean on eval_dataset's rows (or rows held out with
  `gspo={"task": {"num_eval": N}}`), before and after training and every eval_steps with
  eval_strategy="steps"; its metrics are gspo's, prefixed "eval_" in logs and log_history;
- callbacks get on_init_end, on_train_begin, on_step_end, on_log (gspo's metric names), on_evaluate and
  on_train_end; TrainerControl's flags are not read (a run stops at its length);
- log_extra is taken and ignored (completions.jsonl keeps gspo's columns); a reward model scores with its
  own tokenizer (reward_processing_classes is refused);
- a model object is saved into output_dir/base_model/ and trained from there (its tokenizer:
  processing_class, else its name_or_path's from the local cache); processing_class otherwise is the
  model's own, or refused;
- resume_from_checkpoint continues with the new GRPOConfig's run length, checkpoints, evaluations and
  logging (gspo.run.resume.RESUMABLE), and refuses any other change;
- tools= is refused: gspo trains agents through `gspo serve` and their own loop (docs/agents.md);
- save_total_limit=None keeps gspo's one checkpoint (TRL keeps all); logging_steps,
  gradient_checkpointing and log_completions change nothing (gspo logs every step and bounds memory with
  train.micro_batch_tokens).
"""

from gspo.trl.grpo_config import GRPOConfig
from gspo.trl.grpo_trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

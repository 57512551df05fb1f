"""A reward model as a reward function: a local Hugging Face sequence-classification model directory, its
score of each prompt and completion (reward_model.path; TRL takes such a model in reward_funcs).

The text scored is the prompt as the policy saw it (its chat template applied) followed by the completion,
as TRL scores a plain prompt; it is tokenised by the reward model's own tokenizer (its special tokens
added), right-padded, cut at ``max_length`` tokens, and the reward is the first logit of the model's head
(a model with one label: its score). Batches of ``batch_size`` texts run on the run's device, with no
gradient, in the scoring stage's thread.

The folder must hold a sequence-classification model: its config.json names a ...ForSequenceClassification
architecture and its weights hold the head. Anything else is refused with one line saying what was found
(a causal LM would load with a freshly initialised head: random rewards, and a run that exits 0), as is a
file of the folder that is a link out of it. Errors are `RewardModelError` (exit code 4, input files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gspo.models.loading import ModelError


class RewardModelError(ModelError):
    """reward_model.path is not a sequence-classification model folder gspo can load; the message says what
    was found and what to give instead."""


def _check_folder(path: Path) -> dict[str, Any]:
    """The folder's config.json, once the folder is one of a sequence-classification model (module
    docstring); RewardModelError otherwise."""
    if not (path / "config.json").is_file():
        raise RewardModelError(
            f"reward_model.path: {path} is not a Hugging Face model folder (no config.json): give the folder of a "
            "sequence-classification model saved with save_pretrained"
        )
    for file in sorted(path.iterdir()):
        if file.is_symlink() and not file.resolve().is_relative_to(path.resolve()):
            raise RewardModelError(
                f"reward_model.path: {file} is a link to {file.resolve()}, outside the model folder: copy the "
                "file into the folder"
            )
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise RewardModelError(f"reward_model.path: {path / 'config.json'} is not JSON ({error})") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures
    ):
        found = ", ".join(map(str, architectures)) if isinstance(architectures, list) else "no architecture"
        raise RewardModelError(
            f"reward_model.path: {path} holds {found}, not a sequence-classification model: its head would be "
            "initialised at random, and so would the rewards. Give a reward model (a ...ForSequenceClassification "
            "folder, e.g. one trained with TRL's RewardTrainer)"
        )
    return config


class RewardModel:
    """``reward_model.path``'s model as a batch reward function (module docstring)."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        batch_size: int = 16,
        max_length: int = 1024,
    ) -> None:
        import transformers
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()  # one progress bar: the run's

        self.path = Path(path)
        _check_folder(self.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            model, info = AutoModelForSequenceClassification.from_pretrained(
                self.path, output_loading_info=True
            )
        except (OSError, ValueError, KeyError) as error:  # a damaged file of the folder, an unknown type
            message = " ".join(str(error).split())[:300]
            raise RewardModelError(
                f"reward_model.path: {self.path} could not be loaded ({type(error).__name__}: {message})"
            ) from None
        missing = list(info.get("missing_keys") or [])
        if missing:  # a head (or more) that the folder's weights do not hold: initialised at random
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise RewardModelError(
                f"reward_model.path: {self.path}'s weights do not hold {shown}, which would be initialised at "
                "random (and so would the rewards): give a trained sequence-classification model"
            )
        self.model = model.to(device).eval()
        if self.tokenizer.pad_token is None:  # batches are padded; the head reads each text's last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.device, self.batch_size, self.max_length = torch.device(device), batch_size, max_length
        self.__name__ = "reward_model"

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        texts = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**inputs).logits  # (b, num_labels)
            scores += logits[:, 0].float().tolist()
        return scores

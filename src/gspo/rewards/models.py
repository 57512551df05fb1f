"""A reward model as a reward function: a local Hugging Face sequence-classification model directory, its
score of each prompt and completion (reward_model.path; TRL takes such a model in reward_funcs).

The text scored is the prompt as the policy saw it (its chat template applied) followed by the completion,
as TRL scores a plain prompt; it is tokenised by the reward model's own tokenizer (its special tokens
added), right-padded, cut at ``max_length`` tokens, and the reward is the first logit of the model's head
(a model with one label: its score). Batches of ``batch_size`` texts run on the run's device, with no
gradient, in the scoring stage's thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"reward_model.path: {self.path} is not a Hugging Face model folder (no config.json): give the "
                "folder of a sequence-classification model saved with save_pretrained"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.path).to(device).eval()
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

"""A reward model as a reward function (gspo.rewards.models): a sequence-classification model folder's score of
each prompt + completion, batched and right-padded, equal to the model called on each text alone; named in
the config as the reward "reward_model"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bounds import assert_sums_close, tiny_gradient_rtol
from gspo.config import ConfigError, load_config
from gspo.models import tiny_tokenizer
from gspo.rewards.calling import compute_rewards
from gspo.rewards.models import RewardModel
from gspo.training.inputs import resolve_rewards

PROMPTS = ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"] * 2 + ["Name a colour: "]
COMPLETIONS = ["5", "The answer is five, I believe.", "blue"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama sequence classifier (one label) and its tokenizer, saved as a model folder."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("reward_model")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.numerics
def test_batched_scores_are_each_texts_own(folder: Path) -> None:
    """The batch (texts of different lengths, right-padded) scores each text as the model scores it alone:
    the head reads each text's last real token, whatever the padding after it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scores = RewardModel(folder, batch_size=2)(PROMPTS, COMPLETIONS)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    alone = []
    with torch.no_grad():
        for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
            inputs = tokenizer([prompt + completion], return_tensors="pt")
            alone.append(float(model(**inputs).logits[0, 0]))
    # the same sums over other batch shapes: each within the tiny model's chain of sums (bounds.py), relative
    # to its terms' magnitudes, which the largest score bounds where a score's terms cancel
    assert_sums_close(torch.tensor(scores), torch.tensor(alone), tiny_gradient_rtol())
    assert len(set(scores)) == 3  # a real score of each text, not a constant


def test_the_config_names_it_and_the_run_scores_with_it(folder: Path, tmp_path: Path) -> None:
    config = load_config(
        None, ["rewards={reward_model: 1.0}", f"reward_model.path={folder}", "reward_model.batch_size=2"]
    )
    ((name, function, weight),) = resolve_rewards(config, None)
    assert (name, weight) == ("reward_model", 1.0)
    _, per_function = compute_rewards([(name, function, weight)], PROMPTS, COMPLETIONS, {})
    want = RewardModel(folder, batch_size=2)(PROMPTS, COMPLETIONS)
    # the same texts in the same batch shapes: exact
    assert per_function["reward_model"].tolist() == torch.tensor(want).tolist()
    with pytest.raises(ConfigError, match=r"rewards names reward_model: set reward_model\.path"):
        load_config(None, ["rewards={reward_model: 1.0}"])
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model folder"):
        RewardModel(tmp_path)

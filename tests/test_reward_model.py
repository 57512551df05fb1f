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
from gspo.rewards.models import RewardModel
from gspo.rewards.resolve import resolve_rewards
from gspo.rewards.scoring import compute_rewards

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
    from gspo.rewards.models import RewardModelError

    with pytest.raises(RewardModelError, match=r"reward_model\.path: .* is not a Hugging Face model folder"):
        RewardModel(tmp_path)


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(folder, to)
    return to


def test_a_folder_without_a_classification_head_is_refused_saying_what_it_holds(
    folder: Path, tmp_path: Path
) -> None:
    """A causal LM's folder loaded as a sequence classifier gets a head initialised at random: random rewards
    and a run that exits 0, transformers' MISSING note the only hint. Refused, naming what was found."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gspo.rewards.models import RewardModelError

    causal = tmp_path / "causal"
    LlamaForCausalLM(LlamaConfig(**{**_tiny_config(folder), "architectures": None})).save_pretrained(causal)
    tiny_tokenizer().save_pretrained(causal)
    with pytest.raises(
        RewardModelError, match=r"holds LlamaForCausalLM, not a sequence-classification model"
    ):
        RewardModel(causal)
    # a classifier's config with weights that lack its head: the head's names said
    headless = _copy(folder, tmp_path / "headless")
    from safetensors.torch import load_file, save_file

    weights = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score")}, headless / "model.safetensors")
    with pytest.raises(
        RewardModelError, match=r"weights do not hold score\.weight, which would be initialised"
    ):
        RewardModel(headless)


def test_a_file_linked_out_of_the_folder_is_refused_by_name(folder: Path, tmp_path: Path) -> None:
    """A tokenizer_config.json linked to another file read it and failed with "Expecting value: line 1
    column 1"; a link out of the folder is refused before anything is read."""
    from gspo.rewards.models import RewardModelError

    linked = _copy(folder, tmp_path / "linked")
    (tmp_path / "elsewhere.txt").write_text("not a tokenizer config")
    (linked / "tokenizer_config.json").unlink()
    (linked / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(
        RewardModelError, match=r"tokenizer_config\.json is a link to .*elsewhere\.txt, outside"
    ):
        RewardModel(linked)


def test_a_reward_model_folder_error_is_exit_4_and_never_says_importing(
    folder: Path, tmp_path: Path, capsys
) -> None:
    from gspo.cli import EXIT_CODES, main

    empty = tmp_path / "empty"
    empty.mkdir()
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    argv = ["train", str(tiny), f"output_dir={tmp_path / 'run'}", "report_to=[]"]
    argv += ["rewards={reward_model: 1.0}", f"reward_model.path={empty}"]
    assert main(argv) == EXIT_CODES["input"]
    err = capsys.readouterr().err
    assert "is not a Hugging Face model folder (no config.json)" in err and "importing" not in err


def _tiny_config(folder: Path) -> dict:
    import json

    config = json.loads((folder / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return {key: config[key] for key in (*keys, "num_key_value_heads", "pad_token_id")}

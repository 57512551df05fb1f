"""Bring-your-own trajectories: exact assistant masks, per-turn advantages, sampler vs recompute, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.core.corrections import mismatch_metrics, sampler_log_ratios
from gspo.core.layout import TokenSequence
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch, make_batch
from gspo.learning.learner import learn, minibatches
from gspo.learning.policy import score
from gspo.models import tiny_tokenizer
from gspo.rollout.trajectories import (
    Trajectory,
    TrajectoryError,
    TrajectoryGroup,
    groups_from_rollouts,
    tokenize_trajectory,
    trajectory_samples,
)
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "call add(2, 3)"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Bye"},
]


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    config = load_config(
        TINY,
        [
            f"output_dir={tmp_path / 'run'}",
            "report_to=[]",
            "train.minibatches=2",
            *overrides,
        ],
    )
    return Trainer(config)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_assistant_mask_on_a_multi_turn_tool_conversation_is_exact() -> None:
    tokenizer = tiny_tokenizer()
    tok = tokenize_trajectory(tokenizer, Trajectory(TOOL_CONVERSATION, reward=1.0))
    eos = tokenizer.eos_token_id
    # the prompt: everything up to the first assistant header, as the trainer renders prompts
    prompt = tokenizer.apply_chat_template(TOOL_CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert tok.prompt_ids == _ids(tokenizer, prompt)
    # prompt + completion is the whole conversation, minus the glue after the last end-of-turn token
    full = _ids(tokenizer, tokenizer.apply_chat_template(TOOL_CONVERSATION, tokenize=False))
    assert tok.prompt_ids + tok.completion_ids == full[:-1]
    # trained tokens, turn by turn: exactly each assistant content followed by its end-of-turn token
    for k, content in enumerate(["call add(2, 3)", "It is 5.", "Bye"]):
        trained = [t for t, turn in zip(tok.completion_ids, tok.turn, strict=True) if turn == k]
        assert trained == [*_ids(tokenizer, content), eos]
    # and nothing else: the tool, user and header tokens are all context
    assert sum(t >= 0 for t in tok.turn) == sum(len(c) + 1 for c in ["call add(2, 3)", "It is 5.", "Bye"])
    context = "".join(
        tokenizer.decode([t]) for t, turn in zip(tok.completion_ids, tok.turn, strict=True) if turn < 0
    )
    assert (
        context
        == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )


def test_untrained_assistant_turn_is_context_and_the_prompt_starts_at_the_first_trained_turn() -> None:
    tokenizer = tiny_tokenizer()
    messages = [dict(m) for m in TOOL_CONVERSATION]
    messages[2]["train"] = False  # a scripted tool call
    tok = tokenize_trajectory(tokenizer, Trajectory(messages, reward=0.0))
    assert sorted({t for t in tok.turn if t >= 0}) == [1, 2]
    assert tokenizer.decode(tok.prompt_ids).endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


def test_per_turn_rewards_map_to_the_tokens_of_their_turn() -> None:
    tokenizer = tiny_tokenizer()
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]
    a = Trajectory(TOOL_CONVERSATION, reward=1.0, turn_rewards=[0.5, 0.0, 0.25])
    b = Trajectory(short, reward=0.0, turn_rewards=[-1.0])
    groups = [TrajectoryGroup([a, b])]
    tokenized = [[tokenize_trajectory(tokenizer, t) for t in groups[0].trajectories]]
    batch, metrics = make_batch(trajectory_samples(tokenizer, groups))
    advantages = batch.advantages
    # returns to go: a: [1.75, 1.25, 1.25], b: [-1.0]; baseline = mean total = 0.375
    returns = [1.75, 1.25, 1.25, -1.0]
    std = float(torch.tensor(returns, dtype=torch.float64).std(unbiased=False)) + 1e-6
    expected_a = [(r - 0.375) / std for r in returns[:3]]
    for k in range(3):
        values = [v for v, t in zip(advantages[0], tokenized[0][0].turn, strict=True) if t == k]
        assert values == pytest.approx([expected_a[k]] * len(values)) and values
    assert all(v == 0.0 for v, t in zip(advantages[0], tokenized[0][0].turn, strict=True) if t < 0)
    assert advantages[1] == [pytest.approx((-1.0 - 0.375) / std)] * 2  # "a" and its end-of-turn token
    assert metrics["zero_std_groups"] == 0.0


def test_single_rewards_give_the_group_advantages_of_gspo_train() -> None:
    tokenizer = tiny_tokenizer()
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    groups = [
        TrajectoryGroup([Trajectory(convo, r) for r in (1.0, 0.0, 0.0, 1.0)]),
        TrajectoryGroup([Trajectory(convo, 2.0)] * 2),
    ]
    batch, metrics = make_batch(trajectory_samples(tokenizer, groups))
    from gspo.core.advantages import group_advantages

    expected, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(batch.advantages[:4], expected)
    assert batch.advantages[4:].tolist() == [0.0, 0.0] and metrics["zero_std_groups"] == 1.0


def test_mismatch_metrics_by_hand() -> None:
    old = torch.tensor([-1.0, -2.0, -3.0, 0.0, -1.0, -0.5])
    sampler = torch.tensor([-1.1, -2.0, math.nan, 0.0, -1.0, -0.5 - 1e-4])
    segments = torch.tensor([0, 0, 0, -1, 1, 1])
    delta, seq, counts = sampler_log_ratios(old, sampler, segments, 2)
    torch.testing.assert_close(delta, torch.tensor([0.1, 0.0, 0.0, 1e-4]))
    torch.testing.assert_close(seq, torch.tensor([0.05, 0.5e-4]))
    assert counts.tolist() == [2.0, 2.0]
    metrics = mismatch_metrics(delta, seq)
    assert metrics["sampler_logprob_abs_diff"] == pytest.approx(0.100_1 / 4, rel=1e-5)
    assert metrics["sampler_seq_outside_clip_frac"] == 0.5  # exp(0.05) is clipped, exp(5e-5) is not
    assert metrics["sampler_token_outside_clip_frac"] == 0.0
    assert metrics["sampler_seq_log_ratio_max"] == pytest.approx(0.05)


def _groups(tokenizer) -> list[TrajectoryGroup]:
    def convo(answer: str, follow: str) -> list[dict]:
        return [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": answer},
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": follow},
        ]

    return [
        TrajectoryGroup([Trajectory(convo(a, f), r) for a, f, r in [("2", "yes", 1.0), ("3", "no", 0.0)]]),
        TrajectoryGroup([Trajectory(convo(a, f), r) for a, f, r in [("11", "hm", 0.0), ("2", "y", 1.0)]]),
    ]


def _sequence(tokens) -> TokenSequence:
    return TokenSequence(tokens.prompt_ids, tokens.completion_ids, [t >= 0 for t in tokens.turn])


def _with_logprobs(trainer: Trainer, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The groups with sampler log-probs equal, bit for bit, to what `learn` recomputes this step."""
    tokenized = [tokenize_trajectory(trainer.tokenizer, t) for g in groups for t in g.trajectories]
    sequences = [_sequence(t) for t in tokenized]
    values = [[math.nan] * len(s.completion_ids) for s in sequences]
    group_of = [g for g, group in enumerate(groups) for _ in group.trajectories]
    layout = minibatches(
        trainer.spec,
        sequences,
        seed=step_seed(trainer.config.seed, trainer.step),
        device=trainer.device,
        groups=group_of,
    )
    with torch.no_grad():
        for ids, micro, *_ in layout:  # the layout learn() scores in
            for mb in micro:
                flat = score(trainer.policy.scorer, mb, trainer.spec)[mb.logprob_mask.reshape(-1)].tolist()
                for i in mb.indices:
                    n = len(sequences[ids[i]].completion_ids)
                    values[ids[i]], flat = flat[:n], flat[n:]
    out, k = [], 0
    for g in groups:
        trajectories = []
        for t in g.trajectories:
            tok = tokenized[k]
            per_turn = [
                [v for v, turn in zip(values[k], tok.turn, strict=True) if turn == a] for a in range(2)
            ]
            trajectories.append(Trajectory(t.messages, t.reward, sampler_logprobs=per_turn))
            k += 1
        out.append(TrajectoryGroup(trajectories))
    return out


def test_sampler_and_recompute_give_identical_updates_when_the_logprobs_are_identical(tmp_path: Path) -> None:
    params, metrics = {}, {}
    for source in ("recompute", "sampler"):
        trainer = _trainer(tmp_path / source, f"train.old_logprobs={source}")
        groups = _with_logprobs(trainer, _groups(trainer.tokenizer))
        metrics[source] = trainer.train_on_groups(groups)
        params[source] = torch.cat([p.detach().reshape(-1) for p in trainer.policy.model.parameters()])
    assert metrics["recompute"]["sampler_logprob_abs_diff"] == 0.0  # the premise: identical log-probs
    assert metrics["recompute"]["sampler_seq_outside_clip_frac"] == 0.0
    assert metrics["sampler"]["sampler_logprob_missing_frac"] == 0.0
    assert torch.equal(params["recompute"], params["sampler"])
    for key in ("loss", "clip_frac_seq", "ratio_seq_max", "grad_norm"):
        assert metrics["recompute"][key] == metrics["sampler"][key], key


def test_train_on_groups_with_turn_rewards_updates_and_logs(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    before = torch.cat([p.detach().reshape(-1).clone() for p in trainer.policy.model.parameters()])
    groups = _groups(trainer.tokenizer)
    for g in groups:
        for t in g.trajectories:
            t.turn_rewards = [0.5 if t.reward else -0.5, 0.0]
    metrics = trainer.train_on_groups(groups)
    after = torch.cat([p.detach().reshape(-1) for p in trainer.policy.model.parameters()])
    assert not torch.equal(before, after)
    assert all(math.isfinite(float(v)) for v in metrics.values()), metrics
    assert trainer.step == 1 and metrics["num_trained"] == 4.0
    assert (trainer.run_dir / "metrics.jsonl").read_text().count("\n") == 1


def test_constant_per_token_advantages_train_like_per_sequence_ones(tmp_path: Path) -> None:
    params = {}
    for per_token in (False, True):
        trainer = _trainer(tmp_path / str(per_token), "train.minibatches=1")
        tokenized = [
            tokenize_trajectory(trainer.tokenizer, t)
            for g in _groups(trainer.tokenizer)
            for t in g.trajectories
        ]
        sequences = [_sequence(t) for t in tokenized]
        advantages = torch.tensor([1.0, -1.0, -0.5, 0.5])
        adv = (
            [[float(a)] * len(s.completion_ids) for a, s in zip(advantages, sequences, strict=True)]
            if per_token
            else advantages
        )
        batch = Batch(sequences, adv, [t.sampler_logprobs for t in tokenized], [0, 0, 1, 1])
        learn(trainer.policy, trainer.spec, batch, seed=0)  # gspo -> gspo_token when per token
        params[per_token] = torch.cat([p.detach().reshape(-1) for p in trainer.policy.model.parameters()])
    # exact by design: one on-policy update (old log-probs recomputed in its layout: every ratio exactly 1),
    # so both forms give each token the gradient -A w_t bit for bit (A = +-1, +-1/2 scale exactly); then
    # the same kernels, shapes and AdamW step
    torch.testing.assert_close(params[True], params[False], rtol=0, atol=0)


def test_truncated_is_correction_reports_its_weights(tmp_path: Path) -> None:
    trainer = _trainer(
        tmp_path,
        "train.sampler_correction=sequence_truncate",
        "train.sampler_correction_max=1.05",
        "train.minibatches=1",
    )
    groups = _with_logprobs(trainer, _groups(trainer.tokenizer))
    shift = [0.1, -0.1, 0.02, 0.0]  # sampler log-probs = trainer's - shift: log rho_i = shift_i
    for t, s in zip([t for g in groups for t in g.trajectories], shift, strict=True):
        t.sampler_logprobs = [[v - s for v in turn] for turn in t.sampler_logprobs]
    metrics = trainer.train_on_groups(groups)
    assert metrics["sampler_seq_log_ratio_max"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["sampler_seq_log_ratio_min"] == pytest.approx(-0.1, abs=1e-5)
    assert metrics["sampler_seq_outside_clip_frac"] == 0.75
    weights = [min(math.exp(s), 1.05) for s in shift]  # per sequence; the metric weighs each by its tokens
    lengths = [sum(len(turn) for turn in t.sampler_logprobs) for g in groups for t in g.trajectories]
    expected = sum(w * n for w, n in zip(weights, lengths, strict=True)) / sum(lengths)
    assert metrics["sampler_is_weight_mean"] == pytest.approx(expected, abs=1e-5)
    assert metrics["sampler_is_truncated_frac_seq"] == 0.25
    with pytest.raises(ConfigError, match=r"needs train\.old_logprobs=recompute"):
        _trainer(tmp_path / "bad", "train.sampler_correction=token_mask", "train.old_logprobs=sampler")


def test_misaligned_sampler_tokens_raise_a_clear_error() -> None:
    tokenizer = tiny_tokenizer()
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}]
    with pytest.raises(TrajectoryError, match=r"3 sampler log-probs for 4 generated tokens"):
        tokenize_trajectory(tokenizer, Trajectory(convo, 1.0, sampler_logprobs=[[-1.0, -1.0, -1.0]]))
    with pytest.raises(TrajectoryError, match=r"sampler_token_ids spell 'abd<\|im_end\|>'"):
        tokenize_trajectory(
            tokenizer, Trajectory(convo, 1.0, sampler_token_ids=[[*_ids(tokenizer, "abd"), 2]])
        )
    with pytest.raises(TrajectoryError, match="2 entries for 1 assistant messages"):
        tokenize_trajectory(
            tokenizer, Trajectory(convo, 1.0, turn_rewards=None, sampler_logprobs=[[0.0], [0.0]])
        )
    # the sampler's own tokens are what is trained, when they spell the turn's text
    ids = [*_ids(tokenizer, "abc"), 2]
    tok = tokenize_trajectory(
        tokenizer, Trajectory(convo, 1.0, sampler_token_ids=[ids], sampler_logprobs=[[-0.5] * 4])
    )
    assert tok.completion_ids == ids and tok.sampler_logprobs == [-0.5] * 4


def test_a_trajectory_without_assistant_tokens_is_a_clear_error(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    groups = _groups(trainer.tokenizer)
    groups[1].trajectories.append(Trajectory([{"role": "user", "content": "hello?"}], reward=0.0))
    with pytest.raises(
        TrajectoryError, match=r"group 1, trajectory 2: no assistant tokens to train.*\['user'\]"
    ):
        trainer.train_on_groups(groups)
    assert trainer.step == 0  # nothing was trained


def test_a_template_that_is_not_prefix_stable_is_refused() -> None:
    tokenizer = tiny_tokenizer()
    # like templates that drop earlier turns' reasoning: an assistant turn renders differently once followed
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TrajectoryError, match="not prefix-stable"):
        tokenize_trajectory(tokenizer, Trajectory(TOOL_CONVERSATION, reward=1.0))


def test_a_turn_that_starts_with_a_newline_keeps_its_own_tokens() -> None:
    """The engine was prompted with the header's tokens and generated "\n5": tokenised as one string, the
    header's newline and the turn's merged ("\n\n"), so the turn had no token boundary and was refused."""
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "What is 2+3?"}]
    header = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sampled = [*tokenizer("\n5", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    tokens = tokenize_trajectory(
        tokenizer,
        Trajectory([*messages, {"role": "assistant", "content": "\n5"}], 1.0, sampler_token_ids=[sampled]),
    )
    assert tokens.prompt_ids == tokenizer(header, add_special_tokens=False).input_ids
    assert tokens.completion_ids == sampled
    assert tokens.turn == [0] * len(sampled)


def test_groups_from_the_trainers_own_rollouts_keep_their_tokens(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    examples = trainer.rollouts.stream.next_batch()
    rollouts = trainer.sampler.generate(trainer.rollouts.prompts(examples), group_size=4, max_new_tokens=6)
    messages = [[{"role": "user", "content": ex.prompt}] for ex in examples]
    groups = groups_from_rollouts(
        trainer.tokenizer, messages, rollouts, [float(i % 2) for i in range(len(rollouts))]
    )
    tokenized = [tokenize_trajectory(trainer.tokenizer, t) for g in groups for t in g.trajectories]
    for i, tok in enumerate(tokenized):
        assert tok.prompt_ids == rollouts.prompt_ids[i]
        trained = [t for t, turn in zip(tok.completion_ids, tok.turn, strict=True) if turn >= 0]
        assert trained == rollouts.completion_ids[i]
        assert [
            v for v, turn in zip(tok.sampler_logprobs, tok.turn, strict=True) if turn >= 0
        ] == rollouts.sampler_logprobs[i]
    metrics = trainer.train_on_groups(groups)
    assert metrics["sampler_logprob_abs_diff"] < 1e-3  # the HF sampler and the trainer agree on fp32 CPU


def test_groups_of_one_and_turn_rewards_not_one_per_assistant_message_are_refused() -> None:
    tokenizer = tiny_tokenizer()
    groups = _groups(tokenizer)
    alone = TrajectoryGroup([groups[1].trajectories[0]])
    with pytest.raises(TrajectoryError, match=r"group 1 has 1 trajectory: .* at least 2"):
        trajectory_samples(tokenizer, [groups[0], alone])
    with pytest.raises(TrajectoryError, match=r"group 0 has 0 trajectories"):
        trajectory_samples(tokenizer, [TrajectoryGroup([]), groups[0]])
    # two assistant messages each: one turn reward each, neither zero-padded nor cut
    for wrong in ([1.0], [1.0, 0.0, 0.0]):
        groups[0].trajectories[1].turn_rewards = wrong
        with pytest.raises(
            TrajectoryError,
            match=rf"group 0, trajectory 1: turn_rewards has {len(wrong)} entries for 2 assistant messages",
        ):
            trajectory_samples(tokenizer, groups)
    groups[0].trajectories[1].turn_rewards = [1.0, 0.0]
    samples = trajectory_samples(tokenizer, groups)
    assert [s.turn_rewards for s in samples] == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_a_loop_over_train_on_groups_leaves_a_run_folder_like_gspo_train(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "checkpoint.every=2", "checkpoint.keep=5")
    for _ in range(3):
        trainer.train_on_groups(_groups(trainer.tokenizer))
    trainer.logger.log(trainer.step, {"accuracy": 0.5}, kind="eval")  # the agent's own evaluation
    result = trainer.finish()
    run = trainer.run_dir
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert steps == ["step_000002", "step_000003"]  # checkpoint.every=2, and the last step at the end
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "train"), (2, "train"), (3, "train"), (3, "eval")]
    assert (run / "plots" / "reward.png").is_file() and (run / "summary.md").is_file()
    assert result["eval_accuracy_last"] == 0.5 and result["run_dir"] == str(run)
    assert (run / ".gspo_lock").read_text() == ""  # released: another process may continue the run
    # and the run resumes where it stopped: step, optimizer and all
    resumed = Trainer(load_config(run / "config.yaml"), resume=run)
    assert resumed.step == 3
    resumed.logger.close()


def test_the_clients_old_names_still_work_and_say_their_new_ones() -> None:
    import gspo.client

    for old, new in (("Trajectory", "Episode"), ("TrajectoryGroup", "EpisodeGroup")):
        with pytest.warns(DeprecationWarning, match=f"gspo.client.{old} is now gspo.client.{new}"):
            assert getattr(gspo.client, old) is getattr(gspo.client, new)
    with pytest.raises(AttributeError, match="no attribute 'Trajectories'"):
        _ = gspo.client.Trajectories

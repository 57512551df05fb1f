"""Rewards, a stage of their own: the built-in reward functions, how gspo calls any reward function (by
batch or per completion, async ones concurrently on the run's event loop, each call with its deadline), a
reward model and an LLM judge as reward functions, and the names the config gives them (docs/rewards.md)."""

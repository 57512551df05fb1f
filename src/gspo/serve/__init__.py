"""`gspo serve`: the policy behind an OpenAI-compatible endpoint, sampled with exact tokens and trained on
trajectory groups of its own completions (docs/agents.md).

Modules: server (build and run), app (routes, key, errors), openai_api (chat and text completions),
chat (prompts with recorded tokens spliced in), generation (one request's samples), driver (the sampling
engine's thread), records (what was sampled), training and service (train calls on the live policy).
"""

"""The studies behind docs/paper_reproduction.md, docs/bakeoff.md and docs/minibatch_split.md, on one core.

- ``runs``: train a list of run configs (resumable, in parallel processes) and time them;
- ``moe_task``: the tiny Qwen3-MoE, the sums task and the shared cold start the MoE studies train from;
- ``summary``: a run folder's metrics as per-seed numbers, their mean, spread and noise;
- ``plots``: one line per method over rollouts, a band over seeds;
- ``report``: markdown reports from the templates in ``templates/``.

Each study (``paper``, ``family`` (the bake-off), ``split``) names its runs, its numbers, its verdicts and its template;
``scripts/reproduce_paper.py``, ``scripts/bakeoff.py`` and ``scripts/minibatch_split.py`` run them.
"""

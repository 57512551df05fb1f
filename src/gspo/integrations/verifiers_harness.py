"""The verifiers harness that gspo.integrations.verifiers runs environments with: a chat program in this
process whose model calls go through verifiers' interception endpoint to `gspo serve`, keeping each call's
completion id and exact token ids and log-probs on the trace.

A verifiers harness plugin is a module that exports one `Harness` subclass in `__all__`, loaded by its id.
verifiers looks an id up as `verifiers.v1.harnesses.<id>` first, which a dotted id (this module's name)
breaks, so importing this module also registers it as `gspo_harness` (HARNESS_ID).
"""

from __future__ import annotations

import sys
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

from gspo.client import completion_id

__all__ = ["GspoHarness", "GspoHarnessConfig"]

HARNESS_ID = "gspo_harness"
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
CALLS = "gspo"
"""The `trace.info` key of the model calls the harness made (completion id, token ids, log-probs)."""


class GspoHarnessConfig(vf.HarnessConfig):
    """No settings of its own: sampling is the run's `ModelContext.sampling`, limits are the agent's."""


class GspoHarness(vf.Harness[GspoHarnessConfig]):
    """One model call per segment, through the interception endpoint (the interception is verifiers'
    contract, not the process: `Harness.launch` allows a loop in-process). `SUPPORTS_RESUME`: a multi-turn
    env (`agent.interaction(task)`) relaunches it on the conversation so far, turn by turn."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        choice = reply.choices[0]
        extra = choice.model_extra or {}
        trace.info.setdefault(CALLS, []).append(
            {
                "completion_id": completion_id(choice),  # a ValueError if the endpoint is not gspo serve
                "prompt_token_ids": (reply.model_extra or {}).get("prompt_token_ids"),
                "token_ids": extra.get("token_ids"),
                "token_logprobs": extra.get("token_logprobs"),
            }
        )
        return ProgramResult(exit_code=0, stdout=choice.message.content or "", stderr="")

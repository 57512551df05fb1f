"""rollout.vllm.weight_sync=nccl: the trainer's weights broadcast from its GPU to the workers of a vLLM server
on other GPUs (rollout.vllm.url), through vLLM's own weight-transfer API (vllm.distributed.weight_transfer,
vLLM 0.32): its trainer-side NCCL engine drives the server's dev-mode routes (/init_weight_transfer_engine
once; /start_weight_update, /update_weights alongside the broadcast, /finish_weight_update at each sync),
and the workers load what they receive through the model's layer-wise reload. Written for GPUs: it needs
CUDA on both sides and has not run here (docs/gpu.md says what is checked).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from gspo.rollout.openai import ServerError
from gspo.rollout.vllm_engine import policy_weights
from gspo.rollout.vllm_server import ExternalVLLMServer


class PolicySource(WeightSource):
    """The policy's weights as vLLM's trainer engine reads them: the names, dtypes and shapes first, then the
    tensors in the same order (`policy_weights`: Hugging Face names, LoRA merged)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in policy_weights(self.model)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in policy_weights(self.model):
            yield name, tensor.detach()


class NCCLBroadcast:
    """The weight sync of weight_sync=nccl. At construction the trainer (rank 0) and the server's workers
    (ranks 1..N, N from its /get_world_size) join one NCCL group, rendezvousing at `address` (this machine,
    as the workers reach it) on a free port; each call then broadcasts the policy and empties the server's
    prefix cache. Any failure is a ServerError (the NCCL group is then unusable: the run stops)."""

    def __init__(self, server: ExternalVLLMServer, model: PreTrainedModel, address: str) -> None:
        self.server = server
        workers = server.get("/get_world_size")["world_size"]
        with socket.socket() as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        rendezvous = NCCLTrainerInitInfo(
            master_address=address, master_port=port, world_size=1 + workers, rank=0
        )
        client = HTTPVLLMWeightSyncClient(server.root, timeout=server.timeout)
        self.source = PolicySource(model)
        try:
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
                rendezvous, client=client, source=self.source
            )
        except Exception as error:  # NCCL, the rendezvous, or an HTTP error: one line, not a traceback
            raise ServerError(
                f"NCCL weight transfer with the vLLM server at {server.url} did not start (rollout.vllm.nccl_address"
                f"={address}, port {port}, {1 + workers} ranks): {error}"
            ) from error

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        self.source.model = model
        try:
            self.engine.send_weights()
        except Exception as error:
            raise ServerError(f"the NCCL weight sync to {self.server.url} failed: {error}") from error
        self.server.reset_prefix_cache()

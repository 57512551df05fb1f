"""Ask a GGUF file one question through llama.cpp (llama-cpp-python), as Ollama or LM Studio would run it:
with the file's own tokenizer and chat template, greedy.

    python examples/lora_gguf/ask_llama_cpp.py FILE.gguf "What is 3 + 4? Answer with just the number."
"""

from __future__ import annotations

import sys

from llama_cpp import Llama


def main(path: str, question: str) -> None:
    llm = Llama(path, n_ctx=512, n_threads=1, verbose=False)
    try:
        reply = llm.create_chat_completion(
            [{"role": "user", "content": question}], max_tokens=8, temperature=0.0
        )
        print(f"llama.cpp: {question!r} -> {reply['choices'][0]['message']['content']!r}")
    finally:
        llm.close()  # before the interpreter's shutdown, which llama-cpp-python's destructor trips over


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

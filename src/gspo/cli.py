"""Command line: `gspo train [CONFIG] [key=value ...] [--resume RUN_DIR]`, `gspo plot RUN_DIR`, `gspo config`."""

from __future__ import annotations

import argparse
import os
import sys

from gspo.config import ConfigError


def _train(args: argparse.Namespace) -> int:
    from gspo.rollout.rewards import RewardError
    from gspo.training.trainer import train

    # `gspo train key=value` without a config file: the first argument is an override, not a path
    config = args.config
    overrides = list(args.overrides)
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    if args.resume and config is not None:
        print(
            "error: --resume reads RUN_DIR/config.yaml; pass only key=value overrides with it",
            file=sys.stderr,
        )
        return 2
    try:
        result = train(config, overrides=overrides, resume=args.resume)
    except (ConfigError, FileNotFoundError, FileExistsError, ImportError, RewardError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    first, last = result["eval_accuracy_first"], result["eval_accuracy_last"]
    if first is not None:
        print(f"held-out accuracy: {first:.3f} -> {last:.3f}")
    print(f"run folder: {result['run_dir']}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from gspo.training.plots import plot_run, write_summary

    for path in plot_run(args.run_dir):
        print(path)
    print(write_summary(args.run_dir))
    return 0


def _config(args: argparse.Namespace) -> int:
    from gspo.config import describe

    print(describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gspo", description="GSPO / GSPO-token / GRPO fine-tuning of language models."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train (defaults: SmolLM2-135M-Instruct on arithmetic)")
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-5")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.set_defaults(func=_train)

    plot = commands.add_parser("plot", help="redraw a run's plots and summary")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)

    config = commands.add_parser("config", help="list every config key with its default and meaning")
    config.set_defaults(func=_config)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

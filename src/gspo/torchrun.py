"""`python -m gspo.torchrun ARGS`: torchrun (the same ARGS), ending as gspo's ranks end.

When a rank fails, torchrun prints its own traceback (`ChildFailedError`) and exits 1, whatever the rank
exited with. gspo's ranks stop together with one exit code (gspo.cli.EXIT_CODES: 3 a config error, 5 the
run folder, ...) and rank 0 prints the error's one line: this launcher exits with that code and adds no
traceback. A rank killed by a signal gives 128 + the signal's number, as a shell does.
"""

from __future__ import annotations

import logging
import sys


def exit_code(codes: list[int]) -> int:
    """The launcher's code for its ranks' codes: theirs when they agree (ranks that stop together do; a
    signal's as 128 + its number), else the lowest one that is not 0."""
    shell = sorted({128 - code if code < 0 else code for code in codes if code != 0})
    return shell[0] if shell else 0


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's own report of a failed rank ("failed (exitcode: 5) local_rank: 0 ...") says nothing the
    # rank's one line does not
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv if argv is not None else sys.argv[1:]))
    except ChildFailedError as error:
        return exit_code([failure.exitcode for failure in error.failures.values()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

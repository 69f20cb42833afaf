"""The ``sbpflow`` command line: ``sbpflow COMMAND [ARGS...]``.

Commands:

``launch``
    Launch a multi-rank job (torchrun with sbpflow defaults), see
    :mod:`sbpflow.distributed.launch`; e.g. ``sbpflow launch --nproc-per-node 4 train.py``.
``plan``, ``calibrate``
    Predict and search GPT layouts on a hardware profile (:mod:`sbpflow.planner.cli`);
    measure this machine's profile (:mod:`sbpflow.planner.calibrate`).
``train``, ``bench``
    The applications of :mod:`sbpflow.apps` (:mod:`sbpflow.apps.train`,
    :mod:`sbpflow.apps.bench` and its ``dlrm`` and ``partial-fc`` sweeps); they need the
    ``apps`` extra (``pip install 'sbpflow[apps]'``) and say so in one line without it.

Everything after the command name belongs to the command and is handed to it untouched
(``sbpflow launch --help`` shows the launcher's help). To add a command, append a
:class:`Command` to ``COMMANDS``: its handler takes the remaining arguments and the
program name and returns an exit code; import heavy modules inside the handler so that
``sbpflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    """One ``sbpflow`` subcommand.

    Attributes:
        name: the word after ``sbpflow``.
        help: one line shown by ``sbpflow --help``.
        run: ``run(argv, prog) -> exit code``; ``argv`` is everything after the command
            name, ``prog`` is e.g. ``"sbpflow launch"`` for usage messages.
    """

    name: str
    help: str
    run: Callable[[list[str], str], int]


def _launch(argv: list[str], prog: str) -> int:
    from sbpflow.distributed import launch

    return launch.main(argv, prog=prog)


def _train(argv: list[str], prog: str) -> int:
    from sbpflow.apps import train

    return train.main(argv, prog=prog)


def _plan(argv: list[str], prog: str) -> int:
    from sbpflow.planner import cli

    return cli.main(argv, prog=prog)


def _calibrate(argv: list[str], prog: str) -> int:
    from sbpflow.planner import calibrate

    return calibrate.main(argv, prog=prog)


def _bench(argv: list[str], prog: str) -> int:
    if argv[:1] == ["partial-fc"]:  # the class-split head, not a model: its own runners
        from sbpflow.apps.bench import partial_fc

        return partial_fc.main(argv[1:], prog=f"{prog} partial-fc")
    if argv[:1] == ["dlrm"]:  # the embedding-table sweep
        from sbpflow.apps.bench import dlrm

        return dlrm.main(argv[1:], prog=f"{prog} dlrm")
    from sbpflow.apps import bench

    return bench.main(argv, prog=prog)


COMMANDS: tuple[Command, ...] = (
    Command(
        "launch",
        "launch N ranks of a script on this node / across nodes (torchrun with sbpflow "
        "defaults); see `sbpflow launch --help`",
        _launch,
    ),
    Command("train", "train a model from sbpflow.models on real data (launches its ranks); "
            "see `sbpflow train --help`", _train),
    Command("bench", "benchmark a model against plain PyTorch (DDP) in the same run; see "
            "`sbpflow bench --help` (and `sbpflow bench dlrm --help`: embedding tables)",
            _bench),
    Command("plan", "predict a GPT training step on a hardware profile and search its "
            "layout (at scale); see `sbpflow plan --help`", _plan),
    Command("calibrate", "measure this machine's matmul rate, memory bandwidth and "
            "all-reduce latency/bandwidth as a hardware profile (cached); see `sbpflow "
            "calibrate --help`", _calibrate),
)


def build_parser(prog: str = "sbpflow") -> argparse.ArgumentParser:
    """The top-level parser: lists the commands in ``--help`` and rejects unknown ones.

    Args:
        prog: program name for usage messages.

    Returns:
        A parser whose namespace has ``command`` (the :class:`Command` chosen). It is only
        given the command name; the command parses its own arguments.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description="sbpflow: distributed-first deep learning (global tensors, SBP, boxing).",
        epilog="Run `%(prog)s COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, add_help=False)
        p.set_defaults(command=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sbpflow COMMAND [ARGS...]``; return the exit code.

    Args:
        argv: the command line without the program name (default ``sys.argv[1:]``).

    Returns:
        The command's exit code (for ``launch``: the job's exit code, 0 on success).

    Raises:
        SystemExit: for ``--help`` (code 0), and for a missing or unknown command (code 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # argparse sees only the command name: whatever follows belongs to the command
    # (argparse's REMAINDER would not keep leading options such as `--nproc-per-node`).
    ns = parser.parse_args(argv[:1])
    cmd: Command = ns.command
    return cmd.run(argv[1:], f"{parser.prog} {cmd.name}")


if __name__ == "__main__":
    sys.exit(main())

"""Launch a multi-rank sbpflow job: a thin wrapper around ``torchrun`` (torch.distributed.run).

Every torchrun option is accepted unchanged and handed to torchrun's own parser and
launcher; worker restarts (``--max-restarts``), monitoring and logging are torchrun's.
sbpflow adds the number of torch threads each rank uses, where the rendezvous listens,
and that ranks do not outlive their launcher.

* By default, when more than one rank runs on a node (``--nproc-per-node`` > 1, including
  ``auto``/``cpu`` resolving to more than one), every rank gets ONE torch thread
  (``OMP_NUM_THREADS=1`` in the ranks' environment), so that N ranks sharing one CPU
  machine do not oversubscribe its cores. An ``OMP_NUM_THREADS`` already set in the
  environment is left alone. Because the launcher sets the variable itself, torchrun's
  "Setting OMP_NUM_THREADS ... to be 1 in default" warning is not printed.
* ``--threads-per-rank N`` sets ``OMP_NUM_THREADS=N`` for every rank, overriding both the
  default and an inherited ``OMP_NUM_THREADS``.

**Where the job listens.** torch's rendezvous store (a ``TCPStore``: no authentication,
anyone who reaches its port can read and write the job's keys) listens on every interface
by default. Here (:mod:`sbpflow.distributed._rendezvous`, torch's own rendezvous handlers
with their store sockets bound to one address):

* one node (``--standalone``, or no ``--rdzv-endpoint``/``--master-port`` with
  ``--nnodes 1``): the rendezvous store and the ranks' store listen on 127.0.0.1 only,
  and the ranks get ``GLOO_SOCKET_IFNAME=lo`` (unless set), so gloo's connections between
  ranks listen on 127.0.0.1 too. Nothing of the job listens on another address.
* ``--master-addr A --master-port P`` (static rendezvous): node 0's store listens on
  ``A:P`` only (A must be an address of node 0). The ranks' gloo sockets listen on the
  interface ``GLOO_SOCKET_IFNAME`` names, else on the address the host name resolves to.
* ``--rdzv-backend c10d --rdzv-endpoint H:P``: the rendezvous store listens on ``H:P``
  only (on the node that is H); the ranks' store on ``--local-addr`` when given, else on
  every interface (torch's default); gloo as above.

Multi-node jobs are exposed to whoever reaches those ports (store and gloo, no
authentication): run them on a private network, or restrict the ports with a firewall,
and name the private interface (``GLOO_SOCKET_IFNAME=eth1``, ``--local-addr``).

**Supervision.** Each rank polls its parent (:mod:`sbpflow.distributed._watchdog`): when
the launcher dies, even by SIGKILL, which torchrun cannot handle, every rank prints one
line and exits within about half a second of having initialised
:mod:`sbpflow.distributed` (a rank still importing notices once it gets there). The
launcher tells its ranks its pid and start time (``SBPFLOW_LAUNCHER_PID=PID:START``); a
rank trusts the variable only where it was set for it (a stale one, inherited by a plain
``torchrun``, is ignored with a warning). SIGINT and SIGTERM (and SIGHUP, SIGQUIT) to the
launcher are forwarded to the ranks by torchrun's agent, which waits for them up to its
shutdown timeout (30 s, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before SIGKILL; the exit code
is then ``128 + signal`` (``sbpflow train``'s ranks save a checkpoint first). A bad
``SBPFLOW_TIMEOUT`` is refused (exit 2) before any rank starts.

The exit code is the job's: 0 when every rank exits 0, otherwise the exit code of the
first rank that failed (``128 + signal`` for a rank killed by a signal; torchrun itself
always exits 1). sbpflow's own commands (``main(..., reported=True)``: ``sbpflow bench``,
``sbpflow plan``) have a rank that reported its error in one line itself (a plan that does
not fit the memory limit) exit with :data:`REPORTED_EXIT`; when that is the first failure
the launcher adds no failure report of its own and exits 1. A script's exit codes are
its own.

Commands (``sbpflow launch ...`` and ``python -m sbpflow.distributed.launch ...`` are the
same thing; ``train.py --lr 0.1`` stands for your script and its arguments).

One node, 4 ranks (torchrun picks a free port itself, so concurrent jobs do not clash)::

    sbpflow launch --nproc-per-node 4 train.py --lr 0.1

One node, explicitly standalone (same as above, a local c10d rendezvous on a free port)::

    sbpflow launch --standalone --nproc-per-node 4 train.py --lr 0.1

Run a module instead of a script::

    sbpflow launch --nproc-per-node 4 -m mypackage.train --lr 0.1

Two nodes of 4 ranks each, static rendezvous (node 0's address is 10.0.0.1; ranks 0-3 run
on node 0 and 4-7 on node 1). On node 0::

    sbpflow launch --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py --lr 0.1

and on node 1::

    sbpflow launch --nnodes 2 --node-rank 1 --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py --lr 0.1

Two nodes with the c10d rendezvous (the same command on both nodes; which node gets
global ranks 0-3 is decided at rendezvous, ``--node-rank`` is ignored)::

    sbpflow launch --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint 10.0.0.1:29400 --rdzv-id myjob train.py --lr 0.1

Inside the script, :mod:`sbpflow.distributed` reads the rank and world from the variables
torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from .._argtypes import positive_int as _positive_int
from . import _rendezvous, _state, _watchdog

__all__ = ["REPORTED_EXIT", "main"]

REPORTED_EXIT = 3  # sbpflow's commands' ranks: the error is already reported, one line

_DEFAULT_PROG = "python -m sbpflow.distributed.launch"

_DESCRIPTION = """\
Launch N ranks of a script on this node (and join the other nodes of the job).

This is torchrun (torch.distributed.run) with sbpflow defaults: every torchrun option
below is passed through unchanged. sbpflow adds --threads-per-rank; by default each rank
gets one torch thread (OMP_NUM_THREADS=1) when more than one rank runs on a node, unless
OMP_NUM_THREADS is already set. The exit code is the failing rank's exit code (0 when
every rank succeeds).

Network: on one node (--standalone or the default) the rendezvous stores and gloo listen
on 127.0.0.1 only. With --master-addr A the store listens on A only; with --rdzv-endpoint
H:P on H only (the ranks' store on --local-addr, if given); gloo on GLOO_SOCKET_IFNAME's
interface. These ports have no authentication: keep multi-node jobs on a private network.
Ranks exit within about a second when this launcher dies, even by SIGKILL.

examples:
  %(prog)s --nproc-per-node 4 train.py --lr 0.1
  %(prog)s --standalone --nproc-per-node 4 train.py
  %(prog)s --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py      (node 0; node 1: --node-rank 1)
  %(prog)s --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint 10.0.0.1:29400 --rdzv-id myjob train.py  (same command on every node)
"""


def get_args_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """torchrun's argument parser plus sbpflow's ``--threads-per-rank`` option.

    Args:
        prog: program name shown in usage and help (default
            ``python -m sbpflow.distributed.launch``).

    Returns:
        The parser; its namespace is what ``torch.distributed.run.run`` takes, with one
        extra attribute, ``threads_per_rank`` (``None`` when not given).
    """
    parser = torchrun.get_args_parser()
    parser.prog = prog or _DEFAULT_PROG
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    group = parser.add_argument_group("sbpflow options")
    group.add_argument(
        "--threads-per-rank",
        "--threads_per_rank",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch threads per rank: sets OMP_NUM_THREADS=N for every rank, overriding an "
        "inherited OMP_NUM_THREADS. Default: 1 when --nproc-per-node resolves to more than "
        "one rank per node (unless OMP_NUM_THREADS is set), else torch's own default.",
    )
    return parser


def _threads_per_rank(threads_flag: int | None, local_world_size: int,
                      environ: Mapping[str, str] | None = None) -> int | None:
    """The ``OMP_NUM_THREADS`` to give the ranks, or ``None`` to leave the environment alone."""
    environ = os.environ if environ is None else environ
    if threads_flag is not None:
        return threads_flag
    if local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        return 1
    return None


def _rank_environment(args, local_world_size: int) -> dict[str, str]:
    """Variables the launcher adds to its ranks' environment (see the module doc)."""
    env = {_watchdog.LAUNCHER_PID_ENV: _watchdog.launcher_value()}
    threads = _threads_per_rank(args.threads_per_rank, local_world_size)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _script_problem(args) -> str | None:
    """What keeps the ranks from starting the script (checked before any launch): a
    script path that is not a file, or a module that cannot be found. None when fine (or
    with ``--no-python``: the command is the user's)."""
    target = args.training_script
    if getattr(args, "no_python", False):
        return None
    if getattr(args, "module", False):
        import importlib.util

        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else (f"-m {target}: no module named {target!r} (check the "
                                   f"name and that its package is importable here)")
    if not os.path.isfile(target):
        where = os.path.abspath(target)
        return (f"{target}: no such file ({where}); give the path of the training script "
                f"(or -m module.name for a module)")
    return None


class _ReportedExitFilter(logging.Filter):
    """Drops torchrun's log lines about a rank that exited with :data:`REPORTED_EXIT` (it
    has said why in one line already) and about stopping the other ranks (logged before
    or after it; the failure report of any other exit is printed in full)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return f"(exitcode: {REPORTED_EXIT})" not in text and "closing signal" not in text


def _exit_code(err: ChildFailedError) -> int:
    """The exit code of the job: the first failed rank's (128 + signal when killed)."""
    _, failure = err.get_first_failure()
    code = failure.exitcode
    if code < 0:
        return 128 + (-code)
    if 0 < code < 256:
        return code
    return 1


def main(argv: Sequence[str] | None = None, *, prog: str | None = None,
         env: Mapping[str, str] | None = None,
         after_signal: Callable[[], str] | None = None, reported: bool = False) -> int:
    """Launch a job with torchrun; return its exit code.

    Args:
        argv: the launcher's command line without the program name: torchrun options,
            optionally ``--threads-per-rank N``, then the script (or ``-m module``) and its
            arguments. Default ``sys.argv[1:]``.
        prog: program name for usage and help messages.
        env: more variables for the ranks' environment (``sbpflow train`` passes the
            output folder it holds the lock of).
        after_signal: when a signal stops the job, called after the ranks exited; its
            text ends the launcher's one-line report (``sbpflow train``: the command
            that continues the run).
        reported: a rank exiting with :data:`REPORTED_EXIT` has said why itself (sbpflow's
            own commands): no failure report is added, the job exits 1.

    Returns:
        0 when every rank exited 0; otherwise the exit code of the first rank that failed
        (``128 + signal number`` when it was killed by a signal), or ``128 + signal``
        when the launcher itself was terminated by a signal.

    Raises:
        SystemExit: for ``--help`` (code 0) and for bad options, a bad
            ``SBPFLOW_TIMEOUT`` or a script that does not exist (code 2, before any rank
            starts).
        Exception: what torchrun raises when the job cannot start (e.g. a rendezvous
            timeout); it propagates unchanged.
    """
    parser = get_args_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        local_world_size = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: {e}")
    if local_world_size < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: need at least 1 rank per node")

    try:  # one message here rather than a traceback from every rank
        _state._env_timeout("SBPFLOW_TIMEOUT", _state.DEFAULT_TIMEOUT_S)
    except ValueError as e:
        parser.error(str(e))
    problem = _script_problem(args)
    if problem:  # one line here, not torchrun's failure report from every rank
        print(f"{parser.prog}: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    env = {**_rank_environment(args, local_world_size), **(env or {})}
    single_node = _rendezvous.is_single_node(args)
    _rendezvous.configure(args)
    if single_node and "GLOO_SOCKET_IFNAME" not in os.environ:
        lo = _rendezvous.loopback_interface()
        if lo is not None:
            env["GLOO_SOCKET_IFNAME"] = lo  # gloo's pair sockets on loopback too
    # torchrun hands its own environment to the ranks (having OMP_NUM_THREADS set also
    # stops it from printing its "Setting OMP_NUM_THREADS" warning); restored after.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    quiet = _ReportedExitFilter()
    elastic = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if reported:
        elastic.addFilter(quiet)
    try:
        record(torchrun.run)(args)
    except ChildFailedError as e:
        if reported and _exit_code(e) == REPORTED_EXIT:
            return 1
        print(str(e), file=sys.stderr, flush=True)
        return _exit_code(e)
    except SignalException as e:
        signum = int(e.sigval)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        tail = after_signal() if after_signal is not None else ""
        print(f"{parser.prog}: stopped by {name} (forwarded to the ranks, which have "
              f"exited){tail}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        elastic.removeFilter(quiet)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun rendezvous whose stores listen only where the launch flags say.

torch's ``TCPStore`` server listens on every interface (``*:PORT``) whatever host it is
given, and has no authentication: anyone who reaches the port can read and write the
job's keys. ``sbpflow launch`` (hence ``sbpflow train``) therefore registers three
rendezvous handlers with torchrun's registry and picks one from the flags
(:func:`configure`). They are torch's own handlers (``DynamicRendezvousHandler`` over
``C10dRendezvousBackend``, or ``StaticTCPRendezvous``) with one change: each store server
is made from a socket bound to one address (``TCPStore(..., master_listen_fd=...)``).

================== ========================================= ==========================
flags              handler (``--rdzv-backend`` torchrun sees) the stores listen on
================== ========================================= ==========================
one node:          :data:`LOCAL`: c10d rendezvous on a free  127.0.0.1 only (the
``--standalone``,  port; the ranks' store too (``MASTER_ADDR`` rendezvous store and the
or no endpoint     = 127.0.0.1, unless ``--local-addr``)     ranks' store)
and no port
``--master-addr A`` :data:`STATIC`: torch's static rendezvous A (node 0 hosts it; A
``--master-port P`` (``--node-rank`` passed as ``rank=``)     must be an address of
                                                             node 0)
``--rdzv-backend`` :data:`C10D`: torch's c10d rendezvous      the endpoint's address on
``c10d``                                                     the node that hosts it; the
``--rdzv-endpoint``                                          ranks' store on
``H:P``                                                      ``--local-addr`` when
                                                             given, else every interface
================== ========================================= ==========================

Other backends (etcd...) pass through unchanged. Gloo's own connections between ranks
listen on the address of the interface ``GLOO_SOCKET_IFNAME`` names (else the one the
host name resolves to); for one node the launcher sets ``GLOO_SOCKET_IFNAME`` to the
loopback interface unless the user set it (:func:`loopback_interface`).
"""

from __future__ import annotations

import datetime
import socket
import uuid

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    DEFAULT_PORT as C10D_DEFAULT_PORT,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

#: One node: every store on 127.0.0.1.
LOCAL = "sbpflow-local"
#: ``--master-addr/--master-port``: torch's static rendezvous, its store on master-addr.
STATIC = "sbpflow-static"
#: ``--rdzv-backend c10d``: torch's c10d rendezvous, its store on the endpoint's host.
C10D = "sbpflow-c10d"
LOOPBACK = "127.0.0.1"
#: torchrun's default ``--master-port`` for the static rendezvous.
STATIC_DEFAULT_PORT = 29500


def listen_store(host: str, port: int, timeout_s: float = 300.0) -> TCPStore:
    """A ``TCPStore`` server (multi-tenant, as torchrun's) listening on ``host:port`` only.

    Args:
        host: an address (or name) of this machine; the socket is bound to its first
            address (IPv4 or IPv6).
        port: the port; 0 picks a free one (``store.port`` tells which).
        timeout_s: the store's timeout for its own operations, seconds.

    Raises:
        OSError: ``host`` is not an address of this machine (``EADDRNOTAVAIL``) or the
            port is taken (``EADDRINUSE``), with the address in the message.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host} ({addr[0]}) port {port} for the "
                      f"rendezvous store: {e.strerror}") from None
    bound_port = sock.getsockname()[1]
    # The store takes the descriptor over (and closes it when destroyed).
    return TCPStore(host, bound_port, is_master=True, multi_tenant=True,
                    master_listen_fd=sock.detach(),
                    timeout=datetime.timedelta(seconds=timeout_s))


def _read_timeout(params: RendezvousParameters) -> int:
    value = params.get_as_int("read_timeout", 60)
    if value is None or value <= 0:
        raise ValueError(f"--rdzv-conf read_timeout={value}: must be a positive number of "
                         f"seconds")
    return value


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous state in a store, under the name torchrun was given."""

    def __init__(self, store, run_id: str, name: str) -> None:
        super().__init__(store, run_id)
        self._name = name

    @property
    def name(self) -> str:
        return self._name


def _dynamic_handler(store, params: RendezvousParameters, workers_host: str | None):
    """torch's c10d rendezvous over ``store``; the ranks' store (which torch makes on this
    node's address, every interface) listens on ``workers_host`` when given."""
    backend = _Backend(store, params.run_id, params.backend)
    handler = create_handler(store, backend, params)
    if workers_host is not None:
        # torch's hook that makes the ranks' store server (DynamicRendezvousHandler)
        handler._create_tcp_store_server = (
            lambda addr, port: listen_store(workers_host, port))
    torch_next_rendezvous = handler.next_rendezvous

    def next_rendezvous():
        # A new ranks' store for every round (every restart). torch keeps the first one,
        # whose keys (gloo's addresses of the killed attempt's ranks, under the same
        # names) a restarted rank can read before its peers overwrite them: "Gloo
        # connectFullMesh failed ... Connect timeout" (pytorch/pytorch#135712). Each
        # round's address and port travel in that round's own keys, so all nodes agree.
        if hasattr(handler, "_shared_tcp_store_server"):
            handler._shared_tcp_store_server = None
            handler._bootstrap_store_info = None
        return torch_next_rendezvous()

    handler.next_rendezvous = next_rendezvous
    return handler


def _create_local(params: RendezvousParameters):
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = listen_store(host, port, _read_timeout(params))
    return _dynamic_handler(store, params, params.local_addr or host)


def _create_c10d(params: RendezvousParameters):
    # torch's _create_tcp_store, with the server bound to the endpoint's address
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_DEFAULT_PORT)
    timeout = _read_timeout(params)
    cfg_is_host = params.get_as_bool("is_host")
    is_host = _matches_machine_hostname(host) if cfg_is_host is None else cfg_is_host
    store = None
    if is_host:
        try:
            store = listen_store(host, port, timeout)
        except OSError:
            if cfg_is_host:
                raise
            # another agent on this machine hosts it already (torch does the same)
    if store is None:
        store = TCPStore(host, port, is_master=False, multi_tenant=True,
                         timeout=datetime.timedelta(seconds=timeout))
    return _dynamic_handler(store, params, params.local_addr)


class _StaticHandler(StaticTCPRendezvous):
    """torch's static rendezvous; node 0's store listens on ``master_addr`` only."""

    def get_backend(self) -> str:
        return STATIC

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._store:
            if self.rank == 0:
                try:
                    self._store = listen_store(self.master_addr, self.master_port,
                                               self.timeout.total_seconds())
                except OSError as e:
                    raise RuntimeError(
                        f"--node-rank 0 hosts the rendezvous store on --master-addr "
                        f"{self.master_addr} --master-port {self.master_port}: {e}. Give an "
                        f"address of this machine that the other nodes reach, and a free "
                        f"port") from None
            else:
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size,
                                       False, self.timeout, multi_tenant=True)
        store = PrefixStore(self.run_id, self._store)
        info = RendezvousStoreInfo(self.master_addr, self.master_port)
        return RendezvousInfo(store, self.rank, self.world_size, info)


def _create_static(params: RendezvousParameters):
    master_addr, master_port = parse_rendezvous_endpoint(params.endpoint, -1)
    if master_port == -1:
        raise ValueError(f"no port in the rendezvous endpoint {params.endpoint!r}; give "
                         f"--master-port")
    rank = params.get_as_int("rank", 0)
    timeout = params.get_as_int("timeout", 600)
    return _StaticHandler(master_addr, master_port, rank, params.max_nodes, params.run_id,
                          timeout)


def register() -> None:
    """Register the three handlers with torchrun's registry (idempotent)."""
    for name, creator in ((LOCAL, _create_local), (STATIC, _create_static),
                          (C10D, _create_c10d)):
        rendezvous_handler_registry.register(name, creator)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or
    ``None`` when neither exists."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def is_single_node(args) -> bool:
    """Whether torchrun would run ``args`` (its namespace) as one node with a local
    rendezvous: ``--standalone``, or one node with no endpoint and no master port."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        return True
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    return (max_nodes == 1 and args.rdzv_backend == "static" and not args.rdzv_endpoint
            and args.master_port is None)


def configure(args) -> str:
    """Point torchrun's parsed ``args`` at sbpflow's handlers (see the module table);
    returns the backend name now in ``args.rdzv_backend``.

    One node: ``--standalone`` and the default become :data:`LOCAL` on ``127.0.0.1:0``
    with ``--local-addr 127.0.0.1`` (unless given). Static: the endpoint becomes
    ``master_addr:master_port`` (port 29500 by default, as torchrun's) and ``--node-rank``
    travels as the rendezvous's ``rank`` option. c10d: :data:`C10D`.
    """
    register()
    if is_single_node(args):
        args.standalone = False
        args.rdzv_backend = LOCAL
        args.rdzv_endpoint = f"{LOOPBACK}:0"
        args.rdzv_id = str(uuid.uuid4())
        args.local_addr = args.local_addr or LOOPBACK
    elif args.rdzv_backend == "static":
        port = STATIC_DEFAULT_PORT if args.master_port is None else args.master_port
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = f"{args.master_addr}:{port}"
        conf = f"rank={args.node_rank}"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
        args.node_rank = 0  # now in rdzv_conf; torchrun warns about it for other backends
        args.rdzv_backend = STATIC
    elif args.rdzv_backend == "c10d":
        args.rdzv_backend = C10D
    return args.rdzv_backend

"""The hivemind DHT node in a process of its own, started as a fresh interpreter that never imports torch: hivemind
forked its DHT process from ours, a 320 MB copy of a torch-loaded peer; this one is about 40 MB. The parent talks
to it over a socket pair (requests out, results back), and each side learns of the other's death by its EOF.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import contextlib
import importlib
import importlib.util
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable, Optional, Sequence

from swarm.dht import lifeline

logger = logging.getLogger(__name__)
# What the DHT process runs (`python -c DHT_PROCESS_MAIN <fd>`); its command line also tells it apart in /proc.
DHT_PROCESS_MAIN = "from swarm.dht.node_server import serve; serve()"
# Packages whose __init__ imports torch (hivemind's averager and MoE, MPFuture) though the DHT node needs none of it.
TORCH_IMPORTING_PACKAGES = ("hivemind", "hivemind.dht", "hivemind.utils")
P2PD_GONE = 3  # the DHT process's exit code when its p2pd exited on its own
LOGGERS = ("hivemind", "swarm", "asyncio")  # whose levels the DHT process takes from its parent


class DHTProcessError(RuntimeError):
    """The DHT process exited, so a request to it cannot be answered."""


class DHTProcess:
    """Parent side: starts the DHT process, waits until its node is up (raising what the node raised if it could
    not start), and forwards requests to it; the async ones are awaitable from any event loop. The process ends
    with ours: a parent-death signal (Linux, when started from the main thread), a pid watch and the socket's EOF."""

    def __init__(self, initial_peers: Sequence[str], record_validators: Sequence[Any], shutdown_timeout: float = 3.0,
                 **node_kwargs: Any):
        self.shutdown_timeout = shutdown_timeout
        prctl = lifeline.load_prctl()  # looked up at each start: a test stands in for a platform without it
        settings = dict(initial_peers=list(initial_peers), validators=list(record_validators), node_kwargs=node_kwargs,
                        parent_pid=os.getpid(), use_prctl=prctl is not None,
                        # the parent-death signal fires when the forking *thread* exits: only the main thread lives
                        # as long as its process; from another thread, the pid watch and EOF alone tie the child to us
                        death_signal=prctl is not None and threading.current_thread() is threading.main_thread(),
                        logging=_log_settings())
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        try:
            self._process = subprocess.Popen([sys.executable, "-c", DHT_PROCESS_MAIN, str(theirs.fileno())],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=_child_env())
        finally:
            theirs.close()
        self.pid = self._process.pid
        self._lock = threading.Lock()  # one writer at a time on the socket, and the table of pending requests
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._p2p_replica = None
        try:
            self._conn.send(settings)
            status, payload = self._conn.recv()  # the node's start-up takes its own timeouts (startup_timeout ...)
        except (EOFError, OSError):
            self._reap()
            raise DHTProcessError(f"the DHT process exited during start-up (exit code {self._process.returncode})") \
                from None
        except BaseException:
            self._process.kill()
            self._reap()
            raise
        if status != "ready":
            self._reap()
            raise pickle.loads(payload)
        self.peer_id: str = payload
        threading.Thread(target=self._read_replies, name="dht-replies", daemon=True).start()

    # ---- requests ------------------------------------------------------------------------------------------
    async def get(self, key: Any, latest: bool = False) -> Any:
        """DHTNode.get: the value under `key` (a ValueWithExpiration) or None."""
        return await asyncio.wrap_future(self._call("get", key, latest))

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        return await asyncio.wrap_future(self._call("store", key, value, expiration_time, subkey))

    async def run_coroutine(self, function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """`await function(node, *args)` in the DHT process, with its DHTNode; `function` travels by reference (a
        module-level function of a module that imports no torch)."""
        return await asyncio.wrap_future(self._call("run", function, args))

    def add_validators(self, record_validators: Sequence[Any]) -> None:
        self._call("add_validators", list(record_validators)).result()

    def get_visible_maddrs(self, latest: bool = False) -> list:
        return self._call("visible_maddrs", latest).result()

    async def replicate_p2p(self) -> Any:
        """A P2P client of the DHT process's p2pd, in this process."""
        if self._p2p_replica is None:
            from hivemind.p2p import P2P

            replica = await P2P.replicate(await asyncio.wrap_future(self._call("daemon_maddr")))
            # (its unix socket file: P2P.shutdown removes it; if we die first, the DHT process does, as it ends)
            with contextlib.suppress(AttributeError, KeyError, ValueError, TypeError, DHTProcessError):
                self._call("remove_when_orphaned", replica._client_listen_maddr.value_for_protocol("unix"))
            self._p2p_replica = replica
        return self._p2p_replica

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def shutdown(self) -> None:
        """Stop the node (hivemind stops p2pd), waiting up to shutdown_timeout before SIGTERM."""
        if not self.is_alive():
            return
        with contextlib.suppress(DHTProcessError):
            self._call("shutdown")
        self._reap()

    def _reap(self) -> None:
        """Wait up to shutdown_timeout for the DHT process to exit, then SIGTERM it (its p2pd gets its own
        parent-death signal)."""
        try:
            self._process.wait(self.shutdown_timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the DHT process did not exit within %.0f s; terminating it", self.shutdown_timeout)
            self._process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(1.0)

    def _call(self, method: str, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        payload = pickle.dumps(args)  # here, so that what cannot be pickled fails in the caller
        with self._lock:
            if self._closed:
                raise DHTProcessError(f"the DHT process has exited ({exit_reason(self._process.poll())})")
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                self._conn.send((method, request_id, payload))
            except OSError:
                del self._pending[request_id]
                raise DHTProcessError("the DHT process has exited") from None
        # An awaiting task that is cancelled (a stop cancels the network work in flight) cancels the node's work too.
        future.add_done_callback(lambda done: done.cancelled() and self._cancel(request_id))
        return future

    def _cancel(self, request_id: int) -> None:
        with self._lock, contextlib.suppress(OSError):
            if not self._closed:
                self._conn.send(("cancel", request_id, pickle.dumps(())))

    def _read_replies(self) -> None:
        while True:
            try:
                request_id, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(request_id, None)
            if future is None or future.done():
                continue  # cancelled meanwhile
            try:
                value = pickle.loads(payload)
            except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
                ok, value = False, DHTProcessError(f"unreadable reply from the DHT process: {e!r}")
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled since the check
                future.set_result(value) if ok else future.set_exception(value)
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
        self._conn.close()
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(DHTProcessError("the DHT process exited before it answered"))


def exit_reason(code: Optional[int]) -> str:
    if code == P2PD_GONE:
        return "its libp2p daemon, p2pd, exited on its own (killed? out of memory?): start this process again"
    return f"exit code {code}"


def _log_settings() -> dict:
    """How the parent logs, so that the DHT process logs alike (a fork inherited it)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, logging.StreamHandler)), None)
    formatter = handler.formatter if handler is not None else None
    return dict(level=root.level, levels={name: logging.getLogger(name).level for name in LOGGERS},
                format=getattr(formatter, "_fmt", None), datefmt=getattr(formatter, "datefmt", None),
                stdout=handler is not None and handler.stream is sys.stdout)


def _child_env() -> dict:
    """Our environment, with the directory this `swarm` package was imported from first on the path: the DHT
    process runs the same code as its parent."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, path]) if path else root}


# ---- shared with the DHT process (swarm/dht/node_server.py) -----------------------------------------------------
def import_hivemind_without_torch() -> None:
    """Make the TORCH_IMPORTING_PACKAGES lazy: their submodules import as usual, and a name their __init__
    re-exports is imported when first used, so only what the DHT node uses is loaded."""
    for name in TORCH_IMPORTING_PACKAGES:
        if name not in sys.modules:
            _install_lazy_package(name)


def _install_lazy_package(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an installed package")
    package = importlib.util.module_from_spec(spec)  # attributes and __path__ set, __init__ not run
    exports: dict[str, tuple[str, str]] = {}  # re-exported name -> (module, name there)
    with open(spec.origin, encoding="utf-8") as f:
        for statement in ast.parse(f.read()).body:
            if isinstance(statement, ast.ImportFrom):
                source = importlib.util.resolve_name("." * statement.level + (statement.module or ""), name)
                exports.update((alias.asname or alias.name, (source, alias.name)) for alias in statement.names)
            elif isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant):
                for target in statement.targets:  # __version__ and the like
                    if isinstance(target, ast.Name):
                        setattr(package, target.id, statement.value.value)

    def __getattr__(attribute: str) -> Any:
        if attribute not in exports:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        source, original = exports[attribute]
        module = importlib.import_module(source)
        value = getattr(module, original) if hasattr(module, original) else importlib.import_module(
            f"{source}.{original}")  # `from . import submodule`
        setattr(package, attribute, value)
        return value

    package.__getattr__ = __getattr__
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)


async def rejoin_initial_peers(node: Any, initial_peers: Sequence[str]) -> list[str]:
    """Runs in the DHT process: dial and ping each initial peer missing from the routing table (a ping also asks
    that peer to add us to its table). Returns the peer ids reconnected."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    rejoined = []
    for maddr in initial_peers:
        address, peer_id_text = maddr.rsplit("/p2p/", 1)
        peer_id = PeerID.from_base58(peer_id_text)
        if node.protocol.routing_table.get(peer_id=peer_id) is not None:
            continue
        try:
            # p2pd may have dropped the address after the disconnect; hivemind has no public call for this.
            await node.p2p._client.connect(peer_id, [Multiaddr(address)])
            if await node.protocol.call_ping(peer_id) is None:
                continue
        except Exception as e:  # noqa: BLE001 - still unreachable: try again later
            logger.debug("initial peer %s is still unreachable: %r", peer_id_text, e)
            continue
        if peer_id in node.blacklist:
            node.blacklist.register_success(peer_id)  # lift the back-off from its downtime
        rejoined.append(peer_id_text)
    return rejoined

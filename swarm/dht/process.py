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
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable, Optional, Sequence

from swarm.dht import lifeline
from swarm.dht.lifeline import children_die_with_this_process, die_with_parent, end_children, watch_parent

logger = logging.getLogger(__name__)
# What the DHT process runs (`python -c DHT_PROCESS_MAIN <fd>`); its command line also tells it apart in /proc.
DHT_PROCESS_MAIN = "from swarm.dht.process import serve; serve()"
# Packages whose __init__ imports torch (hivemind's averager and MoE, MPFuture) though the DHT node needs none of it.
TORCH_IMPORTING_PACKAGES = ("hivemind", "hivemind.dht", "hivemind.utils")
SHUTDOWN_GRACE = 0.8  # seconds an orphaned DHT process gives hivemind to stop p2pd before killing it itself
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
                self._call("remove_when_orphaned", replica._client_listen_maddr["unix"])
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
                raise DHTProcessError(f"the DHT process has exited (exit code {self._process.poll()})")
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


# ---- the DHT process ---------------------------------------------------------------------------------------------
def serve() -> None:
    """The DHT process's body: `python -c DHT_PROCESS_MAIN <fd of its socket to the parent>`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole group: the parent decides
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # p2pd must not hold it: our death would not show as EOF
    conn = Connection(fd)
    import_hivemind_without_torch()
    try:
        settings = conn.recv()  # needs hivemind's classes (the validators)
    except EOFError:
        os._exit(0)  # the parent died before it told us what to start
    _configure_logging(settings["logging"])
    prctl = lifeline.load_prctl() if settings["use_prctl"] else None
    die_with_parent(prctl if settings["death_signal"] else None, settings["parent_pid"], signal.SIGTERM)
    children: list = []
    server = _NodeServer(conn, children, settings["parent_pid"])
    watch_parent(settings["parent_pid"], server.orphaned)
    from hivemind.utils.asyncio import switch_to_uvloop

    loop = switch_to_uvloop()
    # SIGTERM is how we learn of our parent's death (die_with_parent above) and how an operator stops us: shut the
    # node down as an orphan does, so hivemind removes its sockets (the default action left them in /tmp for good).
    loop.add_signal_handler(signal.SIGTERM, lambda: threading.Thread(target=server.orphaned, name="sigterm",
                                                                     daemon=True).start())
    with children_die_with_this_process(prctl, children):
        loop.run_until_complete(server.run(settings))
    end_children(children, grace=0.3)  # stopped with the node, unless it failed to start
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as multiprocessing ends a child: hivemind's background tasks are still pending, let them be


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


def _configure_logging(settings: dict) -> None:
    logging.basicConfig(level=settings["level"], format=settings["format"] or logging.BASIC_FORMAT,
                        datefmt=settings["datefmt"], stream=sys.stdout if settings["stdout"] else sys.stderr)
    for name, level in settings["levels"].items():
        logging.getLogger(name).setLevel(level)


class _NodeServer:
    """Runs the DHTNode and answers the parent's requests, each in a task of its own."""

    def __init__(self, conn: Connection, children: list, parent_pid: int):
        self.conn, self.children, self.parent_pid = conn, children, parent_pid
        self.node: Any = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.requests: Optional[asyncio.Queue] = None
        self.tasks: dict[int, asyncio.Task] = {}
        self._orphaned = threading.Lock()
        self.parents_sockets: list[str] = []  # the parent's unix socket files (its P2P replica's) to remove if orphaned

    async def run(self, settings: dict) -> None:
        import hivemind.dht.node
        from hivemind.dht.node import DEFAULT_NUM_WORKERS, DHTNode
        from hivemind.dht.validation import CompositeValidator

        from swarm.dht.storage import BoundedProtocol

        self.loop, self.requests = asyncio.get_running_loop(), asyncio.Queue()
        threading.Thread(target=self._read_requests, name="dht-requests", daemon=True).start()
        node_kwargs = dict(settings["node_kwargs"])
        relay_service = node_kwargs.pop("relay_service", None)
        try:
            if relay_service is not None:  # this process starts one p2pd, through DHTNode.create's P2P
                hivemind.dht.node.P2P = daemon_with_relay_service(relay_service)
            hivemind.dht.node.DHTProtocol = BoundedProtocol  # every key's entries bounded (storage.py)
            self.node = await DHTNode.create(initial_peers=settings["initial_peers"], num_workers=DEFAULT_NUM_WORKERS,
                                             record_validator=CompositeValidator(settings["validators"]),
                                             **node_kwargs)
        except Exception as e:  # noqa: BLE001 - the parent raises it
            logger.debug("the DHT node did not start", exc_info=True)
            self._send(("failed", _pickled_exception(e)))
            return
        self._send(("ready", self.node.peer_id.to_base58()))
        while True:
            method, request_id, payload = await self.requests.get()
            if method == "cancel":
                task = self.tasks.get(request_id)
                if task is not None:
                    task.cancel()
                continue
            task = asyncio.create_task(self._answer(method, request_id, payload))
            if method == "shutdown":
                await self._shut_down(task)
                return
            self.tasks[request_id] = task
            task.add_done_callback(lambda _, request_id=request_id: self.tasks.pop(request_id, None))

    async def _shut_down(self, task: asyncio.Task) -> None:
        """Wait for the node's shutdown `task`, or for p2pd's exit if that comes first: hivemind's calls through a
        p2pd that is gone never return (a stop then waited out its parent's timeout, 3 s), and a p2pd that was
        killed leaves its socket files behind, which we remove."""
        ends = [asyncio.ensure_future(child.wait()) for child in self.children]
        await asyncio.wait([task, *ends], return_when=asyncio.FIRST_COMPLETED)
        for end in ends:
            end.cancel()
        if not task.done():
            p2p = self.node.p2p
            for maddr in (p2p.daemon_listen_maddr, getattr(p2p, "_client_listen_maddr", None)):
                with contextlib.suppress(Exception):  # (a maddr without a unix path: nothing to remove)
                    remove_socket_file(maddr.value_for_protocol("unix"))

    async def _answer(self, method: str, request_id: Optional[int], payload: bytes) -> None:
        try:
            value, ok = await self._handle(method, *pickle.loads(payload)), True
        except asyncio.CancelledError:
            return  # the parent stopped waiting
        except Exception as e:  # noqa: BLE001 - the parent raises it
            value, ok = e, False
        if request_id is None:
            return  # our own shutdown (orphaned): nobody waits for it
        try:
            reply = pickle.dumps(value) if ok else _pickled_exception(value)
        except Exception as e:  # noqa: BLE001 - a result that cannot be pickled
            ok, reply = False, _pickled_exception(e)
        self._send((request_id, ok, reply))

    async def _handle(self, method: str, *args: Any) -> Any:
        node = self.node
        if method == "get":
            key, latest = args
            return await node.get(key, latest=latest)
        if method == "store":
            key, value, expiration_time, subkey = args
            return await node.store(key, value, expiration_time, subkey=subkey)
        if method == "run":
            function, function_args = args
            return await function(node, *function_args)
        if method == "add_validators":
            node.protocol.record_validator.extend(args[0])
            return None
        if method == "visible_maddrs":
            return await node.get_visible_maddrs(latest=args[0])
        if method == "daemon_maddr":
            return node.p2p.daemon_listen_maddr
        if method == "shutdown":
            return await node.shutdown()
        if method == "remove_when_orphaned":
            self.parents_sockets.append(str(args[0]))
            return None
        raise ValueError(f"unknown DHT process request {method!r}")

    def _send(self, message: tuple) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: orphaned() ends us
            self.conn.send(message)

    def _read_requests(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            self.loop.call_soon_threadsafe(self.requests.put_nowait, message)
        self.orphaned()  # EOF: the parent died, or closed its end without asking us to stop

    def orphaned(self) -> None:
        """Our parent died (its socket's EOF or the pid watch, whichever came first): shut the node down as the
        parent would have (hivemind then stops p2pd and removes its sockets), and make sure of it after a grace
        period."""
        if not self._orphaned.acquire(blocking=False):
            return  # the other watch got here first
        if not lifeline.alive(self.parent_pid):  # (not when only our end closed: its P2P shutdown removes them)
            for path in self.parents_sockets:  # (a dead process's socket files stayed in /tmp for good)
                remove_socket_file(path)
        if self.node is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the node has stopped already
                self.loop.call_soon_threadsafe(self.requests.put_nowait, ("shutdown", None, pickle.dumps(())))
        deadline = time.monotonic() + SHUTDOWN_GRACE
        while time.monotonic() < deadline and any(child.returncode is None for child in self.children):
            time.sleep(0.05)
        end_children(self.children, grace=0.3)
        os._exit(0)


def remove_socket_file(path: str) -> None:
    """Remove `path` if it is a unix socket file (and nothing else)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def daemon_with_relay_service(relay_service: bool) -> type:
    """hivemind's P2P, starting p2pd with its circuit relay service (relaying other peers' connections) on or off.
    p2pd serves as a relay for anyone whenever relays are on (-relay), and P2P.create has no option for it."""
    from hivemind.p2p import P2P

    class RelayServiceP2P(P2P):
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            return P2P._make_process_args(*args, relayService=relay_service, **kwargs)

    return RelayServiceP2P


def _pickled_exception(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception holding what cannot be pickled: keep its text
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


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

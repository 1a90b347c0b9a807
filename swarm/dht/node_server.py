"""The DHT process's side (swarm/dht/process.py is its parent's): the hivemind DHT node, answering the parent's
requests over their socket pair, ending with the parent (its death signal, EOF, or the pid watch) or its p2pd."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import stat
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from swarm.dht import lifeline
from swarm.dht.lifeline import children_die_with_this_process, die_with_parent, end_children, watch_parent
from swarm.dht.process import P2PD_GONE, import_hivemind_without_torch

logger = logging.getLogger(__name__)
SHUTDOWN_GRACE = 0.8  # seconds an orphaned DHT process gives hivemind to stop p2pd before killing it itself


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
        self.stopping = False  # p2pd's exit from now on is ours, not a crash
        self.watch: Optional[asyncio.Task] = None
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
        self.watch = asyncio.create_task(self._watch_daemon())  # (a reference: the loop holds tasks weakly)
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
        self.stopping = True
        daemon = self._daemon()
        exited = asyncio.ensure_future(daemon.wait()) if daemon is not None else None
        await asyncio.wait([task] + ([exited] if exited is not None else []), return_when=asyncio.FIRST_COMPLETED)
        if exited is not None:
            exited.cancel()
        if not task.done():
            self._remove_node_sockets()

    async def _watch_daemon(self) -> None:
        """p2pd exiting on its own (killed, out of memory) left this node unable to reach anyone, and its peer
        "waiting for peers" for good: end this process then, which the parent reports (P2PD_GONE)."""
        daemon = self._daemon()
        if daemon is None:
            return
        code = await daemon.wait()
        if self.stopping:
            return
        logger.error("p2pd, the libp2p daemon, exited on its own (exit code %s): this node cannot reach the swarm",
                     code)
        self._remove_node_sockets()
        end_children(self.children, grace=0.3)
        logging.shutdown()
        os._exit(P2PD_GONE)

    def _daemon(self) -> Any:
        """The p2pd process our node runs (hivemind's P2P keeps it; not the one hivemind ran and stopped before
        it, to check that our identity is not in use elsewhere), or None."""
        return getattr(self.node.p2p, "_child", None)

    def _remove_node_sockets(self) -> None:
        """The socket files of our node's P2P (p2pd's and our client's), which a p2pd that is gone left."""
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
        self.stopping = True
        if lifeline.gone(self.parent_pid, 0.5):  # (not when only our end closed: its P2P shutdown removes them)
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

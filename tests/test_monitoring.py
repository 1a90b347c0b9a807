"""Monitoring: the peer's and the bootstrap's metrics, the loss history, the HTTP server (/metrics, /, /api/swarm)
and the terminal progress line as units; then a live local swarm (a bootstrap and two peers through the CLI)
scraped by a real Prometheus, rendered by a headless Chromium, and joined by a peer on a pseudo-terminal."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY_RECIPE, EventReader, SwarmProcess, stop_all
from swarm.bootstrap import _stop_on_signals
from swarm.compression import get_codec
from swarm.config import Recipe
from swarm.dht.records import PeerRecord
from swarm.dht.view import summarize
from swarm.monitoring.http import MonitoringServer
from swarm.monitoring.metrics import PeerMetrics, SwarmGauges
from swarm.monitoring.progress import CLEAR_LINE, ProgressLine, format_progress, seconds_to_average
from swarm.monitoring.status_page import StatusBoard, SwarmHistory, render_page

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "swarm.json"
PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---- units ----------------------------------------------------------------------------------------------------
def samples(registry) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def record(peer_id: str, **fields) -> PeerRecord:
    base = dict(state="training", version="0.1.0", run_id="run", round=3, tokens_in_round=0, block_start=0,
                block_end=4, digest="d1", tokens_per_s=100.0, loss=4.0)
    return PeerRecord(peer_id=peer_id, **{**base, **fields})


def test_peer_metrics_account_compression_checkpoints_blocks_and_memory():
    metrics = PeerMetrics()
    before = samples(metrics.registry)
    assert math.isnan(before[("swarm_train_loss", ())]) and math.isnan(before[("swarm_val_loss", ())])
    assert math.isnan(before[("swarm_checkpoint_age_seconds", ())]), "no checkpoint yet: no age"
    used, total = before[("swarm_device_memory_used_bytes", ())], before[("swarm_device_memory_total_bytes", ())]
    assert 1 << 20 < used < total, "a CPU peer reports its resident memory and the machine's"

    fp16 = get_codec("fp16")
    per_param = fp16.bytes_per_param(50_000)
    metrics.record_allreduce(bytes_sent=100_000, bytes_received=300_000, seconds=0.5, group_size=3,
                             wire_bytes_per_param=per_param)
    metrics.set_blocks(2, 6)
    metrics.checkpoint_written(7)
    after = samples(metrics.registry)
    ratio = after[("swarm_compression_ratio", ())]
    assert 1.99 < ratio < 2.0, "fp16 halves fp32, less its small header"
    assert after[("swarm_allreduce_bytes_sent_total", ())] == 100_000
    assert after[("swarm_allreduce_uncompressed_bytes_sent_total", ())] == pytest.approx(100_000 * ratio)
    assert after[("swarm_allreduce_uncompressed_bytes_received_total", ())] == pytest.approx(300_000 * ratio)
    assert after[("swarm_group_size", ())] == 3 and metrics.last_group_size == 3
    assert after[("swarm_allreduce_seconds_count", ())] == 1
    assert abs(after[("swarm_last_average_timestamp_seconds", ())] - time.time()) < 60
    assert (after[("swarm_hosted_blocks", ())], after[("swarm_hosted_block_start", ())],
            after[("swarm_hosted_block_end", ())]) == (4, 2, 6)
    assert after[("swarm_checkpoint_round", ())] == 7 and 0 <= after[("swarm_checkpoint_age_seconds", ())] < 60


def test_swarm_gauges_cover_every_block_and_drop_stale_ones():
    registry = CollectorRegistry()
    gauges = SwarmGauges(registry)
    peers = [record("a", block_start=0, block_end=2, tokens_per_s=10.0, loss=4.0, val_loss=5.0, data_shard=5),
             record("b", block_start=1, block_end=3, tokens_per_s=30.0, loss=6.0, data_shard=5),
             record("c", state="offline", block_start=0, block_end=3, tokens_per_s=1000.0, data_shard=9)]
    gauges.update(summarize(peers, invalid=0, n_blocks=4), now=100.0)
    got = samples(registry)
    replicas = [got[("swarm_swarm_block_replicas", (("block", str(b)),))] for b in range(4)]
    throughput = [got[("swarm_swarm_block_tokens_per_second", (("block", str(b)),))] for b in range(4)]
    assert replicas == [1, 2, 1, 0] and throughput == [10, 40, 30, 0], "offline peers cover nothing"
    assert got[("swarm_swarm_blocks", ())] == 4 and got[("swarm_swarm_peers_online", ())] == 2
    assert got[("swarm_swarm_loss_spread", ())] == pytest.approx(1.0)  # population std of 4 and 6
    assert got[("swarm_swarm_val_loss_mean", ())] == 5.0
    assert got[("swarm_swarm_round_start_timestamp_seconds", ())] == 100.0
    assert got[("swarm_swarm_peers_sharing_a_data_shard", ())] == 2, "a and b read shard 5 (c is offline)"

    gauges.update(summarize([record("a", block_end=2, loss=None)], invalid=0, n_blocks=2), now=130.0)
    got = samples(registry)
    assert not any(name.startswith("swarm_swarm_block") and dict(labels).get("block") in ("2", "3")
                   for name, labels in got), "blocks the model no longer has must not linger"
    assert math.isnan(got[("swarm_swarm_loss_spread", ())]), "no loss reported: unknown, not 0"
    assert got[("swarm_swarm_peers_sharing_a_data_shard", ())] == 0
    assert got[("swarm_swarm_round_start_timestamp_seconds", ())] == 100.0, "same round: same start"
    gauges.update(summarize([record("a", round=4, block_end=2)], invalid=0, n_blocks=2), now=150.0)
    assert samples(registry)[("swarm_swarm_round_start_timestamp_seconds", ())] == 150.0


def test_history_keeps_a_bounded_loss_curve_per_round():
    history = SwarmHistory(max_rounds=5)
    for round_no in range(12):
        peers = [record("a", round=round_no, loss=10.0 - round_no), record("b", round=round_no, loss=8.0 - round_no,
                                                                            val_loss=9.0 - round_no),
                 record("c", round=round_no, state="syncing", loss=100.0)]  # not training: not in the curve
        history.observe(summarize(peers, invalid=0, n_blocks=4), now=1000.0 + round_no)
    rounds = history.rounds()
    assert [entry["round"] for entry in rounds] == [7, 8, 9, 10, 11]
    last = rounds[-1]
    assert (last["train_loss_mean"], last["train_loss_min"], last["train_loss_max"]) == (-2.0, -3.0, -1.0)
    assert last["val_loss_mean"] == -2.0 and last["peers"] == 2 and last["first_seen"] == 1011.0
    history.observe(summarize([record("late", round=2)], invalid=0, n_blocks=4), now=2000.0)
    assert [entry["round"] for entry in history.rounds()] == [7, 8, 9, 10, 11], "older than the window: dropped"
    history.observe(summarize([record("a", round=11, loss=0.5)], invalid=0, n_blocks=4), now=2001.0)
    updated = history.rounds()[-1]
    assert updated["train_loss_mean"] == 0.5 and updated["first_seen"] == 1011.0 and updated["last_seen"] == 2001.0


def _get(url: str, method: str = "GET") -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_http_server_serves_metrics_page_and_json_and_escapes_peer_strings():
    registry = CollectorRegistry()
    Gauge("swarm_test_value", "a test gauge", registry=registry).set(42)
    board = StatusBoard("run-x", "f" * 64, "QmBootstrap")
    hostile = "</script><script>alert(1)</script><img src=http://evil.example/x>"
    board.update(summarize([record("peer-a", device_name=hostile)], invalid=1, n_blocks=4), now=10.0)
    server = MonitoringServer(registry, board.payload)
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, headers, body = _get(base + "/metrics")
        assert status == 200 and "swarm_test_value 42.0" in body.decode()
        status, headers, body = _get(base + "/api/swarm")
        data = json.loads(body)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert data["run_id"] == "run-x" and data["summary"]["invalid_records"] == 1
        assert data["summary"]["peers"][0]["device_name"] == hostile and data["history"][0]["round"] == 3
        status, headers, body = _get(base + "/")
        page = body.decode()
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert "<script>alert" not in page and "evil.example" in page, "the peer's string is there, inert"
        embedded = re.search(r"const INITIAL = (.*);\n", page).group(1)
        assert json.loads(embedded) == data
        page_without_data = page.replace(embedded, "")
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|@import|url\(", page_without_data), \
            "the page must not load anything from elsewhere"
        status, headers, body = _get(base + "/", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(page.encode())
        assert _get(base + "/nope")[0] == 404
    finally:
        server.close()


def test_page_renders_before_the_first_read():
    board = StatusBoard("run-x", "f" * 64, "QmBootstrap")
    page = render_page(board.payload()).decode()
    data = json.loads(re.search(r"const INITIAL = (.*);\n", page).group(1))
    assert data["summary"] is None and data["history"] == [] and data["updated_at"] is None


def test_bootstrap_stops_on_signals_and_its_dht_fork_still_dies_on_sigterm():
    """hivemind forks its DHT process after the bootstrap installs its handlers, and ends a DHT that does not stop
    in time with SIGTERM: the fork must die of it, or the bootstrap waits for it forever."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    stop = threading.Event()
    ready_read, ready_write = os.pipe()
    try:
        _stop_on_signals(stop)
        child = os.fork()
        if child == 0:  # the fork, like hivemind's DHT process: up and running, then waits to be terminated
            os.write(ready_write, b"up")  # (a signal that arrives during fork itself is dropped by Python)
            time.sleep(30)
            os._exit(0)
        assert os.read(ready_read, 2) == b"up"
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # in the bootstrap itself: a clean stop
        assert stop.wait(5)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for fd in (ready_read, ready_write):
            os.close(fd)


def test_bootstrap_with_a_busy_metrics_port_fails_with_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = subprocess.run([sys.executable, "-m", "swarm", "bootstrap", "--recipe", str(TINY_RECIPE),
                                 "--metrics-port", str(busy.getsockname()[1])], capture_output=True, text=True,
                                timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    assert re.search(r"ERROR swarm\.bootstrap: cannot serve metrics on 127\.0\.0\.1:\d+: Address already in use",
                     output), output


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_redraws_under_log_lines():
    terminal = FakeTerminal()
    handler = logging.StreamHandler(terminal)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        line = ProgressLine(terminal, min_interval=0.0)
        view = [record("other", round=3, tokens_per_s=300.0, state="training"),
                record("stale", round=2, tokens_per_s=5000.0)]  # another round: not part of this one's progress
        line.update(state="training", round_no=3, tokens_per_s=100.0, loss=4.25, swarm_tokens=600,
                    steps_in_round=4, recipe=Recipe(tokens_per_round=1000), view=view, peer_id="me",
                    last_group_size=2)
        drawn = terminal.getvalue()
        assert drawn.startswith(CLEAR_LINE) and "\n" not in drawn
        for part in ("round 3", "100 tok/s (swarm 400)", "loss 4.250", "next average ~1 s (60%)",
                     "2 peers in round, last group 2", "training"):
            assert part in drawn, (part, drawn)
        logging.getLogger("swarm.test").warning("round 3: averaged")
        after_log = terminal.getvalue()[len(drawn):]
        assert after_log.startswith(CLEAR_LINE + "round 3: averaged\n" + CLEAR_LINE + "round 3 |"), after_log
        # A recipe with inner_steps_per_round: the average comes after our own steps, at our own rate.
        by_steps = Recipe(inner_steps_per_round=10, tokens_per_round=1000)  # 8 x 128 = 1024 tokens per step
        line.update(state="training", round_no=3, tokens_per_s=512.0, loss=4.0, swarm_tokens=10_000,
                    steps_in_round=5, recipe=by_steps, view=view, peer_id="me")
        assert "next average ~10 s (50%)" in terminal.getvalue().rsplit(CLEAR_LINE, 1)[1]
        line.close()
        assert handler.stream is terminal and terminal.getvalue().endswith(CLEAR_LINE)
    finally:
        root.removeHandler(handler)


def test_progress_line_is_silent_when_not_a_terminal():
    piped = io.StringIO()
    handler = logging.StreamHandler(piped)
    logging.getLogger().addHandler(handler)
    try:
        line = ProgressLine(piped, min_interval=0.0)
        line.update(state="training", round_no=1, tokens_per_s=10.0, loss=1.0, swarm_tokens=0, steps_in_round=0,
                    recipe=Recipe(), view=[], peer_id="me")
        line.close()
        assert piped.getvalue() == "" and handler.stream is piped
    finally:
        logging.getLogger().removeHandler(handler)


def test_time_to_next_average():
    assert seconds_to_average(1000, 400, 200.0) == 3.0
    assert seconds_to_average(1000, 1200, 200.0) == 0.0
    assert seconds_to_average(1000, 400, 0.0) is None
    assert "averaging now" in format_progress("averaging", 2, 1.0, 1.0, None, 0.0, 1.0, 1, None)
    unknown = format_progress("training", 2, 0.0, 0.0, None, None, 0.0, 1, None)
    assert "next average ~? (0%)" in unknown and "loss -" in unknown and "1 peer in round |" in unknown
    assert "next average ~3 min (40%)" in format_progress("training", 2, 5.0, 9.0, 1.0, 180.0, 0.4, 2, 2)


# ---- a live local swarm ---------------------------------------------------------------------------------------
class TerminalProcess(EventReader):
    """A `python -m swarm ...` child whose stdout and stderr are a pseudo-terminal, as in an interactive shell;
    the same interface as conftest's SwarmProcess."""

    def __init__(self, argv: list[str], name: str, log_dir: Path, events: bool = False):
        self.name, self.log_path = name, log_dir / f"{name}.log"
        self.events_path = log_dir / f"{name}.events.jsonl" if events else None
        if self.events_path is not None:
            argv = [*argv, "--events-file", str(self.events_path)]
        master, slave = pty.openpty()
        self.process = subprocess.Popen([sys.executable, "-m", "swarm", *argv], stdin=subprocess.DEVNULL,
                                        stdout=slave, stderr=slave, start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
        os.close(slave)
        self._master = master
        self._raw = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "wb") as log:
            while True:
                try:
                    chunk = os.read(self._master, 65536)
                except OSError:  # EIO: every process on the other side closed it
                    break
                if not chunk:
                    break
                self._raw.extend(chunk)
                log.write(chunk)
        os.close(self._master)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return bytes(self._raw).decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.output())
            if match:
                return match
            if time.monotonic() >= deadline or (self.process.poll() is not None and not self._reader.is_alive()):
                raise AssertionError(f"{self.name}: nothing matching {pattern!r} within {timeout} s; output:\n"
                                     + self.output()[-4000:])
            time.sleep(0.1)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class LiveSwarm:
    def __init__(self, bootstrap: SwarmProcess, maddr: str, url: str, peers: list[SwarmProcess],
                 peer_ids: list[str], peer_ports: list[int], bootstrap_port: int):
        self.bootstrap, self.maddr, self.url, self.peers = bootstrap, maddr, url, peers
        self.peer_ids, self.peer_ports, self.bootstrap_port = peer_ids, peer_ports, bootstrap_port

    def api(self) -> dict:
        return json.loads(_get(self.url + "api/swarm")[2])

    def wait_until_trained(self, timeout: float) -> dict:
        """Poll /api/swarm until both peers train or average and the history holds a round >= 1 with a loss."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.api()
            summary = data["summary"] or {"peers": []}
            states = {p["peer_id"]: p["state"] for p in summary["peers"]}
            if all(states.get(i) in ("training", "averaging") for i in self.peer_ids) and any(
                    h["round"] >= 1 and h["train_loss_mean"] is not None for h in data["history"]):
                return data
            if time.monotonic() >= deadline:
                raise AssertionError(f"the bootstrap did not see both peers train a round within {timeout} s: "
                                     f"{json.dumps(data)[:3000]}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def live_swarm(tmp_path_factory, cache_dir):
    """A bootstrap and two peers, each with --metrics-port 0, training the tiny recipe until the module ends. The
    first peer's output is a pipe, the second's a pseudo-terminal (where it draws its progress line)."""
    workdir = tmp_path_factory.mktemp("live-swarm")
    started: list[SwarmProcess] = []
    try:
        bootstrap = SwarmProcess(["bootstrap", "--recipe", str(TINY_RECIPE), "--metrics-port", "0"], "bootstrap",
                                 workdir, events=True)
        started.append(bootstrap)
        listening = bootstrap.wait_event("listening", 60)
        maddr, bootstrap_port = listening["maddrs"][0], listening["metrics_port"]
        peers = []
        for i, kind in enumerate((SwarmProcess, TerminalProcess)):
            peer = kind(["join", "--initial-peers", maddr, "--device", "cpu", "--num-threads", "1",
                         "--cache-dir", str(cache_dir), "--metrics-port", "0"], f"peer{i}", workdir, events=True)
            started.append(peer)
            peers.append(peer)
        peer_ids = [peer.wait_event("joined", 60)["peer_id"] for peer in peers]
        peer_ports = [peer.wait_event("metrics", 60)["port"] for peer in peers]
        yield LiveSwarm(bootstrap, maddr, f"http://127.0.0.1:{bootstrap_port}/", peers, peer_ids, peer_ports,
                        bootstrap_port)
    finally:
        stop_all(started)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bootstrap_serves_the_swarm_as_metrics_json_and_page(live_swarm):
    started = time.monotonic()
    data = live_swarm.wait_until_trained(75)
    summary = data["summary"]
    assert summary["n_blocks"] == 2 and summary["block_coverage"] == [2, 2]
    assert summary["peers_online"] == 2
    status, _, body = _get(live_swarm.url + "metrics")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert got[("swarm_swarm_block_replicas", (("block", "0"),))] == 2
    assert got[("swarm_swarm_block_tokens_per_second", (("block", "1"),))] > 0
    assert got[("swarm_swarm_round", ())] >= 1 and got[("swarm_swarm_peers_online", ())] == 2
    assert got[("swarm_peers", (("state", "training"),))] + got[("swarm_peers", (("state", "averaging"),))] == 2
    # The peers' own metrics, after at least one averaged round.
    for port in live_swarm.peer_ports:
        peer = {s.name: s.value for family in text_string_to_metric_families(_get(
            f"http://127.0.0.1:{port}/metrics")[2].decode()) for s in family.samples if not s.labels}
        assert peer["swarm_outer_round"] >= 1 and peer["swarm_train_loss"] > 0
        assert peer["swarm_hosted_blocks"] == 2 and peer["swarm_compression_ratio"] == pytest.approx(1.0, abs=0.01)
        assert peer["swarm_data_shard"] in range(64)
        assert peer["swarm_allreduce_uncompressed_bytes_sent_total"] > 0
        assert peer["swarm_device_memory_used_bytes"] > 1 << 20
    piped = live_swarm.peers[0].output()
    assert "averaged with" in piped and "\x1b[" not in piped and "\r" not in piped, "no progress line on a pipe"
    print(f"swarm trained and served in {time.monotonic() - started:.1f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prometheus_query(base: str, query: str) -> list[dict]:
    status, _, body = _get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", (query, data)
    return data["data"]["result"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed (Debian package "
                    "`prometheus`; .ci/run installs it when run as root)")
def test_real_prometheus_scrapes_the_swarm_and_evaluates_our_rules_and_dashboard(live_swarm, tmp_path):
    started = time.monotonic()
    port = _free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(ALERTS)],
              "scrape_configs": [
                  {"job_name": "swarm-bootstrap",
                   "static_configs": [{"targets": [f"127.0.0.1:{live_swarm.bootstrap_port}"]}]},
                  {"job_name": "swarm-peers",
                   "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in live_swarm.peer_ports]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")
    server = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                               "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    checks = {  # query -> what its single value must satisfy
        'count(up{job=~"swarm-.*"} == 1)': lambda v: v == 3,
        "swarm_swarm_peers_online": lambda v: v >= 2,
        'sum(swarm_peers{state=~"training|averaging"})': lambda v: v >= 2,
        "swarm_swarm_round": lambda v: v >= 1,
        "swarm_swarm_loss_mean": lambda v: 0 < v < 20,
        'count(swarm_outer_round{job="swarm-peers"} >= 1)': lambda v: v == 2,
        'count(swarm_train_loss{job="swarm-peers"} > 0)': lambda v: v == 2,
        'count(swarm_swarm_block_replicas == 2)': lambda v: v == 2,
    }
    try:
        deadline = time.monotonic() + 75
        while True:  # the query API answers 503 until the server is ready
            try:
                if _get(base + "/-/ready")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        pending = dict(checks)
        last: dict = {}
        while pending:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            for query, ok in list(pending.items()):
                result = _prometheus_query(base, query)
                last[query] = result
                if len(result) == 1 and ok(float(result[0]["value"][1])):
                    del pending[query]
            if pending and time.monotonic() >= deadline:
                raise AssertionError(f"not within 75 s through Prometheus: {sorted(pending)}; last results: {last}")
            if pending:
                time.sleep(0.5)

        # Our alert rules load and evaluate against live data without errors; none fires on a healthy swarm.
        while True:
            groups = json.loads(_get(base + "/api/v1/rules")[2])["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            if rules and all(rule["health"] == "ok" for rule in rules):
                break
            assert time.monotonic() < deadline + 10, f"rules not evaluated cleanly: {rules}"
            time.sleep(0.5)
        assert len(rules) == len(yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"])
        assert not [rule["name"] for rule in rules if rule["state"] == "firing"]

        # Every dashboard query evaluates and has data, except counts of failures a healthy swarm never had
        # (labelled counters have no series before their first increment). Rates need two scrapes: poll.
        exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
                 for target in panel["targets"]]
        may_be_empty = [e for e in exprs if "swarm_averaging_failures_total" in e or "swarm_bad_peer_messages" in e]
        assert len(may_be_empty) == 2
        while empty := [expr for expr in exprs if expr not in may_be_empty and not _prometheus_query(base, expr)]:
            assert time.monotonic() < deadline + 15, f"dashboard queries without data: {empty}"
            time.sleep(0.5)
        print(f"Prometheus saw the swarm and had data for the dashboard in {time.monotonic() - started:.1f} s")
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(10)
        log.close()


def _run_chromium(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run chromium in its own session and kill that whole session (its helper processes too) afterwards."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", f"chromium did not finish within {timeout} s"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`; .ci/run "
                    "installs it when run as root)")
def test_status_page_renders_the_swarm_in_headless_chromium(live_swarm, tmp_path):
    started = time.monotonic()
    live_swarm.wait_until_trained(75)
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
              f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900", "--virtual-time-budget=5000"]
    result = _run_chromium(common + ["--dump-dom", live_swarm.url])
    dom = result.stdout
    assert result.returncode == 0 and "<table" in dom, result.stderr[-3000:]
    rows = re.findall(r'<tr[^>]*data-peer-id="([^"]+)"', dom)
    assert sorted(rows) == sorted(live_swarm.peer_ids), "the peers table lists exactly the swarm's peers"
    loss_chart = re.search(r'id="loss-chart">(.*?)</div></section>', dom, re.S).group(1)
    assert loss_chart.count("<circle") >= 1 and "no loss reported" not in loss_chart
    coverage_chart = re.search(r'id="coverage-chart">(.*?)</div></section>', dom, re.S).group(1)
    assert coverage_chart.count("<rect") >= 4, "two blocks: a coverage bar and a throughput bar each"
    assert 'id="bandwidth-chart"><div><svg' in dom
    assert re.search(r'id="banner"[^>]*hidden', dom), "no error banner on a healthy swarm"

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "status-page.png"
    screenshot.unlink(missing_ok=True)
    result = _run_chromium(common + [f"--screenshot={screenshot}", live_swarm.url])
    assert result.returncode == 0 and screenshot.is_file(), result.stderr[-3000:]
    png = screenshot.read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (width, height) == (1280, 900)
    assert len(png) > 30_000, "a drawn page, not a blank one"
    print(f"status page checked in {time.monotonic() - started:.1f} s; screenshot at {screenshot}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_join_on_a_terminal_draws_a_live_progress_line(live_swarm):
    """The second peer of the live swarm writes to a pseudo-terminal, as in an interactive shell."""
    started = time.monotonic()
    terminal = live_swarm.peers[1]
    # After its first averaged round, the line shows the group it averaged with.
    line = terminal.wait_for(r"\r\x1b\[Kround (\d+) \| [\d.]+k? tok/s \(swarm [\d.]+k?\) \| loss \d+\.\d{3} \| "
                             r"(next average ~[^|]+ \(\d+%\)|next average due \(\d+%\)|averaging now) \| "
                             r"(\d+) peers? in round, last group (\d+) \| (training|averaging)", 75)
    assert int(line.group(1)) >= 1 and int(line.group(3)) >= 1 and int(line.group(4)) == 2
    text = terminal.output()
    # Log lines still print, each erasing the progress line first and ending a line of its own.
    assert re.search(r"\r\x1b\[K\d\d:\d\d:\d\d INFO swarm\.peer: round \d+: averaged with 2 peers[^\r\x1b]*\r?\n", text)
    assert text.count("\x1b[K") > 10, "the line is redrawn in place as training goes on"
    print(f"progress line seen in {time.monotonic() - started:.1f} s")

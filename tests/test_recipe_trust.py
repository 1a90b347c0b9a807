"""What a peer takes from the run's recipe and its own disk, with real processes: a recipe (published by whoever
runs the bootstrap) cannot make a volunteer's peer read files outside its data directory, and a checkpoint of
another run is refused rather than loaded and announced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.peer.state.checkpoint import save_checkpoint

pytestmark = pytest.mark.slow
TINY = (Path(__file__).parent / "recipes" / "tiny.yaml").read_text()


def test_a_recipe_naming_files_outside_the_data_dir_is_refused(swarm, tmp_path):
    recipe = tmp_path / "greedy.yaml"
    recipe.write_text(TINY.replace("data:\n", "data:\n  source: /etc\n"))
    # A hostile owner's recipe, published as it is (--no-share-data: a bootstrap sharing /etc would refuse to start).
    _, maddr = swarm.bootstrap("--no-share-data", recipe=recipe)
    peer = swarm.peer(maddr, "--data-dir", str(tmp_path / "data"), name="volunteer")
    assert peer.wait(120) == 2, peer.output()[-3000:]
    lines = [line for line in peer.lines if "ERROR" in line]
    assert len(lines) == 1 and "recipe field data.source names '/etc', outside this peer's data directory" \
        in lines[0], peer.output()[-3000:]
    assert not peer.events("training"), "nothing was trained on"


def test_a_checkpoint_of_another_run_is_refused(swarm, tmp_path):
    checkpoints = tmp_path / "ckpt"
    save_checkpoint(checkpoints, 5, 1000, {"global.0": torch.zeros(3)}, {"recipe": "f" * 64, "digest": "x"})
    _, maddr = swarm.bootstrap()
    peer = swarm.peer(maddr, "--checkpoint-dir", str(checkpoints), name="restarted")
    assert peer.wait(120) == 2, peer.output()[-3000:]
    lines = [line for line in peer.lines if "ERROR" in line]
    assert len(lines) == 1 and "is of another run (recipe ffffffff" in lines[0], peer.output()[-3000:]
    assert not peer.events("resumed") and not peer.events("training")

"""The peer's global state beyond one process: checkpoints (checkpoint.py), serving it to others (serve.py),
bringing a peer to the swarm's state by replaying the outer steps it missed (replay.py) or downloading it
(download.py) over one stream protocol (wire.py), chosen by sync.py and driven by catch_up.py."""

"""DiLoCo's outer state in a file (`--outer-state-dir`, swarm/peer/outer.py): the same state, digests and
replay log bit for bit as in memory, through outer steps, replays, state loads, mixing and checkpoints; its pages
out of the process's memory after each use; no file left behind; a directory it cannot use refused in one line."""

import copy

import pytest
import torch

from swarm.compression import decode, get_codec
from swarm.config import OuterRecipe
from swarm.peer.diloco import DiLoCo
from swarm.peer.outer import momenta
from swarm.peer.state.checkpoint import load_latest, save_checkpoint


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])  # 8 params, 16,640 values


def _pair(tmp_path, fragments=1, log_bytes_per_param=2.5):
    model = _model()
    recipe = OuterRecipe(fragments=fragments)
    return (DiLoCo(model, recipe, log_bytes_per_param=log_bytes_per_param),
            DiLoCo(copy.deepcopy(model), recipe, log_bytes_per_param=log_bytes_per_param,
                   outer_state_dir=str(tmp_path / "outer")))


def _bits(tensors):
    return [t.detach().contiguous().view(torch.int32).clone() for t in tensors]


def _same_state(a: DiLoCo, b: DiLoCo) -> None:
    assert (a.round, a.tokens_seen, a.digest()) == (b.round, b.tokens_seen, b.digest())
    assert [torch.equal(x, y) for x, y in zip(_bits(a.global_params), _bits(b.global_params))] == [True] * 8
    ma, mb = momenta(a.global_params, a.outer_optimizer), momenta(b.global_params, b.outer_optimizer)
    assert [m is None for m in ma] == [m is None for m in mb]
    assert all(torch.equal(x, y) for x, y in zip(_bits(m for m in ma if m is not None),
                                                 _bits(m for m in mb if m is not None)))
    assert all(torch.equal(x, y) for x, y in zip(a.local_params, b.local_params))


def _resident_bytes(tensor: torch.Tensor) -> int:
    """The Rss of the mapping `tensor` lies in, from /proc/self/smaps."""
    address, rss, inside = tensor.data_ptr(), None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    assert rss is not None, "the outer state's mapping is not in /proc/self/smaps"
    return rss


def _mapped_from(address: int) -> str:
    """The path /proc/self/maps gives for the mapping `address` lies in ('' for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


def _train(diloco: DiLoCo, step: int) -> None:
    with torch.no_grad():
        for k, param in enumerate(diloco.local_params):
            param.add_(torch.linspace(-1, 1, param.numel()).view_as(param) * 0.01 * (step + k + 1))


@pytest.mark.parametrize("fragments", [1, 4])
def test_the_outer_state_in_a_file_steps_and_hashes_bit_for_bit_as_in_memory(tmp_path, fragments):
    memory, disk = _pair(tmp_path, fragments)
    assert list((tmp_path / "outer").iterdir()) == [], "the file is unlinked once mapped: nothing left behind"
    _same_state(memory, disk)
    for step in range(6):
        for diloco in (memory, disk):
            _train(diloco, step)
        average = memory.pseudo_gradient(memory.fragment())
        assert torch.equal(average, disk.pseudo_gradient(disk.fragment()))
        if step == 0:
            average[::3] = -0.0  # a first momentum buffer keeps the sign of a zero, as torch's clone does
        for diloco in (memory, disk):
            diloco.outer_step(average.clone(), tokens=100)
        _same_state(memory, disk)
        assert [s.after for s in memory.replay_log] == [s.after for s in disk.replay_log]
    buffers = [m for m in momenta(disk.global_params, disk.outer_optimizer) if m is not None]
    assert any(torch.signbit(m).any() for m in buffers)
    in_file = disk.store.flat.untyped_storage().data_ptr()
    assert len(buffers) == 8 and all(m.untyped_storage().data_ptr() == in_file for m in buffers + disk.global_params)


def test_the_replay_log_keeps_its_bytes_in_files_and_a_peer_behind_replays_from_them(tmp_path):
    memory, disk = _pair(tmp_path, fragments=2, log_bytes_per_param=12)
    codec = get_codec("fp16")
    for step in range(3):
        for diloco in (memory, disk):
            _train(diloco, step)
        wire = [(0, 8320, codec.encode(memory.pseudo_gradient(memory.fragment())))]
        for diloco in (memory, disk):
            diloco.outer_step(decode(wire[0][2]), tokens=1, wire=wire)
    fp32 = memory.pseudo_gradient(memory.fragment())  # (an average that never travelled encoded: the ring's)
    for diloco in (memory, disk):
        diloco.outer_step(fp32.clone(), tokens=1)
    _same_state(memory, disk)
    memory.hashed(), disk.hashed()
    assert len(disk.replay_log) == len(memory.replay_log) == 4
    for kept, spilled in zip(memory.replay_log, disk.replay_log):
        assert (kept.round, kept.digest, kept.after, kept.nbytes) == (spilled.round, spilled.digest, spilled.after,
                                                                     spilled.nbytes)
        if kept.wire is not None:
            [(a, b, payload)] = spilled.wire
            assert (a, b) == kept.wire[0][:2] and bytes(payload) == kept.wire[0][2]
            address = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
        else:
            assert torch.equal(spilled.average, kept.average)
            address = spilled.average.data_ptr()
        assert _mapped_from(address).startswith(str(tmp_path / "outer")), "the step's bytes are in a file there"
    assert list((tmp_path / "outer").iterdir()) == []
    behind = DiLoCo(_model(), OuterRecipe(fragments=2))
    behind.replay(disk.steps_since(0, behind.digest()))
    assert (behind.round, behind.digest()) == (4, disk.digest())


def test_its_pages_leave_the_peers_memory_after_each_use(tmp_path):
    _, disk = _pair(tmp_path, fragments=2)
    flat, page = disk.store.flat, 4096
    disk.hashed()
    assert _resident_bytes(flat) <= 2 * page
    flat.add_(0)  # every page read and written: the measure sees them
    assert _resident_bytes(flat) >= flat.numel() * 4 - page
    disk.release()
    assert _resident_bytes(flat) <= 2 * page
    for step in range(3):
        _train(disk, step)
        disk.outer_step(disk.pseudo_gradient(disk.fragment()), tokens=1)
        disk.hashed()
        assert _resident_bytes(flat) <= 2 * page, f"outer step {step}"
    tensors = disk.state_tensors()  # (a state download's copy: the file's pages go again)
    assert _resident_bytes(flat) <= 2 * page and len(tensors) == 16


def test_replay_state_loads_mixing_and_checkpoints_agree_with_memory(tmp_path):
    memory, disk = _pair(tmp_path, fragments=2)
    ahead = DiLoCo(copy.deepcopy(memory.model), OuterRecipe(fragments=2), log_bytes_per_param=12)
    for step in range(3):
        _train(ahead, step)
        ahead.outer_step(ahead.pseudo_gradient(ahead.fragment()), tokens=10)
    ahead.hashed()
    steps = ahead.steps_since(0, disk.digest())
    assert len(steps) == 3
    for diloco in (memory, disk):
        diloco.replay(steps)
    _same_state(memory, disk)
    assert (disk.round, disk.digest()) == (3, ahead.digest())

    mixed = memory.flat_state() * 0.5
    assert torch.equal(disk.flat_state() * 0.5, mixed)
    for diloco in (memory, disk):
        diloco.load_flat_state(mixed)
    _same_state(memory, disk)

    for diloco, name in ((memory, "memory"), (disk, "disk")):
        save_checkpoint(tmp_path / name, diloco.round, diloco.tokens_seen, diloco.state_views(), {},
                        each=diloco.release)
    loaded = [load_latest(tmp_path / name) for name in ("memory", "disk")]
    assert loaded[0].tensors.keys() == loaded[1].tensors.keys()
    assert all(torch.equal(loaded[0].tensors[k], loaded[1].tensors[k]) for k in loaded[0].tensors)
    fresh_memory, fresh_disk = _pair(tmp_path / "again", fragments=2)
    for diloco in (fresh_memory, fresh_disk):
        diloco.load_state_tensors(loaded[1].tensors, loaded[1].round, loaded[1].tokens_seen)
    _same_state(fresh_memory, fresh_disk)
    assert fresh_disk.digest() == disk.digest()


def test_a_directory_it_cannot_use_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match=r"--outer-state-dir .*a-file/outer: cannot keep the outer state there "
                                           r"\(.*\); give a writable directory on a disk with 0.00 GB free"):
        DiLoCo(_model(), OuterRecipe(), outer_state_dir=str(blocker / "outer"))


def test_a_directory_in_memory_is_said_to_be_so(caplog):
    """A tmpfs (/dev/shm, some systems' /tmp) holds the file in memory: the peer says so, and runs on."""
    import shutil
    import tempfile
    from pathlib import Path

    if not Path("/dev/shm").is_dir():
        pytest.skip("this system has no /dev/shm to try a tmpfs with")
    in_memory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with caplog.at_level("WARNING"):
            DiLoCo(_model(), OuterRecipe(), outer_state_dir=in_memory)
        assert f"--outer-state-dir {in_memory} is in memory (a tmpfs)" in caplog.text
    finally:
        shutil.rmtree(in_memory, ignore_errors=True)

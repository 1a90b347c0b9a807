"""DiLoCo around an ordinary inner optimizer: the global params (fp32, CPU) and the outer Nesterov optimizer
live beside the local model; a round's pseudo-gradient is global minus local, and the outer step applies the
group's average of them and resets the local model to the new global params. The last few outer steps are kept
(OuterStep), so a peer a few rounds behind can replay them instead of downloading the whole state.

With `outer.fragments` P > 1 (Streaming DiLoCo, arXiv 2501.18512) the params are cut into P fragments of whole
parameters, in order and of about equal size (`fragment_bounds`), and round r averages and steps fragment r mod P
alone: its pseudo-gradient is taken, its outer step applied and its local params reset, while the other fragments
train on. Each fragment is so averaged every P rounds, and a round's tokens are a P-th of a plain round's.
The state (round, digest, replay log, state sync, checkpoints) stays one: the round number says which fragment
comes next, so every peer of a round agrees on it.

The state digest (round, params, outer momentum) is hashed on a thread of its own after each change of the state,
with blake3 over the tensors' memory (no copy), so the training thread trains on meanwhile and the event loop,
which announces the digest, never waits for it: `identity()` is the last (round, digest) known, `digest()` waits
for the current one. Whatever reads the state in the background (that hash, a checkpoint being written) holds off
the next change of it (`settle`), so nothing copies the state to read it.

With `outer_state_dir` the global params and outer momentum live in a file there (OuterStore), each page of it in
memory only while something reads or writes it: after each such use `release` drops them again; the replay log's
steps keep their bytes in files there too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch

from swarm.config import REPLAY_LOG_BYTES_PER_PARAM, OuterRecipe
from swarm.peer.digest import state_digest
from swarm.peer.outer import OuterStep, OuterStore, fragment_bounds, momenta, outer_update
from swarm.peer.training import eager

logger = logging.getLogger(__name__)


class DiLoCo:
    """Global params + outer optimizer of one peer. Thread-safe snapshots for serving state to other peers."""

    def __init__(self, model: torch.nn.Module, outer: OuterRecipe, log_bytes: Optional[int] = None,
                 log_bytes_per_param: float = REPLAY_LOG_BYTES_PER_PARAM, outer_state_dir: Optional[str] = None):
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        self.local_params = [param for _, param in model.named_parameters()]
        self.store, self._slots = None, None
        if outer_state_dir is None:
            self.global_params = [param.detach().to("cpu", torch.float32).clone() for param in self.local_params]
        else:
            shapes = [param.shape for param in self.local_params]
            self.store = OuterStore(outer_state_dir, sum(param.numel() for param in self.local_params))
            self.global_params, self._slots = self.store.params(shapes), self.store.momentum_slots(shapes)
            with torch.no_grad():
                for mine, param in zip(self.global_params, self.local_params):
                    mine.copy_(param.detach())
            logger.info("outer state: %.2f GB in a file in %s, paged in for a sync", 8 * self.store.numel / 1e9,
                        outer_state_dir)
        self.outer_optimizer = eager(torch.optim.SGD, self.global_params, lr=outer.lr, momentum=outer.momentum,
                                     nesterov=outer.nesterov and outer.momentum > 0)
        self.numel = sum(p.numel() for p in self.global_params)
        self.fragments = fragment_bounds([p.numel() for p in self.global_params], outer.fragments)
        self._sizes = [sum(p.numel() for p in self.global_params[a:b]) for a, b in self.fragments]
        self._spare: list[torch.Tensor] = []  # round buffers handed back (recycle), each of the largest fragment
        if len(self.fragments) > 1:
            logger.info("Streaming DiLoCo: %d fragments of %s parameters, one averaged a round", len(self.fragments),
                        ", ".join(f"{self.fragment_numel(k) / 1e6:.2f}M" for k in range(len(self.fragments))))
        self.round = 0
        self.tokens_seen = 0
        self.lock = threading.RLock()  # guards global params and optimizer state against concurrent readers
        self._digest: Optional[str] = None
        self._identity: tuple[int, str] = (0, "")  # the last (round, digest) hashed: read without any lock
        self.digest_seconds = 0.0  # what the last hash took (on its own thread)
        # Background readers of the state (its hash, a checkpoint being written): a change waits for them.
        self._readers: list[concurrent.futures.Future] = []
        self._readers_lock = threading.Lock()
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-digest")
        self._hashing: Optional[concurrent.futures.Future] = None
        # The latest outer steps, in order and unbroken (a state loaded from elsewhere starts a new log), holding
        # at most `log_bytes`, by default `log_bytes_per_param` a param (the run's AveragingRecipe says how many: a
        # round of its averages). (Its own lock: the hash appends to it, and must never wait for `lock`.)
        self.replay_log: deque[OuterStep] = deque()
        self._log_lock = threading.Lock()
        self.log_bytes = int(log_bytes_per_param * self.numel) if log_bytes is None else log_bytes
        self._parts: list[Optional[bytes]] = []  # each fragment's digest, where hashed (see state_digest)
        self._rehash()

    @classmethod
    def state_only(cls, module: torch.nn.Module, outer: OuterRecipe) -> "DiLoCo":
        """Global params (a copy of `module`'s, which the caller may then drop) and outer momentum alone, with no
        model to train and no replay log: the backup of a pipeline stage that a peer keeps (pipeline/keeper.py)."""
        diloco = cls(module, outer, log_bytes=0)
        diloco.model, diloco.local_params = None, []
        return diloco

    def fragment(self, round_no: Optional[int] = None) -> int:
        """The fragment round `round_no` (by default the current one) averages."""
        return (self.round if round_no is None else round_no) % len(self.fragments)

    def _span(self, fragment: Optional[int]) -> tuple[int, int]:
        return (0, len(self.global_params)) if fragment is None else self.fragments[fragment]

    def fragment_numel(self, fragment: Optional[int] = None) -> int:
        """Elements of `fragment` (None: of the whole model)."""
        return self.numel if fragment is None else self._sizes[fragment]

    def fragment_sizes(self) -> list[int]:
        return list(self._sizes)

    def pseudo_gradient(self, fragment: Optional[int] = None) -> torch.Tensor:
        """Flat fp32 vector of global minus local params of `fragment` (None: all), in parameter order."""
        return self._local_flat(fragment, minus_from_global=True)

    def snapshot(self, fragment: Optional[int] = None) -> torch.Tensor:
        """Local params of `fragment` (None: all), flat fp32 on the CPU (parameter order), in a round buffer (see
        recycle)."""
        return self._local_flat(fragment, minus_from_global=False)

    def _local_flat(self, fragment: Optional[int], minus_from_global: bool) -> torch.Tensor:
        start, end = self._span(fragment)
        numel = self.fragment_numel(fragment)
        out, at = (self._spare.pop() if self._spare else torch.empty(max(self._sizes)))[:numel], 0
        with torch.no_grad():
            for g, l in zip(self.global_params[start:end], self.local_params[start:end]):
                part = out[at:at + g.numel()].view_as(g)
                part.copy_(l.detach())  # (one copy, cast on the way: no whole-model temporary)
                if minus_from_global:
                    torch.sub(g, part, out=part)
                at += g.numel()
        return out

    def recycle(self, *buffers: torch.Tensor) -> None:
        """Keep round buffers (pseudo_gradient's, snapshot's, each the size of the largest fragment) that nobody
        reads any more for the next round's, at most two. Memory taken afresh is faulted in again, on huge pages
        after the kernel compacted some: at 92M the two cost the training thread 1.8 s a round here."""
        for buffer in buffers:
            whole = torch.empty(0).set_(buffer.untyped_storage())  # (all of it: the buffer may be a view)
            if len(self._spare) < 2 and whole.numel() == max(self._sizes):
                self._spare.append(whole)

    def outer_step(self, average: torch.Tensor, tokens: int,
                   wire: Optional[list[tuple[int, int, bytes]]] = None, log: bool = True) -> None:
        """Apply the averaged pseudo-gradient with the outer optimizer, advance the round, reset local params.
        `wire`: the encoded chunks `average` was decoded from (AllReduceResult.wire), kept for replaying; `log`
        False for a step nobody could replay (from a mixing group's state, which only its members held)."""
        fragment = self.fragment()
        start, end = self._span(fragment)
        if average.numel() != self.fragment_numel(fragment):
            raise ValueError(f"averaged pseudo-gradient has {average.numel()} elements, expected "
                             f"{self.fragment_numel(fragment)}")
        self.settle()
        before, round_before = self.digest() if log else "", self.round
        with self.lock, torch.no_grad():
            outer_update(self.global_params[start:end], self.outer_optimizer, average,
                         None if self._slots is None else self._slots[start:end])
            self.round += 1
            self.tokens_seen += int(tokens)
            kept = None if wire or not log else average.to(torch.float32).clone()
            self._rehash(None if not log else lambda after: self._log(
                [OuterStep(round_before, before, after, int(tokens), kept, tuple(wire) if wire else None)]),
                changed=fragment)
        self.reset_local(fragment)
        self.release()

    def _log(self, steps: list[OuterStep]) -> None:
        if self.store is not None:  # (the steps' bytes in files: read only when a peer behind asks for them)
            steps = [self._spilled(step) if step.nbytes <= self.log_bytes else step for step in steps]
        with self._log_lock:
            self.replay_log.extend(steps)
            while sum(s.nbytes for s in self.replay_log) > self.log_bytes:
                self.replay_log.popleft()

    def _spilled(self, step: OuterStep) -> OuterStep:
        if step.wire is not None:
            views = self.store.spill([payload for _, _, payload in step.wire])
            return dataclasses.replace(step, wire=tuple((a, b, view) for (a, b, _), view in zip(step.wire, views)))
        [view] = self.store.spill([memoryview(step.average.to(torch.float32).contiguous().numpy()).cast("B")])
        return dataclasses.replace(step, average=torch.frombuffer(view, dtype=torch.float32))

    # ---- background readers: the state's hash, checkpoints -----------------------------------------------------
    def settle(self) -> float:
        """Wait for the background readers of the state (its hash, a checkpoint being written); the seconds
        waited. Every change of the state calls it first; never call it holding `lock`."""
        started = time.monotonic()
        while True:
            with self._readers_lock:
                self._readers = [reader for reader in self._readers if not reader.done()]
                pending = list(self._readers)
            if not pending:
                return time.monotonic() - started
            concurrent.futures.wait(pending)  # (a reader's failure is its owner's to report)

    def read_in_background(self, read: Callable[[], None],
                           executor: concurrent.futures.Executor) -> concurrent.futures.Future:
        """Run `read` (which reads the state, never changes it, and never takes `lock`) on `executor`; the next
        change of the state waits for it."""
        with self._readers_lock:
            future = executor.submit(read)
            self._readers.append(future)
        return future

    def _rehash(self, then: Optional[Callable[[str], None]] = None, changed: Optional[int] = None) -> None:
        """Hash the state as it is now on the digest thread (it cannot change before the hash is done, see
        settle), then call `then(digest)` there. Called under `lock` with the change it follows, so a reader that
        takes the lock next finds the hash pending and `digest()` waits for it. `changed`: the one fragment the
        change touched (the others' digests are kept), None for all."""
        self._digest = None
        round_no = self.round
        if changed is None:
            self._parts = [None] * len(self.fragments)
        else:
            self._parts[changed] = None

        def read() -> None:
            started = time.monotonic()
            digest = state_digest(self.global_params, momenta(self.global_params, self.outer_optimizer), round_no,
                                  self.fragments, self._parts)
            self.digest_seconds = time.monotonic() - started
            self._digest, self._identity = digest, (round_no, digest)
            self.release()
            if then is not None:
                then(digest)

        self._hashing = self.read_in_background(read, self._hasher)

    def hashed(self) -> None:
        """Wait for the hash of the current state (not for other background readers): the replay log then holds
        the latest outer step. Call it off the event loop."""
        if self._hashing is not None:
            concurrent.futures.wait([self._hashing])

    def identity(self) -> tuple[int, str]:
        """The last (round, digest) hashed, at once: what a heartbeat announces and a state server labels its
        snapshot with (the state of a moment ago while the current one is being hashed)."""
        return self._identity

    def steps_since(self, round_no: int, digest: str) -> list[OuterStep]:
        """The logged outer steps that take the state of `round_no` with params `digest` to ours (empty if the
        log does not reach back to it)."""
        with self._log_lock:
            steps = list(self.replay_log)
        for i, step in enumerate(steps):
            if step.round == round_no and step.digest == digest:
                return steps[i:]
        return []

    def replay(self, steps: list[OuterStep]) -> None:
        """Redo another peer's outer steps from our state, checking the state digest before and after each, then
        take the result. They run on a copy, so the lock (which the heartbeat needs) stays free meanwhile and a
        refused step leaves everything, local params included, as it was: ValueError if one does not apply to our
        state or ends elsewhere, or if our state changed in the meantime."""
        first = self.digest()
        with self.lock:
            start, parts = (self.round, first), list(self._parts)
            tokens_seen = self.tokens_seen
            params = [p.clone() for p in self.global_params]
            buffers = momenta(self.global_params, self.outer_optimizer)
            optimizer = eager(torch.optim.SGD, params, **self.outer_optimizer.defaults)
            for param, buffer in zip(params, buffers):
                if buffer is not None:
                    optimizer.state[param]["momentum_buffer"] = buffer.clone()
        round_no, digest = start
        with torch.no_grad():
            for step in steps:
                if step.round != round_no or step.digest != digest:
                    raise ValueError(f"the outer step of round {step.round} is not from our state")
                fragment = self.fragment(round_no)
                first_param, end_param = self._span(fragment)
                outer_update(params[first_param:end_param], optimizer, step.vector(self.fragment_numel(fragment)))
                round_no, tokens_seen, parts[fragment] = round_no + 1, tokens_seen + step.tokens, None
                digest = state_digest(params, momenta(params, optimizer), round_no, self.fragments, parts)
                if digest != step.after:
                    raise ValueError(f"the outer step of round {step.round} ends at another state")
        self.settle()
        if (self.round, self.digest()) != start:
            raise ValueError("our state changed while replaying")
        with self.lock, torch.no_grad():
            for k, (mine, new) in enumerate(zip(self.global_params, params)):
                mine.copy_(new)
                self._keep_momentum(k, optimizer.state.get(new, {}).get("momentum_buffer"))
            self.round, self.tokens_seen, self._parts = round_no, tokens_seen, parts
            self._digest, self._identity = digest, (round_no, digest)  # (checked above: no need to hash again)
        self._log(steps)  # so we can pass them on
        self.reset_local()
        self.release()

    def _keep_momentum(self, k: int, buffer: Optional[torch.Tensor]) -> None:
        """Global param `k`'s outer momentum := a copy of `buffer` (None: none yet), in its slot where the state
        lives in a file."""
        param = self.global_params[k]
        if buffer is None:
            self.outer_optimizer.state.pop(param, None)
        elif self._slots is None:
            self.outer_optimizer.state[param]["momentum_buffer"] = buffer.to(torch.float32).clone()
        else:
            self.outer_optimizer.state[param]["momentum_buffer"] = self._slots[k].copy_(buffer)

    def release(self) -> None:
        """Where the outer state lives in a file: drop its pages from memory (after anything read it)."""
        if self.store is not None:
            self.store.release()

    def flat_global(self) -> torch.Tensor:
        """A copy of the global params, flat (parameter order)."""
        with self.lock:
            flat = torch.cat([p.view(-1) for p in self.global_params])
        self.release()
        return flat

    def flat_state(self) -> torch.Tensor:
        """Global params then outer momentum (zeros before the first outer step, which torch's SGD treats the
        same), flat fp32: what a mixing group averages besides the pseudo-gradients."""
        with self.lock:
            momentum = momenta(self.global_params, self.outer_optimizer)
            flat = torch.cat([p.view(-1) for p in self.global_params] +
                           [(torch.zeros_like(p) if m is None else m).view(-1)
                            for p, m in zip(self.global_params, momentum)])
        self.release()
        return flat

    def load_flat_state(self, state: torch.Tensor) -> None:
        """Set global params and outer momentum from a `flat_state()` layout (a mixing group's average of them),
        before the outer step applies the group's averaged pseudo-gradient."""
        if state.numel() != 2 * self.numel:
            raise ValueError(f"averaged state has {state.numel()} elements, expected {2 * self.numel}")
        self.settle()
        with self.lock, torch.no_grad():
            offset = 0
            for k, param in enumerate(self.global_params):
                param.copy_(state[offset:offset + param.numel()].view_as(param))
                momentum = state[self.numel + offset:self.numel + offset + param.numel()].view_as(param)
                if self.outer_optimizer.defaults["momentum"] > 0:
                    self._keep_momentum(k, momentum)
                offset += param.numel()
            with self._log_lock:
                self.replay_log.clear()  # a mixed state is nobody's to replay from
            self._rehash()

    def progress(self, snapshot: torch.Tensor, fragment: Optional[int] = None) -> torch.Tensor:
        """Local params of `fragment` (None: all) minus `snapshot` (a `snapshot()` of them taken earlier), written
        over `snapshot` and returned: the progress made since, with no fragment's worth of memory more."""
        start, end = self._span(fragment)
        with torch.no_grad():
            offset = 0
            for local in self.local_params[start:end]:
                part = snapshot[offset:offset + local.numel()].view_as(local)
                torch.sub(local.detach().to("cpu", torch.float32), part, out=part)
                offset += local.numel()
        return snapshot

    def reset_local(self, fragment: Optional[int] = None) -> None:
        """Local params of `fragment` (None: all) := global params (cast to the model's device and dtype)."""
        start, end = self._span(fragment)
        with torch.no_grad():
            for local, global_ in zip(self.local_params[start:end], self.global_params[start:end]):
                local.copy_(global_.to(local.device, local.dtype))

    def add_to_local(self, delta: torch.Tensor, fragment: Optional[int] = None) -> None:
        """Local params of `fragment` (None: all) += `delta` (flat fp32, parameter order): re-applies local
        progress on new global params."""
        start, end = self._span(fragment)
        with torch.no_grad():
            offset = 0
            for local in self.local_params[start:end]:
                local.add_(delta[offset:offset + local.numel()].view_as(local).to(local.device, local.dtype))
                offset += local.numel()

    def digest(self) -> str:
        """The state digest (round, global params and outer momentum) the swarm compares and announces, of the
        state as it is now: waits for its hash if it is being computed (see identity for one that never waits)."""
        self.hashed()
        if self._digest is None:  # (its hash failed: say why here)
            self._digest = state_digest(self.global_params, momenta(self.global_params, self.outer_optimizer),
                                        self.round, self.fragments, [None] * len(self.fragments))
            self.release()
        return self._digest

    def state_views(self) -> dict[str, torch.Tensor]:
        """Global params and outer momentum as named CPU tensors, not copied: for a background reader (see
        read_in_background), which the next change of the state waits for."""
        tensors = {f"params.{name}": p for name, p in zip(self.names, self.global_params)}
        for name, param in zip(self.names, self.global_params):
            buffer = self.outer_optimizer.state.get(param, {}).get("momentum_buffer")
            if buffer is not None:
                tensors[f"momentum.{name}"] = buffer
        return tensors

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Global params and outer momentum as named CPU tensors (a consistent snapshot)."""
        with self.lock:
            tensors = {f"params.{name}": p.clone() for name, p in zip(self.names, self.global_params)}
            for name, param in zip(self.names, self.global_params):
                buffer = self.outer_optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    tensors[f"momentum.{name}"] = buffer.clone()
        self.release()
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], round_no: int, tokens_seen: int) -> None:
        """Replace global params and outer momentum; raises ValueError if names or shapes do not match."""
        for name, param in zip(self.names, self.global_params):
            found = tensors.get(f"params.{name}")
            if found is None or found.shape != param.shape:
                raise ValueError(f"state has no tensor params.{name} of shape {tuple(param.shape)}")
        self.settle()
        with self.lock, torch.no_grad():
            for k, (name, param) in enumerate(zip(self.names, self.global_params)):
                param.copy_(tensors[f"params.{name}"])
                buffer = tensors.get(f"momentum.{name}")
                self._keep_momentum(k, buffer if buffer is not None and buffer.shape == param.shape else None)
            self.round, self.tokens_seen = int(round_no), int(tokens_seen)
            with self._log_lock:
                self.replay_log.clear()
            self._rehash()
        self.reset_local()
        self.release()

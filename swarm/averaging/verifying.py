"""The butterfly's check of its reducers (verify.py has the arithmetic): after every member committed, each member
reveals its nonce (in its commit) and the hash of every averaged part it received, then sends every other member
its own terms of every part's CenteredClip sum (and, as a reducer, every member's term of its part as it computed
them), and applies the average only if every part passes. A failed part names whom this member accuses: the
retry's matchmaking parts accuser and accused (matchmaking.settled), so a lying reducer, caught by the members
whose terms it must misreport or whose sum it cannot make vanish, averages with nobody."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Optional

import msgpack
import numpy as np
import torch

from swarm.averaging.aggregate import capped_weights
from swarm.averaging.common import AllReduceError
from swarm.averaging.messages import Averaged, MessageError, Reveal
from swarm.averaging.verify import (SKETCH_BUCKETS, SKETCH_SLACK, Sketch, Term, Verdict, chunk_norms, judge,
                                    nonce_commitment, offset_stats, part_seed, rounding, sketched)


def report_bound(members: int, chunks: int) -> int:
    """The most bytes an honest member's verification report takes: its term of every part and, as a reducer,
    every member's term of its part (msgpack floats take 9 bytes)."""
    return 2 * members * (9 * (SKETCH_BUCKETS + 2 * chunks) + 64) + 4096


class Verifying:
    """Mixed into Butterfly: `reveal` and `committed` are the hooks of Run.commit. What does not depend on the
    sketch (each chunk's norms, distance and clipping factor of every term, the result's norms and rounding) is
    worked out chunk by chunk as the averages arrive (`averaged_chunk`, `reduced_chunk`), while the data phase
    waits on the network; after the commits only the sketches are left (a subtraction and a bincount a term).
    Worked out after the commits, the whole check cost every member about a quarter of a second of CPU a round at
    6.5M values."""

    def prepare_checks(self) -> None:
        """Room for what the chunks' arrivals work out (Butterfly.__init__, when the group is verified)."""
        self.offset_stats = [[None] * len(chunks) for chunks in self.chunking]  # our term: offset_stats a chunk
        self.result_stats = [[None] * len(chunks) for chunks in self.chunking]  # (norm, rounding) a chunk
        self.claim_stats = {member: [None] * len(self.chunking[self.index]) for member in self.members}  # our part

    def averaged_chunk(self, j: int, k: int, meta: dict) -> None:
        """Chunk k of reducer j's part came back (its average in self.result, `meta` its accounts): our term of it."""
        a, b = self.chunking[j][k]
        try:
            averaged = Averaged.from_wire(meta)
        except MessageError:
            return  # (check_accounts fails the attempt)
        if averaged.radius is None or not math.isfinite(averaged.radius) or averaged.cap is None:
            return  # (`radii` fails the part after the commits)
        self.offset_stats[j][k] = offset_stats(self.mine_at(j, a, b), self.result[a:b], averaged.radius, averaged.cap)
        self.result_stats[j][k] = self.chunk_stats(a, b)

    def reduced_chunk(self, k: int, contributors: list[str], parts: list[torch.Tensor], norms: list[float],
                      radius: float, cap: float) -> None:
        """We averaged chunk k of our part from `parts` (of `contributors`, whose norm64 are `norms`): every
        member's term of it."""
        a, b = self.chunking[self.index][k]
        for member, part, norm in zip(contributors, parts, norms):
            self.claim_stats[member][k] = offset_stats(part, self.result[a:b], radius, cap, norm)
        self.result_stats[self.index][k] = self.chunk_stats(a, b)

    def chunk_stats(self, a: int, b: int) -> tuple[float, float]:
        result = self.result[a:b]
        return chunk_norms(result, [(0, b - a)])[0], rounding([self.average_codec_at(a)], result, [(0, b - a)])[0]

    def mine_at(self, j: int, a: int, b: int) -> torch.Tensor:
        if j == self.index and not self.codec_at(a).own_part_encoded or a == b:
            return self.vector[a:b]
        if self.delivered is not None:
            return self.delivered[a:b]
        # What the reducer decoded: the same bytes, encoded again chunk by chunk as they were sent (each chunk with
        # its own codec: a mixing group's lossless tail; its own scale: fp16's). [a, b) is a chunk of part j or all.
        return torch.cat([self.codec_at(c).round_trip(self.vector[c:d])
                          for c, d in self.chunking[j] if a <= c and d <= b])

    def relative(self, j: int) -> list[tuple[int, int]]:
        start = self.bounds[j][0]
        return [(a - start, b - start) for a, b in self.chunking[j]]

    def reveal(self) -> Optional[Reveal]:
        if not self.verifying:
            return None
        nonce = self.context.nonce_for(self.group.commitments[self.index])
        if nonce is None:  # (our entry's commitment is not one we made: nothing to reveal, so nothing to verify)
            raise AllReduceError("unverified", f"round {self.group.round}: no nonce behind our commitment", set())
        self.revealed = Reveal(nonce, self.part_hashes())
        return self.revealed

    def hashed(self, j: int, a: int) -> None:
        """The averaged chunk of part j starting at `a` is in self.wire: into that part's hash (chunks come in
        order; hashed as they come, the 12.5 MB of averages of a 25 MB fp16 round are not hashed after the data
        phase, when every member waits)."""
        self.part_digests[j].update(self.wire[a][2])

    def part_hashes(self) -> tuple[str, ...]:
        """The sha256 of each part's averaged bytes as we hold them ("" for a part with no elements)."""
        return tuple(digest.hexdigest()[:32] if chunks else "" for digest, chunks in zip(self.part_digests,
                                                                                          self.chunking))

    async def committed(self, commits: dict) -> None:
        """Check every part before we apply the average (servers only: a client member applies only if every
        server does, and they check)."""
        if not self.verifying:
            return
        began = time.monotonic()
        try:
            await self._check(commits)
        finally:
            self.verification_seconds = time.monotonic() - began

    async def _check(self, commits: dict) -> None:
        mine = self.revealed.hashes  # (reveal() made our commit's body before the commits were collected)
        nonces = {self.me: self.revealed.nonce}
        for peer in self.others:
            try:
                reveal = Reveal.from_wire(commits[peer], len(self.members))
            except MessageError as e:
                self.fail(f"{peer[-8:]}'s commit: {e}", {peer})
            if nonce_commitment(reveal.nonce) != self.group.commitments[self.members.index(peer)]:
                self.fail(f"{peer[-8:]} revealed a nonce it had not committed to", {peer})
            nonces[peer] = reveal.nonce
            for j, (theirs, ours) in enumerate(zip(reveal.hashes, mine)):
                if theirs != ours:
                    # Who sent whom which bytes is known to the reducer and the receiver alone: each accuses the other.
                    accused = {peer} if j == self.index or self.members[j] == peer else set()
                    self.fail(f"{peer[-8:]} holds other averages of {self.members[j][-8:]}'s part than we do",
                              accused)
        seeds = [part_seed(self.group.group_id, [nonces[m] for m in self.members], j) for j in range(len(self.members))]
        sketches = {j: Sketch.of(seeds[j], b - a) for j, (a, b) in enumerate(self.bounds) if b > a}
        radii = {j: self.radii(j) for j in sketches}  # (radii, caps) of each chunk
        report = {"terms": [self.term_of(j, self.mine(j), self.offset_stats[j], sketches[j], *radii[j]).to_wire()
                            if j in sketches and j != self.index else None for j in range(len(self.members))]}
        if self.index in sketches:
            claims = self.claims(sketches[self.index], *radii[self.index])
            report["claims"] = {peer: claim.to_wire() for peer, claim in claims.items()}
            report["terms"][self.index] = report["claims"][self.me]
        reports = await self.exchange(msgpack.packb(report))
        reports[self.me] = report
        verdicts = [self.judge_part(j, reports, *radii[j]) for j in sorted(sketches)]
        failed = [v for v in verdicts if not v.ok]
        if failed:
            self.fail("; ".join(v.why for v in failed), set().union(*(v.accused for v in failed)))

    def fail(self, why: str, accused: set[str]) -> None:
        raise AllReduceError("unverified", f"round {self.group.round}: averages not verified ({why}); nothing "
                                           "applied", set(), set(accused) - {self.me})

    def radii(self, j: int) -> tuple[list[float], list[float]]:
        """Reducer j's radius and norm cap of each chunk of its part, as its accounts name them (its total weight
        checked)."""
        reducer, expected = self.members[j], sum(capped_weights(self.group.weights))
        radii, caps = [], []
        for meta in self.accounts.get(reducer, []):
            averaged = Averaged.from_wire(meta)  # (check_accounts has read every one already)
            if averaged.radius is None or not math.isfinite(averaged.radius) or averaged.cap is None or \
                    not math.isclose(averaged.total_weight, expected, rel_tol=1e-9):
                self.fail(f"{reducer[-8:]} names no radius, no norm cap or another total weight", {reducer})
            radii.append(averaged.radius)
            caps.append(averaged.cap)
        if len(radii) != len(self.chunking[j]):
            self.fail(f"{reducer[-8:]}'s accounts do not cover its part", {reducer})
        return radii, caps

    def mine(self, j: int) -> torch.Tensor:
        """Our contribution to part j as its reducer decoded it (our own part: the vector itself, which we
        aggregate as it is, unless the codec encodes that too: Codec.own_part_encoded)."""
        return self.mine_at(j, *self.bounds[j])

    def term_of(self, j: int, contribution: torch.Tensor | list[torch.Tensor], stats: list, sketch: Sketch,
                radii: list[float], caps: list[float]) -> Term:
        """A term of part j (`contribution`: its values, or their pieces chunk by chunk) whose chunks'
        offset_stats are `stats` (worked out now where a chunk's arrival could not, e.g. its radius was missing,
        which fails the part anyway)."""
        start, end = self.bounds[j]
        result = self.result[start:end]
        chunks = self.relative(j)
        pieces = [contribution[a:b] for a, b in chunks] if isinstance(contribution, torch.Tensor) else contribution
        stats = [s if s is not None else offset_stats(piece, result[a:b], radius, cap)
                 for s, piece, (a, b), radius, cap in zip(stats, pieces, chunks, radii, caps)]
        return sketched(pieces, result, chunks, stats, sketch)

    def claims(self, sketch: Sketch, radii: list[float], caps: list[float]) -> dict[str, Term]:
        """Every member's term of our part, from the contributions as we decoded them (chunk by chunk: no copy
        of a whole part)."""
        claims = {self.me: self.term_of(self.index, self.mine(self.index), self.claim_stats[self.me], sketch, radii,
                                        caps)}
        for sender in self.others:
            payloads = [self.mailbox.slot("part", sender, k).result()[1] for k in range(len(self.chunking[self.index]))]
            pieces = [self.codec_at(a).decode(payload, max_numel=b - a)
                      for (a, b), payload in zip(self.chunking[self.index], payloads)]
            claims[sender] = self.term_of(self.index, pieces, self.claim_stats[sender], sketch, radii, caps)
        if self.bad == "lying-reducer":
            claims[self.me] = self.cover_up(claims, radii)
        return claims

    def cover_up(self, claims: dict[str, Term], radii: list[float]) -> Term:
        """(Fault injection.) The lying reducer's best claim of its own term: minus the others' weighted sum, cut
        to the longest a term may be."""
        weights = dict(zip(self.members, capped_weights(self.group.weights)))
        others = sum(weights[p] * np.asarray(claims[p].sketch) for p in self.others)
        own = -others / weights[self.me]
        longest = 0.999 * math.sqrt(SKETCH_SLACK * sum(r * r for r in radii))
        if np.linalg.norm(own) > longest:
            own = own / np.linalg.norm(own) * longest
        return Term(tuple(float(x) for x in own), claims[self.me].norms, claims[self.me].distances)

    async def exchange(self, payload: bytes) -> dict[str, dict]:
        """Send our report to every other server member and collect theirs (a member that sends none within the
        phase deadline fails the attempt, as a missing commit does)."""
        await asyncio.gather(*(self.send(peer, self.header("verify", 1), _one(payload)) for peer in self.servers))
        deadline = asyncio.get_running_loop().time() + self.phase_timeout
        reports, missing = {}, set()
        for peer in self.servers:
            slot = self.mailbox.slot("verify", peer, 0)
            remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
            if not slot.done():
                await asyncio.wait([slot, self.mailbox.slot("abort", peer)], timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
            if not slot.done():
                missing.add(peer)
                continue
            try:
                report = msgpack.unpackb(slot.result()[1])
            except Exception:  # noqa: BLE001 - a report that does not parse is a bad report
                report = None
            reports[peer] = report if isinstance(report, dict) else {}
        if missing:
            raise AllReduceError("commit", f"round {self.group.round}: {len(missing)} member(s) sent no "
                                           "verification; nothing applied", missing)
        return reports

    def judge_part(self, j: int, reports: dict[str, dict], radii: list[float], caps: list[float]) -> Verdict:
        reducer, chunks = self.members[j], len(self.chunking[j])
        raw_claims = reports.get(reducer, {}).get("claims")
        claims = {peer: Term.from_wire(value, chunks) for peer, value in raw_claims.items()} \
            if isinstance(raw_claims, dict) else {}
        if any(claim is None for claim in claims.values()):
            return Verdict(False, frozenset({reducer}), f"{reducer[-8:]} sent malformed claims")
        own = {}
        for peer, report in reports.items():
            terms = report.get("terms")
            own_term = Term.from_wire(terms[j], chunks) if isinstance(terms, list) and len(terms) == len(
                self.members) else None
            if own_term is None:
                return Verdict(False, frozenset({peer}), f"{peer[-8:]} sent a malformed term")
            own[peer] = own_term
        stats = self.result_stats[j]
        if any(s is None for s in stats):
            stats = [self.chunk_stats(a, b) for a, b in self.chunking[j]]
        verdict = judge(self.me, reducer, self.members, capped_weights(self.group.weights), radii, claims, own,
                        [s[0] for s in stats], [s[1] for s in stats], caps)
        if not verdict.ok:
            return Verdict(False, verdict.accused, f"{reducer[-8:]}'s part: {verdict.why}")
        return verdict


async def _one(payload: bytes):
    yield {}, payload

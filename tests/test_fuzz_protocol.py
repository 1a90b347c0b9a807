"""The protocol fuzzer (scripts/fuzz_protocol.py) finds nothing on the code as it is (tests/test_docs.py runs it whole,
as documented), and does find the holes issue 37 reported when they are put back: so what it checks can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_protocol.py"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_protocol", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_protocol"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["fuzz_protocol"]


def test_every_message_type_s_schema_holds_against_every_mutation(fuzz):
    outcomes = fuzz.schema_level(set(fuzz.ALL_TYPES))
    assert {o.message for o in outcomes} >= {t.name for t in fuzz.MESSAGE_TYPES} | {fuzz.TERM_TYPE}
    assert len(outcomes) >= 1000
    assert [o for o in outcomes if o.violation] == []


def test_the_fuzzer_finds_an_entry_whose_missing_commitment_is_taken_as_none_declared(fuzz, monkeypatch):
    """Issue 37, class 1, put back: a parser that takes a missing field as 'not declared'."""
    from swarm.averaging import matchmaking
    real = matchmaking.parse_candidate

    def lenient(value, verified):
        if isinstance(value, dict) and "commitment" not in value:
            value = {**value, "commitment": "0" * 32 if verified else ""}
        return real(value, verified)

    monkeypatch.setattr(matchmaking, "parse_candidate", lenient)
    monkeypatch.setattr(fuzz, "parse_candidate", lenient)
    outcomes = fuzz.schema_level({"entry"})
    assert any(o.violation and o.field == "commitment" and o.mutation == "omit" for o in outcomes)


def test_the_fuzzer_finds_a_leader_that_mixes_in_a_state_only_it_holds(fuzz, monkeypatch):
    """Issue 37, class 3, put back: members that follow a leader's group whatever digests its members declare."""
    from swarm.averaging import matchmaking
    monkeypatch.setattr(matchmaking, "_unvouched", lambda *args: [])
    monkeypatch.setattr(matchmaking, "lineages", lambda candidates: candidates)
    outcomes = fuzz.matchmaking_level({"matchmaking_final"})
    assert any(o.violation and o.field == "digest" for o in outcomes), [o for o in outcomes if o.violation]

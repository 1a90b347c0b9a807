"""The docker/ tree, checked without Docker (which cannot run on these machines): the Prometheus config and alert
rules pass promtool and the rules' own unit tests, every metric the dashboard and the alerts query is one our
code exports, the dashboard's queries parse, and the compose file and Dockerfiles point at things that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from swarm.bootstrap import SwarmMonitor
from swarm.monitoring.metrics import PeerMetrics
from swarm.monitoring.status_page import StatusBoard

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
ALERTS = DOCKER / "prometheus" / "alerts.yml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "swarm.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
COMPOSE = DOCKER / "compose.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package "
                                    "`prometheus`; .ci/run installs it when run as root)")
# Names of our metrics in a PromQL expression (label values such as job="swarm-bootstrap" do not match).
METRIC_NAME = re.compile(r"\b((?:swarm|process)_[A-Za-z0-9_]*[A-Za-z0-9])\b")
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count",
                   "_created"), "info": ("_info",), "summary": ("", "_sum", "_count", "_created"),
                   "unknown": ("",)}


def promtool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *argv], capture_output=True, text=True, timeout=60)


def exported_names() -> set[str]:
    """Every sample name a peer's or the bootstrap's /metrics can carry, labelled series included."""
    registries = [PeerMetrics().registry, SwarmMonitor(StatusBoard("run", "digest", "bootstrap")).registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
            names.update(sample.name for sample in family.samples)
    return names


def dashboard_exprs() -> list[str]:
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(DASHBOARD.read_text()))
    return exprs


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


@needs_promtool
def test_promtool_accepts_the_prometheus_config_and_its_rules():
    result = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr, "the config must load docker/prometheus/alerts.yml"
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rules_fire_on_the_failures_they_name_and_stay_quiet_otherwise():
    """docker/prometheus/alerts_test.yml feeds each alert the series that must trip it, and a healthy swarm."""
    tested = set(re.findall(r"alertname: (\w+)", (ALERTS.parent / "alerts_test.yml").read_text()))
    assert {"SwarmLostPeers", "SwarmRoundStalled", "SwarmParamsDivergence", "SwarmPeerNotAveraging"} <= tested
    assert tested == set(alert_exprs()), "every alert has a unit test"
    result = promtool("test", "rules", str(ALERTS.parent / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses each dashboard query as the expression of a recording rule."""
    exprs = dashboard_exprs()
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                          for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout


def test_dashboard_and_alerts_query_only_metrics_our_code_exports():
    exported = exported_names()
    queried: dict[str, set[str]] = {}
    for where, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", list(alert_exprs().values()))):
        for expr in exprs:
            for name in METRIC_NAME.findall(expr):
                queried.setdefault(name, set()).add(where)
    assert len(queried) >= 25, f"the parser found too few metric names to mean anything: {sorted(queried)}"
    missing = {name: sorted(places) for name, places in queried.items() if name not in exported}
    assert not missing, f"queried but exported by no swarm process: {missing}"


def test_dashboard_uses_the_provisioned_data_source_and_covers_the_swarm():
    dashboard = json.loads(DASHBOARD.read_text())
    [datasource] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert uids == {datasource["uid"]}
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    text = " ".join(dashboard_exprs())
    for name in ("swarm_peers", "swarm_swarm_round", "swarm_swarm_loss_mean", "swarm_swarm_block_replicas",
                 "swarm_swarm_block_tokens_per_second", "swarm_allreduce_bytes_sent_total",
                 "swarm_allreduce_uncompressed_bytes_sent_total", "swarm_compression_ratio",
                 "swarm_checkpoint_age_seconds", "swarm_device_memory_used_bytes", "swarm_hosted_blocks",
                 "swarm_averaging_failures_total"):
        assert name in text, f"the dashboard shows nothing of {name}"


def test_compose_file_parses_and_wires_the_services_together():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"bootstrap", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == ROOT, f"{name} builds from the repository root"
            assert (context / service["build"]["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"
    # What Prometheus scrapes is what the services serve.
    scrape = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    bootstrap_port = services["bootstrap"]["command"][services["bootstrap"]["command"].index("--metrics-port") + 1]
    assert scrape["swarm-bootstrap"]["static_configs"][0]["targets"] == [f"bootstrap:{bootstrap_port}"]
    peer_sd = scrape["swarm-peers"]["dns_sd_configs"][0]
    for name in ("peer", "peer-cpu"):
        command = services[name]["command"]
        assert command[0] == "join" and name in peer_sd["names"] and "--metrics-host" in command
        assert int(command[command.index("--metrics-port") + 1]) == peer_sd["port"]
    mounts = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert {"/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml"} <= mounts  # rule_files is relative
    grafana_mounts = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/swarm.yml").read_text())["providers"][0]
    assert provider["options"]["path"] in grafana_mounts and "/etc/grafana/provisioning" in grafana_mounts


@pytest.mark.parametrize("dockerfile, base", [("peer.Dockerfile", "nvidia/cuda:"), ("peer-cpu.Dockerfile",
                                                                                     "python:3.11")])
def test_dockerfiles_copy_what_exists_and_pin_our_torch(dockerfile, base):
    text = (DOCKER / dockerfile).read_text()
    assert base in text
    if "cuda" in base:
        assert re.search(r"nvidia/cuda:\S+-runtime-", text), "a CUDA runtime base, not the much larger devel one"
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{dockerfile} copies {source}, which is not in the repository"
    pinned = re.search(r"ARG TORCH_VERSION=(\S+)", text).group(1)
    assert pinned == torch.__version__.split("+")[0], "the images should ship the torch version the tests use"
    assert 'ENTRYPOINT ["swarm-peer"]' in text

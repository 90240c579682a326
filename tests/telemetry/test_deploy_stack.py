"""deploy/, checked statically: there is no container runtime on CI.

The compose file, the collector configuration and the dashboard are parsed and held to what an
operator needs (local-only ports, no default credentials, a health check per service, a
maintained trace backend, alerts that reach Alertmanager, a dashboard that works on any
Prometheus); Alertmanager's configuration goes through ``amtool check-config`` (Debian's
``prometheus-alertmanager``), skipped without it except under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
ENV_EXAMPLE = DEPLOY / ".env.example"
COLLECTOR = DEPLOY / "otel-collector" / "config.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "loomflow.json"

FILTERS = ('job=~"$job"', 'env=~"$env"', 'instance=~"$instance"')


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = load(COMPOSE)["services"]
    return found


def one_shot(name: str) -> bool:
    """A service others wait for to *finish* (it copies a file and exits): no health to check."""
    return any(
        isinstance(s.get("depends_on"), dict)
        and s["depends_on"].get(name, {}).get("condition") == "service_completed_successfully"
        for s in services().values()
    )


# -- compose ---------------------------------------------------------------------------------


def test_every_long_running_service_has_a_health_check() -> None:
    for name, service in services().items():
        if one_shot(name):
            assert service.get("restart") == "no", name
            continue
        check = service.get("healthcheck")
        assert check, f"{name} has no health check"
        assert check.get("test"), f"{name} has no health check command"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_services_wait_for_the_health_of_what_they_need() -> None:
    for name, service in services().items():
        for needed, how in (service.get("depends_on") or {}).items():
            wanted = "service_completed_successfully" if one_shot(needed) else "service_healthy"
            assert how == {"condition": wanted}, (name, needed, how)


def test_every_published_port_binds_loopback_only() -> None:
    published = 0
    for name, service in services().items():
        for port in service.get("ports", []):
            published += 1
            assert isinstance(port, str), (name, port)
            assert port.startswith("127.0.0.1:"), (name, port)
    assert published >= 7


def test_credentials_come_from_the_env_file_and_compose_refuses_without_them() -> None:
    text = COMPOSE.read_text()
    references = re.findall(r"\$\{([A-Z_]+)([^}]*)\}", text)
    assert references
    required = {name for name, _ in references}
    # Every interpolation stops compose with a message when the variable is unset or empty:
    # no silent default like ${POSTGRES_PASSWORD:-loomflow}.
    for name, rest in references:
        assert rest.startswith(":?"), f"${{{name}{rest}}} has a default"
        assert "deploy/.env" in rest
    assert {"POSTGRES_PASSWORD", "GRAFANA_ADMIN_USER", "GRAFANA_ADMIN_PASSWORD"} <= required
    example = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(example) == required
    assert all(value == "" for value in example.values()), "the example ships no password"
    assert ".env" in (DEPLOY / ".gitignore").read_text().split()


def test_grafana_has_no_anonymous_access_and_no_default_admin() -> None:
    env = services()["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert env["GF_SECURITY_ADMIN_USER"].startswith("${GRAFANA_ADMIN_USER:?")
    assert "admin" not in env.values()


def test_traces_go_to_a_maintained_backend() -> None:
    images = {name: s["image"] for name, s in services().items()}
    assert not any("all-in-one" in image for image in images.values())
    match = re.fullmatch(r"jaegertracing/jaeger:(\d+)\.\d+\.\d+", images["jaeger"])
    assert match, images["jaeger"]
    assert int(match.group(1)) >= 2


def test_alerts_reach_alertmanager() -> None:
    assert "alertmanager" in services()
    config = load(PROMETHEUS)
    targets = [
        t
        for am in config["alerting"]["alertmanagers"]
        for sc in am["static_configs"]
        for t in sc["targets"]
    ]
    assert targets == ["alertmanager:9093"]
    mounted = services()["alertmanager"]["volumes"]
    assert "./alertmanager/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in mounted
    am = load(ALERTMANAGER)
    receivers = {r["name"]: r for r in am["receivers"]}
    assert am["route"]["receiver"] in receivers
    [hook] = receivers[am["route"]["receiver"]]["webhook_configs"]
    assert hook["url"].startswith("http")


def test_the_alertmanager_configuration_passes_amtool() -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        message = "amtool is not on PATH (apt-get install prometheus-alertmanager)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    done = subprocess.run(
        [amtool, "check-config", str(ALERTMANAGER)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# -- the collector ---------------------------------------------------------------------------


def test_the_collector_pipelines_refer_only_to_defined_components() -> None:
    config = load(COLLECTOR)
    service = config["service"]
    for extension in service.get("extensions", []):
        assert extension in config["extensions"], extension
    for pipeline, parts in service["pipelines"].items():
        assert parts["receivers"], pipeline
        assert parts["exporters"], pipeline
        for kind in ("receivers", "processors", "exporters"):
            for component in parts.get(kind, []):
                assert component in config[kind], (pipeline, kind, component)
    # Every defined receiver and exporter is used somewhere.
    used = {c for parts in service["pipelines"].values() for k in parts.values() for c in k}
    assert set(config["receivers"]) | set(config["exporters"]) <= used


def test_the_collector_has_a_metrics_pipeline_that_prometheus_scrapes() -> None:
    config = load(COLLECTOR)
    metrics = config["service"]["pipelines"]["metrics"]
    assert "otlp" in metrics["receivers"]
    assert "prometheus" in metrics["exporters"]
    port = config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    scraped = [
        t
        for job in load(PROMETHEUS)["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    ]
    assert f"otel-collector:{port}" in scraped


def test_the_collector_health_check_asks_the_extension_it_enables() -> None:
    config = load(COLLECTOR)
    assert "health_check" in config["service"]["extensions"]
    port = config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    test = services()["otel-collector"]["healthcheck"]["test"]
    assert any(f"127.0.0.1:{port}" in part for part in test)


# -- the dashboard ---------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def test_the_dashboard_has_datasource_job_env_and_instance_variables() -> None:
    found = variables()
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    for name in ("job", "env", "instance", "backend"):
        variable = found[name]
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == "${datasource}", name
        assert re.fullmatch(rf"label_values\(.+, {name}\)", variable["definition"]), name
        assert variable["includeAll"], name
        assert variable["allValue"] == ".*", name
    # Narrower variables follow the wider ones.
    assert 'job=~"$job"' in found["instance"]["definition"]
    assert 'env=~"$env"' in found["instance"]["definition"]


def test_no_panel_or_query_hard_codes_a_data_source() -> None:
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    assert len(panels) >= 14
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_metric_in_every_query_filters_by_job_env_and_instance() -> None:
    checked = 0
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            selectors = re.findall(r"\bloomflow_[a-z_]+(\{[^}]*\})?", target["expr"])
            assert selectors, target["expr"]
            for selector in selectors:
                checked += 1
                for wanted in FILTERS:
                    assert wanted in selector, (panel["title"], target["expr"])
    assert checked >= 18


# -- the alert rules' unit tests ------------------------------------------------------------

RULES = DEPLOY / "prometheus" / "rules" / "loomflow.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "loomflow.rules.test.yml"


def alert_names() -> set[str]:
    return {r["alert"] for g in load(RULES)["groups"] for r in g["rules"] if "alert" in r}


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in load(RULE_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert alert_names() == firing == quiet


def test_the_healthy_day_checks_every_alert_stays_quiet() -> None:
    [healthy] = [c for c in load(RULE_TESTS)["tests"] if c["name"].startswith("a healthy day")]
    checks = healthy["alert_rule_test"]
    assert all(check["exp_alerts"] == [] for check in checks)
    assert {c["alertname"] for c in checks if c["eval_time"] == "150m"} == alert_names()


def test_no_alert_watches_the_replay_hit_ratio() -> None:
    # It is 0 in a healthy steady state and high during crash recovery: not a health signal.
    text = RULES.read_text()
    assert "HitRatio" not in text
    assert 'outcome="hit"' not in text

"""deploy/: the alert rules, the Prometheus configuration and the Grafana dashboard.

The rules and the configuration go through ``promtool`` (Debian's ``prometheus`` package), and
a real Prometheus on loopback scrapes a workload process and answers the dashboard's queries.
Without ``prometheus``/``promtool`` on PATH these tests skip, except under ``CI=true``, where
they fail.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _telemetry_workload import Expected, run_workload
from prometheus_client import CollectorRegistry

from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Metrics, Telemetry

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "loomflow.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "loomflow.rules.test.yml"
CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "loomflow.json"
WORKLOAD = Path(__file__).with_name("_telemetry_workload.py")
RATIO_PANEL = "Replay hit ratio by backend and step kind"


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not on PATH (apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


# -- static checks --------------------------------------------------------------------------


def test_the_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 13 rules found" in done.stdout


def test_the_alert_rules_pass_their_unit_tests() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_prometheus_configuration_is_valid() -> None:
    done = promtool("check", "config", str(CONFIG))
    assert done.returncode == 0, done.stdout + done.stderr


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def exported_names() -> set[str]:
    """Every sample name loomflow exports, after a workload and one of each recording call."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    import asyncio

    asyncio.run(run_workload(InMemoryRuntime(), Telemetry(metrics=metrics, tracing=False), users=1))
    metrics.model_usage(
        provider="anthropic", model="m", input_tokens=1, output_tokens=1, cost_usd=0.1
    )
    metrics.budget_denied("user.tokens_total")
    metrics.guardrail_tripped("input", "block")
    metrics.audit_entry("run.start")
    metrics.tool_error(tool="lookup", error_type="tool_error")
    metrics.runs_by_state("sqlite", {"orphaned": 1})  # set by a recovery worker's sweep
    return {s.name for family in registry.collect() for s in family.samples}


def test_every_metric_the_dashboard_and_rules_use_is_exported() -> None:
    used = set()
    for _, expr in dashboard_queries():
        used.update(re.findall(r"\bloomflow_[a-z_]+", expr))
    used.update(re.findall(r"\bloomflow_[a-z_]+", RULES.read_text()))
    assert len(used) >= 9
    missing = used - exported_names()
    assert not missing, missing


def test_the_dashboard_is_provisionable() -> None:
    data = dashboard()
    assert data["uid"] == "loomflow-runs"
    panels = data["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    datasource_uids = {t["datasource"]["uid"] for p in panels for t in p.get("targets", [])} | {
        p["datasource"]["uid"] for p in panels if "datasource" in p
    }
    # The data source is the dashboard's variable (test_deploy_stack checks the rest).
    assert datasource_uids == {"${datasource}"}
    provisioned = DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yml"
    assert "type: prometheus" in provisioned.read_text()
    titles = {p["title"] for p in panels}
    for wanted in (
        RATIO_PANEL,
        "Journaled steps per second by outcome",
        "Step latency by kind (p50, p95, p99)",
        "Journal write latency by backend (p50, p99)",
        "Budget denials per second by cap",
        "Permission decisions per second",
        "Tokens per second by model",
        "Cost by model (USD per hour)",
        "Runs by state",
        "Recoveries per second by outcome",
        "Orphaned to resumed delay (p50, p99)",
    ):
        assert wanted in titles
    # No panel groups or filters by an identity: there is none to group by.
    for _, expr in dashboard_queries():
        assert not re.search(r"user|session|run_id", expr), expr
    compose = (DEPLOY / "compose.yaml").read_text()
    for service in (
        "postgres:",
        "otel-collector:",
        "prometheus:",
        "alertmanager:",
        "grafana:",
        "jaeger:",
    ):
        assert f"\n  {service}" in compose


# -- a real Prometheus -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


class PromAPI:
    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        try:
            body = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as exc:  # 400: the query does not parse or evaluate
            raise AssertionError(f"{expr}\n{exc.read().decode()}") from exc
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


class Lines:
    """A process's stdout lines, read in a thread so that every wait has a deadline."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        assert process.stdout is not None
        self._stream = process.stdout
        self._thread = threading.Thread(target=self._pump, args=(self._stream,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        """After the process ended: the pump reaches end of file, then the pipe is closed."""
        self._thread.join(timeout=10)
        self._stream.close()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {prefix!r} line from the workload")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line[len(prefix) :].strip()


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Lines, int]]:
    stderr = (tmp_path / "workload.log").open("w")
    process = subprocess.Popen(
        [sys.executable, str(WORKLOAD), str(tmp_path / "journal.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=tmp_path,
    )
    lines = Lines(process)
    try:
        port = int(lines.expect("PORT ", timeout=60))
        yield process, lines, port
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        lines.close()
        stderr.close()


@pytest.fixture
def prometheus(
    tmp_path: Path, workload: tuple[subprocess.Popen[str], Lines, int]
) -> Iterator[PromAPI]:
    binary = require("prometheus")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        f"rule_files:\n  - {RULES}\n"
        "scrape_configs:\n"
        "  - job_name: loomflow\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{workload[2]}']\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    process: subprocess.Popen[bytes] | None = None
    api: PromAPI | None = None
    try:
        for _ in range(3):  # the free port may be taken between our probe and its bind
            port = free_port()
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
            api = PromAPI(f"http://127.0.0.1:{port}")

            def ready(p: subprocess.Popen[bytes] = process, a: PromAPI = api) -> bool:
                if p.poll() is not None:
                    return True  # exited: stop waiting, retry with another port
                with urllib.request.urlopen(f"{a.base}/-/ready", timeout=5) as response:
                    return response.status == 200

            wait_for("prometheus to be ready", ready)
            if process.poll() is None:
                break
        assert process is not None
        assert api is not None
        assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
        yield api
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        log.close()


def substitute(expr: str) -> str:
    """Grafana's variables, as the dashboard would send them for the last 5 minutes."""
    for variable in ("$__rate_interval", "$__range"):
        expr = expr.replace(variable, "5m")
    expr = expr.replace("$job", "loomflow")  # the job of the test's scrape configuration
    for variable in ("$backend", "$env", "$instance"):  # "All"
        expr = expr.replace(variable, ".*")
    return expr


def test_a_real_prometheus_scrapes_a_workload_and_the_dashboard_reads_its_replay_ratio(
    workload: tuple[subprocess.Popen[str], Lines, int], prometheus: PromAPI
) -> None:
    process, lines, _ = workload
    # The series exist at 0 before any step, so a rate over the window starts from 0.
    wait_for(
        "the first scrape",
        lambda: len(prometheus.query('loomflow_journal_steps_total{backend="sqlite"}')) == 16,
    )
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    expected = Expected(**json.loads(lines.expect("DONE ", timeout=180)))
    assert expected.hits == {"model": 12, "tool": 8}
    assert expected.misses == {"model": 40, "tool": 20}

    def scraped_total() -> bool:
        result = prometheus.query('sum(loomflow_journal_steps_total{backend="sqlite"})')
        return bool(result) and float(result[0]["value"][1]) == expected.total

    wait_for("a scrape of the finished workload", scraped_total)

    [ratio_expr] = [expr for title, expr in dashboard_queries() if title == RATIO_PANEL]
    series = prometheus.query(substitute(ratio_expr))
    ratios = {s["metric"]["kind"]: float(s["value"][1]) for s in series}
    assert {s["metric"]["backend"] for s in series} == {"sqlite"}
    # Kinds that had no steps (memory, custom) are left out rather than shown as 0/0.
    assert set(ratios) == {"model", "tool"}
    assert ratios["model"] == pytest.approx(12 / 52, rel=1e-9)
    assert ratios["tool"] == pytest.approx(8 / 28, rel=1e-9)

    # Every other query of the dashboard is valid PromQL on real data.
    for _, expr in dashboard_queries():
        prometheus.query(substitute(expr))

    # The alert rules loaded and evaluate cleanly on real data.
    def rules_evaluated() -> bool:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == 13 and all(r["health"] == "ok" for r in rules)

    wait_for("the rules to evaluate", rules_evaluated)

    def active_alerts() -> set[str]:
        alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
        return {a["labels"]["alertname"] for a in alerts}

    # The failed runs (4 of 28) are over the 10% line: that alert becomes pending. Their
    # provider failures are 4 of 44 live model calls (9%, over 5%): that one too.
    wanted = {"LoomflowRunsFailing", "LoomflowModelCallsFailing"}
    active = wait_for("the failing-runs alerts", lambda: wanted <= active_alerts() or None)
    active = active_alerts()
    assert "LoomflowReplayDivergence" not in active

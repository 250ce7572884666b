"""The deployment examples are valid and agree with the code: the alert rules parse and name
only metrics that exist, the Kubernetes probes ask the health endpoints on the metrics port,
the systemd units run commands that exist with flags that exist."""

from __future__ import annotations

import re
import shlex

import yaml
from click.testing import CliRunner

from engine.cli import cli
from tests.helpers import REPO_ROOT
from tests.test_metrics import EXPECTED

EXAMPLES = REPO_ROOT / "docs" / "examples"


def test_the_alert_rules_parse_and_name_only_metrics_that_exist() -> None:
    rules = yaml.safe_load((EXAMPLES / "prometheus-alerts.yaml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert len(alerts) >= 4

    names = {name for expr in exprs for name in re.findall(r"\b(deferral_[a-z_]+)", expr)}
    assert names
    known = set()
    for name, (kind, _) in EXPECTED.items():
        known.add(name)
        if kind == "counter":
            known.add(f"{name}_total")
        if kind == "histogram":
            known |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    assert names <= known, names - known


def _help_ok(args: list[str]) -> None:
    """The command line parses up to its command (run with --help appended, nothing starts)."""
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, (args, result.output)


def test_the_kubernetes_probes_ask_the_health_endpoints_on_the_metrics_port() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "k8s" / "deferral.yaml").read_text()))
    kinds = set()
    for doc in docs:
        assert doc["kind"] == "Deployment"
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        port = int(args[args.index("--metrics-port") + 1])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == port
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        env = {e["name"] for e in container["env"]}
        assert {"DEFERRAL_DATABASE_URL", "DEFERRAL_FERNET_KEY", "DEFERRAL_METRICS_HOST"} <= env
        i = args.index("--dags")
        kinds.add(args[i - 1])
        _help_ok([*args[:i], *args[i + 2 :]])  # (--dags would want the folder to exist)
    assert kinds == {"scheduler", "worker", "triggerer"}


def test_the_systemd_units_run_deferral_with_flags_that_exist() -> None:
    units = sorted((EXAMPLES / "systemd").glob("*.service"))
    assert [u.name for u in units] == [
        "deferral-scheduler.service",
        "deferral-triggerer.service",
        "deferral-worker.service",
    ]
    for unit in units:
        (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
        argv = shlex.split(line.removeprefix("ExecStart="))[1:]
        i = argv.index("--dags")
        _help_ok([*argv[:i], *argv[i + 2 :]])  # (--dags would want the folder to exist)


def test_the_dockerfile_installs_the_package_and_runs_as_a_user() -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert re.search(r"^RUN pip install \.", text, re.M)
    assert re.search(r"^USER deferral$", text, re.M)
    assert 'ENTRYPOINT ["deferral"]' in text
    # Every package pyproject.toml ships is copied into the build.
    for package in ("engine", "triggers", "operators", "benchmarks"):
        assert f"COPY {package} ./{package}" in text


def test_the_metrics_page_lists_every_metric_with_its_type() -> None:
    text = (REPO_ROOT / "docs/howto/metrics.md").read_text()
    listed = {
        line.split("`")[1]: line.split("|")[2].strip()
        for line in text.splitlines()
        if line.startswith("| `deferral_")
    }
    expected = {
        f"{name}_total" if kind == "counter" else name: kind for name, (kind, _) in EXPECTED.items()
    }
    assert listed == expected

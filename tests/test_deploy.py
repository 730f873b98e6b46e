"""Deployment files checked for real: promtool on the config and rules, a real Prometheus scraping a running
learner, the Grafana dashboard against the server's metric names, and the compose file's wiring."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.metrics import ServerMetrics
from tests.helpers import DATA, LiveServer, settings, wait_for

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"


def tool(name: str) -> str:
    """Path of a Prometheus binary; CI installs Debian's package, a developer machine may lack it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def test_promtool_checks_config_and_rules():
    promtool = tool("promtool")
    subprocess.run([promtool, "check", "config", str(PROMETHEUS / "prometheus.yml")], check=True, capture_output=True)
    subprocess.run([promtool, "check", "rules", str(PROMETHEUS / "rules" / "mepo.rules.yml")], check=True,
                   capture_output=True)


def test_every_alert_fires_when_it_should_and_only_then():
    out = subprocess.run([tool("promtool"), "test", "rules", "mepo.rules.test.yml"], cwd=PROMETHEUS / "rules",
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = yaml.safe_load((PROMETHEUS / "rules" / "mepo.rules.yml").read_text())
    tests = (PROMETHEUS / "rules" / "mepo.rules.test.yml").read_text()
    for rule in rules["groups"][0]["rules"]:
        assert f"alertname: {rule['alert']}" in tests  # every alert has a test


def server_metric_names() -> set[str]:
    """Every series name the server exports, from its own registry (labelled families included), in either role."""
    text = "".join(generate_latest(ServerMetrics(role).registry).decode() for role in ("learner", "replica"))
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                    "info": ["_info"]}.get(kind, [""])
        names |= {family + s for s in suffixes} | {family}
    return names


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "mepo.json").read_text())


def test_dashboard_is_valid_and_uses_only_real_metrics():
    dash = dashboard()
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/datasource.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [a["expr"] for a in dash["annotations"]["list"]]
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["type"] in {"timeseries", "stat", "bargauge"}
        assert p["datasource"]["uid"] == uid and p["targets"]
        exprs += [t["expr"] for t in p["targets"]]
    known = server_metric_names()
    used = {m for e in exprs for m in re.findall(r"\bmepo_[a-z_]+", e)}
    assert used and used <= known, f"unknown metrics in the dashboard: {sorted(used - known)}"
    for name in ("mepo_anytime_accuracy_ratio", "mepo_anytime_accuracy_auc_ratio", "mepo_prequential_accuracy_ratio",
                 "mepo_rolling_accuracy_ratio", "mepo_kafka_consumer_lag_records", "mepo_records_dead_lettered_total",
                 "mepo_drift_detections_total", "mepo_model_version", "mepo_learn_step_duration_seconds_bucket",
                 "mepo_predict_duration_seconds_bucket", "mepo_samples_learned_total", "mepo_replica_lag_versions",
                 "mepo_replica_snapshot_age_seconds", "mepo_replica_snapshots_refused_total",
                 "mepo_class_accuracy_ratio", "mepo_last_learned_timestamp_seconds", "mepo_predict_requests_total",
                 "mepo_delayed_accuracy_ratio", "mepo_label_delay_seconds", "mepo_label_join_images_pending",
                 "mepo_label_join_images_total", "mepo_label_join_labels_waiting",
                 "mepo_label_join_labels_refused_total"):
        assert name in used, f"the dashboard does not show {name}"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboard.yml").read_text())
    assert provider["providers"][0]["type"] == "file"


def test_rules_use_only_real_metrics():
    rules = (PROMETHEUS / "rules" / "mepo.rules.yml").read_text()
    used = set(re.findall(r"\bmepo_[a-z_]+", rules))
    assert used <= server_metric_names(), sorted(used - server_metric_names())


def test_compose_wiring_agrees_with_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"broker", "learner", "replica", "producer", "prometheus", "grafana"}
    scrape = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"][0]
    host, port = scrape["static_configs"][0]["targets"][0].split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    assert f"--port {port}" in " ".join(services["learner"]["command"])
    declared = set(compose["volumes"])
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            elif not source.startswith(("$", "/", "..")):
                assert source in declared, f"{name} uses undeclared volume {source}"
        check = svc.get("healthcheck", {})
        assert check.get("test") or check.get("disable") or name in {"learner", "replica"}  # the image's HEALTHCHECK
    replica, jobs = services["replica"], yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
    assert "mepo replica" in replica["command"][0] and "--port 8000" in replica["command"][0]
    assert all("$${MEPO_MODEL_FLAGS}" in services[s]["command"][0] for s in ("learner", "replica"))
    assert {"names": ["replica"], "type": "A", "port": 8000} in [c for j in jobs for c in j.get("dns_sd_configs", [])]
    assert replica["ports"] == ["8001-8004:8000", "8082-8085:8081"]  # HTTP and gRPC
    assert all("--grpc_port 8081" in services[s]["command"][0] for s in ("learner", "replica"))
    assert "8081:8081" in services["learner"]["ports"]
    grafana_mounts = " ".join(services["grafana"]["volumes"])
    assert "./grafana/provisioning:/etc/grafana/provisioning" in grafana_mounts
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboard.yml").read_text())
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}" in grafana_mounts
    for svc, port in (("learner", 8000), ("prometheus", 9090), ("grafana", 3000)):
        assert f"{port}:{port}" in services[svc]["ports"]


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_runs_as_its_own_user_exposes_the_served_ports_and_checks_a_served_route():
    """The Dockerfile by its instructions: a USER created by useradd (not root), EXPOSE of every container port
    compose publishes for the learner, a HEALTHCHECK that requests a route the app serves on the default port,
    and an entry point that is the ``mepo`` command with a subcommand it has."""
    from mepo_stream.cli import main as mepo
    from server.config import ServeConfig
    from server.serve import start_role
    from server.web.app import create_app
    from tests.helpers import NO_BROKER

    instructions = dockerfile()
    args = {name: [a for n, a in instructions if n == name] for name, _ in instructions}
    [user] = args["USER"]
    assert user not in ("root", "0") and any(re.search(rf"useradd\b.*\b{user}\b", a) for a in args["RUN"])
    exposed = {int(p) for a in args["EXPOSE"] for p in a.split()}
    published = {int(p.split(":")[-1]) for p in yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"][
        "learner"]["ports"]}
    assert published <= exposed, (published, exposed)
    [check] = args["HEALTHCHECK"]
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S*?)['\"]", check)
    assert url and int(url.group(1)) == ServeConfig.port
    app = create_app(settings(NO_BROKER, Path("/tmp/unused")), start_role)  # not started: routing only
    answer = TestClient(app, raise_server_exceptions=False).get(url.group(2))
    assert answer.status_code != 404 and TestClient(app).get("/no-such-route").status_code == 404, answer
    assert json.loads(args["ENTRYPOINT"][0]) == ["mepo"]
    command = json.loads(args["CMD"][0])
    with pytest.raises(SystemExit) as shown:  # the subcommand and its options parse (--help exits 0)
        mepo([*command, "--help"])
    assert shown.value.code == 0


def test_the_docs_deploy_commands_name_files_that_exist():
    """Every ``-f FILE`` of a ``docker compose`` or ``docker build`` command in the docs (README included; bash
    blocks and inline code) names a file of this repository."""
    from tests.helpers import code_blocks

    named = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        lines = [line for block in code_blocks(text, "bash") for line in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`([^`\n]+)`", text)
        named += [(page.name, f) for line in lines if re.search(r"docker (compose|build)\b", line)
                  for f in re.findall(r"(?:^|\s)-f (\S+)", line)]
    assert len(named) >= 3, named
    assert all((ROOT / f).is_file() for _, f in named), [n for n in named if not (ROOT / n[1]).is_file()]


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_a_real_prometheus_scrapes_the_learner(broker, tmp_path):
    """The shipped Prometheus config, pointed at a running learner: accuracy series in [0, 1], learning grows."""
    binary = tool("prometheus")
    cfg = settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=48))
    with LiveServer(cfg) as http:
        config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{http.base_url.port}"]
        config["global"]["scrape_interval"] = "1s"
        config["rule_files"] = [str(PROMETHEUS / "rules" / "mepo.rules.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with open(tmp_path / "prometheus.log", "wb") as log:  # the child holds its own handle
            prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            # Prometheus opens its port when its storage is ready: seconds on a cold or busy machine
            def ready() -> bool:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]  # exited: say why
                return httpx.get(f"{url}/-/ready", timeout=10).is_success

            wait_for(ready, 120, "Prometheus to listen", ignore=(httpx.TransportError,))
            produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig(limit=96))
            first = wait_for(lambda: query(url, "mepo_samples_learned_total"), 120, "a scrape of samples learned")
            produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig())
            wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= 200, 180, "the whole stream")
            last = wait_for(lambda: [r for r in query(url, "mepo_samples_learned_total")
                                     if float(r["value"][1]) >= 200], 60, "a scrape after the stream")
            assert float(last[0]["value"][1]) > float(first[0]["value"][1])
            for name in ("mepo_anytime_accuracy_ratio", "mepo_anytime_accuracy_auc_ratio"):
                series = wait_for(lambda n=name: query(url, n), 60, name)
                assert 0.0 <= float(series[0]["value"][1]) <= 1.0
            per_class = wait_for(lambda: query(url, "mepo_class_accuracy_ratio"), 60, "per-class accuracy")
            names = set(http.get("/v1/status").json()["class_accuracy"])
            assert {r["metric"]["class_name"] for r in per_class} == names and len(names) == 10
            assert all(0.0 <= float(r["value"][1]) <= 1.0 for r in per_class)
            assert wait_for(lambda: query(url, "time() - mepo_last_learned_timestamp_seconds"), 60, "last learned")
            assert query(url, 'up{job="mepo-learner"}')[0]["value"][1] == "1"
        finally:
            prom.terminate()
            prom.wait(30)


def test_accuracy_gauges_are_nan_until_measured():
    """A dashboard must not show 0 % accuracy before anything was measured (/v1/status says null there)."""
    text = generate_latest(ServerMetrics("learner").registry).decode()
    for name in ("mepo_prequential_accuracy_ratio", "mepo_rolling_accuracy_ratio", "mepo_anytime_accuracy_ratio",
                 "mepo_anytime_accuracy_auc_ratio", "mepo_last_accuracy_ratio"):
        assert f"\n{name} NaN\n" in text, name

"""The live page at ``/`` in a real browser (headless Chromium through the Debian chromedriver).

Chromium loads the page against a running learner (the real broker and the in-process server of
``test_streaming``), waits until the any-time accuracy curve has points, uploads images and reads the answers;
a stub status shows the initial all-null state and the replicas section. Set ``MEPO_PAGE_SCREENSHOT=path.png`` to
keep a copy of the screenshot (``docs/live-page.png`` comes from such a run).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from mepo_stream.data import list_files
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.web.routers import page
from tests.helpers import DATA, LiveServer, settings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
EMPTY_STATUS = {"samples_seen": 0, "classes_seen": 0, "model_version": 0,
                "anytime_accuracy": {"last": None, "a_auc": None, "evaluations": 0, "samples": [], "accuracy": []},
                "a_last": None, "prequential_accuracy": {"cumulative": None, "rolling": None, "samples": 0},
                "drift_events": [], "dead_lettered": 0, "replays_skipped": 0, "checkpoint_age_seconds": None,
                "idle_seconds": None, "class_accuracy": {}, "paused": False, "kafka_connected": False,
                "consumer_lag": {}, "learner_error": None}


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium, shared by this module's tests; skipped where Chromium or chromedriver is missing."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1300",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def wait_until(driver: WebDriver, condition, what: str, timeout: float = 120):
    """Poll ``condition(driver)`` until it is truthy (WebDriverWait, no fixed sleeps); the message says what."""
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=(WebDriverException,)).until(
        condition, message=f"page never showed {what}")


def text(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def script_errors(driver: WebDriver) -> list[str]:
    """Console errors other than the HTTP errors the tests provoke on purpose (a 4xx upload logs one)."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]


def upload(driver: WebDriver, path: Path) -> None:
    """Choose ``path`` in the page's file input, as a person would."""
    driver.find_element(By.ID, "file-input").send_keys(str(path))


def save_screenshot(driver: WebDriver, path: Path) -> None:
    """Screenshot into the test's tmp_path, and a copy to $MEPO_PAGE_SCREENSHOT when set (docs/live-page.png)."""
    assert driver.save_screenshot(str(path)), "Chromium took no screenshot"
    if os.environ.get("MEPO_PAGE_SCREENSHOT"):
        shutil.copyfile(path, os.environ["MEPO_PAGE_SCREENSHOT"])


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """uvicorn serving ``app`` on a free port in a background thread; yields the page URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            thread.join(0.05)
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(30)


def stub_app(status: dict) -> FastAPI:
    """The page's router with a fixed /v1/status and a /v1/predict that refuses like a model with no classes."""
    app = FastAPI()
    app.include_router(page.router)
    app.get("/v1/status")(lambda: status)
    app.post("/v1/predict")(lambda: JSONResponse({"error": "no class learned yet", "reason": "no_classes_yet"}, 503))
    return app


def test_page_routes_serve_the_static_files_only():
    client = TestClient(stub_app(EMPTY_STATUS))
    html = client.get("/")
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert 'src="static/page.js"' in html.text and "://" not in html.text  # nothing fetched from elsewhere
    assert client.get("/static/page.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/page.css").headers["content-type"].startswith("text/css")
    missing = client.get("/static/..%2Fpage.py")
    assert missing.status_code == 404 and "/" not in client.app.openapi()["paths"]


def test_initial_status_with_nulls_and_a_replicas_section(browser, tmp_path):
    """Nothing learned yet (every accuracy null): dashes, no curve points, a readable 503; replicas when present."""
    status = {**EMPTY_STATUS, "replicas": [{"name": "predict-1", "model_version": 3, "lag": None}]}
    with serve_app(stub_app(status)) as url:
        browser.get(url)
        wait_until(browser, lambda d: text(d, "samples") == "0", "the first status")
        assert {text(browser, i) for i in ("a-auc", "a-last", "prequential", "rolling")} == {"—"}
        assert browser.find_element(By.ID, "curve").get_attribute("data-points") == "0"
        assert "No evaluations yet" in text(browser, "curve-note")
        assert "predict-1" in text(browser, "replicas") and "model_version" in text(browser, "replicas")
        (tmp_path / "a.png").write_bytes(b"not decoded by the stub")
        upload(browser, tmp_path / "a.png")
        wait_until(browser, lambda d: text(d, "answer").startswith("Could not predict"), "the upload error")
        assert "HTTP 503 (no_classes_yet): no class learned yet" in text(browser, "answer")
        assert script_errors(browser) == []
        assert browser.save_screenshot(str(tmp_path / "initial.png"))
        status.pop("replicas")
        wait_until(browser, lambda d: not d.find_element(By.ID, "replicas-panel").is_displayed(), "no replicas")


def test_a_learner_in_a_group_shows_each_learners_partitions_rate_and_lag(browser):
    learners = {"host-a:8000": {"partitions": ["images:0", "images:1"], "samples_per_second": 41.5,
                                "lag": {"images:0": 3, "images:1": 0}},
                "host-b:8000": {"partitions": ["images:2", "images:3"], "samples_per_second": 40.2, "lag": {}}}
    with serve_app(stub_app({**EMPTY_STATUS, "learners": learners})) as url:
        browser.get(url)
        wait_until(browser, lambda d: d.find_element(By.ID, "learners-panel").is_displayed(), "the learners")
        table = text(browser, "learners")
        assert "host-b:8000" in table and "images:3" in table and "41.5" in table and "samples_per_second" in table
        assert not browser.find_element(By.ID, "replicas-panel").is_displayed() and script_errors(browser) == []


def test_labels_that_come_later_show_the_delayed_accuracy_delay_and_backlog(browser):
    join = {"delayed_accuracy": 0.625, "scored": 8, "delay_p50_s": 12.0, "delay_p99_s": 95.5,
            "images": {"received": 20, "joined": 8, "in_flight": 0, "waiting": 9, "expired": 3, "deleted": 0},
            "labels": {"waiting": 2, "refused": 1}}
    status = {**EMPTY_STATUS, "label_join": join}
    with serve_app(stub_app(status)) as url:
        browser.get(url)
        wait_until(browser, lambda d: d.find_element(By.ID, "labels-panel").is_displayed(), "the labels panel")
        shown = {i: text(browser, i) for i in ("delayed-accuracy", "delay-p50", "delay-p99", "images-waiting",
                                               "labels-waiting", "images-expired", "labels-refused")}
        assert shown == {"delayed-accuracy": "0.625", "delay-p50": "12.0", "delay-p99": "95.5", "images-waiting": "9",
                         "labels-waiting": "2", "images-expired": "3", "labels-refused": "1"}
        assert script_errors(browser) == []
        status["label_join"] = None
        wait_until(browser, lambda d: not d.find_element(By.ID, "labels-panel").is_displayed(), "no labels panel")


def test_corrections_and_deletions_show_what_was_applied_and_refused(browser):
    corrections = {"corrections_applied": 40, "corrections_refused": 1, "deletions_applied": 25,
                   "deletions_refused": 2, "ids": 175, "bytes_on_disk": 409600, "retention_s": 604800.0}
    status = {**EMPTY_STATUS, "corrections": corrections}
    with serve_app(stub_app(status)) as url:
        browser.get(url)
        wait_until(browser, lambda d: d.find_element(By.ID, "corrections-panel").is_displayed(), "the panel")
        shown = {i: text(browser, i) for i in ("corrections-applied", "corrections-refused", "deletions-applied",
                                               "deletions-refused", "correctable-ids")}
        assert shown == {"corrections-applied": "40", "corrections-refused": "1", "deletions-applied": "25",
                         "deletions-refused": "2", "correctable-ids": "175"}
        assert script_errors(browser) == []
        status["corrections"] = None
        wait_until(browser, lambda d: not d.find_element(By.ID, "corrections-panel").is_displayed(), "no panel")


def test_the_pill_says_idle_when_nothing_is_learned_and_live_when_learning(browser):
    status = {**EMPTY_STATUS, "kafka_connected": True, "samples_seen": 64, "idle_seconds": 30.0}
    with serve_app(stub_app(status)) as url:
        browser.get(url)
        wait_until(browser, lambda d: text(d, "connection").startswith("idle"), "the idle pill")
        assert text(browser, "connection") == "idle · nothing learned for 30 s"
        assert browser.find_element(By.ID, "connection").get_attribute("class") == "pill idle"
        status["idle_seconds"] = 0.4
        wait_until(browser, lambda d: text(d, "connection") == "live", "the live pill")
        status["paused"] = True
        wait_until(browser, lambda d: text(d, "connection") == "learning paused", "the paused pill")
        assert script_errors(browser) == []


def test_page_follows_the_learner_and_answers_an_upload(broker, browser, tmp_path):
    """The curve fills in as the stream is learned; an upload gets the current model's top-k with probabilities."""
    cfg = settings(broker, tmp_path)
    with LiveServer(cfg) as http:
        browser.get(str(http.base_url))
        wait_until(browser, lambda d: text(d, "samples") == "0", "the first status")
        (tmp_path / "notes.txt").write_text("not an image")
        upload(browser, tmp_path / "notes.txt")
        wait_until(browser, lambda d: "HTTP 422" in text(d, "answer"), "the 422 for a text file")
        produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig())
        wait_until(browser, lambda d: text(d, "a-last") != "—" and text(d, "samples") == "200", "the whole stream")
        status = http.get("/v1/status").json()
        points = browser.find_element(By.ID, "curve").get_attribute("data-points")
        assert int(points) == status["anytime_accuracy"]["evaluations"] >= 3
        assert len(browser.find_elements(By.CSS_SELECTOR, "#curve circle.point")) == int(points)
        assert text(browser, "a-auc") == f"{status['anytime_accuracy']['a_auc']:.3f}"
        assert text(browser, "classes") == "10" and text(browser, "rate") != "—"
        wait_until(browser, lambda d: text(d, "connection").startswith("idle"), "idle once the stream is learned")
        upload(browser, list_files(DATA, "test").files[0])
        rows = wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#top-k li"), "the top-k answer")
        names = set(list_files(DATA, "train").class_names)
        assert len(rows) == 5 and all(r.find_element(By.CLASS_NAME, "name").text in names for r in rows)
        assert f"model version {status['model_version']}" in text(browser, "top-k")
        assert script_errors(browser) == []
        save_screenshot(browser, tmp_path / "live-page.png")

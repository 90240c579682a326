"""The console in a real browser: headless Chromium driven by selenium through Debian's
chromedriver (never a downloaded one). Sign in, find a user, page the trail, verify it,
open an entry and a run, export; a stranger and a reader asking for admin work are refused.

The screenshots of docs/console.md are taken here, so the docs show the real thing.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from console_helpers import ADMIN, BOB, READER, RESUMED, Deployment, Server
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if not missing:
        return
    message = f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver"
    if os.environ.get("CI") == "true":
        pytest.fail(message)  # CI installs them (.ci/run): missing there is a broken build
    pytest.skip(message)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--disable-gpu",
    ):
        options.add_argument(flag)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(tmp_path), "download.prompt_for_download": False},
    )
    # The system driver, by path: selenium's manager never fetches one.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    # A click that submits a form returns before the next page is in: every lookup waits up
    # to this long for its element (a loaded CI machine lost the race once).
    driver.implicitly_wait(10)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: WebDriver, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / f"{name}.png"))


def _sign_in(driver: WebDriver, base: str, token: str, then: str = "/users") -> None:
    from selenium.webdriver.common.by import By

    d = driver
    d.get(base + then)
    assert "/signin" in d.current_url
    d.find_element(By.ID, "token").send_keys(token)
    d.find_element(By.ID, "signin").click()
    WebDriverWait(d, 30).until(lambda drv: "/signin" not in drv.current_url)


def _absent(driver: WebDriver, by: str, value: str) -> bool:
    """No such element on the page, asked without the implicit wait (it would wait it out)."""
    driver.implicitly_wait(0)
    try:
        return not driver.find_elements(by, value)
    finally:
        driver.implicitly_wait(10)


def test_the_compliance_flow_in_chromium(
    browser: WebDriver, console: Server, deployment: Deployment, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    find = d.find_element
    base = console.base

    # A stranger gets the sign-in form, whatever page was asked for.
    d.get(base + "/users/bob")
    assert "/signin" in d.current_url
    find(By.ID, "token").send_keys("not-a-token-anyone-has")
    find(By.ID, "signin").click()
    assert "not known" in find(By.ID, "error").text
    _shot(d, "signin")

    # Sign in and find a user.
    find(By.ID, "token").clear()
    find(By.ID, "token").send_keys(ADMIN)
    find(By.ID, "signin").click()
    WebDriverWait(d, 30).until(lambda drv: "/signin" not in drv.current_url)
    assert d.current_url.endswith("/users/bob")  # where they were going
    d.get(base + "/users")
    find(By.ID, "q").send_keys("bo")
    find(By.ID, "find").click()
    _shot(d, "users")
    links = d.find_elements(By.CSS_SELECTOR, "#users a")
    assert [a.text for a in links] == [BOB]
    links[0].click()
    assert find(By.ID, "user").text == BOB

    # Page the trail.
    first = [r.text for r in d.find_elements(By.CSS_SELECTOR, "#entries tr td:first-child")]
    assert first == [str(n) for n in range(1, 26)]
    find(By.ID, "next").click()
    second = [r.text for r in d.find_elements(By.CSS_SELECTOR, "#entries tr td:first-child")]
    assert second == [str(n) for n in range(26, 51)]

    # Verify the chain: the result is on the page.
    find(By.ID, "verify").click()
    verdict = find(By.ID, "verification")
    assert "Chain verified" in verdict.text
    assert "no problem found" in verdict.text
    _shot(d, "trail")

    # An entry, then its run.
    runs = d.find_elements(By.CSS_SELECTOR, "#entries a.run")
    assert runs
    d.find_element(By.LINK_TEXT, "11").click()
    payload = find(By.ID, "payload").text
    assert "[REDACTED]" in payload  # a secret the writer left in is not shown
    assert "s3cr3t-value-xyz" not in d.page_source
    _shot(d, "entry")
    d.back()
    d.find_elements(By.CSS_SELECTOR, "#entries a.run")[0].click()
    assert find(By.ID, "run-id").text == deployment.runs[BOB]
    assert find(By.ID, "state").text == "finished"
    assert int(find(By.ID, "executed").text) >= 2
    assert "over the limit" in find(By.ID, "story").text
    # A run killed mid-way and resumed: its story tells replayed from executed steps.
    d.get(base + "/users/ana.silva")
    d.find_elements(By.CSS_SELECTOR, "#entries a.run")[-1].click()
    assert find(By.ID, "run-id").text == deployment.runs[RESUMED]
    assert int(find(By.ID, "replayed").text) >= 1
    assert "replayed" in find(By.ID, "story").text
    _shot(d, "run")

    # Export exactly what the filtered trail shows.
    d.get(base + "/users/bob?action=note.*")
    shown = len(d.find_elements(By.CSS_SELECTOR, "#entries tr")) - 1
    find(By.ID, "export").click()
    exported = tmp_path / "audit-export.jsonl"
    deadline = time.monotonic() + 30
    while not exported.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    header, *lines = exported.read_text(encoding="utf-8").splitlines()
    assert '"loomflow_audit_export":1' in header  # it names the filters, then the entries
    assert len(lines) == 60
    assert shown == 25  # the first page of those 60
    assert all('"action":"note.added"' in line for line in lines)
    exported.unlink()
    find(By.ID, "export-page").click()  # this page only
    deadline = time.monotonic() + 30
    while not exported.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(exported.read_text(encoding="utf-8").splitlines()) == 1 + shown

    # Runs by state, for SREs.
    d.get(base + "/runs")
    assert "finished" in find(By.ID, "runs").text
    _shot(d, "runs")

    # Sign out: the pages are closed again.
    d.get(base + "/users")
    d.find_element(By.XPATH, "//button[text()='Sign out']").click()
    # The sign-out post answers with the sign-in page; navigating before it has would race it
    # (a loaded machine let the next page load while still signed in).
    WebDriverWait(d, 30).until(lambda drv: "/signin" in drv.current_url)
    d.get(base + "/users/bob")
    assert "/signin" in d.current_url


def test_a_reader_is_refused_admin_pages_in_chromium(browser: WebDriver, console: Server) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    _sign_in(d, console.base, READER)
    assert "Find a user" in d.page_source
    assert _absent(d, By.LINK_TEXT, "Runs")
    d.get(console.base + "/runs")
    assert "Not allowed" in d.find_element(By.TAG_NAME, "h1").text
    assert "admin role" in d.find_element(By.ID, "error").text
    _shot(d, "refused")
    d.get(console.base + "/users/bob")
    assert _absent(d, By.ID, "export")

"""The chat page in Debian's headless Chromium, driven by selenium, against real gunicorn: stories260K
streams a reply that arrives in pieces and survives a reload; on the fake engine (webui_app) Stop
ends the generation on the server (its running gauge back to 0) and model markup shows as text.
No test leaves a console error. Skips only where chromium, chromedriver or selenium are absent."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from ops_servers import Server, models_dir_with_stories
from webui_app import PAYLOAD, REASONING

pytestmark = [pytest.mark.integration, pytest.mark.slow]
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# TURBOSPARK_SCREENSHOT=docs/chat-page.png keeps the mid-answer screenshot (README's picture).
SCREENSHOT = os.environ.get("TURBOSPARK_SCREENSHOT")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("chromium or chromedriver absent (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # NOTE(flags): no sandbox as root; no background networking, as the machine has no outside network
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1100,760", f"--user-data-dir={tmp_path_factory.mktemp('chrome')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("webui-stories")
    server = Server(tmp, models=models_dir_with_stories(tmp / "models"), model="stories")
    try:
        yield server.wait_ready(timeout=60)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("webui-fake")
    (tmp / "models").mkdir()
    for name in ("fake", "failing"):
        (tmp / "models" / f"{name}.gguf").write_bytes(b"GGUF")
    server = Server(tmp, app="webui_app:app", models=tmp / "models", model="fake")
    try:
        yield server.wait_ready(timeout=60)
    finally:
        server.stop()


def url(server):
    return f"http://127.0.0.1:{server.port}/"


def wait(driver, predicate, timeout=15):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: predicate())


def console_errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, server):
    driver.get(url(server))
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.refresh()
    wait(driver, lambda: Select(driver.find_element(By.ID, "model")).options)
    return Select(driver.find_element(By.ID, "model"))


def assistant_text(driver):
    found = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
    return found[-1].text if found else ""


def test_a_reply_streams_in_pieces_and_the_conversation_survives_a_reload(browser, stories):
    picker = open_page(browser, stories)
    assert [o.text for o in picker.options] == ["stories"] and picker.first_selected_option.text == "stories"
    picker.select_by_visible_text("stories")
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("200")
    # NOTE(pieces): the text's length at every DOM change, recorded in the page as it happens
    browser.execute_script("""window.lengths = [];
        new MutationObserver(() => window.lengths.push(document.getElementById('messages').textContent.length))
            .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});""")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Once upon a time", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "there was")
    assert prompt.get_attribute("value") == "Once upon a time\nthere was"
    prompt.send_keys(Keys.ENTER)
    wait(browser, lambda: "completion tokens" in assistant_text(browser))
    stats = browser.find_element(By.CSS_SELECTOR, "#messages .msg.assistant .stats").text
    assert "tokens/s" in stats and prompt.get_attribute("value") == ""
    assert len(set(browser.execute_script("return window.lengths"))) >= 3
    reply = assistant_text(browser)
    browser.refresh()
    wait(browser, lambda: assistant_text(browser) == reply)
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.user").text.endswith("Once upon a time\nthere was")
    assert [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#conversations li")][0].startswith("Once upon")
    assert console_errors(browser) == []


def test_stop_cancels_on_the_server_and_model_markup_is_text(browser, fake):
    open_page(browser, fake)
    browser.find_element(By.ID, "prompt").send_keys("How do I start?", Keys.ENTER)
    wait(browser, lambda: "one byte at a time" in assistant_text(browser))
    assert fake.metric("turbospark_queue_running") == 1
    if SCREENSHOT:
        browser.save_screenshot(str(Path(SCREENSHOT).resolve()))
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda: "stopped" in assistant_text(browser))
    deadline = time.monotonic() + 5
    while fake.metric("turbospark_queue_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.metric("turbospark_queue_running") == 0
    assert json.loads(fake.get("/health")[2])["queue"]["running"] == 0
    text = assistant_text(browser)
    assert PAYLOAD in text and "one byte at a time" in text and not text.rstrip().endswith("time.")
    messages = browser.find_element(By.ID, "messages")
    assert messages.find_elements(By.TAG_NAME, "img") == []
    assert [li.text for li in messages.find_elements(By.CSS_SELECTOR, ".msg.assistant li")] == [
        "open the page", "pick a model", "ask"]
    assert messages.find_element(By.CSS_SELECTOR, "pre code").text == "print('hello')"
    reasoning = messages.find_element(By.CSS_SELECTOR, ".msg.assistant details.reasoning")
    assert reasoning.get_attribute("open") is None and REASONING not in text
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert reasoning.text == "Reasoning\n" + REASONING
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    assert console_errors(browser) == []


def test_an_error_mid_answer_is_shown_and_the_page_recovers(browser, fake):
    picker = open_page(browser, fake)
    assert picker.first_selected_option.text == "fake"      # the loaded one, not the first listed
    picker.select_by_visible_text("failing")
    browser.find_element(By.ID, "prompt").send_keys("Go", Keys.ENTER)
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant.error"))
    reply = browser.find_element(By.CSS_SELECTOR, "#messages .msg.assistant.error")
    assert reply.find_element(By.XPATH, "./p").text.startswith("Markup from a model")
    assert "request id" in reply.find_element(By.CSS_SELECTOR, ".error-text").text
    assert browser.find_element(By.ID, "send").is_enabled() and fake.metric("turbospark_queue_running") == 0
    assert console_errors(browser) == []


def test_new_and_delete_conversations_and_a_narrow_screen(browser, fake):
    open_page(browser, fake).select_by_visible_text("fake")
    # NOTE(width): headless windows are at least 500 px wide, so 360 px is a device emulation
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 360, "height": 740, "deviceScaleFactor": 1, "mobile": True})
    try:
        for question in ("first", "second"):
            browser.find_element(By.ID, "new-chat").click()
            browser.find_element(By.ID, "prompt").send_keys(question, Keys.ENTER)
            wait(browser, lambda: "one byte at a time" in assistant_text(browser))
            browser.find_element(By.ID, "stop").click()
            wait(browser, lambda: browser.find_element(By.ID, "send").is_enabled())
        assert browser.execute_script("return [innerWidth, document.documentElement.scrollWidth]") == [360, 360]
        titles = lambda: [li.text.split("\n")[0] for li in browser.find_elements(By.CSS_SELECTOR, "#conversations li")]
        assert titles() == ["second", "first"]
        browser.find_element(By.CSS_SELECTOR, "#conversations li button.delete").click()
        assert titles() == ["first"] and browser.find_element(By.CSS_SELECTOR, ".msg.user").text.endswith("first")
        browser.refresh()
        wait(browser, lambda: titles() == ["first"])
        assert console_errors(browser) == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_with_api_keys_the_page_asks_for_one(browser, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake.gguf").write_bytes(b"GGUF")
    server = Server(tmp_path, app="webui_app:app", models=tmp_path / "models", model="fake",
                    api_keys="sk-page").wait_ready(timeout=60)
    try:
        browser.get(url(server))
        key = browser.find_element(By.ID, "api-key")
        wait(browser, key.is_displayed)
        key.send_keys("sk-page", Keys.ENTER)
        wait(browser, lambda: Select(browser.find_element(By.ID, "model")).options)
        assert not key.is_displayed()
    finally:
        server.stop()

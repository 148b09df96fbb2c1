"""The playground page at /: served without a key, its stats endpoint behind one, and a
real headless Chromium (Debian's, driven by selenium through chromedriver) chatting with
a real server on the tiny checkpoint. The browser test skips where Chromium is absent."""

import contextlib
import shutil
import tempfile
import urllib.request

import pytest
import trio
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from structlog.testing import capture_logs

from tests.actors.test_http import in_thread, request, serving, slow_down

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PAGE_IDS = ("model", "messages", "prompt", "send", "api-key", "temperature", "top-p")
STATS = {"num_running", "num_waiting", "kv_cache_usage", "generation_tokens_total"}
KEY = "playground-key"


def get_page(url):
    with urllib.request.urlopen(f"{url}/", timeout=30) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


async def test_the_page_is_open_and_the_stats_need_the_key(tiny):
    async with serving(tiny, api_keys=(KEY,)) as server:
        status, content_type, page = await in_thread(get_page, server.url)
        assert status == 200 and content_type.startswith("text/html")
        assert all(f'id="{name}"' in page for name in PAGE_IDS)
        assert "innerHTML" not in page  # model text is only ever set as textContent
        status, _, body = await in_thread(request, server.url, "GET", "/v1/cadence/stats")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {KEY}"}
        status, _, body = await in_thread(
            request, server.url, "GET", "/v1/cadence/stats", headers=auth
        )
    assert status == 200 and set(body) == STATS
    assert body["num_running"] == body["num_waiting"] == body["generation_tokens_total"] == 0
    assert 0 <= body["kv_cache_usage"] <= 1


async def test_the_stats_count_generated_tokens(tiny):
    async with serving(tiny) as server:
        body = {"model": server.model, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
        status, _, _ = await in_thread(request, server.url, "POST", "/v1/completions", body)
        assert status == 200
        _, _, stats = await in_thread(request, server.url, "GET", "/v1/cadence/stats")
    assert stats["generation_tokens_total"] == 5


async def test_the_stats_show_a_running_request_and_one_waiting_behind_it(tiny):
    async with serving(tiny, max_batch=1) as server:
        running = server.llm.generate("a", max_tokens=900, ignore_eos=True)
        async with running:
            await running.__anext__()  # it holds the only row, and KV blocks
            _, _, alone = await in_thread(request, server.url, "GET", "/v1/cadence/stats")
            async with server.llm.generate("b", max_tokens=5):  # queued behind it
                with trio.fail_after(10):  # until the scheduler has it
                    while True:
                        _, _, both = await in_thread(
                            request, server.url, "GET", "/v1/cadence/stats"
                        )
                        if both["num_waiting"]:
                            break
                        await trio.sleep(0.005)
    assert (alone["num_running"], alone["num_waiting"]) == (1, 0)
    assert (both["num_running"], both["num_waiting"]) == (1, 1)
    assert 0 < alone["kv_cache_usage"] < 1 and alone["generation_tokens_total"] >= 1


@contextlib.contextmanager
def chromium():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Without the background-networking flags Chromium stalls on a closed network.
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory() as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


def chat_in_the_browser(url):
    """Type the key and a message, send it; returns what the page shows once text streamed."""
    with chromium() as driver:
        driver.get(f"{url}/")
        key = driver.find_element(By.ID, "api-key")
        key.send_keys(KEY)
        driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        wait = WebDriverWait(driver, 20)
        wait.until(lambda d: d.find_element(By.ID, "stat-running").text.isdigit())
        for name, value in (
            ("temperature", "0"),
            ("max-tokens", "16"),
        ):  # greedy: the same reply each run
            driver.find_element(By.ID, name).clear()
            driver.find_element(By.ID, name).send_keys(value)
        driver.find_element(By.ID, "prompt").send_keys("Tell me about Python.")
        driver.find_element(By.ID, "send").click()
        reply = ".assistant .content"
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, reply).text.strip())
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())  # the stream ended
        wait.until(lambda d: d.find_element(By.ID, "stat-tps").text not in ("–", "?"))
        return {
            "model": driver.find_element(By.ID, "model").text,
            "reply": driver.find_element(By.CSS_SELECTOR, ".assistant").get_attribute("class"),
            "text": driver.find_element(By.CSS_SELECTOR, reply).text,
            "running": driver.find_element(By.ID, "stat-running").text,
            "tps": driver.find_element(By.ID, "stat-tps").text,
        }


@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
)
async def test_a_browser_chats_with_streaming_and_sees_the_stats(tiny):
    async with serving(tiny, api_keys=(KEY,)) as server:
        shown = await in_thread(chat_in_the_browser, server.url)
        model = server.model
    assert shown["model"] == model
    assert shown["text"] and "error" not in shown["reply"], shown
    assert shown["running"].isdigit()
    float(shown["tps"])  # a number


def stop_and_new_chat_in_the_browser(url):
    """Start a new chat during one reply, stop another, then chat on with an emptied field;
    returns the page's conversation after each, and whether an IME's Enter sent."""
    with chromium() as driver:
        driver.get(f"{url}/")
        wait = WebDriverWait(driver, 20)
        wait.until(lambda d: d.find_element(By.ID, "model").text not in ("loading…", ""))
        for name, value in (("temperature", "0"), ("max-tokens", "900")):
            driver.find_element(By.ID, name).clear()
            driver.find_element(By.ID, name).send_keys(value)

        def streaming(text):
            driver.find_element(By.ID, "prompt").send_keys(text)
            driver.find_element(By.ID, "send").click()
            last = ".message:last-child .content"
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, last).text.strip())

        def conversation():
            wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
            return driver.execute_script("return history.map((m) => m.role + ': ' + m.content)")

        streaming("AGAIN")  # greedy, 900 tokens on the tiny checkpoint
        driver.find_element(By.ID, "clear").click()
        cleared = conversation()
        streaming("Write a long story.")  # 900 tokens too
        driver.find_element(By.ID, "stop").click()
        stopped = conversation()
        driver.find_element(By.ID, "top-p").clear()  # left out: the server's default
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("4")
        streaming("NEW")
        new = conversation()
        driver.find_element(By.ID, "prompt").send_keys("IME")
        driver.execute_script(
            "arguments[0].dispatchEvent(new KeyboardEvent('keydown',"
            " {key: 'Enter', isComposing: true, bubbles: true, cancelable: true}))",
            driver.find_element(By.ID, "prompt"),
        )
        ime_sent = driver.find_element(By.ID, "prompt").get_attribute("value") != "IME"
        errors = driver.find_elements(By.CSS_SELECTOR, ".error")
        return stopped, cleared, new, ime_sent, len(errors)


@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
)
async def test_stop_and_new_chat_abort_the_reply_and_the_new_chat_starts_empty(tiny):
    """There was no stop, and "new chat" left the reply streaming: it was then pushed
    into the new chat's history, sent to the model unseen. An emptied number field was
    sent as 0 (top_p 0: a 400), and the Enter that picks an IME candidate sent."""
    with capture_logs() as logs:
        async with serving(tiny) as server:
            # 900 tokens take 18 s: the clicks land long before a reply could end.
            slow_down(server.llm._engine, 0.02)
            stopped, cleared, new, ime_sent, num_errors = await in_thread(
                stop_and_new_chat_in_the_browser, server.url
            )
    assert stopped[0] == "user: Write a long story." and stopped[1].startswith("assistant: ")
    assert len(stopped) == 2 and len(stopped[1]) > len("assistant: ")  # what came stays
    assert cleared == []
    assert new[:2] == stopped and new[2] == "user: NEW" and len(new) == 4 and num_errors == 0
    assert not ime_sent
    ends = [e["event"] for e in logs if e["event"] in ("aborted", "finished", "failed")]
    assert ends == ["aborted", "aborted", "finished"]  # the server stopped both replies


def think_in_the_browser(url):
    """Send a message with greedy settings; returns the reply's thought and answer as the
    page shows them, once the stream ended."""
    with chromium() as driver:
        driver.get(f"{url}/")
        wait = WebDriverWait(driver, 20)
        wait.until(lambda d: d.find_element(By.ID, "model").text not in ("loading…", ""))
        for name, value in (("temperature", "0"), ("max-tokens", "8")):
            driver.find_element(By.ID, name).clear()
            driver.find_element(By.ID, name).send_keys(value)
        driver.find_element(By.ID, "prompt").send_keys("Tell me about Python.")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.execute_script("return history")) == 2)  # the reply ended
        shown = driver.find_element(By.CSS_SELECTOR, ".assistant").text
        answer = driver.find_element(By.CSS_SELECTOR, ".assistant .content").text
        return shown, answer, driver.execute_script("return history[1]")


@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
)
async def test_a_thinking_models_thought_shows_and_is_sent_back(make_checkpoint, tmp_path):
    """A `<think>` model's thought leaves as `reasoning`, which the page did not read: a
    QwQ reply still thinking at max_tokens showed as an empty message (and the stream as
    nothing at all until the answer began)."""
    from tests.actors.test_http_think import QWQ, with_tags

    checkpoint = with_tags(make_checkpoint, tmp_path / "qwq-like", QWQ, special=False)
    body = {
        "messages": [{"role": "user", "content": "Tell me about Python."}],
        "max_tokens": 8, "temperature": 0, "top_p": 1,
    }
    async with serving(checkpoint) as server:
        status, _, api = await in_thread(
            request, server.url, "POST", "/v1/chat/completions", {"model": server.model, **body}
        )
        shown, answer, sent_back = await in_thread(think_in_the_browser, server.url)
    message = api["choices"][0]["message"]
    assert status == 200 and message["reasoning"].strip()  # greedy: the same reply both times
    thought_and_answer = "\n".join(part for part in (message["reasoning"], message["content"]) if part)
    assert shown.split("\n", 1) == ["assistant", thought_and_answer], shown
    assert answer == message["content"]
    assert sent_back == {"role": "assistant", "content": message["content"], "reasoning_content": message["reasoning"]}

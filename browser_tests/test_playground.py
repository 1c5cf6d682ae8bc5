"""The playground page in a real headless Chromium (`make test-browser`; not part of `make test`).

Asks the demo VLM about a scene twice through the page (the second answer drafts from the
first), then checks the answer equals greedy decoding, that accepted drafts are highlighted,
and saves a screenshot to ``browser-out/playground.png``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from tests.test_serve import _greedy_text, serving  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "browser-out"


@pytest.fixture
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.fail("Chromium is not installed: run `make test-browser`, which installs it")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=900,900"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_playground_streams_an_answer_with_drafts_highlighted(browser, tmp_path):
    from recap.demo_vlm.scenes import HELD_OUT_START, make_example

    image = make_example(HELD_OUT_START + 1).image()
    path = tmp_path / "scene.png"
    image.save(path)
    expected = _greedy_text("recap-demo-vlm", "Describe the image.", image, 48)
    with serving("recap-demo-vlm") as (url, _):
        browser.get(url)
        browser.find_element(By.ID, "image").send_keys(str(path))
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "preview").is_displayed())
        limit = browser.find_element(By.ID, "max-tokens")
        limit.clear()
        limit.send_keys("48")
        for _ in range(2):
            browser.find_element(By.ID, "ask").click()
            WebDriverWait(browser, 120).until(
                expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#answer[data-done='1']")))
        answer = browser.find_element(By.ID, "answer")
        drafted = browser.find_elements(By.CSS_SELECTOR, "#answer .drafted")
        stats = browser.find_element(By.ID, "stats").text
        OUT.mkdir(exist_ok=True)
        browser.save_screenshot(str(OUT / "playground.png"))
    assert answer.text.strip() == expected.strip()
    assert drafted and all(span.text for span in drafted), "no accepted draft was highlighted"
    assert "tau" in stats and "tokens/s" in stats
    assert (OUT / "playground.png").stat().st_size > 10_000


@pytest.fixture
def other_origin(tmp_path):
    """A second local web server (another port: another origin) serving ``tmp_path``."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)


def test_a_page_from_another_origin_cannot_use_a_keyless_server(browser, other_origin, tmp_path):
    """What any web page could do to a keyless server on 127.0.0.1: a cross-site form post whose
    text/plain body is valid JSON (no preflight), and fetches. All are refused (the form's
    navigation shows the 403 JSON error) and the server decodes nothing."""
    with serving("tiny-llama") as (url, app):
        (tmp_path / "form.html").write_text(f"""<html><body>
<form id="f" method="post" enctype="text/plain" action="{url}/v1/chat/completions">
<input type="hidden" name='{{"model": "tiny-llama", "max_tokens": 2, "messages": [{{"role": "user",
 "content": "hi"}}], "x": "' value='"}}'></form>
<script>document.getElementById("f").submit()</script></body></html>""")
        browser.get(f"{other_origin}/form.html")
        WebDriverWait(browser, 30).until(lambda d: "forbidden_origin" in d.page_source)
        browser.get(f"{other_origin}/")
        for content_type in ("text/plain", "application/json"):
            outcome = browser.execute_async_script("""
                const done = arguments[arguments.length - 1];
                fetch(arguments[0], {method: "POST", headers: {"Content-Type": arguments[1]}, body: arguments[2]})
                    .then(r => r.text().then(t => done("read " + r.status + " " + t)), () => done("blocked"));""",
                f"{url}/v1/chat/completions", content_type,
                '{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}')
            assert outcome == "blocked", outcome
        assert not app.state.tenants.streams  # no request reached the decoder

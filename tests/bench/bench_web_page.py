"""The web page's figures, against a real pool and Debian's chromium.

``python -m tests.bench.bench_web_page [--stops N]`` starts a real pool (the
tiny model, 2 workers), then measures:

* what a first load of the page transfers (every page file, bytes) and what
  a reload transfers once the browser holds them (ETag revalidation: 304s);
* Stop in the browser during a 2000-token answer: the time from the Esc key
  to the slot being idle in ``/slots``, over N tries (median and max).

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from frontend.web_page import PAGE_FILES
from tests.bench.harness import md_table
from tests.pool import Pool, wait_until


def open_browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"),
                            options=options)


def js(driver, expr: str, timeout_s: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.02).until(
        lambda d: d.execute_script(f"return {expr}"))


def stop_to_idle_s(driver, pool: Pool) -> float:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.find_element(By.ID, "prompt").send_keys("Go on", Keys.ENTER)
    js(driver, "document.querySelector('.message.assistant.streaming .body')"
               "?.textContent.length > 0")
    driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    start = time.monotonic()

    def idle() -> bool:
        slots = httpx.get(pool.url + "/slots", timeout=10).json()
        return all(s["state"] == "idle" for s in slots)

    wait_until(idle, 30, "slots idle after Stop", interval_s=0.01)
    elapsed = time.monotonic() - start
    js(driver, "document.getElementById('status').textContent.startsWith('Stopped')")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stops", type=int, default=5)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="web-page-"))
    model = run_dir / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    str(model)], check=True, capture_output=True)
    pool = Pool(model, run_dir, workers=2)
    driver = open_browser()
    try:
        first = sum(len(httpx.get(pool.url + p).content)
                    for p in set(PAGE_FILES) - {"/"})
        revalidated = 0
        for path in set(PAGE_FILES) - {"/"}:
            etag = httpx.get(pool.url + path).headers["etag"]
            r = httpx.get(pool.url + path, headers={"If-None-Match": etag})
            assert r.status_code == 304
            revalidated += len(r.content)
        driver.get(pool.url + "/")
        js(driver, "document.documentElement.dataset.ready === 'true'")
        driver.execute_script(
            "const s = {max_tokens: 2000, ignore_eos: true};"
            "localStorage.setItem('llamapool.settings', JSON.stringify(s))")
        driver.get(pool.url + "/")
        js(driver, "document.documentElement.dataset.ready === 'true'")
        stops = []
        for _ in range(args.stops):
            stops.append(stop_to_idle_s(driver, pool))
            driver.execute_script("document.getElementById('new-chat').click()")
        print(md_table(["figure", "value"], [
            ["page files, first load (bytes, uncompressed)", first],
            ["page files, reload with ETags (body bytes)", revalidated],
            [f"Esc -> slot idle in /slots, median of {len(stops)} (s)",
             statistics.median(stops)],
            [f"Esc -> slot idle in /slots, max of {len(stops)} (s)", max(stops)],
        ]))
    finally:
        driver.quit()
        pool.stop()


if __name__ == "__main__":
    main()

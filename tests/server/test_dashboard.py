"""GET /debug/kv, GET /dashboard and the residency histograms on a live server with an API key.

The browser test drives Debian's headless Chromium through selenium and chromedriver (scripts/setup installs
them); it skips when they are absent.
"""
from __future__ import annotations

import random
import shutil
import threading
import time

import httpx
import pytest

from pagedserve.server.debug import KV_SNAPSHOT_INTERVAL_S
from pagedserve.server.middleware import DASHBOARD_COOKIE, DASHBOARD_SESSION_S, make_session_token
from tests.server.helpers import ServerProcess, metric, scrape

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 48
SYSTEM = ("You are the storyteller of a children's library. Tell short, gentle stories with a clear ending, "
          "and never use frightening words. ")  # a small pool: eviction comes quickly and the grid is quick to compare


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("--api-key", KEY, "--metrics-prefix", "vllm", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                      "--max-model-len", "512")
    yield s
    s.close()


def get_kv(url: str) -> dict:
    resp = httpx.get(f"{url}/debug/kv", headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete(url: str, prompt, max_tokens: int = 1, **extra) -> dict:
    resp = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_page_and_the_snapshot_need_the_key(srv):
    url = srv.url
    no_key = httpx.get(f"{url}/debug/kv", timeout=10)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/dashboard/app.js", timeout=10).status_code == 401
    page = httpx.get(f"{url}/dashboard", timeout=10)
    assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
    assert 'name="key"' in httpx.get(f"{url}/dashboard/login", timeout=10).text

    refused = httpx.post(f"{url}/dashboard/login", data={"key": "wrong"}, timeout=10)
    assert refused.status_code == 401 and "set-cookie" not in refused.headers
    login = httpx.post(f"{url}/dashboard/login", data={"key": KEY}, timeout=10)
    assert login.status_code == 303 and login.headers["location"] == "/dashboard"
    cookie = login.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and f"max-age={DASHBOARD_SESSION_S}" in cookie
    assert "secure" not in cookie  # plain http: a Secure cookie would never come back
    assert KEY not in login.headers["set-cookie"]
    with httpx.Client(base_url=url, cookies=login.cookies, timeout=10) as browser:
        assert 'id="grid"' in browser.get("/dashboard").text
        assert browser.get("/dashboard/style.css").headers["content-type"].startswith("text/css")
        snap = browser.get("/debug/kv").json()
        assert (snap["num_blocks"], snap["block_size"], len(snap["blocks"])) == (NUM_BLOCKS, 16, NUM_BLOCKS)
        # The cookie opens the dashboard's GETs only, never the API.
        assert browser.get("/v1/models").status_code == 401


def test_the_session_cookie_expires_and_is_bound_to_the_key(srv):
    expired = make_session_token(KEY, now=time.time() - DASHBOARD_SESSION_S - 1)
    other_key = make_session_token("another-key")
    expires, _, mac = make_session_token(KEY).partition(".")
    extended = f"{int(expires) + 10 ** 6}.{mac}"  # a later expiry under the same signature
    for token in (expired, other_key, extended, KEY, "", "garbage"):
        resp = httpx.get(f"{srv.url}/debug/kv", cookies={DASHBOARD_COOKIE: token}, timeout=10)
        assert resp.status_code == 401, token
    ok = httpx.get(f"{srv.url}/debug/kv", cookies={DASHBOARD_COOKIE: make_session_token(KEY)}, timeout=10)
    assert ok.status_code == 200
    # Behind a TLS proxy on this host (uvicorn trusts X-Forwarded-Proto from 127.0.0.1) the cookie is Secure.
    login = httpx.post(f"{srv.url}/dashboard/login", data={"key": KEY}, headers={"X-Forwarded-Proto": "https"},
                       timeout=10)
    assert login.status_code == 303 and "; secure" in login.headers["set-cookie"].lower()


def test_snapshots_are_shared_between_polls_and_follow_the_engine(srv):
    # Two polls that both finish within the renewal interval of the first's start get the same snapshot (the
    # first takes a new one: the last is older than the interval). On a slow, loaded machine a pair can take
    # longer (the snapshot's JSON is built inside the interval): such a pair says nothing, so take up to 5.
    for _ in range(5):
        time.sleep(KV_SNAPSHOT_INTERVAL_S)
        start = time.monotonic()
        first = get_kv(srv.url)
        again = get_kv(srv.url)
        if time.monotonic() - start < KV_SNAPSHOT_INTERVAL_S:
            assert again["seq"] == first["seq"]
            break
    else:
        pytest.fail("no two polls finished within the renewal interval")
    time.sleep(0.6)
    complete(srv.url, "The capital of France is", max_tokens=2)
    later = get_kv(srv.url)
    assert later["seq"] > first["seq"]
    assert later["engine"]["generation_tokens_total"] >= first["engine"]["generation_tokens_total"] + 2
    # The steps' time (benchmarks/http_offline.py reads it): the request's two steps took some.
    assert later["engine"]["step_time_total_s"] > first["engine"]["step_time_total_s"]
    assert later["engine"]["num_ttft_samples"] >= 1 and later["engine"]["ttft_p50_s"] > 0
    assert later["model"] and later["requests"] == {}
    assert [b for b in later["blocks"] if b["state"] == "in_use"] == []
    assert later["counters"]["num_in_use_blocks"] == 0


def test_residency_histograms_use_the_metrics_prefix(srv):
    rng = random.Random(0)
    # 8 full blocks: 8 consecutive allocations, so one of them is sampled (RESIDENCY_SAMPLE_EVERY = 8).
    shared = [rng.randint(300, 20000) for _ in range(8 * 16 + 5)]
    complete(srv.url, shared)
    complete(srv.url, shared)  # prefix hits on all 8: an access, so a reuse gap, on the sampled one
    # Distinct prompts, 3 blocks each, more than the pool holds: every cached block is evicted in turn.
    churn = [[rng.randint(300, 20000) for _ in range(40)] for _ in range(2 * NUM_BLOCKS // 3)]
    complete(srv.url, churn)
    s = scrape(srv.url)
    lifetime = metric(s, "vllm:kv_block_lifetime_seconds_count")
    assert lifetime >= 1
    assert metric(s, "vllm:kv_block_idle_before_evict_seconds_count") == lifetime
    assert metric(s, "vllm:kv_block_reuse_gap_seconds_count") >= 1
    assert metric(s, "vllm:kv_block_lifetime_seconds_sum") > 0
    assert not [name for name, _ in s if name.startswith("pagedserve:")]


class Workload:
    """Streams requests in the background until stopped, so the page has something to show."""

    def __init__(self, url: str, num_streams: int = 3) -> None:
        self.url = url
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_streams)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        # One system prompt under every stream, two samples on some: shared blocks for the page to colour.
        body = {"prompt": SYSTEM + f"Story {i}: once upon a time", "max_tokens": 32, "ignore_eos": True, "stream": True,
                "n": 1 + i % 2, "temperature": 1.0}
        try:
            while not self.stop.is_set():
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH,
                                  timeout=120) as resp:
                    for _ in resp.iter_lines():
                        if self.stop.is_set():
                            break
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


READ_GRID = """
const cells = [...document.querySelectorAll('#grid .blk')];
return {seq: document.body.dataset.seq || null, blocks: cells.map(c => ({
  id: Number(c.dataset.id), state: c.dataset.state, ref_count: Number(c.dataset.ref),
  holders: c.dataset.holders ? c.dataset.holders.split(',') : [], hash: c.dataset.hash || null,
  shared: c.classList.contains('shared'), color: getComputedStyle(c).backgroundColor}))};
"""


def chromium_driver():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/setup installs them)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1300,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def wait_for(fn, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_page_draws_the_snapshot_in_a_real_browser(srv, tmp_path):
    driver = chromium_driver()
    workload = Workload(srv.url)
    try:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        driver.get(f"{srv.url}/dashboard")  # no cookie yet: the login form
        wait_for(lambda: driver.find_elements(By.ID, "key"), what="the login form")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.execute_script("return Number(document.body.dataset.updates || 0)") >= 2,
                 what="two dashboard updates")

        # Compare the grid the page drew with the snapshot it drew it from (the same seq), under load.
        compared = busy = 0
        deadline = time.monotonic() + 60
        while (compared < 3 or not busy) and time.monotonic() < deadline:
            dom = driver.execute_script(READ_GRID)
            snap = get_kv(srv.url)
            if dom["seq"] != str(snap["seq"]):
                time.sleep(0.1)
                continue
            want = [{"id": b["id"], "state": b["state"], "ref_count": b["ref_count"], "holders": b["holders"],
                     "hash": b["hash"], "shared": b["ref_count"] > 1} for b in snap["blocks"]]
            assert [{k: v for k, v in b.items() if k != "color"} for b in dom["blocks"]] == want
            colors = {}
            for b in dom["blocks"]:
                colors.setdefault((b["state"], b["shared"]), set()).add(b["color"])
            assert all(len(c) == 1 for c in colors.values()), colors  # one colour per kind of block
            assert len({next(iter(c)) for c in colors.values()}) == len(colors)  # and kinds differ
            compared += 1
            busy += any(b["ref_count"] > 1 for b in snap["blocks"])
        assert compared >= 3 and busy, (compared, busy)

        used = driver.find_element(By.CSS_SELECTOR, "#grid .blk.in_use")
        ActionChains(driver).move_to_element(used).perform()
        info = wait_for(lambda: driver.find_element(By.ID, "info").text, what="hover info")
        assert "ref_count" in info and "holders" in info, info
        summary = driver.find_element(By.ID, "summary").text
        assert "running" in summary and "KV usage" in summary
        assert len(driver.find_elements(By.CSS_SELECTOR, "#charts canvas")) == 5
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")
    finally:
        workload.close()
        driver.quit()
    assert not workload.errors, workload.errors

"""Drives a node's web console in headless Chromium (Debian's `chromium` and
`chromium-driver`) through selenium.

    python tests/python/console_e2e.py --base-url http://127.0.0.1:PORT --check NAME \
        [--tier t1] [--nodes 2] [--key KEY] [--shots DIR]

Each check is one behaviour a person sees (see CHECKS); the script exits non-zero with a
message when the page differs. With --shots it saves a screenshot of the pane it checked.
"""

import argparse
import os
import shutil
import sys

from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

WAIT_S = 120


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        fail("chromium and chromedriver are needed (Debian: apt install chromium chromium-driver; scripts/setup.sh does)")
    o = Options()
    o.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,860", "--force-device-scale-factor=1"):
        o.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for drivers online
    return webdriver.Chrome(options=o, service=Service(executable_path=driver))


def wait(d, what, cond, timeout=WAIT_S):
    try:
        return WebDriverWait(d, timeout, poll_frequency=0.2).until(lambda d: cond(d))
    except TimeoutException:
        fail(f"timed out waiting for {what}")


def shot(d, a, name):
    if a.shots:
        os.makedirs(a.shots, exist_ok=True)
        d.save_screenshot(os.path.join(a.shots, f"{name}.png"))


def open_console(d, a):
    d.get(a.base_url + "/")
    if a.key:
        wait(d, "the key dialog", lambda d: d.find_element(By.ID, "key-dialog").is_displayed())
        d.find_element(By.ID, "key-input").send_keys(a.key)
        d.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait(d, f"model {a.tier} in the model list",
         lambda d: a.tier in [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#model option")])


def send(d, a, text):
    """Sends a message; returns the finished assistant turn and how often its text changed."""
    Select(d.find_element(By.ID, "model")).select_by_value(a.tier)
    # Keep the length of every text the answer showed on its way: each delta replaces the
    # answer's text node, and a replaced node keeps the text it showed.
    d.execute_script("""
        window.__lens = [];
        new MutationObserver((recs) => { for (const r of recs)
            if (r.target.classList && r.target.classList.contains('content'))
                for (const n of r.addedNodes) if (n.nodeType === 3) window.__lens.push(n.data.length);
        }).observe(document.getElementById('log'), {subtree: true, childList: true});""")
    box = d.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    d.find_element(By.ID, "send").click()
    turn = wait(d, "the reply to finish", lambda d: next(iter(
        d.find_elements(By.CSS_SELECTOR, ".turn.assistant[data-state=done], .turn.assistant[data-state=error]")), None))
    if turn.get_attribute("data-state") == "error":
        fail(f"the reply failed: {turn.text}")
    return turn, d.execute_script("return window.__lens")


def chat(d, a):
    open_console(d, a)
    turn, lens = send(d, a, "Hello!")
    content = "".join(e.text for e in turn.find_elements(By.CSS_SELECTOR, ".content"))
    if not content.strip():
        fail(f"no answer text in {turn.text!r}")
    if turn.get_attribute("data-tier") != a.tier:
        fail(f"tier {turn.get_attribute('data-tier')!r}, expected {a.tier}")
    if turn.find_element(By.CSS_SELECTOR, ".meta-tier b").text != a.tier:
        fail("the reply's footer does not name its tier")
    # The answer was shown growing, delta by delta, not all at once.
    if len(set(lens)) < 3 or lens != sorted(lens):
        fail(f"the reply was not shown as it streamed: text lengths {lens}")
    print("chat:", repr(content[:60]), "tier", a.tier, "shown at lengths", lens)
    shot(d, a, "chat")


def tool_call(d, a):
    open_console(d, a)
    d.find_element(By.ID, "use-tools").click()
    turn, _ = send(d, a, "What is the forecast in Lima on 2026-03-02?")
    calls = turn.find_elements(By.CSS_SELECTOR, ".tool-call")
    if len(calls) != 1 or "weather_get_forecast" not in calls[0].text or "Lima" not in calls[0].text:
        fail(f"tool calls shown: {[c.text for c in calls]}")
    if "tool_use" not in turn.find_element(By.CSS_SELECTOR, ".meta-stop b").text:
        fail("stop reason is not tool_use")
    print("tool call:", calls[0].text)
    shot(d, a, "tool-call")


def cluster(d, a):
    open_console(d, a)
    d.find_element(By.ID, "tab-cluster").click()

    def rows(d):
        r = d.find_elements(By.CSS_SELECTOR, "#members tbody tr")
        states = [x.find_elements(By.TAG_NAME, "td")[1].text for x in r]
        return r if len(r) == a.nodes and all(s == "alive" for s in states) else None
    r = wait(d, f"{a.nodes} alive members in the cluster pane", rows, timeout=30)
    names = [x.get_attribute("data-node") for x in r]
    tiers = " ".join(x.find_elements(By.TAG_NAME, "td")[4].text for x in r)
    if a.tier not in tiers:
        fail(f"no member lists {a.tier}: {tiers}")
    print("cluster:", names, tiers)
    shot(d, a, "cluster")


def policy(d, a):
    open_console(d, a)
    d.find_element(By.ID, "tab-policy").click()
    wait(d, "the live policy", lambda d: '"cascade"' in d.find_element(By.ID, "policy").text)
    version = d.find_element(By.ID, "policy-version").text
    if not version.startswith("version "):
        fail(f"policy version {version!r}")
    print("policy:", version)
    shot(d, a, "policy")


def policy_refused(d, a):
    open_console(d, a)
    d.find_element(By.ID, "tab-policy").click()
    err = wait(d, "the scope refusal", lambda d: (lambda e: e if e.is_displayed() and e.text else None)(
        d.find_element(By.ID, "policy-error")))
    if "control scope" not in err.text:
        fail(f"policy pane says {err.text!r}")
    print("policy refused:", err.text)


CHECKS = {f.__name__: f for f in [chat, tool_call, cluster, policy, policy_refused]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--check", required=True, choices=sorted(CHECKS))
    ap.add_argument("--tier", default="t1")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--key", default="")
    ap.add_argument("--shots", default="")
    a = ap.parse_args()
    d = browser()
    try:
        CHECKS[a.check](d, a)
    finally:
        d.quit()
    print("console e2e: passed")


if __name__ == "__main__":
    main()

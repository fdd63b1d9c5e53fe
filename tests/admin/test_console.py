"""The web console (#20, `python -m actors.admin`), in a real browser (headless Chromium
through Selenium) against our broker, and its API against the real nsqd."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.admin.admin import Admin
from actors.admin.options import AdminOptions
from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.lookupd.conftest import Http, free_port, nsq_binary, processes  # noqa: F401
from tests.runtime.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

ARTIFACTS = Path(os.environ.get("ZMQNSQ_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path_factory.mktemp("admin") / "data", workers=1)).start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def console(broker) -> Iterator[Admin]:
    admin = Admin(AdminOptions(http_address="127.0.0.1:0",
                               nsqd_http_address=(f"127.0.0.1:{broker.http_port}",))).start()
    yield admin
    admin.stop()


def _chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("chromium and chromium-driver are not installed (tests/deps.sh installs "
                    "them from Debian)")
    return browser, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    binary, driver = _chromium()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1280,900", "--disable-gpu"):
        options.add_argument(flag)
    d = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver),
                         options=options)
    d.implicitly_wait(0)
    yield d
    d.quit()


def _shot(browser, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"console-{name}.png"))


def _find(browser, css: str, text: str | None = None, timeout: float = 15):
    """The element for `css` (with `text` in it, if given), once the page shows it."""
    from selenium.webdriver.common.by import By

    def found():
        for e in browser.find_elements(By.CSS_SELECTOR, css):
            try:
                if text is None or text in e.text:
                    return e
            except Exception:
                return None
        return None

    return wait_until(found, timeout=timeout, what=f"{css} {text or ''} on the page")


def _alert(browser, *, accept: bool) -> str:
    alert = wait_until(lambda: _switch(browser), timeout=10, what="the confirmation")
    text = alert.text
    if accept:
        alert.accept()
    else:
        alert.dismiss()
    return text


def _switch(browser):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return browser.switch_to.alert
    except NoAlertPresentException:
        return None


def test_the_console_lists_shows_pauses_and_asks_before_deleting(broker, console, browser):
    base = f"http://{console.http_address}/"
    for topic in ("web_a", "web_b"):
        broker.topic_command(topic, "hello")
        broker.topic_command(topic, "create_channel", "c")
    broker.publish("web_a", [b"1", b"2", b"3"])
    # The overview lists the topics
    browser.get(base)
    _find(browser, 'tr[data-topic="web_a"]')
    _find(browser, 'tr[data-topic="web_b"]')
    _shot(browser, "overview")
    # A channel page shows its depth
    browser.get(base + "#/topic/web_a/c")
    assert _find(browser, "#channel td.depth", "3").text == "3"
    _shot(browser, "channel")
    # Pause asks, then pauses (as /stats says)
    _find(browser, 'button[data-action="pause"]').click()
    assert "pause channel c of topic web_a" in _alert(browser, accept=True)
    wait_until(lambda: broker.topic_stats("web_a")["channels"][0]["paused"], what="paused")
    _find(browser, "h1 .paused")
    _find(browser, 'button[data-action="unpause"]')
    # Delete asks first; dismissed, nothing is deleted
    browser.get(base + "#/topic/web_b")
    _find(browser, "#channels")
    _find(browser, 'button[data-action="delete"]').click()
    assert "delete topic web_b" in _alert(browser, accept=False)
    assert broker.topic_stats("web_b", timeout=5)["channels"][0]["channel_name"] == "c"
    _shot(browser, "topic")
    # Accepted, the topic goes from every broker
    _find(browser, 'button[data-action="delete"]').click()
    _alert(browser, accept=True)
    wait_until(lambda: "web_b" not in _topics(broker), what="web_b deleted")
    # Creating a topic from the overview form
    browser.get(base)
    field = _find(browser, '#create-topic input[name="topic"]')
    field.send_keys("web_new")
    _find(browser, '#create-topic button').click()
    _alert(browser, accept=True)
    wait_until(lambda: "web_new" in _topics(broker), what="web_new created")
    _find(browser, 'tr[data-topic="web_new"]')
    # The broker page shows its processes and its disk queues' chunks
    browser.get(base + f"#/broker/127.0.0.1:{broker.http_port}")
    _find(browser, "#processes", "gateway")
    _find(browser, "#queues", "web_a/c")
    _shot(browser, "broker")


def _topics(broker: Broker) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.http_port}/stats?format=json",
                                timeout=10) as r:
        return [t["topic_name"] for t in json.load(r)["topics"] or ()]


def _api(console: Admin, path: str) -> dict:
    with urllib.request.urlopen(f"http://{console.http_address}/api/{path}", timeout=10) as r:
        return json.load(r)


def test_the_api_reads_the_real_nsqd_too(tmp_path, processes):  # noqa: F811 - the fixture
    nsqd = nsq_binary("nsqd")
    http = free_port()
    processes([nsqd, f"--data-path={tmp_path}", "--tcp-address=127.0.0.1:0",
               f"--http-address=127.0.0.1:{http}"], tmp_path / "nsqd.log")
    web = Http(f"127.0.0.1:{http}")
    wait_until(web.up, what="nsqd")
    web.call("POST", "/topic/create?topic=real")
    web.call("POST", "/channel/create?topic=real&channel=c")
    with Admin(AdminOptions(http_address="127.0.0.1:0",
                            nsqd_http_address=(f"127.0.0.1:{http}",))) as admin:
        overview = _api(admin, "overview")
        assert [t["topic"] for t in overview["topics"]] == ["real"]
        assert overview["brokers"][0]["version"] == "1.3.0"
        channel = _api(admin, "channel?topic=real&channel=c")
        assert channel["found"]
        assert channel["totals"]["depth"] == 0
        req = urllib.request.Request(f"http://{admin.http_address}/api/action", method="POST",
                                     data=json.dumps({"action": "pause", "topic": "real",
                                                      "channel": "c"}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback only
            assert json.load(r)["results"][0]["ok"]
        assert _api(admin, "topic?topic=real")["channels"][0]["paused"] is True
        unreachable = AdminOptions(http_address="127.0.0.1:0",
                                   nsqd_http_address=("127.0.0.1:1",))
        with Admin(unreachable) as down:
            (row,) = _api(down, "overview")["brokers"]
            assert "127.0.0.1:1" in row["error"]



def test_the_console_and_zmqnsq_find_nsqd_through_the_real_nsqlookupd(tmp_path, processes):  # noqa: F811
    import io

    from actors import cli

    nsqlookupd, nsqd = nsq_binary("nsqlookupd"), nsq_binary("nsqd")
    lookup_tcp, lookup_http, tcp, http = free_port(), free_port(), free_port(), free_port()
    processes([nsqlookupd, f"--tcp-address=127.0.0.1:{lookup_tcp}",
               f"--http-address=127.0.0.1:{lookup_http}", "--broadcast-address=127.0.0.1"],
              tmp_path / "nsqlookupd.log")
    processes([nsqd, f"--data-path={tmp_path}", f"--tcp-address=127.0.0.1:{tcp}",
               f"--http-address=127.0.0.1:{http}", "--broadcast-address=127.0.0.1",
               f"--lookupd-tcp-address=127.0.0.1:{lookup_tcp}"], tmp_path / "nsqd.log")
    nsqd_web, lookup_web = Http(f"127.0.0.1:{http}"), Http(f"127.0.0.1:{lookup_http}")
    wait_until(lambda: nsqd_web.up() and lookup_web.up(), what="nsqd and nsqlookupd")
    nsqd_web.call("POST", "/topic/create?topic=far")
    nsqd_web.call("POST", "/channel/create?topic=far&channel=c")
    wait_until(lambda: lookup_web.json("/lookup?topic=far")["producers"] if
               lookup_web.call("GET", "/lookup?topic=far")[0] == 200 else None,
               what="nsqd registered")
    with Admin(AdminOptions(http_address="127.0.0.1:0",
                            lookupd_http_address=(f"127.0.0.1:{lookup_http}",))) as admin:
        assert [t["topic"] for t in _api(admin, "overview")["topics"]] == ["far"]
        (node,) = _api(admin, "lookupds")[0]["nodes"]
        assert (node["node"], node["topics"]) == (f"127.0.0.1:{http}", ["far"])
    assert cli.pub(cli._parser().parse_args(["pub", "--topic", "far", "--nsqd-tcp-address",
                                             f"127.0.0.1:{tcp}"]), io.BytesIO(b"hi\n"),
                   io.StringIO()) == 0
    out = io.BytesIO()
    assert cli.tail(cli._parser().parse_args([
        "tail", "--topic", "far", "--channel", "c", "-n", "1",
        "--lookupd-http-address", f"127.0.0.1:{lookup_http}"]), out) == 0
    assert out.getvalue() == b"hi\n"

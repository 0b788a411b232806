"""The dashboards of a running D = 2 x P = 2 swarm of real processes: the bootstrap's swarm page and
a stage-0 node's own page, through their JSON and in a real browser (Debian's headless chromium,
driven by Playwright): all four replicas on the map, loss charts that gain points without a
reload, and no console errors. Screenshots go to $NOLOCO_SCREENSHOTS (docs/images/ holds the
ones the docs show)."""

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CHROMIUM = os.environ.get("NOLOCO_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def until(check, timeout_s: float, what: str, period_s: float = 0.5):
    """Poll `check()` until it returns something truthy; fail saying `what` and the last value."""
    deadline, value = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"{what} within {timeout_s:.0f} s; last seen: {value!r}"[:3000])


def test_swarm_and_node_dashboards_of_a_2x2_swarm(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "run.run_id": "dash",
            "outer.method": "noloco",
            "inner.total_steps": 5000,
            "outer.inner_steps_per_outer": 4,
            "timeouts.match_s": 2.0,
            "network.dashboard_poll_s": 0.5,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides, bootstrap_args=("--dashboard", "0"))
    base = swarm.dashboard_url()
    assert (swarm.out_dir / "logs" / "bootstrap.log").read_text().count("dashboard at") == 1  # said once
    empty = get(base + "api/swarm")
    assert empty["schema"] == "noloco-node/swarm/1" and empty["replicas"] == [] and empty["run"]["run_id"] == "dash"
    assert {n.split(" has ")[0] for n in empty["attention"]} == {"stage 0", "stage 1"}  # no replica anywhere yet

    later = [swarm.start_node(1, r) for r in range(2)]
    swarm.wait_ready(later)
    lone = until(lambda: get(base + "api/swarm")["attention"], 30, "stage 0's absence as an attention item")
    assert any(n.startswith("stage 0 has no replica") for n in lone), lone
    drivers = [swarm.start_node(0, 0, "--steps", "5000", "--dashboard", "0"), swarm.start_node(0, 1, "--steps", "5000")]
    swarm.wait_ready(drivers)
    assert drivers[0].log_file.read_text().count("dashboard at http://127.0.0.1:") == 1

    def training() -> dict | None:
        s = get(base + "api/swarm")
        losses = [r["loss"] for r in s["replicas"] if r["stage"] == 0]
        return s if len(s["replicas"]) == 4 and all(loss is not None for loss in losses) else None

    first = until(training, 120, "four replicas, both stage-0 replicas with a loss")
    assert {(r["stage"], r["peer_id"]) for r in first["replicas"]} == {
        (n.stage, json.loads(n.ready_file.read_text())["peer_id"]) for n in later + drivers
    }
    assert all(r["loss"] is None for r in first["replicas"] if r["stage"] == 1)  # the loss belongs to stage 0
    points = lambda h: {peer: len(series) for peer, series in h["loss"].items()}  # noqa: E731
    seen = points(get(base + "api/history"))

    def gaining() -> dict | None:
        now = points(get(base + "api/history"))
        return now if len(now) == 2 and all(n > seen.get(peer, 0) for peer, n in now.items()) else None

    until(gaining, 30, "both stage-0 replicas' loss series gaining points")
    steps = {r["peer_id"]: r["inner_step"] for r in first["replicas"]}
    until(
        lambda: all(
            r["inner_step"] > steps[r["peer_id"]] for r in get(base + "api/swarm")["replicas"] if r["stage"] == 0
        ),
        30,
        "stage-0 inner steps advancing",
    )

    node_port = json.loads(drivers[0].ready_file.read_text())["dashboard_port"]
    node_base = f"http://127.0.0.1:{node_port}/"
    mine = get(node_base + "api/node")
    assert mine["schema"] == "noloco-node/node/1" and mine["stage"] == 0 and mine["health"]["reach"] == "direct"
    assert mine["contribution"]["tokens"] > 0 and mine["contribution"]["flops"] > 0 and mine["health"]["loss"] > 0
    until(
        lambda: get(node_base + "api/node")["contribution"]["tokens"] > mine["contribution"]["tokens"],
        30,
        "the node's tokens advancing",
    )
    assert len(get(node_base + "api/node/history")["loss"]) >= 1
    assert len(get(node_base + "api/swarm")["replicas"]) == 4  # the swarm as the node sees it
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(base + "api/swarm", data=b"{}", method="POST"), timeout=10)
    assert refused.value.code == 405

    if CHROMIUM is None:
        pytest.skip(
            "the JSON endpoints passed; the browser half needs Debian's chromium (apt-get install chromium; "
            "scripts/setup.sh does it as root), and none is installed"
        )
    check_pages_in_a_browser(base, node_base, tmp_path)


def check_pages_in_a_browser(swarm_page: str, node_page: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("NOLOCO_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on(
                "console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(swarm_page)
            page.wait_for_function("() => document.querySelectorAll('#map .replica').length === 4", timeout=30_000)
            stages = page.eval_on_selector_all("#map .replica", "cards => cards.map(c => c.dataset.stage).sort()")
            assert stages == ["0", "0", "1", "1"], stages
            chart_grows(page, "#loss-chart")
            page.screenshot(path=str(shots / "dashboard-swarm.png"), full_page=True)

            page.goto(node_page)
            page.wait_for_function(
                "() => document.querySelector('#contribution [data-field=tokens]')?.textContent.trim()", timeout=30_000
            )
            assert page.get_attribute("#swarm-link", "href") in ("/swarm", node_page + "swarm")
            chart_grows(page, "#loss-chart")
            page.screenshot(path=str(shots / "dashboard-node.png"), full_page=True)
        finally:
            browser.close()
    assert problems == [], problems


def chart_grows(page, selector: str) -> None:
    """The chart has points, and more a few seconds later, on the same page (no reload)."""
    page.wait_for_function(
        f"() => Number(document.querySelector('{selector}')?.dataset.points || 0) > 0", timeout=30_000
    )
    before = int(page.get_attribute(selector, "data-points"))
    page.evaluate("() => { window.sameDocument = true; }")  # gone if the page reloads
    page.wait_for_function(
        f"() => Number(document.querySelector('{selector}').dataset.points) > {before}", timeout=30_000
    )
    assert page.evaluate("() => window.sameDocument === true")

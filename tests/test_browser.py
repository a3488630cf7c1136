"""The dashboard in a real browser: JupyterLab on loopback, driven by Playwright with Debian's Chromium, runs a short
dashboard notebook against a live run; the token view shows coloured tokens and the curves update while the run
steps."""

import json, os, re, secrets, shutil, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
import pytest
from test_controller import free_port, stop_session
from molt_nb.widgets import ratio_colours

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FLAGS = [
    '--no-sandbox',
    '--disable-gpu',
    '--disable-quic',
    '--no-first-run',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--disable-dev-shm-usage',
]


def chromium() -> str:
    "Debian's Chromium, installed by this test when missing (Playwright drives it; never `playwright install`)"
    if not shutil.which('chromium'):
        env = os.environ | dict(DEBIAN_FRONTEND='noninteractive')
        subprocess.run(['apt-get', 'update', '-q'], check=True, env=env, capture_output=True, timeout=300)
        subprocess.run(
            ['apt-get', 'install', '-y', '-q', 'chromium'], check=True, env=env, capture_output=True, timeout=900
        )
    return shutil.which('chromium')


RECIPE = ROOT / 'recipes' / 'arith_moe'
# a narrow IS band, so that some tokens of a short run lie beyond its edge (full colour) and the rest inside it
BAND = ['algo.loss.is_correction.low=0.99', 'algo.loss.is_correction.high=1.01']


def notebook(ray_dir: str, ckpt: str, run_dirs: tuple) -> dict:
    "Two runs of the MoE recipe on a warm start: a short one with routing replay off, then a live one with it on"
    base = [f'model.path="{ckpt}"', 'loop.eval_tasks=8', *BAND]
    cells = [
        "from molt_nb.config import load_config\nfrom molt_nb.controller import connect, launch\nfrom molt_nb.widgets "
        "import Dashboard",
        f"connect(temp_dir={ray_dir!r}, num_cpus=2)\n"
        f"base = {base!r}\n"
        f"off = launch(load_config({str(RECIPE)!r}, base + ['routing.replay=false', 'loop.steps=4', "
        f"'run_dir=\"{run_dirs[0]}\"']), name='replay-off')\n"
        "off.wait(timeout=300)\n"
        f"run = launch(load_config({str(RECIPE)!r}, base + ['loop.steps=100000', 'run_dir=\"{run_dirs[1]}\"']), "
        "name='replay-on')",
        "dash = Dashboard(run, refresh_s=0.5, compare={'replay off': off})\ndash",
        "Dashboard(off)",
    ]
    return dict(
        nbformat=4,
        nbformat_minor=5,
        metadata=dict(kernelspec=dict(name='python3', display_name='Python 3', language='python')),
        cells=[
            dict(cell_type='code', id=f"c{i}", metadata={}, execution_count=None, outputs=[], source=c)
            for i, c in enumerate(cells)
        ],
    )


@pytest.fixture
def lab(tmp_path):
    "JupyterLab on 127.0.0.1 with a token, isolated config and workspaces; yields (url, token, root)"
    base, token, port = tmp_path / 'lab', secrets.token_hex(16), free_port()
    for d in ('cfg', 'run', 'ipy', 'root', 'settings/@jupyterlab/apputils-extension', 'ws'):
        (base / d).mkdir(parents=True)
    (base / 'settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings').write_text(
        '{"fetchNews":"false","checkForUpdates":false}'
    )
    env = os.environ | dict(
        JUPYTER_CONFIG_DIR=str(base / 'cfg'), JUPYTER_RUNTIME_DIR=str(base / 'run'), IPYTHONDIR=str(base / 'ipy')
    )
    proc = subprocess.Popen(
        [
            str(BIN / 'jupyter'),
            'lab',
            '--no-browser',
            '--allow-root',
            '--ServerApp.ip=127.0.0.1',
            f'--ServerApp.port={port}',
            '--ServerApp.port_retries=0',
            f'--IdentityProvider.token={token}',
            f'--ServerApp.root_dir={base / "root"}',
            f'--LabApp.user_settings_dir={base / "settings"}',
            f'--LabApp.workspaces_dir={base / "ws"}',
            '--LabApp.news_url=None',
            '--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate',
            '--LabApp.expose_app_in_browser=True',
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / 'lab.log', 'w'),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline and proc.poll() is None, (tmp_path / 'lab.log').read_text()[-3000:]
            time.sleep(0.3)
        yield url, token, base / 'root'
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_all(page, tmp_path, tries: int = 3):
    """Run every cell; a Run All sent while JupyterLab is still wiring the kernel's session can be dropped, so resend
    until cell 1 starts"""
    prompt = page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")
    for i in range(tries):
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        try:
            return page.wait_for_function(
                "el => /\\[[*0-9]+\\]/.test(el.textContent)", arg=prompt.element_handle(), timeout=20_000, polling=250
            )
        except Exception:
            page.screenshot(path=str(tmp_path / f'run_all_{i}.png'))
    raise AssertionError(f"Run All never started cell 1 (screenshots in {tmp_path})")


def rgb(css: str) -> tuple:
    return tuple(map(int, re.findall(r'\d+', css)[:3]))


def hex_rgb(h: str) -> tuple:
    return tuple(int(h[i : i + 2], 16) for i in (1, 3, 5))


CHIPS = "els => els.map(e => [getComputedStyle(e).backgroundColor, Number(e.dataset.logRatio)])"
# scrolled to inside the page: Playwright's scroll_into_view_if_needed holds a handle, and the view's redraw every
# refresh detaches it ("Element is not attached to the DOM"), which failed CI once
SCROLL = "els => { if (els.length) els[0].scrollIntoView({block: 'nearest'}) }"


def chips(loc, tries: int = 20) -> list:
    """(computed background, log ratio) of every element of `loc`, in one read of the page, taken once all are drawn:
    the view redraws as the run steps, and an element not drawn yet (scrolled out of JupyterLab's window) has no
    computed style"""
    for _ in range(tries):
        loc.evaluate_all(SCROLL)
        got = loc.evaluate_all(CHIPS)
        if got and all(c for c, _ in got):
            return got
        time.sleep(0.25)
    return got


def routing_view(dash) -> dict:
    "What one dashboard's routing tab shows: its note, the heatmap's cells and the agreement bars' values and heights"
    return dict(
        note=dash.get_by_text('routing replay:').first.inner_text(),
        cells=dash.locator('.molt-routing svg.molt-heatmap rect.cell').count(),
        bars=dash.locator('.molt-routing svg.molt-bars rect.bar').evaluate_all(
            "els => els.map(e => [Number(e.dataset.value), e.getBBox().height])"
        ),
    )


@pytest.mark.browser
def test_dashboard_live_in_jupyterlab(lab, tmp_path):
    """An MoE run's dashboard, live: curves follow the run with the replay-off run overlaid, token chips have their
    ratio's colour (full at the IS band's edge, with a legend), and the routing heatmap and per-layer bars are drawn
    with replay on and off"""
    from playwright.sync_api import sync_playwright
    from molt_nb.config import load_config
    from molt_nb.train import warm_start
    from molt_nb.widgets import colour_edges
    from dataclasses import asdict

    url, token, root = lab
    ray_dir = tempfile.mkdtemp(prefix='molt-br-')
    ws = load_config(str(RECIPE), ['warm_start.steps=150', f'run_dir="{tmp_path / "warm"}"'])
    ckpt, _ = warm_start(ws)  # the model answers in digits: chips a person can read
    edges = colour_edges(asdict(load_config(str(RECIPE), BAND)))
    (root / 'dash.ipynb').write_text(
        json.dumps(notebook(ray_dir, str(ckpt), (str(tmp_path / 'off'), str(tmp_path / 'on'))))
    )
    exe = chromium()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, headless=True, args=FLAGS)
            page = browser.new_page(viewport=dict(width=1400, height=1400))
            try:
                page.goto(f"{url}/lab/workspaces/w_dash/tree/dash.ipynb?reset&token={token}")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                page.get_by_text("| Idle").wait_for(timeout=60_000)
                run_all(page, tmp_path)
                live, done = page.locator(".molt-dashboard").nth(0), page.locator(".molt-dashboard").nth(1)
                status = live.locator(".molt-status")
                status.wait_for(timeout=240_000)
                tokens = live.locator(".molt-tokens span.tok")
                tokens.first.wait_for(timeout=60_000)
                first_step, t0 = int(status.get_attribute('data-step')), time.time()
                curve = live.locator(".molt-curves svg").first
                first_curve = int(curve.get_attribute('data-last'))
                page.screenshot(path=str(tmp_path / 'dashboard_mid.png'))
                page.wait_for_function(
                    f"Number(document.querySelector('.molt-dashboard .molt-status').dataset.step) >= {first_step + 3}",
                    timeout=120_000,
                    polling=250,
                )
                later_step, t1 = int(status.get_attribute('data-step')), time.time()
                pairs = chips(tokens)
                later_curve = int(curve.get_attribute('data-last'))
                overlaid = live.locator(".molt-curves svg").first.text_content()
                texts = tokens.all_inner_texts()
                legend = chips(live.locator(".molt-legend .swatch"))
                # the sample holding the step's largest |log ratio| token, that token outlined
                live.get_by_role('button', name='next outlier').click()
                outlier = live.locator(".molt-tokens span.tok.outlier")
                outlier.wait_for(timeout=30_000)
                out_colour, out_ratio = outlier.evaluate(
                    "e => [getComputedStyle(e).backgroundColor, Number(e.dataset.logRatio)]"
                )
                pairs += chips(tokens)  # a trained sample's chips (the newest step's may not be)
                on, off = routing_view(live), routing_view(done)
                page.screenshot(path=str(tmp_path / 'dashboard.png'), full_page=True)
            except Exception:
                page.screenshot(path=str(tmp_path / 'failure.png'), full_page=True)
                raise
            browser.close()
    finally:
        stop_session([ray_dir])
    colours, ratios = [c for c, _ in pairs], [r for _, r in pairs]
    print(f"screenshots: {tmp_path / 'dashboard_mid.png'} {tmp_path / 'dashboard.png'}")
    print(
        f"dashboard steps {first_step} -> {later_step} in {t1 - t0:.1f} s; log ratios {ratios}, colours {colours}; "
        f"legend {legend}; outlier {out_ratio} {out_colour}; routing on {on}, off {off}"
    )
    assert later_step >= first_step + 3  # the curves' header followed the run
    assert later_curve > first_curve  # and the curves were redrawn with the new steps
    assert 'this run' in overlaid and 'replay off' in overlaid  # the replay-off run's reward overlaid
    full = {hex_rgb(h) for h in ratio_colours(list(edges), edges)}
    assert len(colours) > 0 and all(c.startswith('rgb') and c != 'rgba(0, 0, 0, 0)' for c in colours)
    expected = [hex_rgb(h) for h in ratio_colours(ratios, edges)]
    shown = [rgb(c) for c in colours]
    assert all(max(abs(a - b) for a, b in zip(e, c)) <= 2 for e, c in zip(expected, shown)), (ratios, colours)
    # the outlier lies beyond the band's edge (0.99..1.01) and shows the full colour; the legend's ends are the
    # edges at full colour and its middle, ratio 1, is white
    assert abs(out_ratio) >= min(map(abs, edges)) and rgb(out_colour) in full, (out_ratio, out_colour, edges)
    assert [rgb(legend[0][0]), rgb(legend[-1][0])] == [hex_rgb(h) for h in ratio_colours(list(edges), edges)]
    assert [(rgb(c), r) for c, r in legend if r == 0] == [((255, 255, 255), 0.0)], legend
    assert texts and not any('\ufffd' in t for t in texts)  # every chip shows its token
    # the routing tab: a heatmap with cells and one bar per layer (4), each with its agreement drawn
    for view, replay in ((on, 'on'), (off, 'off')):
        assert f'routing replay: {replay}' in view['note'], view
        assert view['cells'] >= 4, view
        assert len(view['bars']) == 4 and all(0 < v <= 1 and h > 0 for v, h in view['bars']), view
    assert 'step agreement 1.0000' in on['note']  # replay on: training used the rollout's experts
    assert (tmp_path / 'dashboard.png').stat().st_size > 10_000

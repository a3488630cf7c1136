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


def notebook(ray_dir: str, run_dir: str) -> dict:
    cells = [
        "from molt_nb.config import load_config\nfrom molt_nb.controller import connect, launch\nfrom molt_nb.widgets "
        "import Dashboard",
        f"connect(temp_dir={ray_dir!r}, num_cpus=2)\n"
        f"cfg = load_config({str(ROOT / 'recipes' / 'parity')!r}, ['loop.steps=100000', 'loop.mode=\"async\"', "
        f"'loop.eval_tasks=8', 'algo.loss.is_correction.level=\"token\"', 'run_dir=\"{run_dir}\"'])\n"
        "run = launch(cfg, name='browser')",
        "dash = Dashboard(run, refresh_s=0.5)\ndash",
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


@pytest.mark.browser
def test_dashboard_live_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    url, token, root = lab
    ray_dir = tempfile.mkdtemp(prefix='molt-br-')
    (root / 'dash.ipynb').write_text(json.dumps(notebook(ray_dir, str(tmp_path / 'run'))))
    exe = chromium()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, headless=True, args=FLAGS)
            page = browser.new_page(viewport=dict(width=1400, height=1000))
            try:
                page.goto(f"{url}/lab/workspaces/w_dash/tree/dash.ipynb?reset&token={token}")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                page.get_by_text("| Idle").wait_for(timeout=60_000)
                run_all(page, tmp_path)
                status = page.locator(".molt-dashboard .molt-status")
                status.wait_for(timeout=180_000)
                tokens = page.locator(".molt-dashboard .molt-tokens span.tok")
                tokens.first.wait_for(timeout=60_000)
                first_step, t0 = int(status.get_attribute('data-step')), time.time()
                curve = page.locator(".molt-dashboard .molt-curves svg").first
                first_curve = int(curve.get_attribute('data-last'))
                page.screenshot(path=str(tmp_path / 'dashboard_mid.png'))
                page.wait_for_function(
                    f"Number(document.querySelector('.molt-dashboard .molt-status').dataset.step) >= {first_step + 3}",
                    timeout=120_000,
                    polling=250,
                )
                later_step, t1 = int(status.get_attribute('data-step')), time.time()
                pairs = tokens.evaluate_all(
                    "els => els.map(e => [getComputedStyle(e).backgroundColor, Number(e.dataset.logRatio)])"
                )  # one read: the view redraws as the run steps
                colours, ratios = [c for c, _ in pairs], [r for _, r in pairs]
                later_curve = int(curve.get_attribute('data-last'))
                texts = tokens.all_inner_texts()
                versions = [
                    int(v)
                    for v in page.locator(".molt-dashboard .molt-head")
                    .first.inner_text()
                    .rsplit('versions ', 1)[1]
                    .split('..')
                ]
                page.screenshot(path=str(tmp_path / 'dashboard.png'))
            except Exception:
                page.screenshot(path=str(tmp_path / 'failure.png'))
                raise
            browser.close()
    finally:
        stop_session([ray_dir])
    print(f"screenshots: {tmp_path / 'dashboard_mid.png'} {tmp_path / 'dashboard.png'}")
    print(
        f"dashboard steps {first_step} -> {later_step} in {t1 - t0:.1f} s; token view shows versions {versions}, log "
        f"ratios {ratios}, colours {colours}"
    )
    assert later_step >= first_step + 3  # the curves' header followed the run
    assert later_curve > first_curve  # and the curves were redrawn with the new steps
    assert len(colours) > 0 and all(
        c.startswith('rgb') and c != 'rgba(0, 0, 0, 0)' for c in colours
    )  # every token chip is coloured
    expected = [tuple(int(h[i : i + 2], 16) for i in (1, 3, 5)) for h in ratio_colours(ratios, 0.5)]
    shown = [tuple(map(int, re.findall(r'\d+', c)[:3])) for c in colours]
    assert all(max(abs(a - b) for a, b in zip(e, c)) <= 2 for e, c in zip(expected, shown)), (
        ratios,
        colours,
    )  # each chip's colour is its log ratio's
    assert texts and not any(
        '\ufffd' in t for t in texts
    )  # every chip shows its token (bytes of a split character as \xNN)
    assert (tmp_path / 'dashboard.png').stat().st_size > 10_000

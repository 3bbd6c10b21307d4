"""Chromium for MiniWoB++: a pool of headless browsers, started once and reused.

An episode plays in a window of one of the pool's browsers (`Pool.acquire`). Windows are
spread over the browsers, the fewest open first, so the G episodes of a group land in
different browsers when the pool has at least G of them: a browser that crashes or hangs
costs the episodes it hosts, then is started again on the next `acquire`. Each browser is
chromedriver plus Chromium, launched by us (not by Selenium) in a process group of its
own that is tethered to this process (mlx_grpo/tether.py): no browser outlives the run,
whatever ends it. Every WebDriver command has a bounded wait (COMMAND_TIMEOUT).

The browser is found as MINIWOB_CHROME_BINARY / MINIWOB_CHROMEDRIVER (set both), else on
PATH (Debian's `chromium` and `chromium-driver`), else an installed Google Chrome with
the chromedriver Selenium Manager fetches for it.

Every window is told it has focus (DevTools `Emulation.setFocusEmulationEnabled`). A
headless browser focuses one window at a time, and a page in any other window gets no
`focus` events: with the 8 episodes of a group in 2 windows each of 4 browsers, the
`focus-text` and `focus-text-2` scripts succeeded in 4 of 8 episodes instead of 8.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import miniwob
from selenium import webdriver
from selenium.common.exceptions import JavascriptException
from selenium.webdriver.common.proxy import Proxy, ProxyType
from selenium.webdriver.remote.client_config import ClientConfig

from mlx_grpo.tether import kill_group, tether, untether

HTML = Path(miniwob.__file__).parent / "html" / "miniwob"
COMMAND_TIMEOUT = 30  # seconds any one WebDriver command may take before the browser is dropped
START_TIMEOUT = 20  # seconds for chromedriver to listen
# MiniWoB ends an episode after 10 s by default, which assumes a policy acting in
# milliseconds; like BrowserGym we give it 1000 s and score by the raw reward.
EPISODE_MAX_MS = 1_000_000
FLAGS = (
    "--headless",
    "--no-sandbox",  # the pages are MiniWoB's own files; the run is the boundary
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-renderer-backgrounding",
    "--disable-extensions",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--disable-breakpad",
    "--no-first-run",
    "--mute-audio",
    "--window-size=500,400",
)


def client_config(url: str) -> ClientConfig:
    """How Selenium talks to the local chromedriver: directly, whatever `http_proxy`
    says (through a proxy every command failed), and each command within
    COMMAND_TIMEOUT (urllib3 retries a read that timed out, so a GET took up to 4x)."""
    return ClientConfig(
        remote_server_addr=url,
        timeout=COMMAND_TIMEOUT,
        proxy=Proxy({"proxyType": ProxyType.DIRECT}),
        init_args_for_pool_manager={"init_args_for_pool_manager": {"retries": False}},
    )


class BrowserError(RuntimeError):
    """A browser that crashed, hung, or could not be started."""


class PageError(BrowserError):
    """The page's own JavaScript raised (the browser itself is fine)."""


class NoBrowser(RuntimeError):
    """No Chromium (or no chromedriver) on this machine; the message says what to install."""


_INSTALL = (
    "no Chromium and chromedriver found: on Debian/Ubuntu run `make system-deps` as root "
    "(apt-get install chromium chromium-driver), on macOS install Google Chrome, or set "
    "MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER"
)


def find_browser() -> tuple[str, str]:
    """(chrome binary, chromedriver) paths, or NoBrowser saying what to install."""
    chrome, driver = os.environ.get("MINIWOB_CHROME_BINARY"), os.environ.get("MINIWOB_CHROMEDRIVER")
    if chrome or driver:
        missing = [
            n
            for n, p in (("MINIWOB_CHROME_BINARY", chrome), ("MINIWOB_CHROMEDRIVER", driver))
            if not p or not os.access(p, os.X_OK)
        ]
        if missing:
            raise NoBrowser(f"{' and '.join(missing)}: not set to an executable file")
        return chrome, driver
    driver = shutil.which("chromedriver")
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        chrome = shutil.which(name)
        if chrome and driver:
            return chrome, driver
    if sys.platform == "darwin":
        mac = "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"
        if os.path.exists(mac):
            return mac, driver or _selenium_manager_driver()
    raise NoBrowser(_INSTALL)


def _selenium_manager_driver() -> str:
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    try:
        return SeleniumManager().binary_paths(["--browser", "chrome"])["driver_path"]
    except Exception as e:
        raise NoBrowser(f"{_INSTALL} (Selenium Manager: {e})") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """One chromedriver + Chromium, tethered to this process, hosting windows."""

    def __init__(self, chrome: str, driver: str):
        port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="mlx-grpo-chromium-")
        # Chromium's own temporary files (its singleton socket folder) go in a folder of
        # this browser's, removed with it. Short and under /tmp where it can be: the
        # socket's path must fit in 104 bytes (macOS), and a profile under macOS's
        # /var/folders/.../T/ would not leave room for it.
        self.tmp = tempfile.mkdtemp(
            prefix="mgc-", dir="/tmp" if os.access("/tmp", os.W_OK) else None
        )
        self.alive = False
        try:
            self.proc = subprocess.Popen(
                [driver, f"--port={port}"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": self.tmp, "MAC_CHROMIUM_TMPDIR": self.tmp},
                start_new_session=True,  # a process group of its own, that Chromium joins
            )
        except OSError as e:
            self._remove_folders()
            raise BrowserError(f"could not start {driver}: {_short(e)}") from None
        self.alive = True
        try:
            tether(self.proc.pid)
            self._connect(chrome, port)
            self.free = [self.driver.current_window_handle]
        except BaseException as e:  # (a Ctrl-C during the start too: nothing left running)
            self.close()
            if not isinstance(e, Exception):
                raise
            raise BrowserError(f"could not start {chrome}: {_short(e)}") from None
        self.in_use: set[str] = set()
        self.current = self.free[0]

    def _connect(self, chrome: str, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise BrowserError("chromedriver did not start") from None
                time.sleep(0.05)
        options = webdriver.ChromeOptions()
        options.binary_location = chrome
        for flag in (*FLAGS, f"--user-data-dir={self.profile}"):
            options.add_argument(flag)
        url = f"http://127.0.0.1:{port}"
        self.driver = webdriver.Remote(
            command_executor=url,
            options=options,
            client_config=client_config(url),
        )
        self.driver.set_script_timeout(COMMAND_TIMEOUT)
        self.driver.set_page_load_timeout(COMMAND_TIMEOUT)
        # chromedriver's DevTools passthrough (what ChromiumDriver.execute_cdp_cmd calls).
        self.driver.command_executor.add_command(
            "executeCdpCommand", "POST", "/session/$sessionId/goog/cdp/execute"
        )
        self._focus()  # the first window

    def _focus(self) -> None:
        """Focus emulation for the current window (DevTools applies it per window)."""
        self.driver.execute(
            "executeCdpCommand",
            {"cmd": "Emulation.setFocusEmulationEnabled", "params": {"enabled": True}},
        )

    @property
    def load(self) -> int:
        return len(self.in_use)

    def open_window(self) -> str:
        if self.free:
            handle = self.free.pop()
        else:
            self.driver.switch_to.new_window("window")
            handle = self.current = self.driver.current_window_handle
            self._focus()
        self.in_use.add(handle)
        return handle

    def release(self, handle: str) -> None:
        if handle in self.in_use:
            self.in_use.discard(handle)
            self.free.append(handle)

    def switch(self, handle: str) -> None:
        if handle != self.current:
            self.driver.switch_to.window(handle)
            self.current = handle

    def close(self) -> None:
        """Kill the process group (chromedriver, Chromium and its helpers) at once: a
        polite quit could wait out a hung browser, and nothing in it needs saving."""
        if not self.alive:
            return
        self.alive = False
        try:
            kill_group(self.proc.pid)
            self.proc.wait()
            untether(self.proc.pid)
        finally:
            self._remove_folders()

    def _remove_folders(self) -> None:
        for folder in (self.profile, self.tmp):
            shutil.rmtree(folder, ignore_errors=True)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


class Window:
    """One window of a pooled browser, where one episode at a time plays. Every call
    that fails (crash, hang, lost connection) drops the browser and raises BrowserError."""

    def __init__(self, pool: Pool, browser: Browser, handle: str):
        self.pool, self.browser, self.handle = pool, browser, handle

    def _do(self, fn, *args):
        if not self.browser.alive:
            raise BrowserError("the browser was restarted")
        try:
            self.browser.switch(self.handle)
            return fn(*args)
        except JavascriptException as e:
            raise PageError(_short(e)) from None
        except Exception as e:
            self.pool.drop(self.browser)
            raise BrowserError(_short(e)) from None

    def run(self, js: str, *args):
        """`execute_script` in this window."""
        return self._do(self.browser.driver.execute_script, js, *args)

    def keys(self, text: str) -> None:
        """Type `text` into the focused element, one key event per character (MiniWoB's
        own typing action)."""
        from miniwob.selenium_actions import execute_type_text

        self._do(execute_type_text, text, self.browser.driver)

    def screenshot(self) -> bytes:
        return self._do(self.browser.driver.get_screenshot_as_png)

    def load(self, task: str) -> None:
        """Open MiniWoB task type `task` afresh (every episode: a page that played an
        episode before may keep state, and then a seed would not decide the episode)."""
        page = HTML / f"{task}.html"
        if not page.exists():
            raise ValueError(
                f"unknown MiniWoB task {task!r} (no {page.name} in the miniwob package)"
            )
        self._do(self.browser.driver.get, page.as_uri())
        self.run(f"core.EPISODE_MAX_TIME = {EPISODE_MAX_MS};")

    def release(self) -> None:
        self.pool.release(self)


class Pool:
    """Up to `size` browsers; windows handed out to the least loaded."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"browsers must be at least 1, got {size}")
        self.size = size
        self.browsers: list[Browser | None] = [None] * size
        self.started = 0  # browsers launched, restarts included

    def acquire(self) -> Window:
        for i, b in enumerate(self.browsers):
            if b is not None and not b.alive:
                self.browsers[i] = None
        slot = min(
            range(self.size),
            key=lambda i: (self.browsers[i] is not None and self.browsers[i].load, i),
        )
        if self.browsers[slot] is None:
            chrome, driver = find_browser()
            self.browsers[slot] = Browser(chrome, driver)
            self.started += 1
        browser = self.browsers[slot]
        try:
            handle = browser.open_window()
        except Exception as e:
            self.drop(browser)
            raise BrowserError(_short(e)) from None
        return Window(self, browser, handle)

    def release(self, window: Window) -> None:
        if window.browser.alive:
            window.browser.release(window.handle)

    def drop(self, browser: Browser) -> None:
        browser.close()

    def close(self) -> None:
        for b in self.browsers:
            if b is not None:
                b.close()
        self.browsers = [None] * self.size

    def pids(self) -> list[int]:
        """Process-group ids of the live browsers."""
        return [b.proc.pid for b in self.browsers if b is not None and b.alive]


_pool: Pool | None = None


def pool(size: int) -> Pool:
    """This process's pool (grown to `size` browsers when asked for more)."""
    global _pool
    if _pool is None:
        _pool = Pool(size)
        atexit.register(shutdown)
    elif size > _pool.size:
        _pool.browsers += [None] * (size - _pool.size)
        _pool.size = size
    return _pool


def shutdown() -> None:
    """Close every browser of this process's pool."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None

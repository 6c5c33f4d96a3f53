"""Real servers for tests: Mosquitto and Prometheus (Debian binaries on PATH), started on 127.0.0.1 and a free
port in a temporary directory, stopped by their own pid. Import what you need:

    from servers import Mosquitto, Prometheus, Subscriber, free_port, step_records
    from servers import mosquitto_fixture, prometheus_fixture  # noqa: F401  (fixtures)

The fixtures are named ``mosquitto`` (a running broker) and ``prometheus`` (a factory:
``prometheus(["127.0.0.1:9400"])``); importing them into a test module makes them available there. ``step_records`` builds StepRecords
from real m2live predictions, as the plugin would hand them to the sinks.
"""

from __future__ import annotations

import getpass
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from m2live import Predictor, Step
from m2live.record import StepRecord


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll ``pred`` until it returns something truthy; fail the test with ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _need(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/sbin/{binary}" if os.path.exists(f"/usr/sbin/{binary}") else None)
    if path is None:
        pytest.fail(f"`{binary}` is not installed: run `make servers` (Debian packages prometheus, mosquitto)")
    return path


class _Server:
    name = "server"

    def __init__(self, workdir: Path, port: int | None = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / f"{self.name}.log"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        return _port_open(self.port)

    def start(self, timeout: float = 20.0) -> _Server:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already running"
        logf = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process' lifetime
        self.proc = subprocess.Popen(self._argv(), stdout=logf, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        logf.close()

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}: {self.log()[-2000:]}")
            return self._ready()

        wait_until(up, timeout, f"{self.name} on 127.0.0.1:{self.port}")
        return self

    def stop(self) -> None:
        """Terminate politely (SIGTERM), then kill; waits until the port is free."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.proc = None
        wait_until(lambda: not _port_open(self.port), 5, f"{self.name} port {self.port} to close")

    def kill(self) -> None:
        """Abrupt stop (SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Mosquitto(_Server):
    """A Mosquitto 2 broker on 127.0.0.1; ``users={"name": "password"}`` turns on password authentication,
    ``acl="..."`` (the text of a Mosquitto ACL file, needs ``users``) restricts who may read/write which topics,
    and ``log_subscriptions=True`` makes the broker log every SUBSCRIBE (``subscriptions()``)."""

    name = "mosquitto"

    def __init__(self, workdir: Path, port: int | None = None, users: dict[str, str] | None = None,
                 acl: str | None = None, log_subscriptions: bool = False):
        super().__init__(workdir, port)
        self.users = users or {}
        self.conf = self.dir / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", "persistence false", f"user {getpass.getuser()}",
                 "log_type error", "log_type warning", "log_type notice", "log_dest stdout"]
        if self.users:
            pw = self.dir / "passwd"
            pw.touch(mode=0o600)
            for u, p in self.users.items():
                subprocess.run([_need("mosquitto_passwd"), "-b", str(pw), u, p], check=True,
                               capture_output=True)
            lines += ["allow_anonymous false", f"password_file {pw}"]
        else:
            lines.append("allow_anonymous true")
        if acl is not None:
            assert self.users, "an ACL file needs users (password authentication)"
            acl_path = self.dir / "acl"
            acl_path.write_text(acl)
            lines.append(f"acl_file {acl_path}")
        self.subscription_log = self.dir / "subscriptions.log"
        if log_subscriptions:  # a log file of its own: the broker flushes it per line (stdout is block-buffered)
            lines += ["log_type subscribe", f"log_dest file {self.subscription_log}"]
        self.conf.write_text("\n".join(lines) + "\n")

    def _argv(self) -> list[str]:
        return [_need("mosquitto"), "-c", str(self.conf)]

    def subscriptions(self) -> str:
        """The broker's SUBSCRIBE log (``log_subscriptions=True``): lines ``<time>: <client id> <qos> <topic>``."""
        try:
            return self.subscription_log.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"


class Prometheus(_Server):
    """A Prometheus server scraping ``targets`` (host:port) every ``scrape_interval``."""

    name = "prometheus"

    def __init__(self, workdir: Path, targets: list[str], scrape_interval: str = "1s", port: int | None = None,
                 rule_files: list[Path] = ()):
        super().__init__(workdir, port)
        self.targets = list(targets)
        self.conf = self.dir / "prometheus.yml"
        rules = "".join(f"  - {json.dumps(str(Path(f).resolve()))}\n" for f in rule_files)
        self.conf.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n"
            "  - job_name: m2live\n"
            f"    scrape_interval: {scrape_interval}\n"
            f"    scrape_timeout: {scrape_interval}\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(self.targets)}\n")

    def _argv(self) -> list[str]:
        return [_need("prometheus"), f"--config.file={self.conf}", f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: object) -> object:
        """GET /api/v1/<path>; returns ``data`` or raises AssertionError with Prometheus' error."""
        qs = urllib.parse.urlencode([(k, v) for k, vs in params.items()
                                     for v in (vs if isinstance(vs, list) else [vs])])
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{qs}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result list (vector/matrix samples)."""
        data = self.api("query", query=expr)
        return data["result"] if isinstance(data["result"], list) else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def alerts(self) -> list[dict]:
        """The alerts of the loaded rules, pending or firing (GET /api/v1/alerts)."""
        return self.api("alerts")["alerts"]

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


_SUB_IDS = itertools.count()


class Subscriber:
    """An MQTT subscriber (paho-mqtt, its own network thread) recording every message it receives."""

    def __init__(self, port: int, topics: list[str], username: str | None = None, password: str | None = None):
        import paho.mqtt.client as mqtt

        self.messages: list[tuple[str, bytes, bool]] = []
        self._lock = threading.Lock()
        self._topics = topics
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-sub-{os.getpid()}-{next(_SUB_IDS)}")
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self._subscribed = threading.Event()
        self.client.on_subscribe = lambda *a, **k: self._subscribed.set()
        self.client.reconnect_delay_set(0.1, 1)
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            self.close()
            raise AssertionError("test subscriber could not subscribe")

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        client.subscribe([(t, 1) for t in self._topics])

    def _on_message(self, client, userdata, msg) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

    def on(self, topic: str) -> list[bytes]:
        with self._lock:
            return [p for t, p, _ in self.messages if t == topic]

    def records(self, topic: str) -> list[dict]:
        """Step records received on a steps topic (each message is a JSON list)."""
        return [r for p in self.on(topic) for r in json.loads(p)]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture(name="mosquitto")
def mosquitto_fixture(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "mosquitto").start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(name="prometheus")
def prometheus_fixture(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """Factory: ``prometheus(["127.0.0.1:PORT"], scrape_interval="1s", rule_files=[...])`` → a started
    Prometheus."""
    started: list[Prometheus] = []

    def make(targets: list[str], scrape_interval: str = "1s", rule_files: list[Path] = ()) -> Prometheus:
        p = Prometheus(tmp_path / f"prometheus{len(started)}", targets, scrape_interval,
                       rule_files=rule_files).start(timeout=30)
        started.append(p)
        return p

    try:
        yield make
    finally:
        for p in started:
            p.stop()


# ---- records as the plugin hands them to the sinks, from real predictions ----------------------------------------
GPU = "NVIDIA H100 80GB HBM3"
MODEL = "meta-llama/Llama-3.1-8B"


def step_records(n: int = 20, *, engine: str = "0", gpu: str = GPU, model: str = MODEL, start: int = 0,
                 slo_s: float | None = 0.05) -> list[StepRecord]:
    """``n`` records for a mix of prefill+decode and pure-decode steps, predicted by the real Predictor at a
    drooping clock; the 'measurement' is the prediction scaled by a deterministic error in [-20 %, +30 %]."""
    p = Predictor.for_gpu(gpu, model=model)
    boost = p.gpu.boost_mhz
    out = []
    for i in range(start, start + n):
        decodes = [(1, 300 + 37 * j + 11 * i) for j in range(4 + i % 12)]
        step = Step([(512 + 64 * (i % 5), 128 * (i % 3)), *decodes]) if i % 3 == 0 else Step(decodes)
        f = 1.0 - 0.02 * (i % 10)  # the SM clock droops under load, as NVML would report
        pred = p.predict(step, f_clk=f)
        measured = pred.total_s * (1.0 + (-0.2 + 0.5 * ((i * 7) % 11) / 10))
        corrected = 0.5 * (pred.total_s + measured)
        out.append(StepRecord(
            step=i, time=time.time(), engine=engine, gpu=pred.gpu, model=pred.model,
            num_prefill_tokens=step.num_prefill_tokens, num_decode_tokens=step.num_decode_tokens,
            num_prefill_seqs=len(step.prefill_seqs), num_decode_seqs=len(step.decode_contexts),
            prefill_kv_tokens=sum(c for _, c in step.prefill_seqs), decode_kv_tokens=sum(step.decode_contexts),
            predicted_s=pred.total_s, corrected_s=corrected, measured_s=measured, f_clk=pred.f_clk,
            clock_mhz=pred.clock_mhz, boost_mhz=boost, clock_source="nvml", ops=dict(pred.ops),
            factors={k: dict(v) for k, v in pred.factors.items()}, bound=dict(pred.bound),
            power_w=450.0 + 20 * (i % 13), power_limit_w=700.0, clock_event_reasons=0x4 if i % 2 else 0x0,
            temperature_c=61.0 + i % 7, clock_age_s=0.004 + 0.001 * (i % 5),
            token_budget=None if slo_s is None else 2048 - 64 * (i % 8),
            max_active=None if slo_s is None else 64 - i % 4, slo_s=slo_s,
            slo_violation=None if slo_s is None else measured > slo_s, admission_flagged=i % 9 == 4,
            hook_overhead_s=40e-6 + 5e-6 * (i % 4), capacity_seqs=None if slo_s is None else 48 - i % 5))
    return out

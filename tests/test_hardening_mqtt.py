"""Who may steer a live engine over MQTT, against a real Mosquitto (ACL file, retained messages, hostile payloads,
outages) — issue 16, item 1 — and that no secret reaches a log line or an error (item 3)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import paho.mqtt.publish as paho_publish
import pytest
from servers import Mosquitto, Subscriber, step_records, wait_until

from exporters.mqtt import MqttPublisher, topics, validate_control

pytestmark = pytest.mark.servers
REPO = Path(__file__).resolve().parent.parent


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if level is None or r.levelno == level]


@contextmanager
def captured_logs() -> Iterator[_Records]:
    """Every record of the ``m2live`` loggers (the MQTT publisher's included), at any level."""
    h = _Records()
    logger = logging.getLogger("m2live")
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)


def publisher(url: str, instance: str, **kw) -> MqttPublisher:
    kw.setdefault("flush_s", 0.05)
    kw.setdefault("backoff_max", 0.3)
    return MqttPublisher(url, instance, **kw).start()


@pytest.fixture
def brokers(tmp_path: Path):
    """Factory of started Mosquitto brokers, every one stopped at teardown whatever the test did."""
    started: list[Mosquitto] = []

    def make(name: str = "mq", **kw) -> Mosquitto:
        b = Mosquitto(tmp_path / name, **kw).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


def readme_acl() -> str:
    """The Mosquitto ACL file the docs recommend (the ```conf block of docs/plugin.md's security section)."""
    text = (REPO / "docs" / "plugin.md").read_text()
    sec = text[text.index("## Security and failure behaviour"):]
    m = re.search(r"```conf\n(.*?)```", sec, re.S)
    assert m, "docs/plugin.md: no ```conf ACL block in the security section"
    return m.group(1)


# --- the control payload: bounds of the configuration, size and depth before parsing ----------------------------
@pytest.mark.parametrize("payload", ['{"slo_ms": 1e-9}', '{"slo_ms": 1e308}', '{"slo_ms": 0.001}',
                                     '{"slo_ms": 600001}'])
def test_control_values_get_the_configurations_bounds(payload):
    with pytest.raises(ValueError, match="within") as e:
        validate_control(payload)
    assert "\n" not in str(e.value)
    assert validate_control('{"slo_ms": 1}') == {"slo_ms": 1.0}  # the bound itself is allowed
    assert validate_control('{"slo_ms": 40, "by": "alice"}') == {"slo_ms": 40.0, "by": "alice"}


@pytest.mark.parametrize("payload,err", [
    (b"[" * 100_000, "bytes refused"),
    (b"[" * 1000, "nested deeper"),
    (b'{"slo_ms": [[[[40]]]]}', "nested deeper"),
    (b'{"slo_ms": 40, "pad": "' + b"x" * 2000 + b'"}', "bytes refused"),
    (b'{"by": "alice"}', "sets nothing"),
    (b'{"slo_ms": 40, "by": "a b; rm -rf"}', "short name"),
])
def test_hostile_payloads_are_refused_in_one_line(payload, err):
    with pytest.raises(ValueError, match=err) as e:
        validate_control(payload)
    assert "\n" not in str(e.value)


def test_a_bracket_inside_a_string_is_not_nesting():
    from exporters.mqtt import _too_deep

    assert not _too_deep(b'{"by": "[[[{{{\\"[[["}', 2)
    assert _too_deep(b'{"by": [[1]]}', 2)
    with pytest.raises(ValueError, match="short name"):  # parsed (not refused as nesting), then checked
        validate_control(b'{"admission": true, "by": "[[[{{{"}')


# --- real broker -------------------------------------------------------------------------------------------------
def test_broker_acl_from_the_readme_lets_a_reader_see_steps_but_not_steer(brokers, tmp_path):
    users = {"m2live-engine": "engine-pw", "reader": "reader-pw", "operator": "operator-pw"}
    broker = brokers("mq", users=users, acl=readme_acl())
    t = topics("acl")
    got: list[dict] = []
    pub = publisher(broker.url, "acl", on_control=got.append, username="m2live-engine", password="engine-pw")
    reader = Subscriber(broker.port, [t["steps"]], username="reader", password="reader-pw")
    try:
        wait_until(lambda: pub.connected, 10, "the engine's publisher to connect")
        for r in step_records(5):
            pub.submit(r)
        wait_until(lambda: len(reader.records(t["steps"])) == 5, 10, "the reader to receive the steps")
        auth = {"hostname": "127.0.0.1", "port": broker.port, "qos": 1}
        paho_publish.single(t["control"], json.dumps({"slo_ms": 7}), auth={"username": "reader",
                                                                           "password": "reader-pw"}, **auth)
        paho_publish.single(t["control"], json.dumps({"slo_ms": 250, "by": "operator"}),
                            auth={"username": "operator", "password": "operator-pw"}, **auth)
        wait_until(lambda: got, 10, "the operator's control message")
        # the broker dropped the reader's message (it came first, and never arrived): only the operator steers
        assert got == [{"slo_ms": 250.0, "by": "operator"}]
        assert pub.control_accepted == 1 and pub.control_rejected == 0
    finally:
        reader.close()
        pub.close()
        broker.stop()


def test_control_topic_is_not_subscribed_unless_control_is_on(brokers, tmp_path):
    broker = brokers("mq", log_subscriptions=True)
    try:
        off = publisher(broker.url, "quiet")  # no on_control: what the plugin does without M2LIVE_MQTT_CONTROL=1
        on = publisher(broker.url, "steered", on_control=lambda cmd: None)
        try:
            wait_until(lambda: off.connected and on.connected, 10, "both publishers to connect")
            # both subscribe before they count as connected; the broker logged the one that did
            wait_until(lambda: "m2live/steered/control" in broker.subscriptions(), 10,
                       "the broker to log the subscription")
            assert "m2live/quiet/control" not in broker.subscriptions()
        finally:
            off.close()
            on.close()
    finally:
        broker.stop()


def test_plugin_leaves_remote_control_off_unless_enabled(brokers, tmp_path):
    from test_hardening_cli import monitor

    broker = brokers("mq")
    try:
        for env, want in (({}, False), ({"M2LIVE_MQTT_CONTROL": "1"}, True)):
            mon = monitor(tmp_path, start_exporters=True, M2LIVE_MQTT_URL=broker.url,
                          M2LIVE_MQTT_INSTANCE="plug", **env)
            try:
                assert mon.mqtt is not None
                assert (mon.mqtt.on_control is not None) is want
            finally:
                mon.close()
    finally:
        broker.stop()


def test_retained_control_is_ignored_at_connect_unless_allowed(brokers, tmp_path):
    broker = brokers("mq")
    t = topics("ret")
    try:
        # an old retained {"slo_ms": 1000} sits on the broker before the engine starts (the scenario)
        paho_publish.single(t["control"], json.dumps({"slo_ms": 1000}), qos=1, retain=True,
                            hostname="127.0.0.1", port=broker.port)
        got: list[dict] = []
        with captured_logs() as logs:
            pub = publisher(broker.url, "ret", on_control=got.append)
            try:
                wait_until(lambda: pub.control_rejected == 1, 10, "the retained message to be refused")
                assert got == [] and pub.control_retained_ignored == 1 and pub.control_accepted == 0
            finally:
                pub.close()
        assert any("retained" in line for line in logs.lines(logging.WARNING))
        allowed = publisher(broker.url, "ret", on_control=got.append, control_retained=True)
        try:
            wait_until(lambda: got, 10, "the retained message, now allowed")
            assert got == [{"slo_ms": 1000.0}]
        finally:
            allowed.close()
    finally:
        broker.stop()


def test_hostile_payloads_do_not_break_the_connection(brokers, tmp_path):
    broker = brokers("mq")
    t = topics("hostile")
    got: list[dict] = []
    pub = publisher(broker.url, "hostile", on_control=got.append)
    try:
        wait_until(lambda: pub.connected, 10, "publisher to connect")
        for bad in (b"[" * 100_000, b"{" * 5000, b'{"slo_ms": ' + b"9" * 5000 + b"}", b"\xff\xfe" * 600):
            paho_publish.single(t["control"], bad, qos=1, hostname="127.0.0.1", port=broker.port)
        paho_publish.single(t["control"], b'{"admission": false}', qos=1, hostname="127.0.0.1", port=broker.port)
        wait_until(lambda: got, 10, "the valid message after the hostile ones")
        assert got == [{"admission": False}] and pub.control_rejected == 4
        assert pub.connects == 1 and pub.connect_failures == 0  # no reconnect storm
    finally:
        pub.close()
        broker.stop()


def test_every_outage_is_warned_about_and_never_demoted_to_debug(tmp_path):
    started = [Mosquitto(tmp_path / "mq").start()]
    port = started[0].port
    pub = None
    try:
        with captured_logs() as logs:
            pub = publisher(started[0].url, "outages", backoff_min=0.05, backoff_max=0.1, warn_every_s=3600)
            wait_until(lambda: pub.connected, 10, "publisher to connect")
            for outage in (1, 2, 3):
                started[-1].stop()
                seen = pub.connect_failures
                wait_until(lambda seen=seen: pub.connect_failures >= seen + 5, 20, f"outage {outage} retries")
                started.append(Mosquitto(tmp_path / f"mq{outage}", port=port).start())
                wait_until(lambda outage=outage: pub.connected and pub.connects == outage + 1, 20,
                           f"reconnect after outage {outage}")
            pub.close()
    finally:
        if pub is not None:
            pub.close()
        for b in started:
            b.stop()
    mqtt = [r for r in logs.records if r.name == "m2live.exporters.mqtt"]
    down = [r for r in mqtt if "unavailable" in r.getMessage()]
    assert [r.levelno for r in down] == [logging.WARNING] * 3  # one per outage, each at WARNING, none at DEBUG
    back = [r for r in mqtt if "reconnected" in r.getMessage()]
    assert len(back) == 3 and all("failed attempt" in r.getMessage() for r in back)
    assert not [r for r in mqtt if r.levelno == logging.DEBUG]


def test_no_password_in_any_log_line_or_error(brokers, tmp_path, capsys):
    from test_hardening_cli import monitor

    from exporters import ExporterError
    from m2live.config import ConfigError, M2liveConfig

    secret = "S3CRET-pw"
    broker = brokers("mq", users={"alice": "right-pw"})
    try:
        with captured_logs() as logs:
            # the broker refuses the password: the publisher retries and logs, never the password
            pub = publisher(f"mqtt://alice:{secret}@127.0.0.1:{broker.port}", "secret")
            try:
                wait_until(lambda: pub.connect_failures >= 2, 10, "refused connection attempts")
                assert pub.last_error and secret not in pub.last_error
            finally:
                pub.close()
            # a publisher that cannot start (TLS CA missing) is reported by the monitor with the URL masked
            mon = monitor(tmp_path, start_exporters=True, M2LIVE_MQTT_URL=f"mqtts://alice:{secret}@127.0.0.1:1",
                          M2LIVE_MQTT_TLS_CA=str(tmp_path / "missing-ca.pem"), M2LIVE_MQTT_PASSWORD=secret)
            mon.close()
        lines = logs.lines()
        assert any("unavailable" in line and "***@127.0.0.1" in line for line in lines)
        assert not [line for line in lines if secret in line]
    finally:
        broker.stop()
    with pytest.raises(ExporterError) as e:
        MqttPublisher(f"mqtt://alice:{secret}@127.0.0.1:notaport", "x")
    assert secret not in str(e.value)
    with pytest.raises(ConfigError) as e2:
        M2liveConfig.from_env({"M2LIVE_MQTT_URL": f"http://alice:{secret}@example"})
    assert secret not in str(e2.value) and "***@example" in str(e2.value)
    assert secret not in capsys.readouterr().err

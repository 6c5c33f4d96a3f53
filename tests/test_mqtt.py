"""MqttPublisher against a real Mosquitto broker started by the test (127.0.0.1, free port, temp dir)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import paho.mqtt.publish as paho_publish
import pytest
from servers import (
    Mosquitto,
    Subscriber,
    free_port,
    mosquitto_fixture,  # noqa: F401  (fixture `mosquitto`)
    step_records,
    wait_until,
)

from exporters import ExporterError
from exporters.mqtt import MqttPublisher, topics, validate_control

pytestmark = pytest.mark.servers
REPO = Path(__file__).resolve().parent.parent


def publisher(url: str, instance: str, **kw) -> MqttPublisher:
    kw.setdefault("flush_s", 0.05)
    kw.setdefault("backoff_max", 0.5)
    return MqttPublisher(url, instance, **kw).start()


def test_subscriber_receives_the_step_stream_and_retained_status(mosquitto):
    t = topics("eng0")
    sub = Subscriber(mosquitto.port, ["m2live/eng0/#"])
    pub = publisher(mosquitto.url, "eng0", batch_max=16)
    try:
        wait_until(lambda: pub.connected, 10, "publisher to connect")
        recs = step_records(100)
        for r in recs:
            pub.submit(r)
        wait_until(lambda: len(sub.records(t["steps"])) >= 100, 10, "100 step records")
        got = sub.records(t["steps"])
        assert [g["step"] for g in got] == [r.step for r in recs]  # all of them, in order
        assert got[7] == json.loads(json.dumps(recs[7].to_dict()))  # the full record, residual_ratio included
        assert got[7]["residual_ratio"] == pytest.approx(recs[7].residual_ratio)
        assert all(len(json.loads(p)) <= 16 for p in sub.on(t["steps"]))  # batched, never above batch_max
        assert pub.published == 100 and pub.dropped == 0
        assert sub.on(t["status"])[0] == b"online"
        # a late subscriber still learns the status: it is retained
        late = Subscriber(mosquitto.port, [t["status"]])
        try:
            wait_until(lambda: late.messages, 5, "retained status")
            assert late.messages[0] == (t["status"], b"online", True)
        finally:
            late.close()
    finally:
        pub.close()
    wait_until(lambda: sub.on(t["status"])[-1:] == [b"offline"], 5, "offline status on clean close")
    sub.close()


def test_last_will_says_offline_when_the_process_dies(mosquitto):
    t = topics("victim")
    sub = Subscriber(mosquitto.port, [t["status"]])
    code = textwrap.dedent(f"""
        import time
        from exporters.mqtt import MqttPublisher
        p = MqttPublisher({mosquitto.url!r}, "victim", keepalive=60).start()
        while not p.connected:
            time.sleep(0.02)
        print("connected", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == b"connected"
        wait_until(lambda: sub.on(t["status"]) == [b"online"], 5, "online status")
        proc.kill()  # abrupt: no DISCONNECT packet, the broker must publish the will
        proc.wait(5)
        wait_until(lambda: sub.on(t["status"])[-1:] == [b"offline"], 10, "last will 'offline'")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sub.close()
    late = Subscriber(mosquitto.port, [t["status"]])
    try:
        wait_until(lambda: late.messages, 5, "retained last will")
        assert late.messages[0] == (t["status"], b"offline", True)
    finally:
        late.close()


@pytest.mark.parametrize("payload,want", [
    ('{"slo_ms": 40}', {"slo_ms": 40.0}),
    ('{"slo_ms": 12.5, "admission": true}', {"slo_ms": 12.5, "admission": True}),
    ('{"slo_ms": null}', {"slo_ms": None}),
    ('{"admission": false}', {"admission": False}),
])
def test_valid_control_messages(payload, want):
    assert validate_control(payload.encode()) == want


@pytest.mark.parametrize("payload,err", [
    ("slo 40", "not JSON"),
    ("[40]", "JSON object"),
    ("{}", "sets nothing"),
    ('{"slo": 40}', "unknown control key"),
    ('{"slo_ms": -5}', "positive"),
    ('{"slo_ms": 0}', "positive"),
    ('{"slo_ms": "40"}', "positive"),
    ('{"slo_ms": true}', "positive"),
    ('{"slo_ms": NaN}', "positive"),
    ('{"admission": "yes"}', "true or false"),
    ('{"admission": 1}', "true or false"),
])
def test_invalid_control_messages_are_rejected_with_one_line(payload, err):
    with pytest.raises(ValueError, match=err) as e:
        validate_control(payload.encode())
    assert "\n" not in str(e.value)


def test_control_messages_reach_on_control_and_invalid_ones_do_not(mosquitto):
    t = topics("ctl")
    got: list[dict] = []
    pub = publisher(mosquitto.url, "ctl", on_control=got.append)
    try:
        wait_until(lambda: pub.connected, 10, "publisher to connect (control topic subscribed)")
        msgs = ['{"slo_ms": -3}', "not json", '{"admission": "off"}', '{"slo_ms": 40}', '{"bogus": 1}',
                '{"admission": false}', '{"slo_ms": null}']
        for m in msgs:
            paho_publish.single(t["control"], m, qos=1, hostname="127.0.0.1", port=mosquitto.port)
        wait_until(lambda: pub.control_accepted + pub.control_rejected == len(msgs), 10, "all control messages")
        assert got == [{"slo_ms": 40.0}, {"admission": False}, {"slo_ms": None}]
        assert pub.control_rejected == 4
    finally:
        pub.close()


def test_broker_outage_never_blocks_submit_counts_drops_and_publishing_resumes(tmp_path):
    broker = Mosquitto(tmp_path / "mq").start()
    t = topics("outage")
    sub = Subscriber(broker.port, [t["steps"]])
    pub = publisher(broker.url, "outage", queue_size=50, batch_max=10, backoff_min=0.1, backoff_max=0.4)
    recs = step_records(60)
    worst = 0.0
    sent = 0

    def submit(n: int, period: float = 0.002) -> None:
        nonlocal worst, sent
        for _ in range(n):
            r = recs[sent % len(recs)]
            r = type(r)(**{**r.__dict__, "step": sent})
            t0 = time.perf_counter()
            pub.submit(r)
            worst = max(worst, time.perf_counter() - t0)
            sent += 1
            time.sleep(period)

    try:
        wait_until(lambda: pub.connected, 10, "publisher to connect")
        submit(50)
        wait_until(lambda: len(sub.records(t["steps"])) >= 50, 10, "records before the outage")
        broker.stop()
        wait_until(lambda: not pub.connected, 5, "publisher to notice the outage")
        t_out = time.monotonic()
        submit(300)  # ~0.6 s+ of steps with no broker: the queue (50) overflows
        wait_until(lambda: time.monotonic() - t_out > 1.5, 3, "the outage to last 1.5 s")
        assert pub.dropped >= 300 - 50
        before = pub.connects
        broker.start()
        wait_until(lambda: pub.connects > before and pub.connected, 10, "publisher to reconnect")
        wait_until(lambda: sub.client.is_connected(), 10, "subscriber to reconnect")
        time.sleep(0.3)  # let the subscriber's re-subscription settle
        first_after = sent
        submit(40)
        wait_until(lambda: any(r["step"] >= first_after + 39 for r in sub.records(t["steps"])), 10,
                   "records after the broker came back")
        steps_seen = {r["step"] for r in sub.records(t["steps"])}
        assert set(range(first_after, first_after + 40)) <= steps_seen  # publishing resumed, nothing lost
        assert worst < 0.05, f"submit() took {worst * 1e3:.1f} ms"  # a lock and an append, never the network
        st = pub.stats()
        assert st["submitted"] == sent == st["published"] + st["dropped"] + st["queued"]
    finally:
        pub.close()
        sub.close()
        broker.stop()


def test_queue_is_bounded_and_drops_oldest_without_a_broker():
    pub = MqttPublisher(f"mqtt://127.0.0.1:{free_port()}", "nobroker", queue_size=100, backoff_max=0.2).start()
    try:
        t0 = time.perf_counter()
        for r in step_records(10) * 50:
            pub.submit(r)
        assert time.perf_counter() - t0 < 1.0
        assert pub.queued == 100 and pub.dropped == 400
        wait_until(lambda: pub.connect_failures >= 2, 5, "connection attempts with backoff")
        assert not pub.connected and "refused" in (pub.last_error or "").lower()
    finally:
        pub.close()
    assert pub.dropped == 500  # the queued ones were never sent: counted too


def test_username_and_password(tmp_path):
    broker = Mosquitto(tmp_path / "auth", users={"m2live": "s3cret"}).start()
    t = topics("auth")
    try:
        sub = Subscriber(broker.port, [t["steps"]], username="m2live", password="s3cret")
        good = publisher(broker.url, "auth", username="m2live", password="s3cret")
        # credentials in the URL work too
        in_url = publisher(f"mqtt://m2live:s3cret@127.0.0.1:{broker.port}", "auth-url")
        bad = publisher(broker.url, "auth", username="m2live", password="wrong")
        anon = publisher(broker.url, "auth-anon")
        try:
            wait_until(lambda: good.connected and in_url.connected, 10, "authenticated publishers")
            good.submit(step_records(1)[0])
            wait_until(lambda: sub.records(t["steps"]), 10, "a record through the authenticated broker")
            wait_until(lambda: bad.connect_failures >= 1 and anon.connect_failures >= 1, 10, "refusals")
            assert not bad.connected and not anon.connected and bad.connects == 0 and anon.connects == 0
            assert "authori" in bad.last_error.lower() or "password" in bad.last_error.lower(), bad.last_error
        finally:
            for p in (good, in_url, bad, anon):
                p.close()
            sub.close()
    finally:
        broker.stop()


def _make_ca_and_server_cert(d: Path) -> tuple[Path, Path, Path]:
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=m2live-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "ext.cnf", "-out", "server.crt")
    return d / "ca.crt", d / "server.crt", d / "server.key"


def test_tls_with_a_private_ca(tmp_path):
    ca, crt, key = _make_ca_and_server_cert(tmp_path)
    broker = Mosquitto(tmp_path / "tls")
    broker.conf.write_text(broker.conf.read_text() + f"cafile {ca}\ncertfile {crt}\nkeyfile {key}\n")
    broker.start()
    t = topics("tls")
    try:
        pub = publisher(f"mqtts://127.0.0.1:{broker.port}", "tls", tls_ca=str(ca))
        untrusted = publisher(f"mqtts://127.0.0.1:{broker.port}", "tls-untrusted")  # system CAs only
        try:
            wait_until(lambda: pub.connected, 10, "TLS publisher to connect")
            pub.submit(step_records(1)[0])
            wait_until(lambda: pub.published == 1, 10, "a record over TLS")
            wait_until(lambda: untrusted.connect_failures >= 1, 10, "the untrusted connection to fail")
            assert not untrusted.connected and "certificate" in untrusted.last_error.lower()
        finally:
            pub.close()
            untrusted.close()
        assert t["steps"].endswith("/steps")
    finally:
        broker.stop()


@pytest.mark.parametrize("url", ["http://127.0.0.1:1883", "127.0.0.1:1883", "mqtt://", "mqtt://h:notaport"])
def test_bad_url_is_one_clear_error(url):
    with pytest.raises(ExporterError, match="MQTT URL"):
        MqttPublisher(url, "x")


def test_bad_instance_and_missing_tls_files_are_clear_errors(tmp_path):
    with pytest.raises(ExporterError, match="instance"):
        MqttPublisher("mqtt://127.0.0.1", "a/#")
    with pytest.raises(ExporterError, match="tls_ca file not found"):
        MqttPublisher("mqtts://127.0.0.1", "x", tls_ca=str(tmp_path / "nope.crt"))

"""MQTT publisher: a compact per-step stream, a retained status with a last will, and a control topic.

Topics (DESIGN.md ★), for an ``instance`` name:
- ``m2live/<instance>/steps`` — JSON list of ``StepRecord.to_dict()``, one message per batch (≤ ``batch_max``
  records, sent every ``flush_s`` or as soon as a batch is full), QoS 0.
- ``m2live/<instance>/status`` — retained ``online`` on every (re)connect; ``offline`` on a clean close, and the
  broker publishes the same ``offline`` as our last will when the connection dies (process killed, network).
- ``m2live/<instance>/control`` — subscribed only when an ``on_control`` callback is given (the plugin gives one
  only with ``M2LIVE_MQTT_CONTROL=1``). A JSON object with ``slo_ms`` (milliseconds within
  ``m2live.limits.SLO_MS``, or null to switch admission off), ``admission`` (true/false) and optionally ``by`` (a
  short name of who sends it, logged; MQTT 3.1.1 does not tell a subscriber who published). The raw payload is
  refused before JSON parsing when it is larger than ``CONTROL_MAX_BYTES`` or nested deeper than
  ``CONTROL_MAX_DEPTH``; a *retained* message (one the broker kept from before we connected) is refused unless
  ``control_retained=True``. Valid messages reach ``on_control`` as a dict (``{"slo_ms": 40.0}``), called on the
  MQTT thread, and are logged at INFO; anything else is logged at WARNING and counted in ``control_rejected``.
  m2live has no authorisation of its own: who may publish on the control topic is the broker's ACL's decision.

The client (aiomqtt) runs on its own thread with its own asyncio loop. ``publish`` only appends to a bounded
queue (``m2live.workqueue.DropOldestQueue``: drop oldest, counted in ``dropped``) and never blocks or raises,
whatever the broker does. When the
broker goes away the publisher reconnects with exponential backoff (``backoff_min`` doubling up to
``backoff_max``); records queued meanwhile are sent after the reconnect (the oldest are dropped if the queue
fills up). A batch lost in a failed publish is counted as dropped too. The first failed attempt of each outage is
logged at WARNING, then at most one WARNING per ``warn_every_s`` while it lasts, and the reconnect says how long
the outage was; no outage is ever demoted to DEBUG. Log lines and errors never contain the password (URLs are
shown without their user:password part).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable

from m2live import limits
from m2live.config import mask_url
from m2live.record import StepRecord
from m2live.workqueue import DropOldestQueue

from . import ExporterError

log = logging.getLogger("m2live.exporters.mqtt")

CONTROL_KEYS = ("slo_ms", "admission", "by")
_SETTING_KEYS = ("slo_ms", "admission")  # the keys that change something


def topics(instance: str) -> dict[str, str]:
    base = f"m2live/{instance}"
    return {"steps": f"{base}/steps", "status": f"{base}/status", "control": f"{base}/control"}


def _too_deep(raw: bytes, max_depth: int) -> bool:
    """True if ``[``/``{`` nest deeper than ``max_depth`` outside JSON strings (scanned before parsing, so a
    ``[`` x 100000 payload never reaches the recursive JSON parser)."""
    depth = 0
    in_str = esc = False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:  # "
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                return True
        elif c in (0x5D, 0x7D):
            depth -= 1
    return False


def validate_control(payload: bytes | str) -> dict:
    """Parse and check a control message; returns e.g. ``{"slo_ms": 40.0}``. Raises ValueError (one line).

    Size and nesting are checked on the raw bytes first; values get the configuration's own bounds
    (``m2live.limits``), so nothing a remote peer sends can set what ``M2LIVE_SLO_MS`` could not."""
    raw = payload.encode("utf-8", "replace") if isinstance(payload, str) else bytes(payload)
    if len(raw) > limits.CONTROL_MAX_BYTES:
        raise ValueError(f"control message of {len(raw)} bytes refused (at most {limits.CONTROL_MAX_BYTES})")
    if _too_deep(raw, limits.CONTROL_MAX_DEPTH):
        raise ValueError(f"control message nested deeper than {limits.CONTROL_MAX_DEPTH} levels refused")
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("control message is not JSON") from None
    if not isinstance(msg, dict):
        raise ValueError(f"control message must be a JSON object, got {type(msg).__name__}")
    unknown = sorted(set(msg) - set(CONTROL_KEYS))
    if unknown:
        shown = ", ".join(repr(k[:32]) for k in unknown[:5])
        raise ValueError(f"unknown control key(s) {shown} (known: {', '.join(CONTROL_KEYS)})")
    if not any(k in msg for k in _SETTING_KEYS):
        raise ValueError(f"control message sets nothing (known keys: {', '.join(CONTROL_KEYS)})")
    out: dict = {}
    if "slo_ms" in msg:
        v = msg["slo_ms"]
        if v is not None:
            try:
                limits.SLO_MS.check(v, "slo_ms")
            except ValueError:
                raise ValueError(f"slo_ms must be a positive number of milliseconds within "
                                 f"{limits.SLO_MS.describe()} (M2LIVE_SLO_MS's bounds) or null, got "
                                 f"{str(v)[:32]}") from None
        out["slo_ms"] = None if v is None else float(v)
    if "admission" in msg:
        v = msg["admission"]
        if not isinstance(v, bool):
            raise ValueError(f"admission must be true or false, got {str(v)[:32]}")
        out["admission"] = v
    if "by" in msg:
        v = msg["by"]
        if not isinstance(v, str) or not re.fullmatch(r"[\w.@:\-]{1,64}", v):
            raise ValueError("by must be a short name (1-64 letters, digits, . @ : - _)")
        out["by"] = v
    return out


def _parse_url(url: str) -> tuple[str, int, bool, str | None, str | None]:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not u.hostname:
        raise ExporterError(f"MQTT URL must look like mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got "
                            f"{mask_url(url)!r}")
    tls = u.scheme in ("mqtts", "ssl")
    try:
        port = u.port or (8883 if tls else 1883)
    except ValueError:
        raise ExporterError(f"MQTT URL has a bad port: {mask_url(url)!r}") from None
    user = urllib.parse.unquote(u.username) if u.username else None
    pw = urllib.parse.unquote(u.password) if u.password else None
    return u.hostname, port, tls, user, pw


class MqttPublisher:
    """Sink publishing step records to MQTT from its own thread (see module docstring)."""

    kind = "mqtt"

    def __init__(self, url: str, instance: str, *, on_control: Callable[[dict], None] | None = None,
                 queue_size: int = 1024, batch_max: int = 64, flush_s: float = 0.25,
                 username: str | None = None, password: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, qos: int = 0,
                 backoff_min: float = 0.2, backoff_max: float = 5.0, keepalive: int = 10,
                 control_retained: bool = False, warn_every_s: float = 60.0):
        self.host, self.port, tls, url_user, url_pw = _parse_url(url)
        if not instance or not re.fullmatch(r"[A-Za-z0-9_.:\-/]+", instance) or "//" in instance:
            raise ExporterError(f"MQTT instance must be a non-empty topic level without wildcards, got {instance!r}")
        if queue_size < 1 or batch_max < 1 or flush_s <= 0:
            raise ExporterError("MQTT queue_size and batch_max must be >= 1 and flush_s > 0")
        if qos not in (0, 1, 2):
            raise ExporterError(f"MQTT qos must be 0, 1 or 2, got {qos!r}")
        for what, path in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)):
            if path is not None and not os.path.isfile(path):
                raise ExporterError(f"MQTT {what} file not found: {path}")
        if (tls_cert is None) != (tls_key is None):
            raise ExporterError("MQTT client TLS needs both tls_cert and tls_key")
        self.url, self.instance = url, instance
        self.topics = topics(instance)
        self.on_control = on_control
        self.control_retained = control_retained  # apply a retained control message found at connect
        self.warn_every_s = warn_every_s
        self.username = username if username is not None else url_user
        self.password = password if password is not None else url_pw
        self.tls = tls or tls_ca is not None or tls_cert is not None
        self.tls_ca, self.tls_cert, self.tls_key = tls_ca, tls_cert, tls_key
        self.qos = qos
        self.queue_size, self.batch_max, self.flush_s = queue_size, batch_max, flush_s
        self.backoff_min, self.backoff_max, self.keepalive = backoff_min, backoff_max, keepalive
        # counters (read from other threads; plain ints are fine under the GIL)
        self.submitted = 0  # records handed to publish()
        self.published = 0  # records handed to the broker
        self._lost = 0  # records taken from the queue but lost in a failed publish, or left unsent at close
        self.batches = 0
        self.connects = 0
        self.connect_failures = 0
        self.control_accepted = 0
        self.control_rejected = 0
        self.control_retained_ignored = 0  # retained control messages refused (part of control_rejected)
        self.last_error: str | None = None
        self._outage_failures = 0  # failed attempts in the current outage
        self._outage_since = 0.0
        self._outage_warned = 0.0
        self._q: DropOldestQueue[StepRecord] = DropOldestQueue(queue_size)  # in hand = being published
        self._qlock = threading.Lock()  # the counters and the queue move together (stats() is consistent)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._wake_pending = False
        self._stopping = False
        self._connected = False
        self._thread: threading.Thread | None = None

    # ---- engine side -----------------------------------------------------------------------------------
    def start(self) -> MqttPublisher:
        """Start the MQTT thread; returns at once (the connection is made, and remade, in the background)."""
        try:
            import aiomqtt  # noqa: F401 - fail here, at start-up, not silently on the MQTT thread
        except ImportError:
            raise ExporterError("MQTT needs the aiomqtt package: pip install aiomqtt") from None
        if self._thread is None:
            self._thread = threading.Thread(target=self._thread_main, name=f"m2live-mqtt-{self.instance}",
                                            daemon=True)
            self._thread.start()
        return self

    def publish(self, record: StepRecord) -> None:
        """Queue one record; never blocks on the network, never raises."""
        with self._qlock:
            self.submitted += 1
            self._q.put(record)
            full = len(self._q) >= self.batch_max and not self._wake_pending
            if full:
                self._wake_pending = True
        if full:
            self._poke()

    submit = publish  # the older name of the same thing

    def flush(self) -> None:
        """Send what is queued now instead of at the next ``flush_s`` tick (returns at once)."""
        self._poke()

    def sink_counters(self) -> dict[str, float]:
        """What the monitor adds to its counters: the records dropped here and the control messages refused."""
        return {"mqtt_dropped_total": float(self.dropped), "control_rejected_total": float(self.control_rejected)}

    @property
    def dropped(self) -> int:
        """Records dropped: queue full (oldest first), lost in a failed publish, published after or unsent at
        close."""
        return self._q.dropped + self._lost

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def queued(self) -> int:
        """Records not yet handed to the broker (queued or being published)."""
        return len(self._q) + self._q.taken

    def stats(self) -> dict[str, int]:
        """A consistent snapshot: submitted == published + dropped + queued."""
        with self._qlock:
            return {"submitted": self.submitted, "published": self.published, "dropped": self.dropped,
                    "queued": self.queued, "connects": self.connects,
                    "connect_failures": self.connect_failures, "control_accepted": self.control_accepted,
                    "control_rejected": self.control_rejected}

    def close(self, timeout: float = 3.0) -> None:
        """Send what is queued (if connected), publish ``offline`` (retained), disconnect, stop the thread."""
        self._stopping = True
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._qlock:
            self._q.close()  # records published from now on are dropped (counted)
            unsent = self._q.take(0.0)
            self._lost += len(unsent)
            self._q.done(len(unsent))

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop already closed
                pass

    # ---- MQTT thread ---------------------------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # never let the thread die silently
            log.error("m2live: MQTT publisher stopped: %s", e)
            self.last_error = str(e)

    def _client(self):
        import aiomqtt

        tls = None
        if self.tls:
            tls = aiomqtt.TLSParameters(ca_certs=self.tls_ca, certfile=self.tls_cert, keyfile=self.tls_key)
        return aiomqtt.Client(
            self.host, self.port, username=self.username, password=self.password,
            identifier=f"m2live-{self.instance.replace('/', '-')}-{os.getpid()}-{id(self) & 0xffff:x}",
            will=aiomqtt.Will(self.topics["status"], b"offline", qos=1, retain=True),
            keepalive=self.keepalive, tls_params=tls, timeout=5.0)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        delay = self.backoff_min
        while not self._stopping:
            try:
                async with self._client() as client:
                    await client.publish(self.topics["status"], b"online", qos=1, retain=True)
                    if self.on_control is not None:
                        await client.subscribe(self.topics["control"], qos=1)
                    self._connected = True  # online published and control subscribed
                    self.connects += 1
                    if self._outage_failures:
                        log.warning("m2live: MQTT %s to %s:%d after %d failed attempt(s) over %.1f s",
                                    "reconnected" if self.connects > 1 else "connected", self.host, self.port,
                                    self._outage_failures, time.monotonic() - self._outage_since)
                    elif self.connects > 1:
                        log.warning("m2live: MQTT reconnected to %s:%d", self.host, self.port)
                    self._outage_failures = 0
                    delay = self.backoff_min
                    await self._serve(client)
                    await client.publish(self.topics["status"], b"offline", qos=1, retain=True)
                    return  # clean close: leaving the context disconnects (no last will)
            except Exception as e:  # aiomqtt.MqttError, TLS/OS errors: back off and retry
                self.connect_failures += 1
                self.last_error = self._scrub(f"{type(e).__name__}: {e}")
                self._log_failure(delay)
            finally:
                self._connected = False
            if self._stopping:
                break
            try:
                await asyncio.wait_for(self._wake.wait(), delay)  # close() cuts the wait short
            except TimeoutError:
                pass
            self._wake.clear()
            delay = min(delay * 2, self.backoff_max)

    def _scrub(self, text: str) -> str:
        """``text`` without the password (an error from a library may echo what it was given)."""
        if self.password:
            text = text.replace(self.password, "***")
        return text

    def _log_failure(self, delay: float) -> None:
        """WARNING for the first failed attempt of every outage, then at most one per ``warn_every_s``."""
        now = time.monotonic()
        self._outage_failures += 1
        if self._outage_failures == 1:
            self._outage_since = self._outage_warned = now
            log.warning("m2live: MQTT %s:%d unavailable (%s); retrying in %.1f s", self.host, self.port,
                        self.last_error, delay)
        elif now - self._outage_warned >= self.warn_every_s:
            self._outage_warned = now
            log.warning("m2live: MQTT %s:%d still unavailable after %d attempts over %.0f s (%s); retrying every "
                        "%.1f s at most", self.host, self.port, self._outage_failures, now - self._outage_since,
                        self.last_error, self.backoff_max)

    async def _serve(self, client) -> None:
        """Publish batches and read control messages until closing (returns) or the connection drops (raises)."""
        pump = asyncio.create_task(self._pump(client))
        reader = asyncio.create_task(self._read(client))
        done, pending = await asyncio.wait({pump, reader}, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            t.result()  # re-raise a connection error
        if reader in done:
            raise ConnectionError("control subscription ended")

    def _take(self) -> list[StepRecord]:
        with self._qlock:
            batch = self._q.take(0.0, most=self.batch_max)
            self._wake_pending = False
        return batch

    async def _pump(self, client) -> None:
        wake = self._wake
        while True:
            batch = self._take()
            if batch:
                payload = json.dumps([r.to_dict() for r in batch], separators=(",", ":"))
                try:
                    await client.publish(self.topics["steps"], payload, qos=self.qos)
                except BaseException:
                    with self._qlock:
                        self._lost += len(batch)
                        self._q.done(len(batch))
                    raise
                with self._qlock:
                    self.published += len(batch)
                    self._q.done(len(batch))
                self.batches += 1
                continue
            if self._stopping:
                return
            try:
                await asyncio.wait_for(wake.wait(), self.flush_s)
            except TimeoutError:
                pass
            wake.clear()

    async def _read(self, client) -> None:
        async for msg in client.messages:  # also how a lost connection shows (the iterator raises)
            if self.on_control is None or str(msg.topic) != self.topics["control"]:
                continue  # control off: the topic is not subscribed, and nothing would be applied anyway
            try:
                self._handle_control(msg.payload, retained=bool(getattr(msg, "retain", False)))
            except Exception as e:  # noqa: BLE001 - a message must never end the subscription
                self.control_rejected += 1
                log.warning("m2live: MQTT control message on %s failed: %s", self.topics["control"],
                            type(e).__name__)

    def _handle_control(self, payload, retained: bool = False) -> None:
        where = f"{self.topics['control']} (broker {self.host}:{self.port})"
        if retained and not self.control_retained:
            self.control_rejected += 1
            self.control_retained_ignored += 1
            log.warning("m2live: ignored a retained MQTT control message on %s: it was published before this "
                        "engine connected (M2LIVE_MQTT_CONTROL_RETAINED=1 applies such messages)", where)
            return
        try:
            raw = payload if isinstance(payload, bytes | str) else bytes(payload)
            cmd = validate_control(raw)
        except (ValueError, TypeError) as e:
            self.control_rejected += 1
            log.warning("m2live: ignored MQTT control message on %s: %s", where, e)
            return
        by = cmd.get("by")
        self.control_accepted += 1
        log.info("m2live: MQTT control accepted on %s%s from %s: %s", where, " (retained)" if retained else "",
                 f"'{by}' (as the message says)" if by else "an unnamed publisher", cmd)
        if self.on_control is not None:
            try:
                self.on_control(cmd)
            except Exception as e:  # noqa: BLE001
                log.warning("m2live: on_control failed for %s: %s", cmd, e)

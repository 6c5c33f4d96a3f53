"""SLO-aware admission benchmark on a real vLLM-CPU server, driven by vLLM's own serving benchmark client.

For each policy the script starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (the shipped
``bench-llama`` config, dummy weights, a word-level tokenizer built offline) with the m2live plugin on
(``M2LIVE_ENABLE=1``, ``M2LIVE_TRACE`` for the per-step times), warms it up, and replays the same workload with
``vllm.benchmarks.serve`` (custom JSONL dataset: lognormal prompts, uniform outputs, Poisson arrivals, fixed
seed). Policies: ``vllm_default`` (vLLM's CPU server default budget), ``static_<budget>``
(``--max-num-batched-tokens``), ``m2live`` (default limits + ``M2LIVE_SLO_MS``); ``best_static`` is chosen in
hindsight. A second m2live run changes the SLO half way over MQTT (a real Mosquitto broker) to show how the
static budgets fare when the SLO moves (their steps do not depend on the SLO, so their phases are scored from
their main runs at the same offset).

    python bench/admission.py --out results/admission.json          # ~10 min of engine time
    python bench/admission.py --out /tmp/a.json --quick             # a short smoke run of the harness
    python bench/admission.py --out results/admission.json --rescore DIR   # recompute from a kept run dir

Every engine run holds the machine-wide engine lock (/tmp/m2live-engine.lock).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from m2live import trace  # noqa: E402
from m2live.enginelock import engine_lock  # noqa: E402

MODEL_CONFIG = REPO / "m2live" / "data" / "models" / "bench-llama" / "config.json"
PY = sys.executable
SERVED_NAME = "bench-llama"

CLIENT = """
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


class BenchError(ValueError):
    """A benchmark step that cannot go on (one clear line)."""


# ---------------------------------------------------------------------------------------------------------
# model dir, tokenizer, workload
# ---------------------------------------------------------------------------------------------------------
def make_model_dir(dest: Path) -> Path:
    """config.json of the shipped bench model + a word-level tokenizer ("w<i>" is token i): a prompt of N
    words is exactly N tokens, and every id the dummy model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = json.loads(MODEL_CONFIG.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL_CONFIG, dest / "config.json")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, int(cfg["vocab_size"])):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "model_max_length": int(cfg["max_position_embeddings"]),
        "add_bos_token": False, "add_eos_token": False,
    }))
    return dest


@dataclass
class Workload:
    requests: int = 60
    rate: float = 1.5  # requests/s (Poisson)
    prompt_median: int = 200
    prompt_sigma: float = 0.6
    prompt_min: int = 16
    prompt_max: int = 1500
    output_min: int = 16
    output_max: int = 64
    seed: int = 0

    def rows(self) -> list[dict]:
        rng = random.Random(self.seed)
        vocab = 8000
        out = []
        for _ in range(self.requests):
            n = int(round(math.exp(rng.gauss(math.log(self.prompt_median), self.prompt_sigma))))
            n = min(self.prompt_max, max(self.prompt_min, n))
            words = " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n))
            out.append({"prompt": words, "output_tokens": rng.randint(self.output_min, self.output_max)})
        return out

    def write(self, path: Path) -> Path:
        with open(path, "w") as f:
            for r in self.rows():
                f.write(json.dumps(r) + "\n")
        return path


# ---------------------------------------------------------------------------------------------------------
# processes: engine lock, mosquitto, the OpenAI server, the client
# ---------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the process group of one child we started."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def mosquitto(workdir: Path) -> Iterator[int]:
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(exe).exists():
        raise BenchError("mosquitto is not installed (make servers)")
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            time.sleep(0.1)
        else:
            raise BenchError(f"mosquitto did not start on port {port}")
        yield port
    finally:
        stop_group(proc, 5)


def publish(port: int, topic: str, payload: dict) -> None:
    """One QoS-1 message to the local broker, through aiomqtt (a dependency: no mosquitto-clients needed)."""
    import asyncio

    import aiomqtt

    async def send() -> None:
        async with aiomqtt.Client("127.0.0.1", port=port, timeout=10) as client:
            await client.publish(topic, json.dumps(payload), qos=1)

    try:
        asyncio.run(asyncio.wait_for(send(), 15))
    except (aiomqtt.MqttError, OSError, TimeoutError) as e:
        raise BenchError(f"could not publish to mqtt://127.0.0.1:{port}/{topic}: {e}") from None


@dataclass
class Policy:
    name: str
    budget: int | None = None  # --max-num-batched-tokens (None: vLLM's default)
    slo_ms: float | None = None  # M2LIVE_SLO_MS (admission on)
    slo_change_ms: float | None = None  # new SLO over MQTT half way through the workload


@dataclass
class RunResult:
    policy: Policy
    dir: Path
    steps: list[dict]
    client: dict
    t_start: float  # wall time the measured client started
    t_end: float
    slo_change_at: float | None = None
    server_config: dict = field(default_factory=dict)

    @property
    def t_first(self) -> float:
        """Start of the first step of the measured workload (the client needs seconds to start sending)."""
        firsts = [s["time"] - s["measured_s"] for s in self.steps
                  if s["time"] >= self.t_start and s.get("num_prefill_tokens", 0) > 0 and s.get("measured_s")]
        return min(firsts) if firsts else self.t_start


class Server:
    def __init__(self, model_dir: Path, run_dir: Path, policy: Policy, mqtt_port: int | None, kv_gib: int,
                 eager: bool = True, max_model_len: int = 4096, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.trace = run_dir / "trace.jsonl"
        self.log = run_dir / "server.log"
        self.policy = policy
        self.instance = f"bench-{policy.name}"
        env = dict(os.environ)
        env.update({
            "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "TOKENIZERS_PARALLELISM": "false",
            "M2LIVE_ENABLE": "1", "M2LIVE_TRACE": str(self.trace), "M2LIVE_PROM": "0",
            "M2LIVE_MQTT_INSTANCE": self.instance, "PYTHONUNBUFFERED": "1",
        })
        env.pop("M2LIVE_SLO_MS", None)
        env.pop("M2LIVE_MQTT_URL", None)
        if policy.slo_ms is not None:
            env["M2LIVE_SLO_MS"] = str(policy.slo_ms)
        if mqtt_port is not None:
            env["M2LIVE_MQTT_URL"] = f"mqtt://127.0.0.1:{mqtt_port}"
        self.env = env
        self.cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--tokenizer", str(model_dir), "--served-model-name", SERVED_NAME, "--load-format", "dummy",
                    "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(max_model_len),
                    "--dtype", "bfloat16", "--uvicorn-log-level", "warning", *extra_args]
        if policy.budget is not None:
            self.cmd += ["--max-num-batched-tokens", str(policy.budget)]
        if eager:  # skips ~35 s of graph capture per start-up on this CPU; the same for every policy
            self.cmd += ["--enforce-eager"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.trace.unlink()
        self._logf = open(self.log, "w")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._logf, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.run_dir)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"server for {self.policy.name} exited with {self.proc.returncode}; "
                                 f"see {self.log}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.5)
        raise BenchError(f"server for {self.policy.name} not ready after 300 s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_group(self.proc)
        self._logf.close()

    def counter(self, name: str) -> float:
        """A counter of the server's own Prometheus metrics (``/metrics``), summed over its label sets."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
        if not values:
            raise BenchError(f"the server exports no {name}")
        return float(sum(values))

    def complete(self, prompt_words: int, max_tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        body = json.dumps({"model": SERVED_NAME, "prompt": " ".join(f"w{rng.randrange(3, 8000)}"
                                                                    for _ in range(prompt_words)),
                           "max_tokens": max_tokens, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()

    def warm_up(self) -> None:
        """A few concurrent mixed requests: compiles what needs compiling, teaches the online correction."""
        shapes = [(400, 16), (200, 16), (600, 8), (100, 24), (300, 16), (50, 24)]
        threads = [threading.Thread(target=self.complete, args=(p, o, i)) for i, (p, o) in enumerate(shapes)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()


def run_client(server: Server, dataset: Path, wl: Workload, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-c", CLIENT, "--backend", "vllm", "--host", "127.0.0.1", "--port", str(server.port),
           "--model", SERVED_NAME, "--tokenizer", str(server.model_dir), "--dataset-name", "custom",
           "--dataset-path", str(dataset), "--custom-output-len", "-1", "--skip-chat-template", "--ignore-eos",
           "--disable-shuffle", "--num-prompts", str(wl.requests), "--request-rate", str(wl.rate),
           "--seed", str(wl.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
           "50,90,99", "--save-result", "--result-dir", str(out_dir), "--result-filename", "client.json",
           "--disable-tqdm"]
    env = dict(server.env)
    with open(out_dir / "client.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900,
                              cwd=out_dir)
    if proc.returncode != 0:
        raise BenchError(f"benchmark client failed ({proc.returncode}); see {out_dir / 'client.log'}")
    return json.loads((out_dir / "client.json").read_text())


def read_trace(path: Path) -> list[dict]:
    """The plugin's step records (m2live.trace: torn or garbled lines skipped)."""
    if not path.exists():
        raise BenchError(f"no trace at {path}: is the m2live plugin installed (M2LIVE_ENABLE=1)?")
    try:
        return trace.read_trace(path)
    except trace.TraceError:
        return []  # the server has not recorded a step yet


def first_workload_step(trace: Path, after: float, timeout: float = 120.0) -> float:
    """Wall time of the first step that finished after ``after`` (the client's first request)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if trace.exists():
            for line in trace.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                    r = json.loads(line)
                    if r["time"] >= after and r["num_prefill_tokens"] > 0:
                        return float(r["time"])
        time.sleep(0.2)
    raise BenchError("the client's requests never reached the engine")


def run_policy(policy: Policy, model_dir: Path, dataset: Path, wl: Workload, workdir: Path,
               kv_gib: int, eager: bool = True) -> RunResult:
    run_dir = workdir / "runs" / policy.name
    with engine_lock(), contextlib.ExitStack() as stack:
        mqtt_port = stack.enter_context(mosquitto(run_dir.parent)) if policy.slo_change_ms else None
        t0 = time.time()
        server = stack.enter_context(Server(model_dir, run_dir, policy, mqtt_port, kv_gib, eager))
        print(f"[{policy.name}] server ready in {time.time() - t0:.0f} s", flush=True)
        server.warm_up()
        t_start = time.time()
        changed: list[float] = []
        if policy.slo_change_ms is not None:
            assert mqtt_port is not None
            half = (wl.requests / 2) / wl.rate  # arrival time of the middle request

            def change() -> None:
                t_first = first_workload_step(server.trace, t_start)
                time.sleep(max(0.0, t_first + half - time.time()))
                publish(mqtt_port, f"m2live/{server.instance}/control", {"slo_ms": policy.slo_change_ms})
                changed.append(time.time())

            th = threading.Thread(target=change, daemon=True)
            th.start()
        client = run_client(server, dataset, wl, run_dir)
        t_end = time.time()
        if policy.slo_change_ms is not None:
            th.join(5)
            if not changed:
                raise BenchError("the SLO change was never published")
        time.sleep(1.0)  # let the trace writer flush the last steps
    steps = read_trace(run_dir / "trace.jsonl")
    meta = {"t_start": t_start, "t_end": t_end, "slo_change_at": changed[0] if changed else None,
            "policy": policy.__dict__}
    (run_dir / "meta.json").write_text(json.dumps(meta))
    print(f"[{policy.name}] {len(steps)} steps, {client.get('output_throughput', 0):.0f} tok/s, "
          f"TTFT {client.get('mean_ttft_ms', 0):.0f} ms", flush=True)
    return RunResult(policy, run_dir, steps, client, t_start, t_end, meta["slo_change_at"])


def load_run(run_dir: Path) -> RunResult:
    meta = json.loads((run_dir / "meta.json").read_text())
    return RunResult(Policy(**meta["policy"]), run_dir, read_trace(run_dir / "trace.jsonl"),
                     json.loads((run_dir / "client.json").read_text()), meta["t_start"], meta["t_end"],
                     meta["slo_change_at"])


# ---------------------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------------------
def tokens_of(step: dict) -> int:
    """Tokens a step generated: one per decode, one per prefill chunk that finished its prompt (when the
    trace says; otherwise every prefill sequence counts)."""
    done = step.get("num_prefill_completed")
    if done is None:
        done = step.get("num_prefill_seqs", 0)
    return int(step.get("num_decode_tokens", 0)) + int(done)


def window(run: RunResult, t0: float | None = None, t1: float | None = None) -> list[dict]:
    a = run.t_first if t0 is None else t0
    b = run.t_end if t1 is None else t1
    return [s for s in run.steps if s.get("measured_s") and a <= s["time"] <= b
            and (s.get("num_prefill_tokens", 0) + s.get("num_decode_tokens", 0)) > 0]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def attainment(steps: list[dict], slo_s: float) -> tuple[float, float]:
    """(token-weighted, per-step) fraction within the SLO."""
    if not steps:
        return float("nan"), float("nan")
    ok = [s["measured_s"] <= slo_s for s in steps]
    w = [tokens_of(s) for s in steps]
    tw = sum(wi for wi, o in zip(w, ok, strict=True) if o) / max(1, sum(w))
    return tw, sum(ok) / len(ok)


def score(run: RunResult, slo_s: float) -> dict:
    steps = window(run)
    ms = [1e3 * s["measured_s"] for s in steps]
    tw, sw = attainment(steps, slo_s)
    c = run.client
    budgets = [s["token_budget"] for s in steps if s.get("token_budget") is not None and s["num_prefill_tokens"]]
    pred_err = [abs(s["corrected_s"] - s["measured_s"]) / s["measured_s"] for s in steps if s.get("corrected_s")]
    return {
        "name": run.policy.name,
        "slo_attainment": tw,
        "step_slo_attainment": sw,
        "output_tokens_per_s": float(c.get("output_throughput", float("nan"))),
        "p50_step_ms": pct(ms, 0.50),
        "p99_step_ms": pct(ms, 0.99),
        "max_step_ms": max(ms) if ms else float("nan"),
        "p99_itl_ms": float(c.get("p99_itl_ms", float("nan"))),
        "mean_ttft_ms": float(c.get("mean_ttft_ms", float("nan"))),
        "p99_ttft_ms": float(c.get("p99_ttft_ms", float("nan"))),
        "completed": int(c.get("completed", 0)),
        "steps": len(steps),
        "configured_max_num_batched_tokens": run.policy.budget or VLLM_CPU_SERVER_DEFAULT_BUDGET,
        "mean_token_budget_prefill_steps": sum(budgets) / len(budgets) if budgets else None,
        "admission_flagged_steps": sum(1 for s in steps if s.get("admission_flagged")),
        "median_abs_corrected_error": pct(pred_err, 0.5) if pred_err else None,
        "run_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.t_start)),
    }


def decision_cost(run: RunResult, slo_s: float, wl: Workload) -> dict:
    """Decision cost of the controller, replayed offline on this machine over the run's own steps: each step's
    decodes and prefill as the running set, a queue of workload prompts waiting (so the budget search really
    runs), the residual tracker trained on the run's measurements as it goes. Also the plugin's whole per-step
    hook overhead as measured live (trace ``hook_overhead_s``: the engine-thread hooks, decision included)."""
    from m2live import Predictor, Step
    from m2live.admission import AdmissionController, QueueView
    from m2live.cpu_device import cpu_device
    from m2live.residuals import ResidualTracker

    p = Predictor(cpu_device(), MODEL_CONFIG.parent)
    tracker = ResidualTracker()
    ctrl = AdmissionController(p, tracker, slo_s)
    prompts = [len(r["prompt"].split()) for r in wl.rows()]
    times, frac, evals = [], [], []
    for i, s in enumerate(window(run)):
        step = Step.from_counts(s["num_prefill_tokens"], s["prefill_kv_tokens"], s["num_decode_tokens"],
                                s["decode_kv_tokens"])
        pending = [(s["num_prefill_tokens"], s["prefill_kv_tokens"])] if s["num_prefill_tokens"] else []
        view = QueueView(step.decode_contexts, pending, [prompts[(i + k) % len(prompts)] for k in range(4)],
                         VLLM_CPU_SERVER_DEFAULT_BUDGET, 128)
        t0 = time.perf_counter()
        d = ctrl.decide(view, 1.0)
        dt = time.perf_counter() - t0
        times.append(dt)
        evals.append(d.evaluations)
        frac.append(dt / s["measured_s"])
        tracker.update(step, p.predict(step, f_clk=1.0), s["measured_s"])
    hooks = [s["hook_overhead_s"] for s in window(run) if s.get("hook_overhead_s") is not None]
    hook_frac = [s["hook_overhead_s"] / s["measured_s"] for s in window(run) if s.get("hook_overhead_s") is not None]
    return {
        "decide_us_median": 1e6 * pct(times, 0.5), "decide_us_p99": 1e6 * pct(times, 0.99),
        "decide_fraction_of_step_median": pct(frac, 0.5), "decide_fraction_of_step_p99": pct(frac, 0.99),
        "predictions_per_decision_mean": sum(evals) / max(1, len(evals)),
        "plugin_hook_us_median": 1e6 * pct(hooks, 0.5) if hooks else None,
        "plugin_hook_fraction_of_step_median": pct(hook_frac, 0.5) if hook_frac else None,
        "how": "decide() replayed offline over the m2live run's steps (tracker trained online on its "
               "measurements); plugin_hook_* = the plugin's per-step time on the engine's thread measured live "
               "(hooks incl. the decision; the record is built on m2live's record thread)",
    }


VLLM_CPU_SERVER_DEFAULT_BUDGET = 2048  # vllm-cpu 0.32 OpenAI server default max_num_batched_tokens


def pick_best_static(rows: list[dict]) -> dict | None:
    """Highest throughput among budgets with slo_attainment >= 0.99; within 2 % of it, the lower mean TTFT
    (``meets_slo`` true). When no budget reaches 0.99 (a load past saturation), the one closest to the SLO —
    highest slo_attainment, then throughput — marked ``meets_slo`` false, so the comparison still has a row."""
    if not rows:
        return None
    ok = [r for r in rows if r["slo_attainment"] >= 0.99]
    if not ok:
        best = max(rows, key=lambda r: (r["slo_attainment"], r["output_tokens_per_s"]))
        return {**best, "meets_slo": False, "chosen_by": "highest slo_attainment (no static budget reached 0.99)"}
    top = max(r["output_tokens_per_s"] for r in ok)
    near = [r for r in ok if r["output_tokens_per_s"] >= 0.98 * top]
    return {**min(near, key=lambda r: r["mean_ttft_ms"]), "meets_slo": True}


def phases(run: RunResult, t_change: float, slo_a: float, slo_b: float) -> list[float]:
    a = window(run, run.t_first, t_change)
    b = window(run, t_change, run.t_end)
    return [attainment(a, slo_a)[0], attainment(b, slo_b)[0]]


# ---------------------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------------------
def plot(result: dict, runs: dict[str, RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = result["slo_ms"]
    pols = [p for p in result["policies"] if p["name"] != "best_static"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    for p in pols:
        ax.scatter(p["output_tokens_per_s"], 100 * p["slo_attainment"], s=60,
                   color="tab:red" if p["name"] == "m2live" else "tab:blue")
        ax.annotate(p["name"], (p["output_tokens_per_s"], 100 * p["slo_attainment"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.axhline(99, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel(f"% of generated tokens in steps ≤ {slo:g} ms")
    ax.set_title("SLO attainment vs throughput")
    ax = axes[0][1]
    names = [p["name"] for p in pols]
    x = range(len(pols))
    ax.bar([i - 0.2 for i in x], [p["p99_step_ms"] for p in pols], 0.4, label="p99 step")
    ax.bar([i + 0.2 for i in x], [p["mean_ttft_ms"] for p in pols], 0.4, label="mean TTFT")
    ax.axhline(slo, color="tab:red", ls="--", lw=0.8, label="SLO")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("step tail and time to first token")
    ax = axes[1][0]
    for name, color in (("m2live", "tab:red"), (result.get("best_static_budget_name") or "", "tab:blue"),
                        ("vllm_default", "tab:gray")):
        run = runs.get(name)
        if run is None:
            continue
        st = window(run)
        ax.plot([s["time"] - run.t_first for s in st], [1e3 * s["measured_s"] for s in st], ".", ms=2,
                color=color, label=name, alpha=0.6)
    ax.axhline(slo, color="k", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("s since the workload started")
    ax.set_ylabel("measured step ms")
    ax.legend(fontsize=8, markerscale=4)
    ax.set_title("every step")
    ax = axes[1][1]
    sc = result.get("slo_change")
    if sc:
        a, b = sc["slo_ms_phases"]
        w = 0.4
        rows = sc["policies"]
        xs = range(len(rows))
        ax.bar([i - w / 2 for i in xs], [100 * r["slo_attainment_per_phase"][0] for r in rows], w,
               label=f"phase 1: SLO {a:g} ms")
        ax.bar([i + w / 2 for i in xs], [100 * r["slo_attainment_per_phase"][1] for r in rows], w,
               label=f"phase 2: SLO {b:g} ms")
        ax.set_xticks(list(xs), [r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.axhline(99, color="gray", ls="--", lw=0.8)
        ax.set_ylim(min(50, min(100 * min(r["slo_attainment_per_phase"]) for r in rows) - 5), 101)
        ax.set_ylabel("% tokens within the SLO in force")
        ax.legend(fontsize=8)
        ax.set_title("SLO changed half way (MQTT control)")
    fig.suptitle(f"m2live admission on vLLM-CPU ({result['workload']['requests']} requests, "
                 f"{result['workload']['rate']} req/s, step SLO {slo:g} ms)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results JSON (e.g. results/admission.json)")
    ap.add_argument("--plot", help="PNG (default: --out with .png)")
    ap.add_argument("--slo-ms", type=float, default=200.0)
    ap.add_argument("--slo-change-ms", type=float, default=100.0, help="SLO after the half-way change")
    ap.add_argument("--budgets", default="64,128,256,512", help="static budgets (comma-separated)")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--compile", action="store_true", help="let vLLM capture graphs (slower start-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny workload, two policies: checks the harness")
    ap.add_argument("--only", help="comma-separated policy names to run (others are skipped)")
    ap.add_argument("--workdir", help="keep raw runs here (default: a temp dir, removed at the end)")
    ap.add_argument("--rescore", help="recompute from the runs kept in this workdir (no engine)")
    a = ap.parse_args(argv)
    if a.slo_ms <= 0 or a.slo_change_ms <= 0:
        ap.error("SLOs must be positive")
    try:
        a.budget_list = [int(b) for b in a.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets must be integers, got {a.budgets!r}")
    if any(b < 16 for b in a.budget_list):
        ap.error("static budgets must be >= 16 tokens")
    if a.requests < 4 or a.rate <= 0:
        ap.error("--requests must be >= 4 and --rate positive")
    return a


def select_policies(a: argparse.Namespace) -> tuple[Workload, list[Policy]]:
    """The workload and the arms to run: vLLM's default, each static budget, m2live, m2live with the SLO changed
    half way (``--quick``: a tiny workload, one static budget and the SLO change; ``--only``: a subset)."""
    wl = Workload(requests=a.requests, rate=a.rate, seed=a.seed)
    policies = [Policy("vllm_default")] + [Policy(f"static_{b}", budget=b) for b in a.budget_list]
    policies += [Policy("m2live", slo_ms=a.slo_ms),
                 Policy("m2live_slo_change", slo_ms=a.slo_ms, slo_change_ms=a.slo_change_ms)]
    if a.quick:
        wl = Workload(requests=10, rate=2.0, seed=a.seed)
        policies = [Policy("static_256", budget=256),
                    Policy("m2live_slo_change", slo_ms=a.slo_ms, slo_change_ms=a.slo_change_ms)]
    if a.only:
        keep = {n.strip() for n in a.only.split(",")}
        policies = [p for p in policies if p.name in keep]
    return wl, policies


@dataclass
class Runs:
    """The arms' runs and what they were run with."""

    slo_ms: float
    slo_change_ms: float
    workload: Workload
    runs: dict[str, RunResult]


def load_runs(workdir: Path) -> Runs:
    """``--rescore``: the runs kept in ``workdir``, with the SLOs and the workload they were run with."""
    saved = json.loads((workdir / "bench.json").read_text())
    runs = {d.name: load_run(d) for d in sorted((workdir / "runs").iterdir()) if (d / "meta.json").exists()}
    return Runs(saved["slo_ms"], saved["slo_change_ms"], Workload(**saved["workload"]), runs)


def run_arms(a: argparse.Namespace, wl: Workload, policies: list[Policy], workdir: Path) -> Runs:
    """Each policy on a fresh server over the same workload; the model, dataset and settings kept in
    ``workdir`` so the runs can be rescored."""
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(workdir / "model")
    dataset = wl.write(workdir / "workload.jsonl")
    (workdir / "bench.json").write_text(json.dumps({"slo_ms": a.slo_ms, "slo_change_ms": a.slo_change_ms,
                                                    "workload": wl.__dict__}))
    t0 = time.time()
    runs = {p.name: run_policy(p, model_dir, dataset, wl, workdir, a.kv_gib, eager=not a.compile)
            for p in policies}
    print(f"engine runs took {time.time() - t0:.0f} s; raw runs in {workdir}", flush=True)
    return Runs(a.slo_ms, a.slo_change_ms, wl, runs)


def is_static(name: str) -> bool:
    return name.startswith("static_") or name == "vllm_default"


def m2live_vs_best_static(m2: dict, best: dict) -> dict:
    return {
        "throughput_ratio": m2["output_tokens_per_s"] / best["output_tokens_per_s"],
        "slo_attainment": m2["slo_attainment"],
        "mean_ttft_ratio": m2["mean_ttft_ms"] / best["mean_ttft_ms"],
        "target_met": m2["slo_attainment"] >= 0.99
        and m2["output_tokens_per_s"] >= 0.95 * best["output_tokens_per_s"],
    }


def _phase_row(name: str, run: RunResult, t_change: float, slo_a: float, slo_b: float) -> dict:
    return {"name": name, "slo_attainment_per_phase": phases(run, t_change, slo_a, slo_b),
            "output_tokens_per_s": float(run.client.get("output_throughput", float("nan"))),
            "mean_ttft_ms": float(run.client.get("mean_ttft_ms", float("nan")))}


def slo_change_result(r: Runs) -> dict | None:
    """The m2live run whose SLO changed half way, against the static budgets' main runs at the same offset."""
    change = r.runs.get("m2live_slo_change")
    if change is None or change.slo_change_at is None:
        return None
    slo_a, slo_b = r.slo_ms / 1e3, r.slo_change_ms / 1e3
    offset = change.slo_change_at - change.t_first
    rows = [_phase_row("m2live", change, change.slo_change_at, slo_a, slo_b)]
    rows += [_phase_row(n, run, run.t_first + offset, slo_a, slo_b) for n, run in r.runs.items() if is_static(n)]
    return {
        "slo_ms_phases": [r.slo_ms, r.slo_change_ms],
        "changed_after_s": offset,
        "how": "MQTT control message {\"slo_ms\": b} to m2live/<instance>/control (real Mosquitto); static "
               "budgets do not react to the SLO, so their phases are scored from their main runs at the same "
               "offset",
        "policies": rows,
    }


def score_runs(r: Runs) -> dict:
    """admission.json: every policy scored under the SLO, best_static picked in hindsight, m2live against it,
    the controller's decision cost and the SLO change."""
    slo_s = r.slo_ms / 1e3
    rows = [score(run, slo_s) for n, run in r.runs.items() if n != "m2live_slo_change"]
    best = pick_best_static([row for row in rows if is_static(row["name"])])
    policies_out = list(rows)
    if best is not None:
        policies_out.append({**best, "name": "best_static", "budget_name": best["name"]})
    result: dict = {
        "slo_ms": r.slo_ms,
        "slo_margin": 0.1,
        "engine": "vllm-cpu 0.32.0 OpenAI server, dummy bf16 Llama (m2live/data/models/bench-llama)",
        "client": "vllm.benchmarks.serve (custom JSONL dataset, Poisson arrivals)",
        "workload": {**r.workload.__dict__},
        "vllm_default_max_num_batched_tokens": VLLM_CPU_SERVER_DEFAULT_BUDGET,
        "best_static_budget_name": best["name"] if best else None,
        "policies": policies_out,
    }
    m2 = next((row for row in rows if row["name"] == "m2live"), None)
    if m2 is not None and best is not None:
        result["m2live_vs_best_static"] = m2live_vs_best_static(m2, best)
    if "m2live" in r.runs:
        result["decision_cost"] = decision_cost(r.runs["m2live"], slo_s, r.workload)
    change = slo_change_result(r)
    if change is not None:
        result["slo_change"] = change
    return result


def write_result(result: dict, runs: dict[str, RunResult], out: Path, png: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n")
    try:
        plot(result, runs, png)
    except Exception as e:  # noqa: BLE001 - the JSON is the result; say why the picture is missing
        print(f"warning: no plot: {type(e).__name__}: {e}", file=sys.stderr)


def print_summary(policies: list[dict]) -> None:
    for r in policies:
        print(f"{r['name']:>16}: SLO {100 * r['slo_attainment']:6.2f} % tokens ({100 * r['step_slo_attainment']:6.2f}"
              f" % steps)  {r['output_tokens_per_s']:6.1f} tok/s  p50/p99 step {r['p50_step_ms']:6.1f}/"
              f"{r['p99_step_ms']:6.1f} ms  p99 ITL {r['p99_itl_ms']:6.1f} ms  TTFT {r['mean_ttft_ms']:7.1f} ms")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    wl, policies = select_policies(a)
    out = Path(a.out)
    png = Path(a.plot) if a.plot else out.with_suffix(".png")
    if a.rescore:
        runs, temp_dir = load_runs(Path(a.rescore)), None
    else:
        workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="m2live-admission-"))
        temp_dir = None if a.workdir else workdir  # removed at the end (kept when a run fails)
        runs = run_arms(a, wl, policies, workdir)
    result = score_runs(runs)
    write_result(result, runs.runs, out, png)
    print_summary(result["policies"])
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

"""Render the dashboard's content to a PNG: every panel's PromQL, evaluated over a time range by a real
Prometheus (``/api/v1/query_range``), plotted with matplotlib in the dashboard's layout order.

    python dashboards/snapshot.py --prometheus http://127.0.0.1:9090 --minutes 5 -o dashboards/snapshot.png

or, for the README picture, a self-contained real run: a vLLM-CPU engine (in this process, dummy weights) with
the m2live plugin switched on by ``M2LIVE_ENABLE=1``, a Prometheus server (Debian ``prometheus`` binary) on a
free port scraping it every second, a varying load, and the SLO changed half way (as an MQTT control would);
it holds the machine-wide engine lock (m2live.enginelock) while the engine runs:

    python dashboards/snapshot.py --run-engine m2live/data/models/bench-llama \
        --seconds 60 -o dashboards/snapshot.png

Grafana is not needed; the picture shows the same series the dashboard would (template variables = All).
``render(url, start, end, out)`` is what the end-to-end engine test calls after a real run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "snapshot.png"


def _dashboard() -> dict:
    spec = importlib.util.spec_from_file_location("m2live_dashboard_build", HERE / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build()


def _query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query_range?{qs}", timeout=20) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    except OSError as e:
        raise ValueError(f"cannot reach Prometheus at {url}: {e}") from None
    if body.get("status") != "success":
        raise ValueError(f"Prometheus rejected {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def _legend(fmt: str, labels: dict) -> str:
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out.replace("{{engine}}", "").strip()


def render(url: str, start: float, end: float, out: Path | str = OUT, rate_interval: str | None = None) -> Path:
    """Query every panel over [start, end] and write the PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = _dashboard()
    span = max(end - start, 10.0)
    step = max(1.0, span / 240)
    ri = rate_interval or f"{max(10, int(4 * step))}s"
    subst = {"$engine": ".*", "$gpu": ".*", "$model": ".*", "$__rate_interval": ri}
    panels = [p for p in d["panels"] if p["type"] != "row"]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, p in zip(axes.flat, panels, strict=False):
        ax.set_title(p["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        series = 0
        for t in p["targets"]:
            expr = t["expr"]
            for k, v in subst.items():
                expr = expr.replace(k, v)
            result = _query_range(url, expr, start, end, step)
            if p["type"] == "heatmap":
                _heatmap(ax, result, start)
                series += len(result)
                continue
            for s in result:
                xs = [float(v[0]) - start for v in s["values"]]
                ys = [float(v[1]) for v in s["values"]]
                ax.plot(xs, ys, lw=1, label=_legend(t.get("legendFormat", ""), s["metric"])[:40])
                series += 1
        if p["type"] != "heatmap":
            custom = p.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
            if custom.get("stacking", {}).get("mode") == "normal":
                _restack(ax)
            if series:
                ax.legend(fontsize=6, loc="upper left", ncol=2 if series > 4 else 1, framealpha=0.6)
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_xlabel("s since start", fontsize=7)
        if unit:
            ax.set_ylabel({"s": "seconds", "percentunit": "ratio", "rotmhz": "MHz", "watt": "W"}.get(unit, unit),
                          fontsize=7)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(end))
    fig.suptitle(f"{d['title']}  —  Prometheus {url}, {span:.0f} s ending {stamp}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out = Path(out)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _restack(ax) -> None:
    """Turn the lines just drawn into a stacked area plot (the panel is stacked in Grafana)."""
    import numpy as np

    lines = ax.get_lines()
    if not lines:
        return
    xs = lines[0].get_xdata()
    ys, labels = [], []
    for ln in lines:
        if len(ln.get_xdata()) != len(xs):
            return  # series on different grids: leave the lines
        ys.append(np.nan_to_num(np.asarray(ln.get_ydata(), dtype=float)))
        labels.append(ln.get_label())
        ln.remove()
    ax.stackplot(xs, *ys, labels=labels)


def _heatmap(ax, result: list[dict], start: float) -> None:
    import numpy as np

    if not result:
        return
    rows = sorted(result, key=lambda s: float("inf") if s["metric"].get("le") == "+Inf" else float(s["metric"]["le"]))
    times = [float(v[0]) - start for v in rows[0]["values"]]
    cum = np.array([[float(v[1]) for v in s["values"]][:len(times)] for s in rows])
    counts = np.diff(np.vstack([np.zeros(cum.shape[1]), cum]), axis=0).clip(min=0)
    les = [s["metric"]["le"] for s in rows]
    ax.imshow(counts, aspect="auto", origin="lower", cmap="Oranges",
              extent=(times[0], times[-1], 0, len(les)), interpolation="nearest")
    ticks = list(range(0, len(les), max(1, len(les) // 8)))
    ax.set_yticks([i + 0.5 for i in ticks], [les[i] for i in ticks], fontsize=6)
    ax.set_ylabel("residual ratio (le)", fontsize=7)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(model_dir: Path, seconds: float, out: Path, slo_ms: tuple[float, float] = (100.0, 50.0)) -> Path:
    """A real engine with the plugin, scraped by a real Prometheus for ``seconds`` of serving; then render."""
    import os
    import random
    import shutil
    import subprocess
    import tempfile

    binary = shutil.which("prometheus")
    if binary is None:
        raise ValueError("`prometheus` is not installed (make servers)")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json")
    tmp = Path(tempfile.mkdtemp(prefix="m2live-snapshot-"))
    exp_port, prom_port = _free_port(), _free_port()
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: m2live, static_configs: [{{targets: ['127.0.0.1:{exp_port}']}}]}}]\n")
    prom = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp}/data",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{prom_port}"
    llm = None
    from m2live.enginelock import engine_lock

    lock = engine_lock(lambda: print("waiting for another vLLM engine to finish …", file=sys.stderr))
    lock.__enter__()
    try:
        os.environ.update({"M2LIVE_ENABLE": "1", "M2LIVE_PROM_PORT": str(exp_port), "M2LIVE_SLO_MS": str(slo_ms[0]),
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32, seed=0)
        engine = llm.llm_engine
        mon = engine.engine_core.engine_core.scheduler._m2live
        if mon is None:
            raise ValueError("the m2live plugin did not start (is the package installed?)")
        rng = random.Random(0)
        t0 = time.time()
        n, changed = 0, False
        while time.time() - t0 < seconds:
            phase = (time.time() - t0) / seconds
            if phase > 0.5 and not changed:  # the SLO tightened half way, as an MQTT control message would
                mon.set_slo_ms(slo_ms[1])
                changed = True
            want = 2 + int(10 * (0.5 + 0.5 * math.sin(2 * math.pi * 2 * phase)))  # a load that comes and goes
            while engine.get_num_unfinished_requests() < want:
                prompt = [rng.randrange(3, 8000) for _ in range(int(rng.lognormvariate(5.8, 0.6)) + 8)]
                params = SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True, detokenize=False)
                engine.add_request(f"s{n}", TokensPrompt(prompt_token_ids=prompt[:3000]), params)
                n += 1
            engine.step()
        time.sleep(2.5)  # two more scrapes
        return render(url, t0, time.time(), out, rate_interval="10s")
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        lock.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prometheus", help="base URL of a Prometheus that scraped m2live, e.g. http://127.0.0.1:9090")
    src.add_argument("--run-engine", type=Path, metavar="MODEL_DIR",
                     help="run a real vLLM-CPU engine with the plugin on this model config (dummy weights)")
    ap.add_argument("--minutes", type=float, default=5.0, help="with --prometheus: time range ending now")
    ap.add_argument("--seconds", type=float, default=60.0, help="with --run-engine: seconds of serving")
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.seconds <= 0:
        print("error: --minutes and --seconds must be positive", file=sys.stderr)
        return 2
    try:
        if args.run_engine is not None:
            path = run_engine(args.run_engine, args.seconds, args.out)
        else:
            end = time.time()
            path = render(args.prometheus.rstrip("/"), end - 60 * args.minutes, end, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

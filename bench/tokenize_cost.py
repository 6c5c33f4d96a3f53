"""The API server's tokenisation time per prompt token → results/tokenize_cost.json.

vLLM 0.32's OpenAI server tokenises every text prompt on one worker thread (``renderers/base.py``: the renderer's
thread pool has ``ModelConfig.renderer_num_workers`` = 1 worker by default), so a burst of long prompts queues
there: the simulator's per-request API-server work grows with the prompt (``ServingConfig.tokenize_s_per_token``).
``vllm bench serve --dataset-name random`` sends text made the way ``RandomDataset`` makes it — consecutive
vocabulary entries from a random offset, decoded — which the server tokenises again.

No Llama tokenizer is on this machine (no network), so this measures a stand-in of the same kind: a byte-level BPE
of 128,000 entries (Llama 3's vocabulary size) with Llama 3's pre-tokenizer split pattern (public: the
tiktoken-style regex of its tokenizer.json), trained here on the Python sources of the installed packages, called
the way vLLM calls it (``PreTrainedTokenizerFast.__call__`` on the prompt text), on random-dataset prompts of 1k,
4k and 8k tokens (best of 3 calls each, median over 6 prompts). Also the word-level tokenizer the CPU serving bench
builds (``admission.make_model_dir``) on its own prompts. Host-CPU dependent: the JSON names this machine's CPU.

    .venv/bin/python bench/tokenize_cost.py --out results/tokenize_cost.json     # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from m2live.serving_config import TOKENIZE_S_PER_TOKEN  # noqa: E402

# Llama 3's pre-tokenizer split (tokenizer.json "pre_tokenizer" of meta-llama/Meta-Llama-3-8B)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 128_000
LENGTHS = (1024, 4096, 8192)
PROMPTS = 6


def corpus_files(limit: int = 3000) -> list[str]:
    site = Path(np.__file__).resolve().parent.parent  # the venv's site-packages
    files = sorted(str(p) for p in site.rglob("*.py") if p.stat().st_size > 8192)
    if len(files) < 200:
        raise SystemExit(f"tokenize_cost: too little text to train on under {site}")
    return files[:limit]


def train_bpe(dest: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    tok.train(corpus_files(), trainer)
    path = dest / "tokenizer.json"
    tok.save(str(path))
    return path


def best_of(fn, text: str, reps: int = 3) -> tuple[float, int]:
    best, n = float("inf"), 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = len(fn(text)["input_ids"])
        best = min(best, time.perf_counter() - t0)
    return best, n


def random_dataset_rows(tok, lengths: tuple[int, ...]) -> list[dict]:
    """Prompts as vLLM's RandomDataset builds them: allowed (non-special) ids from a random offset, consecutive,
    decoded to text; the server's tokenisation of that text is timed."""
    rng = np.random.default_rng(0)
    allowed = np.array(sorted(set(range(tok.vocab_size)) - set(tok.all_special_ids)))
    rows = []
    for n_tok in lengths:
        runs = []
        for i in range(PROMPTS):
            off = int(rng.integers(0, tok.vocab_size))
            text = tok.decode(allowed[(off + i + np.arange(n_tok)) % len(allowed)].tolist())
            runs.append(best_of(tok, text))
        s = statistics.median(r[0] for r in runs)
        rows.append({"prompt_tokens": n_tok, "tokens_back": int(statistics.median(r[1] for r in runs)),
                     "ms": round(s * 1e3, 3), "us_per_token": round(s / n_tok * 1e6, 3)})
    return rows


def word_level_rows(lengths: tuple[int, ...]) -> list[dict]:
    from admission import make_model_dir
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        model = make_model_dir(Path(d) / "model")
        tok = PreTrainedTokenizerFast.from_pretrained(str(model), model_max_length=1 << 20)
        rng = np.random.default_rng(1)
        rows = []
        for n_tok in lengths:
            text = " ".join(f"w{int(x)}" for x in rng.integers(3, 8000, n_tok))
            s, back = best_of(tok, text)
            rows.append({"prompt_tokens": n_tok, "tokens_back": back, "ms": round(s * 1e3, 3),
                         "us_per_token": round(s / n_tok * 1e6, 3)})
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_host_result(path: str, doc: str, **fields: object) -> None:
    """The host benches' JSON (this one, api_server_cost.py, scheduler_cost.py): when, what (the docstring's
    second paragraph), this machine's CPU, then ``fields``."""
    out = {"generated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "what": " ".join(doc.split("\n\n")[1].split()), "cpu": cpu_name(), "python": platform.python_version(),
           **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        path = train_bpe(Path(d))
        bpe = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|begin_of_text|>",
                                      eos_token="<|end_of_text|>", model_max_length=1 << 20)
        bpe_rows = random_dataset_rows(bpe, LENGTHS)
    words = word_level_rows(LENGTHS)
    per_token = [r["ms"] / 1e3 / r["prompt_tokens"] for r in bpe_rows]
    for r in bpe_rows:
        print(f"BPE 128k, random-dataset prompt of {r['prompt_tokens']:5d} tokens: {r['ms']:7.2f} ms "
              f"({r['us_per_token']:.2f} us/token)")
    for r in words:
        print(f"word-level, {r['prompt_tokens']:5d} words: {r['ms']:7.2f} ms ({r['us_per_token']:.2f} us/token)")
    write_host_result(a.out, __doc__, byte_level_bpe_128k_random_dataset=bpe_rows,
                      word_level_cpu_bench_tokenizer=words,
                      mean_us_per_token_1k_8k=round(statistics.mean(per_token) * 1e6, 3),
                      simulator_prior_us_per_token=TOKENIZE_S_PER_TOKEN * 1e6, seconds=round(time.time() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

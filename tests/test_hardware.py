"""GPU catalog: every row complete and physically plausible, exact NVML-name lookup, aliases, and the errors."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import pytest
from conftest import nvml_answers

from m2live.hardware import CATALOG, GpuSpec, UnknownGpuError, all_gpus, close_matches, get_gpu, norm_name

M2LIVE = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "m2live"

# Every exact nvmlDeviceGetName() string the issue asks for (issue 2, item 2), as NVIDIA's driver reports it.
ISSUE_NVML_NAMES = [
    "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe",
    "NVIDIA A10", "NVIDIA A10G", "NVIDIA A30", "NVIDIA A40", "NVIDIA L4", "NVIDIA L40", "NVIDIA L40S",
    "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL",
    "NVIDIA H20", "NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e", "NVIDIA B200", "NVIDIA B300 SXM6 AC",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 5090",
]

# Dense bf16 tensor FLOP per clock per SM, by chip family: GA100 2048; GA10x pro 1024 (A10G: 512); Ada 1024, or
# 512 where fp32 accumulation runs at half rate (L40, GeForce); GH100 4096; GB100 8192; GB202 1024 / 512 GeForce.
PER_SM_RATES = {
    "ampere": {512, 1024, 2048},
    "ada": {512, 1024},
    "hopper": {4096},
    "blackwell": {512, 1024, 8192},
}
# Parts whose tensor rate is capped below what the SMs can do (export-compliance SKU): the rate must be lower.
CAPPED = {"NVIDIA H20"}

ARCH_CC = {"ampere": {(8, 0), (8, 6)}, "ada": {(8, 9)}, "hopper": {(9, 0)}, "blackwell": {(10, 0), (10, 3), (12, 0)}}


def ids(g: GpuSpec) -> str:
    return g.name


@pytest.mark.parametrize("g", CATALOG, ids=ids)
def test_row_complete_and_plausible(g: GpuSpec) -> None:
    assert g.name.startswith("NVIDIA ") and g.name == g.name.strip()
    assert g.arch in PER_SM_RATES
    assert g.compute_capability in ARCH_CC[g.arch], (g.arch, g.compute_capability)
    for f in ("sms", "base_mhz", "boost_mhz", "bf16_tflops", "fp16_tflops", "tflops_at_mhz", "mem_bw_gbs",
              "mem_gb", "l2_mb", "tdp_w", "interconnect_gbs"):
        v = getattr(g, f)
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (f, v)
    assert 20 <= g.sms <= 200
    assert 500 <= g.base_mhz <= g.boost_mhz <= 3200
    # the clock the TFLOP/s are quoted at lies in the board's range and no more than 25 % under max boost
    assert g.base_mhz <= g.tflops_at_mhz <= g.boost_mhz
    assert g.boost_mhz / g.tflops_at_mhz <= 1.25
    assert g.fp16_tflops >= 0.99 * g.bf16_tflops
    if g.arch == "ampere":
        assert g.fp8_tflops is None, "Ampere tensor cores have no fp8"
    else:
        assert g.fp8_tflops is not None
        assert g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.01)
    assert 10 <= g.mem_bw_gbs / g.mem_gb <= 80, "bandwidth per GB outside anything shipped"
    assert 16 <= g.mem_gb <= 300
    assert 100 <= g.mem_bw_gbs <= 10_000
    assert 1 <= g.l2_mb <= 128
    assert 60 <= g.tdp_w <= 1500
    assert g.interconnect in ("nvlink", "pcie", "c2c", "none")
    if g.interconnect == "pcie":
        assert g.interconnect_gbs in (32, 64), "PCIe Gen4 x16 = 32, Gen5 x16 = 64 GB/s per direction"
    if g.interconnect == "nvlink":
        assert g.interconnect_gbs in (300, 450, 900), "NVLink3 300, NVLink4 450, NVLink5 900 per direction"
    assert len(g.source) > 40 and ("datasheet" in g.source or "whitepaper" in g.source
                                   or "product" in g.source), g.source


@pytest.mark.parametrize("g", CATALOG, ids=ids)
def test_peak_matches_sms_times_clock(g: GpuSpec) -> None:
    """Quoted TFLOP/s = SMs x tensor FLOP/clk/SM x clock, with a per-SM rate the architecture actually has."""
    per_sm = g.peak_flops("bf16", g.tflops_at_mhz) / (g.sms * g.tflops_at_mhz * 1e6)
    if g.name in CAPPED:
        assert per_sm < 0.5 * min(PER_SM_RATES[g.arch])
        return
    nearest = min(PER_SM_RATES[g.arch], key=lambda r: abs(r - per_sm))
    assert per_sm == pytest.approx(nearest, rel=0.01), (per_sm, nearest)
    # and the peak at boost scales linearly from the quoted one
    assert g.peak_flops("bf16") == pytest.approx(g.sms * nearest * g.boost_mhz * 1e6, rel=0.01)
    if g.fp8_tflops is not None:
        assert g.peak_flops("fp8") == pytest.approx(2 * g.peak_flops("bf16"), rel=0.01)


def test_ampere_has_no_fp8_peak() -> None:
    with pytest.raises(ValueError, match="no dense fp8"):
        get_gpu("a100").peak_flops("fp8")


def test_relations_between_skus() -> None:
    """Facts that hold across rows: same die, different memory; newer parts not slower where they share a die."""
    h100, h200, gh200 = get_gpu("h100-sxm"), get_gpu("h200"), get_gpu("gh200")
    assert h100.bf16_tflops == h200.bf16_tflops == gh200.bf16_tflops
    assert h200.mem_bw_gbs > gh200.mem_bw_gbs > h100.mem_bw_gbs
    assert get_gpu("h100-pcie").bf16_tflops < get_gpu("h100-nvl").bf16_tflops < h100.bf16_tflops
    assert get_gpu("l40s").bf16_tflops == pytest.approx(2 * get_gpu("l40").bf16_tflops, rel=0.01)
    assert get_gpu("b300").mem_gb > get_gpu("b200").mem_gb
    assert get_gpu("rtxpro6000-ws").mem_bw_gbs > get_gpu("rtxpro6000").mem_bw_gbs
    for a in ("rtx4090", "rtx5090", "rtxpro6000", "rtxpro6000-ws", "l40s", "l40", "l4"):
        assert get_gpu(a).interconnect == "pcie", a  # no NVLink on these boards


def test_catalog_has_every_issue_sku_once() -> None:
    names = [g.name for g in CATALOG]
    assert len(names) == len(set(names))
    assert set(ISSUE_NVML_NAMES) <= set(names) | {n for g in CATALOG for n in g.nvml_names}
    assert all_gpus() == list(CATALOG)


@pytest.mark.parametrize("nvml_name", ISSUE_NVML_NAMES)
def test_exact_nvml_name_resolves_to_its_own_row(nvml_name: str) -> None:
    g = get_gpu(nvml_name)
    assert nvml_name == g.name or nvml_name in g.nvml_names


def test_alternative_nvml_names_resolve() -> None:
    assert get_gpu("NVIDIA A100-PCIE-80GB").name == "NVIDIA A100 80GB PCIe"
    assert get_gpu("NVIDIA GH200 120GB").name == "NVIDIA GH200 480GB"


def test_grace_blackwell_superchips() -> None:
    """GB200 / GB300 (the NVML names their GPUs report): the B200's and B300's dies at a superchip's clock and
    power, so a faster peak and a larger power budget than the HGX boards; Blackwell Ultra's doubled SFUs on
    GB300 only; both run data-centre Blackwell's kernels."""
    b200, gb200, b300, gb300 = (get_gpu(n) for n in ("NVIDIA B200", "NVIDIA GB200", "NVIDIA B300", "NVIDIA GB300"))
    assert gb200.name == "NVIDIA GB200" and gb300.name == "NVIDIA GB300"
    for hgx, grace in ((b200, gb200), (b300, gb300)):
        assert grace.compute_capability == hgx.compute_capability and grace.sms == hgx.sms
        assert grace.peak_flops("bf16") > hgx.peak_flops("bf16") and grace.tdp_w > hgx.tdp_w
        assert grace.kernel_family == hgx.kernel_family == "blackwell"
        assert grace.exp_per_clk == hgx.exp_per_clk
    assert (gb200.exp_per_clk, gb300.exp_per_clk) == (16, 32)
    assert gb300.mem_gb > gb200.mem_gb


@pytest.mark.parametrize(("name", "expect"), [("HGX B200", "NVIDIA B200"), ("NVIDIA DGX H100", "NVIDIA H100 80GB HBM3"),
                                              ("dgx-gb200", "NVIDIA GB200"), ("HGX-H200", "NVIDIA H200")])
def test_a_system_name_in_front_resolves_to_its_gpu(name: str, expect: str) -> None:
    assert get_gpu(name).name == expect
    with pytest.raises(UnknownGpuError):
        get_gpu("HGX")


@pytest.mark.parametrize(("name", "expect"), [("NVIDIA H100-SXM5-80GB", "NVIDIA H100 80GB HBM3"),
                                              ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3"),
                                              ("NVIDIA B300", "NVIDIA B300 SXM6 AC"),
                                              ("NVIDIA RTX PRO 6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition")])
def test_an_alias_with_the_vendor_in_front_resolves(name: str, expect: str) -> None:
    assert get_gpu(name).name == expect
    with pytest.raises(UnknownGpuError):
        get_gpu("NVIDIA")


@pytest.mark.parametrize(("name", "expect"), [("B200 180GB HBM3e", "NVIDIA B200"),
                                              ("NVIDIA H200 141GB HBM3e", "NVIDIA H200"),
                                              ("B300 288GB HBM3e", "NVIDIA B300 SXM6 AC"), ("H20 96GB HBM3", "NVIDIA H20"),
                                              ("L40S 48GB GDDR6", "NVIDIA L40S"), ("L4 24GB GDDR6", "NVIDIA L4"),
                                              ("RTX 4090 24GB GDDR6X", "NVIDIA GeForce RTX 4090"),
                                              ("RTX PRO 6000 96GB GDDR7", "NVIDIA RTX PRO 6000 Blackwell Server Edition"),
                                              ("H100 PCIe 80GB HBM2e", "NVIDIA H100 PCIe"),
                                              ("A100 40GB HBM2", "NVIDIA A100-SXM4-40GB"),
                                              ("A100 80GB HBM2e", "NVIDIA A100-SXM4-80GB"),
                                              ("B300 288GB", "NVIDIA B300 SXM6 AC"),
                                              ("gb200_sxm", "NVIDIA GB200"),
                                              ("RTX 6000 Pro", "NVIDIA RTX PRO 6000 Blackwell Server Edition")])
def test_a_name_with_its_memory_size_and_technology_resolves(name: str, expect: str) -> None:
    """Spec sheets and cloud catalogues write a GPU's memory size and technology after its name: they name no
    other GPU, and a size or technology that is not that GPU's is no match (the A100 40GB is HBM2, the 80GB
    HBM2e, per NVIDIA's A100 datasheet); a name found as written is taken as written."""
    assert get_gpu(name).name == expect
    for wrong in ("B200 180GB HBM3", "L40S GDDR6X", "H100 PCIe HBM3", "A100 40GB HBM2e", "H100 94GB", "HBM3e"):
        with pytest.raises(UnknownGpuError):
            get_gpu(wrong)
    assert get_gpu("GH200 HBM3e").name == "NVIDIA GH200 144G HBM3e"  # its own alias, not the HBM3 GH200
    assert get_gpu("GH200 HBM3").name == "NVIDIA GH200 480GB"


def test_aliases_unique_lowercase_and_case_insensitive() -> None:
    seen: dict[str, str] = {}
    for g in CATALOG:
        for key in (g.name, *g.nvml_names, *g.aliases):
            k = norm_name(key)
            assert seen.setdefault(k, g.name) == g.name, f"{key!r} collides with {seen[k]!r}"
        for a in g.aliases:
            assert a == a.lower() and " " not in a, a
            assert get_gpu(a) is g
            assert get_gpu(a.upper()) is g
    expected = {"h100-sxm": "NVIDIA H100 80GB HBM3", "a100-80gb": "NVIDIA A100-SXM4-80GB", "l40s": "NVIDIA L40S",
                "b200": "NVIDIA B200", "rtx4090": "NVIDIA GeForce RTX 4090", "h100-pcie": "NVIDIA H100 PCIe",
                "h100-nvl": "NVIDIA H100 NVL", "a10g": "NVIDIA A10G", "h200": "NVIDIA H200", "h20": "NVIDIA H20",
                "gh200": "NVIDIA GH200 480GB", "b300": "NVIDIA B300 SXM6 AC", "rtx5090": "NVIDIA GeForce RTX 5090",
                "rtxpro6000": "NVIDIA RTX PRO 6000 Blackwell Server Edition"}
    for alias, name in expected.items():
        assert get_gpu(alias).name == name
    assert get_gpu("nvidia h100 80gb hbm3").name == "NVIDIA H100 80GB HBM3"
    assert get_gpu(get_gpu("l4")) is get_gpu("NVIDIA L4")  # a GpuSpec passes through


@pytest.mark.parametrize(("typo", "expect"), [
    ("H100 SMX", "h100-sxm"),
    ("NVIDIA H100 80GB HBM", "NVIDIA H100 80GB HBM3"),
    ("a100-pcei", "a100-pcie"),
    ("nvidia l40ss", "NVIDIA L40S"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"),
])
def test_unknown_name_lists_close_matches(typo: str, expect: str) -> None:
    with pytest.raises(UnknownGpuError) as ei:
        get_gpu(typo)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"unknown GPU {typo!r}; close matches: ")
    assert expect in msg.split("close matches: ", 1)[1].split(", ")
    assert expect in close_matches(typo)
    assert isinstance(ei.value, KeyError)  # existing callers catch KeyError


@pytest.mark.parametrize("bad", ["", "   ", None, 42])
def test_bad_name_types(bad: object) -> None:
    with pytest.raises(UnknownGpuError, match="non-empty string"):
        get_gpu(bad)  # type: ignore[arg-type]


def test_unrelated_name_points_to_the_catalog() -> None:
    with pytest.raises(UnknownGpuError, match="see `m2live gpus`"):
        get_gpu("nosuchgpu")


def test_cli_gpus_lists_every_row() -> None:
    r = subprocess.run([str(M2LIVE), "gpus", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == [g.name for g in CATALOG]
    # every catalog field, plus the memory CUDA reports (nvidia-smi's total less the driver's share) and the DRAM
    # bandwidth left for data (inline ECC's check bits take 1/16 on GDDR boards that run it)
    assert rows[0] == {**json.loads(json.dumps(dataclasses.asdict(CATALOG[0]))),
                       "cuda_total_gib": round(CATALOG[0].mem_bytes / 2**30, 2), "inline_ecc": False,
                       "data_bw_gbs": CATALOG[0].mem_bw_gbs}
    h100 = next(row for row in rows if row["name"] == "NVIDIA H100 80GB HBM3")
    assert h100["mem_total_mib"] == 81559 and 78.5 < h100["cuda_total_gib"] < 79.65
    l40s = next(row for row in rows if row["name"] == "NVIDIA L40S")
    assert l40s["inline_ecc"] and l40s["data_bw_gbs"] == 810.0
    r = subprocess.run([str(M2LIVE), "gpus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for g in CATALOG:
        assert g.name in r.stdout


def test_cli_unknown_gpu_is_one_line_exit_2() -> None:
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", "nosuchgpu", "--decode", "10"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown GPU 'nosuchgpu'" in lines[0] and "Traceback" not in r.stderr
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", "H100 SMX", "--decode", "10"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "h100-sxm" in r.stderr


def test_inline_ecc_on_gddr_boards_that_report_the_carve_out() -> None:
    """GDDR boards whose driver total is 15/16 of the marketed capacity run ECC in-band, and their check bits take
    the same share of the DRAM bandwidth; HBM (side-band ECC) and boards without the carve-out keep the peak."""
    for name in ("l40s", "NVIDIA L4", "NVIDIA A40"):
        g = get_gpu(name)
        assert g.inline_ecc and g.data_bw == pytest.approx(g.mem_bw * 15 / 16)
    for name in ("h100-sxm", "b200", "NVIDIA GeForce RTX 4090", "NVIDIA RTX PRO 6000 Blackwell Server Edition"):
        g = get_gpu(name)
        assert not g.inline_ecc and g.data_bw == g.mem_bw


def test_inline_ecc_slows_a_stream_and_never_speeds_one() -> None:
    """A memory-bound GEMV on an L40S with its check bits takes 16/15 of the time it would take without them (the
    same board with the carve-out undone); a compute-bound GEMM hardly moves."""
    from m2live.predictor import OpModel

    ecc = get_gpu("l40s")
    plain = dataclasses.replace(ecc, mem_total_mib=None, name="L40S without ECC", aliases=())
    for m, n, k in ((1, 8192, 8192), (16, 14336, 4096), (4096, 4096, 4096)):
        a, b = OpModel(ecc).gemm(m, n, k).t, OpModel(plain).gemm(m, n, k).t
        assert a >= b
    ratio = OpModel(ecc).gemm(1, 16384, 16384).t / OpModel(plain).gemm(1, 16384, 16384).t
    assert ratio == pytest.approx(16 / 15, rel=0.02)
    assert OpModel(ecc).gemm(8192, 8192, 8192).t / OpModel(plain).gemm(8192, 8192, 8192).t < 1.02


# --- a GPU described in a JSON file -----------------------------------------------------------------------------
def catalog_rows() -> list[dict]:
    r = subprocess.run([str(M2LIVE), "gpus", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_catalog_row_is_a_spec_file_of_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of `m2live gpus --json`, saved as a file, is read back as the same GPU (the display-only keys
    ignored), and a file naming a catalog GPU with the catalog's numbers is that GPU."""
    from m2live import hardware

    monkeypatch.setattr(hardware, "_CUSTOM", {})
    for row in catalog_rows():
        path = tmp_path / "gpu.json"
        path.write_text(json.dumps([row]))
        assert get_gpu(str(path)) == get_gpu(row["name"]), row["name"]


def test_an_edited_row_is_a_gpu_of_its_own(tmp_path: Path) -> None:
    """A B200 held to 700 W, described by editing its row: every command takes the file where it takes a GPU
    name, the power model prices the lower limit (a sustained step slower than the catalog's B200), and a batch
    row names it too."""
    row = next(r for r in catalog_rows() if r["name"] == "NVIDIA B200")
    row.update(name="NVIDIA B200 (700 W)", tdp_w=700, aliases=["b200-700w"], nvml_names=[], mem_total_mib=None,
               source="NVIDIA B200 datasheet, the power limit set to 700 W with nvidia-smi -pl")
    spec = tmp_path / "b200_700w.json"
    spec.write_text(json.dumps(row))

    def tpot(gpu: str) -> float:
        r = subprocess.run([str(M2LIVE), "simulate", "--model", "meta-llama/Llama-3.1-70B", "--precision", "fp8",
                            "--gpu", gpu, "--tp", "4", "--isl", "1024", "--osl", "256", "--concurrency", "32",
                            "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tpot_ms"]

    assert tpot(str(spec)) > tpot("b200")
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", str(spec), "--prefill", "4096", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(M2LIVE), "rank", "--model", "meta-llama/Llama-3.1-8B", "--workload", "chat",
                        "--gpus", f"b200,{spec}", "--tp", "1", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "NVIDIA B200 (700 W)" in r.stdout and "NVIDIA B200" in r.stdout


@pytest.mark.parametrize(("edit", "why"), [
    ({"sms": 0}, "sms must be within"),
    ({"sms": "148"}, "sms must be a number"),
    ({"mem_bw_gbs": float("inf")}, "mem_bw_gbs must be"),
    ({"compute_capability": [7, 5]}, "compute capability 7.5 is outside"),
    ({"compute_capability": "10.0"}, "compute_capability must be [major, minor]"),
    ({"arch": "hopper"}, "arch 'hopper' is not compute capability 10.0's"),
    ({"memory": "HBM4"}, "memory 'HBM4' is not one of"),
    ({"interconnect": "infiniband"}, "interconnect 'infiniband' is not one of"),
    ({"tdp_w": None}, "missing tdp_w"),
    ({"tdp_watts": 700}, "unknown field 'tdp_watts'"),
    ({"base_mhz": 3000}, "base_mhz 3000 is above boost_mhz"),
    ({"name": "NVIDIA B200"}, "the name 'NVIDIA B200' is the catalog's NVIDIA B200"),
    ({"aliases": ["h100"]}, "the name 'h100' is the catalog's NVIDIA H100 80GB HBM3"),
    ({"source": ""}, "source must be a non-empty string"),
    ({"mem_gb": 10**400}, "mem_gb must be within 2 .. 10000 GB, got a 401-digit number"),
    ({"mem_total_mib": 600}, "mem_total_mib 600 does not fit mem_gb"),
    ({"mem_gb": 1}, "mem_gb must be within 2 .. 10000 GB"),
    ({"mem_gb": -10**400}, "a 401-digit negative number"),
    ({"name": "DGX"}, "'DGX' cannot name a GPU"),
    ({"name": "other.json"}, "'other.json' cannot name a GPU"),
    ({"name": "cpu"}, "'cpu' cannot name a GPU"),
    ({"name": "two\nlines"}, "a name is printable"),
    ({"aliases": ["ok", ""]}, "aliases must be a list of names"),
])
def test_a_bad_spec_file_is_one_line_exit_2(tmp_path: Path, edit: dict, why: str) -> None:
    row = next(r for r in catalog_rows() if r["name"] == "NVIDIA B200")
    row.update(name="My B200", aliases=[], nvml_names=[])
    row.update(edit)
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps(row))
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", str(spec), "--decode", "100"], capture_output=True,
                       text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert why in lines[0] and str(spec) in lines[0], lines[0]


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "not JSON"),
    ("[]", "a list of 0 GPUs"),
    ('[{"name": "a"}, {"name": "b"}]', "a list of 2 GPUs"),
    ('"NVIDIA B200"', "a GPU spec is a JSON object"),
    (None, "no such file"),
    ("x" * (2 << 20), "larger than 1048576 bytes"),
    ("\udcff", "codec can't decode"),
])
def test_an_unusable_spec_file_is_one_line_exit_2(tmp_path: Path, content: str | None, why: str) -> None:
    spec = tmp_path / "gpu.json"
    if content is not None:
        spec.write_bytes(content.encode("utf-8", "surrogateescape"))
    r = subprocess.run([str(M2LIVE), "simulate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", str(spec),
                        "--isl", "128", "--osl", "16", "--concurrency", "1"], capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and why in lines[0], r.stderr


def test_gpus_device_without_a_driver_is_one_line_exit_2() -> None:
    if nvml_answers():
        pytest.skip("an NVIDIA driver answers here")
    r = subprocess.run([str(M2LIVE), "gpus", "--device"], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--device 0: NVML" in lines[0], r.stderr


def test_a_calibration_of_a_described_gpu_carries_its_spec(tmp_path: Path) -> None:
    """A calibration fitted for a GPU described in a file holds that description, so it works alone (no --gpu
    file, a later process); one fitted for a catalog GPU holds none; a calibration whose description contradicts
    the one already in use is refused in one line."""
    import csv

    row = next(r for r in catalog_rows() if r["name"] == "NVIDIA B300 SXM6 AC")
    row.update(name="NVIDIA B300 at 900 W", tdp_w=900, aliases=[], nvml_names=[],
               source="NVIDIA HGX B300 datasheet, the power limit set to 900 W")
    spec = tmp_path / "b300_900w.json"
    spec.write_text(json.dumps(row))
    plan = tmp_path / "plan.csv"
    r = subprocess.run([str(M2LIVE), "calibrate", "plan", "--gpu", str(spec), "--kind", "gemm", "-o", str(plan)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    measured = {(t["m"], t["n"], t["k"]): t["latency_ms"] for t in csv.DictReader(
        open(Path(__file__).resolve().parents[2] / "shared/data/opbench/b300_sxm/gemm_bf16.csv"))}
    rows = [{**p, "latency_ms": measured[(p["m"], p["n"], p["k"])]} for p in csv.DictReader(open(plan))]
    tables = tmp_path / "measured"
    tables.mkdir()
    with open(tables / "gemm_bf16.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cal = tmp_path / "cal.json"
    r = subprocess.run([str(M2LIVE), "calibrate", "fit", str(tables), "--gpu", str(spec), "-o", str(cal)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(cal.read_text())
    assert doc["gpu"] == "NVIDIA B300 at 900 W" and doc["gpu_spec"]["tdp_w"] == 900
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", "NVIDIA B300 at 900 W", "--calibration", str(cal),
                        "--prefill", "2048", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = dict(row, tdp_w=1000)  # the same board in another machine, at another power limit
    spec.write_text(json.dumps(other))
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", str(spec), "--calibration", str(cal), "--prefill", "2048",
                        "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "described otherwise than before (tdp_w 900 -> 1000; before: a calibration's copy)" in r.stderr
    doc["gpu_spec"]["name"] = "NVIDIA B300 SXM6 AC"  # a catalog name with other numbers: refused
    doc["gpu"] = "NVIDIA B300 SXM6 AC"
    cal.write_text(json.dumps(doc))
    r = subprocess.run([str(M2LIVE), "predict", "--gpu", "b300", "--calibration", str(cal), "--decode", "100"],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "the catalog's NVIDIA B300 SXM6 AC" in lines[0], r.stderr

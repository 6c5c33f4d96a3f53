"""A GPU outside the catalog, described from what its driver reports (m2live.device_spec): the derivation
reproduces the catalog's datasheet rows from the same GPUs' device facts, the NVML reading asks only what NVML has,
and the plugin's device choice reads a GPU the catalog lacks instead of giving up."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types

import pynvml
import pytest
from conftest import nvml_answers

from m2live import Predictor, Step, hardware
from m2live.calibration_file import SCHEMA, Calibration
from m2live.device_spec import DeviceFacts, catalog_or_device, is_derived, read_nvml_facts, spec_from_facts
from m2live.efficiency import constants_for
from m2live.hardware import UnknownGpuError, get_gpu
from m2live.live import device as live_device

# What NVML reports on these boards (max SM / memory clocks, bus width, memory total, power limit, NVLink links,
# ECC): the catalog's datasheet figures in the driver's units (CUDA cores = SMs x cores per SM; NVML's memory
# clock is half the data rate: an H100 SXM reports 2619 MHz on 5120 bits, 3.35 TB/s)
FACTS = {
    "NVIDIA H100 80GB HBM3": DeviceFacts("NVIDIA H100 80GB HBM3", (9, 0), 16896, 1980, 2619, 5120, 81559, 700,
                                         nvlinks=18),
    "NVIDIA A100-SXM4-80GB": DeviceFacts("NVIDIA A100-SXM4-80GB", (8, 0), 6912, 1410, 1593, 5120, 81920, 400,
                                         nvlinks=12),
    "NVIDIA L40S": DeviceFacts("NVIDIA L40S", (8, 9), 18176, 2520, 9001, 384, 46068, 350, pcie_gen=4, pcie_width=16,
                               ecc=True),
    "NVIDIA H200": DeviceFacts("NVIDIA H200", (9, 0), 16896, 1980, 3201, 6144, 143771, 700, nvlinks=18),
    "NVIDIA B200": DeviceFacts("NVIDIA B200", (10, 0), 18944, 1965, 3996, 8192, 183359, 1000, nvlinks=18),
    "NVIDIA H100 PCIe": DeviceFacts("NVIDIA H100 PCIe", (9, 0), 14592, 1755, 1593, 5120, 81559, 350, pcie_gen=5,
                                    pcie_width=16),
    "NVIDIA H100 NVL": DeviceFacts("NVIDIA H100 NVL", (9, 0), 16896, 1785, 2539, 6144, 95830, 400, nvlinks=12),
    # GeForce and RTX workstation boards: NVML's maximum SM clock is a ~3.1 GHz ceiling; the rated boost is the
    # max customer boost clock
    "NVIDIA GeForce RTX 4090": DeviceFacts("NVIDIA GeForce RTX 4090", (8, 9), 16384, 3105, 10501, 384, 24564, 450,
                                           pcie_gen=4, pcie_width=16, boost_mhz=2520),
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": DeviceFacts(
        "NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 24064, 2617, 12477, 512, 97887, 600, pcie_gen=5,
        pcie_width=16),
    "NVIDIA RTX A6000": DeviceFacts("NVIDIA RTX A6000", (8, 6), 10752, 2100, 8001, 384, 49140, 300, pcie_gen=4,
                                    pcie_width=16, boost_mhz=1800),
    "NVIDIA RTX 6000 Ada Generation": DeviceFacts("NVIDIA RTX 6000 Ada Generation", (8, 9), 18176, 3105, 10001, 384,
                                                  49140, 300, pcie_gen=4, pcie_width=16, boost_mhz=2505),
    "NVIDIA A40": DeviceFacts("NVIDIA A40", (8, 6), 10752, 1740, 7251, 384, 46068, 300, pcie_gen=4, pcie_width=16,
                              ecc=True),
}


@pytest.mark.parametrize("name", list(FACTS))
def test_device_facts_give_back_the_datasheet_row(name: str) -> None:
    """The derivation from device facts lands on the catalog's datasheet terms for the same GPU — tensor peak,
    DRAM bandwidth (within the rounding of the marketed figure), memory technology, inline ECC, kernel family,
    interconnect — and so on the same step predictions."""
    d, c = spec_from_facts(FACTS[name]), get_gpu(name)
    assert is_derived(d) and not is_derived(c)
    assert d.sms == c.sms and d.compute_capability == c.compute_capability and d.arch == c.arch
    assert d.peak_flops("bf16", c.boost_mhz) == pytest.approx(c.peak_flops("bf16"), rel=0.005)
    assert (d.fp8_tflops is None) == (c.fp8_tflops is None)
    assert d.mem_bw_gbs == pytest.approx(c.mem_bw_gbs, rel=0.03)
    assert (d.memory, d.inline_ecc, d.kernel_family) == (c.memory, c.inline_ecc, c.kernel_family)
    assert (d.interconnect, d.interconnect_gbs) == (c.interconnect, c.interconnect_gbs)
    assert d.mem_bytes == c.mem_bytes and d.tdp_w == c.tdp_w
    for seqs in ([(2048, 0)], [(1, 900)] * 32, [(512, 0)] + [(1, 2000)] * 16):
        t = [Predictor.for_gpu(g, model="meta-llama/Llama-3.1-8B").predict(Step(seqs=seqs), f_clk=None).total_s
             for g in (d, c)]
        assert t[0] == pytest.approx(t[1], rel=0.02), (seqs, t)


def test_a_gpu_the_catalog_lacks() -> None:
    """An RTX A5000 (GA102, professional: full-rate FP32-accumulating tensor cores, ECC off by default) and a
    GeForce RTX 3090 (the same die, half rate, GDDR6X): what the derivation makes of them."""
    a5000 = spec_from_facts(DeviceFacts("NVIDIA RTX A5000", (8, 6), 8192, 2100, 8001, 384, 24564, 230,
                                        pcie_gen=4, pcie_width=16))
    rtx3090 = spec_from_facts(DeviceFacts("NVIDIA GeForce RTX 3090", (8, 6), 10496, 2100, 9751, 384, 24576, 350,
                                          pcie_gen=4, pcie_width=16))
    assert a5000.sms == 64 and a5000.bf16_tflops == pytest.approx(64 * 1024 * 2100e6 / 1e12, rel=1e-3)
    assert rtx3090.bf16_tflops == pytest.approx(82 * 512 * 2100e6 / 1e12, rel=1e-3)
    assert (a5000.memory, rtx3090.memory) == ("GDDR6", "GDDR6X")
    assert a5000.mem_bw_gbs == pytest.approx(768, rel=0.01) and rtx3090.mem_bw_gbs == pytest.approx(936, rel=0.01)
    assert a5000.fp8_tflops is None and a5000.kernel_family == "ampere" and not a5000.inline_ecc
    assert a5000.l2_mb == pytest.approx(6.0 * 64 / 72, rel=0.01)  # GA10x: the nearest sibling (A10, 72 SMs, 6 MiB)
    assert "not a datasheet" in a5000.source and "L2" in a5000.source
    with_l2 = spec_from_facts(DeviceFacts("NVIDIA RTX A5000", (8, 6), 8192, 2100, 8001, 384, 24564, 230,
                                          l2_bytes=6 * 2**20))
    assert with_l2.l2_mb == 6.0 and "as CUDA reports it" in with_l2.source


def test_what_the_derivation_cannot_tell() -> None:
    """Without a rated boost a GeForce board is quoted at NVML's ceiling (its source says so, and that a live
    clock prices it right); a part whose tensor rate is halved or capped (L40, H20) comes out at its architecture's
    full rate — the source says the rate is assumed."""
    ceiling = spec_from_facts(DeviceFacts("NVIDIA GeForce RTX 4090", (8, 9), 16384, 3105, 10501, 384, 24564, 450))
    assert ceiling.boost_mhz == 3105 and "a V/F-table ceiling no board sustains" in ceiling.source
    assert "ceiling" not in spec_from_facts(FACTS["NVIDIA A40"]).source  # a data-centre board's maximum is its boost
    for name, facts in (("NVIDIA L40", DeviceFacts("NVIDIA L40", (8, 9), 18176, 2490, 9001, 384, 46068, 300,
                                                   ecc=True)),
                        ("NVIDIA H20", DeviceFacts("NVIDIA H20", (9, 0), 9984, 1980, 2619, 6144, 97871, 400,
                                                   nvlinks=18))):
        d = spec_from_facts(facts)
        assert d.bf16_tflops > 1.9 * get_gpu(name).bf16_tflops and "assumed by compute capability" in d.source


@pytest.mark.parametrize(("facts", "why"), [
    (DeviceFacts("Tesla T4", (7, 5), 2560, 1590, 5001, 256, 15360, 70), "compute capability 7.5"),
    (DeviceFacts("NVIDIA X", (9, 0), 0, 1980, 2619, 5120, 81559, 700), "CUDA cores"),
    (DeviceFacts("NVIDIA X", (9, 0), 16896, 1980, 2619, 0, 81559, 700), "memory bus width"),
])
def test_facts_m2live_cannot_use_are_one_line_errors(facts: DeviceFacts, why: str) -> None:
    with pytest.raises(ValueError) as ei:
        spec_from_facts(facts)
    assert why in str(ei.value) and "\n" not in str(ei.value) and str(ei.value).startswith(facts.name)


def fake_nvml(facts: DeviceFacts, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML as a driver answers for ``facts``: only functions the real pynvml has, with its constants."""
    calls = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: facts.name,
        "nvmlDeviceGetCudaComputeCapability": lambda h: facts.compute_capability,
        "nvmlDeviceGetNumGpuCores": lambda h: facts.cuda_cores,
        "nvmlDeviceGetMaxClockInfo": lambda h, kind: facts.max_sm_mhz if kind == pynvml.NVML_CLOCK_SM
        else facts.max_mem_mhz,
        "nvmlDeviceGetMemoryBusWidth": lambda h: facts.mem_bus_bits,
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=facts.mem_total_mib * 2**20),
        "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: facts.power_limit_w * 1000,
        "nvmlDeviceGetEccMode": lambda h: (int(facts.ecc), int(facts.ecc)),
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: facts.pcie_gen,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: facts.pcie_width,
        "nvmlDeviceGetDefaultApplicationsClock": lambda h, kind: facts.base_mhz,
        "nvmlDeviceGetMaxCustomerBoostClock": lambda h, kind: facts.boost_mhz,
    }

    def nvlink_state(h, link):
        if link >= 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(link < facts.nvlinks)

    calls["nvmlDeviceGetNvLinkState"] = nvlink_state
    for fn in calls:
        assert hasattr(pynvml, fn), fn  # the reader asks NVML only what NVML has
    consts = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("NVML_") or k == "NVMLError"}
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(**consts, **calls))


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA L40S", "NVIDIA B200"])
def test_the_nvml_reader_returns_the_facts(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(FACTS[name], monkeypatch)
    got = read_nvml_facts(0)
    assert got == FACTS[name]


def test_the_plugin_reads_a_gpu_the_catalog_lacks(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """NVML names a GPU outside the catalog: the plugin predicts with the spec read from the device, registered
    under its name, and says so in one warning; M2LIVE_GPU with an unknown name stays an error (a typo is not a
    device to read); a catalog name never touches NVML."""
    facts = DeviceFacts("NVIDIA RTX 5000 Ada Generation", (8, 9), 12800, 2550, 9001, 256, 32760, 250, pcie_gen=4,
                        pcie_width=16, ecc=True)
    fake_nvml(facts, monkeypatch)
    monkeypatch.setattr(hardware, "_CUSTOM", {})  # what this test registers leaves with it
    with caplog.at_level(logging.WARNING, logger="m2live"):
        spec = live_device._catalog_or_device(facts.name, 0)
    assert is_derived(spec) and spec.kernel_family == "ada" and spec.inline_ecc
    assert get_gpu(facts.name) is spec  # registered: a calibration or a plan finds it by name
    assert "not in m2live's GPU catalog" in caplog.text and "ada kernel family" in caplog.text
    with pytest.raises(UnknownGpuError):
        live_device._catalog_or_device("NVIDIA RTX 5000 Ada Generatoin", None)
    assert live_device._catalog_or_device("NVIDIA H100 80GB HBM3", 0) is get_gpu("h100")


def test_without_nvml_an_unknown_name_is_one_line_with_both_reasons() -> None:
    """No driver on this machine: the catalog miss and the device read's failure, in one line."""
    if nvml_answers():
        pytest.skip("an NVIDIA driver answers here: device 0 would be read")
    with pytest.raises(ValueError) as ei:
        catalog_or_device("NVIDIA Imaginary 9000", 0)
    msg = str(ei.value)
    assert "\n" not in msg and "unknown GPU 'NVIDIA Imaginary 9000'" in msg and "from the device failed" in msg


def test_the_device_wins_over_a_description_registered_before_it(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The plugin validates M2LIVE_CALIBRATION before it reads the device: a calibration taken on another machine
    (another PCIe slot, another power limit) has registered its copy of the GPU by then. The device's reading is
    what the plugin predicts with, and a warning says the two differ."""
    facts = DeviceFacts("NVIDIA RTX 5000 Ada Generation", (8, 9), 12800, 2550, 9001, 256, 32760, 250, pcie_gen=4,
                        pcie_width=16, ecc=True)
    monkeypatch.setattr(hardware, "_CUSTOM", {})
    elsewhere = hardware.adopt(spec_from_facts(dataclasses.replace(facts, pcie_gen=3, power_limit_w=200)), "test")
    fake_nvml(facts, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="m2live"):
        spec = live_device._catalog_or_device(facts.name, 0)
    assert spec == spec_from_facts(facts) != elsewhere and get_gpu(facts.name) == spec
    assert "is described otherwise than before" in caplog.text
    assert "tdp_w 200 -> 250" in caplog.text and "interconnect_gbs 16.0 -> 32.0" in caplog.text
    # the plugin then loads the calibration again (and a second engine validates its configuration): its
    # constants apply to the device's description, with a warning naming what differs — never refused
    c = constants_for(spec)
    doc = {"schema": SCHEMA, "gpu": spec.name, "arch": spec.kernel_family,
           "constants": {"eta_mem": {"prior": c.eta_mem, "fitted": 0.95 * c.eta_mem}},
           "gpu_spec": json.loads(json.dumps(dataclasses.asdict(elsewhere)))}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="m2live"):
        for _ in range(2):
            cal = Calibration.from_json(doc, "cal.json")
            assert cal.gpu == spec.name and cal.fitted() == {"eta_mem": 0.95 * c.eta_mem}
    assert get_gpu(facts.name) == spec and "the calibration's constants apply to the one in use" in caplog.text
    # where nothing describes the GPU yet, the calibration's description is the one used
    monkeypatch.setattr(hardware, "_CUSTOM", {})
    Calibration.from_json(doc, "cal.json")
    assert get_gpu(facts.name) == elsewhere


FAKE_DRIVER = '''"""An NVML that answers as the driver of the GPUs in $FAKE_NVML_GPUS (JSON list of DeviceFacts fields)."""
import json, os, types
import importlib.machinery, importlib.util
_spec = importlib.machinery.PathFinder.find_spec("pynvml", [p for p in __import__("sys").path if "site-packages" in p])
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({k: getattr(_real, k) for k in dir(_real) if k.startswith("NVML_") or k == "NVMLError"})
_GPUS = json.loads(os.environ["FAKE_NVML_GPUS"])
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return len(_GPUS)
def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < len(_GPUS): raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _GPUS[i]
def nvmlDeviceGetName(h): return h["name"]
def nvmlDeviceGetCudaComputeCapability(h): return tuple(h["compute_capability"])
def nvmlDeviceGetNumGpuCores(h): return h["cuda_cores"]
def nvmlDeviceGetMaxClockInfo(h, kind): return h["max_sm_mhz"] if kind == NVML_CLOCK_SM else h["max_mem_mhz"]
def nvmlDeviceGetMemoryBusWidth(h): return h["mem_bus_bits"]
def nvmlDeviceGetMemoryInfo(h): return types.SimpleNamespace(total=h["mem_total_mib"] * 2**20)
def nvmlDeviceGetPowerManagementDefaultLimit(h): return h["power_limit_w"] * 1000
def nvmlDeviceGetEccMode(h): return (int(h["ecc"]), int(h["ecc"]))
def nvmlDeviceGetMaxPcieLinkGeneration(h): return h["pcie_gen"]
def nvmlDeviceGetMaxPcieLinkWidth(h): return h["pcie_width"]
def nvmlDeviceGetDefaultApplicationsClock(h, kind): raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
def nvmlDeviceGetMaxCustomerBoostClock(h, kind): raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
def nvmlDeviceGetNvLinkState(h, link):
    if link >= 18: raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(link < h["nvlinks"])
'''


def test_config_check_on_a_machine_whose_driver_names_gpus(tmp_path) -> None:
    """`m2live config check` against a driver (an NVML answering for two GPUs): the engine's first GPU is the
    one CUDA_VISIBLE_DEVICES starts with, as the plugin takes it; a GPU the catalog lacks is read from its driver;
    one neither the catalog nor its driver can describe makes the check fail (the plugin would switch off)."""
    import os
    import subprocess

    (tmp_path / "pynvml.py").write_text(FAKE_DRIVER)
    ada = dataclasses.asdict(DeviceFacts("NVIDIA RTX 5000 Ada Generation", (8, 9), 12800, 2550, 9001, 256, 32760,
                                         250, pcie_gen=4, pcie_width=16, ecc=True))
    t4 = dataclasses.asdict(DeviceFacts("Tesla T4", (7, 5), 2560, 1590, 5001, 256, 15360, 70, pcie_gen=3,
                                        pcie_width=16))

    def check(gpus: list[dict], **env: str) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("M2LIVE_", "CUDA_VISIBLE"))}
        return subprocess.run([sys.executable, "-m", "m2live", "config", "check", "--json"], capture_output=True,
                              text=True, timeout=60, env={**clean, **env, "FAKE_NVML_GPUS": json.dumps(gpus),
                                                           "PYTHONPATH": str(tmp_path)})

    h100 = dataclasses.asdict(FACTS["NVIDIA H100 80GB HBM3"])
    r = check([h100, ada])
    assert r.returncode == 0 and json.loads(r.stdout)["device"] == ("NVIDIA H100 80GB HBM3 (NVML GPU 0; the "
                                                                    "catalog's)"), r.stderr
    r = check([h100, ada], CUDA_VISIBLE_DEVICES="1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["device"] == ("NVIDIA RTX 5000 Ada Generation (NVML GPU 1; read from its driver: "
                                              "not in the catalog)")
    r = check([t4])
    assert r.returncode == 2 and json.loads(r.stdout)["device"] == "none"
    assert "compute capability 7.5 is outside" in r.stderr and "switch itself off" in r.stderr
    # `m2live gpus --device --json` there writes a spec file any later command (on any machine) takes
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("M2LIVE_", "CUDA_VISIBLE"))}
    g = subprocess.run([sys.executable, "-m", "m2live", "gpus", "--device", "1", "--json"], capture_output=True,
                       text=True, timeout=60, env={**clean, "FAKE_NVML_GPUS": json.dumps([h100, ada]),
                                                    "PYTHONPATH": str(tmp_path)})
    assert g.returncode == 0, g.stderr
    (tmp_path / "rtx5000.json").write_text(g.stdout)
    p = subprocess.run([sys.executable, "-m", "m2live", "predict", "--gpu", str(tmp_path / "rtx5000.json"),
                        "--decode", "1000x8", "--json"], capture_output=True, text=True, timeout=60, env=clean)
    assert p.returncode == 0 and json.loads(p.stdout)["gpu"] == "NVIDIA RTX 5000 Ada Generation", p.stderr

"""A GPU outside the catalog, described by what the device itself reports.

The catalog (``hardware.CATALOG``) holds datasheet rows. A GPU it does not list — an RTX A5000, an L20, a GeForce
card, next year's part — still tells the driver everything the model's datasheet terms need, except its
L2 size, and the plugin asks NVML for it (no CUDA context: the engine's GPUs stay untouched):

- compute capability → the architecture, the kernel family whose constants it borrows, and the dense tensor rate
  per SM and clock (FLOP, FP32 accumulate: 2048 on sm_80, 4096 on sm_90, 8192 on sm_100/103, 1024 on the other
  8.x / 12.x professional parts and 512 on GeForce ones, whose FP32-accumulating tensor rate is halved — the rates
  the catalog's rows follow, ``tests/test_hardware.py`` PER_SM_RATES); fp8 at twice the bf16 rate from sm_89;
- CUDA cores / cores per SM (64 on sm_80, 128 elsewhere) → SMs; the rated boost (NVML's max customer boost clock)
  where the board reports it, else NVML's maximum SM clock (on GeForce and RTX workstation boards a ceiling they do
  not sustain: a live clock prices them right) → boost, at which the derived tensor peak is quoted;
- memory bus width x maximum memory clock x 2 → DRAM bandwidth (NVML reports half the data rate: an H100 SXM's
  2619 MHz x 5120 bits gives 3.35 TB/s, an L40S's 9001 MHz x 384 bits 864 GB/s, their datasheets' figures); a bus
  of 2048 bits or more is HBM, its generation by the pin rate, a narrower one GDDR (GDDR7 on sm_120, GDDR6X on
  GeForce boards clocked past 9.5 GHz, else GDDR6); ECC on a GDDR6/6X board is
  inline, its 1/16 taken from the data (GDDR7 boards show no carve-out);
- the default power limit → the power model's budget; active NVLink links x the generation's per-link rate, else the PCIe
  link → the all-reduce's interconnect;
- the L2 size, which NVML does not report, from the catalog's GPU of the same compute capability with the nearest
  SM count, scaled by the SM ratio (a caller that knows it may say so: ``DeviceFacts.l2_bytes``; the plugin and
  the probe do not, so that a calibration one writes describes the GPU as the other reads it).

The spec's ``source`` says it was read from the device, and the plugin's start-up line shows it. Nothing here is
fitted; the efficiency constants are the kernel family's, as for any GPU m2live never measured. What the driver does
not tell apart: a part whose tensor rate is halved or capped (the L40's, the H20's) comes out at its architecture's
full rate, and a cut-down die's L2 is scaled from its sibling's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .hardware import (
    CATALOG,
    INLINE_ECC_DATA_SHARE,
    GpuSpec,
    UnknownGpuError,
    adopt,
    arch_of,
    get_gpu,
    in_catalog,
)

DERIVED_SOURCE = "read from the device (NVML), not a datasheet"
log = logging.getLogger("m2live")
HBM_MIN_BUS_BITS = 2048  # HBM stacks are 1024 bits wide each; GDDR boards top out at 512
# no GPU's rated boost reaches 2.9 GHz (RTX 4090 2520, RTX 5090 2407 MHz); an NVML maximum above it is a GeForce or
# RTX workstation board's V/F-table ceiling (~3.1 GHz; hardware.py), not a clock it holds
CEILING_MHZ = 2900
GDDR6X_MIN_MEM_MHZ = 9500  # GeForce GDDR6X boards report 9751+ MHz (19.5+ Gbps); GDDR6 ones up to 9001 (18 Gbps)
# NVLink per link and direction (GB/s): NVLink3 on GA100 (12 links: 300), GA102's bridge links (4: 56.25), NVLink4
# (18: 450), NVLink5 (18: 900)
NVLINK_GBS_PER_LINK = {(8, 0): 25.0, (8, 6): 14.0625, (9, 0): 25.0, (10, 0): 50.0, (10, 3): 50.0}
PCIE_GBS_X16 = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}  # per direction


@dataclass(frozen=True)
class DeviceFacts:
    """What the driver reports about one GPU (``read_nvml_facts``)."""

    name: str
    compute_capability: tuple[int, int]
    cuda_cores: int
    max_sm_mhz: float
    max_mem_mhz: float
    mem_bus_bits: int
    mem_total_mib: float
    power_limit_w: float
    nvlinks: int = 0  # active NVLink links
    pcie_gen: int | None = None  # the link's maximum generation
    pcie_width: int | None = None
    ecc: bool = False  # ECC on (on a GDDR board: inline)
    base_mhz: float | None = None  # default applications clock, where the board has one
    l2_bytes: float | None = None  # where a caller knows it (CUDA's device properties)
    boost_mhz: float | None = None  # the rated boost (NVML's max customer boost clock), where the board says


def tensor_flop_per_clk(name: str, cc: tuple[int, int]) -> int:
    """Dense bf16 tensor FLOP per SM and clock with FP32 accumulation (module docstring)."""
    if cc == (8, 0):
        return 2048
    if cc == (9, 0):
        return 4096
    if cc[0] == 10:
        return 8192
    return 512 if "geforce" in name.lower() else 1024


def memory_technology(name: str, cc: tuple[int, int], bus_bits: int, mem_mhz: float) -> str:
    """HBM from a 2048-bit bus up, its generation by the pin rate (2 x NVML's clock: HBM2 up to 2.4 Gb/s — A100
    40GB, A30 2.43; HBM2e up to 3.6 — A100 80GB 3.2, H100 PCIe 3.1; HBM3 5.2-5.6 — H100 SXM, GH200, H20; HBM3e 6.4
    and up — H200, B200); else GDDR7 on sm_120, GDDR6X on GeForce boards past 9.5 GHz, GDDR6 otherwise. HBM2 and
    HBM2e stream alike here (efficiency.MEMORY_FITTED_ON: the A100's ceiling), so the split only names them."""
    if bus_bits >= HBM_MIN_BUS_BITS:
        gbps = 2 * mem_mhz / 1000
        return ("HBM2" if gbps < 2.8 else "HBM2e") if gbps < 4.0 else ("HBM3" if gbps < 6.0 else "HBM3e")
    if cc[0] >= 12:
        return "GDDR7"
    if "geforce" in name.lower() and mem_mhz > GDDR6X_MIN_MEM_MHZ:
        return "GDDR6X"
    return "GDDR6"


def l2_mb_like(cc: tuple[int, int], sms: int) -> float:
    """L2 (MiB) of the catalog GPU of the same compute capability nearest in SMs, scaled by the SM ratio (that
    architecture's L2 per SM); 40 MiB where the catalog has none of that capability."""
    same = [g for g in CATALOG if g.compute_capability == cc]
    if not same:
        return 40.0
    near = min(same, key=lambda g: abs(g.sms - sms))
    return round(near.l2_mb * sms / near.sms, 1)


def spec_from_facts(f: DeviceFacts) -> GpuSpec:
    """A GpuSpec for a GPU outside the catalog from what its driver reports; ValueError (one line) when a fact is
    missing or the architecture is outside m2live's kernel families."""
    where = f"{f.name}: "
    try:
        arch = arch_of(f.compute_capability)
    except ValueError as e:
        raise ValueError(where + str(e)) from None
    for what, v in (("CUDA cores", f.cuda_cores), ("max SM clock", f.max_sm_mhz), ("max memory clock",
                    f.max_mem_mhz), ("memory bus width", f.mem_bus_bits), ("memory total", f.mem_total_mib),
                    ("power limit", f.power_limit_w)):
        if not (v and v > 0):
            raise ValueError(f"{where}the driver did not report its {what}")
    per_sm = 64 if f.compute_capability == (8, 0) else 128
    sms = max(1, round(f.cuda_cores / per_sm))
    rate = tensor_flop_per_clk(f.name, f.compute_capability)
    # the clock the peak is quoted at: NVML's maximum on data-centre parts; on GeForce and RTX workstation boards
    # that maximum is a V/F-table ceiling (~3.1 GHz) they do not sustain (hardware.py), so the rated boost where
    # the board reports it (its max customer boost clock)
    rated = f.boost_mhz if f.boost_mhz and 0 < f.boost_mhz <= f.max_sm_mhz else None
    boost = rated or f.max_sm_mhz
    bf16 = sms * rate * boost * 1e6 / 1e12
    bw = 2.0 * f.max_mem_mhz * f.mem_bus_bits / 8 / 1000.0
    memory = memory_technology(f.name, f.compute_capability, f.mem_bus_bits, f.max_mem_mhz)
    gib = f.mem_total_mib / 1024
    # inline ECC on GDDR6/6X boards: the driver's total is the data's 15/16 of the devices (GpuSpec.inline_ecc
    # reads it so); GDDR7 boards with ECC on show no carve-out (an RTX PRO 6000 Server: 97887 MiB of 96 GiB)
    mem_gb = gib / INLINE_ECC_DATA_SHARE * 1.0001 if f.ecc and memory in ("GDDR6", "GDDR6X") else gib
    per_link = NVLINK_GBS_PER_LINK.get(f.compute_capability, 50.0 if f.compute_capability[0] >= 10 else 25.0)
    if f.nvlinks > 0:
        link, link_gbs = "nvlink", f.nvlinks * per_link
    else:
        link = "pcie"
        link_gbs = PCIE_GBS_X16.get(f.pcie_gen or 4, 32.0) * min(16, f.pcie_width or 16) / 16
    l2 = f.l2_bytes / 2**20 if f.l2_bytes else l2_mb_like(f.compute_capability, sms)
    base = f.base_mhz if f.base_mhz and 0 < f.base_mhz <= boost else boost
    clock = (f"{boost:.0f} MHz (rated boost)" if rated else f"{boost:.0f} MHz (NVML's maximum"
             + ("; a V/F-table ceiling no board sustains: a live clock prices it right)"
                if f.max_sm_mhz >= CEILING_MHZ else ")"))
    return GpuSpec(
        name=f.name, arch=arch, compute_capability=f.compute_capability, sms=sms, base_mhz=base,
        boost_mhz=boost, bf16_tflops=round(bf16, 1), fp16_tflops=round(bf16, 1),
        fp8_tflops=round(2 * bf16, 1) if f.compute_capability >= (8, 9) else None, tflops_at_mhz=boost,
        memory=memory, mem_bw_gbs=round(bw, 1), mem_gb=mem_gb, mem_total_mib=f.mem_total_mib, l2_mb=l2,
        tdp_w=f.power_limit_w, interconnect=link, interconnect_gbs=link_gbs,
        source=(f"{DERIVED_SOURCE}: sm_{f.compute_capability[0]}{f.compute_capability[1]}, {sms} SMs x {rate} "
                f"FLOP/clk (assumed by compute capability: a part whose rate is halved or capped, as the L40's or "
                f"the H20's, is not told apart) at {clock}, {f.mem_bus_bits}-bit {memory} at {f.max_mem_mhz:.0f} "
                f"MHz, {f.power_limit_w:.0f} W, {link} {link_gbs:g} GB/s, L2 "
                + ("as CUDA reports it" if f.l2_bytes else f"{l2:g} MiB taken from the catalog's sm_"
                   f"{f.compute_capability[0]}{f.compute_capability[1]} GPU nearest in SMs")),
    )


def is_derived(spec: GpuSpec) -> bool:
    """Whether ``spec`` was read from a device (``spec_from_facts``) rather than taken from the catalog."""
    return spec.source.startswith(DERIVED_SOURCE)


def read_nvml_facts(index: int) -> DeviceFacts:
    """DeviceFacts of NVML device ``index`` (NVML initialised and shut down here); TelemetryError when NVML or
    a fact the spec needs cannot be read."""
    from .telemetry import TelemetryError, nvml_opt, nvml_session, nvml_str

    with nvml_session() as nv:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            links = 0
            for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
                state = nvml_opt(nv.nvmlDeviceGetNvLinkState, h, link)
                if state is None:
                    break
                links += int(state == 1)
            ecc = nvml_opt(nv.nvmlDeviceGetEccMode, h)
            limit = nvml_opt(nv.nvmlDeviceGetPowerManagementDefaultLimit, h) or nvml_opt(
                nv.nvmlDeviceGetEnforcedPowerLimit, h)
            return DeviceFacts(
                name=nvml_str(nv.nvmlDeviceGetName(h)),
                compute_capability=tuple(nv.nvmlDeviceGetCudaComputeCapability(h)),
                cuda_cores=int(nvml_opt(nv.nvmlDeviceGetNumGpuCores, h) or 0),
                max_sm_mhz=float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
                max_mem_mhz=float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)),
                mem_bus_bits=int(nvml_opt(nv.nvmlDeviceGetMemoryBusWidth, h) or 0),
                mem_total_mib=nv.nvmlDeviceGetMemoryInfo(h).total / 2**20, power_limit_w=(limit or 0) / 1000.0,
                nvlinks=links, pcie_gen=nvml_opt(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=nvml_opt(nv.nvmlDeviceGetMaxPcieLinkWidth, h), ecc=bool(ecc and ecc[0]),
                base_mhz=nvml_opt(nv.nvmlDeviceGetDefaultApplicationsClock, h, nv.NVML_CLOCK_GRAPHICS),
                boost_mhz=nvml_opt(nv.nvmlDeviceGetMaxCustomerBoostClock, h, nv.NVML_CLOCK_SM) or nvml_opt(
                    nv.nvmlDeviceGetMaxCustomerBoostClock, h, nv.NVML_CLOCK_GRAPHICS),
            )
        except Exception as e:  # noqa: BLE001
            raise TelemetryError(f"NVML device {index} unreadable: {e}") from None


def catalog_or_device(name: str, nvml_index: int) -> GpuSpec:
    """The catalog's row for ``name`` (a GPU NVML named as device ``nvml_index``); for a GPU the catalog does not
    list, its spec read from that device (``spec_from_facts``, from NVML alone, so that the plugin, the probe and
    a calibration written by one and read by another describe the GPU alike), registered under its name so that
    later lookups in this process (a calibration, a plan) find it — the device's reading wins over a description
    registered before it (a calibration's ``gpu_spec``, taken on another machine), with a warning where they
    differ. ValueError, one line, when neither works."""
    from .telemetry import TelemetryError

    try:
        known = get_gpu(name)
    except UnknownGpuError as e:
        known, missing = None, e
    if known is not None and in_catalog(known):
        return known
    try:
        spec = spec_from_facts(read_nvml_facts(nvml_index))
    except (TelemetryError, ValueError) as why:
        if known is not None:
            return known
        raise ValueError(f"{missing}; reading its spec from the device failed too: {why}") from None
    try:  # (a warning names what differs from a description registered before)
        return adopt(spec, f"NVML device {nvml_index}", origin="device")
    except UnknownGpuError as e:  # its name or an alias is a catalog GPU's
        raise ValueError(str(e)) from None

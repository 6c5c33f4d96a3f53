"""The files of a GPU calibration: measured opbench tables in, the versioned calibration JSON out.

- ``read_rows(DIR, gpu)``: the measured rows of DIR's opbench tables (any subset of ``FILES``), checked to be of
  that GPU, with at least ``MIN_ROWS`` per kind; ``rows_from_tables`` for the bench and tests.
- ``Calibration``: the JSON (``SCHEMA``; ``load`` / ``save``, validated on load), ``arch_constants()`` gives the
  ``ArchConstants`` to predict with; ``check_gpu`` refuses a calibration of another GPU.
- ``Calibrations``: one per GPU, as --calibration names them (the flag given once per file); ``for_gpu``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from .calibration_params import (
    ALL_CALIBRATED,
    FILES,
    FP8_CALIBRATED,
    LINEAR,
    SHAPE_COLS,
    CalibrationError,
    Row,
    carry_to_fp8,
    in_plausible_range,
    range_for,
    row_kind,
)
from .efficiency import ArchConstants, constants_for
from .hardware import GpuSpec, adopt, get_gpu, in_catalog, spec_from_dict, spec_to_dict
from .validate import TableError, in_core_region, measured, read_table

SCHEMA = "m2live.calibration/1"
MIN_ROWS = 4  # fewer measured rows of a kind than this cannot pin anything: refused
LABELS = ("fitted_on", "borrowed_from")  # ArchConstants fields that say where values came from, not values
log = logging.getLogger("m2live")


# ---- the calibration file -----------------------------------------------------------------------------------
@dataclass
class Calibration:
    gpu: str  # canonical NVML name
    arch: str  # kernel family whose constants it refines (GpuSpec.kernel_family)
    constants: dict[str, dict[str, float]]  # name -> {"prior": x, "fitted": y}: bf16 (cuBLAS GEMMs, attention)
    rows: dict[str, int]  # rows used per kind
    residual: dict[str, dict[str, float]]  # kind -> {"mape_prior": x, "mape_fitted": y} on the rows used
    m2live_version: str = ""
    created: str = ""
    fit: dict = field(default_factory=dict)  # per fit group: what cross-validation chose, out-of-fold MAPEs
    path: str | None = field(default=None, compare=False)
    # the fp8 GEMM constants (vLLM's CUTLASS scaled-mm), name -> {"prior": the family's fp8 value, "fitted": y},
    # fitted on gemm_fp8 rows from ``fp8_prior`` (the family's with what the bf16 fit says of the GPU); {} when no
    # fp8 row was measured (arch_constants("fp8") then still carries the bf16 fit's: carry_to_fp8)
    constants_fp8: dict[str, dict[str, float]] = field(default_factory=dict)
    # precision -> the architecture's constants the fit held fixed (``held_constants``), as the model had them when
    # the file was written: the fitted values were fitted alongside these, so a later m2live whose model changed
    # one of them (a new term, a refitted prior) has fitted values that may count that change twice (``changed``)
    held: dict[str, dict[str, object]] = field(default_factory=dict)

    def fitted(self, dtype: str = "bf16") -> dict[str, float]:
        return {n: v["fitted"] for n, v in (self.constants_fp8 if dtype == "fp8" else self.constants).items()}

    def arch_constants(self, dtype: str = "bf16") -> ArchConstants:
        """The architecture's constants with this GPU's fitted values: the bf16 ones, or (``dtype`` fp8) the
        fp8 GEMM constants — the family's, with what the bf16 fit says of the GPU, then the fp8 fit's."""
        used = ", ".join(f"{n} {k}" for k, n in self.rows.items() if n)
        gpu = get_gpu(self.gpu)
        if dtype == "fp8":
            base = fp8_prior(gpu, self.fitted())
        else:
            base = constants_for(gpu)
        return replace(base, **self.fitted(dtype), fitted_on=f"calibration of {self.gpu} ({used} measured rows)"
                       + (f", {self.path}" if self.path else ""))

    def predictor_constants(self) -> dict[str, ArchConstants]:
        """``Predictor``'s keyword arguments for this calibration: ``constants`` (bf16) and, on a GPU with fp8
        tensor cores, ``fp8_constants`` (the four projections of an fp8 model)."""
        out = {"constants": self.arch_constants()}
        if get_gpu(self.gpu).has_fp8:
            out["fp8_constants"] = self.arch_constants("fp8")
        return out

    def label(self) -> str:
        """What the info metric and the CLI say about this calibration."""
        return f"{Path(self.path).name if self.path else 'calibration'} ({self.gpu}, {self.created})"

    def check_gpu(self, gpu: GpuSpec | str) -> None:
        name = get_gpu(gpu).name if isinstance(gpu, str) else gpu.name
        if name != self.gpu:
            src = f" ({self.path})" if self.path else ""
            raise CalibrationError(f"calibration{src} is for {self.gpu}, not {name}: calibrate this GPU "
                                   "with `m2live calibrate plan/fit` or drop --calibration")

    def changed(self) -> list[str]:
        """What of the model this calibration was fitted under differs in this m2live: a calibrated constant's
        prior, or a constant the fit held fixed (a term added since counts from its default); [] when none.
        A file written before m2live recorded the held constants is checked on its priors only."""
        gpu = get_gpu(self.gpu)
        today = {"bf16": constants_for(gpu), **({"fp8": constants_for(gpu, "fp8")} if gpu.has_fp8 else {})}
        out: list[str] = []
        named: set[str] = set()  # the fp8 constants share the bf16 ones' other fields: each change said once
        for dtype, ac in today.items():
            section = self.constants_fp8 if dtype == "fp8" else self.constants
            tag = " (fp8)" if dtype == "fp8" else ""
            for n, v in section.items():
                if not _same(v["prior"], getattr(ac, n)):
                    out.append(f"{n} prior{tag} {_show(v['prior'])} -> {_show(getattr(ac, n))}")
                    named.add(n)
            then = self.held.get(dtype)
            if then is None:
                continue
            now = held_constants(ac, section)
            for n in sorted(set(then) | set(now)):
                if (dtype == "fp8" and n in named) or (n not in now and n in section):  # said, or fitted now
                    continue
                if n not in now:
                    out.append(f"{n}{tag} (no longer in the model)")
                else:
                    was = then.get(n, _DEFAULTS.get(n, MISSING))  # a term added since: its default stood for it
                    if _same(was, now[n]):
                        continue
                    out.append(f"{n}{tag} {'absent' if was is MISSING else _show(was)} -> {_show(now[n])}")
                named.add(n)
        return out

    def to_json(self) -> dict:
        doc = {"schema": SCHEMA, "gpu": self.gpu, "arch": self.arch, "m2live_version": self.m2live_version,
               "created": self.created, "constants": self.constants, "rows": self.rows, "residual": self.residual,
               "fit": self.fit}
        if self.constants_fp8:
            doc["constants_fp8"] = self.constants_fp8
        if self.held:
            doc["held"] = self.held
        gpu = get_gpu(self.gpu)
        if not in_catalog(gpu):  # a GPU described by a file or read from its device: the calibration carries it
            doc["gpu_spec"] = spec_to_dict(gpu)
        return doc

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, doc: object, path: str | None = None) -> Calibration:
        where = path or "calibration"
        if not isinstance(doc, dict):
            raise CalibrationError(f"{where}: not a calibration (a JSON object is expected)")
        if doc.get("schema") != SCHEMA:
            raise CalibrationError(f"{where}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
        try:
            if doc.get("gpu_spec") is not None:  # a GPU outside the catalog, described in the file
                described = spec_from_dict(doc["gpu_spec"], "gpu_spec")
                if described.name != str(doc["gpu"]):
                    raise CalibrationError(f"{where}: gpu_spec describes {described.name!r}, not {doc['gpu']!r}")
                adopt(described, where, origin="calibration")  # yields to the run's own description
            gpu = get_gpu(str(doc["gpu"]))
        except KeyError as e:
            raise CalibrationError(str(e) if str(e).startswith(f"{where}: ") else f"{where}: {e}") from None
        if doc.get("arch") != gpu.kernel_family:
            raise CalibrationError(f"{where}: arch {doc.get('arch')!r} is not {gpu.name}'s ({gpu.kernel_family})")
        consts, consts8 = doc.get("constants"), doc.get("constants_fp8", {})
        for key, section in (("constants", consts), ("constants_fp8", consts8)):
            if not isinstance(section, dict):
                raise CalibrationError(f"{where}: {key!r} must be an object of name -> {{prior, fitted}}")
        if not (consts or consts8):
            raise CalibrationError(f"{where}: no constants")
        if consts8 and not gpu.has_fp8:
            raise CalibrationError(f"{where}: fp8 constants for {gpu.name}, which has no fp8 tensor cores")
        clean = _checked_constants(consts, ALL_CALIBRATED, where, "constant")
        clean8 = _checked_constants(consts8, FP8_CALIBRATED, where, "fp8 constant")
        held = doc.get("held", {})
        if not _held_ok(held):
            raise CalibrationError(f"{where}: 'held' must be an object of bf16 / fp8 -> {{name: value}}, each value "
                                   "a number, string, boolean or a list of them (or of such lists)")
        return cls(gpu.name, gpu.arch, clean, dict(doc.get("rows") or {}), dict(doc.get("residual") or {}),
                   str(doc.get("m2live_version", "")), str(doc.get("created", "")),
                   dict(doc.get("fit") or {}), path, clean8, held)


def held_constants(ac: ArchConstants, fitted: Iterable[str]) -> dict[str, object]:
    """The constants of ``ac`` a fit of ``fitted`` held at the architecture's values (every field but those and the
    labels), as JSON values (tuples as lists)."""
    skip = set(fitted) | set(LABELS)
    return {f.name: _json_value(getattr(ac, f.name)) for f in fields(ac) if f.name not in skip}


def _held_ok(held: object) -> bool:
    """A file's 'held' section: bf16 / fp8 -> {name: a value an ArchConstants field can hold}."""
    return isinstance(held, dict) and all(k in ("bf16", "fp8") and isinstance(v, dict)
                                          and all(_plain(x) for x in v.values()) for k, v in held.items())


def _plain(v: object, depth: int = 0) -> bool:
    """A value an ArchConstants field can hold, as JSON: a finite number, string, boolean or null, or a list of
    them (tables: lists of lists, two levels deep)."""
    if isinstance(v, list):
        return depth < 2 and all(_plain(x, depth + 1) for x in v)
    if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)):
        return abs(v) < 1e300  # false for inf and nan too
    return v is None or isinstance(v, (str, bool))


def _json_value(v: object) -> object:
    return [_json_value(x) for x in v] if isinstance(v, (tuple, list)) else v


# each ArchConstants field's default, as a JSON value: what a file written before the field existed was fitted with
_DEFAULTS = {f.name: _json_value(f.default) for f in fields(ArchConstants) if f.default is not MISSING}


def _same(a: object, b: object) -> bool:
    """One constant's value then and now (JSON values, checked by ``_plain``): numbers to a relative 1e-9 (a JSON
    round trip is exact), others equal."""
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-30)
    return a == b


def _show(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v) if isinstance(v, list) else str(v)


def fp8_prior(gpu: GpuSpec, bf16_fitted: dict[str, float]) -> ArchConstants:
    """The fp8 GEMM constants a calibration starts from: the family's, with what the bf16 fit ``bf16_fitted``
    says of this GPU (``calibration_params.CARRIED_TO_FP8``)."""
    return carry_to_fp8(constants_for(gpu, "fp8"), constants_for(gpu), bf16_fitted)


def _checked_constants(consts: dict, allowed: tuple[str, ...], where: str, what: str) -> dict[str, dict[str, float]]:
    """A file's constants section, each name one that section calibrates and each value a valid one."""
    clean: dict[str, dict[str, float]] = {}
    for n, v in consts.items():
        if n not in allowed:
            raise CalibrationError(f"{where}: {n!r} is not a calibrated {what} ({', '.join(allowed)})")
        try:
            prior, val = float(v["prior"]), float(v["fitted"])
        except (TypeError, KeyError, ValueError, OverflowError):  # OverflowError: an integer past any float
            raise CalibrationError(f"{where}: {what} {n!r} needs numeric 'prior' and 'fitted'") from None
        if not (math.isfinite(val) and (val > 0 or (n in LINEAR and val >= 0))):
            raise CalibrationError(f"{where}: {what} {n!r} has an invalid fitted value {v['fitted']!r}")
        for label, x, around in (("prior", prior, None), ("fitted", val, prior)):
            if not in_plausible_range(n, x, around):
                lo, hi = range_for(n, around)
                raise CalibrationError(f"{where}: {what} {n!r} has a {label} value {x!r} outside what any fit "
                                       f"gives ({lo:g} to {hi:g})")
        # a value a rounding step past an end (an older fit's) is the end itself: the soft maxima's exponents
        # (overlap, item_overlap) are then at least 1, their bounds' lower end, as the model needs
        lo, hi = range_for(n, prior)
        clean[n] = {"prior": prior, "fitted": min(max(val, lo), hi)}
    return clean


def load(path: str | os.PathLike, warn: bool = True) -> Calibration:
    """The calibration at ``path``, validated; with ``warn``, one warning naming what of the model it was fitted
    under has changed since (``Calibration.changed``)."""
    p = str(path)
    try:
        text = Path(p).read_text()
    except FileNotFoundError:
        raise CalibrationError(f"no such calibration file: {p}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise CalibrationError(f"cannot read calibration {p}: {e.__class__.__name__}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{p}: not JSON ({e.msg}, line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # a 4300-digit integer, nesting past the recursion limit
        raise CalibrationError(f"{p}: not a calibration ({str(e)[:120]})") from None
    cal = Calibration.from_json(doc, p)
    changed = cal.changed() if warn else []
    if changed:
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        log.warning("%s was fitted under a model that has changed since (%s%s): its fitted values may count a "
                    "changed term twice; refit it with `m2live calibrate fit` on the rows it was measured from",
                    p, ", ".join(changed[:4]), more)
    return cal


Paths = str | os.PathLike | Sequence[str | os.PathLike] | None  # --calibration: one file, or one per GPU


class Calibrations:
    """The calibrations --calibration names, one per GPU (the flag given once per file): a command over several
    GPUs (``rank``, ``simulate --batch``, a table of several devices) predicts each with its own, and a GPU with
    none is refused where a calibration was asked for (``for_gpu``) — never silently priced from the family."""

    def __init__(self, cals: Iterable[Calibration]):
        self.by_gpu: dict[str, Calibration] = {}
        for cal in cals:
            other = self.by_gpu.get(cal.gpu)
            if other is not None:
                raise CalibrationError(f"--calibration: {other.path} and {cal.path} are both for {cal.gpu}: "
                                       "give one file per GPU")
            self.by_gpu[cal.gpu] = cal

    @classmethod
    def load(cls, paths: Paths) -> Calibrations | None:
        """The files at ``paths``, one or several (None when there are none; an empty path is none — a script's
        ``--calibration "$CAL"`` with CAL unset asks for no calibration)."""
        given = [] if not paths else [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        files = [str(p) for p in given if str(p)]
        return cls(load(p) for p in files) if files else None

    def for_gpu(self, gpu: GpuSpec | str) -> Calibration:
        """This GPU's calibration; refused (one line) when none of the files is for it."""
        if len(self.by_gpu) == 1:
            cal = next(iter(self.by_gpu.values()))
            cal.check_gpu(gpu)  # one file: the message names it and its GPU
            return cal
        name = get_gpu(gpu).name if isinstance(gpu, str) else gpu.name
        cal = self.by_gpu.get(name)
        if cal is None:
            given = "; ".join(f"{c.path} is for {g}" for g, c in self.by_gpu.items())
            raise CalibrationError(f"no calibration for {name} ({given}): calibrate this GPU with "
                                   "`m2live calibrate plan/fit` or drop --calibration")
        return cal


# ---- reading measured tables --------------------------------------------------------------------------------
def read_rows(directory: str | os.PathLike, gpu: GpuSpec, sparse: dict[str, int] | None = None) -> list[Row]:
    """The measured rows of DIR's opbench tables (any subset of FILES), checked to be of ``gpu``. A kind with fewer
    than MIN_ROWS rows pins nothing: with ``sparse`` (a dict) its rows are left out and counted there (its constants
    stay at the prior: a table that lacks most of a kind's planned shapes does not cost the other kinds their
    calibration), unless no kind is left; without it, such a kind is an error."""
    d = Path(directory)
    if not d.is_dir():
        why = "not a directory" if d.exists() else "no such directory"
        raise CalibrationError(f"{directory}: {why} (give the folder holding {', '.join(FILES.values())})")
    paths = [d / name for name in FILES.values() if (d / name).is_file()]
    if not paths:
        raise CalibrationError(f"{directory}: none of {', '.join(FILES.values())} found")
    rows: list[Row] = []
    for p in paths:
        try:
            t = read_table(p)
            meas = measured(t)
        except TableError as e:
            raise CalibrationError(str(e)) from None
        if meas is None:
            raise CalibrationError(f"{p}: no latency_ms column (measure the plan's shapes first)")
        n_kind: dict[str, int] = {}
        for i, (kind, row, ms) in enumerate(zip(t.kinds, t.rows, meas, strict=True), start=2):
            if math.isnan(ms):  # a planned shape the table holds but did not measure: not given
                continue
            dev = (row.get("device") or "").strip()
            if dev:
                try:
                    other = get_gpu(dev).name
                except KeyError:
                    other = dev
                if other != gpu.name:
                    raise CalibrationError(f"{p}:{i}: a row of {dev}, not {gpu.name}: calibrate one GPU per folder")
            k = row_kind(kind, t.dtype)
            if k == "gemm_fp8" and not gpu.has_fp8:
                raise CalibrationError(f"{p}: fp8 GEMMs, but {gpu.name} has no fp8 tensor cores")
            try:
                cells = {c: str(int(float(row[c]))) for c in SHAPE_COLS[k]}
            except (KeyError, ValueError):
                raise CalibrationError(f"{p}:{i}: malformed shape cells") from None
            if "head_dim" in cells and int(cells["head_dim"]) % 8:
                raise CalibrationError(f"{p}:{i}: head_dim {cells['head_dim']} is not a multiple of 8")
            if "num_heads" in cells and (int(cells["num_key_value_heads"]) < 1
                                         or int(cells["num_heads"]) % int(cells["num_key_value_heads"])):
                raise CalibrationError(f"{p}:{i}: num_heads {cells['num_heads']} is not a multiple of "
                                       f"num_key_value_heads {cells['num_key_value_heads']}")
            rows.append(Row(k, cells, ms))
            n_kind[k] = n_kind.get(k, 0) + 1
        if not n_kind:  # a header only, or every row unmeasured: that kind has no rows
            if sparse is None:
                raise CalibrationError(f"{p}: no measured rows (a header only, or every latency_ms blank or NaN)")
            sparse[next(k for k, name in FILES.items() if name == p.name)] = 0
        for k, n in n_kind.items():
            if n < MIN_ROWS:
                if sparse is None:
                    raise CalibrationError(f"{p}: only {n} {k} rows; a calibration needs at least {MIN_ROWS} per kind")
                sparse[k] = n
    kept = [r for r in rows if r.kind not in (sparse or {})]
    if not kept:
        raise CalibrationError(f"{directory}: only " + ", ".join(f"{n} {k}" for k, n in (sparse or {}).items())
                               + f" rows; a calibration needs at least {MIN_ROWS} of a kind")
    return kept



def rows_from_tables(paths: Iterable[str | os.PathLike], region: bool = True,
                     keep: Callable[[str, dict[str, str]], bool] | None = None) -> list[Row]:
    """Measured rows of opbench tables (for the bench and tests), optionally filtered."""
    out: list[Row] = []
    for p in paths:
        t = read_table(p)
        meas = measured(t)
        if meas is None:
            raise CalibrationError(f"{p}: no latency_ms column")
        for kind, row, ms in zip(t.kinds, t.rows, meas, strict=True):
            if math.isnan(ms) or (region and not in_core_region(kind, row)):
                continue
            k = row_kind(kind, t.dtype)
            if keep is None or keep(k, row):
                out.append(Row(k, {c: row[c] for c in SHAPE_COLS[k]}, ms))
    return out

"""The calibration cache: the GpuConfig values `pricer calibrate` (pricer/tools/calibrate.py)
measured on a GPU, one JSON file per GPU name and pricer version, in
$XDG_CACHE_HOME (else ~/.cache) /pricer/calibration/<GPU name>-<version>.json, written atomically.
GpuEngine (gpu/hybrid/batch/auto) starts from those values when no explicit config is given; explicit
overrides (`pricer price --t1/--t2`, job keys pricing.t1/t2, GpuEngine keywords) win.
PRICER_CALIBRATION=off makes every engine ignore the cache.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import replace
from pathlib import Path

from pricer import __version__
from pricer.engines.gpu.config import GpuConfig
from pricer.files import atomic_write, cache_dir

SCHEMA = "pricer.calibration/1"
# the GpuConfig fields a calibration sets
CALIBRATED = ("t1", "t2", "tiled_vt", "tiled_k", "cpu_max_steps", "hw_flat_rows",
              "hw_flat_threads")
# fields a calibration file may hold for the warp-per-block kernel, which only `pricer bench gpu`
# runs (not a production path): ignored
RETIRED = ("warp_vt", "warp_k")


def sanitise(name: str) -> str:
    """A device name as a file-name part: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "gpu"


def calibration_path(device_name: str, version: str = __version__) -> Path:
    return cache_dir("calibration") / f"{sanitise(device_name)}-{version}.json"


def check_values(values: dict) -> dict:
    """The calibrated GpuConfig fields of `values`, checked (ValueError says what is wrong)."""
    if not isinstance(values, dict):
        raise ValueError("values is not a table")
    unknown = sorted(set(values) - set(CALIBRATED))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be a whole number >= 0, got {value!r}")
    replace(GpuConfig(), **values).check()
    return dict(values)


def store_calibration(record: dict, path: Path | None = None) -> Path:
    """Write `record` (with device, version and values) as JSON, atomically; returns the path."""
    check_values(record["values"])
    path = Path(path) if path is not None else calibration_path(record["device"], record["version"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
    return path


def load_calibration(device_name: str, version: str = __version__) -> tuple[dict, Path] | None:
    """The cached values for this device name and version, and their file; None if there are none
    (or PRICER_CALIBRATION=off). A file that does not check out is ignored with a warning."""
    if os.environ.get("PRICER_CALIBRATION", "").lower() in ("off", "0", "no"):
        return None
    path = calibration_path(device_name, version)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"pricer: ignoring the calibration {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or record.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file")
        if record.get("device") != device_name or record.get("version") != version:
            raise ValueError(f"made for {record.get('device')!r} / pricer {record.get('version')}, "
                             f"not {device_name!r} / pricer {version}")
        values = record.get("values")
        if isinstance(values, dict):   # the warp-per-block shapes: not calibrated, dropped
            values = {key: value for key, value in values.items() if key not in RETIRED}
        values = check_values(values)
    except ValueError as exc:   # json.JSONDecodeError is a ValueError
        warnings.warn(f"pricer: ignoring the calibration {path}: {exc}; run `pricer calibrate` again",
                      RuntimeWarning, stacklevel=2)
        return None
    return values, path


def effective_config(device_name: str | None, overrides: dict | None = None,
                     defaults: dict | None = None) -> tuple[GpuConfig, Path | None]:
    """GpuConfig() <- defaults <- the cached calibration of `device_name` <- overrides, checked;
    and the calibration file used (None if none)."""
    config = replace(GpuConfig(), **(defaults or {}))
    source = None
    found = load_calibration(device_name) if device_name else None
    if found is not None:
        values, source = found
        config = replace(config, **values)
    return replace(config, **(overrides or {})).check(), source

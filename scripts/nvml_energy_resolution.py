#!/usr/bin/env python3
"""How finely NVML's total-energy counter moves (the counter mxflash-bench reads around each
sampling window): polls nvmlDeviceGetTotalEnergyConsumption for --seconds and prints how many
distinct values it saw, the median time between changes and the mean power they imply. Run it while
the GPU is busy (e.g. beside an mxflash-bench window) to see the update interval under load."""
import argparse
import ctypes
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args()
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        print(f"nvml_energy_resolution: libnvidia-ml.so.1 not loadable: {e}")
        return 1
    if nvml.nvmlInit_v2() != 0:
        print("nvml_energy_resolution: nvmlInit_v2 failed")
        return 1
    dev = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(a.device), ctypes.byref(dev)) != 0:
        print("nvml_energy_resolution: no device handle")
        return 1
    mj = ctypes.c_ulonglong()
    changes = []  # (time, mJ) at each new value
    t_end = time.perf_counter() + a.seconds
    last = None
    reads = 0
    while time.perf_counter() < t_end:
        if nvml.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(mj)) != 0:
            print("nvml_energy_resolution: nvmlDeviceGetTotalEnergyConsumption failed")
            return 1
        reads += 1
        if mj.value != last:
            changes.append((time.perf_counter(), mj.value))
            last = mj.value
    if len(changes) < 3:
        print(f"nvml_energy_resolution: {reads} reads, {len(changes)} distinct values")
        return 0
    dts = [b[0] - a_[0] for a_, b in zip(changes, changes[1:])]
    watts = (changes[-1][1] - changes[1][1]) * 1e-3 / (changes[-1][0] - changes[1][0])
    print(f"nvml_energy_resolution: {reads} reads in {a.seconds:.1f} s, {len(changes)} distinct values, "
          f"median {1e3 * statistics.median(dts):.2f} ms between changes (min {1e3 * min(dts):.2f}, "
          f"max {1e3 * max(dts):.2f}), {watts:.0f} W over them")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The H100's published limits, and the occupancy a kernel reaches under them.

NVIDIA H100 SXM5 80 GB (the card of the course's GPU sessions, ``NVIDIA H100 80GB HBM3``), compute
capability 9.0 — from the CUDA C++ Programming Guide's table of limits per compute capability and
the H100 whitepaper:

    132 SMs, 4 warp schedulers (sub-partitions) an SM, 1.98 GHz boost clock
    65,536 32-bit registers an SM (16,384 a sub-partition), at most 255 a thread,
        allocated to warps in units of 256 (a thread's count rounded up to a multiple of 8)
    2,048 threads = 64 warps an SM, at most 32 blocks an SM, 1,024 threads a block
    228 KB of shared memory an SM, at most 227 KB a block, allocated in 128-byte units,
        plus 1 KB the system reserves for each block
    FP32: 128 lanes an SM → 2 × 128 × 132 × 1.98e9 = 66.9 TFLOP/s with fused multiply-adds
    HBM3: 3.35 TB/s

``occupancy(registers, threads, shared)`` follows the CUDA occupancy calculator
(``cuda_occupancy.h``): blocks an SM = the smallest of the four limits (blocks, warps, registers,
shared memory); occupancy = resident warps / 64.
"""

from __future__ import annotations

from typing import NamedTuple

SMS = 132
SUBPARTITIONS = 4
CLOCK_HZ = 1.98e9
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256                 # registers are given to a warp in units of this many
MAX_REGISTERS_PER_THREAD = 255
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
MAX_THREADS_PER_BLOCK = 1024
SHARED_PER_SM = 228 * 1024
SHARED_PER_BLOCK = 227 * 1024
SHARED_UNIT = 128
SHARED_RESERVED_PER_BLOCK = 1024
WARP = 32
FP32_LANES_PER_SM = 128
PEAK_FP32_FLOPS = 2 * FP32_LANES_PER_SM * SMS * CLOCK_HZ       # 66.9e12
HBM_BYTES_PER_S = 3.35e12


class Occupancy(NamedTuple):
    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float          # resident warps / 64
    limited_by: str           # "blocks", "warps", "registers" or "shared memory"


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(registers: int, threads: int, shared_bytes: int) -> Occupancy:
    """Blocks of ``threads`` threads, ``registers`` registers a thread and ``shared_bytes`` of shared
    memory (static + dynamic) that one SM holds at once, and the resulting occupancy."""
    if not 0 < threads <= MAX_THREADS_PER_BLOCK:
        raise ValueError(f"a block of {threads} threads: an H100 block has 1 to {MAX_THREADS_PER_BLOCK}")
    warps = -(-threads // WARP)
    registers_per_warp = round_up(max(1, registers) * WARP, REGISTER_UNIT)
    warps_by_registers = (REGISTERS_PER_SM // SUBPARTITIONS // registers_per_warp) * SUBPARTITIONS
    shared = round_up(shared_bytes, SHARED_UNIT) + SHARED_RESERVED_PER_BLOCK
    limits = {"blocks": MAX_BLOCKS_PER_SM, "warps": MAX_WARPS_PER_SM // warps,
              "registers": warps_by_registers // warps,
              "shared memory": SHARED_PER_SM // shared if shared_bytes <= SHARED_PER_BLOCK else 0}
    limited_by = min(limits, key=lambda name: (limits[name], name != "blocks"))
    blocks = limits[limited_by]
    return Occupancy(blocks, blocks * warps, blocks * warps / MAX_WARPS_PER_SM, limited_by)

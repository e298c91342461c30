"""PTX → sm_90 machine code (SASS) with NVIDIA's own tools, and what the machine code says.

    ptxas -arch=sm_90 -v K.ptx -o K.cubin     registers a thread, spill stores/loads, stack, shared memory
    nvdisasm -c K.cubin                       the SASS, one instruction a line, branch targets as labels

Both come from NVIDIA's PyPI wheels (``nvidia-cuda-nvcc``: ptxas; ``nvidia-cuda-nvdisasm``;
pyproject's dev extra installs them), else from a CUDA toolkit on the PATH or in /usr/local/cuda*.
``tools()`` finds them, or says in one line which is missing and how to install it.

Reading the SASS (``loop_mix``): a loop is a backward branch — a ``BRA`` to a label at or above
it; its body is every instruction from the label to the branch. An *innermost* loop holds no
other loop. The *hot loop* is the innermost loop with the most FFMAs (fused multiply-adds, the
arithmetic of every product here), or the largest innermost loop when none has any. Its mix:

    FFMA            fused multiply-add: 2 floating-point operations, the useful work
    all             every instruction but NOP
    LDS / LDG       shared-memory / global-memory loads (LDL: local memory — spills, or a
                    thread's array the compiler could not keep in registers)
    divisions       integer division/modulo: ``I2F.U32.RP`` opens the ~20-instruction sequence of
                    a 32-bit one (reciprocal on the MUFU unit, multiply back, two corrections);
                    a 64-bit one CALLs the ``__cuda_sm20_div/rem`` subroutine (~70 instructions),
                    after a test that picks the 32-bit sequence when both operands fit
    atomics         ATOM/RED on global memory, ATOMS on shared memory
    STS             shared-memory stores (a tile loader stores each element it loads once)
    barriers        BAR.SYNC (``cuda.syncthreads()``)
    branches        BRA (a loop's own jump back included)
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

INSTALL_HINT = "pip install -e '.[dev]' (NVIDIA's nvidia-cuda-nvcc, nvidia-nvvm and nvidia-cuda-nvdisasm wheels)"
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def find_tool(name: str) -> str | None:
    """The path of NVIDIA tool ``name``: from the nvidia PyPI wheels first, then the PATH, then /usr/local/cuda*."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for found in sorted(Path(root).glob(f"*/bin/{name}")):
            return str(found)
    on_path = shutil.which(name)
    if on_path:
        return on_path
    for found in sorted(Path("/usr/local").glob(f"cuda*/bin/{name}"), reverse=True):
        return str(found)
    return None


def tools() -> dict:
    """{"ptxas": path, "nvdisasm": path}; ValueError (one line) naming what is missing."""
    found = {name: find_tool(name) for name in ("ptxas", "nvdisasm")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise ValueError(f"static report: {' and '.join(missing)} not found (no GPU is needed, only NVIDIA's "
                         f"compiler tools): {INSTALL_HINT}")
    return found


def assemble(ptx_path: Path, found: dict) -> tuple[Path, dict]:
    """ptxas the PTX for sm_90: (cubin path, resources from ``ptxas -v``)."""
    cubin = ptx_path.with_suffix(".cubin")
    done = subprocess.run([found["ptxas"], "-arch=sm_90", "-v", str(ptx_path), "-o", str(cubin)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"ptxas failed on {ptx_path.name}: {done.stderr.strip().splitlines()[-1]}")
    return cubin, resources(done.stderr)


def resources(ptxas_log: str) -> dict:
    """Registers, spill stores/loads (bytes), stack frame (bytes), static shared memory (bytes), barriers."""
    def number(pattern, default=0):
        found = re.search(pattern, ptxas_log)
        return int(found.group(1)) if found else default

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared_static": number(r"(\d+) bytes smem"), "barriers": number(r"used (\d+) barriers")}


def disassemble(cubin: Path, found: dict) -> str:
    done = subprocess.run([found["nvdisasm"], "-c", str(cubin)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"nvdisasm failed on {cubin.name}: {done.stderr.strip()}")
    return done.stdout


def parse(sass: str) -> tuple[list[dict], dict]:
    """(instructions [{"address", "opcode", "operands"}], {label: address})."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.search(line)
        if found:
            address = int(found.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append({"address": address, "opcode": found.group(3), "operands": found.group(4)})
    return instructions, labels


def loops(instructions: list[dict], labels: dict) -> list[tuple[int, int]]:
    """(first address, last address) of every loop: a branch back to a label at or above it."""
    ends = {}
    for instruction in instructions:
        if instruction["opcode"].startswith("BRA"):
            target = TARGET.search(instruction["operands"])
            if target and labels.get(target.group(1), 1 << 40) <= instruction["address"]:
                start = labels[target.group(1)]
                ends[start] = max(ends.get(start, 0), instruction["address"])
    return sorted((start, end) for start, end in ends.items() if end > start)    # not the BRA-to-itself after EXIT


def innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]


def mix(body: list[dict]) -> dict:
    """Counts of the instruction kinds of the module docstring in ``body``."""
    def count(test):
        return sum(1 for instruction in body if test(instruction["opcode"], instruction["operands"]))

    return {
        "instructions": count(lambda op, _: not op.startswith("NOP")),
        "ffma": count(lambda op, _: op.startswith("FFMA")),
        "fp32_other": count(lambda op, _: op.split(".")[0] in ("FADD", "FMUL", "FMNMX", "FSETP", "FSEL")),
        "lds": count(lambda op, _: op.startswith("LDS")),
        "ldg": count(lambda op, _: op.startswith("LDG") or op.split(".")[0] == "LD"),
        "ldl": count(lambda op, _: op.startswith("LDL")),
        "stl": count(lambda op, _: op.startswith("STL")),
        "divisions_32": count(lambda op, _: op.startswith("I2F") and ".RP" in op),
        "divisions_64": count(lambda op, operands: op.startswith("CALL") and re.search(r"div|rem", operands)),
        "atomics_global": count(lambda op, _: op.split(".")[0] in ("ATOM", "ATOMG", "RED", "REDG")),
        "atomics_shared": count(lambda op, _: op.split(".")[0] == "ATOMS"),
        "sts": count(lambda op, _: op.startswith("STS")),
        "barriers": count(lambda op, _: op.startswith("BAR")),
        "branches": count(lambda op, _: op.startswith("BRA")),
    }


def loop_mix(sass: str) -> dict:
    """What the SASS says: {"kernel": mix of every instruction, "hot": the hot loop's mix (None without a
    loop), "in_loops": mix of every instruction inside some loop, "inner_loops": [mix of each innermost
    loop, in address order], "loops": how many loops, "main_own": the mix of the outermost loop around
    the hot one, without the loops inside it (None when the hot loop is outermost or there is none),
    "hot_sass": the hot loop's instructions as text}."""
    instructions, labels = parse(sass)
    spans = loops(instructions, labels)
    bodies = [[i for i in instructions if a <= i["address"] <= b] for a, b in innermost(spans)]
    in_loops = [i for i in instructions if any(a <= i["address"] <= b for a, b in spans)]
    hot = max(bodies, key=lambda body: (mix(body)["ffma"], len(body))) if bodies else None
    main = None
    if hot:                                    # the outermost loop around the hot one: a tiled product's k loop
        first, last = hot[0]["address"], hot[-1]["address"]
        a, b = min(((a, b) for a, b in spans if a <= first and last <= b), key=lambda span: span[0])
        nested = [(c, d) for c, d in spans if a < c and d <= b or a <= c and d < b]
        if nested:
            main = mix([i for i in instructions if a <= i["address"] <= b
                        and not any(c <= i["address"] <= d for c, d in nested)])
    return {"kernel": mix(instructions), "hot": mix(hot) if hot else None, "in_loops": mix(in_loops),
            "inner_loops": [mix(body) for body in bodies], "loops": len(spans), "main_own": main,
            "hot_sass": [f"{i['opcode']}{i['operands']}".strip() for i in hot] if hot else []}

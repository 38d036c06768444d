"""Every kernel program compiled to a cubin by NVRTC alone: no GPU, no CUDA driver, no toolkit.

CuPy's own ``compile_using_nvrtc`` asks the driver for the device's architecture; the thin NVRTC
binding under it (``cupy_backends.cuda.libs.nvrtc``: ``createProgram``, ``compileProgram``,
``getCUBIN``) needs only ``libnvrtc``, which the ``nvidia-cuda-nvrtc`` wheel ships outside the
loader's search path (``site-packages/nvidia/cu13/lib``). ``load_library`` finds it there and loads
it (and its builtins) globally before the binding's first call opens it by soname.

``compile_program(program, arch)`` returns the cubin and NVRTC's log, with ptxas's resource report
(registers, spills, stack) per kernel; ``python -m zfunc.ops.gpu.nvrtc [sm_90]`` prints a table of
every entry point. ``tests/test_gpu_compile.py`` (not marked gpu: CI runs it) compiles every
program for sm_90 and checks that every entry point the dispatcher can pick is in its cubin.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass

from zfunc.ops.gpu import program as prog

ARCH = "sm_90"  # Hopper: the H100 and H200 the GPU checks run on
_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12")


def library_dirs() -> list[str]:
    """Folders of the ``nvidia-cuda-nvrtc`` wheel's libraries in this environment (CUDA 13's
    ``nvidia/cu13/lib``, CUDA 12's ``nvidia/cuda_nvrtc/lib``), where they exist."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec is not None and spec.submodule_search_locations else []
    found = []
    for root in roots:
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            path = os.path.join(root, sub)
            if glob.glob(os.path.join(path, "libnvrtc.so*")):
                found.append(path)
    return found


_loaded: str | None = None


def load_library() -> str:
    """Load ``libnvrtc`` globally (the loader's search path first, then the wheel's folder) and
    return where it came from; OSError naming what was tried where none loads."""
    global _loaded
    if _loaded is not None:
        return _loaded
    tried = []
    for soname in _SONAMES:
        try:
            ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
            _loaded = soname
            return soname
        except OSError as e:
            tried.append(f"{soname}: {e}")
    for folder in library_dirs():
        # the builtins first: libnvrtc opens them by soname when it compiles
        libs = sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))) + sorted(
            p for p in glob.glob(os.path.join(folder, "libnvrtc.so*")) if "alt" not in os.path.basename(p))
        for path in libs:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                tried.append(f"{path}: {e}")
        if any(os.path.basename(p).startswith("libnvrtc.so") for p in libs):
            _loaded = folder
            return folder
    raise OSError("libnvrtc: not found; pip install nvidia-cuda-nvrtc (tried " + "; ".join(tried) + ")")


def _binding():
    load_library()
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    return tuple(_binding().getVersion())


@dataclass(frozen=True)
class Compiled:
    """One program's cubin, NVRTC's log and the seconds the compile took."""

    name: str
    arch: str
    cubin: bytes
    log: str
    seconds: float

    def has_entry(self, entry: str) -> bool:
        """Whether kernel ``entry`` is in the cubin (its ``.text.<entry>`` section is named there)."""
        return b".text." + entry.encode() + b"\0" in self.cubin

    def resources(self) -> dict[str, dict[str, int]]:
        """ptxas's report per kernel (``--ptxas-options=-v``): registers, spill bytes, stack bytes."""
        found: dict[str, dict[str, int]] = {}
        current = None
        for line in self.log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = found.setdefault(m.group(1), {})
                continue
            if current is None:
                continue
            for key, pattern in (("registers", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                                 ("spill_stores", r"(\d+) bytes spill stores"),
                                 ("spill_loads", r"(\d+) bytes spill loads")):
                m = re.search(pattern, line)
                if m:
                    current[key] = int(m.group(1))
        return found


def compile_program(program: prog.Program, arch: str = ARCH, report: bool = True) -> Compiled:
    """``program`` compiled by NVRTC for ``arch`` (e.g. ``sm_90``) with ``program.OPTIONS``; ptxas's
    resource report in the log where ``report``. RuntimeError with NVRTC's log where it fails."""
    nvrtc = _binding()
    options = [*prog.OPTIONS, f"--gpu-architecture={arch}"] + (["--ptxas-options=-v"] if report else [])
    handle = nvrtc.createProgram(program.source, f"{program.name}.cu", [], [])
    start = time.perf_counter()
    try:
        try:
            nvrtc.compileProgram(handle, options)
        except Exception as e:
            raise RuntimeError(f"NVRTC could not compile program {program.name!r} for {arch}: {e}\n"
                               f"{nvrtc.getProgramLog(handle)}") from e
        seconds = time.perf_counter() - start
        return Compiled(program.name, arch, bytes(nvrtc.getCUBIN(handle)), nvrtc.getProgramLog(handle), seconds)
    finally:
        nvrtc.destroyProgram(handle)


def compile_all(arch: str = ARCH) -> list[Compiled]:
    """Every program (``program.every()``) compiled for ``arch``."""
    return [compile_program(p, arch) for p in prog.every()]


def cache_dir() -> str:
    """Where compiled cubins are kept between processes: ``ZFUNC_KERNEL_CACHE``, else
    ``~/.cache/zfunc/kernels``."""
    return os.environ.get("ZFUNC_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zfunc", "kernels")


def cubin(program: prog.Program, arch: str) -> bytes:
    """``program``'s cubin for ``arch`` (``sm_90``), compiled as ``compile_program`` compiles it (the
    options CI checks), read from ``cache_dir()`` where an earlier process left it (keyed by the
    source, the options, the architecture and NVRTC's version), else compiled and left there."""
    options = (*prog.OPTIONS, arch, ".".join(map(str, version())))
    key = hashlib.sha256("\0".join((program.source, *options)).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"{program.name}-{arch}-{key}.cubin")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    data = compile_program(program, arch, report=False).cubin
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
    except OSError:
        pass  # no cache where the folder cannot be written: compiled again next time
    return data


def main(argv: list[str]) -> int:
    arch = argv[0] if argv else ARCH
    print(f"NVRTC {'.'.join(map(str, version()))} ({load_library()}), {arch}")
    print(f"{'program':10} {'entry':28} {'regs':>5} {'spill':>6} {'stack':>6}")
    for program in prog.every():
        c = compile_program(program, arch)
        res = c.resources()
        for entry in program.every_entry:
            r = res.get(entry, {})
            spill = r.get("spill_stores", 0) + r.get("spill_loads", 0)
            print(f"{c.name:10} {entry:28} {r.get('registers', '?'):>5} {spill:>6} {r.get('stack', '?'):>6}")
        print(f"{c.name:10} {'cubin':28} {len(c.cubin):>5} bytes in {c.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

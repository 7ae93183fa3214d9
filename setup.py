"""Build OSDP: the Python packages plus native modules built by CMake.

Environment flags:
  OSDP_SKIP_CUDA=1     do not build the CUDA split-matmul kernels
  OSDP_BUILD_JOBS=N    parallel build jobs (default: capped by cores and memory)
A machine without nvcc builds everything else and prints a warning.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _build_jobs() -> int:
    if os.environ.get("OSDP_BUILD_JOBS"):
        return max(1, int(os.environ["OSDP_BUILD_JOBS"]))
    cores = os.cpu_count() or 1
    try:  # about 2 GiB per nvcc/g++ job keeps small machines out of swap
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return max(1, min(cores, int(mem_gib // 2)))
    except (ValueError, OSError, AttributeError):
        return cores


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build the whole CMake project once, for every CMakeExtension."""

    def run(self):
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        # Modules land next to their package sources for editable installs and are
        # copied into build_lib for wheel installs.
        out_osdp = Path(self.get_ext_fullpath("osdp._C")).resolve().parent
        out_kernels = out_osdp.parent / "osdp_kernels"
        if self.inplace:
            out_osdp, out_kernels = ROOT / "osdp", ROOT / "osdp_kernels"
        out_kernels.mkdir(parents=True, exist_ok=True)
        import pybind11

        cfg = [
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DOSDP_OUTPUT_DIR={out_osdp}",
            f"-DOSDP_KERNELS_OUTPUT_DIR={out_kernels}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_temp), *cfg])
        subprocess.check_call(
            ["cmake", "--build", str(build_temp), "-j", str(_build_jobs())]
        )


setup(
    name="osdp",
    version="0.1.0",
    description="Optimal Sharded Data Parallel: per-operator dp/zdp sharding and operator splitting for PyTorch",
    packages=find_packages(include=["osdp", "osdp.*", "osdp_kernels", "osdp_kernels.*"]),
    package_data={"osdp": ["profiles/*.json", "configs/hf/*.json", "configs/hf/README.md"]},
    ext_modules=[CMakeExtension("osdp._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "numpy<2.4", "triton==3.6.0", "transformers==5.23.0", "peft==0.21.2"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["osdp=osdp.cli:main"]},
)

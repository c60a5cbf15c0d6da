"""Build of trace_ext: the pure-Python package, plus the CUDA extension trace_ext._C when it can be built.

Variables:
  TRACE_EXT_CUDA_ARCHS       targets, ';'-separated (default "9.0a;10.0a"). We pass explicit -gencode flags,
                             which (as torch documents) makes TORCH_CUDA_ARCH_LIST irrelevant.
  TRACE_EXT_SKIP_CUDA_BUILD  "1" installs the pure-Python package only (reference path).
  TRACE_EXT_CUTLASS_DIR      a CUTLASS checkout; else third_party/cutlass; else the pinned nvidia-cutlass wheel.
  MAX_JOBS                   parallel nvcc jobs (honoured by torch's ninja build).
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
DEFAULT_ARCHS = "9.0a;10.0a"
CONFIG_PATH = ROOT / "python" / "trace_ext" / "_build_config.py"


def log(msg: str) -> None:
    print(f"[trace_ext build] {msg}", flush=True)


def want_cuda_build() -> tuple[bool, str]:
    if os.environ.get("TRACE_EXT_SKIP_CUDA_BUILD", "0") == "1":
        return False, "TRACE_EXT_SKIP_CUDA_BUILD=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False, "torch is not importable at build time"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None and shutil.which("nvcc") is None:
        return False, "nvcc not found (set CUDA_HOME)"
    return True, ""


def find_cutlass() -> tuple[Path, str]:
    """(include root holding cutlass/ and cute/, where it came from), in the documented order."""
    env = os.environ.get("TRACE_EXT_CUTLASS_DIR")
    if env:
        p = Path(env)
        if not (p / "include" / "cutlass" / "cutlass.h").exists():
            raise RuntimeError(f"TRACE_EXT_CUTLASS_DIR={env} has no include/cutlass/cutlass.h")
        return p, "TRACE_EXT_CUTLASS_DIR"
    vendored = ROOT / "third_party" / "cutlass"
    if (vendored / "include" / "cutlass" / "cutlass.h").exists():
        return vendored, "third_party/cutlass"
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")  # locate only: importing it pulls in its generator's deps
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"CUTLASS not found: set TRACE_EXT_CUTLASS_DIR, vendor third_party/cutlass, or `pip install {CUTLASS_PIN}`"
        )
    p = Path(list(spec.submodule_search_locations)[0]).resolve() / "source"
    if not (p / "include" / "cutlass" / "cutlass.h").exists():
        raise RuntimeError(f"the installed nvidia-cutlass wheel has no headers under {p}")
    return p, f"pip {CUTLASS_PIN}"


def cutlass_version(root: Path) -> str:
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = []
    for key in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"):
        for line in text.splitlines():
            if line.startswith(f"#define {key} "):
                parts.append(line.split()[2])
    return ".".join(parts)


def cudart_library_dirs() -> list[str]:
    """Where -lcudart resolves. torch looks in $CUDA_HOME/lib64 only; toolkits that put nvcc in /usr/local/bin
    (CUDA_HOME=/usr/local) keep libcudart.so under /usr/local/cuda/lib64 or lib."""
    from torch.utils.cpp_extension import CUDA_HOME

    for d in (f"{CUDA_HOME}/lib64", f"{CUDA_HOME}/lib", "/usr/local/cuda/lib64", "/usr/local/cuda/lib"):
        if os.path.exists(os.path.join(d, "libcudart.so")):
            log(f"libcudart from {d}")
            return [d]
    return []


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        num = a.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def write_build_config(config: dict) -> None:
    CONFIG_PATH.write_text("# written by setup.py; do not edit\nCONFIG = " + repr(config) + "\n")


def extensions():
    ok, why = want_cuda_build()
    if not ok:
        log(f"building the pure-Python package only: {why}")
        write_build_config({"cuda_archs": [], "cutlass": None, "skipped": why})
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs = [a.strip() for a in os.environ.get("TRACE_EXT_CUDA_ARCHS", DEFAULT_ARCHS).split(";") if a.strip()]
    cutlass_root, cutlass_from = find_cutlass()
    cver = cutlass_version(cutlass_root)
    log(f"CUDA archs: {';'.join(archs)}")
    log(f"CUTLASS {cver} from {cutlass_from}: {cutlass_root}")
    log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(torch default)')}")
    write_build_config({"cuda_archs": archs, "cutlass": {"version": cver, "source": cutlass_from, "path": str(cutlass_root)}})

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu"))
    includes = [
        str(ROOT / "csrc" / "include"),
        str(cutlass_root / "include"),
        str(cutlass_root / "tools" / "util" / "include"),
    ]
    nvcc = [
        "-O3",
        "-DNDEBUG",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-lineinfo",
        # CUTLASS/CuTe need the half / bfloat16 operators torch's default flags switch off
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        # no --use_fast_math anywhere: the quantizers must be IEEE-exact (SPEC preamble)
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        "-fmad=true",
    ] + gencode_flags(archs)
    # stringified in host_checks.h; no quotes or ';' because ninja hands the flags to a shell
    archs_define = "-DTRACE_EXT_ARCHS=" + "/".join("sm_" + a.replace(".", "") for a in archs)
    ext = CUDAExtension(
        library_dirs=cudart_library_dirs(),
        name="trace_ext._C",
        sources=sources,
        include_dirs=includes,
        extra_compile_args={"cxx": ["-O3", "-std=c++20", archs_define], "nvcc": nvcc + [archs_define]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()

setup(
    name="trace_ext",
    version="0.1.0",
    description="FP4 kernels and train-rollout quantization alignment (TRACE) for MoE RL",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "safetensors", "tqdm"],
    extras_require={"hf": ["transformers>=4.57"], "test": ["pytest", "transformers>=4.57", "matplotlib"]},
)

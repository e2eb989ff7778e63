"""Builds poss_ext._C (CPU kernels always; CUDA kernels when asked for or a GPU is visible).

Environment:
  POSS_CUDA=1 / 0        force the CUDA kernels on / off (default: on when torch is a CUDA build,
                         nvcc is found and a GPU is visible)
  TORCH_CUDA_ARCH_LIST   CUDA architectures, default "8.0;9.0"
  CUDA_HOME              CUDA toolkit root, default /usr/local/cuda when it holds nvcc
  MAX_JOBS               parallel compile jobs (ninja)
"""

import glob
import json
import os
import platform
import subprocess
import sysconfig
import tempfile

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # cpp_extension reads it at import time
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def want_cuda() -> bool:
    flag = os.environ.get("POSS_CUDA", "")
    have_nvcc = cpp_extension.CUDA_HOME is not None and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    if flag == "0":
        return False
    if flag == "1":
        if torch.version.cuda is None:
            raise RuntimeError("POSS_CUDA=1 but the installed torch is not a CUDA build")
        if not have_nvcc:
            raise RuntimeError("POSS_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return True
    return torch.version.cuda is not None and have_nvcc and torch.cuda.is_available()


def cpu_arch_flags() -> list:
    # at::vec picks its SIMD width from CPU_CAPABILITY; AVX2 + FMA runs on every x86-64 server
    # of the last decade. poss_ext checks the running CPU at import.
    if platform.machine() in ("x86_64", "AMD64"):
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def link_flags() -> list:
    """``-fopenmp``, plus ``-Bno-symbolic`` where Python's link line binds a library's calls to its own
    functions (``-Bsymbolic-functions``, as Debian's and Ubuntu's Pythons do).

    Why: on a lent H200 image (Ubuntu's Python 3.12, the image's own GCC) the built library held its
    own copy of libstdc++'s ``ostream::_M_insert<long>``; bound to it, the first error message that
    formats an integer segfaulted (tests/ops/test_linear.py, bad arguments on CUDA). Without the local
    binding that call resolves to the libstdc++ that torch loaded, like every other library's.
    """
    flags = ["-fopenmp"]
    ldshared = os.environ.get("LDSHARED") or sysconfig.get_config_var("LDSHARED") or ""
    if "-Bsymbolic" in ldshared and linker_accepts("-Wl,-Bno-symbolic"):
        flags.append("-Wl,-Bno-symbolic")
    return flags


def linker_accepts(flag: str) -> bool:
    """Whether the C++ compiler links an empty shared library with ``flag`` (GNU ld 2.37+ and lld take
    -Bno-symbolic; older linkers reject it)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [os.environ.get("CXX", "c++"), "-shared", "-x", "c++", os.devnull, "-o", os.path.join(tmp, "t.so"), flag]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def cuda_library_includes() -> list:
    """Headers of the CUDA math libraries (cuSPARSE, cuBLAS...) that torch's headers include.

    A bare toolkit (nvcc only, as on CI) lacks them; torch's pip wheels ship them under nvidia/*/include.
    They go in with -isystem, after the toolkit's own headers.
    """
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for root in nvidia.__path__:
        for inc in glob.glob(os.path.join(root, "*", "include")):
            if os.path.exists(os.path.join(inc, "cusparse.h")):
                found += ["-isystem", inc]
    return found


def extension():
    with_cuda = want_cuda()
    arch_list = os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else ""
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    macros = [
        ("POSS_TORCH_VERSION", json.dumps(torch.__version__)),
        ("POSS_CUDA_ARCH_LIST", json.dumps(arch_list)),
    ]
    cxx = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"] + cpu_arch_flags()
    args = dict(
        name="poss_ext._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        define_macros=macros,
        extra_link_args=link_flags(),
    )
    if not with_cuda:
        return cpp_extension.CppExtension(extra_compile_args={"cxx": cxx}, **args), arch_list
    args["sources"] += sorted(glob.glob("csrc/cuda/*.cu"))
    args["define_macros"] = macros + [("POSS_WITH_CUDA", None)]
    libs = cuda_library_includes()
    cxx += libs
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + libs
    return (
        cpp_extension.CUDAExtension(extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **args),
        arch_list,
    )


class BuildExt(cpp_extension.BuildExtension):
    """Also records, next to the built library, the torch it was built against."""

    def run(self):
        super().run()
        for ext in self.extensions:
            out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            with open(os.path.join(out_dir, "_build_info.json"), "w") as f:
                json.dump({"torch_version": torch.__version__, "cuda_arch_list": ARCH_LIST}, f)


EXT, ARCH_LIST = extension()
# The trained drafts in drafts/ install as data of poss (poss/drafts/<name>/...), where
# poss.models.registry.shipped_draft finds them.
DRAFT_PACKAGE = (["poss.drafts"] if os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafts"))
                 else [])

setup(
    packages=find_packages(include=["poss_ext", "poss_ext.*"])
    + find_packages("python", include=["poss", "poss.*"])
    + DRAFT_PACKAGE,
    package_dir={"poss": "python/poss", **{p: "drafts" for p in DRAFT_PACKAGE}},
    package_data={
        # The six eval prompt sets, their license and data card (poss.data.load_eval_set reads them).
        "poss.data": ["eval/*.jsonl", "eval/LICENSE", "eval/README.md",
                      # the lookup datastores (poss.decode.datastore) and their data card
                      "datastores/*.npz", "datastores/README.md"],
        **{p: ["*/config.json", "*/model.safetensors", "*/README.md", "*/trees.json"] for p in DRAFT_PACKAGE},
    },
    ext_modules=[EXT],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)

#!/usr/bin/env python3
"""Compile a kernel family with NVRTC (no GPU needed) for sm_90, as device.rs does, and print
the resource usage (and optionally SASS). Usage:
  NVRTC=/path/libnvrtc.so.13 CUOBJDUMP=/path/cuobjdump nvrtc_check.py decode.cu "D=128,T=32,..." [--sass]
"""
import ctypes, os, subprocess, sys, tempfile

kdir = os.path.join(os.path.dirname(__file__), "..", "crates", "veloxquant-cuda", "kernels")
lib = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so.13"))
fam, defs = sys.argv[1], sys.argv[2]
src = "".join(f"#define {kv.split('=')[0]} {kv.split('=')[1]}\n" for kv in defs.split(",") if kv)
src += open(os.path.join(kdir, "common.cuh")).read() + open(os.path.join(kdir, fam)).read()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
fmad = "true" if fam != "encode.cu" else "false"
opts = [b"--gpu-architecture=sm_90", b"--std=c++17", f"--fmad={fmad}".encode(), b"--prec-div=true",
        b"--prec-sqrt=true", b"--ftz=false"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode()[-6000:])
if rc != 0:
    sys.exit(f"compile failed rc={rc}")
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cub = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cub)
path = os.path.join(tempfile.gettempdir(), "k.cubin")
open(path, "wb").write(cub.raw)
cu = os.environ.get("CUOBJDUMP", "cuobjdump")
print(subprocess.run([cu, "-res-usage", path], capture_output=True, text=True).stdout)
if "--sass" in sys.argv:
    out = subprocess.run([cu, "-sass", path], capture_output=True, text=True).stdout
    open(os.path.join(tempfile.gettempdir(), "k.sass"), "w").write(out)
    print("sass lines:", out.count("\n"), "->", os.path.join(tempfile.gettempdir(), "k.sass"))

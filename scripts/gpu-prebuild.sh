#!/usr/bin/env bash
# Prepares scripts/gpu-check.sh's GPU_CHECK_PREBUILT directory here, for a GPU machine that has
# a PyTorch but no cargo, no network, and maybe a torch other than the 2.13.0 tch 0.26 is made
# for (this workplace's lent H200s have torch 2.11.0+cu130).
#
#   bash scripts/gpu-prebuild.sh TORCH_DIR OUT_DIR
#
# TORCH_DIR: the `torch` package directory (include/ and lib/) of the GPU machine's torch
# version — e.g. unzipped from the same wheel: `pip download --no-deps torch==2.11.0` then
# `unzip -q torch-2.11.0-*.whl 'torch/lib/*' 'torch/include/*'`. Its lib/ need only exist here
# for the link; on the GPU machine gpu-check.sh points the loader at that machine's own torch.
# The C++ operators of tch's generated binding that this libtorch lacks (tch 0.26 binds 2.13.0's)
# are compiled as stubs that raise an error if called: a copy of torch-sys is patched in a
# temporary workspace copy, never here. BasicNet's operators exist in both.
#
# OUT_DIR gets level1-raw-ddp, level2-accelerator, level3-trainer, ladder-accelerate and
# gpu-tests (shared/tests/gpu.rs's test binary), stripped, built with `--features
# ladder-core/nccl`, and lib/: the shared libraries of Open MPI the binaries load (a GPU image
# may have no Open MPI; at W = 1 MPI is never initialised, but the binaries link it).
# Environment: GPU_PREBUILD_WORK (default target/gpu-prebuild): the workspace copy and its
# target directory, kept between runs so that a rebuild is incremental.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu-prebuild.sh TORCH_DIR OUT_DIR" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
torch=$(cd "$1" 2>/dev/null && pwd) || { echo "gpu-prebuild: $1: no such directory (expected a torch package directory)" >&2; exit 2; }
[ -f "$torch/include/torch/csrc/api/include/torch/torch.h" ] && [ -d "$torch/lib" ] ||
  { echo "gpu-prebuild: $torch is not a torch package directory (no include/torch/csrc/api/include/torch/torch.h or lib/)" >&2; exit 2; }
# OUT_DIR as an absolute path: the build runs in the workspace copy, where a relative one would land.
mkdir -p "$2/lib" && out=$(cd "$2" && pwd) || { echo "gpu-prebuild: $2: cannot create the output directory" >&2; exit 2; }
work=${GPU_PREBUILD_WORK:-$repo/target/gpu-prebuild}
export PATH="$HOME/.cargo/bin:$PATH"
bash "$repo/scripts/bootstrap.sh"
mkdir -p "$work/src"

# The workspace as it stands (uncommitted changes included), without its build outputs.
(cd "$repo" && tar --exclude=./target --exclude=./.venv --exclude=./.git --exclude='./.gpu*' -cf - .) | (cd "$work/src" && tar xf -)
ln -sfn "$(readlink -f "$repo/.venv")" "$work/src/.venv"

# A copy of torch-sys whose generated operators this libtorch lacks are stubs.
sys_src=$(cd "$repo" && cargo metadata --format-version 1 2>/dev/null |
  python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "torch-sys").rsplit("/", 1)[0])')
sys_copy=$work/torch-sys
# The stubbed copy is reused while torch-sys's version, this libtorch's headers and this script
# are the same.
stamp=".for-$(basename "$sys_src")-$(printf '%s %s' "$torch" "$(stat -c %Y "$torch/include")" | md5sum | cut -c1-12)-$(md5sum <"$0" | cut -c1-12)"
if [ ! -f "$sys_copy/$stamp" ]; then
  rm -rf "$sys_copy" && cp -a "$sys_src" "$sys_copy"
  gen=$sys_copy/libtch/torch_api_generated.cpp
  for try in 1 2 3; do
    log=$work/generated.log
    if c++ -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -w -fmax-errors=0 -fsyntax-only -I "$torch/include" -I "$torch/include/torch/csrc/api/include" \
      "$gen" >"$log" 2>&1; then
      break
    fi
    [ "$try" -lt 3 ] || { echo "gpu-prebuild: torch-sys's generated binding still fails against $torch (log: $log)" >&2; exit 1; }
    # Each function with an error gets a body that throws (PROTECT turns it into tch's error).
    python3 - "$gen" "$log" <<'EOF'
import re, sys
gen, log = sys.argv[1:]
bad = sorted({int(m.group(1)) for m in re.finditer(r"torch_api_generated\.cpp:(\d+):\d+: error", open(log).read())})
lines = open(gen).read().split("\n")
stubbed = set()
for n in bad:
    s = n - 1
    while not lines[s].startswith("  PROTECT("):
        if lines[s].startswith(("void atg", "int atg", "int64_t atg", "double atg", "bool atg", "tensor atg")) or s == 0:
            sys.exit(f"gpu-prebuild: line {n} of {gen} is outside an operator's body; cannot stub it")
        s -= 1
    if s in stubbed:
        continue
    e = s + 1
    while lines[e] != "  )":
        e += 1
    lines[s + 1:e] = ['    throw std::runtime_error("this operator is not in the libtorch this binary was built against");'] + [""] * (e - s - 2)
    stubbed.add(s)
open(gen, "w").write("\n".join(lines))
print(f"gpu-prebuild: {len(stubbed)} operators of torch-sys's binding stubbed (absent from this libtorch)")
EOF
  done
  touch "$sys_copy/$stamp"
fi

cd "$work/src"
export LIBTORCH=$torch LIBTORCH_BYPASS_VERSION_CHECK=1 CARGO_TARGET_DIR=$work/target CARGO_PROFILE_RELEASE_DEBUG=false
patch=(--config "patch.crates-io.torch-sys.path=\"$sys_copy\"")
cargo build "${patch[@]}" --release -p level1-raw-ddp -p level2-accelerator -p level3-trainer --features ladder-core/nccl --bins
# The test binary's path from cargo's JSON messages; compiler errors go to stderr as text.
tests=$(cargo test "${patch[@]}" --release -p ladder-core --features nccl --test gpu --no-run --message-format json |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-message": print(m["message"]["rendered"], file=sys.stderr)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu": print(m["executable"])')
[ -n "$tests" ] || { echo "gpu-prebuild: cargo built no gpu test binary (messages above)" >&2; exit 1; }
for b in level1-raw-ddp level2-accelerator level3-trainer ladder-accelerate; do
  cp "$CARGO_TARGET_DIR/release/$b" "$out/$b"
done
cp "$tests" "$out/gpu-tests"
strip "$out"/level1-raw-ddp "$out"/level2-accelerator "$out"/level3-trainer "$out"/ladder-accelerate "$out"/gpu-tests
# Open MPI and what it loads beyond a base system, from the loader's own answer.
LD_LIBRARY_PATH="$torch/lib:$(ls -d "$(readlink -f "$repo/.venv")"/lib/python3*/site-packages/nvidia/*/lib | tr '\n' :)" \
  ldd "$out/level1-raw-ddp" | awk '$3 ~ /^\// {print $3}' | { grep -E '/lib(mpi|open-rte|open-pal|hwloc|event_core|event_pthreads|udev)[.-]' || true; } |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
[ -e "$out/lib/libmpi.so.40" ] || echo "gpu-prebuild: warning: no Open MPI library found through ldd; the GPU machine must have its own" >&2
du -sh "$out"
ls -l "$out" "$out/lib"

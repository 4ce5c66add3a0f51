#!/usr/bin/env bash
# Idempotent set-up for ddp-ladder. Every make target calls it first.
#
#  1. Debian packages: OpenMPI (mpirun + headers), libclang (rsmpi's bindgen), pkg-config, and
#     Slurm with munge (scripts/slurm.sh: the two-host Slurm tests; Debian's slurm-wlm has the
#     mpi/pmix plugin that `srun --mpi=pmix` needs).
#     `apt-get update` runs only when something is missing.
#  2. A Python venv holding torch==2.13.0 — the libtorch that tch 0.26 links against — kept in a
#     per-user cache keyed by the torch version (override with LADDER_VENV), so a fresh clone on the
#     same machine reuses it. `.venv` in the repository is a symlink to it.
#  1b. The rustfmt and clippy components, which `make test` runs first.
#  3. bench/reference needs torchvision (the PyTorch peer scripts); installed beside torch. The
#     tests also need safetensors and tensorboard (its event reader) there.
#  0. Disk, checked first: a clean `make test` leaves about 3 GB in target/ (measured: 3.0 GB;
#     `make build` alone less), and the torch venv takes about 5 GB once; with too little room
#     the linker dies of SIGBUS part-way through a build, so say so before anything is written.
#     Needed: 6 GiB for target/ (what it holds counts), plus 5 GiB while the venv is missing.
#
# When nothing is left to do it returns in well under 5 s.
set -euo pipefail

TORCH_VERSION=2.13.0
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${LADDER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddp-ladder/venv-torch-$TORCH_VERSION}

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- 0. Disk room for target/ (and the venv, while it is missing) ------------------------------
target=${CARGO_TARGET_DIR:-$repo/target}
need_kib=$((6 * 1024 * 1024)) why="for target/"
if [ ! -f "$venv/.ladder-complete" ]; then
  need_kib=$((need_kib + 5 * 1024 * 1024)) why="6 for target/, 5 for the torch venv, not yet installed"
fi
free_kib=$(df -Pk "$repo" | awk 'NR == 2 { print $4 }' || true)
held_kib=0
if [ -d "$target" ]; then
  held_kib=$(du -sk "$target" 2>/dev/null | awk '{ print $1 }' || true)
fi
free_kib=${free_kib:-0} held_kib=${held_kib:-0}
if [ "$free_kib" -gt 0 ] && [ $((free_kib + held_kib)) -lt "$need_kib" ]; then
  log "only $((free_kib / 1024)) MiB free on the disk of $repo ($target holds $((held_kib / 1024)) MiB):"
  log "the build needs about $((need_kib / 1024 / 1024)) GiB there ($why);"
  log "free some (e.g. cargo clean in an old clone) and rerun"
  exit 1
fi

# --- 1. Debian packages -------------------------------------------------------------------------
pkgs=(openmpi-bin libopenmpi-dev libclang-dev pkg-config slurm-wlm munge)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  log "installing Debian packages: ${missing[*]}"
  aptlog=$(mktemp)
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
        -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1; then
    cat "$aptlog" >&2; log "apt-get failed (log above)"; exit 1
  fi
  rm -f "$aptlog"
fi

# --- 1b. rustfmt and clippy (`make test` checks style first) ------------------------------------
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  log "adding the rustfmt and clippy components (rustup)"
  rustup component add rustfmt clippy >&2 || { log "rustup could not add rustfmt/clippy: install them for this toolchain"; exit 1; }
fi

# --- 2. Python venv with torch ------------------------------------------------------------------
stamp="$venv/.ladder-complete"
if [ ! -f "$stamp" ]; then
  py=${PYTHON:-python3}
  log "creating $venv with torch==$TORCH_VERSION (about 4.7 GB; once per machine)"
  mkdir -p "$(dirname "$venv")"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" torchvision
  "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
  touch "$stamp"
fi
# safetensors: the tests load the checkpoints' model.safetensors into PyTorch's BasicNet.
if [ ! -d "$(ls -d "$venv"/lib/python3*/site-packages/safetensors 2>/dev/null | head -n 1)" ]; then
  log "installing safetensors into $venv"
  "$venv/bin/python" -m pip install -q safetensors
fi
# tensorboard: the tests read the levels' event files back with its EventAccumulator.
if [ ! -d "$(ls -d "$venv"/lib/python3*/site-packages/tensorboard 2>/dev/null | head -n 1)" ]; then
  log "installing tensorboard into $venv"
  "$venv/bin/python" -m pip install -q tensorboard
fi
# A stable name for the libtorch inside the wheel (.cargo/config.toml points LIBTORCH at it).
if [ ! -e "$venv/libtorch/lib/libtorch_cpu.so" ]; then
  site=$(cd "$venv" && ls -d lib/python3*/site-packages/torch | head -n 1)
  [ -n "$site" ] || { log "torch not found under $venv/lib"; exit 1; }
  ln -sfn "$site" "$venv/libtorch"
fi
# .venv in the repository points at the shared venv (a real directory there is left alone).
if [ ! -e "$repo/.venv" ] || [ -L "$repo/.venv" ]; then
  [ "$(readlink "$repo/.venv" 2>/dev/null)" = "$venv" ] || ln -sfn "$venv" "$repo/.venv"
fi

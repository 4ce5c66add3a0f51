#!/usr/bin/env bash
# Installs mdBook once (cached in ~/.cargo/bin), for `make book` and `make test`.
# Idempotent: does nothing when `mdbook --version` already reports the pinned version.
# The version is pinned so the book builds the same everywhere; 0.5.4 needs rustc >= 1.88.
set -euo pipefail
MDBOOK_VERSION="${MDBOOK_VERSION:-0.5.4}"
export PATH="$HOME/.cargo/bin:$PATH"
if command -v mdbook >/dev/null 2>&1 && [[ "$(mdbook --version 2>/dev/null)" == "mdbook v${MDBOOK_VERSION}" ]]; then
    exit 0
fi
echo "ensure-mdbook: installing mdbook ${MDBOOK_VERSION} from crates.io (once; a few minutes on 2 cores)" >&2
cargo install mdbook --version "${MDBOOK_VERSION}" --locked --quiet
mdbook --version

# Sourced by scripts/demo and scripts/test: create or refresh .venv at the repository root.
# Re-installs only when requirements.txt or pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stamp=.venv/.dstrain-installed
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up .venv (torch CPU/CUDA per requirements.txt, deepspeed, transformers, datasets)..."
  # pip's output goes to a log, shown only if the install fails, so that test output stays readable.
  if ! { .venv/bin/python -m pip install --quiet --upgrade pip && .venv/bin/python -m pip install --quiet -r requirements.txt; } \
      > .venv/pip.log 2>&1; then
    tail -50 .venv/pip.log >&2
    echo "error: pip install -r requirements.txt failed (full log: .venv/pip.log)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1

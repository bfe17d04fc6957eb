# Sourced: export UV_PYTHON as the path of a working Python 3.12 unless already set.
# (pyenv shims only answer when that version is selected, so try real paths too.)
if [ -z "${UV_PYTHON:-}" ]; then
  for c in "$(command -v python3.12 || true)" /usr/bin/python3.12 /usr/local/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      export UV_PYTHON="$c"
      break
    fi
  done
fi
if [ -z "${UV_PYTHON:-}" ]; then
  echo "no Python 3.12 found: install one (or set UV_PYTHON to its path)" >&2
  return 1 2>/dev/null || exit 1
fi

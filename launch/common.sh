# Shared by the launch scripts: find the project root and the Python to run.
TANDEM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$TANDEM_ROOT"
if [ -n "${TANDEM_PYTHON:-}" ]; then
  PY=("$TANDEM_PYTHON")
elif [ -x "$TANDEM_ROOT/.venv/bin/python" ]; then
  PY=("$TANDEM_ROOT/.venv/bin/python")
else
  PY=(uv run --frozen python)
fi
export PYTHONUNBUFFERED=1
# parse --host/--port/--pub-port into Hydra overrides; everything else passes through
TANDEM_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --host) TANDEM_ARGS+=("transport.host=$2"); shift 2 ;;
    --port) TANDEM_ARGS+=("transport.port=$2"); shift 2 ;;
    --pub-port) TANDEM_ARGS+=("transport.pub_port=$2"); shift 2 ;;
    --gpus) TANDEM_ARGS+=("gpus=$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) TANDEM_ARGS+=("$1"); shift ;;
  esac
done

#!/usr/bin/env bash
# Regenerates rollout_pb2.py / rollout_pb2.pyi / rollout_pb2_grpc.py from rollout.proto.
# The generated files are committed; run this after editing the .proto:
#   bash scalerl_jax/protocol/gen_proto.sh            # writes next to rollout.proto
#   OUT_DIR=/tmp/x bash scalerl_jax/protocol/gen_proto.sh   # writes elsewhere (used by the tests)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT="${OUT_DIR:-$HERE}"
mkdir -p "$OUT"
cd "$HERE"
"$PY" -m grpc_tools.protoc -I. --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  rollout.proto
# Package-relative import so the stubs work from the installed package, not only from this folder.
sed -i 's/^import rollout_pb2 as rollout__pb2$/from . import rollout_pb2 as rollout__pb2/' \
  "$OUT/rollout_pb2_grpc.py"
grep -q '^from . import rollout_pb2 as rollout__pb2$' "$OUT/rollout_pb2_grpc.py"
echo "regenerated in $OUT: rollout_pb2.py rollout_pb2.pyi rollout_pb2_grpc.py"

#!/usr/bin/env bash
# Regenerates rollout_pb2.py / rollout_pb2_grpc.py / rollout_pb2.pyi from rollout.proto.
# The generated files are committed; run this after editing the .proto:
#   bash scalerl_jax/rollout/gen_proto.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
cd "$HERE"
"$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. rollout.proto
# Package-relative import so the stubs work from the installed package, not only from this folder.
sed -i 's/^import rollout_pb2 as rollout__pb2$/from . import rollout_pb2 as rollout__pb2/' rollout_pb2_grpc.py
grep -q '^from . import rollout_pb2 as rollout__pb2$' rollout_pb2_grpc.py
echo "regenerated: $(ls rollout_pb2*.py*)"

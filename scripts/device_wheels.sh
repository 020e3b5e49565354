#!/usr/bin/env bash
# Fill .whl/ (ignored by git; or the folder given as the argument) with the wheels the device check needs
# beyond the bare GPU machine's image: requirements/device.txt, as CPython 3.12 manylinux x86_64 wheels
# (or pure-Python ones), without dependencies. Run it where PyPI is reachable, then carry .whl to the GPU
# machine with the working tree and run scripts/device_check.sh there.
#
#   scripts/device_wheels.sh [DIR]
#
# Idempotent: every run downloads into a fresh temporary folder and replaces DIR's wheels only when the
# set is complete and within the size limit (20 MB: the tree and .whl travel in 64 MiB together), so DIR
# holds exactly the pinned wheels. Prints every file and the total size.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
REQ=requirements/device.txt
LIMIT_BYTES=$((20 * 1000 * 1000))
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
fi
case "$DEST" in
  ""|/|.|..) echo "device_wheels: refusing to replace '$DEST'; name a folder of its own" >&2; exit 2 ;;
esac
if [ -e "$DEST" ] && find "$DEST" -mindepth 1 ! -name '*.whl' | grep -q .; then
  echo "device_wheels: $DEST holds files other than wheels; refusing to replace it" >&2
  exit 2
fi
stage=$(mktemp -d "${TMPDIR:-/tmp}/device-wheels.XXXXXX")
trap 'rm -rf -- "$stage"' EXIT
# The target is the GPU machine, not this one: CPython 3.12 on manylinux x86_64, binary wheels only.
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --dest "$stage" -r "$REQ"
total=0
count=0
for f in "$stage"/*.whl; do
  [ -e "$f" ] || { echo "device_wheels: pip downloaded no wheel into $stage" >&2; exit 1; }
  size=$(stat -c %s -- "$f")
  total=$((total + size))
  count=$((count + 1))
  printf '%10d  %s\n' "$size" "$(basename -- "$f")"
done
wanted=$(grep -cE '^[A-Za-z0-9]' "$REQ")
if [ "$count" -ne "$wanted" ]; then
  echo "device_wheels: $count wheel(s) for $wanted pin(s) of $REQ" >&2
  exit 1
fi
printf '%10d  total (%d wheel(s); limit %d)\n' "$total" "$count" "$LIMIT_BYTES"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "device_wheels: $total bytes exceed the $LIMIT_BYTES-byte limit; $DEST left as it was" >&2
  exit 1
fi
rm -rf -- "$DEST"
mkdir -p -- "$DEST"
mv -- "$stage"/*.whl "$DEST"/
echo "device_wheels: $DEST ready; carry it to the GPU machine with the working tree" >&2

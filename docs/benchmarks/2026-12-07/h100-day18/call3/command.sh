# call 3 (held after call 2), tree 34ed986
export LIMIT=200; set -uo pipefail; ROOT=/tmp/r3; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,80p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b
b 8g-uniform-direct 8GiB uniform /tmp/pkg; hd u-hybrid-5; b 8g-uniform-direct-2 8GiB uniform /tmp/pkg
el end
